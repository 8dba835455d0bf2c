"""OpenAI's Responses API (POST /v1/responses), stateless: a body is checked in the Responses shape, then
turned into the equivalent chat completions body and parsed by protocol.parse_request, so it meets the same
chat template, sampling parameters, limits, guided decoding, tool-call and reasoning machinery as
/v1/chat/completions; the engine's output comes back as a response object (output items: reasoning,
message, function_call) or as the Responses stream of named events.

    req = parse_responses(body)                     # -> ResponsesRequest (a GenerationRequest); APIError
    response = ResponseObject(req, prompt_tokens, model, tokens)
    response.add(prompt_index, chunk) ...; response.body()
    ResponseStream(response).start() / add(item) / end() / error(e)     # SSE text, for a streamed request

Stateless: nothing is stored (`store` is accepted and answered false), so `previous_response_id` and
`conversation` are refused with a 400; a client sends the whole conversation as `input` items. Text input only
(input_image and input_file are refused); function tools only.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Dict, List, Optional, Union

from pydantic import ValidationError

from .errors import APIError, bad_request
from .protocol import CHAT_URL, GenerationRequest, Number, _Body, parse_request, unsupported, validation_error
from .responses import OnChat, Response

RESPONSES_URL = "/v1/responses"

# The chat completions names that checks below parse_request report, in the Responses API's words.
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input",
           "top_logprobs": "top_logprobs"}


def _renamed(e: APIError) -> APIError:
    param = _PARAMS.get(e.param, e.param)
    message = e.message
    if e.param in _PARAMS:
        message = message.replace(f"'{e.param}'", f"'{param}'")
    return APIError(e.status, message, e.type, param, e.code)


class ResponsesBody(_Body):
    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[Dict[str, Any]] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    stream: bool = False
    store: Optional[bool] = None            # accepted; nothing is ever stored
    previous_response_id: Optional[str] = None
    conversation: Optional[Union[str, Dict[str, Any]]] = None
    metadata: Optional[Dict[str, str]] = None
    user: Optional[str] = None
    # vLLM's extra sampling fields and corelm's, as chat completions takes them (the client's extra_body)
    top_k: Optional[int] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    max_thinking_tokens: Optional[int] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    structured_outputs: Optional[Dict[str, Any]] = None


_PASSED_ON = ("model", "parallel_tool_calls", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "presence_penalty", "frequency_penalty", "seed", "stop", "max_thinking_tokens", "chat_template_kwargs",
              "structured_outputs", "user")


@dataclasses.dataclass
class ResponsesRequest(GenerationRequest):
    """A /v1/responses body as the chat completions request it maps onto, with what the response object
    echoes back."""
    echoed: Dict[str, Any] = dataclasses.field(default_factory=dict)   # the fields the response repeats


def _refuse(message: str, param: str = "input") -> APIError:
    return bad_request(message, param)


def _content_text(content: Any, role: str) -> str:
    """A message item's content: a string or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse("Invalid value for 'input': a message's 'content' must be a string or a list of parts.")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise unsupported("input", f"'input': {kind} content is not supported; this server reads text only.")
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise _refuse("Invalid value for 'input': content parts must be input_text or output_text "
                          "({'type': 'input_text', 'text': ...}).")
        texts.append(part["text"])
    return "".join(texts)


def _chat_messages(body: ResponsesBody) -> List[Dict[str, Any]]:
    """Responses input items -> chat completions messages: message items by role, function_call items as the
    assistant's tool_calls (consecutive calls, and a call after the assistant's text, join one message),
    function_call_output items as role "tool" messages. Reasoning items are dropped (not shown to the model)."""
    out: List[Dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for item in items:
        if not isinstance(item, dict):
            raise _refuse("Invalid value for 'input': give a string or a list of items.")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _refuse("Invalid value for 'input': a message's 'role' must be user, assistant, system or "
                              "developer.")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(item.get("content"), role)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _refuse("Invalid value for 'input': a function_call item needs 'call_id', 'name' and "
                              "'arguments' (a JSON string).")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise _refuse("Invalid value for 'input': a function_call_output item needs 'call_id' and "
                              "'output' (a string or text parts).")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _content_text(output, "tool")})
        elif kind == "reasoning":
            continue
        else:
            raise _refuse("Invalid value for 'input': items must be message, function_call, "
                          "function_call_output or reasoning.")
    if not out:
        raise _refuse("The 'input' is empty.")
    return out


def _tools(tools: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Responses function tools (flat: {type, name, description, parameters, strict}) -> chat completions'."""
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str) \
                or not isinstance(tool.get("parameters") or {}, dict) \
                or not isinstance(tool.get("description") or "", str):
            raise _refuse("Invalid value for 'tools': each tool must be {'type': 'function', 'name', 'description', "
                          "'parameters'} (built-in tools are not supported).", "tools")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object",
                                                                                   "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Union[str, Dict[str, Any]]) -> Union[str, Dict[str, Any]]:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _refuse("Invalid value for 'tool_choice': give 'auto', 'none', 'required' or "
                  "{'type': 'function', 'name': ...}.", "tool_choice")


