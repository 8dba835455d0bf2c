"""Time to first token of a long prompt, cold against a restarted engine that reads the prompt's KV blocks
from the disk prefix cache (--prefix-cache-dir). Every run is a fresh process (a restart): one fills the
cache, then cold and warm runs alternate (cold, warm, warm, cold, ...) so a noisy neighbour hurts both alike.

    python tools/bench/bench_prefix_store.py [--model /work/models/qwen2.5-coder-0.5b-instruct.gguf]
                                             [--tokens 2000] [--runs 3] [--threads N] [--kv-cache-dtype auto]

A run loads the model, waits for its weights' huge pages (at most 30 s), then times one request of --tokens
random token ids and 1 greedy token: add_request to the first token. The cache's files stay in the OS page
cache between runs, as they would across a server restart. Prints each run and the medians."""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

DEFAULT_MODEL = "/work/models/qwen2.5-coder-0.5b-instruct.gguf"


def worker(args) -> None:
    import corelm
    options = dict(threads=args.threads, max_seq_len=args.tokens + 64, kv_cache_dtype=args.kv_cache_dtype,
                   speculative_model=None)
    if args.dir:
        options["prefix_cache_dir"] = args.dir
    llm = corelm.LLM(args.model, **options)
    llm.wait_for_huge_pages(timeout=30)
    rng = random.Random(1)
    prompt = [rng.randrange(100, min(llm.spec.vocab_size, 30000)) for _ in range(args.tokens)]
    engine = llm.engine
    t0 = time.perf_counter()
    engine.add_request("bench", prompt, corelm.SamplingParams(temperature=0, max_tokens=1))
    ttft = None
    while engine.has_unfinished_requests():
        for _, chunk in engine.step():
            if ttft is None and chunk.token_id is not None:
                ttft = time.perf_counter() - t0
    cached = chunk.cached_tokens   # the last chunk's (the engine forgets the count when the request ends)
    if engine.prefix_store is not None:
        engine.prefix_store.flush(timeout=120)
    print(json.dumps({"ttft_s": ttft, "cached_tokens": cached, "token": chunk.token_id}))


def run(args, directory) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--tokens", str(args.tokens),
           "--kv-cache-dtype", args.kv_cache_dtype] + (["--threads", str(args.threads)] if args.threads else [])
    out = subprocess.run(cmd + (["--dir", directory] if directory else []), capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="corelm-prefix-bench-") as d:
        fill = run(args, d)
        print(f"fill: ttft {fill['ttft_s']:.3f} s (cache written)", flush=True)
        times = {"cold": [], "warm": []}
        for i in range(args.runs):
            for kind in (("cold", "warm") if i % 2 == 0 else ("warm", "cold")):
                r = run(args, d if kind == "warm" else None)
                times[kind].append(r["ttft_s"])
                print(f"{kind}: ttft {r['ttft_s']:.3f} s, cached tokens {r['cached_tokens']}, first token "
                      f"{r['token']}", flush=True)
                assert r["token"] == fill["token"], "a warm run answered differently from the cold one"
        size = sum(os.path.getsize(os.path.join(root, f)) for root, _, fs in os.walk(d) for f in fs)
    cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
    print(f"{args.tokens} tokens, {os.path.basename(args.model)}: median ttft cold {cold:.3f} s, restarted with "
          f"the disk cache {warm:.3f} s ({cold / warm:.1f}x faster); cache {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
