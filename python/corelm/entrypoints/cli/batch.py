"""`corelm batch [MODEL] IN.jsonl -o OUT.jsonl`: an OpenAI Batch file through worker processes, each
with its own LLMEngine (corelm.entrypoints.batch).

MODEL comes first, as for every other command, and may be left out (the embedded model): one file
name is IN.jsonl, two are MODEL then IN.jsonl. `-m/--model MODEL`, the old spelling, is still
accepted (hidden, with a warning)."""
from __future__ import annotations

import argparse
import sys

from ..catalog import find_models
from .flags import add_engine_flags, add_model_arg, engine_options


def add_parser(commands) -> None:
    p = commands.add_parser(
        "batch", help="run an OpenAI Batch JSONL file through N worker processes",
        usage="corelm batch [MODEL] IN.jsonl -o OUT.jsonl [options]",
        description="Run every request of an OpenAI Batch JSONL file (/v1/chat/completions and /v1/completions "
                    "lines) and append one result line per custom_id to OUT, skipping ids already there (so a "
                    "rerun resumes). MODEL comes before IN.jsonl and may be left out (the embedded model).")
    add_model_arg(p)
    p.add_argument("input", metavar="IN.jsonl", help="the requests, one JSON object per line")
    p.add_argument("-o", "--output", required=True, metavar="OUT.jsonl", help="results are appended here")
    p.add_argument("-m", "--model", dest="model_option", default=None, help=argparse.SUPPRESS)  # deprecated
    p.add_argument("-w", "--workers", type=int, default=1, help="worker processes, each with its own engine "
                   "pinned to its own NUMA node or core set (default: %(default)s)")
    p.add_argument("--models-dir", default=None, metavar="DIR",
                   help="several models, each line's 'model' picking one by name (as corelm serve --models-dir): "
                        "DIR/NAME.gguf, DIR/NAME/ (HF or corelm folder), .gguf files one folder down")
    p.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                   help="with --models-dir: at most N models loaded in a worker at once (default: no limit)")
    add_engine_flags(p, threads_help="threads per worker (default: the cores of its set; 1 per Ray actor)")
    p.add_argument("--task-size", type=int, default=8, metavar="N",
                   help="requests handed to a worker at a time (default: %(default)s)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar with requests/s and tokens/s (default: when stderr is a terminal)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the workers as Ray actors on this cluster ('auto', 'local', or an address)")
    p.set_defaults(func=run)


def model_of(args: argparse.Namespace):
    """MODEL, or the deprecated -m/--model."""
    if args.model_option is None:
        return args.model
    if args.model is not None:
        raise ValueError(f"two models: MODEL {args.model!r} and -m {args.model_option!r}; give MODEL only.")
    print("corelm batch: -m/--model is deprecated; give MODEL first: corelm batch MODEL IN.jsonl -o OUT.jsonl",
          file=sys.stderr)
    return args.model_option


def models_of(args: argparse.Namespace):
    """MODEL (a path or None), or {name: path} of --models-dir."""
    model = model_of(args)
    if args.models_dir is None:
        if args.max_loaded_models is not None:
            raise ValueError("--max-loaded-models applies to --models-dir.")
        return model
    if model is not None:
        raise ValueError("give MODEL or --models-dir, not both.")
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise ValueError(f"--max-loaded-models must be at least 1, got {args.max_loaded_models}.")
    models = find_models(args.models_dir)
    if not models:
        raise ValueError(f"no GGUF file or model folder in --models-dir {args.models_dir}.")
    return models


def run(args: argparse.Namespace) -> int:
    from ..batch import run_batch
    s = run_batch(args.input, args.output, model=models_of(args), workers=args.workers, task_size=args.task_size,
                  progress=args.progress, ray_address=args.ray, max_loaded_models=args.max_loaded_models,
                  **engine_options(args))
    print(f"corelm batch: {s['requests']} written ({s['errors']} errors), {s['skipped']} already done, "
          f"{s['generated_tokens']} tokens in {s['seconds']:.1f} s, {s['restarts']} worker restarts -> {args.output}",
          file=sys.stderr)
    return 0
