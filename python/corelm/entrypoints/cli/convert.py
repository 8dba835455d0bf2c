"""`corelm convert`: write a corelm model folder from an HF folder or a GGUF file (corelm.convert, through
corelm.engine.convert_model)."""
from __future__ import annotations

import argparse
import json
import os
import time

from ...engine import convert_model, sparsity_summary
from ...options import SPARSE_OF, WEIGHT_FORMATS
from .flags import add_choice_flag


def add_parser(commands) -> None:
    p = commands.add_parser(
        "convert", help="convert an HF folder or GGUF file to a corelm model folder",
        description="Write a corelm model folder (config.json, tokenizer files and a memory-mapped weights.corelm, "
                    "see docs/model-format.md) from an HF folder or .gguf file. GGUF Q8_0/Q4_0/Q4_1 blocks are "
                    "copied without a float round trip.",
        epilog="weight formats: " + "; ".join(f"{f.name}: {f.description}" for f in WEIGHT_FORMATS.values()))
    p.add_argument("src", metavar="SRC", help="HF model folder or .gguf file")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="the corelm folder to write")
    add_choice_flag(p, "--weights", "weights", "q8_0", "q8_0")
    g = p.add_argument_group("sparse bf16 (--weights bf16; matrices stored as a bitmap and their non-zeros)")
    g.add_argument("--sparsity", default=None, metavar="S|auto",
                   help="prune each row of every matrix but the embedding and lm_head to this fraction of zeros "
                        "(0 <= S < 1) and store them sparse; auto: prune nothing, store sparse the matrices whose "
                        "zeros already save bytes")
    add_choice_flag(g, "--prune", "prune", None, "wanda")
    g.add_argument("--keep-dense", default=None, metavar="PATTERNS",
                   help="comma-separated fnmatch patterns of internal weight names left dense, e.g. "
                        "'layers.0.*,layers.23.*' (the embedding and lm_head always are)")
    p.add_argument("-f", "--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="show a progress bar (default: on)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    out = convert_model(args.src, args.output, weights=args.weights, progress=args.progress, overwrite=args.force,
                        sparsity=args.sparsity, prune=args.prune, keep_dense=args.keep_dense)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {out} ({args.weights}, {size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")
    if args.sparsity is not None:
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        print(sparsity_summary(config["sparsity"]["matrices"].values(), SPARSE_OF[config["weights"]]))
    return 0
