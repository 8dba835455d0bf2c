"""`corelm convert` and the corelm model folder (docs/model-format.md): quantizers, the same logits as the
engine's in-memory dtypes, GGUF blocks copied without a float round trip, strict validation of
weights.corelm, the LLM(path, weights=...) cache and the CLI."""
import json
import os
import shutil
import struct
import zlib

import numpy as np
import pytest

from conftest import DEFAULT_GGUF, MODELS, core_forward
from test_quant import ggml_quantize

import corelm
from corelm import _core
from corelm.calibrate import activation_importance, calibration_ids
from corelm.entrypoints.cli import main as cli_main
from corelm.convert import (cached_conversion, convert, quantize_q4_0, quantize_q4_1, quantize_q4_1_search,
                            quantize_q8_0, to_bf16)
from corelm.engine.model_builder import build_core_model
from corelm.loader import ModelLoadError, load_model
from corelm.loader.corelm_format import ALIGNMENT, MAGIC, PREFIX, WEIGHTS_FILE, CorelmWeights
from corelm.loader.gguf import _DECODERS, read_gguf

STORIES = os.path.join(MODELS, "stories260K")
TINY_QWEN2 = os.path.join(MODELS, "tiny-qwen2")
IDS = np.array([1, 403, 407, 261, 378, 429, 297, 261, 300, 400, 268, 500], np.int32)
BEST = _core.cpu_info()["kernels"]["matmul_fp32"]


def logits(path, dtype, ids=IDS):
    return core_forward(build_core_model(load_model(path), dtype=dtype, threads=1), ids, 0, True)


# ---------------------------------------------------------------------------------------------------
# quantizers

def test_q8_0_matches_ggml_reference_bytes():
    w = np.random.default_rng(0).standard_normal((37, 256)).astype(np.float32)
    w[3] = 0
    w[5, :32] *= 50
    assert np.array_equal(quantize_q8_0(w), ggml_quantize(w, "Q8_0"))


def test_q4_0_matches_the_engines_quantizer():
    """Stored blocks dequantize to what the engine's own dtype="q4" packing gives (the best table)."""
    w = np.random.default_rng(1).standard_normal((64, 512)).astype(np.float32)
    w[2] = 0
    ours = _core.testing.kernel_raw_to_f32(BEST, quantize_q4_0(w), "Q4_0", *w.shape)
    engine = np.stack([_core.testing.kernel_row_to_f32(BEST, w, "q4", r) for r in range(w.shape[0])])
    assert np.mean(ours != engine) < 1e-4       # at most a rare near-tie rounds the other way
    ref = _DECODERS["Q4_0"](ggml_quantize(w, "Q4_0").reshape(-1), w.size).reshape(w.shape)
    assert np.mean(ours != ref) < 1e-3


def test_q4_1_matches_the_engines_quantizer():
    w = np.random.default_rng(2).standard_normal((64, 512)).astype(np.float32)
    w[2], w[5] = 0, w[5] + 3
    ours = _core.testing.kernel_raw_to_f32(BEST, quantize_q4_1(w), "Q4_1", *w.shape)
    engine = np.stack([_core.testing.kernel_row_to_f32(BEST, w, "q4m", r) for r in range(w.shape[0])])
    assert np.mean(ours != engine) < 1e-4
    ref = _DECODERS["Q4_1"](ggml_quantize(w, "Q4_1").reshape(-1), w.size).reshape(w.shape)
    assert np.mean(ours != ref) < 1e-3


def _q4_1_sse(raw, w):
    return float(np.sum((_DECODERS["Q4_1"](raw.reshape(-1), w.size).reshape(w.shape) - w) ** 2))


def test_q4_1_search_beats_round_to_nearest():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 512)).astype(np.float32) * np.float32(0.02)
    w[:, ::37] *= 8                                          # outliers, as real weight rows have
    w[7] = 0
    raw = quantize_q4_1_search(w)
    assert raw.shape == quantize_q4_1(w).shape
    assert _q4_1_sse(raw, w) < 0.9 * _q4_1_sse(quantize_q4_1(w), w)
    assert (raw.reshape(64, -1, 20)[7, :, 4:] == 0).all()       # zero rows stay zero
    # weights already on a Q4_1 grid (a dequantized Q4_1 model) come back without loss
    g = _DECODERS["Q4_1"](ggml_quantize(w, "Q4_1").reshape(-1), w.size).reshape(w.shape)
    assert _q4_1_sse(quantize_q4_1_search(g), g) <= 1e-6 * float(np.sum(g ** 2))


