"""AMX GEMM kernels (cpp/kernels/amx). The kernel source is built twice: against a scalar emulation of
the tile instructions (runs on every CPU: these tests check packing, blocking and tails with it) and
against the real intrinsics (compared with the emulation only where CPUID and the OS allow AMX)."""
import numpy as np
import pytest

from corelm import _core  # a broken build must fail the tests, not skip them

RNG = np.random.default_rng(4321)
HAVE_AMX = _core.amx_available()
NO_AMX_REASON = "real AMX unavailable: " + (_core.amx_info()["reason"] or "?")
needs_amx = pytest.mark.skipif(not HAVE_AMX, reason=NO_AMX_REASON)


def bf16_round(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 -> fp32, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (u.astype(np.uint32) << 16).view(np.float32)


def bf16_bits(vals) -> np.ndarray:
    return (bf16_round(np.asarray(vals, np.float32)).view(np.uint32) >> 16).astype(np.uint16)


def sequential_reference(x, w):
    """bf16(x) . bf16(w)^T accumulated in fp32 in ascending k, one rounding per product-add: the order
    the SDM gives for TDPBF16PS (bf16 x bf16 products are exact in fp32), so the emulated kernel must
    match it bit for bit, whatever its blocking."""
    xb, wb = bf16_round(x), bf16_round(w)
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for k in range(x.shape[1]):
        acc = acc + np.outer(xb[:, k], wb[:, k]).astype(np.float32)
    return acc


def fp32_tolerance(x, w):
    """A bound on fp32 accumulation error for any summation order: K * eps * sum |x_k w_k|."""
    mag = np.abs(bf16_round(x)).astype(np.float64) @ np.abs(bf16_round(w)).astype(np.float64).T
    return x.shape[1] * 2.0 ** -23 * mag + 1e-30


def normal(shape):
    return RNG.standard_normal(shape).astype(np.float32)


MS = [1, 15, 16, 17, 33]
NS = [1, 16, 31, 64]
KS = [2, 32, 62, 64, 100, 1024]


# -------------------------------------------------------------------------------------------------
# The emulation itself, on single instructions computed by hand from the SDM definitions.

def f32_bytes(vals, rows=1):
    return np.asarray(vals, np.float32).view(np.uint8).reshape(rows, -1)


def bf16_tile(vals, rows=1):
    return bf16_bits(vals).view(np.uint8).reshape(rows, -1)


def dpbf16(c, a, b, b_rows=1, emulated=True):
    out = _core.testing.amx_tile_dp("tdpbf16ps", f32_bytes(c), bf16_tile(a), bf16_tile(b, b_rows), emulated)
    return out.view(np.float32)


def dpbssd(c, a, b, c_rows=1, b_rows=1, emulated=True):
    cb = np.asarray(c, np.int32).view(np.uint8).reshape(c_rows, -1)
    ab = np.asarray(a, np.int8).view(np.uint8).reshape(c_rows, -1)
    bb = np.asarray(b, np.int8).view(np.uint8).reshape(b_rows, -1)
    return _core.testing.amx_tile_dp("tdpbssd", cb, ab, bb, emulated).view(np.int32)


@pytest.mark.parametrize("emulated", [True, pytest.param(False, marks=needs_amx)])
def test_tdpbssd_hand_examples(emulated):
    # One dword: 10 + 1*5 + (-2)*6 + 3*(-7) + (-128)*(-128) = 16366.
    assert dpbssd([10], [1, -2, 3, -128], [5, 6, -7, -128], emulated=emulated)[0, 0] == 16366
    # C 2x2 (colsb 8), A 2x2 dwords (K = 8 bytes), B 2 rows x 2 dwords:
    # C[m][n] = sum_k sum_i A[m][4k+i] * B[k][4n+i]
    a = [[1, 2, 3, 4, -1, -1, -1, -1],
         [0, 0, 0, 1, 2, 0, 0, 0]]
    b = [[1, 1, 1, 1, 1, 0, 0, 0],   # k = 0: column 0 = (1,1,1,1), column 1 = (1,0,0,0)
         [2, 2, 2, 2, 0, 0, 0, -3]]  # k = 1: column 0 = (2,2,2,2), column 1 = (0,0,0,-3)
    # row 0: n0 = (1+2+3+4) + (-8) = 2, n1 = 1 + 3 = 4; row 1: n0 = 1 + 4 = 5, n1 = 0 + 0 = 0
    got = dpbssd([[0, 0], [100, -100]], a, b, c_rows=2, b_rows=2, emulated=emulated)
    np.testing.assert_array_equal(got, [[2, 4], [105, -100]])
    # 32-bit wrap-around, no saturation.
    assert dpbssd([2**31 - 1], [1, 0, 0, 0], [1, 0, 0, 0], emulated=emulated)[0, 0] == -2**31


def test_tdpbf16ps_emulation_follows_the_sdm():
    assert dpbf16([0.25], [1.0, 2.0], [3.0, 0.5])[0, 0] == 4.25
    e = 2.0 ** -24  # half an ulp of 1.0
    # Two FMAs in sequence, each rounded to nearest even: 1 + e -> 1, twice.
    assert dpbf16([1.0], [1.0, 1.0], [e, e])[0, 0] == 1.0
    # ... and across the K pairs of one instruction, in ascending k.
    assert dpbf16([1.0], [1.0, 0.0] * 16, [e, 0.0] * 16, b_rows=16)[0, 0] == 1.0
    # DAZ: a bf16 denormal input is zero (2^-128 * 2^100 would be 2^-28 otherwise).
    den = np.array([0x0020], np.uint16)  # bf16 denormal 2^-128
    out = _core.testing.amx_tile_dp("tdpbf16ps", f32_bytes([1.0]), np.concatenate([den, bf16_bits([0.0])]).view(np.uint8)[None],
                            bf16_tile([2.0 ** 100, 0.0]), True)
    assert out.view(np.float32)[0, 0] == 1.0
    # FTZ: a denormal result is flushed to zero (2^-70 * 2^-70 = 2^-140).
    assert dpbf16([0.0], [2.0 ** -70, 0.0], [2.0 ** -70, 0.0])[0, 0] == 0.0


@needs_amx
def test_tdpbf16ps_hardware_on_exact_examples():
    # Results that need no rounding are the same whatever order the hardware sums in.
    assert dpbf16([0.25], [1.0, 2.0], [3.0, 0.5], emulated=False)[0, 0] == 4.25
    assert dpbf16([0.0], [2.0 ** -70, 0.0], [2.0 ** -70, 0.0], emulated=False)[0, 0] == 0.0
    x = RNG.integers(-8, 9, size=32).astype(np.float32)
    w = RNG.integers(-8, 9, size=(16, 32)).astype(np.float32)
    tile_b = bf16_bits(w.reshape(16, 16, 2).transpose(1, 0, 2)).view(np.uint8).reshape(16, 64)  # {k/2, n, 2}
    for emulated in (True, False):
        out = _core.testing.amx_tile_dp("tdpbf16ps", np.zeros((1, 64), np.uint8), bf16_tile(x), tile_b, emulated)
        np.testing.assert_array_equal(out.view(np.float32)[0], w @ x)


@needs_amx
def test_tdpbf16ps_hardware_summation_order():
    """The SDM writes one rounded FMA per product; the Sapphire Rapids hardware sums an instruction's
    products first, then adds them to C. Either order is accepted; this records which one runs here."""
    e = 2.0 ** -24
    hw = dpbf16([1.0], [1.0, 0.0] * 16, [e, 0.0] * 16, b_rows=16, emulated=False)[0, 0]
    assert hw in (np.float32(1.0), np.float32(1.0 + 16 * e))


def test_emulation_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="A.colsb != 4 \\* B.rows"):
        _core.testing.amx_tile_dp("tdpbssd", np.zeros((1, 4), np.uint8), np.zeros((1, 8), np.uint8),
                          np.zeros((1, 4), np.uint8), True)
    with pytest.raises(RuntimeError, match="B.colsb != C.colsb"):
        _core.testing.amx_tile_dp("tdpbf16ps", np.zeros((1, 8), np.uint8), np.zeros((1, 4), np.uint8),
                          np.zeros((1, 4), np.uint8), True)
    with pytest.raises(RuntimeError, match="larger than 16 rows"):
        _core.testing.amx_tile_dp("tdpbssd", np.zeros((17, 4), np.uint8), np.zeros((17, 4), np.uint8),
                          np.zeros((1, 4), np.uint8), True)
    # After a fault the emulated state is released and the kernels still work.
    assert dpbf16([0.25], [1.0, 2.0], [3.0, 0.5])[0, 0] == 4.25


