"""Builds the C++ model (`corelm._core.Model`) from a LoadedModel: picks the weight dtype and thread
count, computes the RoPE frequencies, and hands the weights over one tensor at a time."""
from __future__ import annotations

import collections
import logging
import math
import os
import time
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..loader.rope import rope_attention_factor, rope_inv_freq
from ..loader.spec import LoadedModel, ModelSpec, kept_float, stored_raw_type, weight_shapes
from ..options import KEEP_AS_STORED, WEIGHT_FORMATS, choose, format_of_core, format_of_raw
from ..threads import check_numa, default_threads  # noqa: F401  (model_builder's names before they moved down)

log = logging.getLogger("corelm")

KV_BLOCK_SIZE = 16


def default_pin_threads() -> bool:
    """Workers are pinned one per physical core unless CORELM_PIN_THREADS=0 (for a machine shared
    with other pinned jobs, where two pools pinned to the same cores would take turns)."""
    return os.environ.get("CORELM_PIN_THREADS", "1").strip().lower() not in ("0", "false", "no", "off")


def default_schedule() -> str:
    """How the kernels split work across threads: "dynamic" (each thread's share follows its measured
    speed, idle threads take over leftovers and chunks held by descheduled threads) unless
    CORELM_SCHEDULE=static asks for equal parts."""
    return resolve_schedule(os.environ.get("CORELM_SCHEDULE") or "dynamic")


def resolve_schedule(schedule: str) -> str:
    return choose("schedule", schedule)


def resolve_dtype(dtype: str) -> str:
    """The weight format matrices without quantized GGUF blocks get, as the core names it. "auto" is
    bf16 where the CPU has AVX512_BF16 (its bf16 weights halve the bytes decode reads), otherwise fp32;
    a quantized format quantizes matrices at load (blocks of 32 with an fp16 scale); sbf16 keeps them bf16
    with their exact zeros dropped (for weights already pruned)."""
    from .. import _core
    dtype = choose("dtype", dtype)
    if dtype == "auto":
        return "bf16" if _core.cpu_info().get("bf16_native") else "fp32"
    return WEIGHT_FORMATS[dtype].core


def updated(config, **fields):
    """A copy of a `_core.ModelConfig` with these fields set (model/config.h's names; enums by name); a name
    it lacks is a TypeError."""
    out = config.copy()
    for key, value in fields.items():
        if not hasattr(out, key):
            raise TypeError(f"ModelConfig has no field {key!r}")
        setattr(out, key, value)
    return out


def core_config(spec: ModelSpec, dtype: str, threads: int, max_seq_len: int,
                pin_threads: bool = True, numa: Optional[str] = None, schedule: str = "dynamic"):
    """The `_core.ModelConfig` of a spec: the one typed object the core is built from."""
    from .. import _core
    window = spec.sliding_window if spec.sliding_window and spec.sliding_window < max_seq_len else 0
    return updated(_core.ModelConfig(), vocab_size=spec.vocab_size, dim=spec.hidden_size, ffn_dim=spec.intermediate_size,
                n_layers=spec.num_layers, n_heads=spec.num_heads, n_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, norm_eps=float(spec.rms_norm_eps),
                tie_embeddings=bool(spec.tie_word_embeddings), attention_bias=bool(spec.attention_bias),
                sliding_window=int(window), max_seq_len=int(max_seq_len),
                rope_inv_freq=rope_inv_freq(spec, max_seq_len).tolist(), weight_type=dtype, n_threads=int(threads),
                pin_threads=bool(pin_threads), numa=numa, schedule=schedule,
                # the family's features (loader/families.py)
                rope_dim=int(spec.rope_dim or 0), rope_attn_factor=rope_attention_factor(spec),
                rope_inv_freq_local=rope_inv_freq(spec, max_seq_len, local=True).tolist()
                if spec.rope_local_theta else [],
                sliding_layers=[int(b) for b in spec.sliding_layers] if spec.sliding_layers else [],
                activation=spec.activation, qk_norm=bool(spec.qk_norm), post_norms=bool(spec.post_norms),
                embed_scale=float(spec.embed_scale),
                attn_scale=float(np.float32(spec.query_pre_attn_scalar ** -0.5)) if spec.query_pre_attn_scalar else 0.0,
                attn_softcap=float(spec.attn_logit_softcap or 0.0),
                final_softcap=float(spec.final_logit_softcap or 0.0), qk_norm_whole=bool(spec.qk_norm_whole),
                n_experts=int(spec.num_experts), n_experts_used=int(spec.num_experts_used),
                moe_norm_topk=bool(spec.moe_norm_topk),
                # an encoder's (BERT)
                causal=not spec.encoder, n_positions=int(spec.max_position_embeddings) if spec.encoder else 0,
                n_token_types=int(spec.type_vocab_size), layer_norm=bool(spec.encoder),
                norm_after_residual=bool(spec.encoder), gated_mlp=not spec.encoder, output_bias=bool(spec.encoder))


