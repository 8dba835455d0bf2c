"""The OpenAI Batch line format: validating input lines and building output lines.

Validation happens in the parent, before any engine sees a request: a line that is not a JSON
object, lacks a string custom_id, or has another method or url becomes an output line with
`response: null` and `error: {"code", "message"}`. The body is checked by corelm.openai exactly as
the server checks it (same fields, defaults, limits and messages); its refusals become error lines
with the server's code (or "invalid_request" where the server's is only the HTTP status).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from ...openai import CHAT_URL, COMPLETIONS_URL, APIError, GenerationRequest
from ...openai import embeddings
from ...openai.anthropic import MESSAGES_URL
from ...openai.responses_api import RESPONSES_URL
from ...openai.routes import parse_body

MAX_CUSTOM_ID = 512


class BatchLineError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class BatchRequest:
    custom_id: str
    request: Union[GenerationRequest, embeddings.PoolingRequest]


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON number")   # as the server's JSON parser says


# A line read from UTF-8 bytes holds a surrogate only through a \uD800-\uDFFF escape; a pair decodes to
# one character, a lone one stays and is not text: the tokenizer refuses it, and it cannot be written out.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(obj: Any) -> bool:
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


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
            obj = json.loads(line, parse_constant=_not_json)
        except ValueError as e:
            raise BatchLineError("invalid_json", f"the line is not valid JSON ({_short(str(e), 80)}).") from None
        except RecursionError:
            raise BatchLineError("invalid_json", "the line is not valid JSON (nested too deeply).") from None
        if not isinstance(obj, dict):
            raise BatchLineError("invalid_json", "the line must be a JSON object.")
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID or _SURROGATE.search(cid):
            raise BatchLineError("invalid_custom_id",
                                 f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters "
                                 "(Unicode text: no lone \\uD800-\\uDFFF escape).")
        custom_id = cid
        if (_SURROGATE_ESCAPE.search(line) or _SURROGATE.search(line)) and _has_lone_surrogate(obj):
            raise BatchLineError("invalid_request", "the line holds a lone surrogate escape (\\uD800-\\uDFFF "
                                 "without its pair), which is not Unicode text.")
        if "body" not in obj and ("messages" in obj or "prompt" in obj):   # the bare shorthand
            obj = {"custom_id": cid, "method": "POST",
                   "url": CHAT_URL if "messages" in obj else COMPLETIONS_URL,
                   "body": {k: v for k, v in obj.items() if k != "custom_id"}}
        if obj.get("method", "POST") != "POST":
            raise BatchLineError("invalid_method", "method must be POST.")
        url = obj.get("url")
        if url not in (CHAT_URL, COMPLETIONS_URL, MESSAGES_URL, RESPONSES_URL, *embeddings.POOLING_URLS):
            raise BatchLineError("invalid_url", f"url must be {CHAT_URL}, {COMPLETIONS_URL}, {MESSAGES_URL}, "
                                                f"{RESPONSES_URL}, {embeddings.EMBEDDINGS_URL}, "
                                                f"{embeddings.SCORE_URL} or {embeddings.RERANK_URL}.")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise BatchLineError("invalid_request", "body must be a JSON object.")
        try:
            # /v1/messages, /v1/responses: answered in their own shapes; pooling bodies wait for the model
            request = embeddings.validate(url, body) if url in embeddings.POOLING_URLS else parse_body(url, body)
        except APIError as e:
            raise BatchLineError(e.code or "invalid_request", e.message) from None
        except (ValueError, RecursionError) as e:   # a check below the API layer (a forced tool call's schema size)
            raise BatchLineError("invalid_request", _short(str(e) or type(e).__name__)) from None
        if request.stream:   # a batch answer is whole
            raise BatchLineError("unsupported_parameter", "'stream' is not supported in batch files.")
        return BatchRequest(cid, request)
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


def response_line(custom_id: str, body: Dict[str, Any]) -> Dict[str, Any]:
    """The output line for a finished request; `body` is its OpenAI response (corelm.openai.Response), or
    Anthropic's message for /v1/messages."""
    return {"id": _rid("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": _rid("req_"), "body": body}, "error": None}
