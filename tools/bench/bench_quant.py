"""Decode speed of quantized weights (q8, q4) against bf16 on a Qwen2.5-0.5B-shaped random model.

    python tools/bench/bench_quant.py [--rounds 3] [--tokens 32] [--dtypes bf16,q8,q4] [--threads 1,2]
    python tools/bench/bench_quant.py --gemm [--rounds 5] [--dtypes q8,q4,q4m] [--threads 1,2] [--m 128] [--activations int8,int16]
    python tools/bench/bench_quant.py --stream [--rounds 3] [--dtypes q8,q4,q4m,bf16] [--activations int8,int16]

Every (dtype, threads) model is built once from the same random weights, then the decode
measurements alternate between them round by round, so a noisy neighbour hurts all of them alike.
Reports the median prefill (128 tokens) and decode tok/s of each and the GB/s of packed weights it streams.
--gemm measures the kernel table's matmul alone instead (weights packed once, m activation rows, the
model's 896x4864, 4864x896 and 896x896 weight shapes), alternating kinds round by round: median GOP/s,
2*m*N*K per call.
--stream measures decode's weight stream without the rest of the model: the kernel table's matmul for
one activation row over 24 layers of the model's matrices (qkv, o, gate/up, down; ~200-800 MB, far
beyond the caches), alternating with a plain AVX-512 read of as many bytes in the same process:
median GB/s of each and their ratio, the share of the bandwidth roofline the kernel reaches. On each
of --threads: with T > 1 every thread streams its share of each matrix's rows, once waiting for the
others after every matrix as the model's regions do ("sync") and once without waiting ("free")."""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python"))
from corelm import _core  # noqa: E402
from corelm.engine.model_builder import core_config, updated, wait_for_huge_pages  # noqa: E402
from corelm.loader.spec import ModelSpec, weight_shapes  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, when loaded by path
from core_forward import core_forward  # noqa: E402

SPEC = ModelSpec(arch="qwen2", vocab_size=32000, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                 attention_bias=True)


