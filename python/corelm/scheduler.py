"""Request-level engines: many requests in, one model step at a time, text chunks out.

    engine = SerialEngine(llm)
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for request_id, chunk in engine.step():
            ...   # chunk.text, chunk.token_id, chunk.finish_reason ("stop" | "length" | "abort")

An engine is driven by one thread (the server's loop, LLM.generate); add_request and abort_request may
be called between steps. Every request ends with exactly one chunk whose finish_reason is set.
SerialEngine runs one request at a time (first come, first served) on an LLM; a batching engine with
the same interface runs many per step.
"""
from __future__ import annotations

import collections
import threading
from typing import Dict, Iterator, List, Optional, Tuple

from .sampling import SamplingParams
from .sequence import StreamChunk


class SerialEngine:
    def __init__(self, llm):
        self.llm = llm
        self._lock = threading.Lock()          # guards the queue against add/abort from other threads
        self._waiting: "collections.OrderedDict[str, Tuple[List[int], SamplingParams]]" = collections.OrderedDict()
        self._aborted: List[str] = []
        self._active: Optional[Tuple[str, Iterator[StreamChunk]]] = None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return 1 if self._active else 0

    def add_request(self, request_id: str, prompt_ids: List[int], params: SamplingParams) -> None:
        """Validates now (raises ValueError on a bad prompt or parameters), runs later."""
        ids = self.llm.encode_prompt(prompt_ids)
        self.llm._check_prompt(ids)
        params.validate_against_vocab(self.llm.spec.vocab_size)
        with self._lock:
            if request_id in self._waiting or (self._active and self._active[0] == request_id):
                raise ValueError(f"request id {request_id!r} is already in use")
            self._waiting[request_id] = (ids, params)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._active or self._aborted)

    def step(self) -> List[Tuple[str, StreamChunk]]:
        out: List[Tuple[str, StreamChunk]] = []
        with self._lock:
            aborted, self._aborted = self._aborted, []
            for rid in aborted:
                if self._waiting.pop(rid, None) is not None:
                    out.append((rid, StreamChunk("", None, "abort")))
                elif self._active and self._active[0] == rid:
                    self._active[1].close()  # frees nothing in C++: the KV cache is reused by the next prompt
                    self._active = None
                    out.append((rid, StreamChunk("", None, "abort")))
            if self._active is None and self._waiting:
                rid, (ids, params) = self._waiting.popitem(last=False)
                self._active = (rid, self.llm._stream_ids(ids, params))
        if self._active is not None:
            rid, gen = self._active
            try:
                chunk = next(gen)
            except StopIteration:  # pragma: no cover  (a stream always ends with a finishing chunk)
                chunk = StreamChunk("", None, "abort")
            except Exception:
                self._active = None
                raise
            out.append((rid, chunk))
            if chunk.finish_reason is not None:
                self._active = None
        return out

    def run_to_completion(self) -> Dict[str, List[StreamChunk]]:
        """Steps until every request has finished; returns each request's chunks."""
        chunks: Dict[str, List[StreamChunk]] = collections.defaultdict(list)
        while self.has_unfinished_requests():
            for rid, chunk in self.step():
                chunks[rid].append(chunk)
        return dict(chunks)
