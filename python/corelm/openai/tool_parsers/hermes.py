"""Hermes-style calls, as Qwen2.5 writes them:
<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
Qwen2.5-Coder often answers with the call object alone instead, bare or in a ```json fence: an answer that
is exactly one such object naming a declared tool is that call too."""
import json
import re
from typing import Any, Dict, List, Optional, Tuple

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
# How an answer that is a bare call begins, whitespace removed: while a streamed answer may still become
# one, it is held back (may_be_bare_call).
_BARE_STARTS = ('{"name"', '```json{"name"', '```{"name"')


def may_be_bare_call(answer_so_far: str) -> bool:
    """Whether an unfinished answer may still turn out to be a bare call."""
    head = "".join(answer_so_far[:64].split())
    return any(s.startswith(head) or head.startswith(s) for s in _BARE_STARTS)


def _bare_call(text: str, names) -> Optional[Tuple[str, Dict[str, Any]]]:
    body = text.strip()
    fenced = _FENCED.fullmatch(body)
    try:
        call = json.loads(fenced.group(1) if fenced else body)
    except ValueError:
        return None
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        return None
    if not isinstance(call["name"], str) or call["name"] not in names or not isinstance(call["arguments"], dict):
        return None
    return call["name"], call["arguments"]


def parse(text: str, names=()) -> Tuple[Optional[str], List[Tuple[str, Dict[str, Any]]]]:
    """(the text before the first call, or None when there is none; the calls). Any malformed call
    (not JSON, no name, arguments not an object) leaves the whole text as content. names: the declared
    tools, which a bare call (the whole answer one call object) must name."""
    start = text.find(START)
    if start < 0:
        bare = _bare_call(text, names)
        return (None, [bare]) if bare else (text, [])
    calls = []
    for body in _CALL.findall(text, start):
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        args = call.get("arguments", call.get("parameters", {}))
        if not isinstance(args, dict):
            return text, []
        calls.append((call["name"], args))
    content = text[:start].rstrip()
    return (content or None), calls