def time_prompt_and_steps(model, prompt, tokens):
    """Seconds of the prompt's prefill, then the median seconds of `tokens` decode steps after it."""
    t0 = time.perf_counter()
    core_forward(model, prompt, 0, False)
    prefill = time.perf_counter() - t0
    pos, ts = len(prompt), []
    for _ in range(tokens):
        t0 = time.perf_counter()
        core_forward(model, np.array([5], np.int32), pos, False)
        ts.append(time.perf_counter() - t0)
        pos += 1
    return prefill, float(np.median(ts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--dtypes", default=None, help="default bf16,q8,q4 (--gemm: q8,q4,q4m)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--gemm", action="store_true", help="the matmul kernel alone, GOP/s")
    ap.add_argument("--m", type=int, default=128, help="activation rows for --gemm")
    ap.add_argument("--stream", action="store_true", help="decode's weight stream alone vs a plain read, GB/s")
    ap.add_argument("--tables", default=None,
                    help="--gemm/--stream: comma-separated kernel tables to compare (default: the best one), e.g. avx512,avx2")
    ap.add_argument("--activations", default="int8",
                    help="--gemm/--stream: comma-separated input formats of the quantized kernels (int8,int16)")
    a = ap.parse_args()
    if a.gemm:
        return bench_gemm(a)
    if a.stream:
        return bench_stream(a)
    keys = [(d, int(t)) for t in a.threads.split(",") for d in (a.dtypes or "bf16,q8,q4").split(",")]
    models = {k: _core.Model(updated(core_config(SPEC, k[0], k[1], 1024), pin_threads=False)) for k in keys}
    rng = np.random.default_rng(0)
    for name, shape in weight_shapes(SPEC).items():
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        for m in models.values():
            m.set_weight(name, w)
    for m in models.values():
        m.finalize()
    wait_for_huge_pages(models.values(), timeout=600)   # decode at its steady speed (LLM.wait_for_huge_pages)
    prompt = rng.integers(0, SPEC.vocab_size, 128).astype(np.int32)
    times = {k: [] for k in keys}
    prefill = {k: [] for k in keys}
    for r in range(a.rounds):
        for k, m in models.items():
            pre, step = time_prompt_and_steps(m, prompt, a.tokens)
            prefill[k].append(pre)
            times[k].append(step)
    for k, m in models.items():
        med = float(np.median(times[k]))
        pre = len(prompt) / float(np.median(prefill[k]))
        print(f"{k[0]:5s} threads={k[1]}  prefill {pre:6.1f} tok/s  decode {1 / med:6.1f} tok/s  "
              f"{m.weight_bytes / med / 1e9:5.1f} GB/s  ({m.weight_bytes / 1e6:.0f} MB of weights; decode rounds: "
              f"{', '.join(f'{1 / t:.1f}' for t in times[k])})")


def bench_gemm(a):
    dtypes = (a.dtypes or "q8,q4,q4m").split(",")
    shapes = [(896, 4864), (4864, 896), (896, 896)]   # W [N, K]: FFN down, FFN up/gate, attention output
    keys = [(table, d, act, n, k, int(t)) for t in a.threads.split(",") for d in dtypes for n, k in shapes
            for act in a.activations.split(",") for table in tables_of(a)]
    gops = {key: [] for key in keys}
    wbytes = {}
    for r in range(a.rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            table, d, act, n, k, t = key
            got = _core.testing.bench_gemm(f"{table}_{d}", a.m, n, k, 0.3, t, act)
            gops[key].append(got["gflops"])
            wbytes[key] = got["weight_bytes"]
    for key, v in gops.items():
        table, d, act, n, k, t = key
        # the weights' read rate from cache: beside --stream's plain DRAM read, it says whether one
        # core's decode is bound by arithmetic or by memory
        rate = f"  weights {np.median(v) / (2 * a.m * n * k) * wbytes[key]:5.1f} GB/s from cache" if a.m == 1 else ""
        print(f"{table + '_' + d:11s} {act:5s} m={a.m} W {n}x{k} threads={t}  {np.median(v):7.1f} GOP/s{rate}  "
              f"(rounds: {', '.join(f'{x:.1f}' for x in v)})")


def best_quant_table():
    """The fastest table for the quantized formats (avx512_bf16 differs from avx512 in bf16 only)."""
    return next(t for t in _core.kernel_tables() if t != "avx512_bf16")


def tables_of(a):
    return a.tables.split(",") if a.tables else [best_quant_table()]


def bench_stream(a):
    h, f = SPEC.hidden_size, SPEC.intermediate_size
    kv = SPEC.num_kv_heads * SPEC.head_dim
    shapes = [(h + 2 * kv, h), (h, h), (2 * f, h), (h, f)]     # W [N, K] in the order a layer reads them
    kinds = [(f"{table}_{d}", act) for table in tables_of(a) for d in (a.dtypes or "q8,q4,q4m,bf16").split(",")
             for act in (a.activations.split(",") if d != "bf16" else ["int8"])]
    runs_of = [(k, act, t, sync) for t in map(int, a.threads.split(",")) for k, act in kinds
               for sync in ((True,) if t == 1 else (True, False))]
    got = {r: [] for r in runs_of}
    for r in range(a.rounds):
        for run in runs_of if r % 2 == 0 else runs_of[::-1]:
            k, act, t, sync = run
            got[run].append(_core.testing.bench_gemv_stream(k, shapes, SPEC.num_layers, 9, t, sync, act))
    for (k, act, t, sync), runs in got.items():
        g = [d["gemv_GBps"] for d in runs]
        p = [d["read_GBps"] for d in runs]
        ratio = [x / y for x, y in zip(g, p)]
        mode = "" if t == 1 else (" sync" if sync else " free")
        print(f"{k:12s} {act:5s} {t}t{mode:5s} {runs[0]['bytes'] / 1e6:6.0f} MB  kernel {np.median(g):5.1f} GB/s  plain read "
              f"{np.median(p):5.1f} GB/s  kernel/read {np.median(ratio):.2f}  (rounds: {', '.join(f'{x:.2f}' for x in ratio)})")


if __name__ == "__main__":
    main()
