"""BERT encoders end to end below the engine: tests/data/models/tiny-bert (tools/fixtures/make_tiny_models.py)
and its GGUF written by llama.cpp's converter (tiny-bert.f32.gguf, tools/fixtures/make_family_gguf.py) loaded
by corelm.loader, run by the core's hidden_batch, pooled as the folder's sentence-transformers modules (the
GGUF's pooling_type) say, and compared with sentence-transformers' and transformers' outputs on awkward texts
(tests/data/fixtures/tiny-bert-embeddings.json, tools/fixtures/make_embedding_fixtures.py)."""
import json
import os

import numpy as np
import pytest

from conftest import FIXTURES, MODELS
from test_tokenizer import TRICKY

from corelm.engine.model_builder import KV_BLOCK_SIZE, build_core_model
from corelm.loader import ModelLoadError, load_model
from corelm.loader.gguf import read_gguf, spec_from_gguf
from corelm.tokenizer import Tokenizer

TINY_BERT = os.path.join(MODELS, "tiny-bert")
TINY_BERT_GGUF = os.path.join(TINY_BERT, "tiny-bert.f32.gguf")
with open(os.path.join(FIXTURES, "tiny-bert-embeddings.json"), encoding="utf-8") as _f:
    FIXTURE = json.load(_f)
EMBEDDINGS = np.load(os.path.join(FIXTURES, FIXTURE["embeddings"]))
HIDDEN = np.load(os.path.join(FIXTURES, FIXTURE["hidden"]))
TEXTS, IDS = FIXTURE["texts"], FIXTURE["ids"]

# fp32 sums in another order than torch; bf16 rounds every weight matrix (positions and token types stay fp32)
HIDDEN_TOL = {"fp32": 1e-5, "bf16": 0.05}
MIN_COSINE = {"fp32": 0.9999, "bf16": 0.999}


@pytest.fixture(scope="module")
def hf_model():
    return load_model(TINY_BERT)


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def core(request, hf_model):
    return request.param, build_core_model(hf_model, dtype=request.param, threads=2)


