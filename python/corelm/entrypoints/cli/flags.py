"""The flags several commands share, each defined once: MODEL, the engine flags (threads, NUMA, dtype,
activations, schedule, context) and the sampling flags (llama-cli's names and defaults), and what
they become: the engine's keyword arguments, an LLM, SamplingParams. Option values and help texts
come from corelm.options, so a name added there reaches every command."""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional

from ...engine import LoRARequest, SamplingParams, check_kv_sparsity
from ...options import CHOICES, argparse_choices


def _make_llm(**kwargs):
    """Builds the engine. A module-level hook so tests can put a fake engine in its place."""
    from ...llm import LLM
    return LLM(**kwargs)


def add_choice_flag(p: argparse.ArgumentParser, flag: str, option: str, default: Optional[str],
                    shown_default: Optional[str]) -> None:
    """A flag taking one of corelm.options.CHOICES[option]'s values or aliases, with its help text
    (the usage shows the canonical values; the aliases are accepted too)."""
    c = CHOICES[option]
    p.add_argument(flag, choices=argparse_choices(option), default=default, metavar="|".join(c.values),
                   help=c.help + (f" (default: {shown_default})" if shown_default else ""))


def add_model_arg(p: argparse.ArgumentParser,
                  default: str = "the embedded SmolLM2-135M-Instruct") -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=f"HF folder, .gguf file or hub id owner/name[:QUANT] (default: {default})")


def add_threads_flag(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("-t", "--threads", type=int, default=None, help=help)


def add_numa_flag(p: argparse.ArgumentParser) -> None:
    add_choice_flag(p, "--numa", "numa", None, None)   # the registry's help says what neither means


def add_engine_flags(p: argparse.ArgumentParser,
                     threads_help: str = "worker threads (default: physical cores)") -> None:
    """How the engine is built: threads, NUMA policy, weight dtype, kernels' schedule and input, context."""
    add_threads_flag(p, threads_help)
    add_numa_flag(p)
    add_choice_flag(p, "--dtype", "dtype", "auto", "auto")
    add_choice_flag(p, "--activations", "activations", "auto", "auto")
    add_choice_flag(p, "--schedule", "schedule", None, "$CORELM_SCHEDULE or dynamic")
    add_choice_flag(p, "--kv-cache-dtype", "kv_cache_dtype", "auto", "auto")
    p.add_argument("--kv-sparsity", type=float, default=None, metavar="S",
                   help="drop this fraction of every cached key and value row, keeping the largest magnitudes "
                        "(a bitmap and the kept values; with any --kv-cache-dtype), in [0, 1) (default 0: "
                        "dense; quality cost in docs/quality.md)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH[:SCALE]",
                   help="a LoRA adapter (a PEFT folder or a GGUF LoRA file), applied per request to requests whose "
                        "model is NAME, times SCALE (default 1); repeatable")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="LoRA adapters registered at once (default: 4, or as many as --lora gives); the least "
                        "recently used idle one makes room")
    p.add_argument("--kv-cache-gb", type=float, default=None, metavar="GB",
                   help="KV cache budget in GiB (default: room for 8 full-context sequences, at most 4 GiB; "
                        "pages are reserved, and memory is used only as the cache fills)")
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="also keep full KV blocks of cached prefixes in files under DIR, read back after a restart "
                        "or when memory evicted them (default: the prefix cache is in memory only)")
    p.add_argument("--prefix-cache-gb", type=float, default=None, metavar="GB",
                   help="the most GiB --prefix-cache-dir's blocks take; the least recently used go first (default: 8)")
    p.add_argument("-c", "--ctx-size", type=int, default=0, metavar="N",
                   help="context length in tokens (default 0: the model's trained context, at most 32768; more up to the trained one when asked)")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="reasoning models: end a thought (<think>...) after N tokens and go on to the answer, for "
                        "requests that set no max_thinking_tokens; 0: no thinking (default: -1, no limit)")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: requests that leave temperature, top_p, top_k, min_p or repetition_penalty unset take "
                        "the model's (generation_config.json, GGUF general.sampling.*); vllm: vLLM's own defaults "
                        "(default: %(default)s)")
    g = p.add_argument_group("several processes (MPI ranks, one per NUMA node or slice of the cores, or per "
                             "machine with --hosts; pip install \"corelm[distributed]\"); --threads is then per rank")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="cut every layer across N processes (default 1: one process)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                   help="consecutive layers on each of N processes, for a model larger than one machine's memory "
                        "(default 1)")
    g.add_argument("--hosts", default=None, metavar="FILE",
                   help="an MPI hostfile: ranks 1..N-1 run on those machines (the model at the same path on each); "
                        "default: this machine")
    g.add_argument("--mpi-iface", default=None, metavar="NAME",
                   help="the network interface MPI's traffic keeps to: its ports accept anyone who reaches them, so "
                        "use a private network (docs/distributed.md)")
    g = p.add_argument_group("speculative decoding (lossless: the output is what plain decoding gives)")
    g.add_argument("--draft-model", default=None, metavar="DRAFT",
                   help="a smaller model over the same vocabulary that proposes tokens (HF folder, .gguf, corelm "
                        "folder or hub id); [self]: this model in --draft-weights (default q4); [ngram]: prompt "
                        "lookup, proposals copied from the prompt and the text so far (the default, used where "
                        "it pays); [lookahead]: prompt lookup plus n-grams from the model's own guesses at every "
                        "checked row (Jacobi); [none]: no speculation")
    g.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help="the most tokens proposed per step; each sequence adapts below it (default: 4)")
    g.add_argument("--draft-weights", default=None, metavar="FORMAT",
                   help="convert the draft to this format first (cached), e.g. q4")


