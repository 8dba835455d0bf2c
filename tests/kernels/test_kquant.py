"""K-quants written by `corelm convert --weights q4_k|q5_k|q6_k|q4_k_m|q5_k_m` (cpp/kernels/quantize.h,
corelm.convert): GGUF's own block bytes, less error than round-to-nearest, importance-weighted when asked,
llama.cpp's choice of type per matrix, and folders that load, generate and are checked like any other."""
import json
import os

import numpy as np
import pytest

from conftest import MODELS, core_forward
from test_convert import _copy, _entry, _rewrite_header
from test_loader_hf import copy_model

import corelm
from corelm import _core
from corelm.convert import _use_more_bits, convert, k_quant_type, quantize_ggml_search
from corelm.engine.model_builder import build_core_model
from corelm.loader import ModelLoadError, load_model
from corelm.loader.corelm_format import WEIGHTS_FILE, CorelmWeights
from corelm.loader.safetensors import SafetensorsFile

gguf_quants = pytest.importorskip("gguf.quants")   # a test-only dependency: the reference decoder
from gguf import GGMLQuantizationType  # noqa: E402

TYPES = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K", "q5_0": "Q5_0", "q5_1": "Q5_1"}


def weights(seed, rows, cols, heavy=False):
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(2, (rows, cols)) if heavy else rng.standard_normal((rows, cols))) * 0.02
    w[:, ::37] *= 8                                   # outlier columns, as real weight rows have
    w[0, 5] = 1.0                                     # one huge outlier
    w[1] = np.abs(w[1]) + 0.1                         # all positive (a minimum far from zero)
    if rows > 2:
        w[2, :256] = 0                                # a zero super-block
    return w.astype(np.float32)


def gguf_dequant(raw, fmt, shape):
    return gguf_quants.dequantize(raw, GGMLQuantizationType[TYPES[fmt]]).reshape(shape)


def rtn(w, fmt):
    """Plain round-to-nearest with scales from each (sub-)block's range or max |x| (what a quantizer without
    a search does), as the floats it decodes to: the baseline the search must beat."""
    f16 = lambda v: v.astype(np.float16).astype(np.float32)  # noqa: E731
    if fmt in ("q5_0", "q6_k"):
        n, nmax = (32, 16) if fmt == "q5_0" else (16, 32)
        b = w.reshape(-1, n)
        m = b[np.arange(len(b)), np.abs(b).argmax(1)]
        d = -m / nmax
        if fmt == "q6_k":   # int8 sub-block scales under one fp16 scale per 256
            s = d.reshape(-1, 16)
            dd = f16(np.abs(s).max(1) / 127)
            d = np.round(s / np.where(dd, dd, 1)[:, None]) * dd[:, None]
        d = f16(d).reshape(-1)
        q = np.clip(np.round(b / np.where(d, d, 1)[:, None]), -nmax, nmax - 1)
        return (q * d[:, None]).reshape(w.shape)
    n, nmax = 32, {"q4_k": 15, "q5_k": 31, "q5_1": 31}[fmt]
    b = w.reshape(-1, n)
    mn = b.min(1) if fmt == "q5_1" else np.minimum(b.min(1), 0)
    d = (b.max(1) - mn) / nmax
    if fmt != "q5_1":   # 6-bit sub-block scales and minimums under fp16 d, dmin per 256
        s, m = d.reshape(-1, 8), -mn.reshape(-1, 8)
        ds, dm = f16(s.max(1) / 63), f16(m.max(1) / 63)
        d = (np.round(s / np.where(ds, ds, 1)[:, None]) * ds[:, None]).reshape(-1)
        mn = -(np.round(m / np.where(dm, dm, 1)[:, None]) * dm[:, None]).reshape(-1)
    d, mn = f16(d), f16(mn)
    q = np.clip(np.round((b - mn[:, None]) / np.where(d, d, 1)[:, None]), 0, nmax)
    return (q * d[:, None] + mn[:, None]).reshape(w.shape)


SHAPES = [(3, 256), (5, 512), (4, 768), (2, 1536)]


@pytest.mark.parametrize("fmt", sorted(TYPES))
@pytest.mark.parametrize("heavy", [False, True])
def test_blocks_are_ggufs_and_decode_as_corelm_does(fmt, heavy):
    for i, shape in enumerate(SHAPES):
        w = weights(i, *shape, heavy=heavy)
        raw = quantize_ggml_search(w, fmt)
        ref = gguf_dequant(raw, fmt, shape)
        ours = np.stack([_core.dequantize_gguf(TYPES[fmt], r, shape[1]) for r in raw])
        assert np.array_equal(ours, ref)              # bit for bit, through corelm's own decoder
        assert np.all(ref[2, :256] == 0) if shape[0] > 2 else True
        assert np.abs(ref - w).max() < 0.5 * np.abs(w).max()


