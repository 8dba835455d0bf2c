"""Every kernel table against a float64 numpy reference (and so against the scalar table), over
awkward shapes: K not a multiple of the vector width, one row, thousands of rows."""
import os

import numpy as np
import pytest

from corelm import _core  # a broken build must fail the tests, not skip them

TABLES = _core.kernel_tables() + ["amx_emulated"]  # the AMX table on the tile emulation
RNG = np.random.default_rng(1234)


def bf16_round(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 -> fp32 with round-to-nearest-even, the way pack_matrix stores bf16 weights."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (u.astype(np.uint32) << 16).view(np.float32)


def nmse(y, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.mean((np.asarray(y, np.float64) - ref) ** 2) / max(np.mean(ref ** 2), 1e-30))


def rounds_activations(isa, wtype, m):
    """The AVX512_BF16 table multiplies bf16 weights by bf16-rounded activations (VDPBF16PS) when m >= 2,
    the AMX tables (TDPBF16PS) always."""
    return wtype == "bf16" and (isa.startswith("amx") or (isa == "avx512_bf16" and m >= 2))


def test_scalar_table_always_present():
    assert "scalar" in TABLES
    info = _core.cpu_info()
    assert set(info["kernels"].values()) <= set(TABLES)


SHAPES = [(1, 1, 1), (1, 7, 15), (1, 33, 16), (1, 9, 17), (1, 4099, 65), (2, 5, 31), (3, 17, 100),
          (4, 8, 64), (5, 21, 129), (7, 3, 257), (9, 17, 96), (16, 37, 129), (31, 9, 100), (32, 40, 64),
          (33, 41, 65), (130, 37, 896), (1, 64, 4864), (2000, 3, 48)]


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("wtype", ["fp32", "bf16"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matmul(isa, wtype, m, n, k):
    x = RNG.standard_normal((m, k)).astype(np.float32)
    w = RNG.standard_normal((n, k)).astype(np.float32)
    w_used = bf16_round(w) if wtype == "bf16" else w
    x_used = bf16_round(x) if rounds_activations(isa, wtype, m) else x
    ref = x_used.astype(np.float64) @ w_used.astype(np.float64).T
    y = _core.testing.kernel_matmul(isa, x, w, wtype)
    assert y.shape == (m, n)
    # fp32 accumulation over K terms: error grows like sqrt(K) * eps * |terms|
    tol = 2e-6 * k + 1e-6
    np.testing.assert_allclose(y, ref, rtol=0, atol=tol)


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("wtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(9, 31), (37, 129), (70, 65), (16, 8)])
def test_matmul_every_batch_size(isa, wtype, n, k):
    """m = 1..40: decode, every split of a small batch into row strips, and the prefill path past it."""
    w = RNG.standard_normal((n, k)).astype(np.float32)
    w_used = (bf16_round(w) if wtype == "bf16" else w).astype(np.float64)
    for m in range(1, 41):
        x = RNG.standard_normal((m, k)).astype(np.float32)
        x_used = bf16_round(x) if rounds_activations(isa, wtype, m) else x
        y = _core.testing.kernel_matmul(isa, x, w, wtype)
        np.testing.assert_allclose(y, x_used.astype(np.float64) @ w_used.T, rtol=0, atol=2e-6 * k + 1e-6,
                                   err_msg=f"m={m}")


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("wtype", ["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 33, 40])
@pytest.mark.parametrize("n0,n1", [(0, 1), (3, 29), (7, 8), (13, 45), (16, 32), (36, 70), (64, 70), (5, 69)])
def test_matmul_row_ranges(isa, wtype, m, n0, n1):
    """One thread's share [n0, n1) of the rows, cutting through the layouts' row groups: exactly those
    columns of y are written, the rest stay untouched."""
    x = RNG.standard_normal((m, 65)).astype(np.float32)
    w = RNG.standard_normal((70, 65)).astype(np.float32)
    x_used = bf16_round(x) if rounds_activations(isa, wtype, m) else x
    ref = x_used.astype(np.float64) @ (bf16_round(w) if wtype == "bf16" else w).astype(np.float64).T
    y = _core.testing.kernel_matmul(isa, x, w, wtype, n0, n1)
    np.testing.assert_allclose(y[:, n0:n1], ref[:, n0:n1], rtol=0, atol=2e-6 * 65 + 1e-6)
    assert not y[:, :n0].any() and not y[:, n1:].any()


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("wtype", ["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 2, 5, 40])
def test_matmul_row_split_keeps_the_bits(isa, wtype, m):
    """However the rows are split across threads, each row's result is the same to the bit (the model
    relies on it: logits must not depend on the thread count or the NUMA split)."""
    x = RNG.standard_normal((m, 70)).astype(np.float32)
    w = RNG.standard_normal((150, 70)).astype(np.float32)
    full = _core.testing.kernel_matmul(isa, x, w, wtype)
    for cuts in ([0, 32, 64, 150], [0, 17, 48, 49, 112, 150], [0, 80, 150]):
        y = sum(_core.testing.kernel_matmul(isa, x, w, wtype, a, b) for a, b in zip(cuts, cuts[1:]))
        np.testing.assert_array_equal(y, full, err_msg=f"cuts {cuts}")


def test_bf16_rounding_matches_reference():
    special = np.array([0.0, -0.0, 1.0, 1.00390625, 1.0078125, 3.0e38, -1e-40, 1.5, 65504.0], np.float32)
    w = np.concatenate([special, RNG.standard_normal(1000).astype(np.float32)])[None, :]
    for isa in TABLES:
        got = _core.testing.kernel_row_to_f32(isa, w, "bf16", 0)
        np.testing.assert_array_equal(got, bf16_round(w[0]))
        np.testing.assert_array_equal(_core.testing.kernel_row_to_f32(isa, w, "fp32", 0), w[0])


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("n", [1, 5, 16, 17, 64, 896, 1001])
def test_rmsnorm(isa, n):
    x = RNG.standard_normal(n).astype(np.float32) * 3
    w = RNG.standard_normal(n).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = w * (x64 / np.sqrt(np.mean(x64 * x64) + 1e-5))
    np.testing.assert_allclose(_core.testing.kernel_rmsnorm(isa, x, w, 1e-5), ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("n", [1, 3, 16, 31, 4864])
def test_silu_mul(isa, n):
    g = (RNG.standard_normal(n) * 6).astype(np.float32)
    g[:3] = [-100.0, 100.0, 0.0][: min(3, n)]
    u = RNG.standard_normal(n).astype(np.float32)
    g64 = g.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * u
    np.testing.assert_allclose(_core.testing.kernel_silu_mul(isa, g, u), ref, rtol=3e-6, atol=1e-6)


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("n", [1, 3, 16, 31, 6912])
def test_gelu_tanh_mul(isa, n):
    # GeGLU as transformers' gelu_pytorch_tanh computes it, in float64
    g = (RNG.standard_normal(n) * 4).astype(np.float32)
    g[:3] = [-100.0, 100.0, 0.0][: min(3, n)]
    u = RNG.standard_normal(n).astype(np.float32)
    g64 = g.astype(np.float64)
    ref = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3))) * u
    np.testing.assert_allclose(_core.testing.kernel_gelu_tanh_mul(isa, g, u), ref, rtol=3e-6, atol=1e-6)


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("n", [1, 3, 16, 31, 384, 1025])
def test_layernorm(isa, n):
    # an offset mean and a large scale: a one-pass variance would lose digits here
    x = (RNG.standard_normal(n) * 30 + 500).astype(np.float32)
    w = RNG.standard_normal(n).astype(np.float32)
    b = RNG.standard_normal(n).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean()) / np.sqrt(x64.var() + 1e-12) * w + b if n > 1 else b.astype(np.float64)
    np.testing.assert_allclose(_core.testing.kernel_layernorm(isa, x, w, b, 1e-12), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("n", [1, 3, 16, 31, 1536])
def test_gelu(isa, n):
    # BERT's exact GELU, x/2 (1 + erf(x / sqrt 2)), against math.erf in float64
    import math
    x = (RNG.standard_normal(n) * 4).astype(np.float32)
    x[:4] = [-100.0, 100.0, 0.0, -3.0][: min(4, n)]
    ref = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    np.testing.assert_allclose(_core.testing.kernel_gelu(isa, x), ref, rtol=1e-6, atol=5e-7)


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 100, 4097])
def test_softmax(isa, n):
    x = (RNG.standard_normal(n) * 10).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = np.exp(x64 - x64.max())
    ref /= ref.sum()
    y = _core.testing.kernel_softmax(isa, x)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-7)
    assert abs(float(y.sum()) - 1) < 1e-5


def test_tables_agree_with_scalar_on_large_matmul():
    x = RNG.standard_normal((33, 300)).astype(np.float32)
    w = RNG.standard_normal((77, 300)).astype(np.float32)
    for isa in TABLES:
        xs = bf16_round(x) if rounds_activations(isa, "bf16", len(x)) else x
        assert nmse(_core.testing.kernel_matmul(isa, x, w, "bf16"), _core.testing.kernel_matmul("scalar", xs, w, "bf16")) < 1e-12


def test_bad_kernel_arguments_raise():
    with pytest.raises(ValueError):
        _core.testing.kernel_matmul("scalar", np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32), "fp32")
    with pytest.raises(ValueError):
        _core.testing.kernel_matmul("no-such-isa", np.zeros((1, 4), np.float32), np.zeros((2, 4), np.float32), "fp32")
    with pytest.raises(ValueError):
        _core.testing.kernel_matmul("scalar", np.zeros((1, 4), np.float32), np.zeros((2, 4), np.float32), "q3")


def test_option_names_are_canonical():
    names = _core.option_names()
    ggml = ["q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
    assert names == {"weight_type": ["fp32", "bf16", "q8", "q4", "q4m"] + ggml + ["sbf16", "sq8", "sq4"],
                     "kv_type": ["fp32", "bf16", "int8"],
                     "activations": ["int8", "int16"], "schedule": ["dynamic", "static"],
                     "numa": ["default", "distribute", "isolate"],
                     "raw_weight": ["BF16", "Q8_0", "Q4_0", "Q4_1"] + [t.upper() for t in ggml] + ["SBF16", "SQ8", "SQ4"],
                     "activation": ["silu", "gelu_tanh", "gelu"]}
    # agreement with corelm.options: tests/loaders/test_options.py
    x, w = np.zeros((1, 32), np.float32), np.zeros((2, 32), np.float32)
    for alias in ("f32", "i8", "FP32"):  # the core takes canonical names only
        with pytest.raises(ValueError, match="weight type must be"):
            _core.testing.kernel_matmul("scalar", x, w, alias)
    with pytest.raises(ValueError, match="activations must be"):
        _core.testing.kernel_matmul("scalar", x, w, "q8", activations="i8")
    with pytest.raises(ValueError, match="numa must be"):
        _core.plan_threads(numa="")


def _kv_values(kv, rng, shape):
    """Random cached elements of type kv and their exact fp32 values."""
    if kv == "fp32":
        a = rng.standard_normal(shape).astype(np.float32)
        return a, a.astype(np.float64)
    if kv == "bf16":
        bits = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    a = rng.integers(-128, 128, shape).astype(np.int8)
    return a, a.astype(np.float64)


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("G,hd,ldk,n", [(1, 8, 1, 1), (2, 8, 16, 16), (7, 64, 16, 13), (3, 64, 32, 32),
                                        (9, 24, 7, 5), (8, 80, 48, 33), (17, 128, 16, 1), (5, 3, 20, 17),
                                        (1, 64, 80, 75), (2, 40, 64, 64), (4, 20, 40, 37), (1, 37, 40, 40),
                                        (3, 19, 35, 35)])
def test_kv_scores_and_accum(isa, kv, G, hd, ldk, n):
    """Attention over one KV block for G heads: keys transposed [hd][ldk] (first n tokens used), values
    [n][hd]; head counts past one register tile (8), head_dim and token counts off the 16-lane grid,
    and few heads with 32 tokens or channels per pass and a tail (the AVX2 tiles)."""
    rng = np.random.default_rng(G * 1000 + hd + n)
    q = rng.standard_normal((G, hd)).astype(np.float32)
    k, k64 = _kv_values(kv, rng, (hd, ldk))
    s = _core.testing.kernel_kv_scores(isa, kv, q, k, ldk, n)
    ref = q.astype(np.float64) @ k64[:, :n]
    np.testing.assert_allclose(s, ref, rtol=1e-5, atol=1e-4 * np.sqrt(hd) * np.abs(k64).max())
    p = rng.random((G, n)).astype(np.float32)
    v, v64 = _kv_values(kv, rng, (n, hd))
    out0 = rng.standard_normal((G, hd)).astype(np.float32)
    y = _core.testing.kernel_kv_accum(isa, kv, p, v, hd, out0)
    np.testing.assert_allclose(y, out0 + p.astype(np.float64) @ v64, rtol=1e-5, atol=1e-4 * np.sqrt(n) * np.abs(v64).max())


def test_kv_kernel_arguments_are_checked():
    q = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError):
        _core.testing.kernel_kv_scores("scalar", "bf16", q, np.zeros((8, 16), np.float32), 16, 16)  # wrong dtype
    with pytest.raises(ValueError):
        _core.testing.kernel_kv_scores("scalar", "fp32", q, np.zeros((8, 4), np.float32), 16, 16)   # too small
    with pytest.raises(ValueError):
        _core.testing.kernel_kv_scores("scalar", "fp32", q, np.zeros((8, 16), np.float32), 16, 17)  # n > ldk


@pytest.mark.parametrize("isa", _core.kernel_tables())
def test_few_rows_get_the_bits_of_one_row(isa):
    """Speculative decoding checks a sequence's proposed tokens in one pass of a few rows and keeps what
    decode would have sampled: through the table's row_exact table, each of up to 32 rows must get
    exactly the bits a one-row product (decode) gets, for every weight type and activation input."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_ggml_blocks import TYPES, block_of, random_blocks
    exact = _core.testing.kernel_row_exact(isa)
    rng = np.random.default_rng(3)
    n, k = 70, 512
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((33, k)).astype(np.float32)
    cases = [(wt, act) for wt in ("fp32", "bf16", "q8", "q4", "q4m") for act in (("int8", "int16") if wt[0] == "q" else ("int8",))]
    for wt, act in cases:
        one = np.stack([_core.testing.kernel_matmul(isa, x[i:i + 1], w, wt, activations=act)[0] for i in range(32)])
        for m in (2, 3, 5, 8, 17, 32):
            got = _core.testing.kernel_matmul(exact, x[:m], w, wt, activations=act)
            assert np.array_equal(got.view(np.uint32), one[:m].view(np.uint32)), (isa, exact, wt, act, m)
    for wt in ("fp32", "bf16"):   # a K past the last whole chunk (the rows' masked tail)
        w2, x2 = w[:, :77], x[:, :77]
        one = np.stack([_core.testing.kernel_matmul(isa, x2[i:i + 1], w2, wt)[0] for i in range(8)])
        for m in (2, 3, 5, 8):
            got = _core.testing.kernel_matmul(exact, x2[:m], w2, wt)
            assert np.array_equal(got.view(np.uint32), one[:m].view(np.uint32)), (isa, exact, wt, "K=77", m)
    for t in TYPES:
        raw = random_blocks(t, n, k // block_of(t)[0])
        for act in ("int8", "int16"):
            one = np.stack([_core.testing.kernel_matmul_raw(isa, x[i:i + 1], raw, t, n, k, act)[0] for i in range(32)])
            for m in (2, 5, 8, 32):
                got = _core.testing.kernel_matmul_raw(exact, x[:m], raw, t, n, k, act)
                assert np.array_equal(got.view(np.uint32), one[:m].view(np.uint32)), (isa, exact, t, act, m)
