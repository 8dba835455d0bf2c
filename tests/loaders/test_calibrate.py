"""corelm.calibrate: the activation statistics for `convert --weights q4` come from the engine's own forward
(Model.record_input_squares): each matrix's input column sums of squares, which are what numpy computes on
the same inputs, for every family's matrices."""
import os

import numpy as np
import pytest

from conftest import MODELS, core_forward

from corelm.calibrate import activation_importance, calibration_ids, input_squares
from corelm.engine.model_builder import build_core_model
from corelm.loader import load_model
from corelm.loader.spec import weight_shapes

TINY = sorted(n for n in os.listdir(MODELS) if n.startswith("tiny-"))


def _rmsnorm(x, g, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps)) * g


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-gemma2"])
def test_first_layer_statistics_are_numpys(name):
    """Layer 0's q/k/v input is the embeddings (times Gemma's scale) through the attention norm: its column
    sums of squares, taken here in numpy, are what the core recorded, over every chunk's tokens."""
    m = load_model(os.path.join(MODELS, name))
    ids = calibration_ids(m)[:70]
    spec = m.spec
    x = m.get_weight("tok_embeddings")[np.asarray(ids)].astype(np.float32) * np.float32(spec.embed_scale)
    h = _rmsnorm(x, m.get_weight("layers.0.attn_norm"), spec.rms_norm_eps).astype(np.float64)
    sq = input_squares(load_model(os.path.join(MODELS, name)), ids, chunk=32)
    for part in ("wq", "wk", "wv"):
        sums, rows = sq[f"layers.0.{part}"]
        assert rows == len(ids) and sums.dtype == np.float64
        np.testing.assert_allclose(sums, (h ** 2).sum(0), rtol=1e-5)


def test_recording_is_switched_and_counts_the_rows_multiplied():
    """Off, nothing is recorded; on starts afresh; lm_head counts only the rows whose logits were asked for;
    off keeps what was recorded."""
    m = load_model(os.path.join(MODELS, "tiny-qwen2"))
    ids = np.asarray(calibration_ids(m)[:20], np.int32)
    model = build_core_model(m, dtype="fp32", threads=1, max_seq_len=64)
    core_forward(model, ids, 0)
    model.record_input_squares(True)
    assert model.input_squares() == {}
    core_forward(model, ids[:12], 0)                  # the last token's logits only
    core_forward(model, ids, 0, True)                 # every token's
    model.record_input_squares(False)
    core_forward(model, ids, 0, True)
    sq = model.input_squares()
    assert sq["lm_head"][1] == 1 + len(ids) and sq["layers.1.w_down"][1] == 12 + len(ids)
    hidden = model.hidden_batch(ids, [(len(ids), 0, np.arange(4, dtype=np.int32), False)])
    last = model.hidden_batch(ids[:12], [(12, 0, np.arange(4, dtype=np.int32), False)])[-1]
    ref = (hidden.astype(np.float64) ** 2).sum(0) + last.astype(np.float64) ** 2
    np.testing.assert_allclose(sq["lm_head"][0], ref, rtol=1e-5)
    model.record_input_squares(True)
    assert model.input_squares() == {}


@pytest.mark.parametrize("name", TINY)
def test_every_family_gives_finite_statistics_of_every_matrix(name):
    """Every family's forward (post-norms, soft-caps, q/k norms, experts, encoders) gives statistics for each
    of its layer matrices (an expert's if a token chose it) and lm_head, one per input column, finite."""
    m = load_model(os.path.join(MODELS, name))
    ids = calibration_ids(m)[:60]
    shapes = weight_shapes(m.spec)
    imp = activation_importance(m, ids, chunk=40)
    mats = {n for n in shapes if n.startswith("layers.") and n.rsplit(".", 1)[1].startswith("w")}
    experts = {n for n in mats if ".experts." in n}
    assert mats - experts <= set(imp) and set(imp) <= mats | {"lm_head"}
    assert ("lm_head" in imp) == (not m.spec.encoder)
    for name_, v in imp.items():
        cols = shapes["tok_embeddings" if name_ == "lm_head" and "lm_head" not in shapes else name_][-1]
        assert v.dtype == np.float32 and v.shape == (cols,), name_
        assert np.all(np.isfinite(v)) and np.all(v >= 0) and v.max() > 0, name_
    if m.spec.num_experts:
        sq = input_squares(load_model(os.path.join(MODELS, name)), ids, chunk=40)
        for layer in range(m.spec.num_layers):     # each token's input reaches its k experts
            routed = sum(r for n, (_, r) in sq.items() if n.startswith(f"layers.{layer}.experts.") and n.endswith("w_gate"))
            assert routed == len(ids) * m.spec.num_experts_used
        assert "layers.0.router" in sq and "layers.0.router" not in imp


def test_importance_is_the_inputs_mean_square():
    m = load_model(os.path.join(MODELS, "tiny-qwen2"))
    ids = calibration_ids(m)[:50]
    sq = input_squares(m, ids, chunk=32)
    imp = activation_importance(load_model(os.path.join(MODELS, "tiny-qwen2")), ids, chunk=32)
    assert set(imp) == set(sq)
    for name, (sums, rows) in sq.items():
        np.testing.assert_allclose(imp[name], sums / rows, rtol=1e-6)
    assert np.array_equal(imp["layers.0.wk"], imp["layers.0.wq"]) and np.array_equal(imp["layers.0.w_up"], imp["layers.0.w_gate"])
