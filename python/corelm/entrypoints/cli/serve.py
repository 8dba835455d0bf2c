"""`corelm serve`: the OpenAI-compatible HTTP server (corelm.entrypoints.server) over one LLMEngine, over N
replica processes with --data-parallel-size N (server/replicas.py), or over several models picked by each
request's `model` (--models-dir DIR, or NAME=PATH arguments: server/router.py)."""
from __future__ import annotations

import argparse
import functools
import os
import sys

from ...engine import served_model_name
from ..catalog import find_models, named_models
from .flags import add_engine_flags, add_verbose_flag, engine_options, llm_for, llm_from_args


def add_parser(commands) -> None:
    p = commands.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                            description="Serve a web chat page at /, the OpenAI API (/v1/completions, "
                                        "/v1/chat/completions, /v1/models), /tokenize, /detokenize, /health "
                                        "and /metrics (needs the serve extra: pip install 'corelm[serve]').")
    p.add_argument("model", nargs="*", metavar="MODEL",
                   help="HF folder, .gguf file or hub id owner/name[:QUANT] (default: the embedded "
                        "SmolLM2-135M-Instruct); several models as NAME=PATH arguments, each loaded when a "
                        "request's 'model' names it")
    g = p.add_argument_group("several models (loaded on demand; docs/guide.md)")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every model in DIR by name: DIR/NAME.gguf, DIR/NAME/ (an HF or corelm folder with "
                        "config.json), and the .gguf files one folder down")
    g.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                   help="with several models: at most N loaded at once; the least recently used idle one is "
                        "unloaded first (default: no limit)")
    g.add_argument("--models-memory-gb", type=float, default=None, metavar="GB",
                   help="with several models: at most this much loaded, a model counted as its files' size plus "
                        "its KV pool (default: no limit)")
    add_engine_flags(p)
    add_verbose_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY'; a key given here shows in `ps`, so prefer "
                          "--api-key-file or $CORELM_API_KEY (default: $CORELM_API_KEY, else none)")
    key.add_argument("--api-key-file", default=None, metavar="FILE",
                     help="read the API key from FILE (its first line), kept out of the process list")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id in /v1/models and responses (default: the model's file name)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, metavar="N",
                   help="refuse request bodies larger than this (default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="a request body not received within S seconds gets a 408 (default: %(default)s)")
    p.add_argument("--max-connections", type=int, default=256, metavar="N",
                   help="open connections at most; more are answered 503 (default: %(default)s)")
    p.add_argument("--max-connections-per-client", type=int, default=64, metavar="N",
                   help="open connections one client address may hold; more are answered 503 and closed, so "
                        "one client cannot take them all (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="a request's headers not received within S seconds of the connection opening (or of "
                        "the previous response) close the connection (default: %(default)s)")
    p.add_argument("--allowed-hosts", default="", metavar="NAMES",
                   help="comma-separated host names the server answers to besides IP addresses, localhost "
                        "and --host ('*.example.com' for subdomains, '*' for any); other Host headers get a "
                        "400, which stops DNS rebinding from web pages (default: none)")
    p.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                   help="comma-separated origins (https://app.example.com) whose web pages may call the API "
                        "(CORS); '*' for any (default: none; the server's own web chat needs none)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="run N engine replicas, each its own process pinned to one NUMA node (or, with one node, "
                        "a slice of the cores) with its own copy of the weights, behind this one server; requests "
                        "go to the replica holding their prompt's prefix, else the least loaded; --threads is per "
                        "replica (default 1: one engine in the server's process)")
    p.add_argument("--replica-restarts", type=int, default=3, metavar="N",
                   help="with --data-parallel-size: a replica that dies fails its requests in flight (503) and is "
                        "restarted, at most N times in 10 minutes; one more death stops the server with "
                        "exit status 1 (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}.")
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}.")
    if not args.body_timeout > 0:
        raise ValueError(f"--body-timeout must be positive, got {args.body_timeout}.")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be at least 1, got {args.max_connections}.")
    if args.max_connections_per_client < 1:
        raise ValueError(f"--max-connections-per-client must be at least 1, got {args.max_connections_per_client}.")
    if not args.header_timeout > 0:
        raise ValueError(f"--header-timeout must be positive, got {args.header_timeout}.")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}.")
    if args.replica_restarts < 0:
        raise ValueError(f"--replica-restarts must be 0 or more, got {args.replica_restarts}.")
    api_key = api_key_of(args)
    options = engine_options(args)   # bad engine flags fail now, not in the thread that loads the model
    if args.data_parallel_size > 1 and (options.get("tensor_parallel_size", 1) > 1
                                        or options.get("pipeline_parallel_size", 1) > 1):
        raise ValueError("--data-parallel-size cannot be combined with --tensor-parallel-size or "
                         "--pipeline-parallel-size.")
    try:
        from .. import server
    except ImportError as e:
        print(f"error: corelm serve needs FastAPI and uvicorn: pip install 'corelm[serve]' ({e})", file=sys.stderr)
        return 1
    from ..server.replicas import ReplicaFailure, load_replicas
    router = model_router(args, options)
    if options.get("lora_modules") and (router is not None or args.data_parallel_size > 1):
        raise ValueError("--lora serves adapters of one model: not with --models-dir, several models or "
                         "--data-parallel-size yet.")
    if router is None:
        args.model = args.model[0] if args.model else None
    if router is not None:
        load = None
    elif args.data_parallel_size > 1:
        load = functools.partial(load_replicas, args.model, args.data_parallel_size, options, threads=args.threads,
                                 max_restarts=args.replica_restarts)
    else:
        load = functools.partial(llm_from_args, args)
    # The model loads in the server's background thread, so /health answers while it does.
    try:
        return server.run(load, None if router else args.served_model_name or served_model_name(args.model),
                          host=args.host, port=args.port, api_key=api_key, max_body_bytes=args.max_body_bytes,
                          log_level=args.log_level, body_timeout=args.body_timeout,
                          max_connections=args.max_connections, header_timeout=args.header_timeout,
                          max_connections_per_client=args.max_connections_per_client,
                          allowed_hosts=_names(args.allowed_hosts), allowed_origins=_names(args.allowed_origins),
                          router=router)
    except ReplicaFailure as e:          # a replica could not load, or kept dying
        print(f"error: {e}", file=sys.stderr)
        return 1


