"""Model families (corelm/loader/families.py): one description per family, and a file whose family
fields disagree with its tensors is refused with a ModelLoadError naming the field. Token-for-token
agreement with transformers is in test_models.py; the kernels' GeGLU in test_kernels.py."""
import os
import re
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
TINY = {f: os.path.join(MODELS, f"tiny-{f}") for f in ("qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3moe",
                                                         "olmoe")}
MOE = ("mixtral", "qwen3moe", "olmoe")


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
        # experts: only in MoE families, and then in place of the dense MLP
        for stacked in (f.hf_stacked, f.gguf_stacked):
            assert set(p for parts in stacked.values() for p in parts) <= {"w_gate", "w_up", "w_down"}
        assert all("{e}" in name for name in f.hf_experts)
        mlp = {"w_gate", "w_up", "w_down"} & (set(f.hf_layer.values()) | set(f.gguf_layer.values()))
        assert (f.moe, bool(mlp)) in ((True, False), (False, True)), f.arch
        assert f.moe == bool(f.hf_experts and f.gguf_stacked) == ("router" in f.hf_layer.values())
        # a multimodal class's text model and other towers: only with the key of its text config (an encoder's
        # checkpoints: the model under "bert.", its heads beside it)
        assert f.hf_text_config or f.encoder or not (f.hf_text_prefixes or f.hf_towers), f.arch


