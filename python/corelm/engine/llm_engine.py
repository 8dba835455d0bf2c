"""LLMEngine: the one engine every entry point drives (LLM, chat, generate, serve, batch).

    engine = LLMEngine("model.gguf", threads=2)
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=32, n=2))
    while engine.has_unfinished_requests():
        for request_id, chunk in engine.step():
            ...   # chunk.index (which of the n choices), chunk.text, chunk.token_id, chunk.finish_reason

It owns the loaded model, the tokenizer, the C++ model and the scheduler. It checks every request
before queueing it (prompt within the vocabulary and the context, sampling parameters against the
vocabulary) and fans a request out into its n choices. One thread steps it; add_request and
abort_request may be called from other threads between steps. Every choice ends with exactly one
chunk whose finish_reason is set ("stop" | "length" | "abort", or "error" with the chunk's `error`
saying why: the model's logits were not finite).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence as Seq, Tuple, TypedDict, Union

import numpy as np

from ..loader import load_model
from ..options import choose
from . import speculative
from .kv_blocks import check_prompt_fits
from .lora import LoRARequest, LoraRegistry
from .model_builder import build_core_model, wait_for_huge_pages
from .pooling import Embedder, PoolingParams
from .prefix_store import PrefixStore
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, StreamChunk

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"



class TextPrompt(TypedDict):
    """vLLM's TextPrompt: {"prompt": text}."""
    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's TokensPrompt: {"prompt_token_ids": [ids]}."""
    prompt_token_ids: List[int]


# A prompt: text, token ids, or a TextPrompt / TokensPrompt dict.
PromptType = Union[str, Seq[int], TextPrompt, TokensPrompt]


