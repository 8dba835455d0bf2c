"""Where greedy decoding with a compressed KV cache (bf16, int8) leaves the fp32-cache tokens, and why.

For each prompt: 256 greedy tokens with the fp32 cache (the reference), then the same with each other
cache type. Reports the first differing step, the reference's top-2 logit gap there, and the largest
logit error the compressed cache made (teacher-forced on the reference tokens) before that step.

  python tools/kv_divergence.py MODEL [--kv bf16 int8] [--tokens 256] [--prompts 4] [--dtype auto]
"""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
import corelm  # noqa: E402
from corelm import SamplingParams  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, when loaded by path
from core_forward import core_forward  # noqa: E402

CHAT = ["Write a short story about a robot who learns to paint.",
        "Explain how a hash map works, step by step.",
        "What are three good reasons to learn a second language?",
        "Write a Python function that checks whether a string is a palindrome."]


def prompts_for(llm, name, count):
    """The fixture prompts of tests/data/fixtures/NAME.json, then chat prompts, `count` in all."""
    fixture = os.path.join(ROOT, "tests", "data", "fixtures", f"{name}.json")
    out = []
    if os.path.exists(fixture):
        with open(fixture) as f:
            out = [c["prompt_ids"] for c in json.load(f)["cases"]]
    for text in CHAT[:max(0, count - len(out))]:
        if llm.loaded.chat_template is None:
            out.append([1] + list(llm.tokenizer.encode(text, add_special_tokens=False)))
        else:
            chat = llm.apply_chat_template([{"role": "user", "content": text}])
            out.append(list(llm.tokenizer.encode(chat, add_special_tokens=False)))
    return out[:count]


def teacher_forced(llm, ids, n_prompt):
    llm.reset()
    logits = core_forward(llm.engine.core, np.asarray(ids, np.int32), 0, True)[n_prompt - 1:]
    llm.reset()
    return logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kv", nargs="+", default=["bf16", "int8"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default=None, help="fixture name for the prompts (default: from the path)")
    a = ap.parse_args()
    name = a.name or os.path.basename(a.model.rstrip("/"))
    kw = dict(dtype=a.dtype, threads=a.threads, max_seq_len=1024, speculative_model=None)
    ref = corelm.LLM(a.model, kv_cache_dtype="fp32", **kw)
    others = {kv: corelm.LLM(a.model, kv_cache_dtype=kv, **kw) for kv in a.kv}
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    for pi, prompt in enumerate(prompts_for(ref, name, a.prompts)):
        ref.reset()
        expected = ref.generate([prompt], params)[0].outputs[0].token_ids
        ids = prompt + expected[:-1]
        ref_logits = teacher_forced(ref, ids, len(prompt))
        top2 = np.sort(ref_logits, axis=1)[:, -2:]
        gaps = top2[:, 1] - top2[:, 0]
        tf_ok = int((ref_logits.argmax(1) == np.asarray(expected)).sum())
        print(f"{name} p{pi} ({len(prompt)} prompt tokens): min top-2 gap {gaps.min():.4f} at step {gaps.argmin()}, "
              f"teacher-forced fp32 argmax agrees on {tf_ok}/{len(expected)}")
        for kv, llm in others.items():
            llm.reset()
            got = llm.generate([prompt], params)[0].outputs[0].token_ids
            n = next((i for i, (x, y) in enumerate(zip(got, expected)) if x != y), len(expected))
            lg = teacher_forced(llm, ids, len(prompt))
            err = np.abs(lg - ref_logits).max(1)
            upto = err[:n + 1] if n < len(expected) else err
            msg = f"  {kv:5s} identical" if n == len(expected) else \
                f"  {kv:5s} diverges at step {n}: ref gap {gaps[n]:.4f} (ref {expected[n]} vs {got[n]})"
            print(f"{msg}; max |dlogit| {upto.max():.4f}, median {np.median(upto):.4f}; "
                  f"steps with |dlogit| >= gap: {int((err >= gaps).sum())}")


if __name__ == "__main__":
    main()