@pytest.mark.parametrize("family", list(TINY))
def test_hf_and_gguf_give_the_same_model(family):
    """llama.cpp's converter shifted Gemma's norms, fused Phi-3's tensors and dropped nothing: the
    spec and every weight read from the GGUF equal the HF folder's."""
    hf, gg = load_model(TINY[family]), load_model(gguf_of(family))
    for field in ("arch", "num_layers", "num_heads", "num_kv_heads", "head_dim", "activation", "qk_norm",
                  "post_norms", "embed_scale", "sliding_window", "sliding_layers", "rope_local_theta",
                  "rope_dim", "attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar",
                  "intermediate_size", "qk_norm_whole", "num_experts", "num_experts_used", "moe_norm_topk"):
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
    tensors replaced ({name: (ggml type, raw bytes)}, or (ggml type, raw bytes, numpy shape) to reshape)."""
    g = read_gguf(src)
    items = typed_metadata(g)
    items.update(meta or {})
    new = tensors or {}
    out_tensors = []
    for n, i in g.tensors.items():
        if n not in drop:
            t = new.get(n, (i.ggml_type, g.raw(n).tobytes()))
            out_tensors.append((n, list(reversed(t[2] if len(t) > 2 else i.shape)), t[0], t[1]))
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
    # mixtures of experts: the counts the metadata gives against the tensors, named by their keys
    ("qwen3moe", {"qwen3moe.expert_count": (tool.UINT32, 4)}, (),
     r"qwen3moe.expert_count = 4, but expert tensor blk.0.ffn_\w+_exps.weight holds 8 experts"),
    ("qwen3moe", {"qwen3moe.expert_count": (tool.UINT32, 0)}, (), "qwen3moe.expert_count = 0, but every qwen3moe layer"),
    ("mixtral", {"llama.expert_used_count": (tool.UINT32, 9)}, (),
     r"llama.expert_used_count = 9 \(the experts each token is routed to\) must be between 1 and "
     r"llama.expert_count = 8"),
    ("olmoe", {"olmoe.expert_used_count": (tool.UINT32, 0)}, (), "olmoe.expert_used_count = 0"),
    ("olmoe", {"olmoe.expert_weights_norm": (tool.UINT32, 1)}, (), "'olmoe.expert_weights_norm' = 1 is not a valid bool"),
    ("qwen3moe", {"qwen3moe.expert_feed_forward_length": (tool.UINT32, 40)}, (),
     r"expert tensor blk.0.ffn_(gate|up)_exps.weight has shape \(8, 48, 64\), but w_(gate|up) take 40 rows per expert"),
    ("olmoe", {}, ("blk.1.ffn_up_exps.weight",), "missing weights: layers.1.experts.0.w_up"),
    # without its expert count a "llama" file is a dense Llama, whose blocks hold no experts
    ("mixtral", {"llama.expert_count": (tool.UINT32, 0)}, (), "unknown tensors for a llama model: .*_exps"),
])
def test_gguf_family_fields_that_disagree_are_named(tmp_path, family, meta, drop, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model(rewrite_gguf(gguf_of(family), tmp_path / "m.gguf", meta, drop))


def test_gguf_router_rows_are_the_expert_count(tmp_path):
    router = np.zeros((4, 64), np.float32)
    path = rewrite_gguf(gguf_of("mixtral"), tmp_path / "m.gguf",
                        tensors={"blk.1.ffn_gate_inp.weight": (tool.F32, router.tobytes(), router.shape)})
    with pytest.raises(ModelLoadError, match=r"llama.expert_count = 8, but the router layers.1.router scores 4 "
                                             r"experts"):
        load_model(path)


@pytest.mark.parametrize("family,norm", [("qwen3moe", True), ("olmoe", False), ("mixtral", True)])
def test_gguf_moe_norm_topk_is_llama_cpps_unless_the_file_says(tmp_path, family, norm):
    """llama.cpp renormalises the top-k routing weights of Qwen3-MoE and Mixtral, not OLMoE's; a file's
    <arch>.expert_weights_norm says otherwise."""
    assert load_model(gguf_of(family)).spec.moe_norm_topk is norm
    arch = read_gguf(gguf_of(family)).metadata["general.architecture"]
    path = rewrite_gguf(gguf_of(family), tmp_path / "m.gguf", {f"{arch}.expert_weights_norm": (tool.BOOL, not norm)})
    assert load_model(path).spec.moe_norm_topk is (not norm)


def test_gguf_fused_gate_up_experts_give_the_same_model(tmp_path):
    """convert_hf_to_gguf.py --fuse-gate-up-exps writes ffn_gate_up_exps [experts, 2 * ffn, hidden]: the same
    experts."""
    g = read_gguf(gguf_of("olmoe"))
    tensors = []
    for n, i in g.tensors.items():
        if n.endswith("ffn_up_exps.weight"):
            continue
        if n.endswith("ffn_gate_exps.weight"):
            w = np.concatenate([g.dequantize(n), g.dequantize(n.replace("gate", "up"))], axis=1)
            tensors.append((n.replace("gate_exps", "gate_up_exps"), list(reversed(w.shape)), tool.F32, w.tobytes()))
        else:
            tensors.append((n, list(reversed(i.shape)), i.ggml_type, g.raw(n).tobytes()))
    path = tmp_path / "fused.gguf"
    path.write_bytes(tool.build_gguf([(k, t, v) for k, (t, v) in typed_metadata(g).items()], tensors))
    a, b = load_model(gguf_of("olmoe")), load_model(str(path))
    assert a.spec == b.spec
    for name in a.weight_names():
        np.testing.assert_array_equal(a.get_weight(name), b.get_weight(name), err_msg=name)


def q8_0_of(w):
    """Q8_0 blocks of float rows (any leading dimensions), as ggml's reference quantizer."""
    blocks = w.reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
    inv = np.where(d == 0, 0, 1 / d.astype(np.float32))
    return tool.q8_0_bytes(d.astype(np.float32), np.round(blocks * inv[:, None]).astype(np.int8))


