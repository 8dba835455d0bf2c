"""Issue 22's question for sparse quantized weights: does a block's fp16 scale serve 32 dense positions (what
sq8_0 / sq4_0 store: the dense format's blocks, zero codes dropped) or 32 non-zeros (scales over the packed
non-zeros) with less loss? Every matrix of a model pruned per row by magnitude, then quantized both ways
with the Q8_0 / Q4_0 quantizers; prints the relative error ||Wq - W|| / ||W|| against the pruned W, and the
bits per weight each layout stores (1 mask bit + the non-zero codes + the scales).

    python tools/sparse_scale_layout.py MODEL [--sparsity 0.5] [--max-matrices 0]

MODEL: anything corelm loads (a GGUF file, an HF folder); its weights are dequantized to floats first."""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
from corelm.convert import ALWAYS_DENSE, prune_rows, quantize_q4_0, quantize_q8_0  # noqa: E402
from corelm.loader import load_model  # noqa: E402
from corelm.loader.gguf import _DECODERS  # noqa: E402

FORMATS = {"q8_0": (quantize_q8_0, "Q8_0", 8), "q4_0": (quantize_q4_0, "Q4_0", 4)}


def roundtrip(w: np.ndarray, fmt: str) -> np.ndarray:
    """w [rows, cols % 32 == 0] quantized and dequantized."""
    quantize, ggml, _ = FORMATS[fmt]
    return _DECODERS[ggml](quantize(w).reshape(-1), w.size).reshape(w.shape)


def per_nonzeros(w: np.ndarray, fmt: str) -> np.ndarray:
    """Each row's non-zeros packed in column order, quantized in blocks of 32 of them (the last one padded)."""
    mask = w != 0
    n = int(mask.sum(1).max())
    packed = np.zeros((w.shape[0], -(-n // 32) * 32), np.float32)
    for r in range(w.shape[0]):
        v = w[r, mask[r]]
        packed[r, :len(v)] = v
    q = roundtrip(packed, fmt)
    out = np.zeros_like(w)
    for r in range(w.shape[0]):
        out[r, mask[r]] = q[r, :mask[r].sum()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--max-matrices", type=int, default=0, help="0: every matrix")
    a = ap.parse_args()
    m = load_model(a.model)
    names = [n for n in m.weight_names() if n not in ALWAYS_DENSE]
    err = {(f, k): [0.0, 0.0] for f in FORMATS for k in ("dense", "nonzeros")}   # squared error, squared norm
    nnz = total = 0
    count = 0
    for name in names:
        w = m.get_weight(name)
        if w.ndim != 2 or w.shape[1] % 32:
            continue
        w = prune_rows(w, a.sparsity)
        nnz, total = nnz + int(np.count_nonzero(w)), total + w.size
        norm = float(np.sum(w.astype(np.float64) ** 2))
        for f in FORMATS:
            for k, q in (("dense", roundtrip(w, f)), ("nonzeros", per_nonzeros(w, f))):
                err[(f, k)][0] += float(np.sum((q.astype(np.float64) - w) ** 2))
                err[(f, k)][1] += norm
        count += 1
        if a.max_matrices and count >= a.max_matrices:
            break
    keep = nnz / total
    print(f"{a.model}: {count} matrices pruned to {a.sparsity:g} by magnitude ({100 * (1 - keep):.1f}% zeros)")
    for f, (_, _, bits) in FORMATS.items():
        for k in ("dense", "nonzeros"):
            scale_bits = 16 / 32 * (1 if k == "dense" else keep)
            e = (err[(f, k)][0] / err[(f, k)][1]) ** 0.5
            print(f"  {f} scales per 32 {k:8s}: relative error {e:.5f}, "
                  f"{1 + keep * bits + scale_bits:.3f} bits per weight")


if __name__ == "__main__":
    main()