def default_model_path() -> str:
    """The embedded default model: installed inside the package, or models/ of a source checkout."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for candidate in (os.path.join(here, "models", DEFAULT_MODEL_FILE),
                      os.path.join(here, "..", "..", "models", DEFAULT_MODEL_FILE)):
        if os.path.isfile(candidate):
            return os.path.normpath(candidate)
    raise FileNotFoundError(f"the embedded default model {DEFAULT_MODEL_FILE} is missing from this installation")


# The embedded model's file sets no sampling defaults; SmolLM2-Instruct's model card samples at these (at
# llama-cli's temperature 0.8 it rambles).
EMBEDDED_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def is_embedded_model(path: str) -> bool:
    try:
        return os.path.realpath(path) == os.path.realpath(default_model_path())
    except FileNotFoundError:
        return False


def served_model_name(model: Optional[str]) -> str:
    """The name a model is served and reported under: its file or folder name without .gguf
    (the embedded default model when None)."""
    name = os.path.basename(os.path.normpath(model if model is not None else DEFAULT_MODEL_FILE))
    return name[:-5] if name.lower().endswith(".gguf") else name


def check_parallel_size(name: str, size) -> int:
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{name} must be a positive integer, got {size!r}.")
    return int(size)


def is_single_prompt(prompts) -> bool:
    """True for one prompt (text, a TextPrompt/TokensPrompt dict, or a flat list of token ids), False
    for a list of prompts."""
    if isinstance(prompts, (str, Mapping)):
        return True
    return len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))


class LLMEngine:
    """See the module docstring. Options (all keyword): threads, dtype, max_seq_len, revision, progress,
    kv_cache_dtype, kv_cache_gb, kv_sparsity, max_num_seqs, max_batch_tokens, weights, pin_threads, numa,
    schedule, activations; README.md and corelm.options describe each. Speculative decoding (engine/speculative.py):
    speculative_model (a draft model's path, "[self]" for this model in speculative_weights' format,
    "[ngram]" for prompt lookup, the default, "[lookahead]" for prompt lookup plus the model's own Jacobi
    guesses, or None for none), num_speculative_tokens (the most proposed per step), speculative_weights
    (the draft converted to this format first, e.g. "q4"), prompt_lookup_max / prompt_lookup_min (the n-gram
    sizes matched; for "[lookahead]", shorter matches come after the Jacobi guess; with a draft model, a
    match's copy is proposed instead of drafting where it gives more tokens per second), and
    speculative_adaptive (True: each step proposes what the measured acceptance and costs say pays off;
    False: num_speculative_tokens every step, as vLLM and llama.cpp do). tensor_parallel_size: ranks the model is
    cut across, a slice of every layer each; pipeline_parallel_size: ranks holding consecutive layers each
    (engine/distributed/; MPI, started here unless an MPI launcher started this process); mpi_hosts: an MPI
    hostfile for ranks 1..N-1 on other machines; mpi_iface: the network interface MPI's traffic keeps to.
    enable_prefix_caching=False reads every prompt whole (no KV block is shared between requests).
    prefix_cache_dir: a directory where full KV blocks of cached prefixes are also kept on disk, within
    prefix_cache_gb GiB (default 8), and read back after a restart or an eviction from memory
    (engine/prefix_store.py). enable_lora: requests may name LoRA adapters (add_request's lora_request, vLLM's
    LoRARequest), at most max_loras registered at once (engine/lora.py); lora_modules: adapters loaded now (the
    server's --lora, selected by a request's model name)."""

    def __init__(self, model: Optional[str] = None, *, threads: Optional[int] = None, dtype: str = "auto",
                 max_seq_len: Optional[int] = None, revision: Optional[str] = None, progress: bool = False,
                 kv_cache_dtype: str = "auto", kv_cache_gb: Optional[float] = None, kv_sparsity: float = 0.0,
                 max_num_seqs: int = 64, max_batch_tokens: int = 256, weights: Optional[str] = None,
                 pin_threads: Optional[bool] = None, numa: Optional[str] = None, schedule: Optional[str] = None,
                 activations: str = "auto",
                 speculative_model: Optional[str] = "[ngram]", num_speculative_tokens: Optional[int] = None,
                 speculative_weights: Optional[str] = None, prompt_lookup_max: int = 4, prompt_lookup_min: int = 2,
                 speculative_adaptive: bool = True, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 mpi_hosts: Optional[str] = None, mpi_iface: Optional[str] = None,
                 enable_prefix_caching: bool = True, reasoning_budget: int = -1, generation_config: str = "auto",
                 prefix_cache_dir: Optional[str] = None, prefix_cache_gb: Optional[float] = None,
                 enable_lora: bool = False, max_loras: int = 4, lora_modules: Seq[LoRARequest] = ()):
        t0 = time.perf_counter()
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' (the model's sampling defaults) or 'vllm' (vLLM's "
                             f"own), got {generation_config!r}.")
        if not isinstance(reasoning_budget, int) or isinstance(reasoning_budget, bool) or reasoning_budget < -1:
            raise ValueError(f"reasoning_budget must be -1 (no limit), 0 (no thinking) or a number of tokens, "
                             f"got {reasoning_budget!r}.")
        # the thinking budget of requests that set no max_thinking_tokens (llama.cpp's --reasoning-budget)
        self.reasoning_budget = reasoning_budget
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}.")
        self.model_path = model if model is not None else default_model_path()
        self.model_name = served_model_name(model)
        dtype = choose("dtype", dtype)
        if weights is not None:   # convert once into the cache, then load that
            weights = choose("weights", weights)
            if dtype not in ("auto", weights):   # the converted folder would be repacked into dtype: say so
                raise ValueError(f"weights={weights!r} and dtype={dtype!r} disagree; give one of them "
                                 f"(weights= converts and keeps that format, dtype= repacks at load).")
            from ..convert import cached_conversion   # conversion loads when asked for: the CLI starts light
            self.model_path = cached_conversion(self.model_path, weights, progress=True)
        tp = check_parallel_size("tensor_parallel_size", tensor_parallel_size)
        pp = check_parallel_size("pipeline_parallel_size", pipeline_parallel_size)
        if tp > 1 and pp > 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size cannot both be above 1 yet; pick one.")
        if tp > 1 or pp > 1:
            from .distributed.parallel import start
            from ..loader.hub import download_from_hub, looks_like_repo_id
            path = os.path.expanduser(self.model_path)
            if not os.path.exists(path) and looks_like_repo_id(self.model_path):   # every rank loads one local copy
                self.model_path = download_from_hub(self.model_path, revision)
            options = dict(model=self.model_path, dtype=dtype, threads=threads, max_seq_len=max_seq_len,
                           kv_cache_dtype=kv_cache_dtype, kv_cache_gb=kv_cache_gb, kv_sparsity=kv_sparsity,
                           pin_threads=pin_threads, numa=numa, schedule=schedule, activations=activations)
            self.core, self.loaded = start(options, max(tp, pp), "tensor" if tp > 1 else "pipeline",
                                           hosts=mpi_hosts, iface=mpi_iface)
            self.spec = self.loaded.spec
        else:
            # a GGUF's tokenizer is built on a thread while the weights load (their C++ releases the GIL)
            self.loaded = load_model(self.model_path, revision=revision, tokenizer_in_background=True)
            if dtype == "auto" and self.loaded.source_format == "corelm":   # a converted folder: its own type
                from ..convert import folder_dtype
                dtype = folder_dtype(self.loaded.source)
            self.spec = self.loaded.spec
            self.core = build_core_model(self.loaded, dtype=dtype, threads=threads, max_seq_len=max_seq_len,
                                         progress=progress, kv_cache_dtype=kv_cache_dtype, kv_cache_gb=kv_cache_gb,
                                         kv_sparsity=kv_sparsity, pin_threads=pin_threads, numa=numa,
                                         schedule=schedule, activations=activations)
        self.tensor_parallel_size, self.pipeline_parallel_size = tp, pp
        self.tokenizer = self.loaded.tokenizer
        self.loaded.release_all()
        self.threads = self.core.n_threads
        self.schedule = self.core.schedule
        self.activations = self.core.activations
        self.numa = numa
        self.dtype = getattr(self.loaded, "stored_types", None) or self.core.weight_type  # e.g. "q4_1+q8_0"
        self.max_seq_len = self.core.max_seq_len
        self.kv_cache_dtype = self.core.kv_type
        self.kv_sparsity = float(kv_sparsity)
        self.vocab_size = self.spec.vocab_size
        self.eos_token_ids = self._eos_ids()
        # vLLM's --generation-config auto: the model's sampling defaults for requests that leave them unset
        self.sampling_defaults = model_sampling_defaults(self.loaded.generation_config) \
            if generation_config == "auto" else {}
        if generation_config == "auto" and not self.sampling_defaults and is_embedded_model(self.model_path):
            self.sampling_defaults = dict(EMBEDDED_MODEL_SAMPLING)
        self.speculator = self._speculator(speculative_model, num_speculative_tokens, speculative_weights,
                                           prompt_lookup_max, prompt_lookup_min, threads=threads, progress=progress,
                                           pin_threads=pin_threads, numa=numa, schedule=schedule, activations=activations,
                                           kv_cache_gb=kv_cache_gb)
        if self.speculator is not None:
            if not isinstance(speculative_adaptive, bool):
                raise ValueError(f"speculative_adaptive must be True or False, got {speculative_adaptive!r}.")
            self.speculator.adaptive = speculative_adaptive
        self.prefix_store = self._prefix_store(prefix_cache_dir, prefix_cache_gb, enable_prefix_caching)
        self.scheduler = Scheduler(self.core, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,
                                   speculator=self.speculator, enable_prefix_caching=enable_prefix_caching,
                                   prefix_store=self.prefix_store)
        # embeddings: the model's declared pooling, else an encoder's mean and a decoder's last token
        self.is_encoder = bool(self.spec.encoder)
        self.pooling = self.spec.pooling or ("mean" if self.is_encoder else "last")
        self.loras = self._lora_registry(enable_lora or bool(lora_modules), max_loras)
        for lora in lora_modules:
            self.add_lora(lora)
        self.embedder = Embedder(self.core, self.scheduler.blocks, self.spec.hidden_size, self.pooling,
                                 bool(self.spec.normalize))
        self.load_time_s = time.perf_counter() - t0

    def _speculator(self, model: Optional[str], k: Optional[int], weights: Optional[str], n_max: int, n_min: int,
                    **build):
        """The proposer the options ask for (None: plain decoding)."""
        if model is None or model == "[none]":
            if k is not None or weights is not None:
                raise ValueError("num_speculative_tokens and speculative_weights need speculative_model "
                                 "(a draft model, \"[self]\", \"[ngram]\" or \"[lookahead]\").")
            return None
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_model must be a path, \"[self]\", \"[ngram]\" or \"[lookahead]\", "
                             f"got {model!r}.")
        if model.startswith("[") and model not in ("[self]", "[ngram]", "[lookahead]"):
            raise ValueError(f"speculative_model {model!r} is none of \"[self]\", \"[ngram]\", \"[lookahead]\" "
                             f"and \"[none]\" (a draft model is a path or hub id).")
        if model in ("[ngram]", "[lookahead]"):
            if weights is not None:
                raise ValueError(f"speculative_weights is for a draft model; prompt lookup ({model}) has none.")
            cls = speculative.PromptLookup if model == "[ngram]" else speculative.Lookahead
            return cls(8 if k is None else k, n_max, n_min)
        if model == "[self]":
            model, weights = self.model_path, weights or "q4"
        if weights is not None:
            from ..convert import cached_conversion
            model = cached_conversion(model, choose("weights", weights), progress=True, draft=True)
        draft = load_model(model)
        speculative.check_same_vocabulary(self.tokenizer, draft.tokenizer, self.vocab_size, draft.spec.vocab_size)
        dtype = "auto"
        if draft.source_format == "corelm":
            from ..convert import folder_dtype
            dtype = folder_dtype(draft.source)
        core = build_core_model(draft, dtype=dtype, max_seq_len=self.max_seq_len, **build)
        draft.release_all()
        lookup = speculative.PromptLookup(8 if k is None else k, n_max, n_min)   # copies go first
        return speculative.DraftModel(core, self.core, 4 if k is None else k, vocab_limit=self.vocab_size,
                                      lookup=lookup)

    def _prefix_store(self, directory: Optional[str], budget_gb: Optional[float],
                      enable_prefix_caching: bool) -> Optional[PrefixStore]:
        """The disk prefix cache the options ask for (None: none)."""
        if directory is None:
            if budget_gb is not None:
                raise ValueError("prefix_cache_gb needs prefix_cache_dir (the directory the blocks are kept in).")
            return None
        if not enable_prefix_caching:
            raise ValueError("prefix_cache_dir needs the prefix cache (enable_prefix_caching=True).")
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError("prefix_cache_dir is not supported with tensor or pipeline parallelism yet.")
        core = self.core
        return PrefixStore(directory, budget_gb, self.loaded.source or self.model_path, core.kv_block_size,
                           core.kv_block_bytes, weights=self.dtype, kv_type=core.kv_type, kv_keep=core.kv_keep,
                           kernel_table=core.kernel_table, activations=core.activations)

    def _lora_registry(self, enable_lora: bool, max_loras: int) -> Optional[LoraRegistry]:
        if not isinstance(enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {enable_lora!r}.")
        if not enable_lora:
            return None
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError("LoRA adapters are not supported with tensor or pipeline parallelism yet.")
        if self.is_encoder:
            raise ValueError(f"{self.model_name} is an embedding model; LoRA adapters apply to generation.")
        return LoraRegistry(self.core, self.spec, max_loras, self.scheduler.adapters_in_use)

    def _lora_registry_of(self, what: str) -> LoraRegistry:
        if self.loras is None:
            raise ValueError(f"{what} needs LoRA enabled (LLM(..., enable_lora=True), corelm serve --lora).")
        return self.loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads and registers an adapter now (requests naming it later need not wait for it), as vLLM's."""
        self._lora_registry_of("add_lora").resolve(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora_registry_of("remove_lora").remove(lora_int_id)

    def list_loras(self) -> List[LoRARequest]:
        """The adapters added so far (each loaded again when a request names it after an eviction)."""
        return [] if self.loras is None else self.loras.list()

    def lora_by_name(self, name: Optional[str]) -> Optional[LoRARequest]:
        """The adapter added under lora_name `name` (the server's model field), None if none."""
        return None if self.loras is None or not isinstance(name, str) else self.loras.by_name(name)

    def _eos_ids(self) -> List[int]:
        ids = list(self.spec.eos_token_ids or [])
        gen = self.loaded.generation_config.get("eos_token_id")
        ids += gen if isinstance(gen, list) else ([gen] if isinstance(gen, int) else [])
        ids += list(getattr(self.tokenizer, "eos_token_ids", []) or [])
        return sorted({int(i) for i in ids if isinstance(i, (int, np.integer)) and 0 <= i < self.vocab_size})

    # -- prompts ------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: PromptType) -> List[int]:
        """Token ids of a prompt (text gets the tokenizer's special tokens, e.g. BOS); ids are checked
        against the vocabulary."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (a list of ids).")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Seq, np.ndarray)):
            raise ValueError(f"a prompt must be text or a list of token ids, got {type(prompt).__name__}.")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a token-id prompt must hold integers only.")
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1}).")
        return ids

    def apply_chat_template(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  chat_template=chat_template)

    def encode_chat(self, messages: List[Dict[str, Any]], chat_template: Optional[str] = None,
                    add_generation_prompt: bool = True) -> List[int]:
        """Token ids of a conversation rendered with the model's chat template (which writes BOS itself)."""
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_prompt(self, prompt_ids: List[int]) -> None:
        check_prompt_fits(prompt_ids, self.max_seq_len, self.core.kv_blocks, self.core.kv_block_size)

    def check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling parameters must be a corelm.SamplingParams, got {type(params).__name__}")
        params.validate_against_vocab(self.vocab_size)

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    lora_request: Optional[LoRARequest] = None) -> List[int]:
        """Queues a request (all its n choices) and returns its prompt's token ids. Raises ValueError
        (nothing queued) for a bad prompt or parameters, a request id already in use, or a bad adapter.
        lora_request: the LoRA adapter its tokens go through (None: the base model)."""
        if self.is_encoder:
            raise ValueError(f"{self.model_name} is an embedding model (an encoder): it embeds and scores text, it "
                             f"does not generate; use embed() or /v1/embeddings.")
        ids = self.encode_prompt(prompt)
        self.check_prompt(ids)
        self.check_params(params)
        if params.max_thinking_tokens is None and self.reasoning_budget >= 0:
            params = dataclasses.replace(params, max_thinking_tokens=self.reasoning_budget)
        seqs = [Sequence(ids, choice_params(params, k), self.tokenizer, self.vocab_size, self.eos_token_ids,
                         self.max_seq_len - len(ids), seq_index=k) for k in range(params.n)]
        if lora_request is None:
            self.scheduler.add(request_id, seqs)
            return ids
        loras = self._lora_registry_of("a lora_request")
        with loras.lock:   # the adapter stays registered until the scheduler holds the request
            self.scheduler.add(request_id, seqs, loras.resolve(lora_request))
        return ids

    def encode_embedding_input(self, prompt: PromptType, truncate_prompt_tokens: Optional[int] = None) -> List[int]:
        """A prompt's ids for embedding, checked against the context (truncate_prompt_tokens: keep only its
        last k tokens, as vLLM's option; an encoder keeps its first k, [CLS] included, and its final [SEP])."""
        ids = self.encode_prompt(prompt)
        if truncate_prompt_tokens is not None:
            k = truncate_prompt_tokens
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ValueError(f"truncate_prompt_tokens must be a positive integer, got {k!r}.")
            if len(ids) > k:
                ids = ids[:k - 1] + ids[-1:] if self.is_encoder else ids[-k:]
        if not ids:
            raise ValueError("an input to embed needs at least one token.")
        if len(ids) > self.max_seq_len:
            raise ValueError(f"the input has {len(ids)} tokens; this model embeds at most {self.max_seq_len} "
                             f"(truncate_prompt_tokens cuts longer ones).")
        return ids

    def embed(self, prompts: List[List[int]], params: Optional[PoolingParams] = None) -> List[np.ndarray]:
        """One embedding per prompt (token ids from encode_embedding_input), pooled as the model says
        (self.pooling) and normalized unless params say otherwise. Runs on the caller's thread between
        steps: the server calls it from the engine's thread."""
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError("embeddings run in one process; this engine is split across ranks.")
        return self.embedder.embed(prompts, params)

    def abort_request(self, request_id: str) -> None:
        """Stops every choice of the request at the next step (each ends with an "abort" chunk)."""
        self.scheduler.abort_request(request_id)

    def step(self) -> List[Tuple[str, StreamChunk]]:
        """One forward pass over the running sequences: (request id, chunk) for every choice that moved."""
        return self.scheduler.step()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def run_to_completion(self) -> Dict[str, List[StreamChunk]]:
        """Steps until every request finished: request id -> its chunks (all choices, in order)."""
        chunks: Dict[str, List[StreamChunk]] = collections.defaultdict(list)
        while self.has_unfinished_requests():
            for rid, chunk in self.step():
                chunks[rid].append(chunk)
        return dict(chunks)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted so far because the KV pool ran out (each was recomputed later)."""
        return self.scheduler.num_preemptions

    @property
    def last_step_tokens(self) -> int:
        """Tokens the last step ran through the model (prompt chunks plus one per decoding sequence)."""
        return self.scheduler.last_step_tokens

    def spec_counts(self) -> Optional[Dict[str, int]]:
        """Speculative decoding so far: {"draft_tokens": proposed, "accepted_tokens": kept}; None without it."""
        if self.speculator is None:
            return None
        return {"draft_tokens": self.speculator.stats.proposed, "accepted_tokens": self.speculator.stats.accepted}

    def cached_prompt_tokens(self, request_id: str) -> int:
        """How many of the request's prompt tokens came from the prefix cache (asked once)."""
        return self.scheduler.cached_prompt_tokens(request_id)

    def clear_prefix_cache(self) -> None:
        """Forget the prefix cache (the next prompt is read from scratch)."""
        self.scheduler.clear_prefix_cache()

    def wait_for_huge_pages(self, timeout: Optional[float] = None) -> bool:
        """Waits while the weights (the draft model's too) move onto 2 MiB pages, which happens where the
        load put them on 4 KiB ones because fresh 2 MiB pages came slowly (docs/architecture.md); True
        once no move is running. The move runs at idle priority: while the CPUs are busy it waits."""
        cores = [self.core] + [c for c in [getattr(self.speculator, "core", None)] if c is not None]
        return wait_for_huge_pages(cores, timeout)


# generation_config.json's sampling keys (GGUF's general.sampling.* are read into the same names)
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(generation_config: Dict[str, Any]) -> Dict[str, Any]:
    """The sampling parameters a model's files set, as vLLM reads them (SAMPLING_DEFAULT_KEYS); a value
    SamplingParams refuses is left out."""
    out = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = generation_config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                SamplingParams(**{key: value})
            except ValueError:
                continue
            out[key] = value
    return out


def choice_params(params: SamplingParams, k: int) -> SamplingParams:
    """Choice k of a request: the same parameters, with seed + k for k > 0 when a seed is set, so the
    choices differ but the request stays reproducible."""
    if k == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + k)
