"""HF folders -> LoadedModel (config parsing, name mapping, checks), pickle refusal, and load_model dispatch."""
import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

from corelm.loader import LoadedModel, ModelLoadError, load_model
from corelm.loader.safetensors import SafetensorsFile
from corelm.loader.spec import weight_shapes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(REPO, "tests", "data", "models")


from conftest import child_env, corpus_tool  # noqa: E402

tool = corpus_tool()


def _stories_dir():
    return os.path.join(MODELS, "stories260K")


def _tiny(name):
    d = os.path.join(MODELS, name)
    if not os.path.isfile(os.path.join(d, "model.safetensors")):
        pytest.skip(f"{name} test model not present")
    return d


pytestmark = pytest.mark.usefixtures("stub_tokenizer")  # conftest: keeps these tests about the loader


def copy_model(src, dst, config=None, generation_config=None, drop=(), add=None, files=None):
    """A copy of an HF folder with config.json edited (a dict of updates; None values delete keys),
    tensors dropped or added, and extra files written."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith(".json") and f != "config.json":
            shutil.copy(os.path.join(src, f), dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    for k, v in (config or {}).items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    if generation_config is not None:
        json.dump(generation_config, open(os.path.join(dst, "generation_config.json"), "w"))
    st = SafetensorsFile(os.path.join(src, "model.safetensors"))
    arrays = {n: ("F32", list(st.tensors[n].shape), tool.f32_bytes(st.get(n))) for n in st.keys() if n not in drop}
    for n, arr in (add or {}).items():
        arrays[n] = ("F32", list(arr.shape), tool.f32_bytes(arr))
    with open(os.path.join(dst, "model.safetensors"), "wb") as f:
        f.write(tool.safetensors_from_arrays(arrays, {"format": "pt"}))
    for name, text in (files or {}).items():
        with open(os.path.join(dst, name), "w") as f:
            f.write(text)
    return str(dst)


# ---------------------------------------------------------------------------------------------------
# The test models.

def test_stories260k_folder():
    d = _stories_dir()
    m = load_model(d)
    assert isinstance(m, LoadedModel)
    s = m.spec
    assert (s.arch, s.vocab_size, s.hidden_size, s.intermediate_size, s.num_layers, s.num_heads,
            s.num_kv_heads, s.head_dim) == ("llama", 512, 64, 172, 5, 8, 4, 8)
    assert s.rope_theta == 10000.0 and s.rope_scaling is None and s.max_position_embeddings == 2048
    assert not s.tie_word_embeddings and not s.attention_bias and s.sliding_window is None
    assert s.bos_token_id == 1 and s.eos_token_ids == [2]
    assert m.source_format == "hf" and m.source == os.path.abspath(d)
    assert m.tokenizer == ("hf", os.path.abspath(d))
    assert m.generation_config["eos_token_id"] == 2
    assert m.description == "HF safetensors F32"
    st = SafetensorsFile(os.path.join(d, "model.safetensors"))
    np.testing.assert_array_equal(m.get_weight("layers.3.wk"), st.get("model.layers.3.self_attn.k_proj.weight"))
    np.testing.assert_array_equal(m.get_weight("lm_head"), st.get("lm_head.weight"))
    for name, shape in weight_shapes(s).items():
        w = m.get_weight(name)
        assert w.shape == shape and w.dtype == np.float32 and w.flags.c_contiguous
    with pytest.raises(ModelLoadError, match="no weight named"):
        m.get_weight("layers.9.wq")


def test_tiny_qwen2_has_biases():
    m = load_model(_tiny("tiny-qwen2"))
    assert m.spec.arch == "qwen2" and m.spec.attention_bias and m.spec.rope_theta == 1e6
    assert m.get_weight("layers.1.bk").shape == (32,)
    assert {"layers.0.bq", "layers.0.bk", "layers.0.bv"} <= set(m.weight_names())


def test_tiny_llama3_tied_with_rope_scaling():
    m = load_model(_tiny("tiny-llama3"))
    s = m.spec
    assert s.tie_word_embeddings and "lm_head" not in set(m.weight_names())
    assert s.head_dim == 32 and s.num_kv_heads == 1 and s.rope_theta == 500000.0
    assert s.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert m.get_weight("layers.0.wq").shape == (128, 64)


def test_tiny_mistral():
    m = load_model(_tiny("tiny-mistral"))
    assert m.spec.arch == "mistral" and m.spec.sliding_window is None and not m.spec.attention_bias


# ---------------------------------------------------------------------------------------------------
# config.json variants.

def test_rope_from_rope_parameters_only(tmp_path):
    d = copy_model(_tiny("tiny-llama3"), tmp_path / "m", config={"rope_theta": None, "rope_scaling": None})
    s = load_model(d).spec
    assert s.rope_theta == 500000.0 and s.rope_scaling["rope_type"] == "llama3"
    assert "rope_theta" not in s.rope_scaling


def test_legacy_rope_scaling_type_key(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", config={"rope_scaling": {"type": "linear", "factor": 2.0},
                                                           "rope_parameters": None})
    assert load_model(d).spec.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_defaults_when_keys_are_absent(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m",
                   config={"head_dim": None, "num_key_value_heads": None, "rope_theta": None, "rope_parameters": None,
                           "rope_scaling": None, "max_position_embeddings": None, "rms_norm_eps": None},
                   add={})
    # Without num_key_value_heads the model is MHA: k/v must then have 8 heads, which this file does not.
    with pytest.raises(ModelLoadError, match=r"layers.0.wk has shape \(32, 64\).*\(64, 64\)"):
        load_model(d)
    d = copy_model(_stories_dir(), tmp_path / "m2", config={"head_dim": None, "rope_theta": None,
                                                             "rope_parameters": None, "rms_norm_eps": None})
    s = load_model(d).spec
    assert s.head_dim == 8 and s.rope_theta == 10000.0 and s.rms_norm_eps == 1e-6


def test_eos_list_from_generation_config(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", generation_config={"eos_token_id": [2, 0, 2], "bos_token_id": 1})
    m = load_model(d)
    assert m.spec.eos_token_ids == [2, 0] and m.generation_config["eos_token_id"] == [2, 0, 2]


def test_eos_out_of_vocab(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", generation_config={"eos_token_id": 9999})
    with pytest.raises(ModelLoadError, match="special token id 9999 is outside the vocabulary"):
        load_model(d)


@pytest.mark.parametrize("config,match", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     "unsupported architecture GPT2LMHeadModel; corelm supports LlamaForCausalLM, MistralForCausalLM, "
     "Qwen2ForCausalLM"),
    ({"architectures": None, "model_type": "gpt_neox"}, "unsupported architecture model_type 'gpt_neox'"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"mlp_bias": True}, "MLP biases"),
    ({"quantization_config": {"quant_method": "awq"}}, r"pre-quantized .*awq"),
    ({"vocab_size": None}, "no 'vocab_size'"),
    ({"num_hidden_layers": "5"}, "num_layers = '5'"),
    ({"num_hidden_layers": 10 ** 9}, "num_layers"),
    ({"num_key_value_heads": 3}, "not a multiple of 3"),
    ({"head_dim": 7}, "odd"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"vocab_size": 256}, r"tok_embeddings has shape \(512, 64\).*\(256, 64\)"),
    ({"rope_scaling": "yes"}, "rope_scaling must be an object"),
])
def test_bad_config(tmp_path, config, match):
    d = copy_model(_stories_dir(), tmp_path / "m", config=config)
    with pytest.raises(ModelLoadError, match=match):
        load_model(d)


def test_model_type_without_architectures(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", config={"architectures": None})
    assert load_model(d).spec.arch == "llama"


def test_qwen2_partial_sliding_window_is_refused(tmp_path):
    d = copy_model(_tiny("tiny-qwen2"), tmp_path / "m",
                   config={"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1})
    with pytest.raises(ModelLoadError, match="sliding-window"):
        load_model(d)
    d = copy_model(_tiny("tiny-qwen2"), tmp_path / "m2",
                   config={"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2})
    assert load_model(d).spec.sliding_window is None


def test_mistral_sliding_window(tmp_path):
    d = copy_model(_tiny("tiny-mistral"), tmp_path / "m", config={"sliding_window": 4096})
    assert load_model(d).spec.sliding_window == 4096


def test_bad_json(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m")
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"vocab_size": 512, "vocab_size": 513}')
    with pytest.raises(ModelLoadError, match="duplicate key 'vocab_size'"):
        load_model(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write("{oops")
    with pytest.raises(ModelLoadError, match="could not read config.json"):
        load_model(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write("[1]")
    with pytest.raises(ModelLoadError, match="not a JSON object"):
        load_model(d)


def test_missing_config(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m")
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(d)


# ---------------------------------------------------------------------------------------------------
# Tensor names.

def test_missing_lm_head_when_untied(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", drop={"lm_head.weight"})
    with pytest.raises(ModelLoadError, match="lm_head.weight is missing and tie_word_embeddings is false"):
        load_model(d)


def test_lm_head_ignored_when_tied(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", config={"tie_word_embeddings": True})
    m = load_model(d)
    assert "lm_head" not in set(m.weight_names())


def test_unknown_tensor_is_refused(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", add={"model.layers.0.mlp.experts.0.weight": np.zeros(4)})
    with pytest.raises(ModelLoadError, match="unknown tensors for a llama model: model.layers.0.mlp.experts.0.weight"):
        load_model(d)


def test_layer_beyond_num_layers_is_refused(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", add={"model.layers.5.input_layernorm.weight": np.ones(64)})
    with pytest.raises(ModelLoadError, match="unexpected weights.*layers.5.attn_norm"):
        load_model(d)


def test_bias_on_a_model_without_biases_is_refused(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", add={"model.layers.0.self_attn.q_proj.bias": np.zeros(64)})
    with pytest.raises(ModelLoadError, match="unexpected weights.*layers.0.bq"):
        load_model(d)


def test_missing_layer_tensor(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", drop={"model.layers.4.mlp.up_proj.weight"})
    with pytest.raises(ModelLoadError, match="missing weights: layers.4.w_up"):
        load_model(d)


def test_rotary_inv_freq_is_ignored(tmp_path):
    d = copy_model(_stories_dir(), tmp_path / "m", add={"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4)})
    assert load_model(d).spec.num_layers == 5


def test_bf16_and_f16_weights_are_converted(tmp_path):
    src = _stories_dir()
    st = SafetensorsFile(os.path.join(src, "model.safetensors"))
    d = tmp_path / "m"
    copy_model(src, d)
    arrays = {}
    for i, n in enumerate(st.keys()):
        w = st.get(n)
        arrays[n] = ("BF16", list(w.shape), tool.bf16_bytes(w)) if i % 2 else ("F16", list(w.shape), tool.f16_bytes(w))
    (d / "model.safetensors").write_bytes(tool.safetensors_from_arrays(arrays))
    m = load_model(str(d))
    assert m.description == "HF safetensors BF16/F16, converted to fp32 at load"
    w = m.get_weight("norm")
    assert w.dtype == np.float32
    np.testing.assert_allclose(w, st.get("model.norm.weight"), rtol=1e-2)


def test_bf16_matrices_are_packed_as_stored(tmp_path):
    """Under dtype bf16, a BF16 checkpoint's matrices reach the engine as their stored rows (no float copy
    of a matrix at load) and compute exactly what the float path computes; other dtypes convert them."""
    from conftest import core_forward
    from corelm.engine.model_builder import build_core_model
    src = _stories_dir()
    st = SafetensorsFile(os.path.join(src, "model.safetensors"))
    d = tmp_path / "m"
    copy_model(src, d)
    (d / "model.safetensors").write_bytes(tool.safetensors_from_arrays(
        {n: ("BF16", list(st.get(n).shape), tool.bf16_bytes(st.get(n))) for n in st.keys()}))
    m = load_model(str(d))
    raw = m.get_raw_weight("layers.1.wq")
    assert raw[0] == "BF16" and raw[1].dtype == np.uint8 and tuple(raw[2]) == m.get_weight("layers.1.wq").shape
    assert m.raw_weight_type("norm") is None and m.get_raw_weight("layers.1.attn_norm") is None
    ids = np.array([1, 5, 9, 33, 2, 7], np.int32)
    handed = []
    get_raw = m.get_raw_weight
    m.get_raw_weight = lambda n: handed.append(n) or get_raw(n)
    a = core_forward(build_core_model(m, dtype="bf16", threads=1), ids, 0, True)
    assert "layers.0.w_down" in handed and "tok_embeddings" in handed
    floats = load_model(str(d))
    floats.get_raw_weight = floats.raw_weight_type = None      # every matrix through get_weight (fp32)
    b = core_forward(build_core_model(floats, dtype="bf16", threads=1), ids, 0, True)
    assert np.array_equal(a, b)
    handed.clear()
    core_forward(build_core_model(m, dtype="q8_0", threads=1), ids, 0, True)
    assert not handed


# ---------------------------------------------------------------------------------------------------
# Chat templates.

def test_chat_template_string_list_and_jinja(tmp_path):
    src = _stories_dir()
    tc = json.load(open(os.path.join(src, "tokenizer_config.json")))
    d = copy_model(src, tmp_path / "a", files={"tokenizer_config.json": json.dumps(dict(tc, chat_template="T1"))})
    assert load_model(d).chat_template == "T1"
    named = [{"name": "tool_use", "template": "T2"}, {"name": "default", "template": "T3"}]
    d = copy_model(src, tmp_path / "b", files={"tokenizer_config.json": json.dumps(dict(tc, chat_template=named))})
    assert load_model(d).chat_template == "T3"
    d = copy_model(src, tmp_path / "c", files={"tokenizer_config.json": json.dumps(dict(tc, chat_template="T1")),
                                               "chat_template.jinja": "J"})
    assert load_model(d).chat_template == "J"
    assert load_model(src).chat_template is None
    tc.pop("chat_template", None)  # a processor's chat_template.json (Gemma 3 4B+)
    d = copy_model(src, tmp_path / "d", files={"tokenizer_config.json": json.dumps(tc),
                                               "chat_template.json": json.dumps({"chat_template": "P"})})
    assert load_model(d).chat_template == "P"


# ---------------------------------------------------------------------------------------------------
# Pickles, sharded folders, dispatch and the hub.

class _Boom:
    """Unpickling this would create a file: proof that the loader never unpickles."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_only_folder_is_refused(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(os.path.join(_stories_dir(), "config.json"), d)
    marker = tmp_path / "pwned"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(ModelLoadError, match=r"pickle files \(pytorch_model.bin\).*refuses"):
        load_model(str(d))
    with pytest.raises(ModelLoadError, match="pickle"):
        load_model(str(d / "pytorch_model.bin"))
    (d / "model.pth").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_model(str(d / "model.pth"))
    assert not marker.exists()


