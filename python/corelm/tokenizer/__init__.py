"""Tokenizer: text <-> token ids, chat templates, and streaming detokenization.

Two sources give the same object:
  Tokenizer.from_hf_folder(path)        tokenizer.json (+ tokenizer_config.json, special_tokens_map.json,
                                         chat_template.jinja), read with the `tokenizers` library;
  Tokenizer.from_gguf_metadata(meta)    a `tokenizers.Tokenizer` rebuilt from GGUF keys (gguf_vocab.py).
`encode(text)` equals transformers' `tokenizer(text).input_ids`; `decode` equals `tokenizer.decode`
(without `clean_up_tokenization_spaces`, which would make streamed and whole-sequence text differ).

A rendered chat prompt usually contains the BOS token already (Llama templates write `{{ bos_token }}`),
so encode it with `add_special_tokens=False`, as transformers' `apply_chat_template(tokenize=True)` does.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional

from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelLoadError
from .chat_template import (CHATML_TEMPLATE, ChatTemplateError, ChatTemplateSecurityError,
                            render_chat_template)
from .detokenizer import IncrementalDetokenizer
from .gguf_vocab import build_from_gguf_metadata

__all__ = ["Tokenizer", "IncrementalDetokenizer", "ChatTemplateError", "ChatTemplateSecurityError",
           "CHATML_TEMPLATE"]

log = logging.getLogger("corelm.tokenizer")

# Special tokens that end an assistant turn in common chat formats; generation should stop on them
# even where the model's eos is a different token (llama.cpp keeps a similar end-of-generation list).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                      "<|endoftext|>", "<|end_of_text|>")

_MAX_JSON_BYTES = 256 << 20     # the largest real tokenizer.json files are ~35 MB


class Tokenizer:
    """See the module docstring. Build with `from_hf_folder` or `from_gguf_metadata`."""

    def __init__(self, backend: HFTokenizer, *, bos_token_id: Optional[int] = None,
                 eos_token_id: Optional[int] = None, extra_eos_ids: Iterable[int] = (),
                 add_bos_token: Optional[bool] = None, chat_template: Optional[str] = None,
                 named_chat_templates: Optional[Dict[str, str]] = None, vocab_size: Optional[int] = None):
        # A tokenizer.json may enable truncation or padding; transformers turns both off for a plain
        # `tokenizer(text)` call, and a silently truncated prompt would be a nasty surprise.
        backend.no_truncation()
        backend.no_padding()
        self._tk = backend
        self.vocab_size: int = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True))
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._byte_fallback_ids = _byte_fallback_ids(backend)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids: List[int] = self._end_token_ids(extra_eos_ids)
        # Whether the backend's post-processor (HF TemplateProcessing) already adds BOS; encode() adds
        # or removes it so that the result follows add_bos_token either way.
        self._post_processor_adds_bos = self._detect_post_processor_bos()
        self.add_bos_token: bool = self._post_processor_adds_bos if add_bos_token is None else bool(add_bos_token)
        if self.add_bos_token and bos_token_id is None:
            log.warning("add_bos_token is set but the tokenizer has no BOS token; no BOS will be added")
            self.add_bos_token = False
        self.chat_template: Optional[str] = chat_template
        self.named_chat_templates: Dict[str, str] = dict(named_chat_templates or {})

    # -----------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def from_hf_folder(cls, folder: str) -> "Tokenizer":
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"{folder}: no tokenizer.json (corelm reads the fast-tokenizer file; a folder "
                                 f"with only tokenizer.model can be converted by saving it with transformers)")
        raw = _read_text(path, _MAX_JSON_BYTES)
        _validate_tokenizer_json(_parse_json(raw, path), path)
        try:
            backend = HFTokenizer.from_str(raw)
        except Exception as e:     # tokenizers raises its own Exception type with a terse message
            raise ModelLoadError(f"{path}: the tokenizers library rejected the file: {e}") from None
        config = _read_optional_json(os.path.join(folder, "tokenizer_config.json"))
        special_map = _read_optional_json(os.path.join(folder, "special_tokens_map.json"))

        def token_id(name: str) -> Optional[int]:
            content = _token_content(config.get(name, special_map.get(name)), name)
            if content is None:
                return None
            tid = backend.token_to_id(content)
            if tid is None:
                raise ModelLoadError(f"{folder}: {name} {content!r} is not in the vocabulary of tokenizer.json")
            return tid

        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ModelLoadError(f"{folder}: tokenizer_config.json add_bos_token must be true or false")
        default, named = _chat_templates(folder, config)
        return _self_tested(lambda: cls(backend, bos_token_id=token_id("bos_token"),
                                        eos_token_id=token_id("eos_token"), add_bos_token=add_bos,
                                        chat_template=default, named_chat_templates=named), path)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        v = build_from_gguf_metadata(meta)
        return _self_tested(lambda: cls(v.backend, bos_token_id=v.bos_token_id, eos_token_id=v.eos_token_id,
                                        extra_eos_ids=v.extra_eos_ids, add_bos_token=v.add_bos_token,
                                        chat_template=v.chat_template, named_chat_templates=v.named_chat_templates,
                                        vocab_size=len(v.tokens)), "the GGUF tokenizer metadata")

    # -----------------------------------------------------------------------------------------
    # Encoding and decoding

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token != self._post_processor_adds_bos:
            ids = [self.bos_token_id] + ids if self.add_bos_token else ids[1:]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]     # accepts numpy integers
        if any(i < 0 for i in ids):
            raise ValueError(f"token ids must be non-negative, got {min(ids)}")
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def is_byte_fallback(self, token_id: int) -> bool:
        """True for SentencePiece <0xNN> tokens when the decoder joins runs of them (ByteFallback)."""
        return token_id in self._byte_fallback_ids

    def is_byte_level(self) -> bool:
        """True when the decoder is GPT-2's ByteLevel: token strings then spell bytes with
        bytes_to_unicode's characters (the OpenAI API's logprob `bytes` need the real bytes)."""
        try:
            return '"ByteLevel"' in json.dumps(json.loads(self._tk.to_str()).get("decoder"))
        except (ValueError, AttributeError):
            return False

    def to_json_str(self) -> str:
        """The HF `tokenizers` JSON of this tokenizer (what grammar engines such as llguidance read)."""
        return self._tk.to_str()

    def save(self, path: str) -> None:
        """Writes the tokenizer as an HF tokenizer.json (a GGUF's vocabulary included)."""
        self._tk.save(path)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tk.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tk.token_to_id(token)

    @property
    def bos_token(self) -> Optional[str]:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> Optional[str]:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    # -----------------------------------------------------------------------------------------
    # Chat

    def apply_chat_template(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, **kwargs: Any) -> str:
        """Render `messages` with `chat_template` (a template string, or the name of one of the model's
        named templates), else the model's template, else ChatML (with a warning). Extra kwargs (tools,
        documents, enable_thinking, ...) are passed to the template. Raises ChatTemplateError (a
        ValueError) when the template is malformed, unsafe, or rejects the conversation."""
        template = self.named_chat_templates.get(chat_template, chat_template) if chat_template else None
        template = template or self.chat_template
        if template is None:
            log.warning("the model has no chat template; using ChatML (<|im_start|>role ... <|im_end|>)")
            template = CHATML_TEMPLATE
        special = {name: tok for name, tok in (("bos_token", self.bos_token), ("eos_token", self.eos_token))
                   if tok is not None}
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=special, **kwargs)

    # -----------------------------------------------------------------------------------------

    def _end_token_ids(self, extra: Iterable[int]) -> List[int]:
        ids = [self.eos_token_id] if self.eos_token_id is not None else []
        ids += [int(i) for i in extra]
        ids += [self._tk.token_to_id(t) for t in END_OF_TURN_TOKENS]
        out: List[int] = []
        for i in ids:
            if i is not None and i not in out and (i == self.eos_token_id or i in self._special_ids):
                out.append(i)
        return out

    def _detect_post_processor_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        with_special = self._tk.encode("a", add_special_tokens=True).ids
        without = self._tk.encode("a", add_special_tokens=False).ids
        return with_special[:1] == [self.bos_token_id] and with_special[1:1 + len(without)] == without

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"add_bos_token={self.add_bos_token}, chat_template={'yes' if self.chat_template else 'no'})")


