"""Where greedy decoding with a compressed KV cache (bf16, int8, sparse) leaves the fp32-cache tokens, and why.

For each prompt: 256 greedy tokens with the fp32 cache (the reference), then the same with each other
cache type. Reports the first differing step, the reference's top-2 logit gap there, and the largest
logit error the compressed cache made (teacher-forced on the reference tokens) before that step.
A cache is TYPE or TYPE:SPARSITY (kv_cache_dtype and kv_sparsity, e.g. int8:0.5).

With --text, long context instead: the first --context tokens of the text read teacher-forced by each
cache; per cache the perplexity, the mean KL divergence of its next-token distributions from the fp32
cache's and how often its top token is fp32's, over all positions and over those past --from.

  python tools/bench/kv_divergence.py MODEL [--kv bf16 int8 int8:0.5] [--tokens 256] [--prompts 4] [--dtype auto]
  python tools/bench/kv_divergence.py MODEL --text FILE [--context 2048] [--from 1024] [--kv ...]
"""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
import corelm  # noqa: E402
from corelm import SamplingParams  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, when loaded by path
from core_forward import CHUNK, core_forward  # noqa: E402

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


def cache_options(spec):
    """"int8:0.5" -> LLM options (kv_cache_dtype, kv_sparsity)."""
    kv, _, sparsity = spec.partition(":")
    return dict(kv_cache_dtype=kv, kv_sparsity=float(sparsity or 0))


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def chunk_logprobs(llm, ids):
    """Log-probabilities of every next token, reading ids in prefill chunks (bounded memory)."""
    core = llm.engine.core
    blocks = np.arange(core.kv_blocks, dtype=np.int32)
    for c0 in range(0, len(ids), CHUNK):
        piece = np.asarray(ids[c0:c0 + CHUNK], np.int32)
        yield log_softmax(core.forward_batch(piece, [(len(piece), c0, blocks, True)]))


def long_context(a, kw):
    """Teacher-forced over a long text: ppl, KL from the fp32 cache, top-1 agreement (all / from a.frm)."""
    ref = corelm.LLM(a.model, kv_cache_dtype="fp32", **kw)
    with open(a.text, encoding="utf-8") as f:
        ids = list(ref.tokenizer.encode(f.read(), add_special_tokens=False))[:a.context]
    if len(ids) < a.context:
        sys.exit(f"{a.text} has only {len(ids)} tokens")
    targets = np.asarray(ids[1:] + [0])
    ref_lp = [lp.astype(np.float32) for lp in chunk_logprobs(ref, ids)]  # a chunk at a time: 0.6 MiB a token
    long = slice(a.frm, len(ids) - 1)  # the last position has no next token

    def compare(chunks):
        """NLL of the text, KL from the fp32 cache and top-1 agreement at every position."""
        nll, kl, same = [], [], []
        for c, lp in enumerate(chunks):
            r = ref_lp[c].astype(np.float64)
            nll.append(-lp[np.arange(len(lp)), targets[c * CHUNK:c * CHUNK + len(lp)]])
            kl.append((np.exp(r) * (r - lp)).sum(axis=1))
            same.append(r.argmax(1) == lp.argmax(1))
        return [np.concatenate(x)[:len(ids) - 1] for x in (nll, kl, same)]

    def row(llm, opts, nll, kl, same):
        core = llm.engine.core
        per_token = core.kv_bytes // (core.kv_blocks * core.kv_block_size)
        print(f"| {opts['kv_cache_dtype']} | {opts['kv_sparsity']:g} | {per_token} | {np.exp(nll.mean()):.4f} "
              f"| {np.exp(nll[long].mean()):.4f} | {max(kl.mean(), 0):.5f} | {max(kl[long].mean(), 0):.5f} "
              f"| {100 * same[long].mean():.1f}% |", flush=True)
    print(f"{os.path.basename(a.model)}: {len(ids)} tokens of {os.path.basename(a.text)}; "
          f"positions >= {a.frm} are 'long'")
    print("| KV cache | kv_sparsity | bytes/token | ppl (all) | ppl (long) | KL from fp32 (all) | KL (long) "
          "| top-1 = fp32 (long) |")
    print("|---|---|---|---|---|---|---|---|")
    row(ref, cache_options("fp32"), *compare(ref_lp))
    del ref
    for spec in a.kv:
        opts = cache_options(spec)
        llm = corelm.LLM(a.model, **opts, **kw)
        row(llm, opts, *compare(chunk_logprobs(llm, ids)))
        del llm


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
    ap.add_argument("--text", default=None, help="long-context mode: read this text teacher-forced")
    ap.add_argument("--context", type=int, default=2048, help="tokens of --text read")
    ap.add_argument("--from", dest="frm", type=int, default=1024, help="first position counted as long context")
    a = ap.parse_args()
    name = a.name or os.path.basename(a.model.rstrip("/"))
    if a.text:
        kw = dict(dtype=a.dtype, threads=a.threads, max_seq_len=a.context, speculative_model=None)
        return long_context(a, kw)
    kw = dict(dtype=a.dtype, threads=a.threads, max_seq_len=1024, speculative_model=None)
    ref = corelm.LLM(a.model, kv_cache_dtype="fp32", **kw)
    others = {kv: corelm.LLM(a.model, **cache_options(kv), **kw) for kv in a.kv}
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
