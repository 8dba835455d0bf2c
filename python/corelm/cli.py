"""The `corelm` command line: `chat` (a multi-turn REPL), `generate` (one completion), `info` and
`serve` (an OpenAI-compatible HTTP server, corelm.server).

    corelm chat                                  # the embedded default model, streaming replies
    corelm generate model.gguf -p "Once upon a time" -n 64 --temp 0
    corelm info model.gguf --json

Flag names and sampling defaults follow llama-cli (--temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05,
--seed -1 = random, -n -1 = until the context is full); the REPL's commands follow `ollama run`.
User errors (bad flag values, a missing or corrupt model) print "error: ..." and exit with status 1.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
import time
import traceback
from typing import Any, Dict, Iterable, List, Optional

from . import __version__
from .engine.sampling import SamplingParams
from .options import CHOICES, WEIGHT_FORMATS, argparse_choices


def _make_llm(**kwargs):
    """Builds the engine. A module-level hook so tests can put a fake engine in its place."""
    from .llm import LLM
    return LLM(**kwargs)


def _user_errors() -> tuple:
    """Exceptions a user can cause with their input; anything else is a bug and keeps its traceback."""
    from .loader.spec import ModelLoadError
    return (ValueError, ModelLoadError, OSError)


# ---------------------------------------------------------------------------------------------------
# Arguments

def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="HF folder, .gguf file or hub repo id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-t", "--threads", type=int, default=None, help="worker threads (default: physical cores)")
    _add_numa_arg(p)
    p.add_argument("--dtype", choices=argparse_choices("dtype"), default="auto", metavar="DTYPE",
                   help=f"{CHOICES['dtype'].help}: {', '.join(CHOICES['dtype'].values)} (default: auto)")
    _add_kernel_args(p)
    p.add_argument("-c", "--ctx-size", type=int, default=0, metavar="N",
                   help="context length in tokens (default 0: the model's own)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print prompt and generation speed after each answer")


def _add_kernel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", choices=argparse_choices("activations"), default="auto", metavar="A",
                   help=f"{CHOICES['activations'].help} (default: %(default)s)")
    p.add_argument("--schedule", choices=argparse_choices("schedule"), default=None,
                   help=f"{CHOICES['schedule'].help} (default: $CORELM_SCHEDULE or dynamic)")


def _add_numa_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numa", choices=argparse_choices("numa"), default=None, help=CHOICES["numa"].help)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (llama-cli names and defaults)")
    g.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.8,
                   help="temperature; 0 = greedy (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=40, help="0 = disabled (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, help="1.0 = disabled (default: %(default)s)")
    g.add_argument("--min-p", type=float, default=0.05, help="0.0 = disabled (default: %(default)s)")
    g.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="on prompt and output tokens; 1.0 = disabled (default: %(default)s)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (default: %(default)s)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (default: %(default)s)")
    g.add_argument("-s", "--seed", type=int, default=-1, help="-1 = random (default: %(default)s)")
    g.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=-1, metavar="N",
                   help="tokens to generate per answer; -1 = until the context is full (default: %(default)s)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when this text is generated (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corelm", description="CPU-first LLM inference.")
    parser.add_argument("--version", action="version", version=f"corelm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    chat = sub.add_parser("chat", help="chat with a model (multi-turn, streaming)",
                          description="Chat with a model. Type /? in the chat for its commands.")
    _add_model_args(chat)
    chat.add_argument("--system", default=None, metavar="TEXT", help="system message")
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    gen = sub.add_parser("generate", help="complete one prompt",
                         description="Complete one prompt and print the completion.")
    _add_model_args(gen)
    gen.add_argument("-p", "--prompt", default=None, help="the prompt (default: read stdin)")
    gen.add_argument("-f", "--file", default=None, help="read the prompt from this file")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    gen.add_argument("--system", default=None, metavar="TEXT", help="system message (implies --chat)")
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                     help="print text as it is generated (default: on)")
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="show the CPU, the kernels chosen, and a model's shape",
                          description="Show the CPU, its features, the kernels corelm picked, memory, "
                                      "and with MODEL the model's hyper-parameters (without building it).")
    info.add_argument("model", nargs="?", default=None, metavar="MODEL")
    info.add_argument("-t", "--threads", type=int, default=None,
                      help="show the thread plan for this many threads (default: the default count)")
    _add_numa_arg(info)
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=cmd_info)

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                           description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health "
                                       "and /metrics (needs the serve extra: pip install 'corelm[serve]').")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    serve.add_argument("--api-key", default=os.environ.get("CORELM_API_KEY"), metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (default: $CORELM_API_KEY, else none)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model id in /v1/models and responses (default: the model's file name)")
    serve.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, metavar="N",
                       help="refuse request bodies larger than this (default: %(default)s)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    batch = sub.add_parser("batch", help="run an OpenAI Batch JSONL file through N worker processes",
                           description="Run every request of an OpenAI Batch JSONL file (/v1/chat/completions and "
                                       "/v1/completions lines) and append one result line per custom_id to OUT, "
                                       "skipping ids already there (so a rerun resumes).")
    batch.add_argument("input", metavar="IN.jsonl", help="the requests, one JSON object per line")
    batch.add_argument("-o", "--output", required=True, metavar="OUT.jsonl", help="results are appended here")
    batch.add_argument("-m", "--model", default=None, help="HF folder, .gguf file or hub repo id (default: embedded)")
    batch.add_argument("-w", "--workers", type=int, default=1, help="worker processes, each with its own engine "
                       "pinned to its own NUMA node or core set (default: %(default)s)")
    batch.add_argument("-t", "--threads", type=int, default=None,
                       help="threads per worker (default: the cores of its set; 1 per Ray actor)")
    _add_numa_arg(batch)
    batch.add_argument("--dtype", choices=argparse_choices("dtype"), default="auto", metavar="DTYPE")
    _add_kernel_args(batch)
    batch.add_argument("-c", "--ctx-size", type=int, default=0, metavar="N", help="context length (default: the model's)")
    batch.add_argument("--task-size", type=int, default=8, metavar="N",
                       help="requests handed to a worker at a time (default: %(default)s)")
    batch.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar with requests/s and tokens/s (default: when stderr is a terminal)")
    batch.add_argument("--ray", default=None, metavar="ADDRESS",
                       help="run the workers as Ray actors on this cluster ('auto', 'local', or an address)")
    batch.set_defaults(func=cmd_batch)

    conv = sub.add_parser("convert", help="convert an HF folder or GGUF file to a corelm model folder",
                          description="Write a corelm model folder (config.json, tokenizer files and a memory-mapped "
                                      "weights.corelm, see docs/model-format.md) from an HF folder or .gguf file. "
                                      "GGUF Q8_0/Q4_0/Q4_1 blocks are copied without a float round trip.")
    conv.add_argument("src", metavar="SRC", help="HF model folder or .gguf file")
    conv.add_argument("-o", "--output", required=True, metavar="OUT", help="the corelm folder to write")
    conv.add_argument("--weights", choices=argparse_choices("weights"), default="q8_0", metavar="FORMAT",
                      help="how matrices are stored: " + "; ".join(f"{f.name}: {f.description}"
                                                                    for f in WEIGHT_FORMATS.values())
                           + " (default: %(default)s)")
    conv.add_argument("-f", "--force", action="store_true", help="replace OUT if it exists")
    conv.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                      help="show a progress bar (default: on)")
    conv.set_defaults(func=cmd_convert)
    return parser


def params_from_args(args: argparse.Namespace) -> SamplingParams:
    """llama-cli flag conventions -> vLLM SamplingParams (which validates every value)."""
    return SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=None if args.seed == -1 else args.seed,
        max_tokens=None if args.max_tokens < 0 else args.max_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos)


def llm_from_args(args: argparse.Namespace):
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}.")
    if args.ctx_size < 0:
        raise ValueError(f"--ctx-size must be 0 (the model's) or positive, got {args.ctx_size}.")
    extra = {"schedule": args.schedule} if getattr(args, "schedule", None) else {}
    if getattr(args, "activations", "auto") != "auto":
        extra["activations"] = args.activations
    return _make_llm(model=args.model, threads=args.threads, dtype=args.dtype,
                     max_seq_len=args.ctx_size or None, numa=args.numa, **extra)


# ---------------------------------------------------------------------------------------------------
# Streaming output and statistics

def _close(stream) -> None:
    """Closing the engine's generator stops generation now, not whenever it is garbage-collected."""
    close = getattr(stream, "close", None)
    if close is not None:
        close()