def test_bf16_round_to_nearest_even():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, np.nan, 3.0e38], np.float32)
    b = to_bf16(x)
    back = (b.astype(np.uint32) << 16).view(np.float32)
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == 1 + 2 ** -6 and back[3] == -2.5
    assert np.isinf(back[4]) and np.isnan(back[5]) and np.isfinite(back[6])


# ---------------------------------------------------------------------------------------------------
# converted folders compute what the engine builds in memory

def four_bit_reference(src, weights):
    """src with every whole-block matrix handed to the engine as the 4-bit blocks convert writes (q4_1:
    quantize_q4_1_search weighted by the calibration statistics; q4_0: quantize_q4_0), except the
    embedding and lm_head, which both keep as Q8_0 blocks."""
    m = load_model(src)
    importance = activation_importance(m, calibration_ids(m)) if weights == "q4_1" else None

    def raw(name):
        w = m.get_weight(name)
        if w.ndim != 2 or w.shape[1] % 32:
            return None
        if name in ("tok_embeddings", "lm_head"):
            return "Q8_0", quantize_q8_0(w), w.shape
        if weights == "q4_0":
            return "Q4_0", quantize_q4_0(w), w.shape
        return "Q4_1", quantize_q4_1_search(w, importance[name]), w.shape
    m.get_raw_weight = raw
    m.raw_weight_type = None    # what each matrix is handed as: ask the getter above, not the source's header
    return m


