"""Sparse bf16 models (sbf16, issue 22): `corelm convert --weights bf16 --sparsity` prunes (wanda or
magnitude) and stores the matrices as a bitmap and their non-zeros; the folder computes what a dense bf16
folder holding the same zeros computes, `--sparsity auto` stores the zeros a source already has, the
reader refuses a bitmap that disagrees with its values, and `corelm info` shows the stored sparsity."""
import fnmatch
import json
import os
import shutil

import numpy as np
import pytest

from conftest import MODELS, run_with_isa
from test_convert import _entry, _rewrite_header

import corelm
from corelm import _core
from corelm.calibrate import activation_importance, calibration_ids
from corelm.convert import convert, prune_rows, to_bf16
from corelm.entrypoints.cli import main as cli_main
from corelm.loader import ModelLoadError, load_model
from corelm.loader.corelm_format import WEIGHTS_FILE, CorelmWeights, pack_sbf16, unpack_sbf16

STORIES = os.path.join(MODELS, "stories260K")
IDS = [1, 403, 407, 261, 378, 429, 297, 261, 300, 400, 268, 500]
DENSE = ("tok_embeddings", "lm_head")
# magnitude keeps a whole layer and one of the fused q/k/v partners dense: mixed partners must work too
KEEP = "layers.0.*,layers.1.wk"


def matrices(folder):
    """name -> (file type, dense float32 weights) of every matrix in a corelm folder."""
    m, w = load_model(folder), CorelmWeights(os.path.join(folder, WEIGHTS_FILE))
    return {n: (t.type, m.get_weight(n)) for n, t in w.tensors.items() if len(t.shape) == 2}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"wanda", "magnitude"}: stories260K pruned to 0.5; "<method>-dense": the same weights as dense bf16
    (the sparse folder converted back, so it holds exactly the sparse folder's zeros)."""
    d = tmp_path_factory.mktemp("sparse")
    out = {"wanda": convert(STORIES, str(d / "wanda"), weights="bf16", sparsity=0.5),
           "magnitude": convert(STORIES, str(d / "magnitude"), weights="bf16", sparsity=0.5, prune="magnitude",
                                keep_dense=KEEP)}
    for k in list(out):
        out[k + "-dense"] = convert(out[k], str(d / (k + "-dense")), weights="bf16")
    return out


# ---------------------------------------------------------------------------------------------------
# the pruner and the file layout

def test_prune_rows_zeroes_the_lowest_scores_per_row():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 100)).astype(np.float32)
    w[0, :10] = 1e-6                     # ties among the smallest: the lower columns go first
    imp = rng.random(100).astype(np.float32)
    for sparsity, k in [(0.5, 50), (0.29, 29), (0.0, 0), (0.999, 99)]:
        for importance in (None, imp):
            p = prune_rows(w, sparsity, importance)
            assert ((p == 0).sum(1) == k).all()
            score = np.abs(w) * (1 if importance is None else np.sqrt(importance))
            kept, gone = np.where(p != 0, score, np.inf), np.where(p == 0, score, -np.inf)
            assert (kept.min(1) >= gone.max(1)).all()
            assert np.array_equal(p[p != 0], w[p != 0])
    p = prune_rows(w, 0.05, None)        # 5 of the ten tied smallest: the first five
    assert (p[0, :5] == 0).all() and (p[0, 5:10] == np.float32(1e-6)).all()
    assert np.array_equal(prune_rows(w, 0.3, imp), prune_rows(w, 0.3, imp))


