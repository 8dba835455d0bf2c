"""Sparse q8_0 / q4_0 models (sq8_0 / sq4_0, issue 22): `corelm convert --weights q8_0|q4_0 --sparsity` prunes,
quantizes as the dense format and stores the non-zero codes with a bitmap and the dense scales; the folder
computes what a dense folder holding the same blocks computes, bit for bit; the reader refuses a bitmap that
disagrees with the codes stored; `corelm info` shows the sparse matrices."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import MODELS, core_forward
from test_convert import _entry, _rewrite_header
from test_quant import ggml_quantize

import corelm
from corelm.convert import convert
from corelm.engine.model_builder import build_core_model
from corelm.entrypoints.cli import main as cli_main
from corelm.loader import ModelLoadError, load_model
from corelm.loader.corelm_format import (WEIGHTS_FILE, CorelmWeights, pack_sparse_blocks, stored_sparsity,
                                         unpack_sparse_blocks)

STORIES = os.path.join(MODELS, "stories260K")
IDS = [1, 403, 407, 261, 378, 429, 297, 261, 300, 400, 268, 500]
FILE_TYPE = {"q8_0": "sq8", "q4_0": "sq4"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"q8_0", "q4_0"}: stories260K pruned to 0.5 by magnitude, stored sparse; "<w>-dense": the same blocks
    dense (the sparse folder converted back: its blocks re-quantized from their own values are the same)."""
    d = tmp_path_factory.mktemp("sparse_quant")
    out = {}
    for w in FILE_TYPE:
        out[w] = convert(STORIES, str(d / w), weights=w, sparsity=0.5, prune="magnitude", keep_dense="layers.1.wk")
        out[w + "-dense"] = convert(out[w], str(d / (w + "-dense")), weights=w)
    return out


@pytest.mark.parametrize("weights", list(FILE_TYPE))
def test_sparse_blocks_round_trip(weights):
    """Dense blocks -> the file's bytes (bitmap, scales, codes; an odd count of 4-bit codes padded) -> the
    same blocks, with a zero weight's code (q8_0: 0, q4_0: 8) the only one dropped."""
    rng = np.random.default_rng(0)
    for rows, cols, s in [(1, 32, 0.0), (3, 64, 0.5), (5, 96, 0.9), (2, 32, 1.0), (7, 160, 0.31)]:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        w[rng.random(w.shape) < s] = 0
        blocks = ggml_quantize(w, weights.upper())
        raw = pack_sparse_blocks(blocks, FILE_TYPE[weights])
        assert np.array_equal(unpack_sparse_blocks(raw, (rows, cols), FILE_TYPE[weights]), blocks)
        zeros = (w == 0).mean()
        assert stored_sparsity((rows, cols), raw.size, FILE_TYPE[weights]) >= zeros - (1 / (rows * cols))


@pytest.mark.parametrize("weights", list(FILE_TYPE))
def test_sparse_folder_computes_what_the_same_dense_blocks_do(folders, weights):
    """A prompt's logits (its 12 rows: the few-row kernels) and greedy tokens, on this machine's table."""
    stored = CorelmWeights(os.path.join(folders[weights], WEIGHTS_FILE)).tensors
    assert stored["layers.0.wq"].type == FILE_TYPE[weights] and stored["layers.1.wk"].type != FILE_TYPE[weights]
    assert json.load(open(os.path.join(folders[weights], "config.json")))["sparsity"]["matrices"]["layers.0.wq"] >= 0.5
    a, b = (load_model(folders[k]) for k in (weights, weights + "-dense"))
    for name in ("layers.0.wq", "layers.2.w_up"):
        assert np.array_equal(a.get_weight(name), b.get_weight(name))
    la, lb = (core_forward(build_core_model(m, threads=1), np.int32(IDS), 0, True) for m in (a, b))
    assert np.array_equal(la, lb)
    sp = corelm.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm = corelm.LLM(folders[weights], threads=1)
    assert "s" + weights in llm.dtype.split("+")
    got = llm.generate([IDS], sp)[0].outputs[0].token_ids
    assert got == corelm.LLM(folders[weights + "-dense"], threads=1).generate([IDS], sp)[0].outputs[0].token_ids


