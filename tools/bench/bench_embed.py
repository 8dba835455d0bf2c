#!/usr/bin/env python3
"""Embeddings/s: corelm's LLM.embed against llama.cpp's llama-embedding on the same BERT GGUF (and corelm on
the HF folder too), N inputs of exactly T tokens of real text, 1 and 2 threads, rounds alternating engines,
medians. Also the cosine between the two engines' embeddings of the same inputs.

    python tools/bench/bench_embed.py [--models /work/models/all-MiniLM-L6-v2-f32.gguf,...-f16.gguf,<HF folder>,
                                                 ...-f32.gguf@fp32]
        [--threads 1,2] [--rounds 3] [--inputs 128] [--tokens 128]
        [--llama-embedding /work/peers/llama.cpp-build/bin/llama-embedding]

Inputs: consecutive words of python/corelm/data/calibration.txt from a different offset each, as many as make
exactly T tokens with [CLS] and [SEP] (the model's tokenizer; a word that would overshoot is skipped).
- corelm: a fresh process per measurement: corelm.LLM(model, threads=t), one warm-up embed of other text,
  then the wall time of LLM.embed(texts) (tokenizing, batches of up to 1024 tokens through hidden_batch,
  pooling and normalizing included). dtype as the engine picks it ("auto"), or MODEL@DTYPE's.
- llama-embedding: one process per measurement with the texts in a file, one per line, -c/-b/-ub 256 (2
  inputs per batch: its fastest here, 1.35x its 2048, whose batch attends over all 16 inputs' tokens under a
  mask; 128 asserts; --llama-batch to change), --pooling mean, -t/-tb t; the
  time from its first batch to its end by its own log's timestamps (after loading, its warm-up run and
  tokenizing; its llama_perf "prompt eval time" reads 0 for an encoder), so the ratio slightly favours
  llama.cpp. Its token count is checked against corelm's.
A GGUF row compares the two engines on that file; an HF folder row compares corelm on the folder with
llama-embedding on the F32 GGUF (the first .gguf whose name says f32, else the first .gguf)."""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALIBRATION = os.path.join(REPO, "python", "corelm", "data", "calibration.txt")
MINILM = "/work/models/all-MiniLM-L6-v2"
DEFAULT_MODELS = f"{MINILM}-f32.gguf,{MINILM}-f32.gguf@fp32,{MINILM}-f16.gguf,{MINILM}"
WARMUP_TEXTS = ["a warm-up sentence that is not one of the measured inputs"] * 4


def make_texts(tokenizer, n, tokens):
    # no backslashes: llama-embedding unescapes its prompts ("\\n" in the text's code would split a line)
    words = [w for w in open(CALIBRATION, encoding="utf-8").read().split() if "\\" not in w]
    texts = []
    for i in range(n):
        start, picked, skipped = (i * 37) % len(words), [], 0
        k = start
        while skipped < 20:
            w = words[k % len(words)]
            k += 1
            length = len(tokenizer.encode(" ".join(picked + [w])))
            if length <= tokens:
                picked.append(w)
                skipped = 0
                if length == tokens:
                    break
            else:
                skipped += 1
        texts.append(" ".join(picked))
    return texts


def corelm_worker(model, threads, texts_file, out_file):
    import corelm
    texts = json.load(open(texts_file))
    path, _, dtype = model.partition("@")
    llm = corelm.LLM(path, threads=threads, dtype=dtype or "auto")
    llm.embed(WARMUP_TEXTS)
    t0 = time.perf_counter()
    outs = llm.embed(texts)
    seconds = time.perf_counter() - t0
    np.save(out_file, np.array([o.outputs.embedding for o in outs], np.float32))
    n_tokens = sum(len(o.prompt_token_ids) for o in outs)
    print(json.dumps({"seconds": seconds, "tokens": n_tokens, "dtype": str(llm.engine.dtype)}), flush=True)