def test_quantized_expert_tensors_hand_out_each_experts_blocks(tmp_path):
    """3D expert tensors of Q8_0 blocks: get_raw_weight gives expert e's rows of blocks as they are stored
    (no decoding), get_weight decodes just them; the router stays float even when the file quantized it."""
    src = read_gguf(gguf_of("qwen3moe"))
    q8 = {n: q8_0_of(src.dequantize(n)) for n in src.tensors
          if n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_inp.weight"))}  # rows of 64
    path = rewrite_gguf(gguf_of("qwen3moe"), tmp_path / "q8.gguf", tensors={n: (tool.Q8_0, b) for n, b in q8.items()})
    m, g = load_model(path), read_gguf(path)
    f, d = m.spec.intermediate_size, m.spec.hidden_size
    for e in (0, 5, 7):
        for part, t in (("w_gate", "blk.1.ffn_gate_exps.weight"), ("w_up", "blk.0.ffn_up_exps.weight")):
            name = f"layers.{t[4]}.experts.{e}.{part}"
            kind, raw, shape = m.get_raw_weight(name)
            whole = np.frombuffer(q8[t], np.uint8).reshape(-1, d // 32 * 34)
            assert kind == "Q8_0" and tuple(shape) == (f, d)
            np.testing.assert_array_equal(raw, whole[e * f:(e + 1) * f])
            np.testing.assert_array_equal(m.get_weight(name), g.dequantize(t)[e])
        assert m.get_raw_weight(f"layers.0.experts.{e}.w_down") is None      # F32 (48 columns)
    assert m.get_raw_weight("layers.0.router") is None
    np.testing.assert_array_equal(m.get_weight("layers.0.router"), g.dequantize("blk.0.ffn_gate_inp.weight"))


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
    # mixtures of experts: counts named by the config's keys
    ("mixtral", {"num_local_experts": 16}, "num_local_experts = 16, but"),
    ("qwen3moe", {"num_experts": 4, "num_local_experts": 4}, "num_local_experts = 4, but"),
    ("qwen3moe", {"num_experts": 4}, "num_local_experts = 8 and num_experts = 4 disagree"),
    ("olmoe", {"num_experts": 0}, "num_experts = 0, but every olmoe layer routes to experts"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok = 9 .* between 1 and num_local_experts = 8"),
    ("olmoe", {"num_experts_per_tok": 0}, "num_experts_per_tok = 0"),
    ("olmoe", {"norm_topk_prob": "yes"}, "moe_norm_topk"),
    ("qwen3moe", {"moe_intermediate_size": 40}, r"layers.0.experts.0.w_\w+ has shape \(\d+, \d+\), but the "
                                                r"configuration implies \((40, 64|64, 40)\)"),
    # every layer must route to experts, and only to them
    ("qwen3moe", {"mlp_only_layers": [1]}, "mlp_only_layers = \\[1\\]"),
    ("qwen3moe", {"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
    ("qwen3moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size = 64: shared experts"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv = 8.0"),
])
def test_hf_family_fields_that_disagree_are_named(tmp_path, family, config, match):
    d = copy_model(TINY[family], tmp_path / "m", config=config)
    with pytest.raises(ModelLoadError, match=match):
        load_model(d)


def test_gemma3_defaults_to_transformers_pattern_without_layer_types(tmp_path):
    d = copy_model(TINY["gemma3"], tmp_path / "m", config={"layer_types": None})
    assert load_model(d).spec.sliding_layers == [True] * 5 + [False]


GEMMA3_VL = os.path.join(MODELS, "tiny-gemma3-vl")   # tiny-gemma3's text model in Gemma3ForConditionalGeneration


def renamed_copy(src, dst, rename, config=None, add=None):
    """A copy of an HF folder with every tensor renamed by rename(name) (None drops it), written with the
    safetensors numpy API, config.json edited as copy_model does."""
    from safetensors.numpy import save_file
    d = copy_model(src, dst, config=config)
    tensors = {rename(n): w for n, w in hf_tensors_of(src).items() if rename(n)}
    save_file({**tensors, **(add or {})}, os.path.join(d, "model.safetensors"))
    return d


def hf_tensors_of(folder):
    from corelm.loader.safetensors import SafetensorsFile
    st = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    return {n: st.get(n) for n in st.keys()}


def transformers5_name(name):
    """A tensor's name as transformers 5 computes with it (its save_pretrained writes the hub's)."""
    for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    raise AssertionError(name)


def assert_same_model(a, b):
    assert a.spec == b.spec
    assert sorted(a.weight_names()) == sorted(b.weight_names())
    for name in a.weight_names():
        np.testing.assert_array_equal(a.get_weight(name), b.get_weight(name), err_msg=name)


def test_gemma3_multimodal_folder_is_its_text_model():
    """Gemma3ForConditionalGeneration (Gemma 3 4B and up): config.json's text_config and the language_model
    tensors are tiny-gemma3's text model (same seed, same weights); the vision tower is skipped."""
    names = list(hf_tensors_of(GEMMA3_VL))
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("language_model.model.") for n in names)
    assert_same_model(load_model(TINY["gemma3"]), load_model(GEMMA3_VL))


@pytest.mark.parametrize("layout", ["hub", "transformers5"])
def test_gemma3_multimodal_tensor_layouts_give_the_same_model(tmp_path, layout):
    """Hub checkpoints (language_model.model.*, vision_tower.vision_model.*) and transformers 5's names
    (model.language_model.*, model.vision_tower.*), with an untied lm_head under each one's name."""
    rename = {"hub": lambda n: n.replace("vision_tower.", "vision_tower.vision_model.", 1),
              "transformers5": transformers5_name}[layout]
    lm_head = np.random.default_rng(0).standard_normal((512, 64)).astype(np.float32)
    head = {"hub": "language_model.lm_head.weight", "transformers5": "lm_head.weight"}[layout]
    d = renamed_copy(GEMMA3_VL, tmp_path / "m", rename, config={"tie_word_embeddings": False}, add={head: lm_head})
    m = load_model(d)
    assert not m.spec.tie_word_embeddings
    np.testing.assert_array_equal(m.get_weight("lm_head"), lm_head)
    ref = load_model(GEMMA3_VL)
    for name in ref.weight_names():
        np.testing.assert_array_equal(m.get_weight(name), ref.get_weight(name), err_msg=name)
    # tied again (the outer config's tie_word_embeddings, as transformers 5 reads it): the stored lm_head is redundant
    tied = renamed_copy(GEMMA3_VL, tmp_path / "tied", rename, add={head: lm_head})
    assert_same_model(load_model(tied), ref)


def gemma3_vl_config(text_config=None, **outer):
    import json
    config = json.load(open(os.path.join(GEMMA3_VL, "config.json")))
    if text_config is not None:
        config["text_config"] = text_config
    config.update(outer)
    return {k: v for k, v in config.items() if v is not None}


def test_gemma3_multimodal_text_config_defaults_are_transformers():
    """The hub's text_config omits most keys: they take Gemma3TextConfig's defaults (transformers 5.25)."""
    from corelm.loader.hf import spec_from_hf_config
    gen = {"bos_token_id": 1, "eos_token_id": 2}      # the folder's generation_config.json
    full = spec_from_hf_config(gemma3_vl_config(), gen, "vl")
    # as on the hub (gemma-3-4b-it: hidden_size, intermediate_size, num_hidden_layers, rope_scaling,
    # sliding_window), plus the keys whose tiny values are not the defaults
    hub = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=6, sliding_window=8,
               rope_scaling={"factor": 4.0, "rope_type": "linear"}, vocab_size=512, num_attention_heads=4,
               num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=32768)
    assert spec_from_hf_config(gemma3_vl_config(hub), gen, "vl") == full
    bare = spec_from_hf_config(gemma3_vl_config(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=7)),
                               {}, "vl")
    assert (bare.vocab_size, bare.num_heads, bare.num_kv_heads, bare.head_dim, bare.query_pre_attn_scalar,
            bare.sliding_window, bare.max_position_embeddings) == (262208, 8, 4, 256, 256, 4096, 131072)
    assert (bare.rope_theta, bare.rope_local_theta, bare.rope_scaling, bare.rms_norm_eps) == (1e6, 1e4, None, 1e-6)
    assert bare.sliding_layers == [True] * 5 + [False, True]
    assert (bare.attn_logit_softcap, bare.final_logit_softcap, bare.tie_word_embeddings) == (None, None, True)
    assert (bare.bos_token_id, bare.eos_token_ids) == (2, [1])
    # the outer config's token ids and tie_word_embeddings before the text model's; generation_config first
    outer = spec_from_hf_config(gemma3_vl_config(eos_token_id=[1, 106], tie_word_embeddings=False), {}, "vl")
    assert (outer.eos_token_ids, outer.tie_word_embeddings) == ([1, 106], False)
    assert spec_from_hf_config(gemma3_vl_config(eos_token_id=[1, 106]), {"eos_token_id": 5}, "vl").eos_token_ids == [5]


@pytest.mark.parametrize("edit,match", [
    (dict(text_config=[1]), r"config.json text_config is not an object but \[1\]"),
    (dict(text_config={"vocab_size": 512}), "config.json text_config has no 'hidden_size'"),
    (dict(quantization_config={"quant_method": "gptq"}), r"pre-quantized .*gptq"),
    (dict(text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
                       "hidden_activation": "relu"}), "activation 'relu'"),
])
def test_gemma3_multimodal_configs_that_disagree_are_named(edit, match):
    from corelm.loader.hf import spec_from_hf_config
    with pytest.raises(ModelLoadError, match=match):
        spec_from_hf_config(gemma3_vl_config(**edit), {}, "vl")