def test_sharded_hf_folder(tmp_path):
    src = _stories_dir()
    d = copy_model(src, tmp_path / "m")
    st = SafetensorsFile(os.path.join(d, "model.safetensors"))
    names = st.keys()
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        arrays = {n: ("F32", list(st.tensors[n].shape), tool.f32_bytes(st.get(n))) for n in part}
        (tmp_path / "m" / shard).write_bytes(tool.safetensors_from_arrays(arrays))
        weight_map.update({n: shard for n in part})
    del st
    os.remove(os.path.join(d, "model.safetensors"))
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    m, ref = load_model(d), load_model(src)
    for name in weight_shapes(ref.spec):
        np.testing.assert_array_equal(m.get_weight(name), ref.get_weight(name))


def test_dispatch_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or folder: './does-not-exist'"):
        load_model("./does-not-exist")
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        load_model(str(tmp_path / "a" / "b" / "c"))
    with pytest.raises(ModelLoadError, match="expected a model path or hub repo id"):
        load_model("")
    with pytest.raises(ModelLoadError, match="expected a model path or hub repo id"):
        load_model(None)
    st = tmp_path / "x.safetensors"
    st.write_bytes(tool.valid_safetensors())
    with pytest.raises(ModelLoadError, match="pass the folder"):
        load_model(str(st))
    txt = tmp_path / "notes.txt"
    txt.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file or HF model folder"):
        load_model(str(txt))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(str(empty))


