"""Throughput with many sequences at once: corelm's continuous batcher against llama.cpp's
llama-batched-bench, alternating in the same run.

For each thread count and each number of concurrent sequences N: N prompts of --npp random tokens, then
--ntg greedy tokens each (EOS ignored). Reported like llama-batched-bench: S_PP (prompt tokens/s over
the prefill phase), S_TG (generated tokens/s once every sequence is decoding) and S (prompt plus
generated tokens / total time).

    python tools/bench/bench_batching.py --threads 1 2 --npl 1 4 16 64 --rounds 2
    python tools/bench/bench_batching.py --isa avx512_bf16 avx512   # corelm once per kernel table (CORELM_ISA)
    python tools/bench/bench_batching.py --weights q8               # corelm q8 against llama.cpp Q8_0
    python tools/bench/bench_batching.py --weights auto --model F.gguf --gguf F.gguf   # both engines on one file
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

PEERS = os.environ.get("PEERS", os.path.expanduser("~/corelm-peers"))
HERE = os.path.dirname(os.path.abspath(__file__))


GGUF_FOR = {"bf16": "F16", "q8": "Q8_0", "q4": "Q4_0"}  # llama.cpp's format at the same bits per weight


def corelm_worker(model, threads, n, npp, ntg, kv, weights):
    """Runs in a subprocess so each measurement starts fresh; prints one JSON line."""
    sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
    import numpy as np
    import corelm
    from corelm import SamplingParams
    per_token = None
    # a converted folder keeps its format; "auto" loads the model as it is (a GGUF's blocks kept)
    wkw = {"dtype": "bf16"} if weights == "bf16" else {} if weights == "auto" else {"weights": weights}
    wkw["speculative_model"] = None   # plain batched decode (llama-batched-bench's)
    llm = corelm.LLM(model, threads=threads, max_seq_len=npp + ntg + 16, kv_cache_dtype=kv,
                     kv_cache_gb=None, max_num_seqs=max(n, 1), max_batch_tokens=512, **wkw)
    needed_blocks = n * -(-(npp + ntg + 1) // llm.engine.core.kv_block_size)
    if llm.engine.core.kv_blocks < needed_blocks:  # size the pool for the whole batch: this measures batching, not preemption
        per_block = llm.engine.core.kv_bytes / llm.engine.core.kv_blocks
        llm = corelm.LLM(model, threads=threads, max_seq_len=npp + ntg + 16, kv_cache_dtype=kv,
                         kv_cache_gb=needed_blocks * per_block / 2**30 * 1.01, max_num_seqs=n, max_batch_tokens=512,
                         **wkw)
    llm.wait_for_huge_pages(timeout=300)   # decode at its steady speed (see LLM.wait_for_huge_pages)
    rng = np.random.default_rng(0)
    vocab = llm.spec.vocab_size
    llm.generate([list(rng.integers(3, vocab, 16))], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    llm.reset()
    eng = llm.engine
    params = SamplingParams(max_tokens=ntg, temperature=0, ignore_eos=True)
    for i in range(n):
        eng.add_request(f"r{i}", list(rng.integers(3, vocab, npp)), params)
    started, t_all, n_tok, tok_all = set(), None, 0, 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        for rid, ch in eng.step():
            if ch.token_id is not None:
                n_tok += 1
                started.add(rid)
        if t_all is None and len(started) == n:
            t_all, tok_all = time.perf_counter(), n_tok
    t1 = time.perf_counter()
    print(json.dumps({"S_PP": n * npp / (t_all - t0), "S_TG": (n_tok - tok_all) / max(t1 - t_all, 1e-9),
                      "S": (n * npp + n_tok) / (t1 - t0), "preemptions": eng.num_preemptions}))


def run_corelm(model, threads, n, npp, ntg, kv, weights, isa=None):
    env = dict(os.environ, CORELM_ISA=isa) if isa else None
    out = subprocess.run([sys.executable, __file__, "--worker", model, str(threads), str(n), str(npp), str(ntg), kv,
                          weights],
                         capture_output=True, text=True, timeout=3600, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llama(exe, gguf, threads, n, npp, ntg):
    cmd = [exe, "-m", gguf, "-c", str(n * (npp + ntg) + 64), "-npp", str(npp), "-ntg", str(ntg), "-npl", str(n),
           "-t", str(threads), "-tb", str(threads), "-ub", "512", "-b", "2048"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]):
            return {"S_PP": float(cells[5]), "S_TG": float(cells[7]), "S": float(cells[9])}
    raise RuntimeError("could not parse llama-batched-bench output:\n" + out.stdout[-1500:] + out.stderr[-1500:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=os.path.join(PEERS, "models", "qwen0.5b-dims-rand"))
    ap.add_argument("--weights", default="bf16", choices=sorted(GGUF_FOR) + ["auto"],
                    help="corelm's weight format; llama.cpp runs the GGUF of the same bits (F16, Q8_0, Q4_0); "
                         "auto: --model as it is, e.g. the --gguf file itself")
    ap.add_argument("--gguf", default=None, help="default: the peers' qwen0.5b-dims-rand GGUF matching --weights")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--npl", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("--kv", default="bf16", choices=["fp32", "bf16", "int8"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--isa", nargs="+", default=None,
                    help="run corelm once per kernel table (CORELM_ISA), e.g. avx512_bf16 avx512; default: its own choice")
    ap.add_argument("--llama-batched-bench", default=None,
                    help="the llama.cpp binary to run (e.g. a build without AMX where its AMX path faults); "
                         "default: the peers' build, skipped if absent")
    ap.add_argument("--out", default=None, help="raw results as JSON")
    a = ap.parse_args()
    if a.worker:
        m, t, n, npp, ntg, kv, w = a.worker
        return corelm_worker(m, int(t), int(n), int(npp), int(ntg), kv, w)
    if a.weights == "auto" and not a.gguf:
        ap.error("--weights auto needs --gguf (the file llama.cpp runs; --model the same file or its folder)")
    a.gguf = a.gguf or os.path.join(PEERS, "models", "gguf", f"qwen0.5b-dims-rand-{GGUF_FOR[a.weights]}.gguf")
    if a.llama_batched_bench and not os.path.isfile(a.llama_batched_bench):
        ap.error(f"--llama-batched-bench: no such file {a.llama_batched_bench}")
    a.llama_batched_bench = a.llama_batched_bench or os.path.join(PEERS, "llama.cpp-build", "bin", "llama-batched-bench")
    have_llama = os.path.exists(a.llama_batched_bench) and os.path.exists(a.gguf)
    corelms = [f"corelm:{isa}" for isa in a.isa] if a.isa else ["corelm"]
    raw = []
    for r in range(a.rounds):
        for t in a.threads:
            for n in a.npl:
                engines = corelms + ["llama"]
                engines = engines[r % len(engines):] + engines[:r % len(engines)]  # rotate the order each round
                for e in engines:
                    if e == "llama" and not have_llama:
                        continue
                    res = run_corelm(a.model, t, n, a.npp, a.ntg, a.kv, a.weights, e.partition(":")[2] or None) \
                        if e != "llama" else run_llama(a.llama_batched_bench, a.gguf, t, n, a.npp, a.ntg)
                    raw.append(dict(engine=e, threads=t, n=n, round=r, **res))
                    print(f"[{time.strftime('%H:%M:%S')}] {e} T={t} N={n}: " +
                          ", ".join(f"{k} {v:.1f}" for k, v in res.items() if isinstance(v, float)), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(raw, f, indent=1)
    med = lambda e, t, n, k: statistics.median([x[k] for x in raw if (x["engine"], x["threads"], x["n"]) == (e, t, n)] or [float("nan")])
    print(f"\n| corelm | threads | N | corelm S_TG | llama.cpp S_TG | ratio | corelm S | llama.cpp S | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for e in corelms:
        for t in a.threads:
            for n in a.npl:
                c, l = med(e, t, n, "S_TG"), med("llama", t, n, "S_TG")
                cs, ls = med(e, t, n, "S"), med("llama", t, n, "S")
                print(f"| {e} | {t} | {n} | {c:.1f} | {l:.1f} | {c / l:.2f}x | {cs:.1f} | {ls:.1f} | {cs / ls:.2f}x |")


if __name__ == "__main__":
    main()