# -------------------------------------------------------------------------------------------------
# AMX-BF16 GEMM

@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", MS)
def test_bf16_gemm_emulated(m, n, k):
    x, w = normal((m, k)), normal((n, k))
    y = _core.testing.kernel_amx_bf16_gemm(x, w, True)
    assert y.shape == (m, n) and y.dtype == np.float32
    # Zero-padded K adds exact zeros, so the emulation equals the sequential fp32 order bit for bit.
    np.testing.assert_array_equal(y, sequential_reference(x, w))
    ref64 = bf16_round(x).astype(np.float64) @ bf16_round(w).astype(np.float64).T
    assert np.all(np.abs(y - ref64) <= fp32_tolerance(x, w))


@needs_amx
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", MS)
def test_bf16_gemm_real_vs_emulated(m, n, k):
    x, w = normal((m, k)), normal((n, k))
    real = _core.testing.kernel_amx_bf16_gemm(x, w, False)
    emu = _core.testing.kernel_amx_bf16_gemm(x, w, True)
    # The hardware sums an instruction's products before adding them to C (the SDM writes one FMA
    # at a time), so the two differ by fp32 rounding only.
    assert np.all(np.abs(real - emu) <= 2 * fp32_tolerance(x, w))


def test_bf16_gemm_large_and_special_values():
    x = RNG.standard_normal((40, 96)).astype(np.float32)
    w = RNG.standard_normal((48, 96)).astype(np.float32)
    x[3, :] = 0.0
    w[5, 7] = 3.0e38
    y = _core.testing.kernel_amx_bf16_gemm(x, w, True)
    np.testing.assert_array_equal(y[3], np.zeros(48, np.float32))
    with np.errstate(over="ignore", invalid="ignore"):  # 3e38 * |x| > fp32 max: inf in both
        np.testing.assert_array_equal(y, sequential_reference(x, w))


