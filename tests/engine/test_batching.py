"""Continuous batching over the paged KV cache: batched results equal one-at-a-time results, requests
join mid-flight, prefixes are shared, a too-small KV budget preempts instead of failing (the int8 and
bf16 caches are tested in test_kv_int8.py)."""
import json
import logging
import os

import numpy as np
import pytest

from conftest import FIXTURES, MODELS, core_forward, rerun_with_integer_prefill

import corelm
from corelm import SamplingParams

STORIES = os.path.join(MODELS, "stories260K")
QWEN = os.path.join(MODELS, "tiny-qwen2")
GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts_of(name):
    with open(os.path.join(FIXTURES, f"{name}.json")) as f:
        return [c["prompt_ids"] for c in json.load(f)["cases"]]


@pytest.fixture(scope="module")
def stories():
    return corelm.LLM(STORIES, dtype="fp32", threads=2)


def one_at_a_time(llm, prompts, params):
    out = []
    for p in prompts:
        llm.reset()
        out.append(llm.generate([p], params)[0].outputs[0].token_ids)
    return out


def test_forward_batch_equals_separate_forwards(stories):
    core, B = stories.engine.core, stories.engine.core.kv_block_size
    rng = np.random.default_rng(0)
    a, b = rng.integers(3, 512, 37).astype(np.int32), rng.integers(3, 512, 5).astype(np.int32)
    ref_a = core_forward(core, a, 0, True)
    ref_b = core_forward(core, b, 0, True)
    blocks_a = np.arange(0, 4, dtype=np.int32)          # 64 positions
    blocks_b = np.array([9, 7, 5], dtype=np.int32)      # any blocks, in any order
    got = core.forward_batch(np.concatenate([a, b]), [(37, 0, blocks_a, True), (5, 0, blocks_b, True)])
    np.testing.assert_allclose(got[:37], ref_a, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[37:], ref_b, rtol=1e-4, atol=1e-4)
    # decode one more token for each in one batch; last-token logits only
    nxt = np.array([11, 12], dtype=np.int32)
    got = core.forward_batch(nxt, [(1, 37, blocks_a, False), (1, 5, blocks_b, False)])
    ref = core_forward(core, np.concatenate([b, nxt[1:]]), 0, False)
    np.testing.assert_allclose(got[1], ref, rtol=1e-4, atol=1e-4)


def test_forward_batch_rejects_bad_tables(stories):
    core = stories.engine.core
    with pytest.raises(ValueError, match="block"):
        core.forward_batch(np.array([1, 2], np.int32), [(2, 0, np.array([10**6], np.int32), False)])
    with pytest.raises(ValueError, match="block table"):
        core.forward_batch(np.array([1] * 20, np.int32), [(20, 0, np.array([0], np.int32), False)])
    with pytest.raises(ValueError, match="add up"):
        core.forward_batch(np.array([1, 2, 3], np.int32), [(2, 0, np.array([0], np.int32), False)])


@pytest.mark.parametrize("path", [STORIES, QWEN])
def test_batched_generate_equals_one_at_a_time(path):
    llm = corelm.LLM(path, dtype="fp32", threads=2)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, 512, n)) for n in (1, 3, 17, 40, 90, 2, 33)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert batched == one_at_a_time(llm, prompts, params)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_quantized_logits_do_not_depend_on_the_batch(dtype, activations, request):
    """A token's logits are the same to the bit alone, beside other requests in one step, and with its
    prompt read in chunks (so with one row or many in a matmul): every matmul quantizes each row on its
    own, sums each block exactly in int32, and adds the scaled blocks in the same order for one row or
    many (int8 decode on AVX-512 used to add them in another order). Where AMX runs, prompts of more than
    32 tokens take AMX-BF16 instead; CORELM_AMX_PREFILL=0 keeps the integer kernels, and this promise."""
    if rerun_with_integer_prefill(request):
        return
    llm = corelm.LLM(QWEN, dtype=dtype, activations=activations, threads=2)
    core = llm.engine.core
    rng = np.random.default_rng(2)
    a, b = rng.integers(3, 512, 37).astype(np.int32), rng.integers(3, 512, 6).astype(np.int32)
    alone = core.forward_batch(a, [(37, 0, np.arange(3, dtype=np.int32), True)])
    both = core.forward_batch(np.concatenate([b, a]), [(6, 0, np.array([5], np.int32), True),
                                                       (37, 0, np.arange(3, dtype=np.int32), True)])
    np.testing.assert_array_equal(both[6:], alone)
    blocks = np.arange(3, dtype=np.int32)
    core.forward_batch(a[:20], [(20, 0, blocks, False)])
    last = core.forward_batch(a[20:], [(17, 20, blocks, False)])
    np.testing.assert_array_equal(last[0], alone[-1])
    prompts = [list(rng.integers(3, 512, n)) for n in (1, 3, 17, 40, 2)]
    params = SamplingParams(max_tokens=24, **GREEDY)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert batched == one_at_a_time(llm, prompts, params)


