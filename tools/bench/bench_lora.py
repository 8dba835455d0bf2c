#!/usr/bin/env python3
"""The cost of a LoRA adapter (cpp/model/lora.h: separate low-rank products per request) on decode and prefill,
against the base model: random adapters of each rank over q, k, v, o, gate, up and down of every layer, the
forward passes timed on the core model (decode: one sequence, one token a pass at a context of --context
tokens; prefill: one --prompt-tokens chunk), configurations alternating in each round.

    python tools/bench/bench_lora.py [MODEL] [--ranks 8 16 64] [--rounds 3] [--threads N]

Prints, per configuration, the median over rounds of decode ms per token and prefill ms per chunk, and the
ratio to the base model."""
import argparse
import statistics
import time

import numpy as np

import corelm


def random_targets(spec, rank, rng):
    d, f, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    shapes = {"wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q), "w_gate": (f, d), "w_up": (f, d),
              "w_down": (d, f)}
    return {f"layers.{i}.{p}": (rng.normal(0, 0.01, (rank, cols)).astype(np.float32),
                                rng.normal(0, 0.01, (rows, rank)).astype(np.float32))
            for i in range(spec.num_layers) for p, (rows, cols) in shapes.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="/work/models/qwen2.5-coder-0.5b-instruct.gguf")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=256, help="decode's position (default %(default)s)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    args = ap.parse_args()

    llm = corelm.LLM(args.model, threads=args.threads, max_seq_len=max(1024, args.context + args.decode_steps + 1),
                     speculative_model=None)
    llm.wait_for_huge_pages(60)
    core, spec = llm.engine.core, llm.engine.spec
    rng = np.random.default_rng(0)
    configs = [("base", -1)]
    for i, r in enumerate(args.ranks):
        core.add_lora(i, r, 2.0, random_targets(spec, r, rng))
        configs.append((f"rank {r}", i))
    bs = core.kv_block_size
    blocks = np.arange(-(-(args.context + args.decode_steps + args.prompt_tokens) // bs), dtype=np.int32)
    tokens = rng.integers(0, spec.vocab_size, args.context + args.decode_steps, dtype=np.int32)
    # the context's keys and values once (the same for every configuration: only the timing matters)
    core.forward_batch(tokens[:args.context], [(args.context, 0, blocks, False)])

    def decode(adapter):
        times = []
        for s in range(args.decode_steps):
            t = time.perf_counter()
            core.forward_batch(tokens[args.context + s:args.context + s + 1],
                               [(1, args.context + s, blocks, False, adapter)])
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    def prefill(adapter):
        t = time.perf_counter()
        core.forward_batch(tokens[:args.prompt_tokens], [(args.prompt_tokens, 0, blocks, False, adapter)])
        return (time.perf_counter() - t) * 1e3

    results = {name: ([], []) for name, _ in configs}
    for _ in range(args.rounds):
        for name, adapter in configs:
            results[name][0].append(decode(adapter))
            results[name][1].append(prefill(adapter))
    base_d, base_p = (statistics.median(v) for v in results["base"])
    print(f"{args.model}: {core.n_threads} threads, kernels {core.kernel_table}, weights {llm.engine.dtype}, "
          f"decode at {args.context} tokens, prefill of {args.prompt_tokens}; medians of {args.rounds} rounds")
    print(f"{'':>8} {'decode ms/tok':>14} {'x base':>7} {'prefill ms':>11} {'x base':>7}")
    for name, _ in configs:
        d, p = (statistics.median(v) for v in results[name])
        print(f"{name:>8} {d:14.2f} {d / base_d:7.3f} {p:11.1f} {p / base_p:7.3f}")


if __name__ == "__main__":
    main()
