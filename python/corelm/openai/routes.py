"""The generation APIs by URL, for the server and batch files alike: OpenAI's chat completions and completions
(protocol.py), Anthropic's messages (anthropic.py) and OpenAI's responses (responses_api.py). Each body maps
onto a GenerationRequest; the response object answers in the API's own shape.

    req = parse_body(url, body)             # APIError when invalid
    prompts = encode(engine, req)           # token ids, checked against the model
    response = make_response(req, prompt_tokens, model, tokens)     # .add(prompt index, chunk), .body()
"""
from __future__ import annotations

from typing import Any, Dict, Union

from . import anthropic, responses_api
from .protocol import GenerationRequest

URLS = frozenset({responses_api.RESPONSES_URL, anthropic.MESSAGES_URL})   # besides chat and completions
encode = anthropic.encode       # encode_prompts, and a /v1/messages prefill


def parse_body(url: str, body: Union[bytes, str, Dict[str, Any]]) -> GenerationRequest:
    if url == responses_api.RESPONSES_URL:
        return responses_api.parse_responses(body)
    return anthropic.parse_body(url, body)


def make_response(req: GenerationRequest, prompt_tokens: int, model: str, tokens):
    if isinstance(req, responses_api.ResponsesRequest):
        return responses_api.ResponseObject(req, prompt_tokens, model, tokens)
    return anthropic.make_response(req, prompt_tokens, model, tokens)
