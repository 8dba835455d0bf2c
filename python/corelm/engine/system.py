"""What `corelm info` shows, gathered in the engine layer: the CPU and its features, the kernel table
the C++ core chose, the topology (packages, NUMA nodes, cores, caches), the thread plan, where a NUMA
policy puts threads and weights, and a model's shape.

    info = system_info(threads=8, numa="distribute")   # the dict `corelm info --json` prints
    info["model"] = model_info("model.gguf")

The topology comes from the C++ core, which is the one reader of sysfs (`_core.topology(root)`);
`root` points it at a recorded tree (tests/data/topology/). Without a built core the rest is still
described, with the CPU's features from /proc/cpuinfo.
"""
from __future__ import annotations

import importlib
import math
import os
import platform
from typing import Any, Dict, List, Optional

from .. import __version__, loader
from .model_builder import (AUTO_ACTIVATIONS, default_max_seq_len, default_pin_threads, kv_bytes_per_token,
                            planned_storage)

# /proc/cpuinfo flags worth showing when the C++ core (which reports its own view) is not built.
_INTERESTING_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                      "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8",
                      "amx_bf16", "asimd", "asimddp", "sve", "sve2", "i8mm", "bf16")


def _core():
    """corelm._core, imported when asked so that a missing or broken build only loses its own part."""
    return importlib.import_module("corelm._core")


def _cpuinfo_field(name: str) -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def _core_info() -> Dict[str, Any]:
    """What the C++ core detected and chose; {"error": ...} when it cannot be imported."""
    try:
        return dict(_core().cpu_info())
    except Exception as e:   # a diagnostics command should describe a broken build, not die of it
        return {"error": f"corelm._core is not available ({type(e).__name__}: {e})"}