@pytest.mark.parametrize("fmt", sorted(TYPES))
@pytest.mark.parametrize("heavy", [False, True])
def test_less_error_than_round_to_nearest(fmt, heavy):
    ratios = []
    for i, shape in enumerate(SHAPES):
        w = weights(10 + i, *shape, heavy=heavy)
        ours = ((gguf_dequant(quantize_ggml_search(w, fmt), fmt, shape) - w) ** 2).sum()
        ratios.append(ours / ((rtn(w, fmt) - w) ** 2).sum())
    # 3-30% less error (least for the symmetric types, whose max-abs scale is already a good guess)
    assert max(ratios) < 0.995 and np.mean(ratios) < 0.98, ratios


@pytest.mark.parametrize("fmt", sorted(TYPES))
def test_importance_lowers_the_weighted_error(fmt):
    w = weights(20, 16, 768, heavy=True)
    imp = np.exp(np.random.default_rng(21).standard_normal(768) * 1.5).astype(np.float32)
    err = lambda raw: ((((gguf_dequant(raw, fmt, w.shape) - w) ** 2) * imp).sum())  # noqa: E731
    assert err(quantize_ggml_search(w, fmt, imp)) < 0.95 * err(quantize_ggml_search(w, fmt))
    # zero importance everywhere: no information, the plain search
    assert np.array_equal(quantize_ggml_search(w, fmt, np.zeros(768, np.float32)), quantize_ggml_search(w, fmt))


def test_awkward_input_and_bad_shapes():
    w = weights(30, 4, 512)
    w[0, 3], w[1, 300], w[2, 7] = np.nan, np.inf, -np.inf
    for fmt in TYPES:
        raw = quantize_ggml_search(w, fmt)                 # non-finite weights count as 0, no crash
        assert np.array_equal(raw[3], quantize_ggml_search(w[3:4], fmt)[0])
        assert np.all(np.isfinite(gguf_dequant(raw, fmt, w.shape)))
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_ggml_search(np.zeros((2, 288), np.float32), "q4_k")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_ggml_search(np.zeros((2, 48), np.float32), "q5_1")
    with pytest.raises(ValueError):
        _core.quantize_ggml_search(np.zeros((2, 256), np.float32), "Q3_K")
    with pytest.raises(ValueError):
        _core.quantize_ggml_search(np.zeros((2, 256), np.float32), "Q4_K", np.ones(255, np.float32))


def test_type_per_matrix_as_llama_cpp_chooses():
    assert [i for i in range(24) if _use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    kq = lambda weights, name, cols=512, tied=False: k_quant_type(weights, name, (64, cols), tied, 24)  # noqa: E731
    assert kq("q4_k", "layers.3.wq") == "q4_k" and kq("q4_k", "layers.3.wq", 896) == "q5_0"
    assert kq("q5_k", "layers.3.wq", 896) == "q5_1" and kq("q6_k", "layers.3.wq", 896) == "q8_0"
    assert kq("q4_k", "lm_head") == kq("q4_k", "tok_embeddings", tied=True) == "q6_k"
    assert kq("q4_k", "tok_embeddings") == "q4_k" and kq("q4_k", "lm_head", 896) == "q8_0"
    assert kq("q4_k_m", "layers.2.wv") == kq("q4_k_m", "layers.5.w_down") == "q6_k"
    assert kq("q4_k_m", "layers.3.wv") == "q4_k" and kq("q4_k", "layers.2.wv") == "q4_k"
    assert kq("q5_k_m", "layers.23.experts.1.w_down") == "q6_k" and kq("q5_k_m", "layers.3.w_down") == "q5_k"


# ---------------------------------------------------------------------------------------------------
# End to end, on a random Qwen2-shaped model wide enough for super-blocks: hidden 256, FFN 480 (w_down's
# rows are not whole super-blocks: the fallback).

@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("wide") / "m")
    hidden, ffn, layers, heads, kv, hd, vocab = 256, 480, 3, 4, 2, 64, 512
    rng = np.random.default_rng(0)
    t = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv * hd, hidden),
                  p + "self_attn.v_proj.weight": (kv * hd, hidden), p + "self_attn.o_proj.weight": (hidden, heads * hd),
                  p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                  p + "self_attn.v_proj.bias": (kv * hd,), p + "mlp.gate_proj.weight": (ffn, hidden),
                  p + "mlp.up_proj.weight": (ffn, hidden), p + "mlp.down_proj.weight": (hidden, ffn),
                  p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    tensors = {n: (1 + 0.1 * rng.standard_normal(s) if n.endswith("norm.weight") else
                   rng.standard_normal(s) * (0.5 if "embed" in n else 1.5 / np.sqrt(s[-1]))).astype(np.float32)
               for n, s in t.items()}
    tiny = os.path.join(MODELS, "tiny-qwen2")     # its tokenizer and config, none of its tensors
    copy_model(tiny, d, drop=SafetensorsFile(os.path.join(tiny, "model.safetensors")).keys(), add=tensors,
               config={"hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers, "head_dim": hd,
                       "num_attention_heads": heads, "num_key_value_heads": kv, "max_window_layers": layers,
                       "layer_types": ["full_attention"] * layers})
    return d


IDS = np.array([1, 17, 99, 3, 250, 42, 7, 311, 64, 5], np.int32)