def _rate(tokens: float, seconds: float) -> str:
    return f"{tokens / seconds:.1f}" if seconds > 0 else "-"


def format_stats(m: Dict[str, Any]) -> str:
    """'prompt: N tokens, X tok/s | generation: M tokens, Y tok/s'. Tokens reused from the KV cache
    are not read again, so the prompt rate counts only the ones that were."""
    pt, cached = int(m.get("prompt_tokens", 0)), int(m.get("cached_prompt_tokens", 0) or 0)
    gt = int(m.get("generated_tokens", 0))
    prompt = f"prompt: {pt} tokens"
    if cached:
        prompt += f" ({cached} cached)"
    return (f"{prompt}, {_rate(pt - cached, m.get('prompt_time_s', 0.0))} tok/s | "
            f"generation: {gt} tokens, {_rate(gt, m.get('generation_time_s', 0.0))} tok/s")


def _print_stats(llm) -> None:
    print(format_stats(getattr(llm, "last_metrics", None) or {}), file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# chat

HELP = """Available commands:
  /set system TEXT   set the system message
  /set verbose       show speed stats after each answer (/set quiet hides them)
  /stats             toggle the speed stats
  /clear             forget the conversation (and the KV cache)
  /exit, /bye        quit (Ctrl-D works too)
  /?, /help          this help

Use \"\"\" to begin and end a multi-line message.
Ctrl-C stops the answer being generated."""

_DOUBLE_INTERRUPT_S = 2.0   # a second Ctrl-C at the prompt within this many seconds exits


class ChatREPL:
    """The `corelm chat` loop. On a terminal it shows a ">>> " prompt (with line editing when the
    readline module exists); with piped stdin it reads one message per line and prints only replies,
    which is how scripts and tests drive it. The conversation is `history`, a list of
    {"role", "content"} dicts sent whole to `llm.chat_stream`, which reuses the KV cache of the
    common prefix, so each turn only reads the new message."""

    def __init__(self, llm, params: SamplingParams, system: Optional[str] = None,
                 show_stats: bool = False, interactive: bool = False):
        self.llm, self.params = llm, params
        self.system = system
        self.show_stats = show_stats
        self.interactive = interactive
        self.history: List[Dict[str, str]] = self._fresh_history()
        self.failed = False                 # a turn ended in an error (exit status 1 when piped)
        self._last_interrupt = 0.0          # time of the last Ctrl-C at the prompt

    def _fresh_history(self) -> List[Dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def run(self) -> int:
        if self.interactive:
            _enable_line_editing()
        while True:
            try:
                kind, text = self._read_message()
            except EOFError:
                if self.interactive:
                    print()
                break
            except KeyboardInterrupt:
                if not self.interactive or self._second_interrupt():
                    print()
                    break
                continue
            self._last_interrupt = 0.0
            if kind == "command":
                if self._command(text):
                    break
            elif text:
                self._answer(text)
        return 1 if self.failed and not self.interactive else 0

    # --- input -------------------------------------------------------------------------------------

    def _read_line(self, prompt: str) -> str:
        if self.interactive:
            return input(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def _read_message(self):
        """('command', line) or ('message', text). A line starting with \"\"\" opens a multi-line
        message that a line ending with \"\"\" closes (ollama's convention)."""
        line = self._read_line(">>> ").strip()
        if line.startswith("/"):
            return "command", line
        if not line.startswith('"""'):
            return "message", line
        body = line[3:]
        if len(body) >= 3 and body.endswith('"""'):
            return "message", body[:-3].strip()
        lines = [body] if body else []
        while True:
            try:
                line = self._read_line("... ")
            except EOFError:                 # an unclosed block still counts as a message
                break
            if line.rstrip().endswith('"""'):
                lines.append(line.rstrip()[:-3])
                break
            lines.append(line)
        return "message", "\n".join(lines).strip()

    def _second_interrupt(self) -> bool:
        """Ctrl-C at the prompt: a hint the first time, exit when pressed twice in a row quickly."""
        now = time.monotonic()
        if now - self._last_interrupt < _DOUBLE_INTERRUPT_S:
            return True
        self._last_interrupt = now
        print("\nUse /exit or Ctrl-D to quit (or press Ctrl-C again).", flush=True)
        return False

    # --- commands ----------------------------------------------------------------------------------

    def _command(self, line: str) -> bool:
        """Runs a slash command; True means quit."""
        cmd, _, rest = line.partition(" ")
        cmd = cmd.lower()
        if cmd in ("/exit", "/bye", "/quit"):
            return True
        if cmd in ("/help", "/?"):
            print(HELP)
        elif cmd == "/clear":
            self.history = self._fresh_history()
            self.llm.reset()
            print("Cleared session context.")
        elif cmd == "/stats":
            self.show_stats = not self.show_stats
            print(f"Stats {'on' if self.show_stats else 'off'}.")
        elif cmd == "/set":
            self._set(rest.strip())
        else:
            print(f"Unknown command '{cmd}'. Type /? for help.")
        sys.stdout.flush()
        return False

    def _set(self, rest: str) -> None:
        what, _, value = rest.partition(" ")
        if what == "system" and value.strip():
            self.system = value.strip()
            # Replaces the system message in place: the rest of the conversation carries on.
            self.history = self._fresh_history() + [m for m in self.history if m["role"] != "system"]
            print("Set system message.")
        elif what in ("verbose", "quiet"):
            self.show_stats = what == "verbose"
            print(f"Stats {'on' if self.show_stats else 'off'}.")
        else:
            print("Usage: /set system TEXT | /set verbose | /set quiet")

    # --- answering ---------------------------------------------------------------------------------

    def _fit_history(self) -> None:
        """Drops the oldest turns (never the system message or the new question) until the prompt
        leaves room for an answer, as llama-cli's context shift does, instead of failing the turn."""
        tok, limit = getattr(self.llm, "tokenizer", None), getattr(self.llm, "max_seq_len", None)
        if tok is None or not isinstance(limit, int):
            return
        max_tokens = getattr(self.params, "max_tokens", None)
        room = min(max_tokens or 512, limit // 4)
        dropped = 0
        while True:
            prompt = tok.apply_chat_template(self.history, add_generation_prompt=True)
            if len(tok.encode(prompt, add_special_tokens=False)) + room <= limit:
                break
            first = next((i for i, m in enumerate(self.history) if m["role"] != "system"), None)
            if first is None or first >= len(self.history) - 1:
                break  # only the new question is left: let the engine report that it is too long
            del self.history[first]
            dropped += 1
        if dropped:
            print(f"(dropped the {dropped} oldest message(s) to fit the context of {limit} tokens)",
                  file=sys.stderr, flush=True)

    def _answer(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        self._fit_history()
        parts: List[str] = []
        stream = None
        try:
            # A copy: the engine may keep the list while we append the reply to ours.
            stream = self.llm.chat_stream(list(self.history), self.params)
            for chunk in stream:
                if chunk.text:
                    parts.append(chunk.text)
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            _close(stream)                   # keep the partial answer, back to the prompt
        except BrokenPipeError:              # stdout is gone: nothing more to say to anyone
            raise
        except _user_errors() as e:          # e.g. the conversation no longer fits the context
            _close(stream)
            self.history.pop()
            print("\n" if parts else "", end="", flush=True)
            print(f"error: {e}", file=sys.stderr, flush=True)
            self.failed = True
            return
        reply = "".join(parts)
        if reply:
            self.history.append({"role": "assistant", "content": reply})
        else:
            self.history.pop()   # no answer at all: drop the question so roles keep alternating
        print("\n" if self.interactive else "", flush=True)
        if self.show_stats:
            _print_stats(self.llm)
        self._warn_if_context_full()

    def _warn_if_context_full(self) -> None:
        m = getattr(self.llm, "last_metrics", None) or {}
        limit = getattr(self.llm, "max_seq_len", None)
        used = m.get("prompt_tokens", 0) + m.get("generated_tokens", 0)
        if isinstance(limit, int) and used >= limit:
            print(f"(the context of {limit} tokens is full: /clear starts a new conversation)",
                  file=sys.stderr, flush=True)


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401  (importing it gives input() history and line editing)
    except ImportError:
        pass


def cmd_chat(args: argparse.Namespace) -> int:
    params = params_from_args(args)          # bad flags fail before the model loads
    interactive = sys.stdin.isatty()
    llm = llm_from_args(args)
    if interactive:
        print(f"corelm chat: {getattr(llm, 'model_path', args.model or 'default model')}. "
              f"Type /? for help, /exit or Ctrl-D to quit.", file=sys.stderr)
    return ChatREPL(llm, params, system=args.system, show_stats=args.verbose, interactive=interactive).run()


# ---------------------------------------------------------------------------------------------------
# generate

def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.file is not None:
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    if not sys.stdin.isatty():
        return sys.stdin.read()
    raise ValueError("no prompt: pass -p PROMPT, -f FILE, or pipe the prompt on stdin.")


def _write_stream(stream: Iterable, live: bool) -> str:
    """Prints the chunks' text (as it comes when live, else at the end) and returns all of it."""
    parts: List[str] = []
    for chunk in stream:
        if chunk.text:
            parts.append(chunk.text)
            if live:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    text = "".join(parts)
    if not live:
        sys.stdout.write(text)
    if text and not text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    params = params_from_args(args)
    prompt = _read_prompt(args)
    llm = llm_from_args(args)
    if args.chat or args.system:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        stream = llm.chat_stream(messages + [{"role": "user", "content": prompt}], params)
    else:
        stream = llm.stream(prompt, params)
    try:
        _write_stream(stream, live=args.stream)
    except KeyboardInterrupt:
        _close(stream)
        print(flush=True)
        return 130
    if args.verbose:
        _print_stats(llm)
    return 0


# ---------------------------------------------------------------------------------------------------
# info

# /proc/cpuinfo flags worth showing when the C++ core (which reports its own view) is not built.
_INTERESTING_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                      "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8",
                      "amx_bf16", "asimd", "asimddp", "sve", "sve2", "i8mm", "bf16")


def _cpuinfo_field(name: str) -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def _numa_nodes() -> int:
    try:
        return max(1, sum(1 for d in os.listdir("/sys/devices/system/node")
                          if d.startswith("node") and d[4:].isdigit()))
    except OSError:
        return 1   # no sysfs (not Linux): one memory domain as far as we can tell


def _core_info() -> Dict[str, Any]:
    """What the C++ core detected and chose; {"error": ...} when it cannot be imported."""
    try:
        core = importlib.import_module("corelm._core")
        return dict(core.cpu_info())
    except Exception as e:   # a diagnostics command should describe a broken build, not die of it
        return {"error": f"corelm._core is not available ({type(e).__name__}: {e})"}


def topology_info(root: Optional[str] = None, threads: Optional[int] = None,
                  numa: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The C++ core's view of the CPU topology (sysfs below root, default this machine) with the
    thread plan for `threads` (default: the default count) under the NUMA policy `numa` under
    "thread_plan", and the plan's (node, threads) shares under "numa"; None without the core."""
    try:
        core = importlib.import_module("corelm._core")
        topo = dict(core.topology(root))
        numa_plan = dict(core.numa_plan(threads, root, numa=numa))
        plan = list(numa_plan["thread_cpus"])
    except Exception:   # not built, or a core that predates the topology: info still describes the rest
        return None
    topo["numa"] = {"policy": numa or "default", "shares": [list(s) for s in numa_plan["shares"]]}
    cpus = {c["id"]: c for c in topo["cpus"]}
    topo["thread_plan"] = [dict(thread=i, cpu=cpu, **{k: cpus[cpu][k] for k in ("core", "node", "type")})
                           if cpu in cpus else dict(thread=i, cpu=-1) for i, cpu in enumerate(plan)]
    return topo


def system_info(threads: Optional[int] = None, numa: Optional[str] = None) -> Dict[str, Any]:
    try:
        import psutil
        physical, logical = psutil.cpu_count(logical=False), psutil.cpu_count(logical=True)
        vm = psutil.virtual_memory()
        memory = {"total_bytes": int(vm.total), "available_bytes": int(vm.available)}
    except ImportError:
        physical, logical, memory = None, os.cpu_count(), {}
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    core = _core_info()
    topo = topology_info(threads=threads, numa=numa) if "error" not in core else None
    info: Dict[str, Any] = {
        "corelm_version": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"model": core.get("brand") or _cpuinfo_field("model name") or platform.processor() or None,
                "arch": platform.machine(), "physical_cores": physical, "logical_cores": logical,
                "usable_cores": usable, "numa_nodes": len(topo["nodes"]) if topo else _numa_nodes()},
        "memory": memory,
    }
    if topo:
        from .engine.model_builder import default_pin_threads
        info["thread_plan"] = topo.pop("thread_plan")
        info.update(topology=topo, pin_threads=default_pin_threads())
    if "error" in core:
        flags = set((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())
        info.update(features=[f for f in _INTERESTING_FLAGS if f in flags], features_source="/proc/cpuinfo",
                    kernels=None, core_error=core["error"])
    else:
        info.update(features=list(core.get("features", [])), features_source="corelm._core",
                    kernels=dict(core.get("kernels", {})),
                    core={k: v for k, v in core.items() if k not in ("brand", "features", "kernels")})
    return info


def model_info(model: str) -> Dict[str, Any]:
    """The model's hyper-parameters from its files; weights are not read, the engine is not built."""
    loader = importlib.import_module("corelm.loader")
    loaded = loader.load_model(model)
    spec = loaded.spec
    n_params = sum(math.prod(shape) for shape in loader.weight_shapes(spec).values())
    return {
        "path": loaded.source or model, "format": loaded.source_format, "description": loaded.description,
        "architecture": spec.arch, "parameters": int(n_params), "layers": spec.num_layers,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "heads": spec.num_heads, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size, "context_length": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta, "tie_word_embeddings": spec.tie_word_embeddings,
        "chat_template": bool(loaded.chat_template),
    }


def _gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _cpu_ranges(ids: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    ids, parts = sorted(ids), []
    for i in ids:
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_topology(topo: Dict[str, Any], plan: List[Dict[str, Any]], pinned: bool,
                    max_plan_lines: int = 16) -> List[str]:
    """Packages, nodes, cores (P/E on hybrid CPUs), SMT, caches, then which thread runs where."""
    cores = topo["cores"]
    kinds = ""
    if topo["hybrid"]:
        kinds = " (" + " + ".join(f"{sum(c['type'] == t for c in cores)} {t}" for t in ("P", "E")) + ")"
    tpc = topo["threads_per_core"]
    lines = [f"Topology:  {_plural(len(topo['packages']), 'package')}, {_plural(len(topo['nodes']), 'NUMA node')}, "
             f"{_plural(len(cores), 'core')}{kinds}, {_plural(len(topo['cpus']), 'logical CPU')}, "
             + (f"SMT {tpc}" if tpc > 1 else "no SMT")]
    for node in topo["nodes"]:
        ids = [c["id"] for c in topo["cpus"] if c["node"] == node]
        lines.append(f"           node {node}: CPUs {_cpu_ranges(ids)} "
                     f"({_plural(sum(c['node'] == node for c in cores), 'core')})")
    groups: Dict[tuple, int] = {}
    for c in topo["caches"]:
        name = f"L{c['level']}" + {"Data": "d", "Instruction": "i"}.get(c["type"], "")
        groups[(name, c["size"], len(c["cpus"]))] = groups.get((name, c["size"], len(c["cpus"])), 0) + 1
    if groups:
        lines.append("Caches:    " + ", ".join(
            f"{name} {_bytes(size)} x{count}" + (f" (shared by {n} CPUs)" if n > 1 else "")
            for (name, size, n), count in groups.items()))
    where = "pinned" if pinned else "not pinned (CORELM_PIN_THREADS=0)"
    lines.append(f"Threads:   {len(plan)}, workers {where}; thread 0 is the calling thread (not pinned)")
    for t in plan[:max_plan_lines]:
        if t["cpu"] < 0:
            lines.append(f"           thread {t['thread']} -> no CPU (more threads than allowed CPUs): not pinned")
            continue
        kind = f", {t['type']}" if t["type"] != "?" else ""
        lines.append(f"           thread {t['thread']} -> cpu {t['cpu']} (core {t['core']}, node {t['node']}{kind})")
    if len(plan) > max_plan_lines:
        lines.append(f"           ... {len(plan) - max_plan_lines} more (see --json)")
    for note in topo["notes"]:
        lines.append(f"           note: {note}")
    if "numa" in topo:
        lines += format_numa(topo["numa"], len(topo["nodes"]))
    return lines


def numa_split(model: Dict[str, Any], shares: List[List[int]]) -> Dict[str, List[List[int]]]:
    """Where a model's layer matrices and lm_head would go under a plan's (node, threads) shares:
    {matrix: [[node, first row, end row], ...]}, cut as the engine cuts them."""
    core = importlib.import_module("corelm._core")
    hd, d, f = model["head_dim"], model["hidden_size"], model["intermediate_size"]
    rows = {"wqkv": (model["heads"] + 2 * model["kv_heads"]) * hd, "wo": d, "w_gate_up": 2 * f, "w_down": d,
            "lm_head": model["vocab_size"]}
    return {name: [list(r) for r in core.numa_split(n, core.numa_row_grain(name, hd), [tuple(s) for s in shares])]
            for name, n in rows.items()}


def format_numa(numa: Dict[str, Any], n_nodes: int) -> List[str]:
    """The policy and where its memory goes."""
    policy, shares = numa["policy"], numa["shares"]
    if policy == "default":
        return ["Placement: --numa not set: weights and KV cache where first touch puts them"]
    total = sum(t for _, t in shares) or 1
    split = ", ".join(f"node {n} {100 * t / total:.0f}% ({_plural(t, 'thread')})" for n, t in shares)
    lines = [f"Placement: --numa {policy}: each matrix's rows and the KV-cache blocks split by node: {split}"
             + ("" if n_nodes > 1 else " (one node: nothing to move)")]
    for name, ranges in (numa.get("model_split") or {}).items():
        lines.append(f"           {name}: " + ", ".join(f"rows {a}-{b - 1} on node {n}" for n, a, b in ranges if b > a))
    return lines


def format_info(info: Dict[str, Any]) -> str:
    cpu, mem = info["cpu"], info["memory"]
    lines = [
        f"corelm {info['corelm_version']} (Python {info['python']}, {info['platform']})",
        f"CPU:       {cpu['model'] or '?'} ({cpu['arch']})",
        f"Cores:     {cpu['physical_cores'] or '?'} physical, {cpu['logical_cores'] or '?'} logical, "
        f"{cpu['usable_cores'] or '?'} usable by this process",
        f"NUMA:      {cpu['numa_nodes']} node{'s' if cpu['numa_nodes'] != 1 else ''}",
        f"Memory:    {_gib(mem.get('total_bytes'))} total, {_gib(mem.get('available_bytes'))} available",
        f"Features:  {' '.join(info['features']) or '-'}  (from {info['features_source']})",
    ]
    if info["kernels"]:
        lines.append("Kernels:   " + ", ".join(f"{op}={isa}" for op, isa in info["kernels"].items()))
    else:
        lines.append(f"Kernels:   {info.get('core_error', '-')}")
    amx = (info.get("core") or {}).get("amx")
    if amx is not None:
        if not amx.get("available"):
            state = f"absent ({amx.get('reason') or '?'})"
        elif amx.get("in_use"):
            state = "available, AMX-BF16 serves bf16 weights (kernel table amx)"
        else:
            state = "available (CORELM_ISA=amx lets AMX-BF16 serve bf16 weights)"
        lines.append("AMX:       " + state)
    if info.get("topology"):
        lines += format_topology(info["topology"], info["thread_plan"], info["pin_threads"])
    model = info.get("model")
    if model:
        lines += [
            f"Model:     {model['path']} ({model['description'] or model['format']})",
            f"           {model['architecture']}, {_count(model['parameters'])} parameters, "
            f"{model['layers']} layers, hidden {model['hidden_size']}, ffn {model['intermediate_size']}",
            f"           {model['heads']} heads ({model['kv_heads']} kv) of {model['head_dim']}, "
            f"vocab {model['vocab_size']}, context {model['context_length']}, "
            f"chat template: {'yes' if model['chat_template'] else 'no'}",
        ]
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    if args.threads is not None and not 1 <= args.threads <= 1024:
        raise ValueError(f"--threads must be in [1, 1024], got {args.threads}.")
    info = system_info(threads=args.threads, numa=args.numa)
    if args.model:
        info["model"] = model_info(args.model)
        if info.get("topology") and args.numa:
            info["topology"]["numa"]["model_split"] = numa_split(info["model"], info["topology"]["numa"]["shares"])
    print(json.dumps(info, indent=2, default=str) if args.json else format_info(info))
    return 0


# ---------------------------------------------------------------------------------------------------
# serve

def cmd_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}.")
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}.")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}.")
    try:
        from .entrypoints import server
    except ImportError as e:
        print(f"error: corelm serve needs FastAPI and uvicorn: pip install 'corelm[serve]' ({e})", file=sys.stderr)
        return 1
    name = args.served_model_name or server.model_name_for(args.model)
    return server.run(lambda: llm_from_args(args), name, host=args.host, port=args.port, api_key=args.api_key,
                      max_body_bytes=args.max_body_bytes, log_level=args.log_level)


# ---------------------------------------------------------------------------------------------------
# batch

def cmd_batch(args: argparse.Namespace) -> int:
    if args.ctx_size < 0:
        raise ValueError(f"--ctx-size must be 0 (the model's) or positive, got {args.ctx_size}.")
    from .entrypoints.batch import run_batch
    s = run_batch(args.input, args.output, workers=args.workers, threads=args.threads, model=args.model,
                  dtype=args.dtype, max_seq_len=args.ctx_size or None, task_size=args.task_size,
                  progress=args.progress, ray_address=args.ray, numa=args.numa, schedule=args.schedule,
                  activations=args.activations)
    print(f"corelm batch: {s['requests']} written ({s['errors']} errors), {s['skipped']} already done, "
          f"{s['generated_tokens']} tokens in {s['seconds']:.1f} s, {s['restarts']} worker restarts -> {args.output}",
          file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------

def _tolerant_text_streams() -> None:
    """Model text or piped input that the terminal's encoding cannot carry is replaced, not fatal."""
    for stream in (sys.stdout, sys.stderr, sys.stdin):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="replace")
            except (ValueError, OSError):
                pass


def cmd_convert(args: argparse.Namespace) -> int:
    import time
    from .convert import convert
    t0 = time.perf_counter()
    out = convert(args.src, args.output, weights=args.weights, progress=args.progress, overwrite=args.force)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {out} ({args.weights}, {size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                  # argparse printed the usage (status 2) or --help (0)
        return e.code if isinstance(e.code, int) else 2
    _tolerant_text_streams()
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
    except _user_errors() as e:
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