@pytest.mark.parametrize("folder,extra", [
    (GEMMA3_VL, "language_model.model.layers.0.mlp.extra.weight"),     # in the text model
    (GEMMA3_VL, "audio_tower.conv.weight"),                            # a tower the family does not declare
    (GEMMA3_VL, "model.layers.0.mlp.extra.weight"),                     # a text-only name
    (TINY["gemma3"], "lm_head.bias"),
    (TINY["qwen3"], "vision_tower.embeddings.patch_embedding.weight"),  # no vision tower in a text-only family
])
def test_unknown_tensors_are_still_reported(tmp_path, folder, extra):
    d = renamed_copy(folder, tmp_path / "m", lambda n: n, add={extra: np.zeros((4, 4), np.float32)})
    with pytest.raises(ModelLoadError, match=f"unknown tensors for a .* model: {re.escape(extra)}"):
        load_model(d)


def test_gemma3_multimodal_text_model_under_two_names_is_ambiguous(tmp_path):
    w = hf_tensors_of(GEMMA3_VL)["language_model.model.norm.weight"]
    d = renamed_copy(GEMMA3_VL, tmp_path / "m", lambda n: n, add={"model.language_model.norm.weight": w})
    with pytest.raises(ModelLoadError, match=r"both \S+ and \S+ hold norm"):
        load_model(d)


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