def test_bf16_gemm_real_without_amx_raises():
    if HAVE_AMX:
        pytest.skip("AMX is available here")
    with pytest.raises(RuntimeError, match="not available"):
        _core.testing.kernel_amx_bf16_gemm(np.ones((1, 2), np.float32), np.ones((1, 2), np.float32), False)


# -------------------------------------------------------------------------------------------------
# AMX-INT8 GEMM

def int8(shape):
    return RNG.integers(-128, 128, size=shape, dtype=np.int8)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", MS)
def test_int8_gemm_emulated_exact(m, n, k):
    xq, wq = int8((m, k)), int8((n, k))
    y = _core.testing.kernel_amx_int8_gemm(xq, wq, True)
    assert y.dtype == np.int32 and y.shape == (m, n)
    np.testing.assert_array_equal(y, xq.astype(np.int64) @ wq.astype(np.int64).T)


def scaled_reference(xq, wq, xs, ws, group):
    m, k = xq.shape
    g = k if group == 0 else group
    ref = np.zeros((m, wq.shape[0]), np.float64)
    for j in range(k // g):
        part = xq[:, j * g:(j + 1) * g].astype(np.int64) @ wq[:, j * g:(j + 1) * g].astype(np.int64).T
        ref += xs[:, j:j + 1].astype(np.float64) * ws[:, j].astype(np.float64)[None, :] * part
    return ref


@pytest.mark.parametrize("emulated", [True, pytest.param(False, marks=needs_amx)])
@pytest.mark.parametrize("m,n,k,group", [(1, 1, 2, 0), (17, 31, 100, 0), (33, 64, 1024, 0), (15, 16, 1024, 64),
                                         (33, 31, 1024, 256), (16, 64, 128, 64), (5, 17, 192, 64)])
def test_int8_gemm_scaled(emulated, m, n, k, group):
    xq, wq = int8((m, k)), int8((n, k))
    ng = 1 if group == 0 else k // group
    xs = RNG.uniform(0.001, 0.02, (m, ng)).astype(np.float32)
    ws = RNG.uniform(0.001, 0.02, (n, ng)).astype(np.float32)
    y = _core.testing.kernel_amx_int8_gemm(xq, wq, emulated, xs, ws, group)
    assert y.dtype == np.float32
    ref = scaled_reference(xq, wq, xs, ws, group)
    np.testing.assert_allclose(y, ref, rtol=2e-6 * ng, atol=1e-6 * np.abs(ref).max())


def quantize_reference(x, group):
    m, k = x.shape
    g = k if group == 0 else group
    xg = x.reshape(m, k // g, g)
    amax = np.abs(xg).max(axis=2)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xg * inv[:, :, None]), -127, 127).astype(np.int8).reshape(m, k)
    return q, (amax / np.float32(127)).astype(np.float32)