def test_cli_convert_and_info(tmp_path, capsys):
    out = str(tmp_path / "m")
    assert cli_main(["convert", STORIES, "-o", out, "--weights", "q8", "--sparsity", "0.75", "--prune", "magnitude",
                     "--no-progress"]) == 0
    assert "30 matrices sparse (sq8_0): 75." in capsys.readouterr().out
    assert cli_main(["info", out, "-v"]) == 0
    shown = capsys.readouterr().out
    assert "Sparse:    30 matrices sparse (sq8_0): 75." in shown and ", dense q8_0 " in shown
    assert "layers.1.wq      64x64 sq8_0: 75." in shown


def _corrupt_first_word(folder, tmp_path, name, change):
    d = str(tmp_path / "bad")
    shutil.copytree(folder, d)
    t = CorelmWeights(os.path.join(d, WEIGHTS_FILE)).tensors[name]
    data = bytearray(open(os.path.join(d, WEIGHTS_FILE), "rb").read())
    word = int(np.frombuffer(data, "<u4", 1, t.offset)[0])
    data[t.offset:t.offset + 4] = np.uint32(change(word)).tobytes()
    open(os.path.join(d, WEIGHTS_FILE), "wb").write(bytes(data))
    return d


@pytest.mark.parametrize("weights", list(FILE_TYPE))
def test_a_bitmap_that_disagrees_is_refused(folders, tmp_path, weights):
    """One non-zero code more in the bitmap than the codes stored (sq4: two, a whole byte of codes)."""
    name = "layers.2.wq"
    n = CorelmWeights(os.path.join(folders[weights], WEIGHTS_FILE)).tensors[name]
    more = 1 if weights == "q8_0" else 2

    def add(w):
        for _ in range(more):
            w |= ~w & (w + 1)         # the lowest clear bit set
        return w
    d = _corrupt_first_word(folders[weights], tmp_path, name, add)
    m = load_model(d)
    for read in (m.get_weight, m.get_raw_weight):
        with pytest.raises(ModelLoadError, match="bitmap marks .* non-zero codes, the tensor holds") as e:
            read(name)
        assert name in str(e.value) and d in str(e.value) and FILE_TYPE[weights] in str(e.value)
    with pytest.raises(ModelLoadError, match="non-zero codes"):
        corelm.LLM(d, threads=1)
    assert n.nbytes > 0


def test_a_sparse_size_short_of_its_scales_is_refused(folders, tmp_path):
    """layers.0.wq [64, 64] sq8: a 512-byte bitmap and 256 bytes of scales before any code."""
    d = str(tmp_path / "bad")
    shutil.copytree(folders["q8_0"], d)

    def edit(doc):
        _entry(doc, "layers.0.wq")["nbytes"] = 700
    _rewrite_header(os.path.join(d, WEIGHTS_FILE), edit)
    with pytest.raises(ModelLoadError, match=r"'layers.0.wq' claims 700 bytes.*from 768 \(its bitmap and scales\)"):
        load_model(d)


def test_wanda_and_auto(folders, tmp_path):
    """wanda (the default) prunes every sparse row to at least the target (q4_0: small weights round to the
    zero code too); auto stores sparse exactly the matrices whose zero codes save bytes, block for block."""
    out = convert(STORIES, str(tmp_path / "wanda"), weights="q4_0", sparsity=0.5)
    m, stored = load_model(out), CorelmWeights(os.path.join(out, WEIGHTS_FILE)).tensors
    assert json.load(open(os.path.join(out, "config.json")))["sparsity"]["method"] == "wanda"
    w = m.get_weight("layers.3.w_up")
    assert stored["layers.3.w_up"].type == "sq4" and ((w == 0).sum(1) >= w.shape[1] // 2).all()
    auto = convert(folders["q8_0"], str(tmp_path / "auto"), weights="q8_0", sparsity="auto")
    got = CorelmWeights(os.path.join(auto, WEIGHTS_FILE)).tensors
    assert got["layers.0.wq"].type == "sq8" and got["layers.1.wk"].type == "q8"   # kept dense in the source
    a, b = load_model(auto), load_model(folders["q8_0"])
    assert np.array_equal(a.get_weight("layers.0.wq"), b.get_weight("layers.0.wq"))
    dense = convert(STORIES, str(tmp_path / "none"), weights="q8_0", sparsity="auto")
    assert all(t.type != "sq8" for t in CorelmWeights(os.path.join(dense, WEIGHTS_FILE)).tensors.values())
