"""Sampling parameters (validated like vLLM's) and the per-sequence token sampler.

    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128, seed=1)
    sampler = Sampler(params, vocab_size, eos_token_ids=[2])
    sampler.start(prompt_ids)
    token = sampler.sample(logits)          # logits: float32 [vocab]; the token counts as output

The order of operations: penalties (repetition on prompt + output, presence and frequency on
output, as vLLM) -> min_tokens (EOS and stop ids masked) -> greedy argmax, or temperature -> top_k ->
top_p -> min_p (HF transformers' warper order; vLLM applies min_p before top_k/top_p, which differs
only when top_p is set too) -> a draw from the sequence's own numpy Generator.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .guided import GuidedDecodingParams, StructuredOutputsParams, as_structured  # noqa: F401 (re-exported)

MAX_LOGIT_BIAS = 300        # OpenAI's limit on logit_bias entries

# vLLM treats temperatures below this as greedy: dividing logits by ~0 only amplifies rounding noise.
_SAMPLING_EPS = 1e-5


# ---------------------------------------------------------------------------------------------------
# Validation helpers. bool is an int subclass in Python, so it is refused explicitly: `top_k=True`
# is almost certainly a bug in the caller, not a request for top_k=1.

def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _as_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {_describe(value)}.")
    return int(value)


def _as_float(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_describe(value)}.")
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    if not math.isfinite(result):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return result


def _as_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {_describe(value)}.")
    return bool(value)


def _as_int_list(name: str, value) -> List[int]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, np.ndarray)):
        raise ValueError(f"{name} must be a list of integers, got {_describe(value)}.")
    ids = [_as_int(f"{name}[{i}]", v) for i, v in enumerate(value)]
    for v in ids:
        if v < 0:
            raise ValueError(f"{name} must contain non-negative token ids, got {v}.")
    return ids


def _as_stop_list(value) -> List[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise ValueError(f"stop must be a string or a list of strings, got {_describe(value)}.")
    if any(s == "" for s in value):
        raise ValueError("stop cannot contain an empty string.")
    return list(value)


def _as_logit_bias(value) -> Dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_describe(value)}.")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}.")
    out = {}
    for k, v in value.items():
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():    # OpenAI's JSON keys are strings
            k = int(k)
        t = _as_int("logit_bias token id", k)
        if t < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {t}.")
        b = _as_float("logit_bias value", v)
        if not -100.0 <= b <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {b}.")
        out[t] = b
    return out


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Names, defaults and ranges follow vLLM's SamplingParams.

    temperature 0 (anything below 1e-5) means greedy; then top_p, top_k and min_p are reset to their
    neutral values and n must be 1, as vLLM does. `stop` is normalised to a list of strings and
    `stop_token_ids` to a list of ints; `top_k=-1` is normalised to 0 (disabled). A seed of any integer
    (negative ones included) makes the request reproducible; None draws fresh entropy.
    Invalid values raise ValueError with a message naming the field and the value.
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[Dict[int, float]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_decoding: Optional[StructuredOutputsParams] = None   # vLLM's older name for structured_outputs
    best_of: Optional[int] = None   # vLLM's: only n (or None) is supported, every choice is returned
    # reasoning models: a thought longer than this many tokens is ended (engine/thinking.py); -1 no limit,
    # None the engine's default (LLMEngine(reasoning_budget=...), llama.cpp's --reasoning-budget)
    max_thinking_tokens: Optional[int] = None

    def __post_init__(self):
        self._check_types()
        self._check_ranges()
        if self.is_greedy:
            self._force_greedy()

    def _check_types(self):
        self.n = _as_int("n", self.n)
        self.temperature = _as_float("temperature", self.temperature)
        self.top_p = _as_float("top_p", self.top_p)
        self.top_k = _as_int("top_k", self.top_k)
        self.min_p = _as_float("min_p", self.min_p)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        self.presence_penalty = _as_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _as_float("frequency_penalty", self.frequency_penalty)
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
        self.stop = _as_stop_list(self.stop)
        self.stop_token_ids = _as_int_list("stop_token_ids", self.stop_token_ids)
        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens)
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs)
        if self.max_thinking_tokens is not None:
            self.max_thinking_tokens = _as_int("max_thinking_tokens", self.max_thinking_tokens)
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _as_bool("include_stop_str_in_output",
                                                   self.include_stop_str_in_output)
        self.logit_bias = _as_logit_bias(self.logit_bias) or None
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and \
                    as_structured(self.guided_decoding) != as_structured(self.structured_outputs):
                raise ValueError("structured_outputs and guided_decoding (its older name) disagree; give one.")
            self.structured_outputs = self.guided_decoding
        self.structured_outputs = as_structured(self.structured_outputs)
        self.guided_decoding = self.structured_outputs

    def _check_ranges(self):
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.best_of is not None and (_as_int("best_of", self.best_of) != self.n):
            raise ValueError(f"best_of must equal n ({self.n}) or be None: corelm returns every choice it makes, "
                             f"got {self.best_of}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        self.top_k = max(self.top_k, 0)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        if self.max_thinking_tokens is not None and self.max_thinking_tokens < -1:
            raise ValueError(f"max_thinking_tokens must be -1 (no limit) or at least 0, got {self.max_thinking_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")

    def _force_greedy(self):
        if self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @classmethod
    def greedy(cls, **overrides) -> "SamplingParams":
        """Deterministic argmax decoding: SamplingParams(temperature=0, ...)."""
        return cls(temperature=0.0, **overrides)

    def validate_against_vocab(self, vocab_size: int) -> None:
        """Checks what depends on the model: token ids and the logprobs count must fit the vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary [0, {vocab_size}).")
        for t in self.logit_bias or ():
            if t >= vocab_size:
                raise ValueError(f"logit_bias contains token id {t}, outside the vocabulary [0, {vocab_size}).")
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size {vocab_size}, got {self.logprobs}.")


