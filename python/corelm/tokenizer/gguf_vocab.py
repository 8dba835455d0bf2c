"""Build a `tokenizers.Tokenizer` from GGUF metadata, equivalent to the model's HF tokenizer.json.

GGUF stores the vocabulary the way llama.cpp uses it (llama-vocab.cpp):
  tokenizer.ggml.model       "gpt2" (byte-level BPE) | "llama" (SentencePiece BPE with byte fallback) |
                             "bert" (WordPiece, stored with llama.cpp's phantom spaces: see _wordpiece)
  tokenizer.ggml.tokens      token strings, index = id
  tokenizer.ggml.scores      SentencePiece scores (merge priority for "llama")
  tokenizer.ggml.token_type  1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
  tokenizer.ggml.merges      "left right" strings for "gpt2", in rank order
  tokenizer.ggml.pre         which pre-tokenizer regex a "gpt2" vocabulary was trained with
We rebuild what transformers would put in tokenizer.json so that ids match `transformers` exactly,
not llama.cpp's hand-ported regexes.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelLoadError

log = logging.getLogger("corelm.tokenizer")

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_MAX_VOCAB = 4_000_000          # far above any real vocabulary; stops absurd allocations early

# Pre-tokenizer regexes as written in the HF tokenizer.json files (tokenizers uses Oniguruma, so the
# original `(?i:...)` forms work; llama.cpp had to rewrite them).
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> family; names follow llama.cpp's table. An unknown name is an error, as in
# llama.cpp: silently using the wrong regex gives plausible-looking but wrong token ids.
_PRE_FAMILIES = {
    "gpt2": ("gpt2", "gpt-2", "default", "phi-2", "mpt", "olmo"),
    "digits": ("smollm", "starcoder", "refact", "codeshell", "command-r"),
    "llama3": ("llama3", "llama-v3", "llama-bpe", "falcon3"),
    "cl100k": ("dbrx", "smaug-bpe"),
    "qwen2": ("qwen2", "deepseek-r1-qwen"),
}
_PRE_TO_FAMILY = {name: fam for fam, names in _PRE_FAMILIES.items() for name in names}


@dataclass
class GGUFVocab:
    """What `Tokenizer.from_gguf_metadata` needs besides the backend."""
    backend: HFTokenizer
    tokens: List[str]
    bos_token_id: Optional[int]
    eos_token_id: Optional[int]
    extra_eos_ids: List[int]        # tokenizer.ggml.eot_token_id / eom_token_id when present
    add_bos_token: bool
    chat_template: Optional[str]
    named_chat_templates: Dict[str, str]     # tokenizer.chat_template.<name>, e.g. "tool_use"


def build_from_gguf_metadata(meta: Dict[str, Any]) -> GGUFVocab:
    if not hasattr(meta, "get"):
        raise ModelLoadError(f"GGUF metadata must be a dict, got {type(meta).__name__}")
    kind = _get_str(meta, "tokenizer.ggml.model")
    if kind is None:
        raise ModelLoadError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
    tokens = _token_list(meta)
    n = len(tokens)
    types = _int_list(meta, "tokenizer.ggml.token_type", n, default=TOKEN_NORMAL)
    special_ids = {k: _token_id(meta, f"tokenizer.ggml.{k}_token_id", n)
                   for k in ("bos", "eos", "unknown", "eot", "eom")}

    if kind == "gpt2":
        pre = _get_str(meta, "tokenizer.ggml.pre") or "default"
        backend = _byte_level_bpe(tokens, meta, pre,
                                  add_prefix_space=_get_bool(meta, "tokenizer.ggml.add_space_prefix", False))
        add_bos_default = _PRE_TO_FAMILY.get(pre) == "llama3"   # llama.cpp does the same
    elif kind == "llama":
        scores = _float_list(meta, "tokenizer.ggml.scores", n)
        backend = _sentencepiece_bpe(tokens, scores, types, special_ids["unknown"],
                                     add_space_prefix=_get_bool(meta, "tokenizer.ggml.add_space_prefix", True))
        add_bos_default = True
    elif kind == "bert":
        backend = _wordpiece(tokens, types, meta, special_ids["unknown"])
        add_bos_default = True
    else:
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama', "
                             f"'bert')")

    _add_special_tokens(backend, tokens, types)
    template = _get_str(meta, "tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = {k[len(prefix):]: _get_str(meta, k) for k in meta if isinstance(k, str) and k.startswith(prefix)}
    return GGUFVocab(
        backend=backend, tokens=tokens,
        bos_token_id=special_ids["bos"], eos_token_id=special_ids["eos"],
        extra_eos_ids=[i for i in (special_ids["eot"], special_ids["eom"]) if i is not None],
        # llama.cpp starts every WordPiece input with [CLS], whatever add_bos_token says
        add_bos_token=kind == "bert" or _get_bool(meta, "tokenizer.ggml.add_bos_token", add_bos_default),
        chat_template=template or None, named_chat_templates=named,
    )


# ---------------------------------------------------------------------------------------------
# The two vocabulary kinds

def _byte_level_bpe(tokens: List[str], meta, pre: str, add_prefix_space: bool) -> HFTokenizer:
    family = _PRE_TO_FAMILY.get(pre)
    if family is None:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported "
                             f"(supported: {', '.join(sorted(_PRE_TO_FAMILY))})")
    if pre == "default":
        log.warning("GGUF has no specific pre-tokenizer ('default'); using GPT-2's. Token ids may differ "
                    "from the original model's tokenizer.")
    # Llama 3's tokenizer.json sets ignore_merges: a word that is itself a token is not re-merged.
    raw, vocab = _merge_strings(meta), _vocab_dict(tokens)
    try:    # the usual file: BPE checks every merge's tokens itself, in Rust (150k merges: 0.2 s less)
        model = models.BPE(vocab, [tuple(m.split(" ", 1)) for m in raw], ignore_merges=(family == "llama3"))
    except Exception:        # bytes, or a bad merge: checked here, which names it
        try:
            model = models.BPE(vocab, _checked_merges(raw, tokens), ignore_merges=(family == "llama3"))
        except Exception as e:
            raise ModelLoadError(f"GGUF key tokenizer.ggml.merges is not usable: {e}") from None
    tk = HFTokenizer(model)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)
    if family == "gpt2":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    elif family == "digits":      # SmolLM, StarCoder: every digit on its own, then GPT-2 splitting
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)])
    else:
        regex = _QWEN2_REGEX if family == "qwen2" else _LLAMA3_REGEX
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False), byte_level])
        if family == "qwen2":     # Qwen2's tokenizer.json normalizes to NFC first
            tk.normalizer = normalizers.NFC()
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(tokens: List[str], scores: List[float], types: List[int], unk_id: Optional[int],
                       add_space_prefix: bool) -> HFTokenizer:
    """The equivalent of transformers' LlamaConverter: BPE over "▁"-joined text with byte fallback."""
    unk = tokens[unk_id] if unk_id is not None else None
    vocab = _vocab_dict(tokens)
    model = models.BPE(vocab, sentencepiece_merges(tokens, scores, vocab), unk_token=unk,
                       fuse_unk=True, byte_fallback=True)
    tk = HFTokenizer(model)
    # Metaspace with prepend_scheme "first" is what current transformers writes for Llama/SentencePiece
    # (legacy=False): a "▁" goes before the first piece only, not after each special token, and not when
    # the text already starts with a space. It matches the model's own tokenizer.json id for id.
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    tk.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])])
    return tk