# activations="auto" is the exact path: int16 (about 15 bits) keeps every weight format's own function
# (greedy tokens as transformers on the dequantized file), where int8 activations flipped the embedded
# SmolLM2's answers. int8 remains the option for faster prefill (docs/quality.md has its cost).
AUTO_ACTIVATIONS = "int16"


def check_activations(activations: str) -> str:
    return choose("activations", activations)


def check_kv_sparsity(kv_sparsity) -> float:
    """The fraction of every key and value row the cache drops (0: dense), in [0, 1)."""
    ok = isinstance(kv_sparsity, (int, float)) and not isinstance(kv_sparsity, bool)
    if not ok or not 0 <= kv_sparsity < 1:   # NaN fails the comparison too
        raise ValueError(f"kv_sparsity must be a number in [0, 1), got {kv_sparsity!r}.")
    return float(kv_sparsity)


def kv_keep(head_dim: int, kv_sparsity: float) -> int:
    """Elements a sparse row keeps (as KVCache::kept computes it, in double precision)."""
    return head_dim - math.floor(kv_sparsity * head_dim)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str, kv_sparsity: float = 0.0) -> int:
    """Per layer and kv head a key row and a value row; an int8 row adds an fp16 step and lower bound, a
    sparse row keeps kv_keep values and a bitmap of head_dim bits in 32-bit words."""
    esz = {"fp32": 4, "bf16": 2, "int8": 1}[kv_dtype]
    keep = kv_keep(spec.head_dim, kv_sparsity)
    row = keep * esz + (4 if kv_dtype == "int8" else 0) + (4 * -(-spec.head_dim // 32) if keep < spec.head_dim else 0)
    return spec.num_layers * spec.num_kv_heads * 2 * row


def kv_blocks_for(spec: ModelSpec, kv_dtype: str, max_seq_len: int, kv_cache_gb: Optional[float],
                  kv_sparsity: float = 0.0) -> int:
    """Blocks in the KV pool. The default budget holds 8 full-context sequences, capped at 4 GiB;
    pages are reserved, not touched, so unused capacity costs no memory."""
    per_block = kv_bytes_per_token(spec, kv_dtype, kv_sparsity) * KV_BLOCK_SIZE
    one_seq = -(-max_seq_len // KV_BLOCK_SIZE)
    if kv_cache_gb is None:
        return max(one_seq, min(8 * one_seq, (4 << 30) // per_block))
    if not (isinstance(kv_cache_gb, (int, float)) and kv_cache_gb > 0 and math.isfinite(kv_cache_gb)):
        raise ValueError(f"kv_cache_gb must be a positive number, got {kv_cache_gb!r}.")
    blocks = int(kv_cache_gb * (1 << 30)) // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_gb={kv_cache_gb} holds no KV block ({per_block} bytes each).")
    return blocks


# The default context's cap: a model trained for more gets it by asking (max_seq_len); the KV pool's pages
# are reserved, not touched, so the cap bounds the RoPE tables and one request's memory, not idle memory.
DEFAULT_CONTEXT_CAP = 32768


def trained_context(spec) -> int:
    """The most tokens the model was trained to attend over: max_position_embeddings, or YaRN's factor times
    its original context where that is more (Qwen2.5's 32k x 4)."""
    n = int(spec.max_position_embeddings or 2048)
    s = spec.rope_scaling or {}
    if s.get("rope_type") == "yarn" and s.get("original_max_position_embeddings"):
        n = max(n, int(float(s["factor"]) * int(s["original_max_position_embeddings"])))
    return n


def default_max_seq_len(spec) -> int:
    """The context an engine gets when max_seq_len is not given: the trained one, at most
    DEFAULT_CONTEXT_CAP; a LongRoPE model keeps its pre-training context (beyond it every prompt would take
    the long factors, which transformers uses only for prompts that long)."""
    s = spec.rope_scaling or {}
    if s.get("rope_type") == "longrope":
        return min(int(s["original_max_position_embeddings"]), trained_context(spec))
    return min(trained_context(spec), DEFAULT_CONTEXT_CAP)


def check_max_seq_len(spec, max_seq_len: int) -> int:
    """max_seq_len within the model's trained context (a clear error past it)."""
    if not isinstance(max_seq_len, (int, np.integer)) or isinstance(max_seq_len, bool) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}.")
    if max_seq_len > trained_context(spec):
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's trained context of {trained_context(spec)} "
                         f"tokens (max_position_embeddings, or YaRN's factor x original context in rope_scaling).")
    return int(max_seq_len)


def keep_as_stored(dtype: str) -> Tuple[str, ...]:
    """The stored formats loading keeps as they are under this (canonical) dtype: KEEP_AS_STORED's, and
    bf16 matrices wherever the matrices are bf16 (their rows packed with no float copy)."""
    return KEEP_AS_STORED.get(dtype, ()) + (("bf16",) if resolve_dtype(dtype) == "bf16" else ())


def _kept_blocks(loaded: LoadedModel, name: str, keep_raw):
    """(raw, its format) when the weight's stored form (GGUF blocks, sparse bf16) is kept under this dtype,
    else None."""
    if getattr(loaded, "raw_weight_type", None) is not None and _kept_format(loaded, name, keep_raw) is None:
        return None     # the header says so: nothing read (a GGUF's blocks under bf16, which keeps sparse only)
    get_raw = getattr(loaded, "get_raw_weight", None)
    raw = get_raw(name) if get_raw is not None and keep_raw else None
    raw_format = format_of_raw(raw[0]) if raw is not None else None
    return (raw, raw_format) if raw_format is not None and raw_format.name in keep_raw else None


def _kept_format(loaded: LoadedModel, name: str, keep_raw):
    """The format a weight's stored form (GGUF blocks, sparse bf16) is kept in under this dtype, from the
    header alone; None when it is not kept as stored."""
    t = stored_raw_type(loaded, name) if keep_raw else None
    fmt = format_of_raw(t) if t is not None else None
    return fmt if fmt is not None and fmt.name in keep_raw else None


def planned_storage(loaded: LoadedModel, dtype: str = "auto") -> str:
    """How build_core_model would store the matrices (what loaded.stored_types says after a build),
    without building or reading weights: e.g. "q4_1+q8_0" for a GGUF whose blocks are kept, "bf16" for
    an HF model."""
    dtype = choose("dtype", dtype)
    keep_raw = keep_as_stored(dtype)
    dense = format_of_core(resolve_dtype(dtype)).name
    stored = collections.Counter()
    for name in _matrices(loaded.spec):
        kept = _kept_format(loaded, name, keep_raw)
        stored[kept.name if kept else dense] += 1
    return "+".join(t for t, _ in stored.most_common())


def _matrices(spec: ModelSpec) -> set:
    """The matrices stored in the weight format (not the fp32 ones: norms, biases, MoE routers)."""
    return {name for name, shape in weight_shapes(spec).items() if len(shape) == 2 and not kept_float(name)}


def resolve_kv_dtype(loaded: LoadedModel, dtype: str, kv_cache_dtype: str) -> str:
    """kv_cache_dtype="auto": the model's precision, fp32 only where every matrix is computed in fp32
    (float weights at dtype fp32), else bf16 (bf16 or quantized weights)."""
    kv = choose("kv_cache_dtype", kv_cache_dtype)
    if kv != "auto":
        return kv
    dtype = choose("dtype", dtype)
    if resolve_dtype(dtype) != "fp32":
        return "bf16"
    keep_raw = keep_as_stored(dtype)
    quantized = keep_raw and any(_kept_format(loaded, name, keep_raw) for name in _matrices(loaded.spec))
    return "bf16" if quantized else "fp32"


def build_core_model(loaded: LoadedModel, dtype: str = "auto", threads: Optional[int] = None,
                     max_seq_len: Optional[int] = None, progress: bool = False, kv_cache_dtype: str = "auto",
                     kv_cache_gb: Optional[float] = None, pin_threads: Optional[bool] = None,
                     numa: Optional[str] = None, schedule: Optional[str] = None, activations: str = "auto",
                     kv_sparsity: float = 0.0, shard=None):
    """Returns a ready `_core.Model`. Weights are decoded one at a time, so peak memory stays near
    the packed model plus one fp32 tensor. pin_threads (default: default_pin_threads()) pins the
    pool's workers to the thread plan's CPUs; `model.thread_cpus` says where each thread runs. numa
    (see check_numa) chooses the plan across NUMA nodes; `model.numa_info()` says where memory went.
    schedule (default: default_schedule()) is "dynamic" or "static", see docs/architecture.md.
    activations: how matmuls with quantized weights take their input, per block of 32: "int16" (about
    15 bits, close to fp32: what "auto" picks, see AUTO_ACTIVATIONS) or "int8" (faster prefill, at a
    fidelity cost measured in docs/quality.md). kv_sparsity: the fraction of each key and value row
    the cache drops, keeping the largest magnitudes (model/kv_cache.h; its cost in docs/quality.md).
    shard: a tensor-parallel rank's slice (distributed/shard.py): the model built holds only that, and
    its KV cache has as many blocks as the whole model's would (every rank follows one block table)."""
    from .. import _core
    spec = loaded.spec
    numa = check_numa(numa)
    threads = default_threads(numa) if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}.")
    max_seq_len = default_max_seq_len(spec) if max_seq_len is None else check_max_seq_len(spec, max_seq_len)
    kv_cache_dtype = resolve_kv_dtype(loaded, dtype, kv_cache_dtype)
    kv_sparsity = check_kv_sparsity(kv_sparsity)
    activations = check_activations(activations)
    dtype = choose("dtype", dtype)
    pin = default_pin_threads() if pin_threads is None else bool(pin_threads)
    schedule = default_schedule() if schedule is None else resolve_schedule(schedule)
    config = core_config(spec, resolve_dtype(dtype), threads, int(max_seq_len), pin, numa, schedule)
    config = updated(config, kv_type=kv_cache_dtype, kv_sparsity=kv_sparsity, kv_block_size=KV_BLOCK_SIZE,
                     kv_blocks=kv_blocks_for(spec, kv_cache_dtype, int(max_seq_len), kv_cache_gb, kv_sparsity))
    if shard is not None:
        config = updated(config, **shard.config_changes(config))
    model = _core.Model(config)
    names = list(loaded.weight_names()) if shard is None else shard.weight_names(loaded.weight_names())
    matrices = _matrices(spec)
    if progress:
        from tqdm import tqdm
        names = tqdm(names, desc="loading weights", unit="tensor", leave=False)
    keep_raw = keep_as_stored(dtype)
    stored = collections.Counter()  # weight format -> matrices stored in it, for LLM.dtype / corelm info
    for name in names:
        src = name if shard is None else shard.source(name)
        kept = _kept_blocks(loaded, src, keep_raw)
        is_matrix = name in matrices
        if kept is not None and shard is not None:
            raw = shard.slice_raw(name, kept[0])
            kept = (raw, kept[1]) if raw is not None else None   # a cut through blocks: sliced as floats
        if kept is not None:           # quantized blocks or sparse bf16: repacked, no float round trip
            raw, raw_format = kept
            model.set_weight_raw(name, raw[0], raw[1], list(raw[2]))
            stored[raw_format.name] += is_matrix
        else:
            weight = loaded.get_weight(src)
            model.set_weight(name, weight if shard is None else shard.slice_floats(name, weight))
            stored[format_of_core(model.weight_type).name] += is_matrix
        if not (shard is not None and shard.tied and name == "tok_embeddings"):   # lm_head, last, is cut from it
            loaded.release_weight(src)
    model.finalize()
    model.activations = AUTO_ACTIVATIONS if activations == "auto" else activations
    if numa is not None:
        log.info(model.numa_info()["status"])
    loaded.stored_types = "+".join(t for t, n in stored.most_common() if n)
    return model


def wait_for_huge_pages(cores, timeout: Optional[float] = None) -> bool:
    """Waits until no `_core.Model` of cores is still moving its weights onto 2 MiB pages (see
    `Model.huge_page_promotion`); False if timeout (seconds) ran out first. The move runs at idle
    priority while no model computes, so this waits with the CPUs idle: what benchmarks of decode do."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while any(c.huge_page_promotion["running"] for c in cores):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
