"""The searched Q4_1 quantizer (cpp/kernels/quantize.h, `corelm convert --weights q4`): never worse than
round-to-nearest block by block, better on real-looking weights, importance-weighted when asked, exact on
weights already on a Q4_1 grid, and bounded and crash-free on awkward input."""
import numpy as np
import pytest

from test_quant import ggml_quantize

from corelm import _core
from corelm.convert import quantize_q4_1, quantize_q4_1_search
from corelm.loader.gguf import _DECODERS


def dequant(raw, shape):
    return _DECODERS["Q4_1"](raw.reshape(-1), int(np.prod(shape))).reshape(shape).astype(np.float64)


def block_sse(raw, w, imp=None):
    e = (dequant(raw, w.shape) - w) ** 2
    if imp is not None:
        e = e * imp
    return e.reshape(-1, 32).sum(1)


def weights(seed, rows=48, cols=640):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(0.02)
    w[:, ::37] *= 8                                   # outlier columns, as real weight rows have
    w[1, 5] = 1.0                                     # one huge outlier in a block
    w[2] = np.abs(w[2]) + 0.1                         # all-positive blocks (far-from-zero minimum)
    w[3] = 0                                          # a zero row
    w[4, :64] = 0.25                                  # constant blocks
    w[5] = rng.standard_t(2, cols).astype(np.float32) * np.float32(0.01)   # heavy tails
    return w


@pytest.mark.parametrize("seed", [0, 1])
def test_never_worse_than_round_to_nearest(seed):
    w = weights(seed)
    ours, rtn = block_sse(quantize_q4_1_search(w), w), block_sse(quantize_q4_1(w), w)
    assert np.all(ours <= rtn * (1 + 1e-5) + 1e-12)
    assert ours.sum() < 0.85 * rtn.sum()              # ~25% less error on these blocks


def test_importance_weighting_lowers_the_weighted_error():
    w = weights(2)
    imp = np.exp(np.random.default_rng(3).standard_normal(w.shape[1]) * 1.5).astype(np.float32)
    plain = block_sse(quantize_q4_1_search(w), w, imp).sum()
    weighted_raw = quantize_q4_1_search(w, imp)
    weighted = block_sse(weighted_raw, w, imp)
    assert weighted.sum() < 0.9 * plain
    # and the range is still a candidate block by block: never worse than round-to-nearest, weighted
    assert np.all(weighted <= block_sse(quantize_q4_1(w), w, imp) * (1 + 1e-5) + 1e-12)
    # importance is per column; zero importance everywhere falls back to plain squared error
    assert np.array_equal(quantize_q4_1_search(w, np.zeros(w.shape[1], np.float32)), quantize_q4_1_search(w))


def test_blocks_on_a_q4_1_grid_come_back_exact():
    w = weights(4)
    g = dequant(ggml_quantize(w, "Q4_1"), w.shape).astype(np.float32)
    imp = np.linspace(0.1, 3, w.shape[1]).astype(np.float32)
    for raw in (quantize_q4_1_search(g), quantize_q4_1_search(g, imp)):
        assert np.array_equal(dequant(raw, g.shape), g.astype(np.float64))


def test_round_trip_bounds():
    w = weights(5)
    raw = quantize_q4_1_search(w)
    x = w.reshape(-1, 32).astype(np.float64)
    y = dequant(raw, w.shape).reshape(-1, 32)
    span = x.max(1) - x.min(1)
    # least squares error <= that of the block's own range (every error within span/30, fp16 aside)
    assert np.all(np.sqrt(((y - x) ** 2).mean(1)) <= span / 30 * 1.01 + 1e-6)
    assert np.all(np.abs(y - x).max(1) <= np.sqrt(32) * span / 30 * 1.01 + 1e-6)
    assert np.all(y[3 * 20:4 * 20] == 0)               # the zero row stays zero
    assert np.all(y[4 * 20:4 * 20 + 2] == np.float32(0.25))   # constant blocks are exact


def test_non_finite_input_and_bad_shapes():
    w = weights(6, rows=8, cols=64)
    w[0, 3], w[1, 40], w[2, 7] = np.nan, np.inf, -np.inf
    raw = quantize_q4_1_search(w)                      # no crash; finite blocks are unaffected
    assert raw.shape == (8, 40)
    assert np.array_equal(raw[6], quantize_q4_1_search(w[6:7])[0])
    assert np.array_equal(raw[0, 20:], quantize_q4_1_search(w[:1, 32:])[0])
    with pytest.raises(ValueError):
        quantize_q4_1_search(np.zeros((2, 33), np.float32))
    with pytest.raises(ValueError):
        quantize_q4_1_search(np.zeros((2, 32), np.float32), np.ones(31, np.float32))
    with pytest.raises(ValueError):
        _core.quantize_q4_1_search(np.zeros(32, np.float32))
