"""The OpenAI Batch line format: validating input lines and building output lines.

Validation happens in the parent, before any engine sees a request: a line that is not a JSON
object, lacks a string custom_id, has another method or url, or a body whose fields have the wrong
type or range, becomes an output line with `response: null` and `error: {"code", "message"}`.
Messages name the field, never echo the user's text (long values are cut).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from ..sampling import SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
MAX_N = 16
MAX_CUSTOM_ID = 512
_ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields of the OpenAI bodies that change the output and that corelm cannot honour: refused, not ignored.
_UNSUPPORTED = ("logit_bias", "echo", "suffix", "tools", "tool_choice", "functions", "best_of")


class BatchLineError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class BatchRequest:
    custom_id: str
    kind: str                              # "chat" | "completion"
    prompt: Union[str, List[int], List[Dict[str, str]]]   # text, token ids, or chat messages
    params: SamplingParams
    model: Optional[str]


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(body: Dict[str, Any], name: str, check, what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise BatchLineError("invalid_request", f"body.{name} must be {what}.")
    return v


def _messages(value) -> List[Dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BatchLineError("invalid_request", "body.messages must be a non-empty list of messages.")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BatchLineError("invalid_request", f"body.messages[{i}] must be an object with a role in "
                                                    f"{', '.join(_ROLES)}.")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                    raise BatchLineError("invalid_request", f"body.messages[{i}].content: only text parts are supported.")
                parts.append(p["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BatchLineError("invalid_request", f"body.messages[{i}].content must be a string or a list of text parts.")
        out.append({"role": m["role"], "content": content})
    return out


def _prompt(value) -> Union[str, List[int]]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]                   # a list holding one prompt
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return list(value)
    raise BatchLineError("invalid_request", "body.prompt must be a string or a list of token ids "
                                            "(one prompt per line).")


def parse_body(kind: str, body: Dict[str, Any]) -> Tuple[Any, SamplingParams]:
    """(prompt, SamplingParams) for one body; BatchLineError on anything invalid."""
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise BatchLineError("unsupported", f"body.{name} is not supported.")
    if kind == "chat":
        prompt = _messages(body.get("messages"))
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            raise BatchLineError("unsupported", "body.logprobs is not supported in batch files.")
        max_tokens = _field(body, "max_completion_tokens", _is_int, "an integer",
                            _field(body, "max_tokens", _is_int, "an integer"))
    else:
        if "prompt" not in body:
            raise BatchLineError("invalid_request", "body.prompt is required for /v1/completions.")
        prompt = _prompt(body.get("prompt"))
        if body.get("logprobs") is not None:
            raise BatchLineError("unsupported", "body.logprobs is not supported in batch files.")
        max_tokens = _field(body, "max_tokens", _is_int, "an integer", 16)   # OpenAI's default
    n = _field(body, "n", _is_int, "an integer", 1)
    if not 1 <= n <= MAX_N:
        raise BatchLineError("invalid_request", f"body.n must be an integer from 1 to {MAX_N}.")
    num = lambda name, default: _field(body, name, _is_num, "a number", default)   # noqa: E731
    try:
        params = SamplingParams(
            n=n, temperature=num("temperature", 1.0), top_p=num("top_p", 1.0),
            top_k=_field(body, "top_k", _is_int, "an integer", 0), min_p=num("min_p", 0.0),
            repetition_penalty=num("repetition_penalty", 1.0), presence_penalty=num("presence_penalty", 0.0),
            frequency_penalty=num("frequency_penalty", 0.0), seed=_field(body, "seed", _is_int, "an integer"),
            stop=body.get("stop"), stop_token_ids=body.get("stop_token_ids"),
            ignore_eos=_field(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False),
            max_tokens=max_tokens, min_tokens=_field(body, "min_tokens", _is_int, "an integer", 0))
    except ValueError as e:
        raise BatchLineError("invalid_request", "body: " + _short(str(e))) from None
    return prompt, params


def parse_line(line: Union[str, bytes]) -> BatchRequest:
    """One input line -> BatchRequest; BatchLineError (code, message) when it is malformed. The
    error carries `custom_id` when the line had a usable one."""
    custom_id = None
    try:
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError:
                raise BatchLineError("invalid_json", "the line is not valid UTF-8.") from None
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise BatchLineError("invalid_json", f"the line is not valid JSON ({_short(str(e), 80)}).") from None
        if not isinstance(obj, dict):
            raise BatchLineError("invalid_json", "the line must be a JSON object.")
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
            raise BatchLineError("invalid_custom_id",
                                 f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters.")
        custom_id = cid
        if "body" not in obj and ("messages" in obj or "prompt" in obj):   # the bare shorthand
            obj = {"custom_id": cid, "method": "POST",
                   "url": CHAT_URL if "messages" in obj else COMPLETIONS_URL,
                   "body": {k: v for k, v in obj.items() if k != "custom_id"}}
        if obj.get("method", "POST") != "POST":
            raise BatchLineError("invalid_method", "method must be POST.")
        url = obj.get("url")
        if url not in (CHAT_URL, COMPLETIONS_URL):
            raise BatchLineError("invalid_url", f"url must be {CHAT_URL} or {COMPLETIONS_URL}.")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise BatchLineError("invalid_request", "body must be a JSON object.")
        kind = "chat" if url == CHAT_URL else "completion"
        prompt, params = parse_body(kind, body)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        return BatchRequest(cid, kind, prompt, params, model)
    except BatchLineError as e:
        e.custom_id = custom_id
        raise


def _rid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def error_line(custom_id: Optional[str], code: str, message: str, line_no: Optional[int] = None) -> Dict[str, Any]:
    err: Dict[str, Any] = {"code": code, "message": message}
    if line_no is not None:
        err["line"] = line_no
    return {"id": _rid("batch_req_"), "custom_id": custom_id, "response": None, "error": err}


def response_line(req: BatchRequest, outputs, prompt_tokens: int, model: str) -> Dict[str, Any]:
    """The output line for a finished request; `outputs` are corelm CompletionOutputs."""
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    finish = lambda o: "length" if o.finish_reason == "length" else "stop"   # noqa: E731
    if req.kind == "chat":
        body = {"id": _rid("chatcmpl-"), "object": "chat.completion",
                "choices": [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                             "logprobs": None, "finish_reason": finish(o)} for o in outputs]}
    else:
        body = {"id": _rid("cmpl-"), "object": "text_completion",
                "choices": [{"index": o.index, "text": o.text, "logprobs": None,
                             "finish_reason": finish(o)} for o in outputs]}
    body.update(created=int(time.time()), model=req.model or model,
                usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                       "total_tokens": prompt_tokens + completion_tokens})
    body = {k: body[k] for k in ("id", "object", "created", "model", "choices", "usage")}
    return {"id": _rid("batch_req_"), "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": _rid("req_"), "body": body}, "error": None}
