"""corelm.calibrate: the numpy forward pass that takes the activation statistics for `convert --weights q4`
computes what the engine computes, and the statistics are the mean squares of each matrix's input."""
import os

import numpy as np
import pytest

from conftest import MODELS, core_forward

from corelm.calibrate import activation_importance, calibration_ids, hidden_states
from corelm.engine.model_builder import build_core_model
from corelm.loader import load_model


@pytest.mark.parametrize("name", ["stories260K", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3",
                                  "tiny-mixtral", "tiny-qwen3moe", "tiny-olmoe"])
def test_forward_matches_the_engine(name):
    m = load_model(os.path.join(MODELS, name))
    ids = calibration_ids(m)[:40]
    h = hidden_states(m, [ids[:40], ids[:17]], lambda n, x: None)
    eps = np.float32(m.spec.rms_norm_eps)
    head = m.get_weight("tok_embeddings" if m.spec.tie_word_embeddings else "lm_head")
    # a context within tiny-phi3's pre-training one: LongRoPE's short factors, as hidden_states takes them
    engine = build_core_model(load_model(os.path.join(MODELS, name)), dtype="fp32", threads=1, max_seq_len=128)
    for chunk, x in zip((ids[:40], ids[:17]), h):
        x = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * m.get_weight("norm")
        ours = x @ head.T
        if m.spec.final_logit_softcap:
            ours = np.tanh(ours / m.spec.final_logit_softcap) * m.spec.final_logit_softcap
        ref = core_forward(engine, np.asarray(chunk, np.int32), 0, True)
        assert np.abs(ours - ref).max() < 2e-3 * np.abs(ref).max()


def test_importance_is_the_inputs_mean_square():
    m = load_model(os.path.join(MODELS, "tiny-qwen2"))
    ids = calibration_ids(m)[:50]
    seen = {}
    hidden_states(m, [ids[:32], ids[32:]], lambda n, x: seen.setdefault(n, []).append(x))
    imp = activation_importance(m, ids, chunk=32)
    layer_mats = {n for n in m.weight_names() if n.startswith("layers.") and n.rsplit(".", 1)[1].startswith("w")}
    assert set(imp) == layer_mats | {"lm_head"}
    h = np.concatenate(hidden_states(m, [ids[:32], ids[32:]], lambda n, x: None))
    h = h / np.sqrt((h * h).mean(-1, keepdims=True) + np.float32(m.spec.rms_norm_eps)) * m.get_weight("norm")
    assert np.allclose(imp["lm_head"], (h.astype(np.float64) ** 2).mean(0), rtol=1e-4)
    x = np.concatenate(seen["layers.1.w_down"])
    assert np.allclose(imp["layers.1.w_down"], (x.astype(np.float64) ** 2).mean(0), rtol=1e-5)
    assert np.array_equal(imp["layers.0.wk"], imp["layers.0.wq"]) and np.array_equal(imp["layers.0.w_up"], imp["layers.0.w_gate"])
    assert all(v.dtype == np.float32 and np.all(v >= 0) for v in imp.values())
