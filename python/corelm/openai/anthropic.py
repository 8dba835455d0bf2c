"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens), as llama.cpp's server, Ollama
and LM Studio serve it: a body is checked in Anthropic's shape, then turned into the equivalent chat
completions body and parsed by protocol.parse_request, so it meets the same chat template, sampling
parameters, limits and tool-call machinery as /v1/chat/completions; the engine's output comes back as a
message (content blocks, stop_reason) or as Anthropic's stream of named events.

    req = parse_body(url, body)                     # MESSAGES_URL -> MessagesRequest; other urls: parse_request
    prompts = encode(engine, req)                   # encode_prompts, with a MessagesRequest's prefill
    response = make_response(req, prompt_tokens, model, tokens)     # MessageResponse or openai Response
    MessageStream(response).start() / add(item) / end() / error(e)  # SSE text, for a streamed request
    count_tokens(engine, body, byte_limit)          # {"input_tokens": N}

A conversation that ends with an assistant turn of text is a prefill, as in Anthropic's API: the model
continues that text (rendered after the template's generation prompt), and the answer holds only what it
added.

Differences from Anthropic's service: images and documents are refused (400); thinking blocks in earlier
assistant turns are dropped; a tool_result's is_error is not shown to the model; the `thinking` and
`metadata` fields are ignored.
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .protocol import (CHAT_URL, APIError, GenerationRequest, bad_request, check_context, check_prompt_bytes,
                       encode_chat, encode_prompts, parse_request, validation_error)
from .responses import OnChat, Response

MESSAGES_URL = "/v1/messages"
COUNT_TOKENS_URL = "/v1/messages/count_tokens"
URLS = frozenset({MESSAGES_URL, COUNT_TOKENS_URL})

# Anthropic's error types by HTTP status (its API reference, "Errors"); other 4xx are invalid requests.
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}

# The chat completions names the checks below protocol.parse_request report, in Anthropic's words.
_PARAMS = {"stop": "stop_sequences"}
_WORDS = [("'stop'", "'stop_sequences'"), ("a function's 'parameters'", "a tool's 'input_schema'")]


def owns(path: str) -> bool:
    """Whether a request path is Anthropic's (its errors then take Anthropic's shape)."""
    return path == MESSAGES_URL or path.startswith(MESSAGES_URL + "/")


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(e: APIError) -> Dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}, as Anthropic answers an error."""
    return {"type": "error", "error": {"type": error_type(e.status), "message": _renamed(e).message}}


def _renamed(e: APIError) -> APIError:
    """A chat completions refusal in Anthropic's words; its error has no `param`, so a message that does not
    name the field starts with it, as Anthropic's own do ("max_tokens: ...")."""
    message, param = e.message, _PARAMS.get(e.param, e.param)
    for old, new in _WORDS:
        message = message.replace(old, new)
    if param and f"'{param}'" not in message and not message.startswith(f"{param}: "):
        message = f"{param}: {message}"
    return APIError(e.status, message, e.type, param, e.code)


# ---------------------------------------------------------------------------------------------------
# Request bodies

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


Number = Union[int, float]


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, List[Dict[str, Any]]]


class CountTokensBody(_Body):
    model: Optional[str] = None
    messages: List[MessageParam] = Field(min_length=1)
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Dict[str, Any]] = None


class MessagesBody(CountTokensBody):
    max_tokens: int
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[int] = None
    stream: bool = False
    metadata: Optional[Dict[str, Any]] = None      # Anthropic's user_id: accepted, not used


@dataclasses.dataclass
class MessagesRequest(GenerationRequest):
    """A /v1/messages body as the chat completions request it maps onto (a GenerationRequest the server and
    batch run as any other), with what the answer needs to be written back in Anthropic's shape."""
    stop_sequences: Optional[List[str]] = None
    prefill: bool = False       # messages[-1] is an assistant's text for the model to continue


def _refuse(message: str, param: str = "messages") -> APIError:
    return bad_request(message, param)


