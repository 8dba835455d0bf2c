"""Model families (corelm/loader/families.py): one description per family, and a file whose family
fields disagree with its tensors is refused with a ModelLoadError naming the field. Token-for-token
agreement with transformers is in test_models.py; the kernels' GeGLU in test_kernels.py."""
import os
import shutil

import numpy as np
import pytest

from conftest import MODELS, corpus_tool, core_forward
from test_loader_hf import copy_model

import corelm
from corelm.engine.model_builder import build_core_model
from corelm.loader import ModelLoadError, load_model
from corelm.loader.families import FAMILIES, GGUF_ARCHS, HF_CLASSES
from corelm.loader.gguf import read_gguf

tool = corpus_tool()
TINY = {f: os.path.join(MODELS, f"tiny-{f}") for f in ("qwen3", "gemma2", "gemma3", "phi3")}


def gguf_of(family):
    return os.path.join(TINY[family], f"tiny-{family}.f32.gguf")


def test_each_family_is_described_once():
    assert len(HF_CLASSES) == sum(len(f.hf_classes) for f in FAMILIES.values())
    assert set(GGUF_ARCHS.values()) <= set(FAMILIES)
    for f in FAMILIES.values():
        # a fused tensor's parts are internal layer weights, never also mapped one by one
        for fused in (f.hf_fused, f.gguf_fused):
            for name, parts in fused.items():
                assert name not in f.hf_layer and name not in f.gguf_layer
                assert set(parts) <= {"wq", "wk", "wv", "w_gate", "w_up"}


@pytest.mark.parametrize("family", list(TINY))
def test_hf_and_gguf_give_the_same_model(family):
    """llama.cpp's converter shifted Gemma's norms, fused Phi-3's tensors and dropped nothing: the
    spec and every weight read from the GGUF equal the HF folder's."""
    hf, gg = load_model(TINY[family]), load_model(gguf_of(family))
    for field in ("arch", "num_layers", "num_heads", "num_kv_heads", "head_dim", "activation", "qk_norm",
                  "post_norms", "embed_scale", "sliding_window", "sliding_layers", "rope_local_theta",
                  "rope_dim", "attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar"):
        assert getattr(hf.spec, field) == getattr(gg.spec, field), field
    for name in hf.weight_names():
        np.testing.assert_array_equal(hf.get_weight(name), gg.get_weight(name), err_msg=name)


def typed_metadata(g):
    """A read GGUF's metadata as (key, type, value) for tool.build_gguf."""
    kinds = {str: tool.STRING, float: tool.FLOAT32, bool: tool.BOOL, int: tool.UINT32}
    out = {}
    for k, v in g.metadata.items():
        if k == "general.alignment":
            continue
        if isinstance(v, list):
            et = tool.STRING if v and isinstance(v[0], str) else tool.FLOAT32 if v and isinstance(v[0], float) \
                else tool.INT32
            out[k] = (tool.ARRAY, (et, v))
        else:
            out[k] = (kinds[type(v)], v)
    return out


def rewrite_gguf(src, out, meta=None, drop=(), tensors=None):
    """A copy of a GGUF with metadata keys replaced or added ({key: (type, value)}), tensors dropped and
    tensors replaced ({name: (ggml type, raw bytes)})."""
    g = read_gguf(src)
    items = typed_metadata(g)
    items.update(meta or {})
    new = tensors or {}
    out_tensors = [(n, list(reversed(i.shape))) + new.get(n, (i.ggml_type, g.raw(n).tobytes()))
                   for n, i in g.tensors.items() if n not in drop]
    with open(out, "wb") as f:
        f.write(tool.build_gguf([(k, t, v) for k, (t, v) in items.items()], out_tensors))
    return str(out)


def test_rewritten_gguf_loads_as_the_original(tmp_path):
    path = rewrite_gguf(gguf_of("gemma3"), tmp_path / "m.gguf")
    a, b = load_model(gguf_of("gemma3")), load_model(path)
    assert a.spec == b.spec


