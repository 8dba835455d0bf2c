"""The AVX512_BF16 table's bf16-weight matmul (VDPBF16PS on bf16-rounded activations) against a float64
reference of the bf16-rounded x and W: the dot-product path (m = 2..256: every strip tail, K split in
blocks past 2048), the pair-panel path (m > 256), K and row counts off the 32/8 layout, and column ranges
that split weight groups the way threads do. The table must only exist where CPUID reports AVX512_BF16."""
import numpy as np
import pytest

from corelm import _core
from test_kernels import bf16_round

TABLES = _core.kernel_tables()
HAS_BF16 = "avx512_bf16" in TABLES
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="CPU without AVX512_BF16")
RNG = np.random.default_rng(99)


def reference(x, w):
    return bf16_round(x).astype(np.float64) @ bf16_round(w).astype(np.float64).T


def check(y, x, w, n0=0, n1=None):
    ref = reference(x, w)
    n1 = w.shape[0] if n1 is None else n1
    k = x.shape[1]
    # products of bf16 values are exact in fp32, so only fp32 accumulation differs from float64
    tol = 1e-6 * np.sqrt(k) * np.abs(bf16_round(x)).max() * np.abs(bf16_round(w)).max() * 8 + 1e-7
    np.testing.assert_allclose(y[:, n0:n1], ref[:, n0:n1], rtol=0, atol=tol)
    assert not y[:, :n0].any() and not y[:, n1:].any()  # columns of other threads untouched


def test_table_follows_cpuid():
    features = _core.cpu_info()["features"]
    assert HAS_BF16 == ("avx512_bf16" in features and "avx512f" in features)
    if HAS_BF16:
        assert "avx512" in TABLES  # the plain AVX-512 table stays available (CORELM_ISA=avx512)


@needs_bf16
@pytest.mark.parametrize("m", list(range(1, 41)))
@pytest.mark.parametrize("n,k", [(9, 31), (37, 129), (16, 896), (11, 4164)])
def test_batched_decode_shapes(m, n, k):
    x = RNG.standard_normal((m, k)).astype(np.float32)
    w = RNG.standard_normal((n, k)).astype(np.float32)
    y = _core.testing.kernel_matmul("avx512_bf16", x, w, "bf16")
    if m == 1:  # single-row decode keeps fp32 activations: same as the plain table
        np.testing.assert_array_equal(y, _core.testing.kernel_matmul("avx512", x, w, "bf16"))
    else:
        check(y, x, w)


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 7, 33, 130, 256, 257, 300])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 15), (41, 65), (77, 100), (33, 1000), (130, 257), (9, 2100)])
def test_prefill_shapes(m, n, k):
    x = RNG.standard_normal((m, k)).astype(np.float32)
    w = RNG.standard_normal((n, k)).astype(np.float32)
    if m == 1:
        # single-row decode keeps fp32 activations (the plain table's GEMV), so bf16-exact x makes the
        # bf16-rounded reference below exact for it too: m = 1 is checked against the same reference
        x = bf16_round(x)
    y = _core.testing.kernel_matmul("avx512_bf16", x, w, "bf16")
    check(y, x, w)
    if m == 1:
        np.testing.assert_array_equal(y, _core.testing.kernel_matmul("avx512", x, w, "bf16"))


@needs_bf16
@pytest.mark.parametrize("m", [2, 5, 16, 32, 33, 40, 130, 260])
@pytest.mark.parametrize("n0,n1", [(0, 1), (3, 29), (7, 8), (13, 45), (36, 70), (64, 70)])
def test_column_ranges(m, n0, n1):
    x = RNG.standard_normal((m, 65)).astype(np.float32)
    w = RNG.standard_normal((70, 65)).astype(np.float32)
    check(_core.testing.kernel_matmul("avx512_bf16", x, w, "bf16", n0, n1), x, w, n0, n1)


@needs_bf16
def test_rounding_and_special_values():
    # exact bf16 inputs with an exactly representable result: any activation rounding error shows
    x = np.array([[1.0, 2.0, -3.0, 0.5], [1.00390625, 1.0, 0.0, -0.0]], np.float32)  # 1 + 2^-8 is a tie: rounds to 1
    w = np.array([[1.0, 1.0, 1.0, 1.0], [2.0, -1.0, 4.0, 8.0]], np.float32)
    y = _core.testing.kernel_matmul("avx512_bf16", x, w, "bf16")
    np.testing.assert_array_equal(y, [[0.5, -8.0], [2.0, 1.0]])
    x[0, 0] = np.inf
    assert np.isposinf(_core.testing.kernel_matmul("avx512_bf16", x, w, "bf16")[0, 0])
    x[0, 0] = np.nan
    assert np.isnan(_core.testing.kernel_matmul("avx512_bf16", x, w, "bf16")[0]).all()


@needs_bf16
def test_fp32_weights_unchanged():
    x = RNG.standard_normal((20, 100)).astype(np.float32)
    w = RNG.standard_normal((30, 100)).astype(np.float32)
    np.testing.assert_array_equal(_core.testing.kernel_matmul("avx512_bf16", x, w, "fp32"),
                                  _core.testing.kernel_matmul("avx512", x, w, "fp32"))