def hf_tensors(family):
    return hf_tensors_of(TINY[family])


def stacked_experts(family, layers=(0, 1)):
    """The per-expert tensors of `layers` as transformers 5 computes with them: mlp.experts.gate_up_proj
    [experts, 2 * ffn, hidden] and mlp.experts.down_proj [experts, hidden, ffn]; (dropped names, added)."""
    t, drop, add = hf_tensors(family), [], {}
    for i in layers:
        per = {w: [t[f"model.layers.{i}.mlp.experts.{e}.{w}_proj.weight"] for e in range(8)]
               for w in ("gate", "up", "down")}
        drop += [f"model.layers.{i}.mlp.experts.{e}.{w}_proj.weight" for e in range(8) for w in per]
        add[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([g, u]) for g, u in zip(per["gate"], per["up"])])
        add[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(per["down"])
    return drop, add


def test_hf_stacked_expert_tensors_give_the_same_model(tmp_path):
    """A checkpoint with transformers 5's stacked expert tensors (one layer of them beside one layer of
    per-expert tensors) loads as the per-expert one; each expert's rows are read alone."""
    drop, add = stacked_experts("qwen3moe", layers=(1,))
    a, b = load_model(TINY["qwen3moe"]), load_model(copy_model(TINY["qwen3moe"], tmp_path / "m", drop=drop, add=add))
    assert a.spec == b.spec
    for name in a.weight_names():
        np.testing.assert_array_equal(a.get_weight(name), b.get_weight(name), err_msg=name)


@pytest.mark.parametrize("edit,match", [
    # a stacked tensor with another expert count, or with rows that are not each expert's parts
    (lambda drop, add: add.update({k: v[:4] for k, v in add.items() if k.endswith("down_proj")}),
     r"num_local_experts = 8, but expert tensor model.layers.0.mlp.experts.down_proj holds 4 experts"),
    (lambda drop, add: add.update({k: v[:, :40] for k, v in add.items() if k.endswith("gate_up_proj")}),
     r"expert tensor model.layers.0.mlp.experts.gate_up_proj has shape \(8, 40, 64\), but w_gate \+ w_up take 96 "
     r"rows per expert"),
    (lambda drop, add: add.update({k: v[0] for k, v in add.items() if k.endswith("down_proj")}),
     r"expert tensor model.layers.0.mlp.experts.down_proj has shape \(64, 48\), not \[experts, rows, cols\]"),
    # the same expert twice: stacked and per-expert
    (lambda drop, add: drop.remove("model.layers.0.mlp.experts.3.up_proj.weight"),
     r"both model.layers.0.mlp.experts.(3.up_proj.weight|gate_up_proj) and \S+ hold layers.0.experts.3.w_up"),
])
def test_hf_stacked_expert_tensors_that_disagree_are_named(tmp_path, edit, match):
    drop, add = stacked_experts("qwen3moe")
    edit(drop, add)
    with pytest.raises(ModelLoadError, match=match):
        load_model(copy_model(TINY["qwen3moe"], tmp_path / "m", drop=drop, add=add))


@pytest.mark.parametrize("family,drop,add,match", [
    ("olmoe", [f"model.layers.1.mlp.experts.7.{w}_proj.weight" for w in ("gate", "up", "down")], {},
     "num_experts = 8, but layer 1 holds 7 experts"),
    ("olmoe", [], {"model.layers.0.mlp.experts.8.up_proj.weight": np.zeros((48, 64), np.float32)},
     r"num_experts = 8, but the file holds expert 8 \(layers.0.experts.8.w_up\)"),
    ("mixtral", [], {"model.layers.1.block_sparse_moe.gate.weight": np.zeros((4, 64), np.float32)},
     "num_local_experts = 8, but the router layers.1.router scores 4 experts"),
    # transformers 5 calls Mixtral's block mlp: the same router under both names is ambiguous
    ("mixtral", [], {"model.layers.0.mlp.gate.weight": np.zeros((8, 64), np.float32)},
     r"both model.layers.0.\S+ and model.layers.0.\S+ hold layers.0.router"),
    ("mixtral", ["model.layers.0.block_sparse_moe.experts.2.w3.weight"], {},
     "missing weights: layers.0.experts.2.w_up"),
])
def test_hf_expert_tensors_that_disagree_are_named(tmp_path, family, drop, add, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model(copy_model(TINY[family], tmp_path / "m", drop=drop, add=add))


def test_hf_moe_defaults_are_transformers():
    """What a config.json that omits a key means: transformers' defaults (norm_topk_prob false for
    Qwen3-MoE and OLMoE; Mixtral always renormalises), and Qwen3-MoE's sliding window only with
    use_sliding_window."""
    import json
    from corelm.loader.hf import spec_from_hf_config

    def spec(family, **edits):
        config = json.load(open(os.path.join(TINY[family], "config.json")))
        config.update(edits)
        return spec_from_hf_config({k: v for k, v in config.items() if v is not None}, {}, family)

    assert spec("qwen3moe", norm_topk_prob=None).moe_norm_topk is False
    assert spec("olmoe", norm_topk_prob=None).moe_norm_topk is False
    assert spec("mixtral", norm_topk_prob=False).moe_norm_topk is True
    assert (spec("qwen3moe", num_experts_per_tok=None).num_experts_used, spec("mixtral").num_experts_used) == (8, 2)
    assert spec("qwen3moe", num_experts=None, num_local_experts=None).num_experts == 128
    assert spec("qwen3moe", moe_intermediate_size=None).intermediate_size == 768
    assert spec("qwen3moe", sliding_window=64).sliding_window is None
    assert spec("qwen3moe", sliding_window=64, use_sliding_window=True).sliding_window == 64
    assert spec("mixtral", sliding_window=64).sliding_window == 64
    dense = spec("qwen3moe", architectures=["Qwen3ForCausalLM"])
    assert (dense.num_experts, dense.num_experts_used, dense.moe_norm_topk) == (0, 0, False)


@pytest.mark.parametrize("weights", ["fp32", "q4_1"])
def test_converted_moe_model_keeps_its_experts(tmp_path, weights):
    """convert writes the MoE spec fields and every expert; the routers stay fp32 and q4_1's experts are
    calibrated on the tokens routed to them."""
    from corelm.convert import convert
    from corelm.loader.corelm_format import CorelmWeights
    out = str(tmp_path / f"qwen3moe-{weights}")
    convert(TINY["qwen3moe"], out, weights=weights)
    a, b = load_model(TINY["qwen3moe"]), load_model(out)
    assert a.spec == b.spec
    types = {n: t.type for n, t in CorelmWeights(os.path.join(out, "weights.corelm")).tensors.items()}
    assert types["layers.1.router"] == "f32"
    if weights == "fp32":
        for name in a.weight_names():
            np.testing.assert_array_equal(a.get_weight(name), b.get_weight(name), err_msg=name)
    else:
        assert types["layers.1.experts.7.w_gate"] == "q4m"      # 64 columns: whole blocks
        w, q = a.get_weight("layers.1.experts.7.w_gate"), b.get_weight("layers.1.experts.7.w_gate")
        assert float(np.mean((w - q) ** 2) / np.mean(w ** 2)) < 1e-2


def test_moe_calibration_statistics_come_from_the_routed_tokens():
    """Each expert's statistics are over the rows the router sent it: as many as the forward's routing
    (Model.last_routing) gave it, chunk by chunk."""
    from corelm.calibrate import activation_importance, calibration_ids, input_squares
    m = load_model(TINY["olmoe"])
    ids = calibration_ids(m)[:60]
    engine = build_core_model(load_model(TINY["olmoe"]), dtype="fp32", threads=1, max_seq_len=64)
    counts = np.zeros((m.spec.num_layers, m.spec.num_experts), np.int64)
    for chunk in (ids[:40], ids[40:]):
        core_forward(engine, np.asarray(chunk, np.int32), 0, True)
        for layer, routed in enumerate(engine.last_routing()):
            counts[layer] += np.bincount(routed.ravel(), minlength=m.spec.num_experts)
    sq = input_squares(m, ids, chunk=40)
    for (layer, expert), n in np.ndenumerate(counts):
        for part in ("w_gate", "w_up", "w_down"):
            assert sq.get(f"layers.{layer}.experts.{expert}.{part}", (None, 0))[1] == n
    imp = activation_importance(load_model(TINY["olmoe"]), ids, chunk=40)
    for name, (sums, rows) in sq.items():
        if not name.endswith(".router"):
            np.testing.assert_allclose(imp[name], sums / rows, rtol=1e-6, err_msg=name)
    assert "layers.0.router" not in imp
    assert np.array_equal(imp["layers.1.experts.3.w_up"], imp["layers.1.experts.3.w_gate"])


def test_info_shows_the_experts():
    from corelm.engine.system import model_info, system_info
    from corelm.entrypoints.cli.info import format_info
    info = model_info(TINY["mixtral"])
    assert (info["experts"], info["experts_used"], info["intermediate_size"]) == (8, 2, 48)
    assert "ffn 48 per expert, experts 8, 2 active" in format_info({**system_info(), "model": info})
    assert model_info(TINY["qwen3"])["experts"] == 0
