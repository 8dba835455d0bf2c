"""The prefix cache on disk (LLM(prefix_cache_dir=...), engine/prefix_store.py) and the core's block copies it
rests on (Model.kv_block_read / kv_block_write): a fresh engine over the same directory (a restart) reads the
prompt's full blocks back and answers exactly as a cold run; a corrupt, truncated or foreign file is ignored
with one warning; the budget evicts the least recently used files; an unwritable directory only warns."""
import glob
import logging
import os

import numpy as np
import pytest

from conftest import MODELS

import corelm
from corelm import SamplingParams
from corelm.engine.prefix_store import chain_digest

STORIES = os.path.join(MODELS, "stories260K")
# ~200 token ids every test model's vocabulary holds; 12 full blocks of 16 before the last token
PROMPT = [1] + [(i * 37) % 500 + 1 for i in range(199)]
FULL = (len(PROMPT) - 1) // 16 * 16
GREEDY = SamplingParams(temperature=0, max_tokens=16)
KV_LAYOUTS = [("fp32", 0.0), ("bf16", 0.0), ("int8", 0.0), ("int8", 0.5), ("bf16", 0.5)]


def make_llm(directory=None, model=STORIES, **options):
    if directory is not None:
        options["prefix_cache_dir"] = str(directory)
    return corelm.LLM(model, dtype="fp32", threads=1, max_seq_len=512, **options)


def run(llm, prompt=PROMPT, params=GREEDY):
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def block_files(directory):
    return sorted(glob.glob(os.path.join(str(directory), "*", "*", "*.kvb")))


def written(llm, directory):
    """The block files once the engine's writer has caught up."""
    assert llm.engine.prefix_store.flush(timeout=30)
    return block_files(directory)


def block_path(llm, i, prompt=PROMPT):
    """The file of the prompt's block i."""
    digest = b""
    for k in range(i + 1):
        digest = chain_digest(digest, prompt[k * 16:(k + 1) * 16])
    return llm.engine.prefix_store.path(digest)


@pytest.fixture(scope="module")
def cold():
    return {layout: run(make_llm(kv_cache_dtype=layout[0], kv_sparsity=layout[1]))[0] for layout in KV_LAYOUTS}


# -- the core's block copies ----------------------------------------------------------------------
@pytest.mark.parametrize("kv_type,sparsity", KV_LAYOUTS)
def test_block_copy_round_trips_and_keeps_the_forward(kv_type, sparsity):
    core = make_llm(kv_cache_dtype=kv_type, kv_sparsity=sparsity).engine.core
    tokens = np.asarray(PROMPT[:40], dtype=np.int32)
    core.forward_batch(tokens[:32], [(32, 0, np.array([0, 1], np.int32), False)])
    original = core.kv_block_read(1)
    assert original.dtype == np.uint8 and original.shape == (core.kv_block_bytes,)
    assert core.kv_block_bytes * core.kv_blocks == core.kv_bytes
    assert original.any() and not np.array_equal(original, core.kv_block_read(5))
    core.kv_block_write(4, core.kv_block_read(0))
    core.kv_block_write(5, original)
    assert np.array_equal(core.kv_block_read(5), original)
    # the last block's 8 tokens over the copies give the bits they give over the originals
    tail = [(8, 32, np.array(table, np.int32), True) for table in ([0, 1, 2], [4, 5, 6])]
    by_original = core.forward_batch(tokens[32:], tail[:1])
    by_copy = core.forward_batch(tokens[32:], tail[1:])
    assert np.array_equal(by_original, by_copy)


def test_block_copy_checks_sizes_and_indices():
    core = make_llm().engine.core
    with pytest.raises(ValueError, match="kv_block_bytes"):
        core.kv_block_write(0, np.zeros(core.kv_block_bytes - 1, np.uint8))
    with pytest.raises(IndexError):
        core.kv_block_read(core.kv_blocks)
    with pytest.raises(IndexError):
        core.kv_block_write(-1, np.zeros(core.kv_block_bytes, np.uint8))


# -- across a restart -----------------------------------------------------------------------------
@pytest.mark.parametrize("kv_type,sparsity", KV_LAYOUTS)
def test_a_restarted_engine_reads_the_prompt_from_disk(tmp_path, cold, kv_type, sparsity):
    first = make_llm(tmp_path, kv_cache_dtype=kv_type, kv_sparsity=sparsity)
    assert run(first) == (cold[kv_type, sparsity], 0)
    files = written(first, tmp_path)
    assert len(files) >= FULL // 16                       # the prompt's full blocks (and generated ones)
    del first
    again = make_llm(tmp_path, kv_cache_dtype=kv_type, kv_sparsity=sparsity)
    assert run(again) == (cold[kv_type, sparsity], FULL)


