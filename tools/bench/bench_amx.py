#!/usr/bin/env python3
"""AMX GEMM micro-benchmark: real AMX-BF16 / AMX-INT8 kernels vs the kernel table's matmul (the AVX-512
fp32/bf16 prefill path) on one GEMM y[M][N] = x[M][K] . W[N][K]^T with weights packed once.

usage:  python tools/bench/bench_amx.py [--shape 128 4864 896] [--ms 1 32 128 256] [--threads 1 2] [--rounds 5]
                                  [--seconds 0.5] [--json]

Each (kind, M, threads) point runs `rounds` timed windows of `seconds` (after a warm-up call), interleaved
with the other kinds so machine noise hits them alike; the best window is reported (the machine's other
load only ever slows a window down) with the median beside it. GFLOP/s = 2*M*N*K / time.
Kinds: amx_bf16 (x rounded to bf16 per call, fp32 accumulate), amx_int8 (int8 x int8 -> int32, per-row
scales applied after), <table>_fp32 / <table>_bf16 / <table>_q8 / <table>_q4 (corelm's kernel table matmul
with fp32 activations; q8/q4 with int8 activations, and on the amx table past 32 rows dequantized to bf16).
The shape default is the Qwen2.5-0.5B FFN up/gate projection (dim 896, ffn 4864) for a 128-token chunk.
"""
import argparse
import json
import os
import statistics
import sys

try:
    from corelm import _core
except ImportError:  # a source checkout with an in-place build
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python"))
    from corelm import _core


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs=3, type=int, default=[128, 4864, 896], metavar=("M", "N", "K"))
    ap.add_argument("--ms", nargs="*", type=int, default=None, help="M values to sweep (default: the shape's M)")
    ap.add_argument("--threads", nargs="*", type=int, default=[1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    m0, n, k = args.shape
    ms = args.ms or [m0]
    tables = _core.kernel_tables()
    # the amx table's bf16 matmul is the amx_bf16 kernel below (same name) and its fp32 is the base
    # table's; its q8/q4 are a prompt's quantized weights dequantized into bf16 tiles (m > 32)
    kinds = ([f"{t}_{w}" for t in tables if t != "scalar" for w in ("fp32", "bf16", "q8", "q4")
              if not (t == "amx" and w in ("fp32", "bf16"))] or ["scalar_fp32"])
    if _core.amx_available():
        kinds = ["amx_bf16", "amx_int8"] + kinds
    else:
        print(f"AMX unavailable ({_core.amx_info()['reason']}): only the kernel tables are measured", file=sys.stderr)

    results = []
    for threads in args.threads:
        for m in ms:
            samples = {kind: [] for kind in kinds}
            for _ in range(args.rounds):
                for kind in kinds:
                    samples[kind].append(_core.testing.bench_gemm(kind, m, n, k, args.seconds, threads)["gflops"])
            for kind in kinds:
                results.append({"kind": kind, "m": m, "n": n, "k": k, "threads": threads,
                                "gflops_best": max(samples[kind]), "gflops_median": statistics.median(samples[kind]),
                                "ms_best": 2e-6 * m * n * k / max(samples[kind])})

    if args.json:
        print(json.dumps({"cpu": _core.cpu_info()["brand"], "results": results}, indent=2))
        return 0
    print(f"CPU: {_core.cpu_info()['brand']}; GEMM N={n} K={k}; best (median) GFLOP/s over {args.rounds} windows")
    print(f"{'threads':>7} {'M':>5} " + " ".join(f"{kind:>18}" for kind in kinds))
    for threads in args.threads:
        for m in ms:
            row = {r["kind"]: r for r in results if r["m"] == m and r["threads"] == threads}
            cells = [f"{row[kd]['gflops_best']:8.1f} ({row[kd]['gflops_median']:6.1f})" for kd in kinds]
            print(f"{threads:>7} {m:>5} " + " ".join(f"{c:>18}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