@pytest.mark.parametrize("family,meta,drop,match", [
    ("gemma3", {"gemma3.attention.sliding_window_pattern": (tool.ARRAY, (tool.INT32, [1, 0]))}, (),
     "sliding_window_pattern lists 2 flags for 6 layers"),
    ("gemma3", {"gemma3.attention.sliding_window_pattern": (tool.UINT32, 0)}, (),
     "sliding_window_pattern = 0"),
    ("gemma3", {"gemma3.attention.head_count": (tool.UINT32, 8)}, (), r"wq has shape \(128, 64\).*\(256, 64\)"),
    ("gemma3", {}, ("blk.2.attn_q_norm.weight",), "layers.2.q_norm"),
    ("gemma2", {}, ("blk.1.post_ffw_norm.weight",), "layers.1.post_ffn_norm"),
    ("gemma2", {"gemma2.attn_logit_softcapping": (tool.FLOAT32, float("inf"))}, (), "attn_logit_softcap"),
    ("phi3", {"phi3.attention.head_count_kv": (tool.UINT32, 1)}, (), "fused tensor blk.0.attn_qkv.weight"),
    ("phi3", {}, ("rope_factors_short.weight",), "no rope_factors_short"),
    ("phi3", {"phi3.rope.dimension_count": (tool.UINT32, 10)}, (), "short_factor must list 5"),
    ("qwen3", {"qwen3.block_count": (tool.UINT32, 3)}, (), "layers.2"),
])
def test_gguf_family_fields_that_disagree_are_named(tmp_path, family, meta, drop, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model(rewrite_gguf(gguf_of(family), tmp_path / "m.gguf", meta, drop))


@pytest.mark.parametrize("family,config,match", [
    ("gemma3", {"layer_types": ["sliding_attention"] * 5}, "layer_types must list"),
    ("gemma3", {"layer_types": None, "sliding_window_pattern": 0, "_sliding_window_pattern": None},
     "sliding_window_pattern = 0"),
    ("gemma2", {"hidden_activation": "relu"}, "activation 'relu' is not supported for gemma2"),
    ("gemma3", {"query_pre_attn_scalar": -4}, "query_pre_attn_scalar"),
    ("gemma3", {"num_attention_heads": 2}, r"wq has shape"),
    ("qwen3", {"head_dim": 16}, r"layers.0.wq has shape \(128, 64\).*\(64, 64\)"),
    ("phi3", {"num_key_value_heads": 1}, r"fused tensor model.layers.0.self_attn.qkv_proj.weight has shape "
                                         r"\(128, 64\), but wq \+ wk \+ wv take 96 rows"),
    ("phi3", {"partial_rotary_factor": 0.1}, "rotated dims"),
    ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "short_factor must list 6"),
    ("gemma3", {"use_bidirectional_attention": True}, "bidirectional"),
])
def test_hf_family_fields_that_disagree_are_named(tmp_path, family, config, match):
    d = copy_model(TINY[family], tmp_path / "m", config=config)
    with pytest.raises(ModelLoadError, match=match):
        load_model(d)


def test_gemma3_defaults_to_transformers_pattern_without_layer_types(tmp_path):
    d = copy_model(TINY["gemma3"], tmp_path / "m", config={"layer_types": None})
    assert load_model(d).spec.sliding_layers == [True] * 5 + [False]


def test_converted_family_model_matches(tmp_path):
    """convert writes the family's spec and shifted norms; the corelm folder computes what the HF folder does."""
    from corelm.convert import convert
    out = tmp_path / "gemma3-fp32"
    convert(TINY["gemma3"], str(out), weights="fp32")
    ids = np.array([1, 300, 45, 77, 210, 9, 14, 400, 33, 81], np.int32)
    a = core_forward(build_core_model(load_model(TINY["gemma3"]), dtype="fp32", threads=1), ids, 0, True)
    b = core_forward(build_core_model(load_model(str(out)), dtype="fp32", threads=1), ids, 0, True)
    np.testing.assert_array_equal(a, b)


def test_quantized_fused_tensors_keep_their_blocks(tmp_path):
    """Phi-3's fused attn_qkv and ffn_up as Q8_0 blocks: each part keeps its rows' blocks, so the engine
    computes what it computes on the same file dequantized (dtype fp32)."""
    src = read_gguf(gguf_of("phi3"))
    q8 = {}
    for name, info in src.tensors.items():
        w = src.dequantize(name)
        if w.ndim == 2 and name != "token_embd.weight":
            blocks = w.reshape(-1, 32)
            d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
            inv = np.where(d == 0, 0, 1 / d.astype(np.float32))
            q8[name] = tool.q8_0_bytes(d.astype(np.float32), np.round(blocks * inv[:, None]).astype(np.int8))
    path = rewrite_gguf(gguf_of("phi3"), tmp_path / "q8.gguf", tensors={n: (tool.Q8_0, b) for n, b in q8.items()})
    llm = corelm.LLM(str(path), threads=1, max_seq_len=128)
    assert llm.engine.dtype.startswith("q8_0"), llm.engine.dtype   # the blocks are kept
    ids = np.array([1, 300, 45, 77, 210, 9, 14, 400], np.int32)
    kept = core_forward(llm.engine.core, ids, 0, True)
    f32 = core_forward(build_core_model(load_model(str(path)), dtype="fp32", threads=1, max_seq_len=128), ids, 0, True)
    assert float(np.mean((kept - f32) ** 2) / np.mean(f32 ** 2)) < 1e-4