def logits(path, dtype):
    return core_forward(build_core_model(load_model(path), dtype=dtype, threads=1, max_seq_len=64), IDS, 0, True)


@pytest.fixture(scope="module")
def folders(wide, tmp_path_factory):
    root = tmp_path_factory.mktemp("kq")
    return {k: convert(wide, str(root / k), weights=k) for k in ("q4_k", "q5_k", "q6_k", "q4_k_m")}


def test_convert_writes_llama_cpp_types_and_runs(wide, folders):
    ref = logits(wide, "fp32")
    err = {}
    for kind, folder in folders.items():
        w = CorelmWeights(os.path.join(folder, WEIGHTS_FILE))
        types = {n: t.type for n, t in w.tensors.items()}
        base = kind[:4]
        assert types["layers.0.wq"] == types["layers.1.w_up"] == types["tok_embeddings"] == base
        assert types["layers.0.w_down"] == {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8"}[base]   # 480 columns
        assert types["lm_head"] == "q6_k" and types["norm"] == types["layers.0.bq"] == "f32"
        # q4_k_m: attn_v of the layers use_more_bits picks (of 3: the last) in Q6_K
        assert types["layers.2.wv"] == ("q6_k" if kind == "q4_k_m" else base) and types["layers.1.wv"] == base
        cfg = json.load(open(os.path.join(folder, "config.json")))
        assert cfg["weights"] == kind and sum(cfg["tensor_types"].values()) == len(types)
        out = logits(folder, "auto")
        assert np.array_equal(out, logits(folder, "q8_0"))      # the folder's own dtype keeps every block
        err[kind] = np.abs(out - ref).mean() / np.abs(ref).mean()
    # a random model amplifies weight errors (q8_0: 3% here, q4_1 with 8-bit embedding and lm_head: 30%)
    assert err["q6_k"] < err["q5_k"] < err["q4_k"] < 0.5
    llm = corelm.LLM(folders["q4_k"], threads=1)
    text = llm.generate("Once upon a time", corelm.SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert len(text.token_ids) == 8


def test_blocks_are_the_weighted_search_of_the_source(wide, folders):
    from corelm.calibrate import activation_importance, calibration_ids
    src = load_model(wide)
    imp = activation_importance(src, calibration_ids(src))
    w = CorelmWeights(os.path.join(folders["q4_k"], WEIGHTS_FILE))
    for name, fmt in [("layers.1.wq", "q4_k"), ("layers.0.w_down", "q5_0"), ("lm_head", "q6_k")]:
        assert np.array_equal(w.raw(name), quantize_ggml_search(src.get_weight(name), fmt, imp[name]).reshape(-1))
    emb = quantize_ggml_search(src.get_weight("tok_embeddings"), "q4_k")     # a row gather: no importance
    assert np.array_equal(w.raw("tok_embeddings"), emb.reshape(-1))


def test_blocks_already_in_the_chosen_type_are_copied(folders, tmp_path, monkeypatch):
    """A source holding the chosen type's blocks (here a q4_k folder) is copied block for block: no calibration."""
    import corelm.calibrate
    monkeypatch.setattr(corelm.calibrate, "activation_importance", None)   # would fail if called
    out = convert(folders["q4_k"], str(tmp_path / "again"), weights="q4_k")
    a, b = CorelmWeights(os.path.join(folders["q4_k"], WEIGHTS_FILE)), CorelmWeights(os.path.join(out, WEIGHTS_FILE))
    assert a.tensors.keys() == b.tensors.keys()
    for name, t in a.tensors.items():
        assert b.tensors[name].type == t.type and np.array_equal(a.raw(name), b.raw(name)), name


@pytest.mark.parametrize("edit, msg", [
    (lambda d: _entry(d, "layers.0.wq").update(nbytes=_entry(d, "layers.0.wq")["nbytes"] - 144), "takes"),
    (lambda d: _entry(d, "layers.0.w_down").update(type="q4_k"), "multiple of the q4_k block size 256"),
])
def test_corrupt_k_quant_folders_are_refused(folders, tmp_path, edit, msg):
    d, path = _copy(folders["q4_k"], tmp_path)
    _rewrite_header(path, edit)
    with pytest.raises(ModelLoadError, match=msg):
        load_model(d)


def test_truncated_k_quant_folder_is_refused(folders, tmp_path):
    d, path = _copy(folders["q4_k"], tmp_path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) - 4096])
    with pytest.raises(ModelLoadError, match="past the end"):
        load_model(d)


def test_draft_conversion_keeps_the_base_type(wide, tmp_path):
    """As a speculative draft (convert(..., draft=True)) q4_k_m puts lm_head and attn_v in Q4_K too (the
    fewest bytes a guess); rows that are not whole super-blocks still fall back to Q5_0."""
    w = CorelmWeights(os.path.join(convert(wide, str(tmp_path / "d"), weights="q4_k_m", draft=True), WEIGHTS_FILE))
    types = {n: t.type for n, t in w.tensors.items()}
    assert types["lm_head"] == types["layers.2.wv"] == types["layers.0.wq"] == "q4_k"
    assert types["layers.0.w_down"] == "q5_0"