def test_gguf_detected_by_magic_without_extension(tmp_path):
    p = tmp_path / "model.bin.download"
    shutil.copy(os.path.join(_stories_dir(), "stories260K.gguf"), p)
    assert load_model(str(p)).source_format == "gguf"


def test_folder_with_only_gguf_suggests_the_file(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"pass its path \(m.gguf\)"):
        load_model(str(tmp_path))


def test_hub_download_is_used_for_repo_ids(monkeypatch):
    import huggingface_hub
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, allow_patterns))
        return _stories_dir()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files",
                        lambda repo_id, revision=None: sorted(os.listdir(_stories_dir())))
    m = load_model("karpathy/stories260K", revision="main")
    assert m.spec.num_layers == 5
    assert calls[0][0] == "karpathy/stories260K" and calls[0][1] == "main"
    assert "*.safetensors" in calls[0][2] and "*.json" in calls[0][2] and not any("bin" in p for p in calls[0][2])


def test_hub_offline_gives_a_clear_error(tmp_path):
    code = ("from corelm.loader import load_model, ModelLoadError\n"
            "try:\n"
            "    load_model('corelm-test-nonexistent-owner/definitely-not-a-model-xyz')\n"
            "except ModelLoadError as e:\n"
            "    print('ModelLoadError:', e)\n")
    env = child_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "ModelLoadError: could not download 'corelm-test-nonexistent-owner/definitely-not-a-model-xyz' " \
           "from the Hugging Face hub" in out
    assert "pass a local folder or .gguf file" in out


def test_real_tokenizer_integration():
    """With the real corelm.tokenizer (in a subprocess, away from the stub): both stories260K forms load
    and tokenize alike."""
    code = ("import sys\n"
            "try:\n"
            "    import corelm.tokenizer\n"
            "except Exception as e:\n"
            "    print('SKIP', e); sys.exit(0)\n"
            "from corelm.loader import load_model\n"
            "a = load_model(sys.argv[1]); b = load_model(sys.argv[1] + '/stories260K.gguf')\n"
            "print(a.tokenizer.encode('Once upon a time') == b.tokenizer.encode('Once upon a time'))\n")
    env = child_env()
    r = subprocess.run([sys.executable, "-c", code, _stories_dir()], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    if r.stdout.startswith("SKIP"):
        pytest.skip("corelm.tokenizer not importable: " + r.stdout)
    assert r.stdout.strip() == "True"
