"""The Python API: `LLM` loads a model once and generates from prompts or chats, whole or streamed.

    llm = LLM("path/to/hf-folder-or-file.gguf", threads=2, dtype="bf16")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))         # list, in input order
    for chunk in llm.stream("Hello", SamplingParams(max_tokens=32)):        # text as it is made
        print(chunk.text, end="")
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=64))

One sequence runs at a time; its KV cache is kept between calls and reused for the longest common
prefix of the next prompt (a multi-turn chat re-reads only the new turn).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from .engine import build_core_model, default_threads
from .loader import load_model
from .sampling import SamplingParams
from . import sequence
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
                 weights: Optional[str] = None):
        t0 = time.perf_counter()
        self.model_path = model if model is not None else default_model_path()
        if weights is not None:   # "f32" | "bf16" | "q8" | "q4": convert once into the cache, then load that
            from .convert import cached_conversion
            self.model_path = cached_conversion(self.model_path, weights, progress=True)
        self.loaded = load_model(self.model_path, revision=revision) if revision else load_model(self.model_path)
        if dtype == "auto" and self.loaded.source_format == "corelm":   # a converted folder: its own type
            from .convert import folder_dtype
            dtype = folder_dtype(self.loaded.source)
        self.spec = self.loaded.spec
        self.tokenizer = self.loaded.tokenizer
        self._core = build_core_model(self.loaded, dtype=dtype, threads=threads, max_seq_len=max_seq_len,
                                      progress=progress)
        self.threads = self._core.n_threads
        self.dtype = self._core.weight_type
        self.max_seq_len = self._core.max_seq_len
        self.load_time_s = time.perf_counter() - t0
        self._cached: List[int] = []      # tokens whose keys/values sit in the KV cache, in order
        self.last_metrics: Dict[str, float] = {}
        self.eos_token_ids = self._eos_ids()

    # -- model facts --------------------------------------------------------------------------------
    def _eos_ids(self) -> List[int]:
        ids = list(self.spec.eos_token_ids or [])
        gen = self.loaded.generation_config.get("eos_token_id")
        ids += gen if isinstance(gen, list) else ([gen] if isinstance(gen, int) else [])
        ids += list(getattr(self.tokenizer, "eos_token_ids", []) or [])
        return sorted({int(i) for i in ids if isinstance(i, (int, np.integer)) and 0 <= i < self.spec.vocab_size})

    def reset(self) -> None:
        """Forget the KV cache (the next prompt is read from scratch)."""
        self._cached = []

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
    def _forward(self, ids: List[int], pos: int) -> np.ndarray:
        return self._core.forward(np.asarray(ids, dtype=np.int32), pos, False)

    def _prefill(self, prompt_ids: List[int]) -> np.ndarray:
        """Logits after the prompt, reusing the cached prefix; at least one token is always run."""
        common = 0
        limit = min(len(self._cached), len(prompt_ids) - 1)
        while common < limit and self._cached[common] == prompt_ids[common]:
            common += 1
        self._cached = self._cached[:common]
        logits = self._forward(prompt_ids[common:], common)
        self._cached = list(prompt_ids)
        self.last_metrics["cached_prompt_tokens"] = common
        return logits

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

    def _stream_ids(self, prompt_ids: List[int], params: SamplingParams) -> Iterator[StreamChunk]:
        seq = sequence.Sequence(prompt_ids, params, self.tokenizer, self.spec.vocab_size, self.eos_token_ids,
                       self.max_seq_len - len(prompt_ids))
        m = self.last_metrics = {"prompt_tokens": len(prompt_ids), "generated_tokens": 0}
        t0 = time.perf_counter()
        logits = self._prefill(prompt_ids)
        m["prompt_time_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            while True:
                chunk = seq.step(logits)
                m["generated_tokens"] = len(seq.output_ids)
                yield chunk
                if seq.finished:
                    return
                logits = self._forward([chunk.token_id], len(self._cached))
                self._cached.append(chunk.token_id)
        finally:
            seq.abort()  # no-op when it finished on its own
            m["generation_time_s"] = time.perf_counter() - t1
            m["finish_reason"] = seq.finish_reason

    def chat_stream(self, messages: List[Dict[str, Any]], params: Optional[SamplingParams] = None,
                    chat_template: Optional[str] = None) -> Iterator[StreamChunk]:
        prompt = self.apply_chat_template(messages, add_generation_prompt=True, chat_template=chat_template)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)  # the template already wrote BOS
        return self.stream(ids, params)

    # -- whole completions --------------------------------------------------------------------------
    def _complete(self, prompt_ids: List[int], params: SamplingParams, index: int) -> CompletionOutput:
        text, ids, finish, reason = [], [], None, None
        logprobs, cum = ([] if params.logprobs is not None else None), 0.0
        for chunk in self._stream_ids(prompt_ids, params):
            text.append(chunk.text)
            if chunk.token_id is not None:
                ids.append(chunk.token_id)
                if logprobs is not None:
                    cum += chunk.logprob
                    logprobs.append({"token_id": chunk.token_id, "logprob": chunk.logprob, "top": chunk.top_logprobs})
            finish, reason = chunk.finish_reason, chunk.stop_reason
        return CompletionOutput(index, "".join(text), ids, finish, reason,
                                cum if logprobs is not None else None, logprobs)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]], params: Optional[SamplingParams] = None,
                 use_tqdm: bool = False) -> List[RequestOutput]:
        """Completes every prompt (a string, a list of token ids, or a list of either) and returns one
        RequestOutput per prompt, in input order."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        encoded = [self.encode_prompt(p) for p in prompts]      # validate everything before starting
        for ids in encoded:
            self._check_prompt(ids)
        params.validate_against_vocab(self.spec.vocab_size)
        iterator = enumerate(zip(prompts, encoded))
        if use_tqdm:
            from tqdm import tqdm
            iterator = tqdm(iterator, total=len(encoded), desc="generating", unit="prompt")
        results = []
        for _, (prompt, ids) in iterator:
            outs = []
            for k in range(params.n):
                p = params if params.seed is None or k == 0 else _with_seed(params, params.seed + k)
                outs.append(self._complete(ids, p, k))
            results.append(RequestOutput(prompt if isinstance(prompt, str) else None, ids, outs,
                                         dict(self.last_metrics)))
        return results

    def chat(self, messages, params: Optional[SamplingParams] = None,
             chat_template: Optional[str] = None) -> List[RequestOutput]:
        """`messages` is one conversation (a list of {"role", "content"} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.encode(self.apply_chat_template(c, True, chat_template), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, params)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace
    return replace(params, seed=seed)
