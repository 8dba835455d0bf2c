"""Tool calling: the request's `tools` / `tool_choice` / `parallel_tool_calls`, checked; the grammar that
forces a call (tool_choice "required" or a named function); the model's output parsed back into
OpenAI's `tool_calls`.

The tools go to the chat template (its `tools` variable), which writes them into the prompt in the
model's own way; the model answers in its tool-call syntax (tool_parsers), which is turned into
tool_calls with finish_reason "tool_calls". A forced call is constrained to the JSON object
{"name": ..., "arguments": {...}} of one of the allowed functions, whatever the model's syntax.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from ..engine.guided import StructuredOutputsParams
from . import tool_parsers
from .errors import bad_request

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8   # calls one forced answer may hold


@dataclass
class ToolConfig:
    tools: List[Dict[str, Any]]         # OpenAI's [{"type": "function", "function": {...}}], for the template
    choice: str                         # "auto" | "none" | "required" | "function" (one named function)
    name: Optional[str] = None          # the named function
    parallel: bool = True
    parser: Any = tool_parsers.DEFAULT

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def guide(self) -> StructuredOutputsParams:
        """The constraint of a forced call: {"name": one of the functions, "arguments": its parameters};
        with tool_choice "required" and parallel calls allowed, a list of 1 to MAX_PARALLEL_CALLS of them
        (as vLLM forces "required")."""
        options = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for f in (t["function"] for t in self.tools) if self.name in (None, f["name"])]
        call = options[0] if len(options) == 1 else {"anyOf": options}
        if self.choice == "required" and self.parallel:
            call = {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
        so = StructuredOutputsParams(json=call)
        so.source_param = "tools"
        return so

    @property
    def names(self) -> List[str]:
        return [t["function"]["name"] for t in self.tools]

    def parse(self, text: str) -> Tuple[Optional[str], List[Dict[str, Any]]]:
        """The output -> (content, OpenAI tool_calls); no calls leaves the text as content."""
        if self.choice == "none":
            return text, []
        if self.forced:
            try:
                forced = json.loads(text)
                content, calls = None, [(c["name"], c["arguments"]) for c in
                                        (forced if isinstance(forced, list) else [forced])]
            except (ValueError, KeyError, TypeError):
                return text, []
        else:
            content, calls = self.parser.parse(text, self.names)
        if not self.parallel:
            calls = calls[:1]
        return content, [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args)}} for name, args in calls]


def _parameters(function: Dict[str, Any]) -> Dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def check_tools(tools: Optional[List[Any]], tool_choice: Union[str, Dict[str, Any], None],
                parallel: Optional[bool]) -> Optional[ToolConfig]:
    """The request's tool fields -> ToolConfig (None without tools); a 400 naming the field at fault."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'.", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"Invalid value for 'tools': give at most {MAX_TOOLS} tools.", "tools")
    names = []
    for tool in tools:
        f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"] \
                or not isinstance(f.get("parameters", {}), dict):
            raise bad_request("Invalid value for 'tools': each tool must be {'type': 'function', 'function': "
                              "{'name', 'description', 'parameters'}}.", "tools")
        try:
            StructuredOutputsParams(json=_parameters(f))
        except ValueError:
            raise bad_request("Invalid value for 'tools': a function's 'parameters' is not a valid JSON schema "
                              "(within the size limits).", "tools") from None
        names.append(f["name"])
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        config = ToolConfig(list(tools), tool_choice or "auto")
    else:
        named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
        f = tool_choice.get("function") if named else None
        name = f.get("name") if isinstance(f, dict) else None
        if name not in names:
            raise bad_request("Invalid value for 'tool_choice': give 'auto', 'none', 'required' or "
                              "{'type': 'function', 'function': {'name'}} naming one of 'tools'.", "tool_choice")
        config = ToolConfig(list(tools), "function", name)
    config.parallel = parallel is not False
    return config


def template_messages_tool_calls(tool_calls: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them: arguments as an object (OpenAI
    sends a JSON string; Qwen2.5's template writes `arguments | tojson`)."""
    out = []
    for call in tool_calls:
        f = dict(call["function"])
        try:
            f["arguments"] = json.loads(f["arguments"])
        except ValueError:
            pass            # not JSON: the template gets the text
        out.append({**call, "function": f})
    return out
