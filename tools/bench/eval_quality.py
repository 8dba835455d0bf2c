#!/usr/bin/env python3
"""Quality of quantized weights: perplexity, mean KL divergence and top-1 agreement against fp32.

    python tools/bench/eval_quality.py --model /work/cache/models/hf/SmolLM2-135M-Instruct \\
        --weights bf16 q8_0 q4_1 --extra gguf-Q4_1=/work/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf@q4_0

The reference is MODEL (an HF folder) run by corelm with fp32 weights. Each --weights kind is MODEL
converted with `corelm convert` (into $CORELM_CACHE, reused on later runs) and loaded from the corelm
folder; each --extra LABEL=PATH[@DTYPE] is any other model file with the same tokenizer.

Text: tests/data/text/alice-ch1-2.txt (public domain; see tests/data/text/README.md), tokenized with the
model's tokenizer (BOS added if the model adds one). Windows: non-overlapping chunks of --ctx tokens, each
run from an empty cache; every token but a chunk's first is scored (so each scored token has 1..ctx-1
tokens of context). All variants are loaded at once and see the same chunks.

    perplexity   exp(mean negative log-likelihood of the next token)
    mean KLD     mean over scored positions of KL(p_fp32 || p_variant), nats, in float64
    same top-1   % of positions whose argmax equals the fp32 model's
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TEXT = os.path.join(ROOT, "tests", "data", "text", "alice-ch1-2.txt")
try:
    import corelm  # noqa: F401
except ImportError:  # a source checkout with the in-place build
    sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, when loaded by path
from core_forward import core_forward  # noqa: E402
from corelm.options import argparse_choices  # noqa: E402


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def build(path: str, dtype: str, threads: int, ctx: int, activations: str = "auto"):
    from corelm.engine.model_builder import build_core_model
    from corelm.loader import load_model
    loaded = load_model(path)
    if dtype == "auto" and loaded.source_format == "corelm":
        from corelm.convert import folder_dtype
        dtype = folder_dtype(loaded.source)
    model = build_core_model(loaded, dtype=dtype, threads=threads, max_seq_len=ctx, activations=activations)
    return loaded, model


def evaluate(reference, variants, ids, ctx: int, progress: bool = False):
    """reference: a _core.Model; variants: {label: _core.Model}. Returns {label: metrics}, reference included."""
    stats = {k: {"nll": 0.0, "kld": 0.0, "top1": 0, "n": 0, "seconds": 0.0} for k in ["fp32", *variants]}
    chunks = [ids[i:i + ctx] for i in range(0, len(ids) - 1, ctx)]
    chunks = [c for c in chunks if len(c) >= 2]
    for ci, chunk in enumerate(chunks):
        toks = np.asarray(chunk, dtype=np.int32)
        targets = toks[1:]
        t = time.perf_counter()
        ref = log_softmax(core_forward(reference, toks, 0, True)[:-1])
        stats["fp32"]["seconds"] += time.perf_counter() - t
        p_ref = np.exp(ref)
        ref_top = ref.argmax(-1)
        stats["fp32"]["nll"] -= ref[np.arange(len(targets)), targets].sum()
        stats["fp32"]["top1"] += len(targets)
        stats["fp32"]["n"] += len(targets)
        for label, model in variants.items():
            t = time.perf_counter()
            lp = log_softmax(core_forward(model, toks, 0, True)[:-1])
            s = stats[label]
            s["seconds"] += time.perf_counter() - t
            s["nll"] -= lp[np.arange(len(targets)), targets].sum()
            s["kld"] += (p_ref * (ref - lp)).sum()
            s["top1"] += int((lp.argmax(-1) == ref_top).sum())
            s["n"] += len(targets)
        if progress:
            print(f"  chunk {ci + 1}/{len(chunks)}", file=sys.stderr, flush=True)
    out = {}
    base = float(np.exp(stats["fp32"]["nll"] / stats["fp32"]["n"]))
    for label, s in stats.items():
        ppl = float(np.exp(s["nll"] / s["n"]))
        out[label] = {"ppl": ppl, "ppl_delta_pct": 100 * (ppl / base - 1), "mean_kld": s["kld"] / s["n"],
                      "same_top1_pct": 100 * s["top1"] / s["n"], "tokens": s["n"], "seconds": s["seconds"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF folder: the fp32 reference and the source of --weights")
    ap.add_argument("--weights", nargs="*", default=["bf16", "q8_0", "q4_1"], choices=argparse_choices("weights"),
                    metavar="FORMAT", help="formats (corelm.options) to convert MODEL to and evaluate "
                                           "(default: %(default)s)")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL=PATH[@DTYPE]",
                    help="another model to evaluate, e.g. gguf-Q4_1=model.Q4_1.gguf@q4_0 (repeatable)")
    ap.add_argument("--activations", nargs="+", default=["auto"], choices=argparse_choices("activations"),
                    help="input precision of quantized matmuls; each --weights/--extra model is evaluated "
                         "with each (default: %(default)s)")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=0, help="use only the first N tokens (0 = all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)

    from corelm.convert import cached_conversion
    loaded, reference = build(args.model, "fp32", args.threads, args.ctx)
    with open(args.text, encoding="utf-8") as f:
        ids = loaded.tokenizer.encode(f.read(), add_special_tokens=True)
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    variants = {}
    def add(label, path, dtype):
        for act in args.activations:
            model = build(path, dtype, args.threads, args.ctx, act)[1]
            variants[f"{label}, {model.activations} activations"] = model
    for kind in args.weights:
        add(f"corelm {kind}", cached_conversion(args.model, kind, progress=args.progress), "auto")
    for spec in args.extra:
        label, _, rest = spec.partition("=")
        path, _, dtype = rest.partition("@")
        add(label, path, dtype or "auto")
    res = evaluate(reference, variants, ids, args.ctx, args.progress)

    name = os.path.basename(os.path.normpath(args.model))
    print(f"{name}: {res['fp32']['tokens']} scored tokens of {os.path.basename(args.text)}, "
          f"non-overlapping chunks of {args.ctx}")
    print("| weights | perplexity | vs fp32 | mean KLD | same top-1 | eval s |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in res.items():
        print(f"| {label} | {r['ppl']:.4f} | {r['ppl_delta_pct']:+.2f}% | {r['mean_kld']:.5f} | "
              f"{r['same_top1_pct']:.2f}% | {r['seconds']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "text": args.text, "ctx": args.ctx, "results": res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
