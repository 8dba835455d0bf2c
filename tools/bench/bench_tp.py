#!/usr/bin/env python3
"""Several processes against one on the same cores: prefill and decode tok/s of
`LLM(model, tensor_parallel_size=N, threads=T/N)` (or pipeline_parallel_size) against `LLM(model, threads=T)`,
each configuration a fresh process, alternating (A, B, B, A, ...), medians over the rounds. Greedy, EOS
ignored, no speculation, fresh random prompts per measurement (no prefix-cache hits); with --seqs S, S
sequences at once (decode tok/s counts all of them).

    python tools/bench/bench_tp.py --model qwen2.5-coder-0.5b-instruct.gguf [--tp 2 | --pp 2] [--threads 2]
        [--rounds 4] [--prompt 128] [--tokens 64] [--seqs 1] [--env tcp]

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


def worker(model, kind, size, threads, prompt_len, tokens, seqs, seed):
    import numpy as np
    import corelm
    llm = corelm.LLM(model, threads=threads, speculative_model=None, **{f"{kind}_parallel_size": size})
    engine = llm.engine
    vocab = engine.vocab_size
    rng = np.random.default_rng(seed)
    params = corelm.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": rng.integers(100, vocab - 100, 32).tolist()}],
                 corelm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))     # warm-up
    for i in range(seqs):
        engine.add_request(f"r{i}", {"prompt_token_ids": rng.integers(100, vocab - 100, prompt_len).tolist()}, params)
    t0, first, generated = time.perf_counter(), None, 0
    while engine.has_unfinished_requests():
        out = engine.step()
        now = time.perf_counter()
        n = sum(1 for _, chunk in out if chunk.token_id is not None)
        if n and first is None:
            first, generated = now, 0       # the step that gave every prompt's first token ends the prefill
            continue
        generated += n
    last = time.perf_counter()
    print(json.dumps({"prefill": seqs * prompt_len / (first - t0), "decode": generated / (last - first)}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=0)
    ap.add_argument("--pp", type=int, default=0)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="cores in all: one process's threads, split over the ranks")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--env", choices=["shm", "tcp"], default="shm")
    ap.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        m, kind, size, th, p, t, seqs, seed = a.worker
        return worker(m, kind, int(size), int(th), int(p), int(t), int(seqs), int(seed))
    kind, size = ("pipeline", a.pp) if a.pp else ("tensor", a.tp or 2)
    configs = {f"1 x {a.threads} threads": ("tensor", 1, a.threads),
               f"{kind[:4]} {size} x {a.threads // size}": (kind, size, a.threads // size)}
    env = dict(os.environ, **(TCP_ENV if a.env == "tcp" else {}))
    results = {k: [] for k in configs}
    order = list(configs)
    for r in range(a.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            k, n, th = configs[name]
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--model", a.model, "--worker", a.model,
                                  k, str(n), str(th), str(a.prompt), str(a.tokens), str(a.seqs), str(r)],
                                 env=env, capture_output=True, text=True, timeout=900)
            line = [l for l in out.stdout.splitlines() if l.startswith("{")]
            if out.returncode or not line:
                sys.exit(f"{name} failed: {out.stderr[-2000:]}")
            results[name].append(json.loads(line[-1]))
            print(f"round {r} {name}: {results[name][-1]}", flush=True)
    print(f"\n{os.path.basename(a.model)}, {a.env}, {a.seqs} sequence(s), {a.rounds} rounds alternating, medians:")
    base = order[0]
    for name in order:
        pre = statistics.median(x["prefill"] for x in results[name])
        dec = statistics.median(x["decode"] for x in results[name])
        b_pre = statistics.median(x["prefill"] for x in results[base])
        b_dec = statistics.median(x["decode"] for x in results[base])
        print(f"  {name:18} prefill {pre:8.1f} tok/s (x{pre / b_pre:.2f})   decode {dec:7.1f} tok/s (x{dec / b_dec:.2f})")


if __name__ == "__main__":
    main()
