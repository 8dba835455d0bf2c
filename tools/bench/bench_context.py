#!/usr/bin/env python3
"""Long context: decode tok/s with D tokens already in the KV cache and prefill tok/s of a D-token prompt, for
corelm and llama.cpp's llama-bench with flash attention (-fa 1, -d D) on the same GGUF, alternating engines
round by round, medians. Each corelm measurement is a fresh process (no prefix cache, no warm KV pages).

    python tools/bench/bench_context.py --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        [--depths 128,4096,16384] [--threads 1,2] [--rounds 3] [--tokens 32] [--kv bf16,int8] \\
        [--llama-bench /work/peers/llama.cpp-build/bin/llama-bench]

Decode's bandwidth ideal at depth D is the 128-token decode rate scaled by W / (W + KV(D)), W the weight bytes
one token reads and KV(D) the cache bytes it reads (D x bytes per token); the table gives each rate as a
fraction of it. Prefill rates are also given as a fraction of the 512-token prompt's (when 512 is a depth)."""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def corelm_run(model, depth, threads, tokens, kv):
    """One measurement in this process: {"prefill": tok/s of the D-token prompt, "decode": tok/s after it,
    "weight_bytes", "kv_bytes_per_token"}."""
    import time
    import numpy as np
    import corelm
    from corelm.engine.model_builder import kv_bytes_per_token
    llm = corelm.LLM(model, threads=threads, speculative_model=None, kv_cache_dtype=kv,
                     max_seq_len=depth + tokens + 16, max_batch_tokens=512, enable_prefix_caching=False)
    e = llm.engine
    rng = np.random.default_rng(depth)
    ids = rng.integers(100, e.vocab_size - 100, depth).tolist()
    e.add_request("r", {"prompt_token_ids": ids}, corelm.SamplingParams(temperature=0, max_tokens=tokens,
                                                                         ignore_eos=True))
    t0, first, n = time.perf_counter(), None, 0
    while e.has_unfinished_requests():
        out = e.step()
        now = time.perf_counter()
        if any(c.token_id is not None for _, c in out):
            if first is None:
                first = now
            else:
                n += 1
    last = time.perf_counter()
    return {"prefill": depth / (first - t0), "decode": n / (last - first), "weight_bytes": e.core.weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token(e.spec, e.kv_cache_dtype)}


def llama_run(binary, model, depth, threads, tokens, kv):
    """llama-bench at one depth: decode (-n tokens after -d depth) and prefill (-p depth), flash attention."""
    ctk = {"bf16": "f16", "int8": "q8_0", "fp32": "f32"}[kv]   # its nearest cache types
    out = {}
    for what, args in (("decode", ["-p", "0", "-n", str(tokens), "-d", str(depth)]),
                       ("prefill", ["-p", str(depth), "-n", "0"])):
        r = subprocess.run([binary, "-m", model, "-t", str(threads), "-fa", "1", "-ctk", ctk, "-ctv", ctk, "-r", "1",
                            "-o", "json", *args], capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {r.stderr[-500:]}")
        out[what] = json.loads(r.stdout)[0]["avg_ts"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--depths", default="128,4096,16384")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--kv", default="bf16,int8")
    ap.add_argument("--llama-bench", default="/work/peers/llama.cpp-build/bin/llama-bench")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        model, depth, threads, tokens, kv = a.worker
        print(json.dumps(corelm_run(model, int(depth), int(threads), int(tokens), kv)), flush=True)
        return
    depths = [int(d) for d in a.depths.split(",")]
    peer = os.path.exists(a.llama_bench)
    results = {}   # (engine, kv, threads, depth) -> list of runs
    for rnd in range(a.rounds):
        for kv in a.kv.split(","):
            for t in [int(x) for x in a.threads.split(",")]:
                for depth in depths:
                    engines = ["corelm", "llama.cpp"] if peer else ["corelm"]
                    for eng in (engines if rnd % 2 == 0 else engines[::-1]):
                        if eng == "corelm":
                            r = subprocess.run([sys.executable, __file__, "--model", a.model, "--worker", a.model,
                                                str(depth), str(t), str(a.tokens), kv], capture_output=True, text=True)
                            if r.returncode != 0:
                                raise RuntimeError(r.stderr[-2000:])
                            run = json.loads(r.stdout.strip().splitlines()[-1])
                        else:
                            run = llama_run(a.llama_bench, a.model, depth, t, a.tokens, kv)
                        results.setdefault((eng, kv, t, depth), []).append(run)
                        print(f"round {rnd} {eng} kv={kv} t={t} d={depth}: prefill {run['prefill']:.1f} decode "
                              f"{run['decode']:.2f}", file=sys.stderr, flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("prefill", "decode")} for k, v in results.items()}
    print(f"\n{os.path.basename(a.model)}, {a.rounds} rounds alternating, medians; decode of {a.tokens} tokens")
    print("| kv | threads | depth | corelm decode | % of ideal | llama.cpp -fa decode | ratio | corelm prefill "
          "| vs 512 | llama.cpp prefill | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (eng, kv, t, depth), m in sorted(med.items(), key=lambda x: (x[0][1], x[0][2], x[0][3])):
        if eng != "corelm":
            continue
        runs = results[(eng, kv, t, depth)][0]
        base = med.get((eng, kv, t, min(depths)))
        ideal = base["decode"] * runs["weight_bytes"] / (runs["weight_bytes"] + runs["kv_bytes_per_token"] * depth)
        p512 = med.get((eng, kv, t, 512))
        peer_m = med.get(("llama.cpp", kv, t, depth))
        cols = [kv, t, depth, f"{m['decode']:.2f}", f"{100 * m['decode'] / ideal:.0f}%",
                f"{peer_m['decode']:.2f}" if peer_m else "-",
                f"{m['decode'] / peer_m['decode']:.2f}" if peer_m else "-", f"{m['prefill']:.1f}",
                f"{m['prefill'] / p512['prefill']:.2f}" if p512 else "-",
                f"{peer_m['prefill']:.1f}" if peer_m else "-",
                f"{m['prefill'] / peer_m['prefill']:.2f}" if peer_m else "-"]
        print("| " + " | ".join(str(c) for c in cols) + " |")


if __name__ == "__main__":
    main()
