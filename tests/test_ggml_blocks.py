"""GGUF block types multiplied as the file stores them (Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS;
cpp/kernels/ggml_formats.h): dequantization bit for bit as gguf.quants, every kernel table against the
scalar reference and against numpy, int8 and int16 activations, row ranges, decode == prefill rows."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from corelm import _core  # noqa: E402
from corelm.loader.gguf import _DECODERS  # noqa: E402
from corelm.options import GGUF_BLOCK_FORMATS, WEIGHT_FORMATS  # noqa: E402

TABLES = _core.kernel_tables()
TYPES = [WEIGHT_FORMATS[n].gguf for n in GGUF_BLOCK_FORMATS]
# byte ranges of each type's fp16 scale fields (random bytes there could be NaN/Inf or huge)
F16_FIELDS = {"Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def block_of(t):
    f = next(f for f in WEIGHT_FORMATS.values() if f.gguf == t)
    return f.block, f.block_bytes


def random_blocks(t, rows, blocks, seed=0, extreme=False):
    """Random raw blocks: every code, scale and high bit byte random; the fp16 scales finite and small
    (extreme: every byte 0xff but the scales, the largest codes and scales each type has)."""
    rng = np.random.default_rng(seed)
    _, bb = block_of(t)
    raw = np.full((rows, blocks, bb), 0xFF, np.uint8) if extreme else rng.integers(0, 256, (rows, blocks, bb), np.uint8)
    for off in F16_FIELDS[t]:
        d = (rng.standard_normal((rows, blocks)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


def reference(t, raw, rows, cols):
    return quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, t)).reshape(rows, cols).astype(np.float32)


def shapes(t):
    be, _ = block_of(t)
    return [(1, be), (7, 2 * be), (13, 3 * be), (37, be * (5 if be == 256 else 28))]  # rows % 8 != 0, odd blocks


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("extreme", [False, True])
def test_dequantize_bit_exact(t, extreme):
    for rows, cols in shapes(t):
        raw = random_blocks(t, rows, cols // block_of(t)[0], seed=rows, extreme=extreme)
        ref = reference(t, raw, rows, cols)
        for isa in TABLES:
            got = _core.testing.kernel_raw_to_f32(isa, raw, t, rows, cols)
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (isa, rows, cols)
        flat = _DECODERS[t](raw.reshape(-1), rows * cols).reshape(rows, cols)
        assert np.array_equal(flat.view(np.uint32), ref.view(np.uint32))


def quantized_activations(x, act):
    """x as every matmul takes it: per 32 columns dx = absmax/127 (int8) or /32767 (int16), q = round to
    even of x * (1/dx), in float32 as the kernels compute it; returned dequantized, q * dx."""
    top = np.float32(127 if act == "int8" else 32767)
    b = x.reshape(len(x), -1, 32).astype(np.float32)
    d = (np.abs(b).max(-1, keepdims=True) / top).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.rint((b * inv).astype(np.float32))
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("act", ["int8", "int16"])
def test_matmul_every_table(t, act):
    """Each table gives the dot of the dequantized weights with the quantized activations, up to fp32
    summation (relative to the sum of the terms' magnitudes)."""
    for rows, cols in shapes(t):
        raw = random_blocks(t, rows, cols // block_of(t)[0], seed=cols)
        w = reference(t, raw, rows, cols).astype(np.float64)
        for m in (1, 2, 5, 9):
            x = np.random.default_rng(m).standard_normal((m, cols)).astype(np.float32) * 3
            xq = quantized_activations(x, act)
            want, size = xq @ w.T, np.abs(xq) @ np.abs(w).T + 1e-30
            for isa in TABLES:
                y = _core.testing.kernel_matmul_raw(isa, x, raw, t, rows, cols, act)
                assert np.all(np.abs(y - want) / size < 1e-5), (isa, rows, cols, m)


@pytest.mark.parametrize("t", ["Q4_K", "Q6_K", "Q5_0", "Q2_K"])
def test_row_ranges_and_batch_invariance(t):
    """A thread's [n0, n1) writes only those rows, and a token's outputs are the same bits alone
    (decode) as among others (prefill)."""
    be, _ = block_of(t)
    rows, cols = 29, 4 * be
    raw = random_blocks(t, rows, 4, seed=3)
    x = np.random.default_rng(0).standard_normal((7, cols)).astype(np.float32)
    for isa in TABLES:
        for act in ("int8", "int16"):
            full = _core.testing.kernel_matmul_raw(isa, x, raw, t, rows, cols, act)
            part = _core.testing.kernel_matmul_raw(isa, x, raw, t, rows, cols, act, 5, 18)
            assert np.all(part[:, :5] == 0) and np.all(part[:, 18:] == 0)
            assert np.array_equal(part[:, 5:18], full[:, 5:18]), isa
            for i in range(len(x)):
                alone = _core.testing.kernel_matmul_raw(isa, x[i:i + 1], raw, t, rows, cols, act)
                assert np.array_equal(alone[0], full[i]), (isa, act, i)


def test_bad_raw_buffers_are_refused():
    raw = random_blocks("Q4_K", 2, 1)
    with pytest.raises(ValueError, match="multiple of 256"):
        _core.testing.kernel_matmul_raw("scalar", np.zeros((1, 128), np.float32), raw[:, :72], "Q4_K", 2, 128)
    with pytest.raises(ValueError, match="bytes"):
        _core.dequantize_gguf("Q6_K", np.zeros(209, np.uint8), 256)
    with pytest.raises(ValueError, match="GGUF type"):
        _core.dequantize_gguf("Q8_K", np.zeros(292, np.uint8), 256)
