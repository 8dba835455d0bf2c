"""GGUF parsing, dequantization against scalar references, the llama q/k un-permutation, and GGUF -> LoadedModel."""
import os
import struct

import numpy as np
import pytest

from corelm.loader import ModelLoadError, load_model
from corelm.loader.gguf import ggml_type_ids, read_gguf, unpermute_rope_rows
from corelm.loader.safetensors import SafetensorsFile
from corelm.loader.spec import weight_shapes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO, "tests", "data", "corrupt")
MODELS = os.path.join(REPO, "tests", "data", "models")


def _stories_dir():
    local = os.path.join(MODELS, "stories260K")
    if os.path.isfile(os.path.join(local, "stories260K.gguf")):
        return local
    return os.path.join(MODELS, "stories260K")


from conftest import corpus_tool, real_model  # noqa: E402

tool = corpus_tool()


pytestmark = pytest.mark.usefixtures("stub_tokenizer")  # conftest: keeps these tests about the loader


# ---------------------------------------------------------------------------------------------------
# Parsing.

@pytest.mark.parametrize("name", ["valid_tiny.gguf", "valid_tiny_v2.gguf", "valid_alignment_64.gguf"])
def test_valid_tiny_file(name):
    g = read_gguf(os.path.join(CORPUS, name))
    assert g.version == (2 if "v2" in name else 3)
    assert g.alignment == (64 if "64" in name else 32)
    assert g.data_offset % g.alignment == 0
    md = g.metadata
    assert md["general.architecture"] == "llama"
    assert md["general.quantization_version"] == 2
    assert md["test.flag"] is True
    assert md["test.float"] == 0.5
    assert md["test.int64"] == -7
    assert md["test.scores"] == [0.0, -1.5, 2.25]
    assert md["test.tokens"] == ["<unk>", "hello", "wörld"]
    assert {n: t.shape for n, t in g.tensors.items()} == {
        "f32": (2, 4), "f16": (8,), "bf16": (4,), "q8_0": (2, 32), "q4_0": (32,), "q4_1": (64,)}
    assert g.tensors["q4_1"].type_name == "Q4_1"

    np.testing.assert_array_equal(g.dequantize("f32"), (np.arange(8) - 3.5).reshape(2, 4))
    np.testing.assert_array_equal(g.dequantize("f16"), np.arange(8) * 0.25)
    np.testing.assert_array_equal(g.dequantize("bf16"), [1.0, -2.0, 0.5, 3.0])
    q = (np.arange(64) % 200 - 100).reshape(2, 32)
    np.testing.assert_array_equal(g.dequantize("q8_0"), q * np.array([[0.5], [0.25]]))
    np.testing.assert_array_equal(g.dequantize("q4_0"), (np.arange(32) % 16 - 8) * 2.0)
    nib = (np.arange(64) % 16).reshape(2, 32)
    want = nib * np.array([[0.5], [1.0]]) + np.array([[-1.0], [3.0]])
    np.testing.assert_array_equal(g.dequantize("q4_1").reshape(2, 32), want)
    for n in g.tensors:
        w = g.dequantize(n)
        assert w.dtype == np.float32 and w.flags.c_contiguous