# ---------------------------------------------------------------------------------------------------
# Penalties. One function does the arithmetic for both the stateless helper and the Sampler, so the
# test of the helper covers the engine's path.

def _penalise(x: np.ndarray, seen_ids: np.ndarray, out_ids: np.ndarray, out_counts: np.ndarray,
              repetition: float, presence: float, frequency: float) -> None:
    """In place on x. seen_ids: unique ids of prompt + output; out_ids/out_counts: unique output ids
    and how often each was generated (all counts > 0)."""
    if repetition != 1.0 and len(seen_ids):
        v = x[seen_ids]
        # HF/vLLM: shrinking a positive logit and growing a negative one both make the token less likely.
        x[seen_ids] = np.where(v > 0, v / repetition, v * repetition)
    if (presence != 0.0 or frequency != 0.0) and len(out_ids):
        # OpenAI: logit -= frequency * count + presence * (count > 0)
        x[out_ids] -= frequency * out_counts + presence


def apply_penalties(logits: np.ndarray, prompt_ids: Sequence[int], output_ids: Sequence[int],
                    repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0) -> np.ndarray:
    """Returns a penalised float32 copy of `logits`, computed from whole token lists (the Sampler
    keeps the same counts incrementally instead)."""
    x = np.array(logits, dtype=np.float32, copy=True)
    out_ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
    seen = np.union1d(np.asarray(prompt_ids, dtype=np.int64), out_ids)
    _penalise(x, seen, out_ids, counts, repetition_penalty, presence_penalty, frequency_penalty)
    return x


def compute_logprobs(logits: np.ndarray, token_id: int, num: int = 0) -> Tuple[float, int, List[Tuple[int, float]]]:
    """Log-softmax of `logits` (the raw model output, as vLLM reports by default): the chosen token's
    logprob, its rank (1 = most likely; ties share the better rank) and the `num` most likely
    (token_id, logprob) pairs, best first."""
    z = np.asarray(logits, dtype=np.float32)
    top = float(z.max())
    # Clamped at e^-80 like the sampler (denormals make float32 exp slow); changes lse by < 1e-29.
    lse = top + math.log(float(np.exp(np.maximum(z - np.float32(top), -80.0)).sum(dtype=np.float64)))
    chosen = float(z[token_id]) - lse
    rank = 1 + int(np.count_nonzero(z > z[token_id]))
    k = min(int(num), len(z))
    if k <= 0:
        return chosen, rank, []
    idx = np.argpartition(-z, k - 1)[:k]          # the k best without sorting the whole vocabulary
    idx = idx[np.argsort(-z[idx], kind="stable")]
    return chosen, rank, [(int(i), float(z[i]) - lse) for i in idx]


# ---------------------------------------------------------------------------------------------------
# Truncation and the draw, on probability vectors.

