"""`corelm generate`: complete one prompt (from -p, a file or stdin) and print the completion."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Iterable, List

from ...engine import StructuredOutputsParams
from .flags import (add_engine_flags, add_model_arg, add_sampling_flags, add_verbose_flag, describe_sampling,
                    llm_from_args, sampling_choices, sampling_params)
from .terminal import close_stream, print_stats


def add_parser(commands) -> None:
    p = commands.add_parser("generate", help="complete one prompt",
                            description="Complete one prompt and print the completion.")
    add_model_arg(p)
    add_engine_flags(p)
    add_verbose_flag(p)
    p.add_argument("-p", "--prompt", default=None, help="the prompt (default: read stdin)")
    p.add_argument("-f", "--file", default=None, help="read the prompt from this file")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", default=None, metavar="TEXT", help="system message (implies --chat)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print text as it is generated (default: on)")
    add_sampling_flags(p)
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to JSON valid against the JSON schema in FILE (llguidance)")
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.file is not None:
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    if sys.stdin is not None and not sys.stdin.isatty():   # None: fd 0 closed
        return sys.stdin.read()
    raise ValueError("no prompt: pass -p PROMPT, -f FILE, or pipe the prompt on stdin.")


def write_stream(stream: Iterable, live: bool) -> str:
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


def read_schema(path: str):
    """The JSON schema in `path` (ValueError naming the file when it cannot be read or parsed)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"--json-schema: cannot read {path}: {e.strerror}.") from None
    except ValueError as e:
        raise ValueError(f"--json-schema: {path} is not valid JSON ({e}).") from None


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    if args.json_schema is not None:
        try:
            so = StructuredOutputsParams(json=read_schema(args.json_schema))
        except ValueError as e:
            raise ValueError(f"--json-schema {args.json_schema}: {e}") from None
        params = dataclasses.replace(params, structured_outputs=so, guided_decoding=None)
    prompt = read_prompt(args)
    llm = llm_from_args(args)
    model_defaults = getattr(getattr(llm, "engine", None), "sampling_defaults", None)
    params = dataclasses.replace(sampling_params(args, model_defaults), structured_outputs=params.structured_outputs,
                                 guided_decoding=params.guided_decoding)
    if args.verbose:
        print(describe_sampling(sampling_choices(args, model_defaults)), file=sys.stderr)
    if args.chat or args.system:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        stream = llm.chat_stream(messages + [{"role": "user", "content": prompt}], params)
    else:
        stream = llm.stream(prompt, params)
    try:
        write_stream(stream, live=args.stream)
    except KeyboardInterrupt:
        close_stream(stream)
        print(flush=True)
        return 130
    if args.verbose:
        print_stats(llm)
    return 0