def _is_named(item: str) -> bool:
    """NAME=PATH, unless the whole argument is itself an existing file or folder."""
    return "=" in item and not os.path.exists(item)


def model_router(args: argparse.Namespace, options):
    """The ModelRouter of --models-dir and NAME=PATH arguments, or None for one MODEL (today's server)."""
    named = [m for m in args.model if _is_named(m)]
    if args.models_dir is None and not named:
        if len(args.model) > 1:
            raise ValueError("several models are given as NAME=PATH (or with --models-dir DIR); one MODEL is served "
                             "by itself.")
        if args.max_loaded_models is not None or args.models_memory_gb is not None:
            raise ValueError("--max-loaded-models and --models-memory-gb apply to several models (--models-dir "
                             "or NAME=PATH).")
        return None
    if len(named) < len(args.model):
        raise ValueError("with several models give each as NAME=PATH (or put them in --models-dir DIR).")
    for flag in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, flag) > 1:
            raise ValueError(f"--{flag.replace('_', '-')} cannot be combined with several models.")
    if args.served_model_name is not None:
        raise ValueError("--served-model-name names one model; with several, each is named by NAME=PATH or its "
                         "file or folder name.")
    models = find_models(args.models_dir) if args.models_dir is not None else {}
    for name, path in named_models(named).items():
        if name in models:
            raise ValueError(f"the model name {name!r} is in --models-dir too.")
        models[name] = path
    if not models:
        raise ValueError(f"no GGUF file or model folder in --models-dir {args.models_dir}.")
    from ..server.router import ModelRouter
    gb = args.models_memory_gb
    if gb is not None and not gb > 0:
        raise ValueError(f"--models-memory-gb must be positive, got {gb}.")
    kv_gb = options.get("kv_cache_gb")
    return ModelRouter(models, functools.partial(llm_for, options=options), max_loaded=args.max_loaded_models,
                       memory_bytes=None if gb is None else int(gb * (1 << 30)),
                       kv_bytes_hint=None if kv_gb is None else int(kv_gb * (1 << 30)))


def _names(text: str):
    return [n.strip() for n in text.split(",") if n.strip()]


def api_key_of(args: argparse.Namespace):
    """--api-key, else the first line of --api-key-file, else $CORELM_API_KEY, else None."""
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --api-key-file {args.api_key_file}: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty.")
        return key
    return args.api_key if args.api_key is not None else os.environ.get("CORELM_API_KEY") or None