def corelm_run(model, threads, texts_file, out_file):
    r = subprocess.run([sys.executable, __file__, "--worker", model, str(threads), texts_file, out_file],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"corelm worker failed: {r.stderr[-1500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


_BATCH = re.compile(r"batch_decode: n_tokens = (\d+)")


def _log_seconds(line):
    """A llama.cpp log line's timestamp ("M.SS.mmm.uuu ...") in seconds since the process started."""
    m, sec, ms, us = line.split()[0].split(".")
    return int(m) * 60 + int(sec) + int(ms) / 1e3 + int(us) / 1e6


def llama_run(binary, model, threads, texts_file, batch):
    """One llama-embedding process; the time from its first batch to its end, from its own log timestamps
    (-v: llama_perf's closing lines; its "prompt eval time" stays 0 for an encoder)."""
    r = subprocess.run([binary, "-m", model, "-f", texts_file, "-t", str(threads), "-tb", str(threads),
                        "-c", str(batch), "-b", str(batch), "-ub", str(batch), "--pooling", "mean",
                        "--embd-normalize", "2", "--embd-output-format", "array", "-v"],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"llama-embedding failed: {r.stderr[-1500:]}")
    lines = r.stderr.splitlines()
    batches = [ln for ln in lines if "batch_decode: n_tokens" in ln]
    end = next((ln for ln in lines if "llama_perf_context_print" in ln), None)
    if not batches or end is None:
        raise RuntimeError(f"llama-embedding's log has no batch_decode or llama_perf lines: {r.stderr[-800:]}")
    start = r.stdout.index("[")
    emb = np.array(json.loads(r.stdout[start:r.stdout.rindex("]") + 1]), np.float32)
    return {"seconds": _log_seconds(end) - _log_seconds(batches[0]), "embeddings": emb,
            "tokens": sum(int(_BATCH.search(ln).group(1)) for ln in batches)}


def cosines(a, b):
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inputs", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--llama-embedding", default="/work/peers/llama.cpp-build/bin/llama-embedding")
    ap.add_argument("--llama-batch", type=int, default=256, help="llama-embedding's -c, -b and -ub")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        model, threads, texts_file, out_file = a.worker
        corelm_worker(model, int(threads), texts_file, out_file)
        return
    from corelm.loader import load_model

    models = a.models.split(",")              # each PATH or PATH@DTYPE
    ggufs = [m.partition("@")[0] for m in models if m.partition("@")[0].endswith(".gguf")]
    f32 = next((g for g in ggufs if "f32" in os.path.basename(g).lower()), ggufs[0] if ggufs else None)
    peer = {m: m.partition("@")[0] if m.partition("@")[0].endswith(".gguf") else f32 for m in models}
    threads = [int(t) for t in a.threads.split(",")]
    texts = make_texts(load_model(models[0].partition("@")[0]).tokenizer, a.inputs, a.tokens)
    work = tempfile.mkdtemp(prefix="bench_embed_")
    texts_json, texts_txt = os.path.join(work, "texts.json"), os.path.join(work, "texts.txt")
    json.dump(texts, open(texts_json, "w"))
    with open(texts_txt, "w") as f:
        f.write("\n".join(texts))
    print(f"{a.inputs} inputs of {a.tokens} tokens (calibration text), threads {threads}, {a.rounds} rounds, "
          f"engines alternating; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at start", flush=True)

    results = {}      # (model, threads, engine) -> [embeddings/s]
    info = {}
    for r in range(a.rounds):
        measured = set()       # (GGUF, threads) llama-embedding ran on this round
        for model in models:
            for t in threads:
                out = os.path.join(work, f"corelm-{model.replace('/', '_')}.npy")
                c = corelm_run(model, t, texts_json, out)
                results.setdefault((model, t, "corelm"), []).append(a.inputs / c["seconds"])
                info[(model, "corelm")] = (c, out)
                line = f"round {r + 1}: {os.path.basename(model)} t={t}: corelm {a.inputs / c['seconds']:.1f} emb/s"
                if peer[model] and (peer[model], t) not in measured:
                    ll = llama_run(a.llama_embedding, peer[model], t, texts_txt, a.llama_batch)
                    results.setdefault((peer[model], t, "llama"), []).append(a.inputs / ll["seconds"])
                    info[(peer[model], "llama")] = ll
                    measured.add((peer[model], t))
                    line += f", llama-embedding {a.inputs / ll['seconds']:.1f} emb/s"
                print(line, flush=True)

    print(f"\n| model | corelm dtype | threads | corelm emb/s | llama-embedding emb/s (file) | corelm / llama.cpp |")
    print("|---|---|---:|---:|---:|---:|")
    for model in models:
        c, _ = info[(model, "corelm")]
        for t in threads:
            mine = statistics.median(results[(model, t, "corelm")])
            theirs = statistics.median(results[(peer[model], t, "llama")]) if peer[model] else None
            print(f"| {os.path.basename(model)} | {c['dtype']} | {t} | {mine:.1f} | "
                  + (f"{theirs:.1f} ({os.path.basename(peer[model])}) | {mine / theirs:.2f}x |" if theirs else "- | - |"))
    print()
    for model in models:
        c, out = info[(model, "corelm")]
        if not peer[model]:
            continue
        ll = info[(peer[model], "llama")]
        if c["tokens"] != ll["tokens"]:
            print(f"warning: {os.path.basename(model)}: corelm ran {c['tokens']} tokens, llama.cpp {ll['tokens']}")
        cos = cosines(np.load(out), ll["embeddings"])
        print(f"cosine corelm ({os.path.basename(model)}) vs llama-embedding ({os.path.basename(peer[model])}): "
              f"first 3 {', '.join(f'{x:.6f}' for x in cos[:3])}; min over {len(cos)} {cos.min():.6f}")


if __name__ == "__main__":
    main()
