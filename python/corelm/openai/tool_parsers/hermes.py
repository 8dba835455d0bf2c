"""Hermes-style calls, as Qwen2.5 writes them:
<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>"""
import json
import re
from typing import Any, Dict, List, Optional, Tuple

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse(text: str) -> Tuple[Optional[str], List[Tuple[str, Dict[str, Any]]]]:
    """(the text before the first call, or None when there is none; the calls). Any malformed call
    (not JSON, no name, arguments not an object) leaves the whole text as content."""
    start = text.find(START)
    if start < 0:
        return text, []
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
