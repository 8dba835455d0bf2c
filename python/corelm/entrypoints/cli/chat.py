"""`corelm chat`: a multi-turn REPL whose commands follow `ollama run` (/set system, /clear, /stats,
/exit, triple quotes for multi-line messages)."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List, Optional

from ...engine import SamplingParams
from .flags import (add_engine_flags, add_model_arg, add_sampling_flags, add_verbose_flag, describe_sampling,
                    llm_from_args, sampling_choices, sampling_params)
from .terminal import USER_ERRORS, close_stream, print_stats


def add_parser(commands) -> None:
    p = commands.add_parser("chat", help="chat with a model (multi-turn, streaming)",
                            description="Chat with a model. Type /? in the chat for its commands.")
    add_model_arg(p)
    add_engine_flags(p)
    add_verbose_flag(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="system message")
    add_sampling_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sampling_params(args)                    # bad flags fail before the model loads
    if sys.stdin is None:                    # started with fd 0 closed (`corelm chat <&-`)
        raise ValueError("stdin is closed: corelm chat reads the messages from it.")
    interactive = sys.stdin.isatty()
    llm = llm_from_args(args)
    model_defaults = getattr(getattr(llm, "engine", None), "sampling_defaults", None)
    params = sampling_params(args, model_defaults)
    sampling = describe_sampling(sampling_choices(args, model_defaults))
    if args.verbose:
        print(sampling, file=sys.stderr)
    if interactive:
        print(f"corelm chat: {getattr(llm, 'model_path', args.model or 'default model')}. "
              f"Type /? for help, /exit or Ctrl-D to quit.", file=sys.stderr)
    return ChatREPL(llm, params, system=args.system, show_stats=args.verbose, interactive=interactive,
                    sampling=sampling).run()


HELP = """Available commands:
  /set system TEXT   set the system message
  /set verbose       show speed stats after each answer (/set quiet hides them)
  /stats             toggle the speed stats (and say which sampling defaults are in force)
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
                 show_stats: bool = False, interactive: bool = False, sampling: str = ""):
        self.llm, self.params = llm, params
        self.system = system
        self.sampling = sampling    # which sampling defaults are in force (describe_sampling)
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
            if self.show_stats and self.sampling:
                print(self.sampling)
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
            close_stream(stream)                   # keep the partial answer, back to the prompt
        except BrokenPipeError:              # stdout is gone: nothing more to say to anyone
            raise
        except USER_ERRORS as e:          # e.g. the conversation no longer fits the context
            close_stream(stream)
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
            print_stats(self.llm)
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