def hidden_states(model, seqs):
    """Every sequence's final hidden states from one hidden_batch call, each sequence in its own KV blocks."""
    entries, first = [], 0
    for ids in seqs:
        n_blocks = -(-len(ids) // KV_BLOCK_SIZE)
        entries.append((len(ids), 0, np.arange(first, first + n_blocks, dtype=np.int32), False))
        first += n_blocks
    out = model.hidden_batch(np.concatenate([np.asarray(s, np.int32) for s in seqs]), entries)
    return np.split(out, np.cumsum([len(s) for s in seqs])[:-1])


def pool(hidden, pooling, normalize):
    e = {"mean": lambda h: h.mean(0), "cls": lambda h: h[0], "last": lambda h: h[-1]}[pooling](hidden)
    return e / np.linalg.norm(e) if normalize else e


def cosine(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_the_folder_declares_mean_pooling_and_normalize(hf_model):
    spec = hf_model.spec
    assert (spec.arch, spec.encoder, spec.pooling, spec.normalize) == ("bert", True, "mean", True)
    assert (spec.type_vocab_size, spec.max_position_embeddings, spec.activation) == (2, 128, "gelu")
    assert (FIXTURE["pooling"], FIXTURE["normalize"]) == ("mean", True)


@pytest.fixture(scope="module")
def gguf_model():
    return load_model(TINY_BERT_GGUF)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_tokenization_equals_transformers(source, request):
    tok = request.getfixturevalue(f"{source}_model").tokenizer
    for text, ids in zip(TEXTS, IDS):
        assert tok.encode(text) == ids, text
        assert tok.encode(text, add_special_tokens=False) == ids[1:-1], text
    assert any(tok.id_to_token(i) == "[UNK]" for ids in IDS for i in ids)      # the emoji
    assert max(len(ids) for ids in IDS) > 96                                    # a long text near the 128 positions


def test_hidden_states_and_embeddings_match_sentence_transformers(hf_model, core):
    dtype, model = core
    spec = hf_model.spec
    for k, ids in enumerate(IDS):
        (h,) = hidden_states(model, [ids])
        assert h.shape == (len(ids), spec.hidden_size)
        if k == FIXTURE["hidden_text"]:
            err = float(np.abs(h - HIDDEN).max())
            assert err < HIDDEN_TOL[dtype], f"{dtype}: hidden states differ by {err}"
        e = pool(h, spec.pooling, spec.normalize)
        assert abs(float(np.linalg.norm(e)) - 1) < 1e-5
        cos = cosine(e, EMBEDDINGS[k])
        assert cos >= MIN_COSINE[dtype], f"{dtype}: text {k} {TEXTS[k]!r}: cosine {cos}"


def test_a_batch_of_sequences_equals_one_at_a_time(core):
    """Bidirectional attention stays inside each sequence: batched with others (in any order), a text's hidden
    states are those it has alone. Not to the bit: float matmuls may sum a tail row in another order (1e-6,
    as a decoder's fp32 prefill; the bit-exact promise is the quantized formats'), where seeing another
    sequence's tokens would move them by tenths."""
    _, model = core
    alone = [hidden_states(model, [ids])[0] for ids in IDS]
    order = [3, 0, 5, 1, 4, 2]
    batched = hidden_states(model, [IDS[k] for k in order])
    for k, h in zip(order, batched):
        np.testing.assert_allclose(h, alone[k], rtol=0, atol=2e-5, err_msg=TEXTS[k])


# ---------------------------------------------------------------------------------------------------
# The GGUF llama.cpp's converter wrote: WordPiece stored with phantom spaces, LayerNorm's epsilon, the pooling
# type from modules.json, token types, and BERT's tensor names


def test_gguf_gives_the_folders_model(hf_model, gguf_model):
    hf, gg = hf_model.spec, gguf_model.spec
    for field in ("arch", "encoder", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings", "type_vocab_size", "attention_bias",
                  "activation", "pooling", "normalize"):
        assert getattr(gg, field) == getattr(hf, field), field
    assert gg.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)     # stored as float32
    assert sorted(gguf_model.weight_names()) == sorted(hf_model.weight_names())
    for name in hf_model.weight_names():
        np.testing.assert_array_equal(gguf_model.get_weight(name), hf_model.get_weight(name), err_msg=name)


@pytest.mark.parametrize("text", TRICKY + TEXTS)
def test_gguf_wordpiece_encodes_and_decodes_like_the_folders(hf_model, gguf_model, text):
    hf, gg = hf_model.tokenizer, gguf_model.tokenizer
    assert gg.encode(text) == hf.encode(text)
    ids = hf.encode(text)
    assert gg.decode(ids) == hf.decode(ids)
    assert gg.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_gguf_embeddings_match_sentence_transformers(gguf_model):
    model = build_core_model(gguf_model, dtype="fp32", threads=2)
    spec = gguf_model.spec
    for k, h in enumerate(hidden_states(model, IDS)):
        if k == FIXTURE["hidden_text"]:
            assert float(np.abs(h - HIDDEN).max()) < HIDDEN_TOL["fp32"]
        assert cosine(pool(h, spec.pooling, spec.normalize), EMBEDDINGS[k]) >= MIN_COSINE["fp32"]


@pytest.fixture
def gguf_file():
    return read_gguf(TINY_BERT_GGUF)      # its metadata edited in memory by each test


@pytest.mark.parametrize("kind, pooling", [(0, None), (1, "mean"), (2, "cls"), (3, "last")])
def test_gguf_pooling_type(gguf_file, kind, pooling):
    gguf_file.metadata["bert.pooling_type"] = kind
    assert spec_from_gguf(gguf_file).pooling == pooling


@pytest.mark.parametrize("key, value, message", [
    ("bert.pooling_type", 4, "pooling_type = 4 is not supported"),           # rank: a reranker's head
    ("bert.attention.causal", True, "causal is true"),
    ("tokenizer.ggml.token_type_count", 0, "type_vocab_size = 0"),
])
def test_gguf_encoder_metadata_corelm_cannot_run_is_refused(gguf_file, key, value, message):
    gguf_file.metadata[key] = value
    with pytest.raises(ModelLoadError, match=message):
        spec_from_gguf(gguf_file)


def test_gguf_wordpiece_follows_the_normalizer_keys():
    """Cased files keep case (and accents); a file written before the keys existed lowercases, as llama.cpp
    then always did; [CLS] and [SEP] are the file's ids."""
    meta = dict(read_gguf(TINY_BERT_GGUF).metadata)
    text = "Harbour Café"
    lower = Tokenizer.from_gguf_metadata(meta)
    assert lower.decode(lower.encode(text)) == "harbour cafe"
    cls, unk, sep = 2, 1, 3
    cased = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.normalizer.lowercase": False})
    assert cased.encode(text) == [cls, unk, unk, sep]      # the vocabulary has no capitals, nor "é"
    assert cased.encode("harbour cafe") == lower.encode(text)
    accents = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.normalizer.strip_accents": False})
    assert accents.encode(text) == lower.encode("harbour")[:-1] + [unk, sep]
    old = {k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.normalizer.")}
    assert Tokenizer.from_gguf_metadata(old).encode(text) == lower.encode(text)
    swapped = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.bos_token_id": 4})
    assert swapped.encode("a")[0] == 4
    # without the keys, llama.cpp's defaults (BERT's 101 and 102), which a 100-token vocabulary lacks
    small = {k: v[:100] if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") else v for k, v in meta.items()
             if k not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.seperator_token_id")}
    with pytest.raises(ModelLoadError, match="no \\[CLS\\] or \\[SEP\\]"):
        Tokenizer.from_gguf_metadata(small)