# llama.cpp's defaults for a "bert" vocabulary's [CLS] and [SEP] (BERT's own ids)
_BERT_CLS_ID, _BERT_SEP_ID = 101, 102


def _wordpiece(tokens: List[str], types: List[int], meta, unk_id: Optional[int]) -> HFTokenizer:
    """The equivalent of BERT's tokenizer.json: WordPiece with "##" continuations, BERT's normalizer and
    pre-tokenizer, "[CLS] $A [SEP]". llama.cpp's converter stored each word-initial piece with a leading "▁"
    (its phantom space) and each "##" continuation bare, special tokens as they are; this undoes that.
    Lowercasing (and accent stripping, which follows it unless the file says) is the file's
    tokenizer.ggml.normalizer.* keys; a file written before those keys existed means lowercase, which
    llama.cpp then always did."""
    pieces = [t[1:] or t if t.startswith("\u2581") else t if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN) else "##" + t
              for t, ty in zip(tokens, types)]
    n = len(tokens)
    cls_id, sep_id = (_token_id(meta, key, n) for key in ("tokenizer.ggml.bos_token_id",
                                                           "tokenizer.ggml.seperator_token_id"))
    cls_id = _BERT_CLS_ID if cls_id is None else cls_id
    sep_id = _BERT_SEP_ID if sep_id is None else sep_id
    if max(cls_id, sep_id) >= n:
        raise ModelLoadError(f"GGUF 'bert' vocabulary of {n} tokens has no [CLS] or [SEP] (ids {cls_id} and "
                             f"{sep_id}; keys tokenizer.ggml.bos_token_id, tokenizer.ggml.seperator_token_id)")
    unk = pieces[unk_id] if unk_id is not None else "[UNK]"
    tk = HFTokenizer(models.WordPiece(_vocab_dict(pieces), unk_token=unk, continuing_subword_prefix="##",
                                      max_input_chars_per_word=100))
    strip = meta.get("tokenizer.ggml.normalizer.strip_accents")
    tk.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, lowercase=_get_bool(meta, "tokenizer.ggml.normalizer.lowercase", True),
        strip_accents=None if strip is None else _get_bool(meta, "tokenizer.ggml.normalizer.strip_accents", False))
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = pieces[cls_id], pieces[sep_id]
    tk.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1", special_tokens=[(cls, cls_id), (sep, sep_id)])
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tk