def _top_p_indices(w: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of tokens whose share of the total weight reaches top_p, heaviest
    first. Tries the best 128, then 4096, ... before sorting everything: with a peaked distribution
    the nucleus is small, and a full sort of 150k weights costs a few ms per token."""
    target = top_p * w.sum(dtype=np.float64)
    n, m = len(w), min(len(w), 128)
    while True:
        if m >= n:
            order = np.argsort(-w)
        else:
            part = np.argpartition(-w, m - 1)[:m]
            order = part[np.argsort(-w[part])]
        cdf = np.cumsum(w[order], dtype=np.float64)
        if m >= n or cdf[-1] >= target:
            break
        m *= 32
    keep = int(np.searchsorted(cdf, target, side="left")) + 1   # first prefix reaching the target
    return order[:keep]


_DRAW_BLOCK = 1024


def _draw(w: np.ndarray, rng: np.random.Generator) -> int:
    """Index drawn with probability proportional to the weights w (zeros are never drawn)."""
    if len(w) <= 4 * _DRAW_BLOCK:
        cdf = np.cumsum(w, dtype=np.float64)
        return _search(w, cdf, rng.random() * cdf[-1])
    # A float64 cumsum over 150k weights is the slowest step of a draw (~1.7 ms), so sum blocks of
    # 1024 first (~0.1 ms), pick a block, and walk inside it. One random number either way.
    block_sums = np.add.reduceat(w, np.arange(0, len(w), _DRAW_BLOCK), dtype=np.float64)
    block_cdf = np.cumsum(block_sums)
    u = rng.random() * block_cdf[-1]
    b = int(np.searchsorted(block_cdf, u, side="right"))
    if b >= len(block_sums) or block_sums[b] <= 0.0:      # only reachable through rounding
        b = int(np.flatnonzero(block_sums)[-1])
    lo = b * _DRAW_BLOCK
    block = w[lo:lo + _DRAW_BLOCK]
    u -= block_cdf[b - 1] if b else 0.0
    return lo + _search(block, np.cumsum(block, dtype=np.float64), u)


def _search(w: np.ndarray, cdf: np.ndarray, u: float) -> int:
    i = int(np.searchsorted(cdf, u, side="right"))
    if i >= len(w) or w[i] <= 0.0:       # only reachable through rounding at the top end
        i = int(np.flatnonzero(w)[-1])
    return i


class _IdList:
    """A growable int64 array: ids are appended one at a time, read back as a view without copying."""

    def __init__(self, ids: Optional[np.ndarray] = None):
        self._buf = np.empty(max(64, 0 if ids is None else 2 * len(ids)), dtype=np.int64)
        self.n = 0
        if ids is not None:
            self._buf[:len(ids)] = ids
            self.n = len(ids)

    def append(self, i: int) -> None:
        if self.n == len(self._buf):
            self._buf = np.concatenate([self._buf, np.empty_like(self._buf)])
        self._buf[self.n] = i
        self.n += 1

    def view(self) -> np.ndarray:
        return self._buf[:self.n]


# ---------------------------------------------------------------------------------------------------

class Sampler:
    """Chooses the tokens of one sequence.

    It is stateful so that each step costs O(tokens seen), not O(prompt + output):

        sampler = Sampler(params, vocab_size, eos_token_ids=[eos])
        sampler.start(prompt_ids)           # resets counts and seeds the generator
        tok = sampler.sample(logits)        # picks a token; it counts as generated output
        ...

    `sample()` records its own choice, committed on the next `sample()` call. Calling `accept(tok)`
    with that same token is harmless (it is counted once), and `accept(other)` replaces it: that is how
    an engine records a token it chose itself (a forced or teacher-forced token).

    The stateless form `sample(logits, prompt_ids, output_ids)` is also accepted: the sampler then
    catches up with output_ids[already counted:] (and starts over when the prompt changes length or
    output_ids shrinks), so calling it every step with growing lists stays incremental.

    Each sequence has its own numpy Generator seeded from params.seed (and `seq_index`, so the n
    sequences of one request differ yet stay reproducible); seed None uses fresh OS entropy.
    `logits` are never modified.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, eos_token_ids: Sequence[int] = (),
                 seq_index: int = 0):
        params.validate_against_vocab(vocab_size)
        self.params = params
        self.vocab_size = int(vocab_size)
        self.seq_index = int(seq_index)
        eos = [] if params.ignore_eos else [int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size]
        # Ids that end a sequence; min_tokens masks them until enough tokens were generated.
        self._stop_ids = np.unique(np.asarray(list(params.stop_token_ids) + eos, dtype=np.int64))
        self._penalised = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                           or params.frequency_penalty != 0.0)
        bias = params.logit_bias or {}
        self._bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self._bias_vals = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self.start(())

    # --- state -------------------------------------------------------------------------------------

    def start(self, prompt_ids: Sequence[int]) -> None:
        """Begins a sequence: forgets earlier output, records the prompt, seeds the generator."""
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self._check_ids(prompt)
        self._n_prompt = len(prompt)
        self._n_out = 0
        self._pending: Optional[int] = None
        self._rng = self._make_rng()
        if self._penalised:
            self._seen = np.zeros(self.vocab_size, dtype=bool)
            self._counts = np.zeros(self.vocab_size, dtype=np.int32)
            unique = np.unique(prompt)
            self._seen[unique] = True
            self._seen_ids = _IdList(unique)   # prompt + output, for the repetition penalty
            self._out_ids = _IdList()          # output only, for presence / frequency

    def accept(self, token_id: int) -> None:
        """Records `token_id` as the sequence's next output token (see the class docstring)."""
        self._pending = None
        self._commit(int(token_id))

    @property
    def num_output_tokens(self) -> int:
        return self._n_out + (self._pending is not None)

    def _make_rng(self) -> np.random.Generator:
        seed = self.params.seed
        if seed is None:
            return np.random.default_rng()
        # SeedSequence wants non-negative entropy; masking keeps every int seed valid and distinct.
        return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, self.seq_index])

    def _check_ids(self, ids: np.ndarray) -> None:
        if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0]
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size}).")

    def _commit(self, t: int) -> None:
        if not 0 <= t < self.vocab_size:
            raise ValueError(f"token id {t} is outside the vocabulary [0, {self.vocab_size}).")
        self._n_out += 1
        if not self._penalised:
            return
        if self._counts[t] == 0:
            self._out_ids.append(t)
        self._counts[t] += 1
        if not self._seen[t]:
            self._seen[t] = True
            self._seen_ids.append(t)

    def _sync(self, prompt_ids: Optional[Sequence[int]], output_ids: Optional[Sequence[int]]) -> None:
        out = [] if output_ids is None else output_ids
        self._pending = None                     # the caller's output_ids are authoritative
        if (prompt_ids is not None and len(prompt_ids) != self._n_prompt) or len(out) < self._n_out:
            self.start(() if prompt_ids is None else prompt_ids)
        for t in out[self._n_out:]:
            self._commit(int(t))

    # --- sampling ----------------------------------------------------------------------------------

    def sample(self, logits: np.ndarray, prompt_ids: Optional[Sequence[int]] = None,
               output_ids: Optional[Sequence[int]] = None, allowed: Optional[np.ndarray] = None,
               grammar=None) -> int:
        """The next token id for `logits` (float32 [vocab]). `allowed` (bool [vocab], a grammar's mask)
        restricts the choice to its True entries; it is applied last, after penalties, logit_bias and
        min_tokens, and wins over min_tokens when they leave nothing. `grammar` (with `allows(token)` and
        `allowed()`, the mask) is the same restriction computed lazily: the choice without the mask
        stands when the grammar allows it, which gives the masked choice exactly (below); only otherwise
        is the mask computed."""
        if prompt_ids is not None or output_ids is not None:
            self._sync(prompt_ids, output_ids)
        elif self._pending is not None:
            self.accept(self._pending)
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} entries, expected {self.vocab_size}.")
        p = self.params
        logits = np.asarray(logits).reshape(-1)
        token = -1
        if grammar is not None and allowed is None:
            token = self._unmasked_choice(logits, grammar)
            if token < 0:
                allowed = grammar.allowed()
        elif allowed is not None and (p.is_greedy or p.top_k == 1) and self._unprocessed():
            # the first maximum, when the grammar allows it, is the masked first maximum too: no masked copy
            token = int(np.argmax(logits))
            token = token if allowed[token] else -1
        if token < 0:
            x = self._processed_logits(logits, allowed)
            if p.is_greedy or p.top_k == 1:
                token = int(np.argmax(x))            # first maximum: ties go to the lowest id
            else:
                token = self._sample_random(x)
        self._pending = token
        return token

    def _unmasked_choice(self, logits: np.ndarray, grammar) -> int:
        """The token chosen without the grammar's mask if the grammar allows it, else -1. Greedy: the
        first maximum, if allowed, is also the first maximum among the allowed. Plain sampling (no
        top_k, top_p or min_p, which pick their candidates before the mask would): a token drawn from
        all and kept only if allowed, else redrawn under the mask, is drawn with probability
        p(t) + (1 - P(allowed)) p(t) / P(allowed) = p(t) / P(allowed), the masked distribution."""
        p = self.params
        greedy = p.is_greedy or p.top_k == 1
        if not greedy and (0 < p.top_k < self.vocab_size or p.top_p < 1.0 or p.min_p > 0.0):
            return -1
        x = self._processed_logits(logits)
        if not np.isfinite(x.max()):                # min_tokens left nothing: the mask decides
            return -1
        token = int(np.argmax(x)) if greedy else self._sample_random(x)
        return token if grammar.allows(token) else -1

    def _unprocessed(self) -> bool:
        """No penalty, logit_bias or min_tokens mask changes the logits at this step."""
        return not (self._penalised or (self._n_out < self.params.min_tokens and len(self._stop_ids)) or
                    len(self._bias_ids))

    def _processed_logits(self, logits: np.ndarray, allowed: Optional[np.ndarray] = None) -> np.ndarray:
        """Penalties, logit_bias, the min_tokens mask and the grammar's mask, on a copy (only when
        there is something to change)."""
        p = self.params
        mask_stops = self._n_out < p.min_tokens and len(self._stop_ids)
        if self._unprocessed():
            return logits if allowed is None else np.where(allowed, logits, np.float32(-np.inf))
        x = logits.astype(np.float32, copy=True)
        if self._penalised:
            out_ids = self._out_ids.view()
            _penalise(x, self._seen_ids.view(), out_ids, self._counts[out_ids], p.repetition_penalty,
                      p.presence_penalty, p.frequency_penalty)
        if len(self._bias_ids):
            x[self._bias_ids] += self._bias_vals
        if mask_stops:
            x[self._stop_ids] = -np.inf
        if allowed is not None:
            y = np.where(allowed, x, np.float32(-np.inf))
            # min_tokens (or a -inf bias) may forbid all the grammar allows (e.g. only EOS): the grammar wins
            x = y if np.isfinite(y.max()) else np.where(allowed, logits, np.float32(-np.inf))
        return x

    def _sample_random(self, x: np.ndarray) -> int:
        p = self.params
        cand = None                                # vocabulary ids of the candidates; None = all
        vals = x
        if 0 < p.top_k < len(x):
            cand = np.argpartition(x, len(x) - p.top_k)[len(x) - p.top_k:]   # the k largest, unsorted
            vals = x[cand]
        z = np.asarray(vals, dtype=np.float32) / np.float32(p.temperature)
        zmax = z.max()
        if not np.isfinite(zmax):                  # everything masked: nothing sensible to draw from
            return int(np.argmax(x))
        z -= zmax
        # Unnormalised weights, best token = 1. float32 exp is ~10x faster than float64, but slow on
        # results that underflow to denormals: tokens below e^-80 of the best are clamped, then zeroed
        # (masked -inf ones included), so they are never drawn.
        w = np.exp(np.maximum(z, -80.0))
        w *= z > -80.0
        keep = None                                # indices into w; None = all
        if p.top_p < 1.0:
            keep = _top_p_indices(w, p.top_p)
        if p.min_p > 0.0:
            kept = w if keep is None else w[keep]
            # Relative to the best token, so renormalising after top_k / top_p changes nothing.
            ok = kept >= p.min_p * kept.max()
            keep = np.flatnonzero(ok) if keep is None else keep[ok]
        i = _draw(w if keep is None else w[keep], self._rng)
        i = i if keep is None else int(keep[i])
        return int(i if cand is None else cand[i])

    def logprobs(self, logits: np.ndarray, token_id: int) -> Optional[Tuple[float, int, List[Tuple[int, float]]]]:
        """(logprob of token_id, its rank, top params.logprobs (id, logprob) pairs) from the raw,
        unpenalised logits, or None when the request did not ask for logprobs."""
        if self.params.logprobs is None:
            return None
        return compute_logprobs(logits, token_id, self.params.logprobs)
