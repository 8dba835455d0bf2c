"""corelm.options is the one place option names are spelled: canonical names and aliases resolve the
same way everywhere, and the C++ core's own name tables agree with it."""
import os

import pytest

from conftest import MODELS

import corelm
from corelm import _core
from corelm.convert import convert
from corelm.loader.corelm_format import TYPES
from corelm.loader.gguf import RAW_GGML_TYPES
from corelm.options import (CHOICES, CONVERT_TARGETS, GGUF_BLOCK_FORMATS, K_QUANT_TARGETS, KEEP_AS_STORED, PACKABLE,
                            QUANTIZED, SPARSE, WEIGHT_FORMATS, argparse_choices, choose, format_of_core, format_of_gguf,
                            format_of_raw, weight_format)

STORIES = os.path.join(MODELS, "stories260K")


def test_core_name_tables_agree():
    names = _core.option_names()
    assert sorted(names["weight_type"]) == sorted(f.core for f in WEIGHT_FORMATS.values())
    assert sorted(names["raw_weight"]) == sorted(f.raw for f in WEIGHT_FORMATS.values() if f.raw)
    assert sorted(names["kv_type"]) == sorted(v for v in CHOICES["kv_cache_dtype"].values if v != "auto")
    assert sorted(names["activations"]) == sorted(v for v in CHOICES["activations"].values if v != "auto")
    assert sorted(names["schedule"]) == sorted(CHOICES["schedule"].values)
    assert set(CHOICES["numa"].values) <= set(names["numa"])


def test_every_format_is_described_once():
    assert set(QUANTIZED) == {f.name for f in WEIGHT_FORMATS.values() if f.gguf and f.from_floats}
    assert set(GGUF_BLOCK_FORMATS) == {f.name for f in WEIGHT_FORMATS.values() if not f.from_floats}
    assert set(CHOICES["dtype"].values) == {"auto"} | set(PACKABLE) and "q4_k" not in CHOICES["dtype"].values
    # sparse storage is convert's --sparsity over bf16, q8_0 or q4_0, not a --weights kind; dtype="sbf16"
    # (sq8_0, sq4_0) packs sparse at load
    assert SPARSE == ("sbf16", "sq8_0", "sq4_0") and set(CHOICES["weights"].values) == set(CONVERT_TARGETS) == \
        set(PACKABLE) - set(SPARSE) | set(K_QUANT_TARGETS)
    assert sorted(RAW_GGML_TYPES) == sorted(f.gguf for f in WEIGHT_FORMATS.values() if f.gguf)
    assert TYPES == {f.file_type: f for f in WEIGHT_FORMATS.values()}
    assert {f.name: f.bits for f in WEIGHT_FORMATS.values()} == {
        "fp32": 32, "bf16": 16, "sbf16": None, "sq8_0": None, "sq4_0": None, "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0,
        "q2_k": 2.625, "q3_k": 3.4375, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625, "iq4_nl": 4.5, "iq4_xs": 4.25}
    for f in WEIGHT_FORMATS.values():
        assert format_of_core(f.core) is f and weight_format(f.name) is f
        assert all(weight_format(a) is f for a in f.aliases)
        if f.gguf:
            assert format_of_gguf(f.gguf) is f and f.raw == f.gguf
        if f.raw:
            assert format_of_raw(f.raw) is f
    assert format_of_raw("SBF16").name == "sbf16" and format_of_gguf("SBF16") is None
    # what loading keeps as stored: every dtype keeps sparse matrices sparse but fp32, which expands them
    assert set(KEEP_AS_STORED) == set(CHOICES["dtype"].values) - {"fp32"}
    assert all("sbf16" in keep for keep in KEEP_AS_STORED.values())
    assert set(KEEP_AS_STORED["bf16"]) == set(KEEP_AS_STORED["sbf16"]) == set(SPARSE)


def test_aliases_and_errors():
    assert choose("dtype", "Q8") == "q8_0" and choose("dtype", "q4") == "q4_0" and choose("dtype", "f32") == "fp32"
    assert choose("kv_cache_dtype", "i8") == "int8" and choose("weights", "q4m") == "q4_1"
    assert choose("dtype", "sparse_bf16") == "sbf16" and choose("prune", "Magnitude") == "magnitude"
    for option, bad in [("dtype", "fp8"), ("weights", "q3"), ("weights", "sbf16"), ("kv_cache_dtype", "int4"),
                        ("activations", 8), ("prune", "random"),
                        ("schedule", "round-robin"), ("numa", "interleave")]:
        with pytest.raises(ValueError, match=f"{option} must be one of"):
            choose(option, bad)
    assert set(argparse_choices("dtype")) == set(CHOICES["dtype"].values) | set(CHOICES["dtype"].aliases)


def test_one_name_means_one_format_at_load_and_in_convert(tmp_path):
    """dtype="q4_0" at load and convert --weights q4_0 store the same blocks (the converted folder keeps
    the embedding at 8 bits, as every 4-bit convert does)."""
    for name in ("q8_0", "q4_0", "q4_1"):
        llm = corelm.LLM(STORIES, threads=1, dtype=name)
        assert llm.dtype.split("+")[0] == name
        folder = convert(STORIES, str(tmp_path / name), weights=name)
        stored = corelm.LLM(folder, threads=1).dtype.split("+")
        assert name in stored and set(stored) <= {name, "q8_0", "fp32"}
    assert corelm.LLM(STORIES, threads=1, dtype="q8").dtype == corelm.LLM(STORIES, threads=1, dtype="q8_0").dtype
