"""BERT encoders end to end below the engine: tests/data/models/tiny-bert (tools/fixtures/make_tiny_models.py)
loaded by corelm.loader, run by the core's hidden_batch, pooled as its sentence-transformers modules say, and
compared with sentence-transformers' and transformers' outputs on awkward texts
(tests/data/fixtures/tiny-bert-embeddings.json, tools/fixtures/make_embedding_fixtures.py)."""
import json
import os

import numpy as np
import pytest

from conftest import FIXTURES, MODELS

from corelm.engine.model_builder import KV_BLOCK_SIZE, build_core_model
from corelm.loader import load_model

TINY_BERT = os.path.join(MODELS, "tiny-bert")
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


def test_tokenization_equals_transformers(hf_model):
    tok = hf_model.tokenizer
    for text, ids in zip(TEXTS, IDS):
        assert tok.encode(text) == ids, text
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
