"""The OpenAI request bodies (pydantic, strict: "0.5" is not a number) and the error envelope.

Unknown fields are ignored, as vLLM does; known fields of the wrong type, out-of-range values and
features corelm does not have give a 400 whose message is a fixed text naming the parameter: values
and user text are never echoed back (llama.cpp PR#9210: "error messages are supposed to be fixed
strings").
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """Raised anywhere in a request; the app turns it into {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# Fixed descriptions of each sampling parameter's valid values (SamplingParams' own messages quote the
# value, so they are not passed on).
_RANGES = {
    "n": "an integer from 1 to {max_n} (and 1 when temperature is 0)",
    "temperature": "a finite number >= 0",
    "top_p": "a number in (0, 1]",
    "top_k": "an integer: 0 or -1 (disabled), or at least 1",
    "min_p": "a number in [0, 1]",
    "repetition_penalty": "a number > 0",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "seed": "an integer",
    "stop": "a non-empty string or a list of non-empty strings",
    "stop_token_ids": "a list of token ids inside the vocabulary",
    "ignore_eos": "a boolean",
    "max_tokens": "an integer >= 1",
    "min_tokens": "an integer >= 0 and <= max_tokens",
    "logprobs": "an integer from 0 to {max_logprobs}",
    "skip_special_tokens": "a boolean",
    "include_stop_str_in_output": "a boolean",
}


def sampling_error(exc: ValueError, rename: Optional[Dict[str, str]] = None, **fmt: Any) -> APIError:
    """SamplingParams' ValueError -> a 400 naming the parameter, with a fixed message."""
    text = str(exc)
    for name in sorted(_RANGES, key=len, reverse=True):
        if text.startswith(name):
            param = (rename or {}).get(name, name)
            return bad_request(f"Invalid value for '{param}': it must be {_RANGES[name].format(**fmt)}.", param)
    return bad_request("Invalid sampling parameters.")


def validation_error(exc: ValidationError) -> APIError:
    """pydantic's error -> a 400 naming the top-level field (never the input, which is user text)."""
    errors = exc.errors(include_input=False, include_url=False)
    if not errors:
        return bad_request("Invalid request body.")
    err = errors[0]
    kind = err.get("type", "")
    if kind in ("json_invalid", "json_type"):
        return bad_request("The request body is not valid JSON.", code="invalid_json")
    if kind == "model_type" or not err.get("loc"):
        return bad_request("The request body must be a JSON object.")
    param = str(err["loc"][0])
    if kind == "missing":
        return bad_request(f"Missing required parameter '{param}'.", param)
    return bad_request(f"Invalid type or value for '{param}'.", param)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: Optional[bool] = None


Number = Union[int, float]  # strict mode: JSON numbers only, no strings


class _Sampling(_Body):
    """Fields shared by both endpoints, OpenAI's and vLLM's extras (top_k, min_p, ...)."""
    model: Optional[str] = None
    n: int = 1
    max_tokens: Optional[int] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    logit_bias: Optional[Dict[str, Number]] = None
    user: Optional[str] = None
    # vLLM's extra sampling parameters (the openai client sends them through extra_body)
    top_k: Optional[int] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[List[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(_Sampling):
    prompt: Union[str, List[Union[int, str, List[int]]]]   # a prompt, token ids, or a list of either
    max_tokens: Optional[int] = 16          # OpenAI's default for completions
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class TextPart(_Body):
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[TextPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Any]] = None
    response_format: Optional[Dict[str, Any]] = None
