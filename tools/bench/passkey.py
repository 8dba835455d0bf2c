#!/usr/bin/env python3
"""Passkey retrieval at long context, as llama.cpp's llama-passkey: a random 5-digit key hidden at a given depth
of filler text ("The grass is green. The sky is blue. ..."), then "What is the pass key?"; greedy, the model
must answer with the key. One line per (length, depth) with the prompt's tokens, the answer and whether it is
right, and a summary of how many were found.

    python tools/bench/passkey.py --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf [--lengths 4096,16384,32768]
        [--depths 0.1,0.5,0.9] [--threads 2] [--kv auto] [--seed 0]

Lengths are in tokens (the filler is repeated until the prompt reaches about that many); the engine's context is
set to the longest length plus room for the answer."""
import argparse
import random
import sys
import time

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz "
        "you about the important information there.\n\n")


def prompt_ids(llm, length: int, depth: float, key: int):
    """Chat-templated ids of about `length` tokens with the key's line at `depth` (0: start, 1: end)."""
    tok = llm.engine.tokenizer
    per_filler = len(tok.encode(FILLER, add_special_tokens=False))
    n = max(1, (length - 120) // per_filler)
    before = int(n * depth)
    text = (TASK + FILLER * before + f"The pass key is {key}. Remember it. {key} is the pass key. "
            + FILLER * (n - before) + "\nWhat is the pass key? The pass key is")
    return llm.engine.encode_chat([{"role": "user", "content": text}])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv", default="auto", help="kv_cache_dtype")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    import corelm
    lengths = [int(x) for x in a.lengths.split(",")]
    llm = corelm.LLM(a.model, threads=a.threads, kv_cache_dtype=a.kv, max_seq_len=max(lengths) + 64,
                     max_batch_tokens=512, enable_prefix_caching=False, speculative_model=None)
    rng = random.Random(a.seed)
    found = total = 0
    for length in lengths:
        for depth in [float(x) for x in a.depths.split(",")]:
            key = rng.randint(10000, 99999)
            ids = prompt_ids(llm, length, depth, key)
            t0 = time.perf_counter()
            out = llm.generate({"prompt_token_ids": ids}, corelm.SamplingParams(temperature=0, max_tokens=12))
            answer = out[0].outputs[0].text.strip()
            ok = str(key) in answer
            found, total = found + ok, total + 1
            print(f"length {len(ids):6d} depth {depth:.2f} key {key}: {'found' if ok else 'MISSED'} "
                  f"({answer[:40]!r}, {time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{found} of {total} keys found")
    return 0 if found == total else 1


if __name__ == "__main__":
    sys.exit(main())