_SELF_TEST_TEXT = "Hello, world! 123 \u00e9\u4e16 \U0001F600"


def _self_tested(make, source: str) -> "Tokenizer":
    """make() (construction encodes too), then one encode and decode: the tokenizers library panics
    (pyo3's PanicException, a BaseException that passes every `except Exception`) on some broken files
    only when it first encodes, e.g. a post_processor naming a token it does not define. Such a file must
    fail at load with a ModelLoadError, not later in a serving worker."""
    try:
        tok = make()
        tok.decode(tok.encode(_SELF_TEST_TEXT, add_special_tokens=True), skip_special_tokens=False)
        return tok
    except Exception:
        raise
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise ModelLoadError(f"{source}: the tokenizer is broken: the tokenizers library panicked on a test "
                             f"encode ({str(e).strip() or 'no message'})") from None


def _byte_fallback_ids(backend: HFTokenizer) -> frozenset:
    decoder = backend.decoder
    if decoder is None or b"ByteFallback" not in decoder.__getstate__():
        return frozenset()
    pattern = re.compile(r"<0x[0-9A-Fa-f]{2}>")
    return frozenset(i for t, i in backend.get_vocab().items() if pattern.fullmatch(t))


# ---------------------------------------------------------------------------------------------
# HF folder helpers