def sentencepiece_merges(tokens: List[str], scores: List[float],
                         ids: Dict[str, int]) -> List[Tuple[str, str]]:
    """SentencePiece BPE has no merge list: a pair merges when the joined piece is in the vocabulary,
    higher score first. Spell that out as ranked merges, in transformers' order (score, then the longer
    left piece, then the longer right piece; stable otherwise) so ties break exactly as there."""
    merges = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in ids and piece[k:] in ids]
        local.sort(key=lambda m: (ids[m[0]], ids[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tk: HFTokenizer, tokens: List[str], types: List[int]) -> None:
    """Control and unknown tokens are special (matched in raw text, skipped by skip_special_tokens);
    user-defined ones are matched in raw text but kept when decoding, as HF marks them special=False."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN) and t]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t]
    tk.add_special_tokens(special)
    tk.add_tokens(user)


# ---------------------------------------------------------------------------------------------
# Metadata access with validation: every failure is a ModelLoadError that names the key

def _as_list(value: Any) -> Optional[list]:
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):   # numpy array
        value = value.tolist()
    return list(value) if isinstance(value, (list, tuple)) else None


def _get_str(meta, key: str) -> Optional[str]:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bytes):
        value = _utf8(value, key)
    if not isinstance(value, str):
        raise ModelLoadError(f"GGUF key {key} must be a string, got {type(value).__name__}")
    return value


def _get_bool(meta, key: str, default: bool) -> bool:
    value = meta.get(key)
    if value is None:
        return default
    if hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise ModelLoadError(f"GGUF key {key} must be a bool, got {value!r}")
    return bool(value)


def _utf8(raw: bytes, key: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"GGUF key {key} holds invalid UTF-8: {e}") from None


def _token_list(meta) -> List[str]:
    key = "tokenizer.ggml.tokens"
    tokens = _as_list(meta.get(key))
    if not tokens:
        raise ModelLoadError(f"GGUF key {key} is missing or empty")
    if len(tokens) > _MAX_VOCAB:
        raise ModelLoadError(f"GGUF key {key} has {len(tokens)} entries, more than the {_MAX_VOCAB} allowed")
    if all(type(t) is str for t in tokens):   # as the GGUF reader gives them
        return list(tokens)
    out = []
    for i, t in enumerate(tokens):
        if isinstance(t, bytes):
            t = _utf8(t, f"{key}[{i}]")
        if not isinstance(t, str):
            raise ModelLoadError(f"GGUF key {key}[{i}] must be a string, got {type(t).__name__}")
        out.append(t)
    return out


def _int_list(meta, key: str, n: int, default: int) -> List[int]:
    values = _as_list(meta.get(key))
    if values is None:
        if key in meta:
            raise ModelLoadError(f"GGUF key {key} must be an array")
        return [default] * n
    if len(values) != n:
        raise ModelLoadError(f"GGUF key {key} has {len(values)} entries but there are {n} tokens")
    if not (set(map(type, values)) <= {int} and 0 <= min(values, default=0) and max(values, default=0) <= TOKEN_BYTE):
        bad = next(v for v in values if not (isinstance(v, int) and 0 <= v <= TOKEN_BYTE))
        raise ModelLoadError(f"GGUF key {key} holds an invalid token type {bad!r} (expected 0..6)")
    return values


def _float_list(meta, key: str, n: int) -> List[float]:
    values = _as_list(meta.get(key))
    if values is None:
        raise ModelLoadError(f"GGUF key {key} is missing; a SentencePiece ('llama') vocabulary needs scores")
    if len(values) != n:
        raise ModelLoadError(f"GGUF key {key} has {len(values)} entries but there are {n} tokens")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise ModelLoadError(f"GGUF key {key} holds a value that is not a finite number")
    return [float(v) for v in values]


def _token_id(meta, key: str, n: int) -> Optional[int]:
    value = meta.get(key)
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelLoadError(f"GGUF key {key} must be an integer, got {value!r}")
    if value in (-1, 0xFFFFFFFF):       # llama.cpp's "not set" (LLAMA_TOKEN_NULL written as uint32)
        return None
    if not 0 <= value < n:
        raise ModelLoadError(f"GGUF key {key} = {value} is out of range for a vocabulary of {n} tokens")
    return value


def _merge_strings(meta) -> list:
    raw = _as_list(meta.get("tokenizer.ggml.merges"))
    if raw is None:
        raise ModelLoadError("GGUF key tokenizer.ggml.merges is missing; a byte-level BPE ('gpt2') vocabulary "
                             "needs merges")
    return raw


def _checked_merges(raw: list, tokens: List[str]) -> List[Tuple[str, str]]:
    """(left, right) of each merge; a ModelLoadError names the first that is not "left right" of known
    tokens."""
    key = "tokenizer.ggml.merges"
    vocab = set(tokens)
    merges = []
    for i, m in enumerate(raw):
        if isinstance(m, bytes):
            m = _utf8(m, f"{key}[{i}]")
        left, sep, right = m.partition(" ") if isinstance(m, str) else ("", "", "")
        if not (sep and left and right):
            raise ModelLoadError(f"GGUF key {key}[{i}] = {m!r} is not of the form 'left right'")
        if left not in vocab or right not in vocab or left + right not in vocab:
            raise ModelLoadError(f"GGUF key {key}[{i}] = {m!r} refers to a token that is not in the vocabulary")
        merges.append((left, right))
    return merges


def _vocab_dict(tokens: List[str]) -> Dict[str, int]:
    """token -> id. A duplicated string keeps its first id and the later id decodes to nothing;
    warn because such a file is unusual."""
    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))  # the first id wins: written last
    if len(vocab) != len(tokens):
        log.warning("GGUF vocabulary has %d duplicated token strings; the first id of each is used",
                    len(tokens) - len(vocab))
    return vocab
