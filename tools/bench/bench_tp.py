#!/usr/bin/env python3
"""Tensor parallelism against one process on the same cores: prefill and decode tok/s of
`LLM(model, tensor_parallel_size=N, threads=T/N)` against `LLM(model, threads=T)`, each configuration a fresh
process, alternating (A, B, B, A, ...), medians over the rounds. Greedy, EOS ignored, no speculation, a fresh
random prompt per measurement (no prefix-cache hits).

    python tools/bench/bench_tp.py --model qwen2.5-coder-0.5b-instruct.gguf [--tp 2] [--threads 2] [--rounds 4]
        [--prompt 128] [--tokens 64] [--env tcp]

--env tcp runs the ranks on TCP sockets only (MPICH without its shared-memory path). Needs the distributed
extra (mpi4py, mpich)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp", "FI_PROVIDER": "tcp"}


def worker(model, tp, threads, prompt_len, tokens, seed):
    import numpy as np
    import corelm
    llm = corelm.LLM(model, tensor_parallel_size=tp, threads=threads, speculative_model=None)
    vocab = llm.engine.vocab_size
    rng = np.random.default_rng(seed)
    params = corelm.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": rng.integers(100, vocab - 100, 32).tolist()}],
                 corelm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))     # warm-up
    prompt = rng.integers(100, vocab - 100, prompt_len).tolist()
    t0 = time.perf_counter()
    stamps = []
    for chunk in llm.stream({"prompt_token_ids": prompt}, params):
        stamps.append(time.perf_counter())
    first, last = stamps[0], stamps[-1]
    print(json.dumps({"prefill": prompt_len / (first - t0), "decode": (len(stamps) - 1) / (last - first)}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="cores in all: one process's threads, split over the ranks")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--env", choices=["shm", "tcp"], default="shm")
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        m, tp, th, p, t, seed = a.worker
        return worker(m, int(tp), int(th), int(p), int(t), int(seed))
    configs = {f"1 x {a.threads} threads": (1, a.threads), f"tp {a.tp} x {a.threads // a.tp}": (a.tp, a.threads // a.tp)}
    env = dict(os.environ, **(TCP_ENV if a.env == "tcp" else {}))
    results = {k: [] for k in configs}
    order = list(configs)
    for r in range(a.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            tp, th = configs[name]
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--model", a.model, "--worker", a.model,
                                  str(tp), str(th), str(a.prompt), str(a.tokens), str(r)],
                                 env=env, capture_output=True, text=True, timeout=900)
            line = [l for l in out.stdout.splitlines() if l.startswith("{")]
            if out.returncode or not line:
                sys.exit(f"{name} failed: {out.stderr[-2000:]}")
            results[name].append(json.loads(line[-1]))
            print(f"round {r} {name}: {results[name][-1]}", flush=True)
    print(f"\n{os.path.basename(a.model)}, {a.env}, {a.rounds} rounds alternating, medians:")
    base = order[0]
    for name in order:
        pre = statistics.median(x["prefill"] for x in results[name])
        dec = statistics.median(x["decode"] for x in results[name])
        b_pre = statistics.median(x["prefill"] for x in results[base])
        b_dec = statistics.median(x["decode"] for x in results[base])
        print(f"  {name:18} prefill {pre:8.1f} tok/s (x{pre / b_pre:.2f})   decode {dec:7.1f} tok/s (x{dec / b_dec:.2f})")


if __name__ == "__main__":
    main()
