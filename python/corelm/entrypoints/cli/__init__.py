"""The `corelm` command line: one module per command, the flags they share in flags.py.

    corelm chat [MODEL]                          # a multi-turn REPL (chat.py), streaming replies
    corelm generate [MODEL] -p "Once upon a time" -n 64 --temp 0
    corelm info [MODEL] --json                   # the machine and a model's shape (engine.system)
    corelm serve [MODEL] --port 8000             # OpenAI-compatible HTTP (entrypoints.server)
    corelm batch [MODEL] IN.jsonl -o OUT.jsonl   # an OpenAI Batch file (entrypoints.batch)
    corelm convert SRC -o OUT --weights q8_0
    corelm pull owner/name:Q4_K_M                # download from the Hugging Face hub, print the path
    corelm list                                  # the models in the hub's local cache

chat, generate and serve build a corelm.LLM (over its LLMEngine), batch an LLMEngine per worker; the
command line never reaches past the engine. Flag names follow llama-cli; a sampling flag left out takes the
model's default (generation_config.json, GGUF general.sampling.*; the embedded model's: temperature 0.2,
top_p 0.9), else llama-cli's (--temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05); --seed -1 = random, -n -1 =
until the context is full; -v and /stats say which are in force.
User errors (bad flag values, a missing or corrupt model) print "error: ..." and exit with status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import List, Optional

from ... import __version__
from . import batch, chat, convert, generate, info, list_models, pull, serve
from .terminal import USER_ERRORS, tolerant_text_streams

COMMANDS = (chat, generate, info, serve, batch, convert, pull, list_models)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corelm", description="CPU-first LLM inference.")
    parser.add_argument("--version", action="version", version=f"corelm {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                  # argparse printed the usage (status 2) or --help (0)
        return e.code if isinstance(e.code, int) else 2
    tolerant_text_streams()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`corelm generate ... | head`): stop quietly, and point stdout at
        # /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except USER_ERRORS as e:
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 1
