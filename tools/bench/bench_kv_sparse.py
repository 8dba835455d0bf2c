"""Decode speed with a sparse KV cache (issue 22: keep the largest-magnitude fraction of each key and value
row) against the dense cache, where attention is a large part of a step: several sequences at a long
context. Each engine first reads the prompts (max_tokens=1, which leaves them in the prefix cache), then
decodes `--tokens` more from the cached prompts; the second call's time is the decode (a prompt's last
partial block is read again, the same for every engine). Engines alternate within every round; medians.

    python tools/bench/bench_kv_sparse.py --model qwen2.5-coder-0.5b-instruct.gguf --seqs 8 --context 4096 \\
        --kv bf16:0 bf16:0.5 int8:0 int8:0.5 --threads 2 --rounds 2 [--out results.json]

--attention times attention alone, as a decode step runs it: one query row per sequence against every
layer's cache (`_core.testing.KVCache.attend`, the engine's attention over 16-token blocks, one thread per
process) for --seqs sequences of --context tokens, the Qwen2.5-0.5B shape by default (--layers 24
--kv-heads 2 --head-dim 64 --group 7); --procs 2 runs two processes at once (each its own caches, rounds
started together), as two decode threads share the memory. No model is loaded.

    python tools/bench/bench_kv_sparse.py --attention --seqs 4 --context 4096 --kv int8:0 int8:0.5 --procs 2
"""
import argparse
import json
import multiprocessing as mp
import statistics
import time

import numpy as np

BLOCK = 16   # the engine's KV block size (engine/model_builder.py: KV_BLOCK_SIZE)


def attention_worker(a, start, out):
    """One process: every --kv engine's caches filled with random rows, then per round (after `start`, a
    barrier shared with the other processes) the ms of one decode step's attention for each engine."""
    from corelm import _core
    rng = np.random.default_rng(len(out))
    per_seq = -(-a.context // BLOCK)
    caches = {}
    for spec in a.kv:
        dtype, sparsity = spec.split(":")
        layers = []
        for _ in range(a.layers):
            c = _core.testing.KVCache(a.kv_heads, a.head_dim, a.seqs * per_seq, BLOCK, dtype, float(sparsity))
            for t in range(a.seqs * per_seq * BLOCK):
                for h in range(a.kv_heads):
                    c.store(t // BLOCK, t % BLOCK, h, False, rng.standard_normal(a.head_dim).astype(np.float32))
                    c.store(t // BLOCK, t % BLOCK, h, True, rng.standard_normal(a.head_dim).astype(np.float32))
            layers.append(c)
        caches[spec] = layers
    isa = _core.kernel_tables()[0]
    q = rng.standard_normal((a.group, a.head_dim)).astype(np.float32)
    blocks = [np.arange(s * per_seq, (s + 1) * per_seq, dtype=np.int32) for s in range(a.seqs)]
    ms = {spec: [] for spec in a.kv}
    for rnd in range(a.rounds):
        for spec in (a.kv if rnd % 2 == 0 else a.kv[::-1]):
            start.wait(timeout=600)   # a process that died breaks the barrier instead of hanging the rest
            t = time.perf_counter()
            for c in caches[spec]:
                for b in blocks:
                    for h in range(a.kv_heads):
                        c.attend(isa, h, b, 0, a.context - 1, q, a.head_dim ** -0.5, 0.0)
            ms[spec].append((time.perf_counter() - t) * 1e3)
    out.append(ms)


def attention(a):
    start = mp.Barrier(a.procs)
    with mp.Manager() as m:
        out = m.list()
        procs = [mp.Process(target=attention_worker, args=(a, start, out)) for _ in range(a.procs)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs) or len(out) != a.procs:
            raise SystemExit(f"--attention: a process failed (exit codes {[p.exitcode for p in procs]})")
        runs = {spec: [v for r in out for v in r[spec]] for spec in a.kv}
    base = statistics.median(runs[a.kv[0]])
    print(f"attention of one decode step: {a.seqs} sequences x {a.context} tokens, {a.layers} layers x "
          f"{a.kv_heads} KV heads (group {a.group}, head size {a.head_dim}), {a.procs} process(es)")
    print(f"| kv cache | sparsity | ms per step | vs {a.kv[0]} |\n|---|---|---|---|")
    result = {}
    for spec, r in runs.items():
        d, sp = spec.split(":")
        m = statistics.median(r)
        result[spec] = {"ms": round(m, 3), "runs": r}
        print(f"| {d} | {sp} | {m:.2f} | {base / m:.2f}x |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"mode": "attention", "args": vars(a), "results": result}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the model (not with --attention)")
    ap.add_argument("--attention", action="store_true", help="attention alone, no model (see above)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--group", type=int, default=7, help="query heads per KV head")
    ap.add_argument("--procs", type=int, default=1, help="--attention: processes at once")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per sequence")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed")
    ap.add_argument("--kv", nargs="+", default=["bf16:0", "bf16:0.5", "int8:0", "int8:0.5"],
                    help="kv cache dtype:sparsity of each engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.attention:
        return attention(a)
    if not a.model:
        ap.error("--model is needed (or --attention)")
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
