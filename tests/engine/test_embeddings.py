"""Embeddings from a decoder (LLM.embed, LLM.score, vLLM's pooling API): the hidden states hidden_batch gives
are the ones the logits come from (checked against forward_batch through the lm_head weights, not against
hidden_batch itself), pooling by last token or mean, normalization, dimensions, batching that changes
nothing, and clear errors for bad input."""
import os

import numpy as np
import pytest

import corelm
from corelm import PoolingParams
from corelm.engine.pooling import BATCH_TOKENS, cosine, pool
from conftest import MODELS

TEXTS = ["Once upon a time", "The little dog ran to the park and", "a", "Lily liked to play with her ball " * 6]


@pytest.fixture(scope="module")
def llm():
    return corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=2, max_seq_len=256)


def test_hidden_states_are_what_the_logits_are_made_of(llm):
    e = llm.engine
    ids = e.encode_embedding_input(TEXTS[1])
    blocks = np.arange(-(-len(ids) // e.core.kv_block_size), dtype=np.int32)
    hidden = e.core.hidden_batch(np.array(ids, np.int32), [(len(ids), 0, blocks, False)])
    logits = e.core.forward_batch(np.array(ids, np.int32), [(len(ids), 0, blocks, True)])
    head = e.loaded.get_weight("tok_embeddings" if e.spec.tie_word_embeddings else "lm_head")
    np.testing.assert_allclose(hidden @ head.T, logits, rtol=1e-4, atol=1e-4)


def test_embed_pools_the_last_token_normalized(llm):
    e = llm.engine
    out = llm.embed(TEXTS)
    assert [o.prompt_token_ids for o in out] == [e.encode_embedding_input(t) for t in TEXTS]
    for o in out:
        ids = o.prompt_token_ids
        blocks = np.arange(-(-len(ids) // e.core.kv_block_size), dtype=np.int32)
        last = e.core.hidden_batch(np.array(ids, np.int32), [(len(ids), 0, blocks, False)])[-1]
        v = np.array(o.outputs.embedding, np.float32)
        assert abs(np.linalg.norm(v) - 1) < 1e-5
        np.testing.assert_allclose(v, last / np.linalg.norm(last), rtol=1e-5, atol=1e-6)


def test_one_batch_equals_one_at_a_time(llm):
    together = [o.outputs.embedding for o in llm.embed(TEXTS)]
    alone = [llm.embed(t)[0].outputs.embedding for t in TEXTS]
    np.testing.assert_allclose(np.array(together), np.array(alone), rtol=1e-5, atol=1e-6)


def test_many_inputs_run_in_several_batches_and_free_their_blocks(llm):
    e = llm.engine
    free = e.scheduler.blocks.num_free
    texts = [f"{TEXTS[3]} {i}" for i in range(2 * BATCH_TOKENS // 60)]
    out = llm.embed(texts)
    assert len(out) == len(texts) and e.scheduler.blocks.num_free == free
    np.testing.assert_allclose(out[-1].outputs.embedding, llm.embed(texts[-1])[0].outputs.embedding, atol=1e-6)


def test_dimensions_and_normalize(llm):
    full = np.array(llm.embed(TEXTS[0], PoolingParams(normalize=False))[0].outputs.embedding)
    cut = np.array(llm.embed(TEXTS[0], PoolingParams(dimensions=16))[0].outputs.embedding)
    assert len(cut) == 16 and abs(np.linalg.norm(cut) - 1) < 1e-5
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), rtol=1e-5, atol=1e-6)
    for bad in (0, llm.spec.hidden_size + 1, True, 2.5):
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed(TEXTS[0], PoolingParams(dimensions=bad))


def test_mean_pooling():
    hidden = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_allclose(pool(hidden, "mean"), hidden.mean(0))
    np.testing.assert_allclose(pool(hidden, "cls"), hidden[0])
    np.testing.assert_allclose(pool(hidden, "last"), hidden[-1])


def test_score_is_the_cosine_of_embeddings(llm):
    vecs = [np.array(o.outputs.embedding) for o in llm.embed(TEXTS)]
    one_to_many = llm.score(TEXTS[0], TEXTS)
    assert [round(s.outputs.score, 6) for s in one_to_many] == [round(cosine(vecs[0], v), 6) for v in vecs]
    assert abs(one_to_many[0].outputs.score - 1) < 1e-5
    pairs = llm.score(TEXTS[:2], TEXTS[2:])
    assert [round(s.outputs.score, 6) for s in pairs] == [round(cosine(vecs[0], vecs[2]), 6),
                                                          round(cosine(vecs[1], vecs[3]), 6)]
    with pytest.raises(ValueError, match="pairs"):
        llm.score(TEXTS[:2], TEXTS[:3])


def test_bad_inputs_are_clear_errors(llm):
    with pytest.raises(ValueError, match="at most 256"):
        llm.embed([1] * 300)
    assert len(llm.embed([1] * 300, truncate_prompt_tokens=200)[0].prompt_token_ids) == 200
    with pytest.raises(ValueError, match="at least one token"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([[10 ** 6]])
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed("x", truncate_prompt_tokens=0)


def test_generation_still_runs_beside_embeddings(llm):
    before = llm.generate("Once upon a time", corelm.SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    llm.embed(TEXTS)
    after = llm.generate("Once upon a time", corelm.SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    assert before == after