@pytest.mark.parametrize("m,k,group", [(1, 1, 0), (3, 100, 0), (5, 256, 64), (2, 192, 0)])
def test_quantize_rows(m, k, group):
    x = normal((m, k)) * 3
    x[0, : min(k, 64 if group else k)] = 0.0  # an all-zero group gets scale 0
    q, s = _core.testing.amx_quantize_rows(x, group)
    q_ref, s_ref = quantize_reference(x, group)
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(s, s_ref)
    g = k if group == 0 else group
    err = np.abs(q.reshape(m, -1, g) * s[:, :, None] - x.reshape(m, -1, g))
    assert np.all(err <= s[:, :, None] * 0.5 * (1 + 1e-6) + 1e-30)


@pytest.mark.parametrize("emulated", [True, pytest.param(False, marks=needs_amx)])
@pytest.mark.parametrize("group", [0, 64])
def test_int8_gemm_from_fp32(emulated, group):
    """fp32 x and W through the int8 formats end to end: close to the fp32 product."""
    x, w = normal((33, 256)), normal((40, 256))
    xq, xs = _core.testing.amx_quantize_rows(x, group)
    wq, ws = _core.testing.amx_quantize_rows(w, group)
    y = _core.testing.kernel_amx_int8_gemm(xq, wq, emulated, xs, ws, group)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.mean((y - ref) ** 2) / np.mean(ref ** 2) < 1e-3


def test_int8_gemm_rejects_bad_groups():
    xq, wq = int8((2, 100)), int8((3, 100))
    with pytest.raises(ValueError):
        _core.testing.kernel_amx_int8_gemm(xq, wq, True, np.ones((2, 2), np.float32), np.ones((3, 2), np.float32), 50)


@needs_amx
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", MS)
def test_int8_gemm_real_vs_emulated(m, n, k):
    xq, wq = int8((m, k)), int8((n, k))
    np.testing.assert_array_equal(_core.testing.kernel_amx_int8_gemm(xq, wq, False), _core.testing.kernel_amx_int8_gemm(xq, wq, True))


@pytest.mark.parametrize("emulated", [True, pytest.param(False, marks=needs_amx)])
@pytest.mark.parametrize("n0,n1", [(0, 16), (16, 31), (16, 64), (32, 33), (48, 70), (64, 70), (0, 0)])
def test_column_ranges(emulated, n0, n1):
    """The callers split N across threads in whole 16-column tiles: a range computes exactly its columns."""
    x, w = normal((19, 70)), normal((70, 70))
    y = _core.testing.kernel_amx_bf16_gemm(x, w, emulated, n0, n1)
    full = _core.testing.kernel_amx_bf16_gemm(x, w, emulated)
    np.testing.assert_array_equal(y[:, n0:n1], full[:, n0:n1])
    assert not y[:, :n0].any() and not y[:, n1:].any()
    xq, wq = int8((19, 70)), int8((70, 70))
    yq = _core.testing.kernel_amx_int8_gemm(xq, wq, emulated, n0=n0, n1=n1)
    np.testing.assert_array_equal(yq[:, n0:n1], (xq.astype(np.int64) @ wq.astype(np.int64).T)[:, n0:n1])
    assert not yq[:, :n0].any() and not yq[:, n1:].any()


def test_column_range_must_start_on_a_tile():
    with pytest.raises(ValueError, match="multiple of 16"):
        _core.testing.kernel_amx_bf16_gemm(normal((2, 8)), normal((40, 8)), True, 8, 40)
    with pytest.raises(ValueError):
        _core.testing.kernel_amx_int8_gemm(int8((2, 8)), int8((40, 8)), True, n0=0, n1=41)


def test_amx_info_reports_a_reason():
    info = _core.amx_info()
    assert info["available"] == HAVE_AMX
    assert info["available"] or info["reason"]
    assert _core.cpu_info()["amx"]["available"] == HAVE_AMX


def test_cli_info_has_an_amx_line(capsys):
    from corelm.entrypoints import cli
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("AMX:")]
    assert len(line) == 1
    assert ("available" in line[0]) == HAVE_AMX and ("absent" in line[0]) == (not HAVE_AMX)


# -------------------------------------------------------------------------------------------------
# The kernel table that hands bf16 weights to the AMX-BF16 GEMM in the forward pass ("amx" where the
# hardware allows, the default there; "amx_emulated", the same table on the emulation, anywhere).