def test_sbf16_bytes_are_bitmap_words_then_values():
    rng = np.random.default_rng(1)
    for rows, cols in [(1, 1), (3, 31), (4, 32), (5, 70), (2, 172)]:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        w[rng.random(w.shape) < 0.5] = 0
        w[0, 0] = -0.0                   # a negative zero is a zero
        bits = to_bf16(w)
        raw = pack_sbf16(bits)
        words, nnz = -(-cols // 32), int(np.count_nonzero(w))
        assert raw.size == 4 * rows * words + 2 * nnz
        bitmap = raw[:4 * rows * words].view("<u4").reshape(rows, words)
        for r in range(rows):
            for c in range(cols):
                assert bool(bitmap[r, c // 32] >> (c % 32) & 1) == (w[r, c] != 0)
        assert np.array_equal(raw[4 * rows * words:].view("<u2"), bits[w != 0])
        assert np.array_equal(unpack_sbf16(raw, (rows, cols)), np.where(w != 0, bits, 0))


# ---------------------------------------------------------------------------------------------------
# converted folders

@pytest.mark.parametrize("method", ["wanda", "magnitude"])
def test_every_row_is_pruned_to_the_target(folders, method):
    src = load_model(STORIES)
    importance = activation_importance(src, calibration_ids(src)) if method == "wanda" else {}
    stored = matrices(folders[method])
    config = json.load(open(os.path.join(folders[method], "config.json")))
    keep = KEEP.split(",") if method == "magnitude" else []
    dense = {n for n in stored if n in DENSE or any(fnmatch.fnmatchcase(n, k) for k in keep)}
    assert config["sparsity"] == {"method": method, "target": 0.5, "keep_dense": keep,
                                  "matrices": {n: 0.5 for n in stored if n not in dense}}
    for name, (type_, w) in stored.items():
        orig = src.get_weight(name)
        if name in dense:
            assert type_ == "bf16" and np.count_nonzero(w) == w.size
            continue
        assert type_ == "sbf16" and ((w == 0).sum(1) == w.shape[1] // 2).all(), name
        score = np.abs(orig) * (np.sqrt(importance[name]) if method == "wanda" else 1)
        kept, gone = np.where(w != 0, score, np.inf), np.where(w == 0, score, -np.inf)
        assert (kept.min(1) >= gone.max(1)).all(), name      # the lowest scores went
        assert np.array_equal(to_bf16(w), np.where(w != 0, to_bf16(orig), 0))
    assert load_model(folders[method]).description.endswith(f"pruned to 0.5 by {method}")
    if method == "wanda":        # the activations change the choice
        mag = matrices(folders["magnitude"])
        assert not np.array_equal(stored["layers.2.w_up"][1] == 0, mag["layers.2.w_up"][1] == 0)


# The tables whose sparse kernels give the dense bf16 kernels' bits for every batch size. The
# AVX512_BF16 table multiplies a small batch of sparse rows by bf16-rounded activations straight from
# the sparse records, in another order than its dense kernels: close there (decode itself is bitwise).
BITWISE = ("scalar", "avx512")
COMPARE = """
import json, sys, numpy as np, corelm
sys.path.insert(0, "tools/bench")
from core_forward import core_forward
from corelm.engine.model_builder import build_core_model
from corelm.loader import load_model
ids = json.loads(sys.argv[3])
def run(path):
    llm = corelm.LLM(path, dtype="bf16", threads=1)
    out = llm.generate([ids], corelm.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    return core_forward(build_core_model(load_model(path), dtype="bf16", threads=1), ids, 0, True), \\
        out[0].outputs[0].token_ids, llm.dtype
(a, ta, da), (b, tb, db) = run(sys.argv[1]), run(sys.argv[2])
print(json.dumps({"table": corelm._core.cpu_info()["kernels"]["matmul_bf16"], "stored": [da, db],
                  "bitwise": bool(np.array_equal(a, b)), "error": float(np.abs(a - b).max() / np.abs(b).max()),
                  "same_tokens": ta == tb}))
"""


@pytest.mark.parametrize("method", ["wanda", "magnitude"])
@pytest.mark.parametrize("isa", _core.kernel_tables())
def test_sparse_folder_computes_what_the_same_dense_weights_do(folders, method, isa):
    """Logits of a prompt and greedy tokens: the sparse folder against a dense bf16 folder holding its zeros,
    on every kernel table (each in a process of its own: the table is chosen at import)."""
    r = run_with_isa(isa, COMPARE, folders[method], folders[method + "-dense"], json.dumps(IDS), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["table"] == isa and got["stored"] == ["sbf16+bf16", "bf16"]
    if isa in BITWISE:
        assert got["bitwise"] and got["same_tokens"], got
    else:
        assert got["error"] < 2e-2, got


def test_fp32_expands_a_sparse_folder_exactly(folders):
    """dtype="fp32" expands sbf16 to floats: the same logits as the dense folder, bit for bit, on any table."""
    from conftest import core_forward
    from corelm.engine.model_builder import build_core_model

    def logits(path):
        return core_forward(build_core_model(load_model(path), dtype="fp32", threads=1), np.int32(IDS), 0, True)
    assert np.array_equal(logits(folders["wanda"]), logits(folders["wanda-dense"]))


def test_llm_loads_and_generates(folders):
    llm = corelm.LLM(folders["magnitude"], threads=1)
    assert "sbf16" in llm.dtype.split("+")
    out = llm.generate("Once upon a time", corelm.SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    assert len(out.token_ids) > 0
    # dtype="sbf16" stores an already pruned model sparse at load, every matrix
    pruned = corelm.LLM(folders["magnitude-dense"], threads=1, dtype="sparse_bf16")
    assert pruned.dtype == "sbf16"
    a = pruned.generate("Once upon a time", corelm.SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    assert len(a.token_ids) > 0
    assert corelm.LLM(folders["magnitude"], threads=1, dtype="q8_0").dtype.split("+")[0] == "sbf16"  # kept sparse


def test_auto_stores_the_zeros_a_source_has(folders, tmp_path):
    """magnitude-dense holds 50% zeros except layers.0 and layers.1.wk: auto stores those dense, the rest
    sparse, each exactly as the source holds it."""
    out = convert(folders["magnitude-dense"], str(tmp_path / "auto"), weights="bf16", sparsity="auto")
    src, got = matrices(folders["magnitude-dense"]), matrices(out)
    config = json.load(open(os.path.join(out, "config.json")))["sparsity"]
    assert config["method"] == "auto" and config["target"] is None
    for name, (type_, w) in got.items():
        dense = name in DENSE or name.startswith("layers.0.") or name == "layers.1.wk"
        assert type_ == ("bf16" if dense else "sbf16"), name
        assert np.array_equal(w, src[name][1])
        assert (name in config["matrices"]) == (not dense)
    # keep_dense applies to auto too
    out = convert(folders["magnitude-dense"], str(tmp_path / "auto2"), weights="bf16", sparsity="auto",
                  keep_dense=["layers.2.*"])
    assert all(t == "bf16" for n, (t, _) in matrices(out).items() if n.startswith("layers.2."))


def test_bad_options_are_refused(tmp_path):
    out = str(tmp_path / "x")
    for kwargs, msg in [(dict(weights="q4_1", sparsity=0.5), "sparse storage exists for bf16, q8_0, q4_0"),
                        (dict(weights="bf16", sparsity=1.0), "fraction in"),
                        (dict(weights="bf16", sparsity=-0.1), "fraction in"),
                        (dict(weights="bf16", sparsity="half"), "fraction in"),
                        (dict(weights="bf16", prune="magnitude"), "give a sparsity"),
                        (dict(weights="bf16", sparsity="auto", prune="wanda"), "prunes nothing"),
                        (dict(weights="bf16", sparsity=0.5, prune="random"), "prune must be"),
                        (dict(weights="bf16", sparsity=0.5, keep_dense="layer.0.*"), "matches no weight")]:
        with pytest.raises(ValueError, match=msg):
            convert(STORIES, out, **kwargs)
    assert not os.path.exists(out)
    with pytest.raises(ValueError, match="weights must be"):      # sparse storage is --sparsity, not a kind
        convert(STORIES, out, weights="sbf16")


# ---------------------------------------------------------------------------------------------------
# the command line

def test_cli_convert_and_info(tmp_path, capsys):
    out = str(tmp_path / "m")
    assert cli_main(["convert", STORIES, "-o", out, "--weights", "bf16", "--sparsity", "0.75", "--prune",
                     "magnitude", "--keep-dense", "layers.4.*", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "28 matrices sparse (sbf16): 75.0% zeros on average (75.0-75.0% per matrix)" in printed
    assert matrices(out)["layers.4.wq"][0] == "bf16"
    assert cli_main(["convert", STORIES, "-o", str(tmp_path / "q"), "--weights", "q4_1", "--sparsity", "0.5",
                     "--no-progress"]) == 1
    assert "sparse storage exists for bf16, q8_0, q4_0" in capsys.readouterr().err

    assert cli_main(["info", out]) == 0
    shown = capsys.readouterr().out
    assert "Sparse:    28 matrices sparse (sbf16): 75.0% zeros" in shown and "read per token" in shown
    assert "layers.1.wq" not in shown
    assert cli_main(["info", out, "-v"]) == 0
    assert "layers.1.wq      64x64 sbf16: 75.0% zeros" in capsys.readouterr().out
    assert cli_main(["info", out, "--json"]) == 0
    storage = json.loads(capsys.readouterr().out)["model"]["storage"]
    w = CorelmWeights(os.path.join(out, WEIGHTS_FILE))
    assert storage["bytes_per_token"] == sum(t.nbytes for n, t in w.tensors.items() if n != "tok_embeddings")
    assert storage["sparse"]["layers.1.w_down"] == {"shape": [64, 172], "type": "sbf16",
                                                    "bytes": 4 * 64 * 6 + 2 * 64 * 43, "dense_bytes": 2 * 64 * 172,
                                                    "sparsity": 0.75}


# ---------------------------------------------------------------------------------------------------
# corrupt sparse tensors

def _corrupt(folder, tmp_path, name, edit):
    """A copy of `folder` with edit(bitmap words [rows, words] of tensor `name`) applied in place."""
    d = str(tmp_path / "bad")
    shutil.copytree(folder, d)
    t = CorelmWeights(os.path.join(d, WEIGHTS_FILE)).tensors[name]
    data = bytearray(open(os.path.join(d, WEIGHTS_FILE), "rb").read())
    rows, words = t.shape[0], -(-t.shape[1] // 32)
    bitmap = np.frombuffer(data, "<u4", rows * words, t.offset).reshape(rows, words).copy()
    edit(bitmap)
    data[t.offset:t.offset + bitmap.nbytes] = bitmap.tobytes()
    open(os.path.join(d, WEIGHTS_FILE), "wb").write(bytes(data))
    return d


@pytest.mark.parametrize("case", ["popcount", "past the row"])
def test_a_bitmap_that_disagrees_is_refused(folders, tmp_path, case):
    if case == "popcount":        # one non-zero fewer than the values stored
        name, msg = "layers.2.wq", "bitmap marks 2047 non-zeros, the tensor holds 2048 values"
        d = _corrupt(folders["wanda"], tmp_path, name, lambda b: b.__setitem__((0, 0), b[0, 0] & (b[0, 0] - 1)))
    else:                         # w_down has 172 columns: bit 12 of each row's sixth word is column 172
        name, msg = "layers.3.w_down", "bitmap row 5 has bits set past its 172 columns"
        d = _corrupt(folders["wanda"], tmp_path, name, lambda b: b.__setitem__((5, 5), b[5, 5] | (1 << 12)))
    m = load_model(d)             # the header is fine; the tensor's bytes are checked when read
    for read in (m.get_weight, m.get_raw_weight):
        with pytest.raises(ModelLoadError, match=msg) as e:
            read(name)
        assert name in str(e.value) and d in str(e.value)
    with pytest.raises(ModelLoadError, match=msg):
        corelm.LLM(d, threads=1)


@pytest.mark.parametrize("nbytes,msg", [(lambda n: n - 1, "even count"), (lambda n: 100, r"from 1536 \(its bitmap\)"),
                                        (lambda n: 1536 + 2 * 64 * 172 + 2, "to 23552")])
def test_a_sparse_size_outside_its_bounds_is_refused(folders, tmp_path, nbytes, msg):
    """layers.0.w_down [64, 172]: a 1536-byte bitmap, at most 2 bytes per element after it."""
    d = str(tmp_path / "bad")
    shutil.copytree(folders["wanda"], d)

    def edit(doc):
        t = _entry(doc, "layers.0.w_down")
        t["nbytes"] = nbytes(t["nbytes"])
    _rewrite_header(os.path.join(d, WEIGHTS_FILE), edit)
    with pytest.raises(ModelLoadError, match=f"'layers.0.w_down' claims .*{msg}"):
        load_model(d)


def test_a_non_finite_sparse_value_is_warned(folders, tmp_path, caplog):
    d = str(tmp_path / "nan")
    shutil.copytree(folders["wanda"], d)
    path = os.path.join(d, WEIGHTS_FILE)
    t = CorelmWeights(path).tensors["layers.2.wq"]
    data = bytearray(open(path, "rb").read())
    first_value = t.offset + 4 * 64 * 2          # past the [64 rows][2 words] bitmap
    data[first_value:first_value + 2] = np.uint16(0x7FC0).tobytes()     # a bf16 NaN
    open(path, "wb").write(bytes(data))
    with caplog.at_level("WARNING", logger="corelm.loader"):
        load_model(d).get_raw_weight("layers.2.wq")
    assert "layers.2.wq has 1 non-finite value (NaN or Inf)" in caplog.text
