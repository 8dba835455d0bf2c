"""The core's one traits row per weight type (cpp/formats/traits.h, `_core.weight_formats()`): its GGUF
names, ids, blocks and bytes are gguf-py's, its fp16 fields are the ones a block's values are scaled by,
and the Python tables (corelm.options, the GGUF parser) read it rather than keep their own."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants  # noqa: E402

from corelm import _core  # noqa: E402
from corelm.loader.gguf import ggml_type_ids, ggml_types  # noqa: E402
from corelm.options import WEIGHT_FORMATS, core_formats  # noqa: E402

ROWS = _core.weight_formats()
KINDS = ("float_rows", "quant", "ggml_block", "sparse", "sparse_quant")


def test_rows_are_the_core_names_in_enum_order():
    assert [r["name"] for r in ROWS] == _core.option_names()["weight_type"]
    assert [r["raw"] for r in ROWS if r["raw"]] == _core.option_names()["raw_weight"]
    for r in ROWS:
        assert sum(r[k] for k in KINDS) == 1, r["name"]       # one kind of storage each
        assert not r["grouped"] or r["ggml_block"]
        dense = core_formats()[r["dense"]]
        assert (r["dense"] != r["name"]) == (r["sparse"] or r["sparse_quant"])
        assert (dense["block"], dense["block_bytes"]) == (r["block"], r["block_bytes"])


@pytest.mark.parametrize("row", [r for r in ROWS if r["ggml"]], ids=lambda r: r["ggml"])
def test_gguf_rows_match_gguf_py(row):
    t = GGMLQuantizationType[row["ggml"]]
    assert row["ggml_id"] == int(t)
    assert (row["block"], row["block_bytes"]) == GGML_QUANT_SIZES[t]


@pytest.mark.parametrize("row", [r for r in ROWS if r["ggml"] and r["f16_fields"]], ids=lambda r: r["ggml"])
def test_f16_fields_scale_every_value(row):
    # an fp16 NaN in a block's scale d (or minimum) makes every value NaN; at any other even offset of an
    # all-zero block, whose values are then 0 (or its table's), it does not reach every value
    t = GGMLQuantizationType[row["ggml"]]
    nan = np.array([np.nan], np.float16).view(np.uint8)
    for at in range(0, row["block_bytes"] - 1, 2):
        blk = np.zeros(row["block_bytes"], np.uint8)
        blk[at:at + 2] = nan
        every_nan = bool(np.isnan(quants.dequantize(blk, t)).all())
        assert every_nan == (at in row["f16_fields"]), (row["ggml"], at)


def test_gguf_parser_sizes_match_gguf_py():
    # the parser's table: the core's rows for its types, its own list for the rest (F16, the IQ*, ...)
    types = ggml_types()
    assert {i: (n, b, bb) for i, (n, b, bb) in types.items() if n in {r["ggml"] for r in ROWS}} == \
        {r["ggml_id"]: (r["ggml"], r["block"], r["block_bytes"]) for r in ROWS if r["ggml"]}
    for i, (name, block, block_bytes) in types.items():
        t = GGMLQuantizationType(i)
        # gguf-py sizes Q8_1 as 4 + 4 + 32 bytes (fp32 d and s, as ggml once had); ggml's block_q8_1 is two
        # fp16 and 32 int8 (36). It is an activation type no model file holds.
        want = (32, 36) if name == "Q8_1" else GGML_QUANT_SIZES[t]
        assert t.name == name and want == (block, block_bytes), name
    assert ggml_type_ids() == {name: i for i, (name, _, _) in types.items()}


def test_options_formats_agree_with_the_rows():
    assert sorted(f.core for f in WEIGHT_FORMATS.values()) == sorted(r["name"] for r in ROWS)
    for f in WEIGHT_FORMATS.values():
        r = core_formats()[f.core]
        assert (f.block, f.block_bytes) == (r["block"], r["block_bytes"])
        assert f.raw == r["raw"]
        assert f.gguf == (r["ggml"] if r["quant"] or r["ggml_block"] else None)
        assert f.sparse == (r["sparse"] or r["sparse_quant"])
        assert f.from_floats == (not r["ggml_block"])
