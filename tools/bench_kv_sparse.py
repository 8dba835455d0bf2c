"""Decode speed with a sparse KV cache (issue 22: keep the largest-magnitude fraction of each key and value
row) against the dense cache, where attention is a large part of a step: several sequences at a long
context. Each engine first reads the prompts (max_tokens=1, which leaves them in the prefix cache), then
decodes `--tokens` more from the cached prompts; the second call's time is the decode (a prompt's last
partial block is read again, the same for every engine). Engines alternate within every round; medians.

    python tools/bench_kv_sparse.py --model qwen2.5-coder-0.5b-instruct.gguf --seqs 8 --context 4096 \\
        --kv bf16:0 bf16:0.5 int8:0 int8:0.5 --threads 2 --rounds 2 [--out results.json]
"""
import argparse
import json
import statistics
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per sequence")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed")
    ap.add_argument("--kv", nargs="+", default=["bf16:0", "bf16:0.5", "int8:0", "int8:0.5"],
                    help="kv cache dtype:sparsity of each engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import corelm
    from corelm import SamplingParams
    rng = np.random.default_rng(0)
    engines = {}
    for spec in a.kv:
        dtype, sparsity = spec.split(":")
        engines[spec] = corelm.LLM(a.model, threads=a.threads, kv_cache_dtype=dtype, kv_sparsity=float(sparsity),
                                   max_seq_len=a.context + a.tokens + 64, max_num_seqs=a.seqs,
                                   speculative_model=None)
        engines[spec].wait_for_huge_pages(timeout=300)
    vocab = min(30000, engines[a.kv[0]].engine.spec.vocab_size)
    runs = {k: [] for k in engines}
    for rnd in range(a.rounds):
        prompts = [{"prompt_token_ids": rng.integers(100, vocab, a.context).tolist()} for _ in range(a.seqs)]
        for name in (a.kv if rnd % 2 == 0 else a.kv[::-1]):
            llm = engines[name]
            llm.reset()
            llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            t = time.perf_counter()
            out = llm.generate(prompts, SamplingParams(max_tokens=a.tokens + 1, temperature=0, ignore_eos=True))
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in out)
            runs[name].append(n / dt)
            print(f"round {rnd} kv {name:10s} {n / dt:7.1f} generated tok/s ({a.seqs} x {a.context} context)", flush=True)
    base = {d: statistics.median(runs[f"{d}:0"]) for d in ("bf16", "int8", "fp32") if f"{d}:0" in runs}
    print("| kv cache | sparsity | generated tok/s | vs dense bf16 | vs dense int8 |\n|---|---|---|---|---|")
    result = {}
    for name, r in runs.items():
        d, s = name.split(":")
        m = statistics.median(r)
        result[name] = {"tok_s": round(m, 2), "runs": r}
        vs = [f"{m / base[k]:.2f}x" if k in base else "" for k in ("bf16", "int8")]
        print(f"| {d} | {s} | {m:.1f} | {vs[0]} | {vs[1]} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "seqs": a.seqs, "context": a.context, "tokens": a.tokens,
                       "threads": a.threads, "results": result}, f, indent=1)


if __name__ == "__main__":
    main()