def test_another_kv_layout_does_not_read_the_files(tmp_path, cold):
    run(make_llm(tmp_path, kv_cache_dtype="int8"))
    bf16 = make_llm(tmp_path, kv_cache_dtype="bf16")
    assert run(bf16) == (cold["bf16", 0.0], 0)
    assert len({os.path.dirname(os.path.dirname(f)) for f in written(bf16, tmp_path)}) == 2   # one key each


def test_a_prefix_evicted_from_memory_comes_back_from_disk(tmp_path, cold):
    llm = make_llm(tmp_path)
    run(llm)
    written(llm, tmp_path)
    llm.engine.clear_prefix_cache()
    assert run(llm) == (cold["fp32", 0.0], FULL)


# -- bad files ------------------------------------------------------------------------------------
def _flip_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40   # inside the KV bytes
    open(path, "wb").write(bytes(data))


def _truncate(path):
    os.truncate(path, os.path.getsize(path) - 100)


def _junk(path):
    open(path, "wb").write(os.urandom(300))


@pytest.mark.parametrize("damage", [_flip_byte, _truncate, _junk])
def test_a_damaged_file_is_ignored_with_one_warning(tmp_path, cold, caplog, damage):
    first = make_llm(tmp_path)
    run(first)
    written(first, tmp_path)
    damaged = block_path(first, 3)
    damage(damaged)
    with caplog.at_level(logging.WARNING, logger="corelm"):
        assert run(make_llm(tmp_path)) == (cold["fp32", 0.0], 3 * 16)   # the blocks before it
    warnings = [r for r in caplog.records if "prefix cache" in r.getMessage()]
    assert len(warnings) == 1 and os.path.basename(damaged) in warnings[0].getMessage()
    # the recomputed block was written again: the next engine reads the whole prompt
    again = make_llm(tmp_path)
    assert run(again) == (cold["fp32", 0.0], FULL)


def test_another_models_file_is_ignored_with_a_warning(tmp_path, caplog):
    other = os.path.join(MODELS, "tiny-llama3")
    stories = make_llm(tmp_path)
    run(stories)
    written(stories, tmp_path)
    ours = block_path(stories, 0)   # the first block: both models' prompts start with it
    llama = make_llm(tmp_path, model=other)
    expected = run(make_llm(model=other))[0]
    key = llama.engine.prefix_store.key
    forged = os.path.join(str(tmp_path), key, *ours.split(os.sep)[-2:])
    os.makedirs(os.path.dirname(forged), exist_ok=True)
    with open(ours, "rb") as src, open(forged, "wb") as dst:
        dst.write(src.read())
    with caplog.at_level(logging.WARNING, logger="corelm"):
        assert run(llama) == (expected, 0)
    assert "another model" in caplog.text


# -- the budget and the disk ----------------------------------------------------------------------
def test_the_budget_evicts_the_least_recently_used(tmp_path):
    one_token = SamplingParams(temperature=0, max_tokens=1)
    prompts = {name: [1] + [(i * k) % 500 + 2 for i in range(64)] for name, k in (("a", 7), ("b", 11), ("c", 13))}
    probe = make_llm(tmp_path)
    run(probe, prompts["a"], one_token)
    size = os.path.getsize(written(probe, tmp_path)[0])   # every file has the same size
    llm = make_llm(tmp_path, prefix_cache_gb=9 * size / (1 << 30))   # 9 of the 12 files the three prompts make
    run(llm, prompts["b"], one_token)
    written(llm, tmp_path)
    llm.engine.clear_prefix_cache()
    assert run(llm, prompts["a"], one_token)[1] == 64   # read from disk: a is now used more recently than b
    run(llm, prompts["c"], one_token)
    assert len(written(llm, tmp_path)) == 8    # past the budget: down to 90% of it
    llm.engine.clear_prefix_cache()
    assert [run(llm, prompts[p], one_token)[1] for p in "acb"] == [64, 64, 0]   # b's oldest blocks went


def test_an_unwritable_directory_only_warns(tmp_path, cold, caplog):
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="corelm"):
        llm = make_llm(tmp_path / "file" / "cache")
        assert run(llm) == (cold["fp32", 0.0], 0)
        assert llm.engine.prefix_store.flush(timeout=30)
        assert run(make_llm(tmp_path / "file" / "cache")) == (cold["fp32", 0.0], 0)
    assert 1 <= sum("prefix cache" in r.getMessage() for r in caplog.records) <= 2   # cannot create; cannot write


def test_option_errors(tmp_path):
    with pytest.raises(ValueError, match="prefix_cache_gb"):
        make_llm(tmp_path, prefix_cache_gb=0)
    with pytest.raises(ValueError, match="prefix_cache_dir"):
        make_llm(prefix_cache_gb=1.0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_llm(tmp_path, enable_prefix_caching=False)
