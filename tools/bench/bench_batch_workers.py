"""`corelm batch` throughput: N workers x K threads, e.g. 2 workers x 1 thread against 1 worker x 2.

    python tools/bench/bench_batch_workers.py [--requests 120] [--max-tokens 16] [--rounds 3]
                                        [--configs 2x1,1x2] [--model PATH] [--task-size 8]

Writes a batch of short chat requests (distinct prompts, greedy, ignore_eos so every request makes
exactly --max-tokens tokens), then runs the whole `corelm batch` path in-process (spawned workers,
pinned CPU sets, model load included) for each configuration, alternating configurations round by
round so a noisy neighbour hurts all of them alike. Prints each run and the median requests/s and
generated tokens/s per configuration. Default model: the embedded SmolLM2-135M-Instruct Q4_1."""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python"))
from corelm.entrypoints.batch import run_batch  # noqa: E402

TOPICS = ["the sea", "a red fox", "bread", "winter", "a lighthouse", "trains", "bees", "the moon", "tea", "maps"]


def write_requests(path, n, max_tokens):
    with open(path, "w") as f:
        for i in range(n):
            body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]} "
                                                             f"(request {i})."}]}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="2x1,1x2", help="WORKERSxTHREADS, comma-separated")
    ap.add_argument("--model", default=None)
    ap.add_argument("--task-size", type=int, default=8)
    a = ap.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")]
    results = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "in.jsonl")
        write_requests(src, a.requests, a.max_tokens)
        for r in range(a.rounds):
            for workers, threads in configs:
                out = os.path.join(tmp, f"out-{workers}x{threads}-{r}.jsonl")
                s = run_batch(src, out, workers=workers, threads=threads, model=a.model, task_size=a.task_size,
                              progress=False)
                assert s["requests"] == a.requests and s["errors"] == 0, s
                rps, tps = s["requests"] / s["seconds"], s["generated_tokens"] / s["seconds"]
                results[(workers, threads)].append((rps, tps))
                print(f"round {r + 1}: {workers} worker(s) x {threads} thread(s): {s['seconds']:.1f} s, "
                      f"{rps:.2f} req/s, {tps:.1f} tok/s", flush=True)
    print(f"\n{a.requests} chat requests x {a.max_tokens} tokens, median of {a.rounds} rounds (model load included):")
    for (workers, threads), runs in results.items():
        print(f"  {workers} worker(s) x {threads} thread(s): {statistics.median(x for x, _ in runs):.2f} req/s, "
              f"{statistics.median(y for _, y in runs):.1f} tok/s")


if __name__ == "__main__":
    main()