def test_requests_join_mid_flight(stories):
    params = SamplingParams(max_tokens=30, **GREEDY)
    prompts = [stories.encode_prompt(p) for p in ("Once upon a time", "The little dog", "Tom and Sue")]
    expected = one_at_a_time(stories, prompts, params)
    eng = stories.engine
    eng.add_request("j0", prompts[0], params)
    got = {"j0": [], "j1": [], "j2": []}
    steps = 0
    while eng.has_unfinished_requests():
        if steps == 5:
            eng.add_request("j1", prompts[1], params)
        if steps == 12:
            eng.add_request("j2", prompts[2], params)
        for rid, chunk in eng.step():
            got[rid].append(chunk.token_id)
        steps += 1
    assert [got[f"j{i}"] for i in range(3)] == expected


def test_shared_prefixes_reuse_blocks(stories):
    stories.reset()
    base = stories.encode_prompt("Once upon a time, there was a little girl named Lily. She loved to play outside")
    params = SamplingParams(max_tokens=10, **GREEDY)
    first = stories.generate([base + [300, 301]], params)[0]
    second = stories.generate([base + [302]], params)[0]
    full_blocks = (len(base)) // stories.engine.core.kv_block_size
    assert second.metrics["cached_prompt_tokens"] == full_blocks * stories.engine.core.kv_block_size > 0
    assert second.outputs[0].token_ids == one_at_a_time(stories, [base + [302]], params)[0]
    assert first.metrics["cached_prompt_tokens"] == 0


def test_small_kv_budget_preempts_and_still_finishes(caplog):
    big = corelm.LLM(STORIES, dtype="fp32", threads=2)
    per_block = 5 * 4 * 16 * 8 * 2 * 4  # layers * kv heads * block * head_dim * (k, v) * fp32
    small = corelm.LLM(STORIES, dtype="fp32", threads=2, kv_cache_gb=24 * per_block / 2**30, max_seq_len=256)
    assert small.engine.core.kv_blocks == 24
    prompts = [[1, 400 + i, 30 + i] for i in range(8)]
    params = SamplingParams(max_tokens=60, **GREEDY)
    with caplog.at_level(logging.WARNING, logger="corelm"):
        got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.num_preemptions > 0 and "preempted" in caplog.text
    assert got == [o.outputs[0].token_ids for o in big.generate(prompts, params)]
    assert not small.engine.has_unfinished_requests()
    assert small.engine.scheduler.blocks.num_free == 24  # everything handed back (some of it as prefix cache)


def test_prompt_larger_than_the_whole_cache_is_refused():
    per_block = 5 * 4 * 16 * 8 * 2 * 4
    llm = corelm.LLM(STORIES, dtype="fp32", threads=1, kv_cache_gb=2 * per_block / 2**30)
    with pytest.raises(ValueError, match="kv_cache_gb"):
        llm.generate([[1] * 40], SamplingParams(max_tokens=2))
    assert llm.generate([[1, 5]], SamplingParams(max_tokens=3, **GREEDY))[0].outputs[0].token_ids


def test_bad_kv_options():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        corelm.LLM(STORIES, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_gb"):
        corelm.LLM(STORIES, kv_cache_gb=-1)