def add_verbose_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print prompt and generation speed after each answer (and tracebacks of errors)")


# What an unset sampling flag means when the model's files set no default for it either: llama-cli's.
LLAMA_CLI_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}
_SAMPLING_FLAGS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "repeat_penalty": "repetition_penalty"}


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (llama-cli names; unset: the model's defaults, else llama-cli's)")
    g.add_argument("--temp", "--temperature", dest="temp", type=float, default=None,
                   help="temperature; 0 = greedy (default: the model's, else 0.8)")
    g.add_argument("--top-k", type=int, default=None, help="0 = disabled (default: the model's, else 40)")
    g.add_argument("--top-p", type=float, default=None, help="1.0 = disabled (default: the model's, else 0.95)")
    g.add_argument("--min-p", type=float, default=None, help="0.0 = disabled (default: the model's, else 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=None,
                   help="on prompt and output tokens; 1.0 = disabled (default: the model's, else 1.0)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (default: %(default)s)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (default: %(default)s)")
    g.add_argument("-s", "--seed", type=int, default=-1, help="-1 = random (default: %(default)s)")
    g.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=-1, metavar="N",
                   help="tokens to generate per answer; -1 = until the context is full (default: %(default)s)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when this text is generated (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def sampling_choices(args: argparse.Namespace, model_defaults: Optional[Dict[str, Any]] = None) -> Dict[str, tuple]:
    """Each sampling parameter the flags cover -> (value, where it came from: "flag", "model" or "llama-cli"):
    a flag given wins, then the model's own default (LLMEngine.sampling_defaults), then llama-cli's."""
    out = {}
    for flag, name in _SAMPLING_FLAGS.items():
        given = getattr(args, flag)
        if given is not None:
            out[name] = (given, "flag")
        elif model_defaults and name in model_defaults:
            out[name] = (model_defaults[name], "model")
        else:
            out[name] = (LLAMA_CLI_SAMPLING[name], "llama-cli")
    return out


def describe_sampling(choices: Dict[str, tuple]) -> str:
    """What --verbose and /stats say: "sampling: temperature 0.2 (model), top_k 40 (llama-cli), ..."."""
    return "sampling: " + ", ".join(f"{name} {value:g} ({source})" for name, (value, source) in choices.items())