@pytest.mark.parametrize("weights,dtype", [("fp32", "fp32"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"),
                                           ("q4_1", "q4_1")])
@pytest.mark.parametrize("src", [STORIES, TINY_QWEN2])
def test_converted_folder_matches_in_memory_dtype(tmp_path, src, weights, dtype):
    """fp32/bf16/q8_0 folders compute exactly what the engine builds from the source with that dtype; a
    4-bit folder (Q8_0 embeddings; q4_1: blocks from quantize_q4_1_search) what it builds from those blocks."""
    out = convert(src, str(tmp_path / "m"), weights=weights)
    m = load_model(out)
    assert m.source_format == "corelm" and m.spec == load_model(src).spec
    b = logits(out, dtype)
    if weights in ("q4_0", "q4_1"):
        a = core_forward(build_core_model(four_bit_reference(src, weights), dtype=dtype, threads=1), IDS, 0, True)
        assert np.array_equal(a, b)
    else:
        assert np.array_equal(logits(src, dtype), b)
    # the tokenizer and chat template come along
    s = "Once upon a time, there was a little girl."
    assert m.tokenizer.encode(s) == load_model(src).tokenizer.encode(s)
    assert m.chat_template == load_model(src).chat_template


def test_weight_names_are_one_vocabulary(tmp_path):
    """convert and LLM take the same names and aliases (corelm.options): an alias gives the same folder."""
    a = convert(STORIES, str(tmp_path / "a"), weights="q8")
    b = convert(STORIES, str(tmp_path / "b"), weights="q8_0")
    assert open(os.path.join(a, WEIGHTS_FILE), "rb").read() == open(os.path.join(b, WEIGHTS_FILE), "rb").read()
    assert json.load(open(os.path.join(a, "config.json")))["weights"] == "q8_0"
    c = convert(STORIES, str(tmp_path / "c"), weights="f32")
    assert json.load(open(os.path.join(c, "config.json")))["weights"] == "fp32"
    assert np.array_equal(logits(c, "fp32"), logits(STORIES, "float32"))


def test_layout_is_aligned_and_sized(tmp_path):
    out = convert(STORIES, str(tmp_path / "m"), weights="q8")
    w = CorelmWeights(os.path.join(out, WEIGHTS_FILE))
    assert all(t.offset % ALIGNMENT == 0 for t in w.tensors.values())
    assert w.tensors["layers.0.wq"].type == "q8" and w.tensors["layers.0.attn_norm"].type == "f32"
    assert w.tensors["layers.0.w_down"].type == "f32"       # 172 columns: not whole blocks, left to the engine
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["format"] == "corelm" and cfg["format_version"] == 1 and cfg["weights"] == "q8_0"


@pytest.mark.skipif(not os.path.isfile(DEFAULT_GGUF), reason="embedded SmolLM2 GGUF missing")
def test_gguf_blocks_are_copied_not_requantized(tmp_path):
    out = convert(DEFAULT_GGUF, str(tmp_path / "smol-q4"), weights="q4_1")
    w = CorelmWeights(os.path.join(out, WEIGHTS_FILE))
    g = read_gguf(DEFAULT_GGUF)
    # qwen-style naming is irrelevant here: SmolLM2 is llama, so wq/wk rows are un-permuted whole rows
    for name, gname in [("layers.3.wv", "blk.3.attn_v.weight"), ("layers.7.w_down", "blk.7.ffn_down.weight")]:
        assert w.tensors[name].type == "q4m"
        assert np.array_equal(w.raw(name), g.raw(gname))
    assert w.tensors["layers.0.wq"].type == "q4m"
    assert sum(t.type == "q4m" for t in w.tensors.values()) == 210
    assert w.tensors["tok_embeddings"].type == "q8"  # the Q8_0 embedding is copied as it is
    assert np.array_equal(w.raw("tok_embeddings"), g.raw("token_embd.weight"))
    ids = np.array(load_model(DEFAULT_GGUF).tokenizer.encode("The capital of France is"), np.int32)
    a, b = logits(DEFAULT_GGUF, "auto", ids), logits(out, "q4_1", ids)   # the same blocks: the same logits
    assert np.array_equal(a, b)
    assert a[-1].argmax() == b[-1].argmax()
    a, b = load_model(DEFAULT_GGUF), load_model(out)
    for s in ["Hello <|im_start|>user\nWhat is 2+2? ünïcödé 🙂", "  spaces\tand\nnewlines  "]:
        assert a.tokenizer.encode(s) == b.tokenizer.encode(s)
    assert a.tokenizer.eos_token_ids == b.tokenizer.eos_token_ids
    assert a.chat_template == b.chat_template
    assert a.spec == b.spec


# ---------------------------------------------------------------------------------------------------
# validation

@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return convert(STORIES, str(tmp_path_factory.mktemp("good") / "m"), weights="q8")


def _copy(good, tmp_path):
    d = str(tmp_path / "bad")
    shutil.copytree(good, d)
    return d, os.path.join(d, WEIGHTS_FILE)


def _rewrite_header(path, edit, fix_crc=True):
    """Apply edit(header_dict) and write the header back (same length, padded with spaces), re-CRC'd."""
    data = bytearray(open(path, "rb").read())
    magic, ver, align, hlen, crc, res = PREFIX.unpack_from(data, 0)
    doc = json.loads(bytes(data[PREFIX.size:PREFIX.size + hlen]))
    doc["metadata"] = {}        # room for edits that lengthen an entry
    edit(doc)
    new = json.dumps(doc, separators=(",", ":")).encode()
    assert len(new) <= hlen, "edit made the header longer"
    new = new + b" " * (hlen - len(new))
    data[PREFIX.size:PREFIX.size + hlen] = new
    if fix_crc:
        crc = zlib.crc32(new, zlib.crc32(bytes(data[:24]))) & 0xFFFFFFFF
        struct.pack_into("<I", data, 24, crc)
    open(path, "wb").write(bytes(data))


def _entry(doc, name):
    return next(t for t in doc["tensors"] if t["name"] == name)


BAD_HEADERS = {
    "unknown type": (lambda d: _entry(d, "norm").update(type="q9"), "unknown type"),
    "nbytes mismatch": (lambda d: _entry(d, "norm").update(nbytes=_entry(d, "norm")["nbytes"] - 4), "takes"),
    "misaligned": (lambda d: _entry(d, "layers.0.wq").update(offset=_entry(d, "layers.0.wq")["offset"] + 4),
                   "multiple of 64"),
    "past the end": (lambda d: _entry(d, "norm").update(offset=1 << 40), "past the end"),
    "overlap": (lambda d: _entry(d, "layers.0.wk").update(offset=_entry(d, "layers.0.wq")["offset"]), "overlap"),
    "duplicate name": (lambda d: _entry(d, "layers.0.wk").update(name="layers.0.wq"), "duplicate"),
    "bad shape": (lambda d: _entry(d, "norm").update(shape=[-64]), "bad shape"),
    "block type on a vector": (lambda d: _entry(d, "norm").update(type="q8", nbytes=0), "matrix"),
    "missing tensor": (lambda d: _entry(d, "norm").update(name="norm_x"), "do not match config.json"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_corrupt_headers_are_refused(good, tmp_path, case):
    edit, msg = BAD_HEADERS[case]
    d, path = _copy(good, tmp_path)
    _rewrite_header(path, edit)
    with pytest.raises(ModelLoadError, match=msg):
        load_model(d)


def test_checksum_magic_version_truncation(good, tmp_path):
    d, path = _copy(good, tmp_path)
    _rewrite_header(path, lambda doc: _entry(doc, "norm").update(offset=0), fix_crc=False)
    with pytest.raises(ModelLoadError, match="checksum"):
        load_model(d)
    orig = open(os.path.join(good, WEIGHTS_FILE), "rb").read()
    for data, msg in [(b"NOTCORLM" + orig[8:], "bad magic"), (orig[:8] + struct.pack("<I", 9) + orig[12:], "version 9"),
                      (orig[:20], "shorter"), (orig[:len(orig) // 2], "past the end"),
                      (orig[:16] + struct.pack("<Q", 1 << 40) + orig[24:], "header length")]:
        open(path, "wb").write(data)
        with pytest.raises(ModelLoadError, match=msg):
            load_model(d)
    assert orig[:8] == MAGIC


def test_bad_config(good, tmp_path):
    d, _ = _copy(good, tmp_path)
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    for edit, msg in [(dict(format_version=2), "format version"), (dict(format="hf"), "not a corelm"),
                      (dict(spec={**cfg["spec"], "bogus": 1}), "unknown fields"),
                      (dict(spec={**cfg["spec"], "num_layers": 0}), "num_layers")]:
        json.dump({**cfg, **edit}, open(cfg_path, "w"))
        with pytest.raises(ModelLoadError, match=msg):
            load_model(d)


# ---------------------------------------------------------------------------------------------------
# LLM(path, weights=...) and the CLI

def test_llm_weights_converts_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("CORELM_CACHE", str(tmp_path / "cache"))
    llm = corelm.LLM(STORIES, threads=1, weights="q8")
    assert llm.dtype == "q8_0" and llm.loaded.source_format == "corelm"
    folder = llm.model_path
    assert folder.startswith(str(tmp_path / "cache"))
    stamp = os.stat(os.path.join(folder, WEIGHTS_FILE)).st_mtime_ns
    out1 = llm.generate("Once upon a time", corelm.SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    llm2 = corelm.LLM(STORIES, threads=1, weights="q8")
    assert llm2.model_path == folder and os.stat(os.path.join(folder, WEIGHTS_FILE)).st_mtime_ns == stamp
    out2 = llm2.generate("Once upon a time", corelm.SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    ref = corelm.LLM(STORIES, threads=1, dtype="q8")
    assert out1 == out2 == ref.generate("Once upon a time",
                                        corelm.SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    assert cached_conversion(STORIES, "q4_1", progress=False) != folder
    assert cached_conversion(STORIES, "q8_0", progress=False) == folder     # an alias: the same folder
    with pytest.raises(ValueError, match="weights must be"):
        corelm.LLM(STORIES, threads=1, weights="q3")
    with pytest.raises(ValueError, match="disagree"):   # would silently repack the q8 folder as bf16
        corelm.LLM(STORIES, threads=1, weights="q8", dtype="bf16")


def test_cli_convert(tmp_path, capsys):
    out = str(tmp_path / "m")
    assert cli_main(["convert", STORIES, "-o", out, "--weights", "q4_1", "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert load_model(out).description.startswith("corelm v1 q4_1")
    assert cli_main(["convert", STORIES, "-o", out, "--weights", "q4", "--no-progress"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["convert", STORIES, "-o", out, "--weights", "bf16", "--no-progress", "--force"]) == 0
    assert cli_main(["convert", str(tmp_path / "nope"), "-o", str(tmp_path / "x"), "--no-progress"]) == 1


@pytest.mark.skipif(not os.path.isfile(DEFAULT_GGUF), reason="embedded SmolLM2 GGUF missing")
def test_gguf_q8_0_copied_for_q8(tmp_path):
    """--weights q8 from a GGUF copies its Q8_0 tensors (here the embedding) and quantizes the rest."""
    out = convert(DEFAULT_GGUF, str(tmp_path / "smol-q8"), weights="q8")
    w = CorelmWeights(os.path.join(out, WEIGHTS_FILE))
    g = read_gguf(DEFAULT_GGUF)
    assert g.tensors["token_embd.weight"].type_name == "Q8_0"
    assert np.array_equal(w.raw("tok_embeddings"), g.raw("token_embd.weight"))
    assert all(t.type == ("q8" if len(t.shape) == 2 else "f32") for t in w.tensors.values())
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["source"]["format"] == "gguf" and cfg["tensor_types"] == {"q8": 211, "f32": 61}


@pytest.mark.skipif(not os.path.isfile(DEFAULT_GGUF), reason="embedded SmolLM2 GGUF missing")
def test_draft_conversion_stores_every_matrix_in_the_target_type(tmp_path, monkeypatch):
    """A draft (speculative_weights) reads the fewest bytes: the Q8_0 embedding, which is SmolLM2's lm_head,
    goes to 4 bits too, and a GGUF's blocks are kept only where no larger (Q4_1 under q4_1, not under q4_0)."""
    g = read_gguf(DEFAULT_GGUF)
    out = convert(DEFAULT_GGUF, str(tmp_path / "d41"), weights="q4_1", draft=True)
    w = CorelmWeights(os.path.join(out, WEIGHTS_FILE))
    assert all(t.type == ("q4m" if len(t.shape) == 2 else "f32") for t in w.tensors.values())
    assert np.array_equal(w.raw("layers.3.wv"), g.raw("blk.3.attn_v.weight"))     # copied, not requantized
    assert json.load(open(os.path.join(out, "config.json")))["draft"] is True
    w = CorelmWeights(os.path.join(convert(DEFAULT_GGUF, str(tmp_path / "d40"), weights="q4", draft=True), WEIGHTS_FILE))
    assert all(t.type == ("q4" if len(t.shape) == 2 else "f32") for t in w.tensors.values())
    monkeypatch.setenv("CORELM_CACHE", str(tmp_path / "cache"))
    plain, draft = cached_conversion(DEFAULT_GGUF, "q4", progress=False), cached_conversion(DEFAULT_GGUF, "q4", False, draft=True)
    assert plain != draft and draft == cached_conversion(DEFAULT_GGUF, "q4_0", False, draft=True)
    assert CorelmWeights(os.path.join(plain, WEIGHTS_FILE)).tensors["tok_embeddings"].type == "q8"
    with pytest.raises(ValueError, match="draft"):
        convert(STORIES, str(tmp_path / "x"), weights="q4", sparsity=0.5, draft=True)


# ---------------------------------------------------------------------------------------------------
# --force replaces only a corelm folder (or an empty one), and never leaves a half folder in place

def test_force_refuses_a_folder_that_is_not_a_corelm_folder(tmp_path, capsys):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("keep\n")
    assert cli_main(["convert", STORIES, "-o", str(d), "--weights", "q8", "--no-progress", "--force"]) == 1
    err = capsys.readouterr().err
    assert str(d) in err and "not a corelm model folder" in err
    assert (d / "notes.txt").read_text() == "keep\n" and (d / "sub").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["d"]          # no temporary folder left behind
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        convert(STORIES, str(f), weights="q8", overwrite=True)
    assert f.read_text() == "x"


def test_force_refuses_a_corelm_folder_holding_other_files(good, tmp_path):
    d, _ = _copy(good, tmp_path)
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("keep")
    with pytest.raises(FileExistsError, match="notes.txt"):
        convert(STORIES, d, weights="q8", overwrite=True)
    assert open(os.path.join(d, "notes.txt")).read() == "keep"


def test_force_replaces_a_corelm_folder_and_an_empty_folder(good, tmp_path):
    d, _ = _copy(good, tmp_path)
    assert json.load(open(os.path.join(d, "config.json")))["weights"] == "q8_0"
    convert(STORIES, d, weights="bf16", overwrite=True)
    assert json.load(open(os.path.join(d, "config.json")))["weights"] == "bf16"
    assert load_model(d).description.startswith("corelm v1 bf16")
    empty = tmp_path / "empty"
    empty.mkdir()
    convert(STORIES, str(empty), weights="q8", overwrite=True)
    assert load_model(str(empty)).source_format == "corelm"
    assert sorted(os.listdir(tmp_path)) == ["bad", "empty"]


def test_a_convert_that_fails_midway_leaves_the_old_folder_intact(good, tmp_path, monkeypatch):
    d, path = _copy(good, tmp_path)
    before = {f: open(os.path.join(d, f), "rb").read() for f in os.listdir(d)}
    import corelm.convert as conv
    real_add, calls = conv.WeightsWriter.add, []

    def failing_add(self, name, data):
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt("killed midway")
        real_add(self, name, data)
    monkeypatch.setattr(conv.WeightsWriter, "add", failing_add)
    with pytest.raises(KeyboardInterrupt):
        convert(STORIES, d, weights="bf16", overwrite=True)
    assert {f: open(os.path.join(d, f), "rb").read() for f in os.listdir(d)} == before
    assert sorted(os.listdir(tmp_path)) == ["bad"]        # no .corelm-convert-* or .corelm-old-* left
    assert load_model(d).description.startswith("corelm v1 q8_0")
