"""The sparse KV cache (kv_sparsity: each key and value row keeps its largest-magnitude elements as a
bitmap and the kept values): the kernels of every table against the scalar reference, the whole
attention against a dense cache holding the same rows with the dropped elements zero, which elements a
row keeps, the pool's bytes per token, and the option through LLM."""
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import MODELS

import corelm
from corelm import SamplingParams, _core
from corelm.engine.model_builder import KV_BLOCK_SIZE, kv_blocks_for, kv_keep

TABLES = _core.kernel_tables() + ["amx_emulated"]
STORIES = os.path.join(MODELS, "stories260K")
GREEDY = dict(temperature=0.0, ignore_eos=True)


def mask_words(hd):
    return (hd + 31) // 32


def sparse_rows(kv, rng, n, hd, nk):
    """n sparse rows: masks [n][words] (nk bits each, except an empty row and a row with fewer bits), the
    kept values [n][nk] of type kv, and the dense rows [n][hd] (float64, dropped elements zero)."""
    masks = np.zeros((n, mask_words(hd)), np.uint32)
    dense = np.zeros((n, hd))
    if kv == "fp32":
        vals = rng.standard_normal((n, nk)).astype(np.float32)
        exact = vals.astype(np.float64)
    elif kv == "bf16":
        vals = (rng.standard_normal((n, nk)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        exact = (vals.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        vals = rng.integers(-127, 128, (n, nk)).astype(np.int8)
        exact = vals.astype(np.float64)
    for j in range(n):
        count = 0 if j == 1 else nk // 2 if j == 2 else nk  # an empty row, a row using half its values
        chans = np.sort(rng.choice(hd, count, replace=False))
        for r, d in enumerate(chans):
            masks[j, d // 32] |= np.uint32(1 << (d % 32))
            dense[j, d] = exact[j, r]
    return masks, vals, dense


SHAPES = [(1, 64, 1, 32), (2, 64, 16, 32), (4, 128, 13, 64), (8, 80, 17, 40), (3, 256, 5, 128), (5, 256, 16, 1),
          (9, 64, 7, 45), (1, 6, 9, 3), (7, 37, 4, 37), (6, 80, 3, 80)]


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("G,hd,n,nk", SHAPES)
def test_sparse_kv_kernels_match_dense_rows(isa, kv, G, hd, n, nk):
    """Scores and weighted sums over sparse rows = those over the dense rows with the dropped elements
    zero; head counts past one register tile (8), head_dim off the 8/16-lane grid, rows keeping all."""
    rng = np.random.default_rng(G * 1000 + hd * 7 + n + nk)
    q = rng.standard_normal((G, hd)).astype(np.float32)
    masks, k, k64 = sparse_rows(kv, rng, n, hd, nk)
    s = _core.testing.kernel_kv_scores_sparse(isa, kv, q, masks, k, nk)
    np.testing.assert_allclose(s, q.astype(np.float64) @ k64.T, rtol=1e-5, atol=1e-4 * np.sqrt(hd) * np.abs(k64).max())
    if isa != "scalar":
        np.testing.assert_allclose(s, _core.testing.kernel_kv_scores_sparse("scalar", kv, q, masks, k, nk),
                                   rtol=1e-5, atol=1e-5 * np.sqrt(hd) * np.abs(k64).max())
    p = rng.random((G, n)).astype(np.float32)
    masks, v, v64 = sparse_rows(kv, rng, n, hd, nk)
    out0 = rng.standard_normal((G, hd)).astype(np.float32)
    y = _core.testing.kernel_kv_accum_sparse(isa, kv, p, masks, v, nk, out0)
    np.testing.assert_allclose(y, out0 + p.astype(np.float64) @ v64, rtol=1e-5,
                               atol=1e-4 * np.sqrt(n) * np.abs(v64).max())


def fill(cache, rng, n_kv, hd, positions, blocks, bs, outliers=True):
    """Random key and value rows (two outlier channels, as real keys have; a zero row; tied magnitudes)
    at positions [0, positions) of the sequence whose block table is `blocks`."""
    for p in range(positions):
        for h in range(n_kv):
            for value in (False, True):
                x = rng.standard_normal(hd).astype(np.float32)
                if outliers and not value:
                    x[1] *= 8
                    x[hd - 1] *= 4
                if p == 3:
                    x[:] = 0  # an all-zero row
                if p == 5:
                    x = np.where(np.arange(hd) % 2 == 0, 1.0, -1.0).astype(np.float32)  # all ties
                cache.store(int(blocks[p // bs]), p % bs, h, value, x)


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("hd,G,length,start", [(64, 1, 40, 0), (128, 4, 33, 0), (80, 8, 50, 7), (256, 2, 17, 16),
                                               (64, 7, 16, 0), (6, 3, 20, 2)])
def test_sparse_cache_attention_equals_dense_cache_of_its_rows(isa, kv, hd, G, length, start):
    """The whole attention over a sparse cache (scattered blocks, lengths crossing block boundaries, a
    window start) = over a dense cache holding the rows it reads back (dropped elements zero; for int8
    the dequantized rows in an fp32 cache), to fp rounding."""
    bs, n_kv = 16, 2
    rng = np.random.default_rng(hd + G + length)
    blocks = rng.permutation(8).astype(np.int32)
    sparse = _core.testing.KVCache(n_kv, hd, 8, bs, kv, sparsity=0.5)
    assert sparse.n_keep == hd - math.floor(0.5 * hd)
    dense = _core.testing.KVCache(n_kv, hd, 8, bs, "fp32" if kv == "int8" else kv)
    fill(sparse, rng, n_kv, hd, length, blocks, bs)
    for p in range(length):
        for h in range(n_kv):
            for value in (False, True):
                row = sparse.load(int(blocks[p // bs]), p % bs, h, value, hd)
                assert np.count_nonzero(row) <= sparse.n_keep
                dense.store(int(blocks[p // bs]), p % bs, h, value, row)
                # the dense cache holds the row exactly (bf16 values are bf16 already)
                np.testing.assert_array_equal(dense.load(int(blocks[p // bs]), p % bs, h, value, hd), row)
    for softcap in (0.0, 30.0):
        for h in range(n_kv):
            q = rng.standard_normal((G, hd)).astype(np.float32)
            got = sparse.attend(isa, h, blocks, start, length - 1, q, hd ** -0.5, softcap)
            ref = dense.attend("scalar", h, blocks, start, length - 1, q, hd ** -0.5, softcap)
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.9])
def test_a_sparse_row_keeps_its_largest_elements(kv, sparsity):
    hd = 80
    cache = _core.testing.KVCache(1, hd, 1, 4, kv, sparsity=sparsity)
    keep = hd - math.floor(sparsity * hd)
    assert cache.n_keep == keep == kv_keep(hd, sparsity)
    x = np.random.default_rng(1).standard_normal(hd).astype(np.float32)
    cache.store(0, 0, 0, True, x)
    row = cache.load(0, 0, 0, True, hd)
    chosen = np.sort(np.argsort(-np.abs(x), kind="stable")[:keep])
    assert (np.flatnonzero(row) == chosen).all()
    if kv == "int8":  # symmetric: half a step of (about) absmax / 127
        np.testing.assert_allclose(row[chosen], x[chosen], rtol=0, atol=1.01 * 0.5 / 127 * np.abs(x).max())
    else:
        np.testing.assert_allclose(row[chosen], x[chosen], rtol=0 if kv == "fp32" else 2 ** -8)
    # ties: the lower channels; a zero row stays zero
    cache.store(0, 1, 0, False, np.ones(hd, np.float32))
    assert (np.flatnonzero(cache.load(0, 1, 0, False, hd)) == np.arange(keep)).all()
    cache.store(0, 2, 0, False, np.zeros(hd, np.float32))
    assert not cache.load(0, 2, 0, False, hd).any()


@pytest.mark.parametrize("kv,esz,extra", [("fp32", 4, 0), ("bf16", 2, 0), ("int8", 1, 4)])
def test_sparse_cache_bytes_per_token(kv, esz, extra):
    """A row: head_dim bits of mask (in 32-bit words) and n_keep values (+ the int8 step and bound); the
    Python pool sizing (kv_blocks_for) uses the same size."""
    for hd, s in [(64, 0.5), (128, 0.3), (80, 0.5), (64, 0.0)]:
        cache = _core.testing.KVCache(2, hd, 4, KV_BLOCK_SIZE, kv, sparsity=s)
        keep = hd - math.floor(s * hd)
        row = keep * esz + extra + (4 * mask_words(hd) if keep < hd else 0)
        assert cache.bytes == 4 * KV_BLOCK_SIZE * 2 * 2 * row  # blocks x slots x kv heads x (key, value)
    spec = SimpleNamespace(num_layers=24, num_kv_heads=2, head_dim=64)  # Qwen2.5-0.5B's cache
    blocks = {s: kv_blocks_for(spec, kv, 64, 1 / 1024, s) for s in (0.0, 0.5)}
    assert blocks[0.5] > blocks[0.0]  # the same budget holds more tokens


def test_kv_sparsity_option_is_validated():
    for bad in (-0.1, 1.0, 1.5, float("nan"), "half"):
        with pytest.raises(ValueError, match="kv_sparsity"):
            corelm.LLM(STORIES, threads=1, kv_sparsity=bad)


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_sparse_kv_through_llm(kv):
    """kv_sparsity 0 is the dense cache (same tokens); a sparse cache generates, its pool holds more
    tokens for the same budget, and prefix caching and speculative decoding still give its own tokens."""
    prompt = [1] + [400, 300, 200, 100, 42, 7] * 6  # 37 tokens: two full blocks for the prefix cache,
    params = SamplingParams(max_tokens=48, **GREEDY)  # and repeats for prompt lookup to propose
    kw = dict(threads=2, dtype="fp32", kv_cache_dtype=kv, max_seq_len=256, kv_cache_gb=0.001,
              speculative_model=None)
    dense = corelm.LLM(STORIES, **kw)
    zero = corelm.LLM(STORIES, kv_sparsity=0.0, **kw)
    assert zero.engine.core.kv_keep == zero.loaded.spec.head_dim
    expected = dense.generate([prompt], params)[0].outputs[0].token_ids
    assert zero.generate([prompt], params)[0].outputs[0].token_ids == expected
    sparse = corelm.LLM(STORIES, kv_sparsity=0.5, **kw)
    assert sparse.engine.core.kv_keep == dense.loaded.spec.head_dim // 2
    # the pool is sized with the sparse rows' bytes (at stories260K's head_dim 8 an int8 row's bitmap
    # costs what its dropped half saves)
    assert sparse.engine.core.kv_blocks == kv_blocks_for(sparse.spec, kv, 256, 0.001, 0.5)
    assert sparse.engine.core.kv_blocks >= dense.engine.core.kv_blocks
    first = sparse.generate([prompt], params)[0].outputs[0].token_ids
    assert len(first) == 48
    # again: the prompt's blocks now come from the prefix cache
    again = sparse.generate([prompt], params)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == first
    # every step proposes (not as measured step times decide: on a loaded host the planner may propose
    # only what is then all kept)
    spec = corelm.LLM(STORIES, kv_sparsity=0.5, **dict(kw, speculative_model="[ngram]", speculative_adaptive=False))
    assert spec.generate([prompt], params)[0].outputs[0].token_ids == first
    counts = spec.engine.spec_counts()
    assert counts["draft_tokens"] > counts["accepted_tokens"] > 0  # some guesses kept, some rolled back
