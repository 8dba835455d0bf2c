"""The Python API: `LLM` loads a model once and generates from prompts or chats, whole or streamed.

    llm = LLM("path/to/hf-folder-or-file.gguf", threads=2, dtype="bf16")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))         # list, in input order
    for chunk in llm.stream("Hello", SamplingParams(max_tokens=32)):        # text as it is made
        print(chunk.text, end="")
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=64))

Every request goes through one continuous-batching engine (corelm.scheduler.BatchEngine) over a
paged KV cache; full KV blocks stay in a prefix cache, so a multi-turn chat re-reads only the new turn
and prompts that share a prefix share its blocks.
"""
from __future__ import annotations

import collections
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from .engine import build_core_model, default_threads
from .loader import load_model
from .sampling import SamplingParams
from .scheduler import BatchEngine
from .sequence import StreamChunk  # noqa: F401  (part of the API)

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

PromptType = Union[str, Sequence[int]]


def default_model_path() -> str:
    """The embedded default model: installed inside the package, or models/ of a source checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "models", DEFAULT_MODEL_FILE),
                      os.path.join(here, "..", "..", "models", DEFAULT_MODEL_FILE)):
        if os.path.isfile(candidate):
            return os.path.normpath(candidate)
    raise FileNotFoundError(f"the embedded default model {DEFAULT_MODEL_FILE} is missing from this installation")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]          # "stop" | "length" | "abort"
    stop_reason: Union[int, str, None] = None  # the stop string or token id that ended it
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[List[Dict[str, Any]]] = None


@dataclass
class RequestOutput:
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    metrics: Dict[str, float] = field(default_factory=dict)
    finished: bool = True


class LLM:
    def __init__(self, model: Optional[str] = None, threads: Optional[int] = None, dtype: str = "auto",
                 max_seq_len: Optional[int] = None, revision: Optional[str] = None, progress: bool = False,
                 kv_cache_dtype: str = "fp32", kv_cache_gb: Optional[float] = None, max_num_seqs: int = 64,
                 max_batch_tokens: int = 256, weights: Optional[str] = None, pin_threads: Optional[bool] = None,
                 numa: Optional[str] = None, schedule: Optional[str] = None, activations: str = "auto"):
        t0 = time.perf_counter()
        self.model_path = model if model is not None else default_model_path()
        if weights is not None:   # "f32" | "bf16" | "q8" | "q4": convert once into the cache, then load that
            if dtype not in ("auto", weights):   # the converted folder would be repacked into dtype: say so
                raise ValueError(f"weights={weights!r} and dtype={dtype!r} disagree; give one of them "
                                 f"(weights= converts and keeps that format, dtype= repacks at load).")
            from .convert import cached_conversion
            self.model_path = cached_conversion(self.model_path, weights, progress=True)
        self.loaded = load_model(self.model_path, revision=revision) if revision else load_model(self.model_path)
        if dtype == "auto" and self.loaded.source_format == "corelm":   # a converted folder: its own type
            from .convert import folder_dtype
            dtype = folder_dtype(self.loaded.source)
        self.spec = self.loaded.spec
        self.tokenizer = self.loaded.tokenizer
        self._core = build_core_model(self.loaded, dtype=dtype, threads=threads, max_seq_len=max_seq_len,
                                      progress=progress, kv_cache_dtype=kv_cache_dtype, kv_cache_gb=kv_cache_gb,
                                      pin_threads=pin_threads, numa=numa, schedule=schedule,
                                      activations=activations)
        self.threads = self._core.n_threads
        self.schedule = self._core.schedule
        self.activations = self._core.activations
        self.numa = numa
        self.dtype = getattr(self.loaded, "stored_types", None) or self._core.weight_type  # e.g. "q4m+q8"
        self.max_seq_len = self._core.max_seq_len
        self.load_time_s = time.perf_counter() - t0
        self._request_ids = itertools.count()
        self._inbox: Dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.last_metrics: Dict[str, float] = {}
        self.eos_token_ids = self._eos_ids()
        self.engine = BatchEngine(self, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens)

    # -- model facts --------------------------------------------------------------------------------
    def _eos_ids(self) -> List[int]:
        ids = list(self.spec.eos_token_ids or [])
        gen = self.loaded.generation_config.get("eos_token_id")
        ids += gen if isinstance(gen, list) else ([gen] if isinstance(gen, int) else [])
        ids += list(getattr(self.tokenizer, "eos_token_ids", []) or [])
        return sorted({int(i) for i in ids if isinstance(i, (int, np.integer)) and 0 <= i < self.spec.vocab_size})

    def reset(self) -> None:
        """Forget the prefix cache (the next prompt is read from scratch)."""
        self.engine.clear_prefix_cache()

    def apply_chat_template(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  chat_template=chat_template)

    def encode_prompt(self, prompt: PromptType) -> List[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.spec.vocab_size - 1}).")
        return ids

    # -- the generation loop ------------------------------------------------------------------------
    def _check_prompt(self, prompt_ids: List[int]) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens to start from).")
        if len(prompt_ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, but the context holds {self.max_seq_len} "
                             f"(including at least one generated token); shorten the prompt or raise max_seq_len.")

    def stream(self, prompt: PromptType, params: Optional[SamplingParams] = None) -> Iterator[StreamChunk]:
        """Generates one completion, yielding text as soon as it is complete UTF-8 and cannot be the
        start of a stop string. Closing the iterator early stops generation (finish_reason "abort")."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a corelm.SamplingParams")
        prompt_ids = self.encode_prompt(prompt)
        self._check_prompt(prompt_ids)
        params.validate_against_vocab(self.spec.vocab_size)
        return self._stream_ids(prompt_ids, params)

    def _pump(self) -> None:
        """Runs one engine step and files each chunk under its request (several callers may be
        waiting on the same engine: streams consumed in turn, generate)."""
        for rid, chunk in self.engine.step():
            self._inbox[rid].append(chunk)

    def _next_chunk(self, rid: str) -> StreamChunk:
        box = self._inbox[rid]
        while not box:
            self._pump()
        return box.popleft()

    def _stream_ids(self, prompt_ids: List[int], params: SamplingParams) -> Iterator[StreamChunk]:
        """Runs one request through the engine until it finishes. Closing the generator aborts the
        request, which releases its KV blocks at the next step."""
        rid = f"stream-{next(self._request_ids)}"
        self.engine.add_request(rid, prompt_ids, params)
        m = self.last_metrics = {"prompt_tokens": len(prompt_ids), "generated_tokens": 0}
        t0 = time.perf_counter()
        t1, finish = None, None
        try:
            while finish is None:
                chunk = self._next_chunk(rid)
                if t1 is None:
                    t1 = time.perf_counter()
                    m["prompt_time_s"] = t1 - t0
                    m["cached_prompt_tokens"] = self.engine.cached_prompt_tokens(rid)
                if chunk.token_id is not None:
                    m["generated_tokens"] += 1
                finish = chunk.finish_reason
                yield chunk
        finally:
            if finish is None:
                self.engine.abort_request(rid)
                while self._next_chunk(rid).finish_reason is None:
                    pass
                finish = "abort"
            self._inbox.pop(rid, None)
            m.setdefault("prompt_time_s", time.perf_counter() - t0)
            m["generation_time_s"] = time.perf_counter() - (t1 or t0)
            m["finish_reason"] = finish

    def chat_stream(self, messages: List[Dict[str, Any]], params: Optional[SamplingParams] = None,
                    chat_template: Optional[str] = None) -> Iterator[StreamChunk]:
        prompt = self.apply_chat_template(messages, add_generation_prompt=True, chat_template=chat_template)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)  # the template already wrote BOS
        return self.stream(ids, params)

    # -- whole completions --------------------------------------------------------------------------
    def generate(self, prompts: Union[PromptType, Sequence[PromptType]], params: Optional[SamplingParams] = None,
                 use_tqdm: bool = False) -> List[RequestOutput]:
        """Completes every prompt (a string, a list of token ids, or a list of either) and returns one
        RequestOutput per prompt, in input order. All prompts go to the continuous batcher at once."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        encoded = [self.encode_prompt(p) for p in prompts]      # validate everything before starting
        for ids in encoded:
            self._check_prompt(ids)
        params.validate_against_vocab(self.spec.vocab_size)
        base = next(self._request_ids)
        rids = []
        for i, ids in enumerate(encoded):
            for k in range(params.n):
                p = params if params.seed is None or k == 0 else _with_seed(params, params.seed + k)
                rid = f"gen-{base}-{i}-{k}"
                self.engine.add_request(rid, ids, p, seq_index=k)
                rids.append(rid)
        progress = None
        if use_tqdm:
            from tqdm import tqdm
            progress = tqdm(total=len(rids), desc="generating", unit="req")
        chunks: Dict[str, List[StreamChunk]] = {rid: [] for rid in rids}
        t0 = time.perf_counter()
        try:
            pending = set(rids)
            while pending:
                self._pump()
                for rid in list(pending):
                    box = self._inbox[rid]
                    while box:
                        chunk = box.popleft()
                        chunks[rid].append(chunk)
                        if chunk.finish_reason is not None:
                            pending.discard(rid)
                            if progress is not None:
                                progress.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            for rid in rids:
                self._inbox.pop(rid, None)
            if progress is not None:
                progress.close()
        elapsed = time.perf_counter() - t0
        results = []
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            outs = [_completion(k, chunks[f"gen-{base}-{i}-{k}"], params) for k in range(params.n)]
            cached = max(self.engine.cached_prompt_tokens(f"gen-{base}-{i}-{k}") for k in range(params.n))
            metrics = {"prompt_tokens": len(ids), "cached_prompt_tokens": cached,
                       "generated_tokens": sum(len(o.token_ids) for o in outs), "batch_time_s": elapsed}
            results.append(RequestOutput(prompt if isinstance(prompt, str) else None, ids, outs, metrics))
        self.last_metrics = {"prompt_tokens": sum(len(e) for e in encoded),
                             "cached_prompt_tokens": sum(r.metrics["cached_prompt_tokens"] for r in results),
                             "generated_tokens": sum(r.metrics["generated_tokens"] for r in results),
                             "generation_time_s": elapsed}
        return results

    def chat(self, messages, params: Optional[SamplingParams] = None,
             chat_template: Optional[str] = None) -> List[RequestOutput]:
        """`messages` is one conversation (a list of {"role", "content"} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.encode(self.apply_chat_template(c, True, chat_template), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, params)


def _completion(index: int, chunks: List[StreamChunk], params: SamplingParams) -> CompletionOutput:
    text, ids, finish, reason = [], [], None, None
    logprobs, cum = ([] if params.logprobs is not None else None), 0.0
    for chunk in chunks:
        text.append(chunk.text)
        if chunk.token_id is not None:
            ids.append(chunk.token_id)
            if logprobs is not None and chunk.logprob is not None:
                cum += chunk.logprob
                logprobs.append({"token_id": chunk.token_id, "logprob": chunk.logprob, "top": chunk.top_logprobs})
        finish, reason = chunk.finish_reason, chunk.stop_reason
    return CompletionOutput(index, "".join(text), ids, finish, reason, cum if logprobs is not None else None, logprobs)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace
    return replace(params, seed=seed)
