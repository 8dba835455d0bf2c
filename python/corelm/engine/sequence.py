"""One request's generation state, shared by every engine: sampling, stop conditions and UTF-8-safe
text. An engine runs the model and hands each step's logits to `Sequence.step`, which picks the next
token and returns the text it completes, with `finish_reason` set on the last step. Logits that are not
all finite (NaN or infinity: weights that overflow float32) pick no token: the sequence ends with
finish_reason "error" and the chunk's `error` says why (LLM raises GenerationError, the server answers 500)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence as Seq, Union

import numpy as np

from .guided import GuidedMatcher
from .sampling import Sampler, SamplingParams
from .thinking import ThinkingBudget

log = logging.getLogger("corelm")


class GenerationError(ValueError):
    """The model could not produce a token for a request (its logits were NaN or infinite)."""


@dataclass
class StreamChunk:
    text: str                             # new text; "" while a multi-byte character or a possible stop string is pending
    token_id: Optional[int]               # the token behind this chunk
    finish_reason: Optional[str] = None   # "stop" | "length" | "error" on the last chunk ("abort" is set by engines)
    stop_reason: Union[int, str, None] = None  # the stop string or token id that ended it
    logprob: Optional[float] = None
    top_logprobs: Optional[List[Any]] = None  # [(token id, logprob)], best first
    index: int = 0                        # which of the request's n choices
    logprob_rank: Optional[int] = None    # the token's rank among the whole vocabulary (1 = most likely)
    error: Optional[str] = None           # with finish_reason "error": what went wrong
    cached_tokens: Optional[int] = None   # on a choice's last chunk: its prompt tokens found in the prefix cache


class StopStringFilter:
    """Holds back just enough text to recognise a stop string that spans several tokens."""

    def __init__(self, stops: List[str], include_stop: bool):
        self.stops = stops
        self.include = include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str):
        """Returns (text safe to emit, matched stop string or None)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, None
        best = None
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            out = self.pending[: i + len(s)] if self.include else self.pending[:i]
            self.pending = ""
            return out, s
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Sequence:
    def __init__(self, prompt_ids: Seq[int], params: SamplingParams, tokenizer, vocab_size: int,
                 eos_token_ids: Seq[int], max_new_tokens: int, seq_index: int = 0):
        self.prompt_ids = list(prompt_ids)
        self.index = seq_index
        self.params = params
        self.tokenizer = tokenizer
        self.eos = [] if params.ignore_eos else list(eos_token_ids)
        self.stop_ids = set(params.stop_token_ids or []) | set(self.eos)
        self.sampler = Sampler(params, vocab_size, eos_token_ids=self.eos, seq_index=seq_index)
        self.sampler.start(self.prompt_ids)
        self.detok = tokenizer.detokenizer(skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStringFilter(list(params.stop or []), params.include_stop_str_in_output)
        self.max_new = max_new_tokens if params.max_tokens is None else min(params.max_tokens, max_new_tokens)
        self.output_ids: List[int] = []
        self.finish_reason: Optional[str] = None
        # structured output: the grammar's mask restricts every step; ValueError if it does not compile
        self.guide = None
        if params.structured_outputs is not None:
            self.guide = GuidedMatcher(params.structured_outputs, tokenizer, vocab_size, eos_token_ids)
        # a thinking budget: a thought that runs past it is ended by forced tokens
        self.thinking = None
        if params.max_thinking_tokens is not None and params.max_thinking_tokens >= 0:
            self.thinking = ThinkingBudget.for_prompt(params.max_thinking_tokens, tokenizer, self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def step(self, logits: np.ndarray) -> StreamChunk:
        """Samples the next token from `logits` and returns what it adds."""
        params = self.params
        guide = self.guide
        # max and min propagate NaN: two passes over the row, a few microseconds next to the forward pass
        row = np.asarray(logits)
        if not (np.isfinite(row.max()) and np.isfinite(row.min())):
            return self._fail(row)
        token = self.sampler.sample(logits, grammar=guide)
        forced = self.thinking.forced() if self.thinking is not None else None
        if forced is not None and forced != token:
            self.sampler.accept(forced)         # replaces the sampled token (Sampler's docstring)
            token = forced
        self.output_ids.append(token)
        n = len(self.output_ids)
        lp = self.sampler.logprobs(logits, token) if params.logprobs is not None else None
        logprob, rank, top = lp or (None, None, None)
        extra = dict(logprob=logprob, top_logprobs=top, index=self.index, logprob_rank=rank)
        if guide is not None and token in guide.eos and token not in self.stop_ids:
            self.stop_ids = self.stop_ids | {token}    # the grammar ended: EOS stops even with ignore_eos
        if token in self.stop_ids and not (token in self.eos and n <= params.min_tokens and guide is None):
            self.finish_reason = "stop"
            special = self.tokenizer.is_special(token) and params.skip_special_tokens
            text = "" if special else self.detok.add(token)
            tail = self.stops.feed(text + self.detok.flush())[0] + self.stops.flush()
            # vLLM's stop_reason: the stop token's id, None for the end of sequence
            reason = None if token in self.eos and token not in (params.stop_token_ids or ()) else token
            return StreamChunk(tail, token, "stop", reason, **extra)
        grammar_done = False
        if guide is not None:
            if not guide.consume(token):
                log.warning("structured output: the grammar refused a token (%s); the sequence ends", guide.error)
            grammar_done = guide.stopped       # nothing but EOS may follow: end now, without another step
        piece = self.detok.add(token)
        if self.thinking is not None:
            self.thinking.advance(token, piece)
        text, matched = self.stops.feed(piece)
        if grammar_done and matched is None:
            self.finish_reason = "stop"
            text += self.stops.feed(self.detok.flush())[0] + self.stops.flush()
            return StreamChunk(text, token, "stop", None, **extra)
        if matched is not None:
            self.finish_reason = "stop"
            return StreamChunk(text, token, "stop", matched, **extra)
        if n >= self.max_new:
            self.finish_reason = "length"
            text += self.stops.feed(self.detok.flush())[0] + self.stops.flush()
            return StreamChunk(text, token, "length", None, **extra)
        return StreamChunk(text, token, None, None, **extra)

    def _fail(self, logits: np.ndarray) -> StreamChunk:
        n_nan = int(np.isnan(logits).sum())
        what = f"{n_nan} NaN" if n_nan else "infinite"
        msg = (f"the model produced non-finite logits ({what} of {logits.size}) at generated token "
               f"{len(self.output_ids) + 1}: its weights or activations overflow float32, so it has no answer "
               f"(the model file is likely corrupt)")
        self.finish_reason = "error"
        return StreamChunk("", None, "error", None, index=self.index, error=msg)

    def abort(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "abort"