AMX_TABLES = ["amx_emulated"] + (["amx"] if HAVE_AMX else [])


def test_amx_tables_are_listed_only_where_they_run():
    tables = _core.kernel_tables()
    assert ("amx" in tables) == HAVE_AMX
    assert "amx_emulated" not in tables             # by name only: it is a test vehicle
    assert (tables[0] == "amx") == HAVE_AMX         # the default wherever it runs
    if not HAVE_AMX:
        with pytest.raises(Exception):
            _core.testing.kernel_matmul("amx", normal((1, 32)), normal((16, 32)), "bf16")


@pytest.mark.parametrize("isa", AMX_TABLES)
@pytest.mark.parametrize("k", [2, 62, 100])
@pytest.mark.parametrize("n", [1, 31, 64])
@pytest.mark.parametrize("m", [1, 17, 33])
def test_amx_table_bf16_matmul_is_the_gemm(isa, m, n, k):
    """The table's bf16 matmul is the AMX GEMM on the same tiles, for decode's single row and prefill's many."""
    x, w = normal((m, k)), normal((n, k))
    y = _core.testing.kernel_matmul(isa, x, w, "bf16")
    np.testing.assert_array_equal(y, _core.testing.kernel_amx_bf16_gemm(x, w, isa == "amx_emulated"))


@pytest.mark.parametrize("isa", AMX_TABLES)
@pytest.mark.parametrize("n0,n1", [(0, 70), (5, 9), (5, 16), (5, 40), (15, 17), (16, 33), (69, 70), (3, 3)])
def test_amx_table_any_row_range(isa, n0, n1):
    """The model splits rows in multiples of 16, but the table takes any range (a scratch panel covers
    a start inside a panel) and writes nothing outside it."""
    x, w = normal((19, 70)), normal((70, 70))
    full = _core.testing.kernel_matmul(isa, x, w, "bf16")
    y = _core.testing.kernel_matmul(isa, x, w, "bf16", n0, n1)
    np.testing.assert_array_equal(y[:, n0:n1], full[:, n0:n1])
    assert not y[:, :n0].any() and not y[:, n1:].any()