def _text_blocks(blocks: List[Dict[str, Any]], param: str) -> str:
    """A system prompt's or a tool result's blocks: text only."""
    texts = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("image", "document"):
            raise _refuse(f"'{param}': {kind} content is not supported; this server reads text only.", param)
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _refuse(f"Invalid value for '{param}': give a string or a list of text blocks "
                          "({'type': 'text', 'text': ...}).", param)
        texts.append(block["text"])
    return "".join(texts)


def _chat_messages(body: CountTokensBody) -> List[Dict[str, Any]]:
    """Anthropic's turns -> chat completions messages: text blocks joined into one content, tool_use blocks
    into the assistant's tool_calls, each tool_result into a role "tool" message (before the user's text,
    as Anthropic has tool results come first)."""
    out: List[Dict[str, Any]] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else _text_blocks(body.system, "system")
        out.append({"role": "system", "content": system})
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: List[str] = []
        calls: List[Dict[str, Any]] = []
        results: List[Dict[str, Any]] = []
        for block in m.content:
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("image", "document"):
                raise _refuse(f"'messages': {kind} content is not supported; this server reads text only.")
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                        or not isinstance(block.get("input"), dict):
                    raise _refuse("Invalid value for 'messages': a tool_use block needs 'id', 'name' and an "
                                  "object 'input'.")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
            elif kind == "tool_result" and m.role == "user":
                content = block.get("content", "")
                if not isinstance(block.get("tool_use_id"), str):
                    raise _refuse("Invalid value for 'messages': a tool_result block needs 'tool_use_id'.")
                if isinstance(content, list):
                    content = _text_blocks(content, "messages")
                elif not isinstance(content, str):
                    raise _refuse("Invalid value for 'messages': a tool_result's 'content' must be a string or "
                                  "a list of text blocks.")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue        # a model's earlier reasoning: not shown to this one
            else:
                raise _refuse("Invalid value for 'messages': content blocks must be text, tool_use (assistant) "
                              "or tool_result (user).")
        out.extend(results)
        if texts or calls or not results:
            message: Dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _tools(tools: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None) \
                or not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict) \
                or not isinstance(tool.get("description", ""), (str, type(None))):
            raise _refuse("Invalid value for 'tools': each tool must be {'name', 'description', 'input_schema'} "
                          "(server tools are not supported).", "tools")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Dict[str, Any], chat: Dict[str, Any]) -> None:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _refuse("Invalid value for 'tool_choice': give {'type': 'auto' | 'any' | 'none'} or "
                      "{'type': 'tool', 'name': ...}.", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def parse_messages(body: Union[bytes, str, Dict[str, Any]], count_only: bool = False) -> MessagesRequest:
    """A /v1/messages body (count_only: a /v1/messages/count_tokens body, without max_tokens) ->
    MessagesRequest; APIError (400 naming the field) when it is invalid. Needs no model."""
    model = CountTokensBody if count_only else MessagesBody
    try:
        req = model.model_validate(body) if isinstance(body, dict) else model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    chat: Dict[str, Any] = {"messages": _chat_messages(req)}
    if req.model is not None:
        chat["model"] = req.model
    if req.tools:
        chat["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        _tool_choice(req.tool_choice, chat)
        if not req.tools and chat["tool_choice"] != "none":
            raise _refuse("'tool_choice' needs 'tools'.", "tool_choice")
        if not req.tools:
            del chat["tool_choice"]
    if not count_only:
        chat.update(max_tokens=req.max_tokens, stream=req.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                chat[name] = getattr(req, name)
        if req.stop_sequences:
            chat["stop"] = req.stop_sequences
    try:
        parsed = parse_request(CHAT_URL, chat)
    except APIError as e:
        raise _renamed(e) from None
    fields = {f.name: getattr(parsed, f.name) for f in dataclasses.fields(GenerationRequest)}
    last = parsed.messages[-1]
    prefill = last["role"] == "assistant" and bool(last["content"]) and "tool_calls" not in last
    return MessagesRequest(**fields, stop_sequences=None if count_only else req.stop_sequences, prefill=prefill)


def parse_body(url: str, body: Union[bytes, str, Dict[str, Any]]) -> GenerationRequest:
    """A body for one of the generation urls: Anthropic's MESSAGES_URL here, the others by parse_request."""
    return parse_messages(body) if url == MESSAGES_URL else parse_request(url, body)


def _render(engine, req: MessagesRequest) -> List[int]:
    """The prompt's token ids: the conversation through the chat template, a prefill after its generation
    prompt (encoded with it, so the two join as the model would have written them)."""
    if not req.prefill:
        return encode_chat(engine, req.messages, req.template_kwargs)     # as encode_prompts renders it
    try:
        text = engine.tokenizer.apply_chat_template(req.messages[:-1], add_generation_prompt=True,
                                                    **(req.template_kwargs or {}))
    except ValueError:
        raise bad_request("The chat template could not be applied to these messages.", "messages") from None
    return engine.tokenizer.encode(text + req.messages[-1]["content"], add_special_tokens=False)


def encode(engine, req: GenerationRequest) -> List[List[int]]:
    """encode_prompts(engine, req), and for a MessagesRequest with a prefill, the prompt that continues it
    (checked against the context and the KV cache in turn). Slow for long inputs: run it off an event loop."""
    if not isinstance(req, MessagesRequest) or not req.prefill:
        return encode_prompts(engine, req)
    encode_prompts(engine, dataclasses.replace(req, messages=req.messages[:-1]))   # the other checks
    ids = _render(engine, req)
    check_context(ids, engine.max_seq_len, "messages", req.params.max_tokens)
    try:
        engine.check_prompt(ids)
    except ValueError:
        raise bad_request("The prompt needs more KV-cache blocks than the server has.", "messages",
                          code="context_length_exceeded") from None
    req.prompt_ids = [ids]
    return req.prompt_ids


def count_tokens(engine, body: Union[bytes, str, Dict[str, Any]], byte_limit: Optional[int]) -> Dict[str, int]:
    """/v1/messages/count_tokens: the prompt's length in tokens, as /v1/messages reports it in
    usage.input_tokens (a prompt longer than the context is counted, not refused, unless its text alone is
    over byte_limit). Slow for long inputs: run it off an event loop."""
    req = parse_messages(body, count_only=True)
    check_prompt_bytes(req, byte_limit, engine.max_seq_len)
    return {"input_tokens": len(_render(engine, req))}


# ---------------------------------------------------------------------------------------------------
# Responses

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def make_response(req: GenerationRequest, prompt_tokens: int, model: str, tokens) -> Union["MessageResponse", Response]:
    """The response object for a parsed request: Anthropic's for a MessagesRequest, else OpenAI's."""
    cls = MessageResponse if isinstance(req, MessagesRequest) else Response
    return cls(req, prompt_tokens, model, tokens)


def _tool_use(call: Dict[str, Any]) -> Dict[str, Any]:
    """An OpenAI tool call (tools.ToolConfig.parse) as a tool_use block."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].split("_", 1)[-1], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


class MessageResponse(OnChat):
    """One /v1/messages request's answer, collected by the chat completions Response it maps onto; body()
    is the whole message, MessageStream its events."""

    def __init__(self, req: MessagesRequest, prompt_tokens: int, model: str, tokens):
        self.chat = Response(req, prompt_tokens, model, tokens)
        self.chat.reasoning = None      # thinking blocks are not mapped: the text keeps its <think> tags
        for c in self.chat.choices:
            c.thought = None
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.stop_sequences = req.stop_sequences or []
        self.stop_sequence: Optional[str] = None     # the stop sequence that ended the answer

    def add(self, prompt_index: int, chunk) -> Optional[Dict[str, Any]]:
        """Files an engine chunk; returns the chat completions streaming entry (delta, finish_reason) or None."""
        if chunk.finish_reason == "stop" and isinstance(chunk.stop_reason, str) \
                and chunk.stop_reason in self.stop_sequences:
            self.stop_sequence = chunk.stop_reason
        return self.chat.add(prompt_index, chunk)

    def stop_reason(self, finish_reason: Optional[str]) -> str:
        if finish_reason == "stop" and self.stop_sequence is not None:
            return "stop_sequence"
        return _STOP_REASONS.get(finish_reason, "end_turn")

    def usage(self) -> Dict[str, int]:
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.completion_tokens}

    def message(self, content: List[Dict[str, Any]], stop_reason: Optional[str],
                usage: Dict[str, int]) -> Dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason,
                "stop_sequence": self.stop_sequence if stop_reason == "stop_sequence" else None, "usage": usage}

    def body(self) -> Dict[str, Any]:
        """The whole message: a text block (when there is text, or nothing else), then the tool_use blocks."""
        choice = self.chat.body()["choices"][0]
        text = choice["message"].get("content")
        blocks = [{"type": "text", "text": text}] if text else []
        blocks += [_tool_use(call) for call in choice["message"].get("tool_calls") or []]
        return self.message(blocks or [{"type": "text", "text": ""}], self.stop_reason(choice["finish_reason"]),
                            self.usage())


def _event(name: str, data: Dict[str, Any]) -> str:
    # ASCII-only JSON (json.dumps' default), as the OpenAI stream: no broken UTF-8 sequence on the wire
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, separators=(',', ':'))}\n\n"


class MessageStream:
    """A streamed /v1/messages answer as Anthropic's server-sent events: message_start, ping, then per content
    block content_block_start, content_block_delta (text_delta; one input_json_delta per tool_use),
    content_block_stop; message_delta (stop_reason, usage.output_tokens), message_stop. A failure mid-way is
    an `error` event, which ends the stream."""

    def __init__(self, response: MessageResponse):
        self.response = response
        self.blocks = 0            # content blocks started
        self.text_open = False     # the last block is a text block still receiving deltas
        self.finish_reason: Optional[str] = None

    def start(self) -> List[str]:
        return [_event("message_start", {"message": self.response.message([], None, {
                    "input_tokens": self.response.prompt_tokens, "output_tokens": 0})}),
                _event("ping", {})]

    def _close_text(self) -> List[str]:
        if not self.text_open:
            return []
        self.text_open = False
        return [_event("content_block_stop", {"index": self.blocks - 1})]

    def add(self, item) -> List[str]:
        """The events for one engine chunk ((prompt index, StreamChunk) from the runner)."""
        entry = self.response.add(*item)
        if entry is None:
            return []
        out: List[str] = []
        delta = entry["delta"]
        if delta.get("content"):
            if not self.text_open:
                out.append(_event("content_block_start", {"index": self.blocks,
                                                          "content_block": {"type": "text", "text": ""}}))
                self.blocks += 1
                self.text_open = True
            out.append(_event("content_block_delta", {"index": self.blocks - 1,
                                                      "delta": {"type": "text_delta", "text": delta["content"]}}))
        for call in delta.get("tool_calls") or []:
            out += self._close_text()
            block = _tool_use(call)
            arguments = json.dumps(block.pop("input"))
            index = self.blocks
            self.blocks += 1
            out += [_event("content_block_start", {"index": index, "content_block": {**block, "input": {}}}),
                    _event("content_block_delta", {"index": index,
                                                   "delta": {"type": "input_json_delta", "partial_json": arguments}}),
                    _event("content_block_stop", {"index": index})]
        if entry["finish_reason"] is not None:
            if self.blocks == 0:       # an empty answer still has its (empty) text block, as body() has
                out.append(_event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
                self.blocks, self.text_open = 1, True
            out += self._close_text()
            self.finish_reason = entry["finish_reason"]
        return out

    def end(self) -> List[str]:
        reason = self.response.stop_reason(self.finish_reason)
        return [_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": self.response.stop_sequence
                                                   if reason == "stop_sequence" else None},
                                         "usage": {"output_tokens": self.response.completion_tokens}}),
                _event("message_stop", {})]

    @staticmethod
    def error(e: APIError) -> List[str]:
        return [_event("error", {"error": error_body(e)["error"]})]