def _read_text(path: str, limit: int) -> str:
    try:
        size = os.path.getsize(path)
        if size > limit:
            raise ModelLoadError(f"{path} is {size} bytes, over the {limit}-byte limit")
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path} is not valid UTF-8: {e}") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def _parse_json(raw: str, path: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def _read_optional_json(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    data = _parse_json(_read_text(path, _MAX_JSON_BYTES), path)
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _validate_tokenizer_json(data: Any, path: str) -> None:
    """Structure and id checks with readable messages; the tokenizers library catches the rest."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ModelLoadError(f"{path}: not a tokenizer.json (expected an object with a 'model' object)")
    vocab = data["model"].get("vocab")
    if isinstance(vocab, dict):
        bad = next((v for v in vocab.values() if not isinstance(v, int) or isinstance(v, bool) or v < 0), None)
        if bad is not None:
            raise ModelLoadError(f"{path}: model.vocab holds an invalid token id {bad!r}")
        n_model = max(vocab.values(), default=-1) + 1
    elif isinstance(vocab, list):       # Unigram: [[piece, score], ...]
        n_model = len(vocab)
    else:
        raise ModelLoadError(f"{path}: model.vocab is missing or has the wrong type")
    added = data.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(t, dict) for t in added):
        raise ModelLoadError(f"{path}: added_tokens must be a list of objects")
    limit = n_model + len(added)        # added tokens extend the model vocabulary, without big gaps
    for t in added:
        tid, content = t.get("id"), t.get("content")
        if not isinstance(content, str) or not isinstance(tid, int) or isinstance(tid, bool):
            raise ModelLoadError(f"{path}: added token {t!r} needs an integer 'id' and a string 'content'")
        if not 0 <= tid < limit:
            raise ModelLoadError(f"{path}: added token {content!r} has id {tid}, out of range "
                                 f"for a vocabulary of {n_model} tokens plus {len(added)} added")
    _validate_post_processor(data.get("post_processor"), path)


def _validate_post_processor(pp: Any, path: str) -> None:
    """A TemplateProcessing post_processor must define every special token its templates name (the
    tokenizers library panics on the first encode otherwise), with integer ids."""
    if not isinstance(pp, dict):
        return
    if pp.get("type") == "Sequence":
        for p in pp.get("processors") or []:
            _validate_post_processor(p, path)
        return
    if pp.get("type") != "TemplateProcessing":
        return
    special = pp.get("special_tokens")
    if not isinstance(special, dict):
        raise ModelLoadError(f"{path}: post_processor.special_tokens must be an object")
    for key, tok in special.items():
        ids = tok.get("ids") if isinstance(tok, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids):
            raise ModelLoadError(f"{path}: post_processor.special_tokens[{key!r}] needs a list of token ids")
    for which in ("single", "pair"):
        for piece in pp.get(which) or []:
            name = piece.get("SpecialToken", {}).get("id") if isinstance(piece, dict) and \
                isinstance(piece.get("SpecialToken"), dict) else None
            if name is not None and name not in special:
                raise ModelLoadError(f"{path}: post_processor template {which!r} names the special token "
                                     f"{name!r}, which post_processor.special_tokens does not define")


def _token_content(value: Any, name: str) -> Optional[str]:
    """tokenizer_config.json writes special tokens as "<s>" or as {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value or None
    raise ModelLoadError(f"tokenizer_config.json {name} must be a string or an object with 'content'")


def _chat_templates(folder: str, config: Dict[str, Any]):
    """(default template, {name: template}). chat_template.jinja next to the config wins, as in
    transformers; the config's chat_template is a string or a list of {"name", "template"}."""
    value = config.get("chat_template")
    named: Dict[str, str] = {}
    if isinstance(value, list):
        for item in value:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ModelLoadError(f"{folder}: tokenizer_config.json chat_template list entries need "
                                     f"'name' and 'template' strings")
            named[item["name"]] = item["template"]
        value = named.get("default")
    elif value is not None and not isinstance(value, str):
        raise ModelLoadError(f"{folder}: tokenizer_config.json chat_template must be a string or a list")
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        value = _read_text(jinja_path, 16 << 20)
    return value or None, named
