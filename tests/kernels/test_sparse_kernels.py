"""Sparse bf16 weights (sbf16, kernels/sparse_layout.h) through every kernel table: against the scalar
table's dense bf16 product over awkward shapes and sparsity patterns (all-zero rows and chunks, fully
dense rows, 99% sparse), every row of a small batch with the bits of a one-row product, and the bytes
stored."""
import numpy as np
import pytest

from corelm import _core
from corelm.convert import to_bf16

T = _core.testing
TABLES = _core.kernel_tables() + ["amx_emulated"]  # the AMX table on the tile emulation


def pruned(rng, n, k, sparsity):
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[rng.random((n, k)) < sparsity] = 0
    return w


def patterns(rng):
    """(name, w) for the shapes and patterns a sparse layout can get wrong."""
    out = [(f"{n}x{k} at {s}", pruned(rng, n, k, s)) for n, k, s in
           [(1, 1, 0.0), (7, 31, 0.5), (9, 33, 0.3), (37, 70, 0.5), (64, 896, 0.7), (33, 100, 0.99), (16, 64, 0.0)]]
    w = pruned(rng, 40, 130, 0.5)
    w[3] = 0                      # an all-zero row
    w[8:16, 32:64] = 0            # an all-zero chunk of a whole group
    w[17] = rng.standard_normal(130)  # a fully dense row
    w[24:32, :] = 0               # an all-zero group
    out.append(("zero rows, chunks and groups", w))
    out.append(("all zero", np.zeros((12, 40), np.float32)))
    return out


def bf16(a):
    """a rounded to bf16 (nearest even), as float32."""
    return (to_bf16(a).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("isa", TABLES)
def test_sparse_matches_the_dense_reference(isa):
    rng = np.random.default_rng(1)
    for name, w in patterns(rng):
        n, k = w.shape
        for m in (1, 2, 3, 4, 7, 32, 33, 70):
            x = rng.standard_normal((m, k)).astype(np.float32)
            got = T.kernel_matmul(isa, x, w, "sbf16")
            exact = bf16(x).astype(np.float64) @ bf16(w).astype(np.float64).T  # bf16 activations at worst
            ref = x.astype(np.float64) @ bf16(w).astype(np.float64).T
            scale = np.abs(x).max() * np.abs(w).sum(axis=1).max() + 1e-30
            err = min(np.abs(got - exact).max(), np.abs(got - ref).max()) / scale
            assert err < 2e-3, (isa, name, m, err)
            if not w.any():
                assert not got.any()


@pytest.mark.parametrize("isa", TABLES)
def test_sparse_rows_of_a_small_batch_get_the_bits_of_one_row(isa):
    """Speculative tokens are checked in a pass of a few rows: each must get decode's bits."""
    exact = T.kernel_row_exact(isa)
    rng = np.random.default_rng(2)
    w = pruned(rng, 70, 512, 0.6)
    x = rng.standard_normal((32, 512)).astype(np.float32)
    one = np.stack([T.kernel_matmul(isa, x[i:i + 1], w, "sbf16")[0] for i in range(32)])
    for m in (2, 3, 4, 5, 8, 17, 32):
        got = T.kernel_matmul(exact, x[:m], w, "sbf16")
        assert np.array_equal(got.view(np.uint32), one[:m].view(np.uint32)), (isa, exact, m)


@pytest.mark.parametrize("isa", TABLES)
def test_sparse_row_ranges_and_rows_out(isa):
    """A thread's row range [n0, n1) starting or ending inside a group, and rows read back (embedding)."""
    rng = np.random.default_rng(3)
    w = pruned(rng, 45, 77, 0.5)
    for m in (1, 5, 40):
        x = rng.standard_normal((m, 77)).astype(np.float32)
        whole = T.kernel_matmul(isa, x, w, "sbf16")
        for n0, n1 in ((0, 3), (3, 11), (13, 45), (44, 45)):
            part = T.kernel_matmul(isa, x, w, "sbf16", n0, n1)
            assert np.array_equal(part[:, n0:n1], whole[:, n0:n1]), (isa, m, n0, n1)
            assert not part[:, :n0].any() and not part[:, n1:].any()
    for r in (0, 7, 8, 44):
        assert np.array_equal(T.kernel_row_to_f32(isa, w, "sbf16", r), bf16(w[r]))


@pytest.mark.parametrize("isa", [t for t in TABLES if t.startswith(("avx512", "amx"))])
def test_large_batches_multiply_the_expanded_dense_matrix(isa):
    """Past the small-batch kernels, panels expanded from the sparse layout go through the table's dense
    kernels (AMX: rows expanded into the A operand): the dense matrix's bits exactly, over tails of rows,
    tokens and K, and row ranges that start inside a group."""
    rng = np.random.default_rng(4)
    for n, k, m in ((100, 300, 40), (37, 70, 33), (64, 896, 70), (16, 64, 48), (45, 1000, 100)):
        w = pruned(rng, n, k, 0.5)
        w[5] = 0
        x = rng.standard_normal((m, k)).astype(np.float32)
        dense = T.kernel_matmul(isa, x, w, "bf16")
        assert np.array_equal(T.kernel_matmul(isa, x, w, "sbf16"), dense), (isa, n, k, m)
        # the two-step matmul (the forward pass's: x prepared once per region) gives the same bits
        assert np.array_equal(T.kernel_matmul(isa, x, w, "sbf16", activations="int16"), dense), (isa, n, k, m)
        for n0, n1 in ((0, 3), (3, 11), (13, n), (n - 1, n)):
            part = T.kernel_matmul(isa, x, w, "sbf16", n0, n1)
            assert np.array_equal(part[:, n0:n1], dense[:, n0:n1]), (isa, n, k, m, n0, n1)
            assert not part[:, :n0].any() and not part[:, n1:].any()


def test_sparse_bytes_follow_the_non_zeros():
    rng = np.random.default_rng(5)
    n, k = 256, 1024
    dense = T.kernel_packed_bytes("scalar", pruned(rng, n, k, 0.0), "bf16")
    for s in (0.5, 0.7):
        got = T.kernel_packed_bytes("scalar", pruned(rng, n, k, s), "sbf16")
        expect = (1 - s) * n * k * 2 + n * k / 8   # the non-zeros and one mask bit per weight
        assert expect <= got <= expect * 1.03 + 2048, (s, got, expect)
        assert got < dense


@pytest.mark.skipif("avx512" not in TABLES, reason="the AVX-512 sparse paths need AVX-512")
@pytest.mark.parametrize("setting", ["WITHOUT=bf16", "WITHOUT=bitalg", "WITHOUT=vbmi2", "EXPAND=ranks",
                                     "EXPAND=vpexpandw"])
def test_every_avx512_path(setting):
    """The AVX-512 kernels pick VDPBF16PS, VPOPCNTW ranks or VPEXPANDW by CPUID and vendor: the tests
    above again with each taken away (CORELM_SPARSE_WITHOUT) and each expansion chosen
    (CORELM_SPARSE_EXPAND), so every path runs on this machine."""
    import os
    import subprocess
    import sys
    name, value = setting.split("=")
    env = dict(os.environ, **{"CORELM_SPARSE_" + name: value})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not every_avx512_path"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