def _response_format(text: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """text.format -> chat completions' response_format (None for plain text)."""
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"]}}
    raise _refuse("Invalid value for 'text': 'format' must be {'type': 'text'}, {'type': 'json_object'} or "
                  "{'type': 'json_schema', 'name', 'schema'}.", "text")


def parse_responses(body: Union[bytes, str, Dict[str, Any]]) -> ResponsesRequest:
    """A /v1/responses body -> ResponsesRequest; APIError (400 naming the field, OpenAI's shape) when it is
    invalid or asks for state this server does not keep. Needs no model."""
    try:
        req = ResponsesBody.model_validate(body) if isinstance(body, dict) else \
            ResponsesBody.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    for field in ("previous_response_id", "conversation"):
        if getattr(req, field) is not None:
            raise unsupported(field, f"'{field}' is not supported: this server is stateless and stores no "
                                     "responses; send the whole conversation as 'input' items.")
    chat: Dict[str, Any] = {"messages": _chat_messages(req), "stream": req.stream}
    for name in _PASSED_ON:
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    if req.tools:
        chat["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    if req.text is not None:
        rf = _response_format(req.text)
        if rf is not None:
            chat["response_format"] = rf
    try:
        parsed = parse_request(CHAT_URL, chat)
    except APIError as e:
        raise _renamed(e) from None
    fields = {f.name: getattr(parsed, f.name) for f in dataclasses.fields(GenerationRequest)}
    fields["max_tokens_param"] = "max_output_tokens"
    echoed = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [{**t, "strict": t.get("strict")} for t in req.tools or []], "user": req.user}
    return ResponsesRequest(**fields, echoed=echoed)


# ---------------------------------------------------------------------------------------------------
# Responses

def _hex() -> str:
    return uuid.uuid4().hex


class ResponseObject(OnChat):
    """One /v1/responses request's answer, collected by the chat completions Response it maps onto (which
    splits the thought off and parses tool calls); body() is the whole response, ResponseStream its events."""

    def __init__(self, req: ResponsesRequest, prompt_tokens: int, model: str, tokens):
        self.chat = Response(req, prompt_tokens, model, tokens)
        self.tokenizer = getattr(tokens, "tokenizer", None)
        self.echoed = req.echoed
        self.id = "resp_" + _hex()
        self.created_at = int(time.time())
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.reasoning_id, self.message_id = "rs_" + _hex(), "msg_" + _hex()

    def add(self, prompt_index: int, chunk) -> Optional[Dict[str, Any]]:
        """Files an engine chunk; returns the chat completions streaming entry (delta, finish_reason) or None."""
        return self.chat.add(prompt_index, chunk)

    def usage(self, thought: str = "") -> Dict[str, Any]:
        done = self.completion_tokens
        # the thought's tokens, counted again from its text (the engine counts the output as a whole)
        reasoning = len(self.tokenizer.encode(thought, add_special_tokens=False)) if thought and self.tokenizer else 0
        return {"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.num_cached_tokens},
                "output_tokens": done, "output_tokens_details": {"reasoning_tokens": min(reasoning, done)},
                "total_tokens": self.prompt_tokens + done}

    # -- output items -------------------------------------------------------------------------------
    def reasoning_item(self, text: Optional[str], status: str = "completed") -> Dict[str, Any]:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "content": content, "status": status}

    def message_item(self, text: Optional[str], status: str = "completed") -> Dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def call_item(call: Dict[str, Any], arguments: Optional[str] = None, status: str = "completed") -> Dict[str, Any]:
        f = call["function"]
        return {"id": "fc_" + call["id"].split("_", 1)[-1], "type": "function_call", "call_id": call["id"],
                "name": f["name"], "arguments": f["arguments"] if arguments is None else arguments, "status": status}

    def output(self, thought: str, text: Optional[str], calls: List[Dict[str, Any]],
               finish_reason: Optional[str]) -> List[Dict[str, Any]]:
        """The output items: the reasoning (when the model thought), the message (when it wrote text, or
        nothing at all), then one function_call per call."""
        status = "incomplete" if finish_reason == "length" else "completed"
        items = [self.reasoning_item(thought)] if thought else []
        if text or not calls:
            items.append(self.message_item(text or "", status))
        return items + [self.call_item(c) for c in calls]

    def response(self, status: str, output: List[Dict[str, Any]], usage: Optional[Dict[str, Any]],
                 finish_reason: Optional[str] = None) -> Dict[str, Any]:
        incomplete = finish_reason == "length"
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": "incomplete" if incomplete and status == "completed" else status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "model": self.model, "output": output, "previous_response_id": None, "store": False,
                "usage": usage, **self.echoed}

    def body(self) -> Dict[str, Any]:
        choice = self.chat.body()["choices"][0]
        message = choice["message"]
        thought = message.get("reasoning_content") or ""
        output = self.output(thought, message.get("content"), message.get("tool_calls") or [],
                             choice["finish_reason"])
        return self.response("completed", output, self.usage(thought), choice["finish_reason"])