def topology_info(root: Optional[str] = None, threads: Optional[int] = None,
                  numa: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The C++ core's view of the CPU topology (sysfs below root, default this machine) with the
    thread plan for `threads` (default: the default count) under the NUMA policy `numa` under
    "thread_plan", and the plan's (node, threads) shares under "numa"; None without the core."""
    try:
        core = _core()
        topo = dict(core.topology(root))
        numa_plan = dict(core.numa_plan(threads, root, numa=numa))
        plan = list(numa_plan["thread_cpus"])
    except Exception:   # not built, or a core that predates the topology: info still describes the rest
        return None
    topo["numa"] = {"policy": numa or "default", "shares": [list(s) for s in numa_plan["shares"]]}
    cpus = {c["id"]: c for c in topo["cpus"]}
    topo["thread_plan"] = [dict(thread=i, cpu=cpu, **{k: cpus[cpu][k] for k in ("core", "node", "type")})
                           if cpu in cpus else dict(thread=i, cpu=-1) for i, cpu in enumerate(plan)]
    return topo


def numa_split(model: Dict[str, Any], shares: List[List[int]]) -> Dict[str, List[List[int]]]:
    """Where a model's layer matrices and lm_head would go under a plan's (node, threads) shares:
    {matrix: [[node, first row, end row], ...]}, cut as the engine cuts them. `model` has model_info's keys."""
    core = _core()
    hd, d, f = model["head_dim"], model["hidden_size"], model["intermediate_size"]
    rows = {"wqkv": (model["heads"] + 2 * model["kv_heads"]) * hd, "wo": d, "w_gate_up": 2 * f, "w_down": d,
            "lm_head": model["vocab_size"]}
    return {name: [list(r) for r in core.numa_split(n, core.numa_row_grain(name, hd), [tuple(s) for s in shares])]
            for name, n in rows.items()}


def system_info(threads: Optional[int] = None, numa: Optional[str] = None,
                root: Optional[str] = None) -> Dict[str, Any]:
    """The machine as corelm sees it (the keys of `corelm info --json`): versions, CPU, cores, memory,
    features and kernels, and with the core built, the topology with the thread plan for `threads`
    under `numa` (read below `root`, default this machine)."""
    try:
        import psutil
        physical, logical = psutil.cpu_count(logical=False), psutil.cpu_count(logical=True)
        vm = psutil.virtual_memory()
        memory = {"total_bytes": int(vm.total), "available_bytes": int(vm.available)}
    except ImportError:
        physical, logical, memory = None, os.cpu_count(), {}
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    core = _core_info()
    topo = topology_info(root, threads=threads, numa=numa) if "error" not in core else None
    info: Dict[str, Any] = {
        "corelm_version": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"model": core.get("brand") or _cpuinfo_field("model name") or platform.processor() or None,
                "arch": platform.machine(), "physical_cores": physical, "logical_cores": logical,
                "usable_cores": usable, "numa_nodes": len(topo["nodes"]) if topo else None},
        "memory": memory,
    }
    if topo:
        info["thread_plan"] = topo.pop("thread_plan")
        info.update(topology=topo, pin_threads=default_pin_threads())
    if "error" in core:
        flags = set((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())
        info.update(features=[f for f in _INTERESTING_FLAGS if f in flags], features_source="/proc/cpuinfo",
                    kernels=None, core_error=core["error"])
    else:
        info.update(features=list(core.get("features", [])), features_source="corelm._core",
                    kernels=dict(core.get("kernels", {})),
                    core={k: v for k, v in core.items() if k not in ("brand", "features", "kernels")})
    return info


def model_info(model: str) -> Dict[str, Any]:
    """A model's hyper-parameters from its files; weights are not read, the engine is not built."""
    loaded = loader.load_model(model)
    spec = loaded.spec
    n_params = sum(math.prod(shape) for shape in loader.weight_shapes(spec).values())
    return {
        "path": loaded.source or model, "format": loaded.source_format, "description": loaded.description,
        "architecture": spec.arch, "parameters": int(n_params), "layers": spec.num_layers,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        # mixture of experts: the experts of each layer and how many each token uses (0, 0: dense MLPs;
        # intermediate_size is then an expert's)
        "experts": spec.num_experts, "experts_used": spec.num_experts_used,
        "heads": spec.num_heads, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size, "context_length": spec.max_position_embeddings,
        # what chat, generate, serve and batch run with by default (-c/--ctx-size 0), and how the
        # default dtype ("auto") stores the matrices
        "default_context": default_max_seq_len(spec), "matrices_stored_as": planned_storage(loaded),
        "default_activations": AUTO_ACTIVATIONS,
        # KV cache bytes per token by --kv-cache-dtype, dense and at --kv-sparsity 0.5
        "kv_bytes_per_token": {kv: {str(s): kv_bytes_per_token(spec, kv, s) for s in (0.0, 0.5)}
                               for kv in ("fp32", "bf16", "int8")},
        "rope_theta": spec.rope_theta, "tie_word_embeddings": spec.tie_word_embeddings,
        "chat_template": bool(loaded.chat_template),
        "storage": storage_info(loaded),
    }


def storage_info(loaded) -> Optional[Dict[str, Any]]:
    """A corelm folder's tensors as stored (None for other models, whose storage the dtype decides at load):
    the bytes a decoded token reads (every tensor but the embedding table, of which it reads one row; MoE
    experts at the share a token uses), and each sparse matrix's shape, format, bytes (and its dense format's)
    and fraction of zeros."""
    from ..loader.corelm_format import TYPES, bitmap_nbytes, stored_sparsity, tensor_nbytes  # corelm folders only
    if loaded.stored_tensors is None:
        return None
    spec = loaded.spec
    per_token = 0.0
    sparse = {}
    for name, (type_, shape, nbytes) in loaded.stored_tensors.items():
        if name != "tok_embeddings" or spec.tie_word_embeddings:
            per_token += nbytes * (spec.num_experts_used / spec.num_experts if ".experts." in name else 1)
        if TYPES[type_].sparse:
            sparse[name] = {"shape": list(shape), "type": TYPES[type_].name, "bytes": nbytes,
                            "dense_bytes": tensor_nbytes(type_, shape) - bitmap_nbytes(shape),
                            "sparsity": stored_sparsity(shape, nbytes, type_)}
    return {"bytes_per_token": int(per_token), "sparse": sparse}
