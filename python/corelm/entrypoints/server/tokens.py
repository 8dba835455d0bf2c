"""/tokenize and /detokenize, as vLLM's server has them:

    POST /tokenize    {"prompt": "text", "add_special_tokens": true}
                      {"messages": [...], "tools": [...], "add_generation_prompt": true, "chat_template_kwargs": {...}}
                      -> {"tokens": [...], "count": N, "max_model_len": M}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "text"}
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from ...openai.protocol import (ChatMessage, _Body, _chat_messages, bad_request, check_template_kwargs, encode_chat,
                                parse_body_as)
from ...openai.tools import check_tools


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None      # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    tools: Optional[List[Any]] = None       # rendered by the chat template, as chat completions does


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: List[int]


def tokenize(engine, body: Union[bytes, Dict[str, Any]]) -> Dict[str, Any]:
    """The token ids of a prompt, or of a conversation rendered with the chat template. Slow for long
    inputs: run it off the event loop."""
    req = parse_body_as(TokenizeRequest, body)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("Give exactly one of 'prompt' and 'messages'.", "prompt" if req.prompt is None else "messages")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("The 'messages' is empty.", "messages")
        kwargs = check_template_kwargs(req.chat_template_kwargs)
        tools = check_tools(req.tools, None, None)
        if tools is not None:           # the same template variables and messages as a chat completion's
            kwargs = {**(kwargs or {}), "tools": tools.tools}
        messages = _chat_messages(req)
        ids = encode_chat(engine, messages, kwargs, req.add_generation_prompt,
                          add_special_tokens=bool(req.add_special_tokens))
    else:
        ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_seq_len}


def detokenize(engine, body: Union[bytes, Dict[str, Any]]) -> Dict[str, Any]:
    req = parse_body_as(DetokenizeRequest, body)
    if any(not 0 <= t < engine.vocab_size for t in req.tokens):
        raise bad_request("The tokens contain ids outside the vocabulary.", "tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