def sampling_params(args: argparse.Namespace, model_defaults: Optional[Dict[str, Any]] = None) -> SamplingParams:
    """llama-cli flag conventions -> vLLM SamplingParams (which validates every value); unset flags take the
    model's defaults, else llama-cli's (sampling_choices)."""
    chosen = {name: value for name, (value, _) in sampling_choices(args, model_defaults).items()}
    return SamplingParams(
        **chosen, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=None if args.seed == -1 else args.seed,
        max_tokens=None if args.max_tokens < 0 else args.max_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos)


def engine_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The engine flags as LLMEngine keyword arguments; schedule, activations and the KV cache's only when chosen,
    so the engine's own defaults (and $CORELM_SCHEDULE) apply otherwise."""
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}.")
    if args.ctx_size < 0:
        raise ValueError(f"--ctx-size must be 0 (the model's) or positive, got {args.ctx_size}.")
    options = dict(threads=args.threads, dtype=args.dtype, max_seq_len=args.ctx_size or None, numa=args.numa)
    if args.reasoning_budget != -1:
        options["reasoning_budget"] = args.reasoning_budget
    if args.generation_config != "auto":
        options["generation_config"] = args.generation_config
    if args.hosts is not None:
        options["mpi_hosts"] = args.hosts
    if args.mpi_iface is not None:
        options["mpi_iface"] = args.mpi_iface
    for flag in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = getattr(args, flag)
        if size < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {size}.")
        if size > 1:
            options[flag] = size
    if args.schedule:
        options["schedule"] = args.schedule
    if args.activations != "auto":
        options["activations"] = args.activations
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.kv_cache_gb is not None:
        options["kv_cache_gb"] = args.kv_cache_gb
    if args.prefix_cache_dir is not None:
        options["prefix_cache_dir"] = args.prefix_cache_dir
    if args.prefix_cache_gb is not None:
        options["prefix_cache_gb"] = args.prefix_cache_gb
    if args.kv_sparsity is not None:
        try:
            options["kv_sparsity"] = check_kv_sparsity(args.kv_sparsity)
        except ValueError:
            raise ValueError(f"--kv-sparsity must be in [0, 1), got {args.kv_sparsity}.") from None
    if args.lora:
        options["lora_modules"] = lora_modules(args.lora)
        options["max_loras"] = max(args.max_loras or 4, len(args.lora))
    elif args.max_loras is not None:
        raise ValueError("--max-loras needs --lora (an adapter to serve).")
    for flag, key in (("draft_model", "speculative_model"), ("draft_tokens", "num_speculative_tokens"),
                      ("draft_weights", "speculative_weights")):
        if getattr(args, flag) is not None:   # else the engine's default: prompt lookup where it pays
            options[key] = getattr(args, flag)
    return options


def lora_modules(items) -> List[LoRARequest]:
    """--lora NAME=PATH[:SCALE] values as LoRARequests (ids 1, 2, ... in order)."""
    out: List[LoRARequest] = []
    for i, item in enumerate(items):
        name, eq, path = item.partition("=")
        scale = 1.0
        head, colon, tail = path.rpartition(":")
        if colon and head:
            try:
                scale = float(tail)
                path = head
            except ValueError:
                pass   # a colon inside the path
        if not eq or not name or not path:
            raise ValueError(f"--lora takes NAME=PATH[:SCALE], got {item!r}.")
        if any(r.lora_name == name for r in out):
            raise ValueError(f"--lora names {name!r} twice.")
        out.append(LoRARequest(name, i + 1, path, scale=scale))
    return out


def llm_from_args(args: argparse.Namespace):
    """The corelm.LLM (over its LLMEngine) that MODEL and the engine flags describe."""
    return llm_for(args.model, engine_options(args))


def llm_for(model: Optional[str], options: Dict[str, Any]):
    """The corelm.LLM of `model` with engine_options' keyword arguments (each model of `corelm serve`'s router)."""
    return _make_llm(model=model, **options)
