"""Structured output (guided decoding) through llguidance: a token mask per sequence per step.

    params = SamplingParams(temperature=0.8, structured_outputs=StructuredOutputsParams(json=schema))

StructuredOutputsParams follows vLLM's (GuidedDecodingParams is its older name, kept as an alias):
exactly one of `json` (a JSON schema, dict or text), `json_object` (any JSON object), `regex`,
`choice` (a list of strings) or `grammar` (Lark or GBNF). It is compiled to an llguidance grammar and
checked when it is built (ValueError on an invalid schema, regex or grammar). Compiling is bounded by
LIMITS, so a pathological grammar is an error, not a stalled engine.

GuidedMatcher is one sequence's state: `allowed()` gives a bool mask over the vocabulary for the next
token, `allows(token)` checks one token without it (the sampler asks that first: the mask is the
expensive part, and the model mostly picks an allowed token), `consume(token)` advances it, `stopped`
says that nothing but EOS may follow.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

log = logging.getLogger("corelm")
llguidance = None            # imported on first use: processes that never constrain output do not load it

# Sizes a request may bring: the grammar engine's own limits bound the work, these bound the text.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
# llguidance's parser and lexer budgets (its defaults are 500k symbols / 1M fuel); verbose_errors off
# so its messages carry no parser state.
LIMIT_ARGS = dict(max_grammar_size=100_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                  step_max_items=50_000, max_lexer_states=100_000, verbose_errors=False)
# JSON: compact output (no free whitespace between tokens, as OpenAI's strict mode writes it), and
# unknown schema keywords are errors rather than silently ignored.
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False}

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _need_llguidance():
    global llguidance
    if llguidance is None:
        try:
            import llguidance as module
        except ImportError:
            raise ValueError("structured outputs need the llguidance package (pip install llguidance).") from None
        llguidance = module
    return llguidance


def limits():
    return _need_llguidance().LLParserLimits(**LIMIT_ARGS)


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: give exactly one of json, json_object, regex, choice, grammar.
    Invalid ones raise ValueError (naming the field) when built."""
    json: Optional[Union[str, Dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, "
                             f"grammar (got {len(given)}).")
        self.kind = given[0]
        self.grammar_text = compile_grammar(self.kind, getattr(self, self.kind))

    def __eq__(self, other):
        return isinstance(other, StructuredOutputsParams) and self.grammar_text == other.grammar_text

    def __hash__(self):
        return hash(self.grammar_text)


GuidedDecodingParams = StructuredOutputsParams


def as_structured(value) -> Optional[StructuredOutputsParams]:
    """None, a StructuredOutputsParams, or a dict of its fields -> StructuredOutputsParams or None."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; use {list(KINDS)}.")
        return StructuredOutputsParams(**value)
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}.")


def _checked_text(kind: str, text: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"structured_outputs.{kind} must be a string, got {type(text).__name__}.")
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.{kind} is longer than {MAX_SPEC_CHARS} characters.")
    return text


def _check_size(value) -> None:
    """A schema's JSON text stays under MAX_SPEC_CHARS, checked by a walk that stops at the limit (a
    dict that shares sub-dicts can stand for an exponentially long text; json.dumps would hang)."""
    budget, stack = MAX_SPEC_CHARS, [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > 256:
            raise ValueError("structured_outputs.json is nested too deeply.")
        if isinstance(v, dict):
            budget -= 2 + sum(len(str(k)) + 4 for k in v)
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, (list, tuple)):
            budget -= 2 + len(v)
            stack.extend((x, depth + 1) for x in v)
        else:
            budget -= len(v) + 2 if isinstance(v, str) else 8
        if budget < 0:
            raise ValueError(f"structured_outputs.json is longer than {MAX_SPEC_CHARS} characters.")


def _to_grammar(kind: str, value) -> str:
    G = _need_llguidance()
    if kind == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object must be True.")
        return G.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(_checked_text(kind, value))
            except ValueError:
                raise ValueError("structured_outputs.json is not valid JSON.") from None
        if isinstance(value, bool) or not isinstance(value, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object).")
        _check_size(value)
        try:
            return G.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.json is not a valid JSON schema: {e}") from None
    if kind == "regex":
        return G.LLMatcher.grammar_from_regex(_checked_text(kind, value))
    if kind == "choice":
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value \
                or not all(isinstance(c, str) for c in value):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        if len(value) > MAX_CHOICES or sum(len(c) for c in value) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.choice allows at most {MAX_CHOICES} choices, "
                             f"{MAX_SPEC_CHARS} characters in all.")
        if any(c == "" for c in value):
            raise ValueError("structured_outputs.choice cannot contain an empty string.")
        return G.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        try:
            return G.grammar_from("grammar", _checked_text(kind, value))
        except (ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError) as e:
            raise ValueError(f"structured_outputs.grammar is not a valid grammar: {e}") from None
    raise ValueError(f"unknown structured output kind {kind!r}")


_validated: "collections.OrderedDict[str, None]" = collections.OrderedDict()
_lock = threading.Lock()
_CACHE = 64


def compile_grammar(kind: str, value) -> str:
    """The llguidance grammar for one kind of constraint, checked under LIMITS (ValueError if invalid)."""
    grammar = _to_grammar(kind, value)
    with _lock:
        if grammar in _validated:
            _validated.move_to_end(grammar)
            return grammar
    is_error, messages = _need_llguidance().LLMatcher.validate_grammar_with_warnings(grammar, None,
                                                                                   limits=limits())
    if is_error:
        msg = (messages[0] if messages else "invalid").strip().splitlines()[0][:300]
        raise ValueError(f"structured_outputs.{kind} is invalid: {msg}")
    with _lock:
        _validated[grammar] = None
        while len(_validated) > _CACHE:
            _validated.popitem(last=False)
    return grammar


# ---------------------------------------------------------------------------------------------------
# Per tokenizer: llguidance's tokenizer (built once, ~0.2 s) and compiled matchers to copy from.

class _TokenizerState:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        G = _need_llguidance()
        eos = [int(t) for t in eos_ids] or None
        self.lltok = G.LLTokenizer(tokenizer.to_json_str(), n_vocab=int(vocab_size), eos_token=eos)
        self.eos = frozenset(int(t) for t in self.lltok.eos_tokens)
        self.templates: "collections.OrderedDict[str, Any]" = collections.OrderedDict()


_states: "weakref.WeakKeyDictionary[Any, Dict[tuple, _TokenizerState]]" = weakref.WeakKeyDictionary()


def _state(tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> _TokenizerState:
    key = (int(vocab_size), tuple(sorted(int(t) for t in eos_ids)))
    with _lock:
        per = _states.setdefault(tokenizer, {})
        st = per.get(key)
    if st is None:
        st = _TokenizerState(tokenizer, vocab_size, key[1])
        with _lock:
            st = per.setdefault(key, st)
    return st


class UnsatisfiableConstraint(ValueError):
    """The constraint matches no output at all ("start: start", a schema that is only "$ref": "#"):
    generating under it could only ever give empty text."""


def _check_satisfiable(matcher, eos, kind: str) -> None:
    """A fresh matcher that does not accept the empty output and allows no token but EOS (llguidance
    stops it at once) matches nothing: UnsatisfiableConstraint."""
    if matcher.is_accepting():
        return
    if not matcher.is_stopped():
        probe = matcher.deep_copy()
        mask = np.unpackbits(np.frombuffer(probe.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = set(np.flatnonzero(mask).tolist()) if mask.any() else set()
        if allowed - set(eos):
            return
    raise UnsatisfiableConstraint(f"structured_outputs.{kind} can never be satisfied: no output matches it.")


class GuidedMatcher:
    """One sequence's grammar state. Raises ValueError when the grammar does not compile for this
    tokenizer, UnsatisfiableConstraint (a ValueError) when it matches no output."""

    def __init__(self, so: StructuredOutputsParams, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        G = _need_llguidance()
        st = _state(tokenizer, vocab_size, eos_ids)
        with _lock:
            template = st.templates.get(so.grammar_text)
            if template is not None:
                st.templates.move_to_end(so.grammar_text)
        if template is None:
            template = G.LLMatcher(st.lltok, so.grammar_text, log_level=0, limits=limits())
            if template.is_error():
                msg = template.get_error().strip().splitlines()[0][:300] if template.get_error() else "invalid"
                raise ValueError(f"structured_outputs.{so.kind} is invalid: {msg}")
            _check_satisfiable(template, st.eos, so.kind)
            with _lock:
                st.templates[so.grammar_text] = template
                while len(st.templates) > _CACHE:
                    st.templates.popitem(last=False)
        self.matcher = template.deep_copy()
        self.eos = st.eos
        self.vocab_size = int(vocab_size)
        self._words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """Bool [vocab]: the tokens the grammar allows next (EOS among them once it is satisfied). When
        the grammar allows nothing (it failed, e.g. out of its step budget), EOS, which ends the sequence."""
        w = self._words
        self.matcher.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
        mask = np.unpackbits(w.view(np.uint8), count=self.vocab_size, bitorder="little").view(np.bool_)
        if not mask.any():
            log.warning("structured output: the grammar allows no token (%s); the sequence ends", self.error)
            mask[list(self.eos)] = True
        return mask

    def allows(self, token: int) -> bool:
        """Whether `token` may come next, as allowed()[token] says, without computing the whole mask."""
        return 0 <= token < self.vocab_size and self.matcher.validate_tokens([int(token)]) == 1

    def consume(self, token: int) -> bool:
        return bool(self.matcher.consume_token(int(token)))

    @property
    def stopped(self) -> bool:
        """Nothing but EOS may follow (or the matcher is in an error state)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> Optional[str]:
        return self.matcher.get_error() if self.matcher.is_error() else None
