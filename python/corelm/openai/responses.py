"""OpenAI response bodies: whole completions, streaming chunks, usage and logprobs, built from the
engine's StreamChunks as they arrive (Response), for the server and for batch files alike."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from .protocol import GenerationRequest
from .reasoning import ReasoningParser, split_reasoning

# ---------------------------------------------------------------------------------------------------
# Token text for logprobs

_GPT2_BYTES: Optional[Dict[str, int]] = None


def _gpt2_byte_decoder() -> Dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode (byte-level BPE vocabularies spell bytes this way)."""
    global _GPT2_BYTES
    if _GPT2_BYTES is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _GPT2_BYTES = {chr(c): b for b, c in zip(bs, cs)}
    return _GPT2_BYTES


class TokenText:
    """A token id -> (text, UTF-8 bytes) for logprobs. Text of a partial UTF-8 sequence uses U+FFFD;
    `bytes` carries the exact bytes, as OpenAI's API does."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = tokenizer.is_byte_level()
        self._cache: Dict[int, Tuple[str, List[int]]] = {}

    def get(self, token_id: int) -> Tuple[str, List[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit

    def _bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer
        piece = tok.id_to_token(token_id) or ""
        if tok.is_special(token_id):
            return piece.encode("utf-8")
        if tok.is_byte_fallback(token_id) and len(piece) == 6 and piece.startswith("<0x"):
            return bytes([int(piece[3:5], 16)])
        if self.byte_level:
            table = _gpt2_byte_decoder()
            if piece and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if "▁" in piece:
            return piece.replace("▁", " ").encode("utf-8")
        return tok.decode([token_id], skip_special_tokens=False).encode("utf-8")


def chat_logprobs(tokens: TokenText, entries) -> Dict[str, Any]:
    content = []
    for tid, lp, top, _ in entries:
        text, raw = tokens.get(tid)
        tops = []
        for t, l in top:
            tt, tb = tokens.get(t)
            tops.append({"token": tt, "logprob": l, "bytes": tb})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": tops})
    return {"content": content}


def completion_logprobs(tokens: TokenText, entries) -> Dict[str, Any]:
    out: Dict[str, List[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, top, offset in entries:
        out["tokens"].append(tokens.get(tid)[0])
        out["token_logprobs"].append(lp)
        tops: Dict[str, float] = {}
        for t, l in top:
            tops.setdefault(tokens.get(t)[0], l)
        out["top_logprobs"].append(tops)
        out["text_offset"].append(offset)
    return out


# ---------------------------------------------------------------------------------------------------
# One request's choices

@dataclass
class Choice:
    index: int
    text: List[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None   # vLLM's: the stop string or token id that ended the choice
    logprobs: List[Tuple[int, float, list, int]] = field(default_factory=list)  # (id, lp, top, text offset)
    offset: int = 0
    sent: int = 0       # with tools: characters already streamed as content
    thought: Optional[ReasoningParser] = None   # a reasoning model's: splits the streamed text
    content: List[str] = field(default_factory=list)    # with thought: the text that is not reasoning

    def content_text(self) -> str:
        return "".join(self.content if self.thought is not None else self.text)

    def add(self, chunk) -> None:
        if chunk.token_id is not None:
            self.tokens += 1
            if chunk.logprob is not None:
                self.logprobs.append((chunk.token_id, chunk.logprob, chunk.top_logprobs or [], self.offset))
        self.text.append(chunk.text)
        self.offset += len(chunk.text)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_reason


class Response:
    """Collects one request's chunks (choice index = prompt index * n + the chunk's index) and builds
    its bodies: `body()` once every choice has finished, or `stream_*` as the chunks come."""

    def __init__(self, req: GenerationRequest, prompt_tokens: int, model: str, tokens: TokenText):
        self.chat = req.chat
        self.n = req.params.n
        self.prompt_tokens = prompt_tokens
        self.cached_tokens: Dict[int, int] = {}   # prompt index -> its tokens found in the prefix cache
        self.tokens = tokens
        self.want_logprobs = req.params.logprobs is not None
        self.include_usage = req.include_usage
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.choices = [Choice(i) for i in range(req.num_choices)]
        # a reasoning model's chat: <think>...</think> goes to reasoning_content (see reasoning.py)
        self.reasoning = req.reasoning if req.chat else None
        if self.reasoning is not None:
            for c in self.choices:
                c.thought = ReasoningParser(self.reasoning)
        # chat with tools: the output is parsed for tool calls (tool_choice "none" leaves it text)
        self.tools = req.tools if req.chat and req.tools is not None and req.tools.choice != "none" else None
        # echo: each completion choice starts with its prompt's text; the prompt tokens' logprobs are
        # not computed, so with logprobs they are listed with null logprobs.
        self.echo: List[Tuple[str, Optional[Dict[str, Any]]]] = []
        if req.echo and not req.chat:
            for p, prompt in enumerate(req.prompts):
                ids = req.prompt_ids[p] if req.prompt_ids else []
                text = prompt if isinstance(prompt, str) else \
                    tokens.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
                self.echo.append((text, self._echo_logprobs(ids, len(text)) if self.want_logprobs else None))
            for c in self.choices:
                text = self.echo[c.index // self.n][0]
                c.text.append(text)
                c.offset = len(text)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def add(self, prompt_index: int, chunk) -> Optional[Dict[str, Any]]:
        """Files a chunk under its choice; returns the choice's streaming entry for what it added
        (None when it added nothing a client sees)."""
        c = self.choices[prompt_index * self.n + chunk.index]
        cached = getattr(chunk, "cached_tokens", None)   # on a choice's last chunk
        if cached:
            self.cached_tokens[prompt_index] = max(self.cached_tokens.get(prompt_index, 0), cached)
        start = len(c.logprobs)
        c.add(chunk)
        new_lp = c.logprobs[start:]
        if not (chunk.text or chunk.finish_reason or (self.want_logprobs and new_lp)):
            return None
        entry: Dict[str, Any] = {"index": c.index}
        finish_reason = chunk.finish_reason
        thought = ""
        if c.thought is not None:
            thought, content = c.thought.feed(chunk.text, final=chunk.finish_reason is not None)
            c.content.append(content)
        if self.tools is not None:
            entry["delta"], finish_reason = self._tool_delta(c)
        elif c.thought is not None:
            entry["delta"] = {"content": content} if content else {}
        if thought:     # before the content the same chunk may hold
            entry["delta"] = {"reasoning_content": thought, **entry["delta"]}
        if "delta" in entry:
            if not (entry["delta"] or finish_reason or (self.want_logprobs and new_lp)):
                return None         # all of it held back
        elif self.chat:
            entry["delta"] = {"content": chunk.text} if chunk.text else {}
        else:
            entry["text"] = chunk.text
        entry["logprobs"] = self._logprobs(new_lp)
        entry["finish_reason"] = finish_reason
        entry["stop_reason"] = c.stop_reason
        return entry

    def _tool_delta(self, c: Choice) -> Tuple[Dict[str, Any], Optional[str]]:
        """A streamed choice with tools: text that may be a tool call is held back until the choice
        finishes, then its calls are sent whole (delta.tool_calls) with finish_reason "tool_calls"."""
        text = c.content_text()
        if c.finish_reason is None:
            start = self.tools.parser.START
            bare = self.tools.parser.may_be_bare_call(text)  # the whole answer may be one call object
            safe = 0 if self.tools.forced or bare else text.find(start)
            if safe < 0:        # hold a tail that may be the beginning of a call, and the space before it
                safe = len(text) - next((k for k in range(min(len(start), len(text)), 0, -1)
                                         if start.startswith(text[-k:])), 0)
            safe = len(text[:safe].rstrip())
            delta = {"content": text[c.sent:safe]} if safe > c.sent else {}
            c.sent = max(c.sent, safe)
            return delta, None
        content, calls = self.tools.parse(text)
        rest = (content or "")[c.sent:] if calls else text[c.sent:]
        delta: Dict[str, Any] = {"content": rest} if rest else {}
        if not calls:
            return delta, c.finish_reason
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return delta, "tool_calls"

    def _echo_logprobs(self, ids: List[int], text_len: int) -> Dict[str, Any]:
        out: Dict[str, List[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for tid in ids:
            token = self.tokens.get(tid)[0]
            out["tokens"].append(token)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(min(offset, text_len))
            offset += len(token)
        return out

    def _logprobs(self, entries) -> Optional[Dict[str, Any]]:
        if not self.want_logprobs:
            return None
        return chat_logprobs(self.tokens, entries) if self.chat else completion_logprobs(self.tokens, entries)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        """The prompt tokens the prefix cache supplied (vLLM's RequestOutput.num_cached_tokens)."""
        return sum(self.cached_tokens.values())

    def usage(self) -> Dict[str, Any]:
        done = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    def body(self) -> Dict[str, Any]:
        """The whole (non-streaming) response."""
        out = []
        for c in self.choices:
            text = "".join(c.text)
            item: Dict[str, Any] = {"index": c.index}
            finish_reason = c.finish_reason
            thought = None
            if self.reasoning is not None:
                thought, text = split_reasoning(text, self.reasoning)
            if self.tools is not None:
                content, calls = self.tools.parse(text)
                item["message"] = {"role": "assistant", "content": content if calls else text}
                if calls:
                    item["message"]["tool_calls"] = calls
                    finish_reason = "tool_calls"
            elif self.chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            if self.reasoning is not None:
                if thought and not item["message"]["content"]:
                    item["message"]["content"] = None      # all thought (max_tokens reached inside it)
                item["message"]["reasoning_content"] = thought or None
            item["logprobs"] = self._logprobs(c.logprobs)
            if self.echo and item["logprobs"] is not None:
                prompt_part = self.echo[c.index // self.n][1]
                item["logprobs"] = {k: prompt_part[k] + v for k, v in item["logprobs"].items()}
            item["finish_reason"] = finish_reason
            item["stop_reason"] = c.stop_reason
            out.append(item)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": self.usage()}

    # -- streaming ----------------------------------------------------------------------------------
    def stream_chunk(self, choices: List[Dict[str, Any]], usage: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        """A streamed event; with include_usage every event has "usage" (null until the last)."""
        event = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            event["usage"] = usage
        return event

    def stream_start(self) -> List[Dict[str, Any]]:
        """The events before any text: chat announces the assistant role of each choice; echo sends
        each completion choice's prompt text."""
        if self.echo:
            return [self.stream_chunk([{"index": c.index, "text": self.echo[c.index // self.n][0],
                                        "logprobs": self.echo[c.index // self.n][1], "finish_reason": None}])
                    for c in self.choices]
        if not self.chat:
            return []
        return [self.stream_chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]) for c in self.choices]

    def stream_end(self) -> List[Dict[str, Any]]:
        """The events after the last choice finished: the usage, when asked for."""
        return [self.stream_chunk([], self.usage())] if self.include_usage else []


class OnChat:
    """A response in another API's shape (Anthropic's message, OpenAI's Responses object) collected by the
    chat completions Response it maps onto (`self.chat`): its state is the chat response's."""
    chat: Response

    @property
    def finished(self) -> bool:
        return self.chat.finished

    @property
    def completion_tokens(self) -> int:
        return self.chat.completion_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.chat.num_cached_tokens