def test_missing_file_and_unknown_tensor(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot open"):
        read_gguf(str(tmp_path / "nope.gguf"))
    g = read_gguf(os.path.join(CORPUS, "valid_tiny.gguf"))
    with pytest.raises(ModelLoadError, match="no tensor named"):
        g.dequantize("missing")


def test_unsupported_quant_type_names_the_type(tmp_path):
    p = tmp_path / "iq2.gguf"
    p.write_bytes(tool.build_gguf([], [("w", [256], ggml_type_ids()["IQ2_XXS"], b"\0" * 66)]))
    g = read_gguf(str(p))
    with pytest.raises(ModelLoadError, match=r"tensor w uses GGUF type IQ2_XXS, which corelm does not support yet "
                                             r"\(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, "
                                             r"Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS\)"):
        g.dequantize("w")


# ---------------------------------------------------------------------------------------------------
# Dequantization against straightforward scalar code, on random blocks.

def _f16(b: bytes) -> float:
    return struct.unpack("<e", b)[0]


def _ref_q8_0(raw: bytes):
    out = []
    for i in range(0, len(raw), 34):
        d = np.float32(_f16(raw[i:i + 2]))
        out += [np.float32(q) * d for q in struct.unpack("<32b", raw[i + 2:i + 34])]
    return np.array(out, dtype=np.float32)


def _ref_q4_0(raw: bytes):
    out = []
    for i in range(0, len(raw), 18):
        d = np.float32(_f16(raw[i:i + 2]))
        qs = raw[i + 2:i + 18]
        block = [0.0] * 32
        for j in range(16):
            block[j] = np.float32((qs[j] & 0x0F) - 8) * d
            block[j + 16] = np.float32((qs[j] >> 4) - 8) * d
        out += block
    return np.array(out, dtype=np.float32)


def _ref_q4_1(raw: bytes):
    out = []
    for i in range(0, len(raw), 20):
        d, m = np.float32(_f16(raw[i:i + 2])), np.float32(_f16(raw[i + 2:i + 4]))
        qs = raw[i + 4:i + 20]
        block = [0.0] * 32
        for j in range(16):
            block[j] = np.float32(qs[j] & 0x0F) * d + m
            block[j + 16] = np.float32(qs[j] >> 4) * d + m
        out += block
    return np.array(out, dtype=np.float32)


def _random_blocks(rng, n_blocks, n_scales, payload):
    """Blocks of n_scales finite f16 scales followed by `payload` random bytes."""
    blocks = []
    for _ in range(n_blocks):
        scales = (rng.standard_normal(n_scales) * 0.1).astype("<f2").tobytes()
        blocks.append(scales + rng.integers(0, 256, payload, dtype=np.uint8).tobytes())
    return b"".join(blocks)


@pytest.mark.parametrize("type_name,n_scales,payload,ref", [
    ("Q8_0", 1, 32, _ref_q8_0), ("Q4_0", 1, 16, _ref_q4_0), ("Q4_1", 2, 16, _ref_q4_1)])
def test_dequantize_matches_scalar_reference(tmp_path, type_name, n_scales, payload, ref):
    rng = np.random.default_rng(7)
    rows, cols = 3, 96                       # 3 blocks per row
    raw = _random_blocks(rng, rows * cols // 32, n_scales, payload)
    p = tmp_path / "q.gguf"
    p.write_bytes(tool.build_gguf([], [("w", [cols, rows], ggml_type_ids()[type_name], raw)]))
    got = read_gguf(str(p)).dequantize("w")
    assert got.shape == (rows, cols) and got.dtype == np.float32
    np.testing.assert_array_equal(got.reshape(-1), ref(raw))


def test_dequantize_matches_gguf_package(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize
    rng = np.random.default_rng(3)
    for type_name, n_scales, payload in (("Q8_0", 1, 32), ("Q4_0", 1, 16), ("Q4_1", 2, 16)):
        raw = _random_blocks(rng, 8, n_scales, payload)
        p = tmp_path / f"{type_name}.gguf"
        p.write_bytes(tool.build_gguf([], [("w", [64, 4], ggml_type_ids()[type_name], raw)]))
        want = dequantize(np.frombuffer(raw, np.uint8).reshape(4, -1), gguf.GGMLQuantizationType[type_name])
        np.testing.assert_array_equal(read_gguf(str(p)).dequantize("w"), want)


def test_f16_bf16_conversions(tmp_path):
    vals = np.array([0.0, -0.0, 1.5, -65504.0, 6.1e-5, np.inf], dtype=np.float32)
    p = tmp_path / "h.gguf"
    p.write_bytes(tool.build_gguf([], [("h", [6], ggml_type_ids()["F16"], tool.f16_bytes(vals)),
                                       ("b", [6], ggml_type_ids()["BF16"], tool.bf16_bytes(vals))]))
    g = read_gguf(str(p))
    np.testing.assert_array_equal(g.dequantize("h"), vals.astype(np.float16).astype(np.float32))
    bf = (vals.view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(g.dequantize("b"), bf)


# ---------------------------------------------------------------------------------------------------
# The llama q/k permutation.

def permute_like_converter(w, n_head):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim,cols", [(8, 8, 64), (3, 64, 16), (1, 32, 0)])
def test_unpermute_inverts_the_converter(n_head, head_dim, cols):
    rng = np.random.default_rng(0)
    shape = (n_head * head_dim, cols) if cols else (n_head * head_dim,)
    w = rng.standard_normal(shape).astype(np.float32)
    p = permute_like_converter(w, n_head)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute_rope_rows(p, n_head), w)


def test_stories260k_gguf_matches_hf_weights():
    """The GGUF (interleaved RoPE layout) and the HF folder made from it by transformers must agree on every
    internal weight once q/k are un-permuted; this pins the permutation direction to a real file."""
    d = _stories_dir()
    g_model = load_model(os.path.join(d, "stories260K.gguf"))
    h_model = load_model(d)
    assert g_model.spec == h_model.spec
    assert g_model.source_format == "gguf" and h_model.source_format == "hf"
    for name, shape in weight_shapes(h_model.spec).items():
        a, b = g_model.get_weight(name), h_model.get_weight(name)
        assert a.shape == b.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=name)
    # ... and the un-permutation is what made them agree.
    raw_q = read_gguf(os.path.join(d, "stories260K.gguf")).dequantize("blk.0.attn_q.weight")
    assert not np.allclose(raw_q, h_model.get_weight("layers.0.wq"))


# ---------------------------------------------------------------------------------------------------
# GGUF -> LoadedModel, with GGUF files written from the tiny HF test models.

def gguf_from_hf(folder, out, *, arch, quant="F32", extra_tensors=(), extra_meta=(), drop=()):
    """Convert an HF test folder to GGUF the way llama.cpp's converter does (llama: q/k permuted)."""
    import json
    cfg = json.load(open(os.path.join(folder, "config.json")))
    st = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    meta = [("general.architecture", tool.STRING, arch),
            (f"{arch}.context_length", tool.UINT32, cfg["max_position_embeddings"]),
            (f"{arch}.embedding_length", tool.UINT32, cfg["hidden_size"]),
            (f"{arch}.block_count", tool.UINT32, cfg["num_hidden_layers"]),
            (f"{arch}.feed_forward_length", tool.UINT32, cfg["intermediate_size"]),
            (f"{arch}.attention.head_count", tool.UINT32, heads),
            (f"{arch}.attention.head_count_kv", tool.UINT32, kv),
            (f"{arch}.attention.key_length", tool.UINT32, head_dim),
            (f"{arch}.attention.value_length", tool.UINT32, head_dim),
            (f"{arch}.rope.freq_base", tool.FLOAT32, theta),
            (f"{arch}.attention.layer_norm_rms_epsilon", tool.FLOAT32, cfg["rms_norm_eps"]),
            ("tokenizer.ggml.model", tool.STRING, "llama"),
            ("tokenizer.ggml.tokens", tool.ARRAY, (tool.STRING, [f"t{i}" for i in range(cfg["vocab_size"])])),
            ("tokenizer.ggml.bos_token_id", tool.UINT32, 1),
            ("tokenizer.ggml.eos_token_id", tool.UINT32, 2),
            ("tokenizer.chat_template", tool.STRING, "{{ messages }}")]
    overrides = {k: (k, t, v) for k, t, v in extra_meta}      # replace keys already there, append the rest
    meta = [overrides.pop(k, (k, t, v)) for k, t, v in meta] + list(overrides.values())
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    tensors = []
    for hf in st.keys():
        if hf in names:
            gname = names[hf]
        else:
            _, _, i, rest = hf.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{per_layer[mod]}.{kind}"
        if gname in drop:
            continue
        w = st.get(hf)
        if arch == "llama" and ".attn_q." in gname:
            w = permute_like_converter(w, heads)
        if arch == "llama" and ".attn_k." in gname:
            w = permute_like_converter(w, kv)
        ne = list(reversed(w.shape))
        if quant == "Q8_0" and w.ndim == 2 and gname != "token_embd.weight":
            tensors.append((gname, ne, tool.Q8_0, _quantize_q8_0(w)))
        elif quant == "BF16" and w.ndim == 2:
            tensors.append((gname, ne, tool.BF16, tool.bf16_bytes(w)))
        else:
            tensors.append((gname, ne, tool.F32, tool.f32_bytes(w)))
    tensors += list(extra_tensors)
    with open(out, "wb") as f:
        f.write(tool.build_gguf(meta, tensors))
    return str(out)


def _quantize_q8_0(w):
    blocks = w.reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
    inv = np.where(d == 0, 0, 1 / d.astype(np.float32))
    return tool.q8_0_bytes(d.astype(np.float32), np.round(blocks * inv[:, None]).astype(np.int8))


@pytest.mark.parametrize("model,arch", [("tiny-mistral", "llama"), ("tiny-qwen2", "qwen2"),
                                        ("stories260K", "llama")])
def test_gguf_written_from_hf_loads_the_same_model(tmp_path, model, arch):
    folder = os.path.join(MODELS, model) if model != "stories260K" else _stories_dir()
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        pytest.skip(f"{model} test model not present")
    hf = load_model(folder)
    gg = load_model(gguf_from_hf(folder, tmp_path / "m.gguf", arch=arch))
    s_hf, s_gg = hf.spec, gg.spec
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_ids"):
        assert getattr(s_gg, field) == getattr(s_hf, field), field
    assert s_gg.arch == arch and s_gg.rope_theta == pytest.approx(s_hf.rope_theta)
    assert s_gg.rms_norm_eps == pytest.approx(s_hf.rms_norm_eps)
    assert gg.chat_template == "{{ messages }}" and gg.description == "GGUF F32"
    assert gg.generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    assert gg.tokenizer[0] == "gguf"
    for name in weight_shapes(s_hf):
        np.testing.assert_array_equal(gg.get_weight(name), hf.get_weight(name), err_msg=name)


@pytest.mark.parametrize("model,arch", [("tiny-mistral", "llama"), ("tiny-qwen2", "qwen2")])
def test_bf16_matrices_are_packed_as_stored(tmp_path, model, arch):
    """Under dtype bf16, a GGUF's BF16 matrices reach the engine as their rows (llama's q/k un-permuted
    as whole rows), no float copy made, and compute exactly what the float path computes."""
    from conftest import core_forward
    from corelm.engine.model_builder import build_core_model
    folder = os.path.join(MODELS, model)
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        pytest.skip(f"{model} test model not present")
    path = gguf_from_hf(folder, tmp_path / "m.gguf", arch=arch, quant="BF16")
    m = load_model(path)
    assert m.raw_weight_type("layers.0.wq") == "BF16" and m.raw_weight_type("norm") is None
    kind, raw, shape = m.get_raw_weight("layers.0.wk")
    bits = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(bits.reshape(shape), m.get_weight("layers.0.wk"))
    ids = np.array([1, 5, 9, 33, 2, 7], np.int32)
    a = core_forward(build_core_model(m, dtype="bf16", threads=1), ids, 0, True)
    floats = load_model(path)
    floats.get_raw_weight = floats.raw_weight_type = None
    b = core_forward(build_core_model(floats, dtype="bf16", threads=1), ids, 0, True)
    assert np.array_equal(a, b)


def test_q8_0_model_and_description(tmp_path):
    folder = os.path.join(MODELS, "tiny-mistral")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        pytest.skip("tiny-mistral not present")
    hf = load_model(folder)
    gg = load_model(gguf_from_hf(folder, tmp_path / "m.gguf", arch="llama", quant="Q8_0"))
    assert gg.description == "GGUF Q8_0 (+F32)"
    for name in weight_shapes(hf.spec):
        want = hf.get_weight(name)
        tol = np.abs(want).max() / 127 * 0.51 + 1e-6
        np.testing.assert_allclose(gg.get_weight(name), want, atol=tol, rtol=0, err_msg=name)


def test_tied_embeddings_when_output_is_missing(tmp_path):
    folder = os.path.join(MODELS, "tiny-mistral")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        pytest.skip("tiny-mistral not present")
    gg = load_model(gguf_from_hf(folder, tmp_path / "m.gguf", arch="llama", drop={"output.weight"}))
    assert gg.spec.tie_word_embeddings and "lm_head" not in set(gg.weight_names())


def _stories_gguf(tmp_path, **kw):
    return gguf_from_hf(_stories_dir(), tmp_path / "m.gguf", arch="llama", **kw)


def test_rope_freqs_is_refused(tmp_path):
    path = _stories_gguf(tmp_path, extra_tensors=[("rope_freqs.weight", [4], tool.F32, tool.f32_bytes(np.ones(4)))])
    with pytest.raises(ModelLoadError, match="rope_freqs.*not support"):
        load_model(path)


def test_rope_scaling_metadata(tmp_path):
    path = _stories_gguf(tmp_path, extra_meta=[("llama.rope.scaling.type", tool.STRING, "linear"),
                                               ("llama.rope.scaling.factor", tool.FLOAT32, 4.0)])
    assert load_model(path).spec.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    path = _stories_gguf(tmp_path, extra_meta=[("llama.rope.scaling.type", tool.STRING, "longrope"),
                                               ("llama.rope.scaling.factor", tool.FLOAT32, 4.0)])
    with pytest.raises(ModelLoadError, match="RoPE scaling 'longrope'"):
        load_model(path)


def test_unknown_tensor_is_refused(tmp_path):
    extra = [("blk.0.ffn_gate_exps.weight", [8], tool.F32, tool.f32_bytes(np.ones(8)))]
    path = _stories_gguf(tmp_path, extra_tensors=extra)
    with pytest.raises(ModelLoadError, match="unknown tensors.*ffn_gate_exps"):
        load_model(path)


def test_missing_tensor_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="missing weights: layers.2.w_up"):
        load_model(_stories_gguf(tmp_path, drop={"blk.2.ffn_up.weight"}))


def test_unsupported_type_is_refused_at_load(tmp_path):
    path = _stories_gguf(tmp_path, drop={"output_norm.weight"},
                         extra_tensors=[("output_norm.weight", [64], ggml_type_ids()["Q8_1"], b"\0" * 72)])
    with pytest.raises(ModelLoadError, match="output_norm.weight uses GGUF type Q8_1"):
        load_model(path)


@pytest.mark.parametrize("meta,match", [
    ([("general.architecture", tool.STRING, "gpt2")], "unsupported GGUF architecture 'gpt2'"),
    ([("llama.block_count", tool.STRING, "five")], "block_count"),
    ([("llama.attention.head_count_kv", tool.UINT32, 3)], "not a multiple of 3"),
    ([("llama.rope.dimension_count", tool.UINT32, 5)], "rope_dim = 5 must be an even"),
    ([("llama.rope.dimension_count", tool.UINT32, 4096)], "up to head_dim"),
    ([("tokenizer.ggml.eos_token_id", tool.UINT32, 100000)], "outside the vocabulary"),
    ([("llama.block_count", tool.UINT32, 1 << 30)], "num_layers"),
    ([("llama.rope.freq_base", tool.FLOAT32, float("nan"))], "freq_base"),
])
def test_bad_hyper_parameters(tmp_path, meta, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model(_stories_gguf(tmp_path, extra_meta=meta))


# ---------------------------------------------------------------------------------------------------
# The embedded real model.

def test_smollm2_q4_1():
    m = load_model(real_model("SmolLM2-135M-Instruct.Q4_1.gguf"))
    s = m.spec
    assert (s.arch, s.vocab_size, s.hidden_size, s.intermediate_size, s.num_layers, s.num_heads,
            s.num_kv_heads, s.head_dim) == ("llama", 49152, 576, 1536, 30, 9, 3, 64)
    assert s.tie_word_embeddings and not s.attention_bias and s.rope_theta == 100000.0
    assert s.eos_token_ids == [2] and s.bos_token_id == 1
    assert m.description == "GGUF Q4_1 (+Q8_0, F32)"   # the types in the file, most matrices first
    assert "<|im_start|>" in m.chat_template
    wq = m.get_weight("layers.0.wq")
    assert wq.shape == (576, 576) and wq.dtype == np.float32 and wq.flags.c_contiguous
    assert np.isfinite(wq).all() and np.abs(wq).max() > 0
    assert m.get_weight("tok_embeddings").shape == (49152, 576)


def test_smollm2_dequant_matches_gguf_package():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize
    path = real_model("SmolLM2-135M-Instruct.Q4_1.gguf")
    ours = read_gguf(path)
    ref = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "blk.0.attn_norm.weight"):
        t = ref[name]
        want = dequantize(t.data, t.tensor_type).reshape(ours.tensors[name].shape)
        np.testing.assert_array_equal(ours.dequantize(name), want)


# ---------------------------------------------------------------------------------------------------
# Loading fast: the string arrays in C++, the block scales' check in C++, the tokenizer on a thread.

def _prefixed(strings):
    return b"".join(struct.pack("<Q", len(s)) + s for s in strings)


def test_length_prefixed_strings_stop_at_the_first_bad_one():
    from corelm import _core
    good = ["a", "", "ĠHello", "日本", "x" * 300]
    buf = b"pad" + _prefixed([s.encode() for s in good])
    out, end = _core.read_length_prefixed_strings(buf, 3, len(good), 1000)
    assert out == good and end == len(buf)
    assert _core.read_length_prefixed_strings(buf, 3, 2, 1000) == (good[:2], 3 + 8 + 1 + 8)
    for bad in (b"\xc3\x28", b"\xed\xa0\x80"):      # invalid UTF-8, a lone surrogate
        out, end = _core.read_length_prefixed_strings(_prefixed([b"ok", bad, b"later"]), 0, 3, 1000)
        assert out == ["ok"] and end == 10
    assert _core.read_length_prefixed_strings(_prefixed([b"ok", b"y" * 20]), 0, 2, 10)[0] == ["ok"]   # too long
    trunc = _prefixed([b"ok", b"abcdef"])[:-1]
    assert _core.read_length_prefixed_strings(trunc, 0, 2, 100)[0] == ["ok"]                       # truncated
    assert _core.read_length_prefixed_strings(b"\x05\x00", 0, 1, 100) == ([], 0)                     # no length


def test_bad_string_in_a_vocabulary_names_its_element(tmp_path):
    tokens = [f"t{i}" for i in range(512)]
    path = _stories_gguf(tmp_path, extra_meta=[("tokenizer.ggml.tokens", tool.ARRAY, (tool.STRING, tokens))])
    data = open(path, "rb").read()
    i = data.index(b"t300")
    with open(path, "wb") as f:
        f.write(data[:i] + b"\xff300" + data[i + 4:])
    with pytest.raises(ModelLoadError, match=r"element 300 of 'tokenizer.ggml.tokens' is not valid UTF-8"):
        load_model(path)


@pytest.mark.parametrize("type_name,block,fields", [("Q4_K", 144, (0, 2)), ("Q6_K", 210, (208,)),
                                                    ("Q8_0", 34, (0,)), ("Q5_1", 24, (0, 2))])
def test_nonfinite_block_scales_are_counted(type_name, block, fields, caplog):
    from corelm.loader.spec import check_finite_blocks
    raw = np.zeros((7, block), np.uint8)
    for b in range(7):    # finite fp16 everywhere: 65504 (0x7BFF), -0.0, a subnormal
        for f in fields:
            raw[b, f:f + 2] = np.frombuffer(struct.pack("<H", (0x7BFF, 0x8000, 0x0001)[b % 3]), np.uint8)
    raw[2, fields[0]:fields[0] + 2] = (0x00, 0x7C)        # +Inf
    raw[5, fields[-1]:fields[-1] + 2] = (0x01, 0xFE)      # a NaN
    raw[6, fields[0] + 2 if fields[0] + 2 < block else 0] = 0xFF   # a code byte, not a scale: no matter
    with caplog.at_level("WARNING", logger="corelm.loader"):
        check_finite_blocks(type_name, raw.reshape(-1), "f.gguf", "layers.0.wq")
    assert f"layers.0.wq has 2 non-finite {type_name} block scales" in caplog.text
    caplog.clear()
    raw[2] = raw[5] = 0
    check_finite_blocks(type_name, raw, "f.gguf", "layers.0.wq")
    assert "non-finite" not in caplog.text


def test_nonfinite_bf16_values_are_counted(caplog):
    from corelm import _core
    from corelm.loader.spec import check_finite_blocks
    v = np.array([0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC1, 0x0080, 0x8001, 0x3F80], np.uint16)   # 3 non-finite
    with caplog.at_level("WARNING", logger="corelm.loader"):
        check_finite_blocks("BF16", v.view(np.uint8).reshape(2, 8), "m", "layers.1.w_up")
    assert "layers.1.w_up has 3 non-finite values" in caplog.text
    with pytest.raises(ValueError, match="inside its block"):
        _core.count_nonfinite(np.zeros(8, np.uint8), 4, [3])

