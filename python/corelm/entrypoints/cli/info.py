"""`corelm info`: the CPU, its features, the kernels the C++ core chose, memory, the topology and
thread plan, and with MODEL the model's hyper-parameters (without building it). The facts come from
corelm.engine.system; this module only formats them."""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict, Iterable, List, Optional

from ...engine import model_info, numa_split, sparsity_summary, system_info
from ...options import SPARSE_OF
from .flags import add_model_arg, add_numa_flag, add_threads_flag


def add_parser(commands) -> None:
    p = commands.add_parser("info", help="show the CPU, the kernels chosen, and a model's shape",
                            description="Show the CPU, its features, the kernels corelm picked, memory, "
                                        "and with MODEL the model's hyper-parameters (without building it).")
    add_model_arg(p, default="none, the machine only")
    add_threads_flag(p, "show the thread plan for this many threads (default: the default count)")
    add_numa_flag(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="with a sparse corelm folder: every sparse matrix's stored fraction of zeros and bytes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.threads is not None and not 1 <= args.threads <= 1024:
        raise ValueError(f"--threads must be in [1, 1024], got {args.threads}.")
    info = system_info(threads=args.threads, numa=args.numa)
    if args.model:
        info["model"] = model_info(args.model)
        if info.get("topology") and args.numa:
            info["topology"]["numa"]["model_split"] = numa_split(info["model"], info["topology"]["numa"]["shares"])
    print(json.dumps(info, indent=2, default=str) if args.json else format_info(info, verbose=args.verbose))
    return 0


def _gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _cpu_ranges(ids: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    ids, parts = sorted(ids), []
    for i in ids:
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _bytes(n: int, digits: int = 6) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{digits}g} {unit}"
    return f"{n} B"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_topology(topo: Dict[str, Any], plan: List[Dict[str, Any]], pinned: bool,
                    max_plan_lines: int = 16) -> List[str]:
    """Packages, nodes, cores (P/E on hybrid CPUs), SMT, caches, then which thread runs where."""
    cores = topo["cores"]
    kinds = ""
    if topo["hybrid"]:
        kinds = " (" + " + ".join(f"{sum(c['type'] == t for c in cores)} {t}" for t in ("P", "E")) + ")"
    tpc = topo["threads_per_core"]
    lines = [f"Topology:  {_plural(len(topo['packages']), 'package')}, {_plural(len(topo['nodes']), 'NUMA node')}, "
             f"{_plural(len(cores), 'core')}{kinds}, {_plural(len(topo['cpus']), 'logical CPU')}, "
             + (f"SMT {tpc}" if tpc > 1 else "no SMT")]
    for node in topo["nodes"]:
        ids = [c["id"] for c in topo["cpus"] if c["node"] == node]
        lines.append(f"           node {node}: CPUs {_cpu_ranges(ids)} "
                     f"({_plural(sum(c['node'] == node for c in cores), 'core')})")
    groups: Dict[tuple, int] = {}
    for c in topo["caches"]:
        name = f"L{c['level']}" + {"Data": "d", "Instruction": "i"}.get(c["type"], "")
        groups[(name, c["size"], len(c["cpus"]))] = groups.get((name, c["size"], len(c["cpus"])), 0) + 1
    if groups:
        lines.append("Caches:    " + ", ".join(
            f"{name} {_bytes(size)} x{count}" + (f" (shared by {n} CPUs)" if n > 1 else "")
            for (name, size, n), count in groups.items()))
    where = "pinned" if pinned else "not pinned (CORELM_PIN_THREADS=0)"
    lines.append(f"Threads:   {len(plan)}, workers {where}; thread 0 is the calling thread (not pinned)")
    for t in plan[:max_plan_lines]:
        if t["cpu"] < 0:
            lines.append(f"           thread {t['thread']} -> no CPU (more threads than allowed CPUs): not pinned")
            continue
        kind = f", {t['type']}" if t["type"] != "?" else ""
        lines.append(f"           thread {t['thread']} -> cpu {t['cpu']} (core {t['core']}, node {t['node']}{kind})")
    if len(plan) > max_plan_lines:
        lines.append(f"           ... {len(plan) - max_plan_lines} more (see --json)")
    for note in topo["notes"]:
        lines.append(f"           note: {note}")
    if "numa" in topo:
        lines += format_numa(topo["numa"], len(topo["nodes"]))
    return lines


def format_numa(numa: Dict[str, Any], n_nodes: int) -> List[str]:
    """The policy and where its memory goes."""
    policy, shares = numa["policy"], numa["shares"]
    if policy == "default":
        return ["Placement: --numa not set: weights and KV cache where first touch puts them"]
    total = sum(t for _, t in shares) or 1
    split = ", ".join(f"node {n} {100 * t / total:.0f}% ({_plural(t, 'thread')})" for n, t in shares)
    lines = [f"Placement: --numa {policy}: each matrix's rows and the KV-cache blocks split by node: {split}"
             + ("" if n_nodes > 1 else " (one node: nothing to move)")]
    for name, ranges in (numa.get("model_split") or {}).items():
        lines.append(f"           {name}: " + ", ".join(f"rows {a}-{b - 1} on node {n}" for n, a, b in ranges if b > a))
    return lines


def format_storage(storage: Dict[str, Any], verbose: bool = False) -> List[str]:
    """A corelm folder's bytes read per token and its sparse matrices (each one with verbose)."""
    lines = [f"Storage:   {_bytes(storage['bytes_per_token'], 3)} read per token (every tensor as stored but the "
             f"embedding table, of which a token reads one row)"]
    sparse = storage["sparse"]
    if sparse:
        for fmt in sorted({m["type"] for m in sparse.values()}):
            of = [m for m in sparse.values() if m["type"] == fmt]
            dense_fmt = next(d for d, s in SPARSE_OF.items() if s == fmt)
            lines.append(f"Sparse:    {sparsity_summary((m['sparsity'] for m in of), fmt)}; "
                         f"{_bytes(sum(m['bytes'] for m in of), 3)}, dense {dense_fmt} "
                         f"{_bytes(sum(m['dense_bytes'] for m in of), 3)}" + ("" if verbose else " (-v: each)"))
        width = max(map(len, sparse))
        lines += [f"           {name:<{width}}  {'x'.join(map(str, m['shape']))} {m['type']}: "
                  f"{100 * m['sparsity']:.1f}% zeros, {_bytes(m['bytes'], 3)}" for name, m in sparse.items()] if verbose else []
    return lines


def format_info(info: Dict[str, Any], verbose: bool = False) -> str:
    cpu, mem = info["cpu"], info["memory"]
    lines = [
        f"corelm {info['corelm_version']} (Python {info['python']}, {info['platform']})",
        f"CPU:       {cpu['model'] or '?'} ({cpu['arch']})",
        f"Cores:     {cpu['physical_cores'] or '?'} physical, {cpu['logical_cores'] or '?'} logical, "
        f"{cpu['usable_cores'] or '?'} usable by this process",
        f"NUMA:      {cpu['numa_nodes'] or '?'} node{'s' if cpu['numa_nodes'] != 1 else ''}",
        f"Memory:    {_gib(mem.get('total_bytes'))} total, {_gib(mem.get('available_bytes'))} available",
        f"Features:  {' '.join(info['features']) or '-'}  (from {info['features_source']})",
    ]
    if info["kernels"]:
        lines.append("Kernels:   " + ", ".join(f"{op}={isa}" for op, isa in info["kernels"].items()))
    else:
        lines.append(f"Kernels:   {info.get('core_error', '-')}")
    amx = (info.get("core") or {}).get("amx")
    if amx is not None:
        if not amx.get("available"):
            state = f"absent ({amx.get('reason') or '?'})"
        elif amx.get("in_use"):
            state = "available, AMX-BF16 serves bf16 weights and prompts' quantized and sparse ones (kernel table amx)"
        else:
            state = "available, not in use (CORELM_ISA chose another table)"
        lines.append("AMX:       " + state)
    if info.get("topology"):
        lines += format_topology(info["topology"], info["thread_plan"], info["pin_threads"])
    model = info.get("model")
    if model:
        lines += [
            f"Model:     {model['path']} ({model['description'] or model['format']})",
            f"           {model['architecture']}, {_count(model['parameters'])} parameters, "
            f"{model['layers']} layers, hidden {model['hidden_size']}, ffn {model['intermediate_size']}"
            + (f" per expert, experts {model['experts']}, {model['experts_used']} active" if model.get("experts")
               else ""),
            f"           {model['heads']} heads ({model['kv_heads']} kv) of {model['head_dim']}, "
            f"vocab {model['vocab_size']}, context {model['default_context']} "
            f"(-c 0; the model's own: {model['context_length']}), "
            f"chat template: {'yes' if model['chat_template'] else 'no'}",
            f"Weights:   matrices stored as {model['matrices_stored_as']} (--dtype auto)",
            f"           quantized matmuls take {model['default_activations']} activations (--activations auto: "
            f"the exact path, the model answers as its file does; int8 reads prompts faster at a fidelity "
            f"cost, docs/quality.md)",
        ]
        if model.get("kv_bytes_per_token"):
            kv = model["kv_bytes_per_token"]
            lines.append("KV cache:  bytes per token (--kv-cache-dtype) " +
                         ", ".join(f"{t} {b['0.0']}" for t, b in kv.items()) +
                         "; at --kv-sparsity 0.5 " + ", ".join(f"{t} {b['0.5']}" for t, b in kv.items()))
        if model.get("storage"):
            lines += format_storage(model["storage"], verbose)
    return "\n".join(lines)