@pytest.mark.parametrize("isa", AMX_TABLES)
@pytest.mark.parametrize("n,k", [(1, 2), (17, 33), (40, 100)])
def test_amx_table_reads_rows_back(isa, n, k):
    """Embedding lookups read rows out of the tiles: bf16(W[row]) exactly, past the N and K padding."""
    w = normal((n, k))
    for row in sorted({0, n // 2, 15 % n, n - 1}):
        np.testing.assert_array_equal(_core.testing.kernel_row_to_f32(isa, w, "bf16", row), bf16_round(w[row]))


@pytest.mark.parametrize("isa", AMX_TABLES)
@pytest.mark.parametrize("wtype", ["fp32", "q8", "q4"])
@pytest.mark.parametrize("m", [1, 5, 32, 40])
def test_amx_table_leaves_other_formats_to_the_base_table(isa, wtype, m):
    """fp32 weights always, and quantized ones in decode and small batches (up to kRowExactRows = 32 rows:
    speculative checks must get decode's bits), are the base table's, packed as it packs them."""
    base = _core.cpu_info()["kernels"]["matmul_q8"]  # the best non-AMX table here
    x, w = normal((m, 96)), normal((40, 96))
    if wtype == "fp32" or m <= 32:
        np.testing.assert_array_equal(_core.testing.kernel_matmul(isa, x, w, wtype), _core.testing.kernel_matmul(base, x, w, wtype))
    assert _core.testing.kernel_packed_bytes(isa, w, wtype) == _core.testing.kernel_packed_bytes(base, w, wtype)


def dequantized(isa, w, wtype):
    return np.stack([_core.testing.kernel_row_to_f32(isa, w, wtype, r) for r in range(len(w))])


@pytest.mark.parametrize("isa", AMX_TABLES)
@pytest.mark.parametrize("wtype", ["q8", "q4", "q4m"])
def test_amx_table_prefill_multiplies_quantized_weights_as_bf16(isa, wtype):
    """Past 32 rows, quantized weights are dequantized 16 rows at a time (AVX-512 on real AMX, the base
    table's rows on the emulation) into bf16 tiles: exactly the AMX GEMM of the dequantized matrix, over
    row, token and K tails and any row range."""
    rng = np.random.default_rng(11)
    for n, k, m in ((40, 96, 33), (37, 64, 70), (70, 320, 45), (16, 32, 100)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = _core.testing.kernel_matmul(isa, x, dequantized(isa, w, wtype), "bf16")
        np.testing.assert_array_equal(_core.testing.kernel_matmul(isa, x, w, wtype), want)
        # the two-step matmul (the forward pass's: x rounded to bf16 once per region), the same bits
        np.testing.assert_array_equal(_core.testing.kernel_matmul(isa, x, w, wtype, activations="int16"), want)
        for n0, n1 in ((0, 3), (5, 14), (16, n), (n - 1, n)):
            y = _core.testing.kernel_matmul(isa, x, w, wtype, n0, n1)
            np.testing.assert_array_equal(y[:, n0:n1], want[:, n0:n1])
            assert not y[:, :n0].any() and not y[:, n1:].any()


@pytest.mark.parametrize("isa", AMX_TABLES)
def test_amx_table_prefill_multiplies_gguf_blocks_as_bf16(isa):
    """The same for every grouped GGUF type (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS), extreme blocks
    included; Q2_K and Q3_K stay with the base table."""
    gguf_blocks = pytest.importorskip("test_ggml_blocks")
    for t in gguf_blocks.TYPES:
        be, _ = gguf_blocks.block_of(t)
        for rows, nb, extreme in ((37, 3 if be == 256 else 20, False), (21, 2 if be == 256 else 9, True)):
            cols = nb * be
            raw = gguf_blocks.random_blocks(t, rows, nb, seed=rows, extreme=extreme)
            x = np.random.default_rng(rows).standard_normal((40, cols)).astype(np.float32)
            y = _core.testing.kernel_matmul_raw(isa, x, raw, t, rows, cols, "int16")
            if t in ("Q2_K", "Q3_K"):
                base = _core.cpu_info()["kernels"]["matmul_q8"]
                np.testing.assert_array_equal(y, _core.testing.kernel_matmul_raw(base, x, raw, t, rows, cols, "int16"))
                continue
            want = _core.testing.kernel_matmul(isa, x, _core.testing.kernel_raw_to_f32(isa, raw, t, rows, cols), "bf16")
            np.testing.assert_array_equal(y, want, err_msg=f"{t} {rows}x{cols}")
            part = _core.testing.kernel_matmul_raw(isa, x, raw, t, rows, cols, "int16", 5, 19)
            np.testing.assert_array_equal(part[:, 5:19], want[:, 5:19])
            assert not part[:, :5].any() and not part[:, 19:].any()


@pytest.mark.parametrize("isa", AMX_TABLES)
def test_amx_table_runs_the_forward_pass(isa):
    """A bf16 model on the AMX table (a subprocess: the table is chosen at import) gives transformers'
    greedy tokens and logits as the bf16 check in test_models does, prefill and decode alike."""
    from conftest import FIXTURES, MODELS, run_with_isa
    code = (
        "import json, os, sys, numpy as np, corelm\n"
        "from corelm import _core\n"
        "sys.path.insert(0, 'tools/bench')\n"
        "from core_forward import core_forward\n"
        "fixtures, models, isa = sys.argv[1:4]\n"
        "assert _core.cpu_info()['kernels']['matmul_bf16'] == isa\n"
        "for name in ('stories260K', 'tiny-qwen2'):\n"
        "    fx = json.load(open(os.path.join(fixtures, name + '.json')))\n"
        "    llm = corelm.LLM(os.path.join(models, name), dtype='bf16', threads=2)\n"
        "    assert llm.engine.core.kernel_table == isa\n"
        "    for c in fx['cases']:\n"
        "        ref = np.load(os.path.join(fixtures, c['last_logits']))\n"
        "        llm.reset()\n"
        "        y = core_forward(llm.engine.core, c['prompt_ids'], 0, False)\n"
        "        nmse = float(np.mean((y - ref) ** 2) / np.mean(ref ** 2))\n"
        "        assert nmse < 1e-3, (name, nmse)\n"
        "        llm.reset()\n"
        "        p = corelm.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)\n"
        "        got = llm.generate([c['prompt_ids']], p)[0].outputs[0].token_ids\n"
        "        margins = c.get('margins') or [1.0] * 16\n"
        "        first_tie = next((i for i, m in enumerate(margins[:16]) if m < 0.2), 16)\n"
        "        assert got[:first_tie] == c['generated_ids'][:first_tie], (name, got, c['generated_ids'][:16])\n"
        "print('ok')\n"
    )
    r = run_with_isa(isa, code, FIXTURES, MODELS, isa)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
