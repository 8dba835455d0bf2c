"""The Python API: `LLM` loads a model once and generates from prompts or chats, whole or streamed.
Its `generate` and `chat` take vLLM's arguments and return vLLM's output types, so code written for
vLLM's offline API runs unchanged.

    llm = LLM("path/to/hf-folder-or-file.gguf", threads=2, dtype="bf16")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))         # list, in input order
    outs = llm.generate({"prompt_token_ids": [1, 2, 3]}, sampling_params=SamplingParams(max_tokens=8))
    for chunk in llm.stream("Hello", SamplingParams(max_tokens=32)):        # text as it is made
        print(chunk.text, end="")
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=64))

A model that produces no valid logits for a request (NaN or infinity) raises GenerationError (a
ValueError) from generate, chat and stream, naming the cause, rather than answer with a made-up token.

A thin facade over one LLMEngine (`llm.engine`, corelm.engine): every request goes through its
continuous batcher over a paged KV cache, whose full blocks stay in a prefix cache, so a multi-turn
chat re-reads only the new turn and prompts that share a prefix share its blocks.
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from .engine.llm_engine import DEFAULT_MODEL_FILE, LLMEngine, PromptType, default_model_path, is_single_prompt  # noqa: F401
from .engine.lora import LoRARequest  # noqa: F401
from .engine.pooling import PoolingParams, cosine
from .engine.sampling import SamplingParams
from .engine.sequence import GenerationError, StreamChunk

# vLLM's LLM(...) keywords, all in one place. Renamed to corelm's option of the same meaning:
VLLM_RENAMES = {"max_model_len": "max_seq_len", "max_num_batched_tokens": "max_batch_tokens"}
# vLLM's dtype names; float16 has no CPU kernels here and becomes bfloat16, as on vLLM's CPU backend.
VLLM_DTYPES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "bf16", "half": "bf16"}
# Accepted with a warning that they change nothing on a CPU (or in corelm).
VLLM_NO_OPS = {
    "gpu_memory_utilization": "GPU memory is not used (size the KV cache with kv_cache_gb)",
    "enforce_eager": "there are no CUDA graphs on a CPU",
    "swap_space": "the KV cache lives in main memory already",
    "cpu_offload_gb": "the weights live in main memory already",
    "trust_remote_code": "corelm runs no model code from the hub, only its own",
    "disable_custom_all_reduce": "there is no GPU all-reduce",
    "max_seq_len_to_capture": "there are no CUDA graphs on a CPU",
    "disable_log_stats": "corelm logs no periodic statistics",
    "block_size": "the KV block size is the C++ core's",
}


def _vllm_options(model: Optional[str], options: Dict[str, Any]) -> Dict[str, Any]:
    """vLLM's constructor keywords -> LLMEngine's: renamed, dropped with a warning, or refused (ValueError
    for a value corelm cannot honour, TypeError naming LLM for a keyword it does not know)."""
    out: Dict[str, Any] = {}
    for key, value in options.items():
        if key in VLLM_RENAMES:
            name = VLLM_RENAMES[key]
            if name in options and options[name] != value:
                raise ValueError(f"{key}={value!r} and {name}={options[name]!r} disagree; give one of them.")
            out[name] = value
        elif key in VLLM_NO_OPS:
            warnings.warn(f"LLM({key}=...) does nothing in corelm: {VLLM_NO_OPS[key]}.", stacklevel=3)
        elif key == "device":
            if value not in ("cpu", "auto", None):
                raise ValueError(f"device={value!r}: corelm runs on the CPU only (device='cpu').")
        elif key == "tokenizer":
            if value is not None and (model is None or os.path.normpath(str(value)) != os.path.normpath(model)):
                raise ValueError(f"tokenizer={value!r}: corelm reads the tokenizer from the model's own files; "
                                 "a separate tokenizer is not supported.")
        elif key == "tokenizer_mode":
            if value not in ("auto", "hf", "slow"):
                raise ValueError(f"tokenizer_mode={value!r}: corelm has one tokenizer (give 'auto').")
        elif key in ("task", "runner", "convert"):   # vLLM's model-runner choice: every model here embeds too
            allowed = {"task": ("auto", "generate", "embed", "score"), "runner": ("auto", "generate", "pooling"),
                       "convert": ("auto", "none", "embed")}[key]
            if value not in allowed:
                raise ValueError(f"{key}={value!r}: corelm runs {', '.join(repr(a) for a in allowed)} (every model "
                                 f"generates and embeds; an encoder only embeds).")
        elif key == "seed":
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"seed must be an integer, got {value!r}.")
        else:
            out.setdefault(key, value)
    dtype = out.get("dtype")
    if isinstance(dtype, str) and dtype.strip().lower() in VLLM_DTYPES:
        if dtype.strip().lower() in ("float16", "half"):
            warnings.warn(f"LLM(dtype={dtype!r}): float16 runs as bfloat16 on a CPU.", stacklevel=3)
        out["dtype"] = VLLM_DTYPES[dtype.strip().lower()]
    known = inspect.signature(LLMEngine.__init__).parameters
    for key in out:
        if key not in known or key in ("self", "model"):
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
    return out


@dataclass
class Logprob:
    """vLLM's Logprob: one token's log-probability, its rank in the vocabulary (1 = most likely) and
    its text."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """One choice of a request, as vLLM's CompletionOutput. `logprobs` (when asked for) has one dict
    per generated token: token id -> Logprob, holding the sampled token and the top `logprobs` ones."""
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[List[Dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None          # "stop" | "length" | "abort"
    stop_reason: Union[int, str, None] = None    # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's result, as vLLM's RequestOutput. `metrics` (corelm's): prompt_tokens,
    cached_prompt_tokens, generated_tokens, batch_time_s."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    prompt_logprobs: Optional[List[Any]]
    outputs: List[CompletionOutput]
    finished: bool = True
    metrics: Dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: List[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, as vLLM's pooling API returns it (`outputs.embedding`)."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: List[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's similarity score (`outputs.score`), as vLLM's LLM.score returns it."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: List[int]
    finished: bool = True


class LLM:
    """Loads a model (an HF folder, a .gguf file, a corelm folder or a hub id; None = the embedded
    SmolLM2-135M-Instruct) into one LLMEngine. Options are LLMEngine's (threads, dtype, max_seq_len,
    kv_cache_dtype, kv_cache_gb, kv_sparsity, max_num_seqs, max_batch_tokens, weights, pin_threads, numa,
    schedule, activations, revision, progress, enable_prefix_caching, ...) and vLLM's names for them
    (max_model_len, max_num_batched_tokens, dtype="float32"/"bfloat16"/"float16"); `seed` seeds every
    request that has none (a run is reproducible); GPU-only options (gpu_memory_utilization,
    enforce_eager, swap_space, ...) are accepted with a warning (VLLM_NO_OPS)."""

    def __init__(self, model: Optional[str] = None, **options: Any):
        engine_options = _vllm_options(model, options)
        self._seeds = random.Random(options["seed"]) if options.get("seed") is not None else None
        self.engine = LLMEngine(model, **engine_options)
        e = self.engine
        self.model_path, self.loaded, self.spec, self.tokenizer = e.model_path, e.loaded, e.spec, e.tokenizer
        self.threads, self.schedule, self.activations, self.numa = e.threads, e.schedule, e.activations, e.numa
        self.dtype, self.max_seq_len, self.eos_token_ids = e.dtype, e.max_seq_len, e.eos_token_ids
        self.load_time_s = e.load_time_s
        self._request_ids = itertools.count()
        self._inbox: Dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.last_metrics: Dict[str, Any] = {}

    def get_tokenizer(self):
        return self.tokenizer

    # -- pooling: embeddings and scores (vLLM's embed() and score()) -----------------------------------
    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: Optional[PoolingParams] = None,
              *, truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = False) -> List[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), pooled as the model was trained (an encoder's
        sentence-transformers config, mean by default; a decoder's last token) and normalized unless
        pooling_params.normalize is False; pooling_params.dimensions keeps the first d components."""
        single = is_single_prompt(prompts)
        batch = [prompts] if single else list(prompts)
        ids = [self.engine.encode_embedding_input(p, truncate_prompt_tokens) for p in batch]
        vectors = self.engine.embed(ids, pooling_params)
        return [EmbeddingRequestOutput(str(next(self._request_ids)), EmbeddingOutput(v.tolist()), i)
                for i, v in zip(ids, vectors)]

    def score(self, data_1: Union[PromptType, Sequence[PromptType]], data_2: Union[PromptType, Sequence[PromptType]],
              *, truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = False) -> List[ScoringRequestOutput]:
        """The cosine similarity of each pair's embeddings: one data_1 against every data_2 (1 -> N), or
        data_1[i] against data_2[i] (N -> N), as vLLM scores with an embedding model."""
        left = [data_1] if is_single_prompt(data_1) else list(data_1)
        right = [data_2] if is_single_prompt(data_2) else list(data_2)
        if not left or not right:
            raise ValueError("score needs at least one text on each side.")
        if len(left) != 1 and len(left) != len(right):
            raise ValueError(f"score pairs one text with many, or as many with as many; got {len(left)} and "
                             f"{len(right)}.")
        ids = [self.engine.encode_embedding_input(p, truncate_prompt_tokens) for p in left + right]
        vectors = self.engine.embed(ids)
        queries, docs = vectors[:len(left)], vectors[len(left):]
        pairs = [(queries[0 if len(left) == 1 else j], docs[j], ids[len(left) + j]) for j in range(len(right))]
        return [ScoringRequestOutput(str(next(self._request_ids)), ScoringOutput(cosine(q, d)), i)
                for q, d, i in pairs]

    def reset(self) -> None:
        """Forget the prefix cache (the next prompt is read from scratch)."""
        self.engine.clear_prefix_cache()

    def wait_for_huge_pages(self, timeout: Optional[float] = None) -> bool:
        """See LLMEngine.wait_for_huge_pages: decode's full speed on a VM whose 2 MiB pages come slowly."""
        return self.engine.wait_for_huge_pages(timeout)

    def apply_chat_template(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None) -> str:
        return self.engine.apply_chat_template(messages, add_generation_prompt, chat_template)

    def encode_prompt(self, prompt: PromptType) -> List[int]:
        return self.engine.encode_prompt(prompt)

    def _seeded(self, params: SamplingParams) -> SamplingParams:
        """With LLM(seed=...), a request without a seed gets the next one of the LLM's sequence."""
        if self._seeds is None or params.seed is not None:
            return params
        return dataclasses.replace(params, seed=self._seeds.getrandbits(31))

    # -- streaming ----------------------------------------------------------------------------------
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

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None,
               lora_request: Optional[LoRARequest] = None) -> Iterator[StreamChunk]:
        """Generates one completion, yielding text as soon as it is complete UTF-8 and cannot be the
        start of a stop string. Closing the iterator early stops generation (finish_reason "abort").
        GenerationError when the model's logits are not finite."""
        params = self._seeded(sampling_params or SamplingParams())
        self.engine.check_params(params)
        if params.n != 1:
            raise ValueError("stream() makes one completion: use n=1 (or generate() for several).")
        rid = f"stream-{next(self._request_ids)}"
        prompt_ids = self.engine.add_request(rid, prompt, params, lora_request)   # validates before the generator starts
        return self._stream_request(rid, len(prompt_ids))

    def _spec_since(self, before: Optional[Dict[str, int]], m: Dict[str, Any]) -> None:
        """Adds the draft tokens proposed and accepted since `before` (engine.spec_counts()) to m."""
        now = self.engine.spec_counts()
        if before is not None and now is not None:
            for k in now:
                m[k] = now[k] - before[k]

    def _stream_request(self, rid: str, n_prompt: int) -> Iterator[StreamChunk]:
        m = self.last_metrics = {"prompt_tokens": n_prompt, "generated_tokens": 0}
        spec0 = self.engine.spec_counts()
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
                if finish == "error":
                    raise GenerationError(chunk.error)
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
            self._spec_since(spec0, m)

    def chat_stream(self, messages: List[Dict[str, Any]], sampling_params: Optional[SamplingParams] = None,
                    chat_template: Optional[str] = None, lora_request: Optional[LoRARequest] = None
                    ) -> Iterator[StreamChunk]:
        return self.stream(self.engine.encode_chat(messages, chat_template), sampling_params, lora_request)

    # -- whole completions --------------------------------------------------------------------------
    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> List[RequestOutput]:
        """Completes every prompt (text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...};
        one or a list) and returns one RequestOutput per prompt, in input order. `sampling_params` is
        one SamplingParams for all prompts or a list, one per prompt; `lora_request` (LLM(enable_lora=True))
        likewise one LoRARequest or a list (None: the base model). All prompts go to the continuous
        batcher at once."""
        prompts = [prompts] if is_single_prompt(prompts) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_request for {len(prompts)} prompts.")
        encoded = [self.engine.encode_prompt(p) for p in prompts]     # validate everything before starting
        for ids, params in zip(encoded, params_list):
            self.engine.check_prompt(ids)
            self.engine.check_params(params)
        params_list = [self._seeded(p) for p in params_list]
        base = next(self._request_ids)
        rids = [f"gen-{base}-{i}" for i in range(len(prompts))]
        added: List[str] = []
        chunks: Dict[str, List[StreamChunk]] = {rid: [] for rid in rids}
        left = {rid: p.n for rid, p in zip(rids, params_list)}   # choices not yet finished
        progress = None
        if use_tqdm:
            from tqdm import tqdm
            progress = tqdm(total=len(rids), desc="generating", unit="req")
        spec0 = self.engine.spec_counts()
        t0 = time.perf_counter()
        try:
            for rid, ids, params, lora in zip(rids, encoded, params_list, loras):
                self.engine.add_request(rid, ids, params, lora)
                added.append(rid)
            pending = set(rids)
            while pending:
                self._pump()
                for rid in list(pending):
                    box = self._inbox[rid]
                    while box:
                        chunk = box.popleft()
                        chunks[rid].append(chunk)
                        if chunk.finish_reason is not None:
                            left[rid] -= 1
                    if left[rid] == 0:
                        pending.discard(rid)
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        finally:
            for rid in rids:
                self._inbox.pop(rid, None)
            if progress is not None:
                progress.close()
        elapsed = time.perf_counter() - t0
        for i, rid in enumerate(rids):
            failed = next((c for c in chunks[rid] if c.finish_reason == "error"), None)
            if failed is not None:
                raise GenerationError(failed.error if len(rids) == 1 else f"prompt {i}: {failed.error}")
        results = []
        for rid, prompt, ids, params in zip(rids, prompts, encoded, params_list):
            outs = [self._completion(k, [c for c in chunks[rid] if c.index == k], params) for k in range(params.n)]
            cached = max((c.cached_tokens or 0 for c in chunks[rid] if c.finish_reason is not None), default=0)
            metrics = {"prompt_tokens": len(ids), "cached_prompt_tokens": cached,
                       "generated_tokens": sum(len(o.token_ids) for o in outs), "batch_time_s": elapsed}
            text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
            results.append(RequestOutput(rid, text, ids, None, outs, True, metrics, cached))
        self.last_metrics = {"prompt_tokens": sum(len(e) for e in encoded),
                             "cached_prompt_tokens": sum(r.metrics["cached_prompt_tokens"] for r in results),
                             "generated_tokens": sum(r.metrics["generated_tokens"] for r in results),
                             "generation_time_s": elapsed}
        self._spec_since(spec0, self.last_metrics)
        return results

    def chat(self, messages, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = False, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, tools: Optional[List[Dict[str, Any]]] = None,
             chat_template_kwargs: Optional[Dict[str, Any]] = None,
             lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> List[RequestOutput]:
        """`messages` is one conversation (a list of {"role", "content"} dicts) or a list of them; each
        is rendered with the model's chat template (or `chat_template`) and generated as in generate().
        `tools` (OpenAI's function tools) and `chat_template_kwargs` reach the template as the server's
        do (checked the same way; ValueError when invalid)."""
        from .openai.errors import APIError     # the server's checks; loaded when a chat first needs them
        from .openai.protocol import check_template_kwargs
        from .openai.tools import check_tools
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        try:
            kwargs = check_template_kwargs(chat_template_kwargs) or {}
            config = check_tools(tools, None, None)
        except APIError as e:
            raise ValueError(e.message) from None
        if config is not None:
            kwargs["tools"] = config.tools
        prompts = [{"prompt_token_ids": self._encode_chat(c, chat_template, add_generation_prompt, kwargs)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _encode_chat(self, messages: List[Dict[str, Any]], chat_template: Optional[str],
                     add_generation_prompt: bool, kwargs: Dict[str, Any]) -> List[int]:
        if not kwargs:
            return self.engine.encode_chat(messages, chat_template, add_generation_prompt)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  chat_template=chat_template, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _completion(self, index: int, chunks: List[StreamChunk], params: SamplingParams) -> CompletionOutput:
        text, ids, finish, reason = [], [], None, None
        logprobs: Optional[List[Dict[int, Logprob]]] = [] if params.logprobs is not None else None
        cumulative = 0.0
        for chunk in chunks:
            text.append(chunk.text)
            if chunk.token_id is not None:
                ids.append(chunk.token_id)
                if logprobs is not None and chunk.logprob is not None:
                    cumulative += chunk.logprob
                    logprobs.append(self._logprob_entry(chunk))
            finish, reason = chunk.finish_reason, chunk.stop_reason
        return CompletionOutput(index, "".join(text), ids, cumulative if logprobs is not None else None,
                                logprobs, finish, reason)

    def _logprob_entry(self, chunk: StreamChunk) -> Dict[int, Logprob]:
        """vLLM's per-token dict: the top tokens (ranks 1..k), then the sampled one if it is not among them."""
        decode = lambda t: self.tokenizer.decode([t], skip_special_tokens=False)   # noqa: E731
        entry = {t: Logprob(lp, r, decode(t)) for r, (t, lp) in enumerate(chunk.top_logprobs or [], 1)}
        if chunk.token_id not in entry:
            entry[chunk.token_id] = Logprob(chunk.logprob, chunk.logprob_rank, decode(chunk.token_id))
        return entry
