"""Tool-call syntaxes: each module parses one model family's way of writing calls in its output.

A parser module has START (the text that opens a call, so a stream can hold text back once it may be
one), may_be_bare_call(answer so far) (whether an unfinished answer may still be a call written without
START, held back while it may) and parse(text, declared tool names) -> (content before the first call or
None, [(name, arguments dict)]); text that is not a well-formed call stays content. Add a family: write
its module and list it in PARSERS.
"""
from . import hermes

PARSERS = {"hermes": hermes}
DEFAULT = hermes        # Qwen2.5, Hermes, and the ChatML models that follow them
