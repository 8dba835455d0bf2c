"""Sparse Q8/Q4 weights (sq8/sq4, kernels/sparse_quant.h) through every kernel table. The sparse matrix
is the dense quantized matrix with its zero codes dropped, so every table's sparse product must have
the bits of the same table's dense product of the same matrix: for decode (one row, where AVX-512
expands the codes in registers), a few rows, prompts past the AMX table's 32 rows, int8 and int16
activations, awkward shapes (columns not a multiple of 32, rows not a multiple of 8 or 32) and
sparsity patterns (all-zero rows, blocks and groups, fully dense blocks, 99% sparse)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from corelm import _core
from test_quant import ggml_quantize
from test_sparse_kernels import pruned

T = _core.testing
TABLES = _core.kernel_tables() + ["amx_emulated"]  # the AMX table on the tile emulation
DTYPES = ["q8", "q4"]


def patterns(rng):
    """(name, w) for the shapes and patterns a sparse layout can get wrong."""
    out = [(f"{n}x{k} at {s}", pruned(rng, n, k, s)) for n, k, s in
           [(1, 1, 0.0), (7, 31, 0.5), (9, 33, 0.3), (37, 70, 0.5), (64, 896, 0.7), (33, 100, 0.99),
            (16, 64, 0.0), (100, 300, 0.5), (70, 1000, 0.6)]]
    w = pruned(rng, 72, 130, 0.5)
    w[3] = 0                      # an all-zero row
    w[8:16, 32:64] = 0            # an all-zero block of a whole group
    w[17] = rng.standard_normal(130)  # a fully dense row
    w[40:48, 64:96] = rng.standard_normal((8, 32))  # a fully dense block of a group
    w[24:32, :] = 0               # an all-zero group
    out.append(("zero rows, blocks and groups", w))
    out.append(("all zero", np.zeros((12, 40), np.float32)))
    return out


def same_bits(a, b):
    return np.array_equal(np.ascontiguousarray(a).view(np.uint32), np.ascontiguousarray(b).view(np.uint32))


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_quant_has_the_dense_bits(isa, dtype):
    rng = np.random.default_rng(11)
    for name, w in patterns(rng):
        n, k = w.shape
        for m in (1, 2, 5, 8, 33, 70):
            x = rng.standard_normal((m, k)).astype(np.float32)
            for act in ("int8", "int16"):
                dense = T.kernel_matmul(isa, x, w, dtype, activations=act)
                got = T.kernel_matmul(isa, x, w, "s" + dtype, activations=act)
                assert same_bits(got, dense), (isa, dtype, name, m, act, np.abs(got - dense).max())


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_quant_row_ranges_and_rows_out(isa, dtype):
    """A thread's row range [n0, n1) starting or ending inside a group or super-group, and rows read back."""
    rng = np.random.default_rng(12)
    w = pruned(rng, 77, 96, 0.5)
    for m in (1, 5, 40):
        x = rng.standard_normal((m, 96)).astype(np.float32)
        whole = T.kernel_matmul(isa, x, w, dtype)
        for n0, n1 in ((0, 3), (3, 11), (13, 45), (31, 33), (76, 77)):
            part = T.kernel_matmul(isa, x, w, "s" + dtype, n0, n1)
            assert same_bits(part[:, n0:n1], whole[:, n0:n1]), (isa, dtype, m, n0, n1)
            assert not part[:, :n0].any() and not part[:, n1:].any()
    for r in (0, 7, 8, 33, 76):
        assert same_bits(T.kernel_row_to_f32(isa, w, "s" + dtype, r), T.kernel_row_to_f32(isa, w, dtype, r))


def ggml_blocks(w, dtype):
    return np.ascontiguousarray(ggml_quantize(w, "Q8_0" if dtype == "q8" else "Q4_0"))


@pytest.mark.parametrize("isa", TABLES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_quant_from_raw_blocks(isa, dtype):
    """Packed from dense Q8_0/Q4_0 blocks (what the loader expands a sparse file tensor into): the dense
    blocks' product, and their values read back."""
    rng = np.random.default_rng(13)
    w = pruned(rng, 45, 256, 0.6)
    raw = ggml_blocks(w, dtype)
    ggml = "Q8_0" if dtype == "q8" else "Q4_0"
    for m in (1, 4, 40):
        x = rng.standard_normal((m, 256)).astype(np.float32)
        for act in ("int8", "int16"):
            dense = T.kernel_matmul_raw(isa, x, raw, ggml, 45, 256, act)
            assert same_bits(T.kernel_matmul_raw(isa, x, raw, "S" + dtype.upper(), 45, 256, act), dense), (isa, m, act)
    assert same_bits(T.kernel_raw_to_f32(isa, raw, "S" + dtype.upper(), 45, 256), T.kernel_raw_to_f32(isa, raw, ggml, 45, 256))


def nonzero_codes(w, dtype):
    """The codes of the dense quantization that are not the zero code (Q8_0 q != 0, Q4_0 q != 8)."""
    raw = ggml_blocks(w, dtype).reshape(-1, 34 if dtype == "q8" else 18)
    if dtype == "q8":
        return int((raw[:, 2:] != 0).sum())
    q = raw[:, 2:]
    return int(((q & 15) != 8).sum() + ((q >> 4) != 8).sum())


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_quant_bytes_follow_the_non_zeros(dtype):
    """One mask bit and the dense fp16 scale per block of 32 per weight, and the non-zero codes: at 50%
    sparsity ~5.5 bits per weight for sq8 (dense 8.5), ~3.5 for sq4 (dense 4.5)."""
    rng = np.random.default_rng(14)
    n, k = 256, 1024
    bits = 8 if dtype == "q8" else 4
    dense = T.kernel_packed_bytes("scalar", pruned(rng, n, k, 0.0), dtype)
    for s in (0.5, 0.7):
        w = pruned(rng, n, k, s)
        got = T.kernel_packed_bytes("scalar", w, "s" + dtype)
        expect = nonzero_codes(w, dtype) * bits / 8 + n * k * (1 + 0.5) / 8
        # sq4's window pairs (max of the two counts: ~2.3 bytes over their mean per 128 positions at
        # 50%), the block offsets, the records' padding
        slack = (n * k / 32 if dtype == "q4" else 0) + 4 * (n // 32) * (k // 32) + 64 * (n // 32 + 2)
        assert expect <= got <= expect + slack, (s, got, expect)
        assert got < dense


@pytest.mark.skipif("avx512" not in TABLES, reason="the AVX-512 sparse paths need AVX-512")
def test_sparse_quant_without_vbmi2():
    """Without VBMI2 (CORELM_SPARSE_WITHOUT=vbmi2) the AVX-512 table expands with plain code: the tests above again."""
    env = dict(os.environ, CORELM_SPARSE_WITHOUT="vbmi2")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "not without_vbmi2 and (avx512 or amx)"], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