def _event(kind: str, data: Dict[str, Any], number: int) -> str:
    # ASCII-only JSON (json.dumps' default), as the other streams: no broken UTF-8 sequence on the wire
    payload = {"type": kind, "sequence_number": number, **data}
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ResponseStream:
    """A streamed /v1/responses answer as OpenAI's server-sent events: response.created, response.in_progress;
    per output item response.output_item.added, then for the reasoning response.content_part.added,
    response.reasoning_text.delta..., response.reasoning_text.done, response.content_part.done; for the
    message response.content_part.added, response.output_text.delta..., response.output_text.done,
    response.content_part.done; for a function call response.function_call_arguments.delta and .done;
    response.output_item.done; last response.completed (response.incomplete when max_output_tokens ended it).
    A failure mid-way is an `error` event, which ends the stream."""

    def __init__(self, response: ResponseObject):
        self.response = response
        self.number = 0
        self.open: Optional[str] = None     # "reasoning" | "message": the item receiving deltas
        self.thought: List[str] = []
        self.text: List[str] = []
        self.calls: List[Dict[str, Any]] = []
        self.items = 0                      # output items started
        self.finish_reason: Optional[str] = None

    def _ev(self, kind: str, **data) -> str:
        text = _event(kind, data, self.number)
        self.number += 1
        return text

    def start(self) -> List[str]:
        r = self.response.response("in_progress", [], None)
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def _open(self, kind: str) -> List[str]:
        out = self._close()
        r = self.response
        item = r.reasoning_item(None, "in_progress") if kind == "reasoning" else r.message_item(None, "in_progress")
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
            {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open = kind
        self.items += 1
        return out + [self._ev("response.output_item.added", output_index=self.items - 1, item=item),
                      self._ev("response.content_part.added", item_id=item["id"], output_index=self.items - 1,
                               content_index=0, part=part)]

    def _close(self) -> List[str]:
        if self.open is None:
            return []
        r, index = self.response, self.items - 1
        if self.open == "reasoning":
            text = "".join(self.thought)
            item, part = r.reasoning_item(text), {"type": "reasoning_text", "text": text}
            done = self._ev("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text)
        else:
            text = "".join(self.text)
            status = "incomplete" if self.finish_reason == "length" else "completed"
            item = r.message_item(text, status)
            part = item["content"][0]
            done = self._ev("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=[])
        self.open = None
        return [done, self._ev("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part),
                self._ev("response.output_item.done", output_index=index, item=item)]

    def add(self, item) -> List[str]:
        """The events for one engine chunk ((prompt index, StreamChunk) from the runner)."""
        entry = self.response.add(*item)
        if entry is None:
            return []
        out: List[str] = []
        delta, r = entry["delta"], self.response
        if entry["finish_reason"] is not None:
            self.finish_reason = entry["finish_reason"]
        if delta.get("reasoning_content"):
            if self.open != "reasoning":
                out += self._open("reasoning")
            self.thought.append(delta["reasoning_content"])
            out.append(self._ev("response.reasoning_text.delta", item_id=r.reasoning_id, output_index=self.items - 1,
                                content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self.open != "message":
                out += self._open("message")
            self.text.append(delta["content"])
            out.append(self._ev("response.output_text.delta", item_id=r.message_id, output_index=self.items - 1,
                                content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or []:
            out += self._close()
            call = {k: v for k, v in call.items() if k != "index"}
            self.calls.append(call)
            index, self.items = self.items, self.items + 1
            added = r.call_item(call, arguments="", status="in_progress")
            arguments = call["function"]["arguments"]
            out += [self._ev("response.output_item.added", output_index=index, item=added),
                    self._ev("response.function_call_arguments.delta", item_id=added["id"], output_index=index,
                             delta=arguments),
                    self._ev("response.function_call_arguments.done", item_id=added["id"], output_index=index,
                             arguments=arguments),
                    self._ev("response.output_item.done", output_index=index, item=r.call_item(call))]
        if entry["finish_reason"] is not None:
            if not self.text and not self.calls:     # no text and no call: an (empty) message, as body() has
                out += self._open("message")
            out += self._close()
        return out

    def end(self) -> List[str]:
        r = self.response
        thought, text = "".join(self.thought), "".join(self.text)
        output = r.output(thought, text, self.calls, self.finish_reason)
        body = r.response("completed", output, r.usage(thought), self.finish_reason)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [self._ev(kind, response=body)]

    def error(self, e: APIError) -> List[str]:
        return [self._ev("error", code=e.code if isinstance(e.code, str) else None, message=e.message,
                         param=e.param)]
