"""IncrementalDetokenizer: streamed text == whole-sequence decode, and never half a character."""
import os
import random

import numpy as np
import pytest

from corelm.loader.gguf import read_gguf
from corelm.tokenizer import Tokenizer

from conftest import MODELS, real_model

STORIES_DIR = os.path.join(MODELS, "stories260K")

TEXTS = [
    "Hello world", "  two  spaces  ", "line one\nline two\n\n", "Café déjà vu, naïve résumé, Ångström",
    "日本語のテキストです", "中文字符串测试，世界", "한국어 문장", "Привет, мир", "مرحبا بالعالم",
    "😀😃😄 emoji 👍🏽 family 👨‍👩‍👧 flag 🇫🇷", "mixed 日本 and 😀 and é", "a\u0301 combining", "zero\u200bwidth",
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
]


def _stories_hf():
    return Tokenizer.from_hf_folder(STORIES_DIR)


def _stories_gguf():
    return Tokenizer.from_gguf_metadata(read_gguf(os.path.join(STORIES_DIR, "stories260K.gguf")).metadata)


def _smollm2():
    return Tokenizer.from_gguf_metadata(read_gguf(real_model("SmolLM2-135M-Instruct.Q4_1.gguf")).metadata)


_CACHE = {}


@pytest.fixture(params=["stories-hf", "stories-gguf", "smollm2-gguf"])
def tok(request):
    """SentencePiece with <0xNN> byte fallback (stories260K, both sources) and byte-level BPE (SmolLM2)."""
    builders = {"stories-hf": _stories_hf, "stories-gguf": _stories_gguf, "smollm2-gguf": _smollm2}
    if request.param not in _CACHE:
        _CACHE[request.param] = builders[request.param]()
    return _CACHE[request.param]


def stream(tok, ids, skip_special_tokens=True):
    d = tok.detokenizer(skip_special_tokens=skip_special_tokens)
    chunks = [d.add(i) for i in ids]
    chunks.append(d.flush())
    assert d.text == "".join(chunks)
    return chunks


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_and_never_breaks_a_character(tok, text):
    ids = tok.encode(text)
    chunks = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids)
    assert not any("\ufffd" in c for c in chunks), chunks
    if not tok.is_byte_fallback(ids[-1]):
        assert chunks[-1] == ""         # nothing was left pending at the end of valid text


def test_multibyte_characters_really_are_split_across_tokens(tok):
    """The texts above exercise the hold-back path: some characters span several tokens."""
    split = [t for t in TEXTS if any("\ufffd" in tok.decode([i]) for i in tok.encode(t))]
    assert split


def _byte_ids(tok, data):
    return [tok.token_to_id(f"<0x{b:02X}>") for b in data]


def test_byte_fallback_tokens_are_held_until_the_run_closes():
    tok = _stories_gguf()
    d = tok.detokenizer()
    assert [d.add(i) for i in _byte_ids(tok, "日".encode())] == ["", "", ""]
    assert d.add(tok.token_to_id("▁the")) == "日 the"
    assert d.flush() == "" and d.text == "日 the"
    d = tok.detokenizer()
    assert [d.add(i) for i in _byte_ids(tok, "é".encode())] == ["", ""]
    assert d.flush() == "é"


def test_stray_byte_after_a_complete_run_matches_full_decode():
    """ByteFallback turns every byte of an invalid run into U+FFFD, even the valid ones before it."""
    tok = _stories_gguf()
    ids = _byte_ids(tok, b"&\xb2") + [tok.token_to_id("▁the")]
    assert tok.decode(ids) == "\ufffd\ufffd the"
    assert "".join(stream(tok, ids)) == "\ufffd\ufffd the"


def test_truly_invalid_tail_becomes_replacement_character_on_flush(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])][:1]     # the first piece of the emoji
    assert partial, "the emoji should span more than one token"
    d = tok.detokenizer()
    head = "".join(d.add(i) for i in ids[:ids.index(partial[0]) + 1])
    assert "\ufffd" not in head
    assert d.flush().endswith("\ufffd")
    assert d.text == tok.decode(ids[:ids.index(partial[0]) + 1])


def test_special_tokens(tok):
    eos = tok.eos_token_id
    ids = tok.encode("Hello") + [eos] + tok.encode(" world", add_special_tokens=False) + [eos]
    assert "".join(stream(tok, ids)) == tok.decode(ids) == tok.decode([i for i in ids if not tok.is_special(i)])
    with_special = "".join(stream(tok, ids, skip_special_tokens=False))
    assert with_special == tok.decode(ids, skip_special_tokens=False)
    assert tok.eos_token in with_special


def test_random_token_sequences_match_full_decode(tok):
    """Arbitrary id sequences, including stray byte tokens that form invalid UTF-8, still add up."""
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 24))]
        for skip in (True, False):
            assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip), ids


def test_accepts_numpy_ids(tok):
    ids = np.array(tok.encode("Hello 😀 world"), dtype=np.int32)
    assert "".join(stream(tok, ids)) == tok.decode(ids.tolist())


def _longest_byte_run(tok, ids):
    longest = run = 0
    for i in ids:
        run = run + 1 if tok.is_byte_fallback(i) else 0
        longest = max(longest, run)
    return longest


def test_work_per_token_stays_bounded(tok, monkeypatch):
    """Each step decodes a short window, not the whole sequence (amortized O(1) per token); only a
    run of SentencePiece byte tokens, held until it closes, widens it."""
    text = " ".join(TEXTS) * 8
    ids = tok.encode(text)
    assert len(ids) > 500
    sizes = []
    real_decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, skip_special_tokens=True: (
        sizes.append(len(ids)), real_decode(ids, skip_special_tokens))[1])
    d = tok.detokenizer()
    for i in ids:
        d.add(i)
    d.flush()
    monkeypatch.undo()
    assert d.text == tok.decode(ids)
    assert max(sizes) <= 8 + _longest_byte_run(tok, ids)
    assert len(ids) > 10 * (8 + _longest_byte_run(tok, ids))
