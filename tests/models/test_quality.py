"""A fast CI check of tools/bench/eval_quality.py on stories260K (the full table for the real models is in
docs/quality.md): converted q8 stays close to fp32, bf16 closer still, q4 is worse but bounded."""
import importlib.util
import os

import pytest

from conftest import MODELS, ROOT

from corelm.convert import convert

STORIES = os.path.join(MODELS, "stories260K")
TEXT = os.path.join(ROOT, "tests", "data", "text", "alice-ch1-2.txt")


def eval_tool():
    spec = importlib.util.spec_from_file_location("eval_quality", os.path.join(ROOT, "tools", "bench", "eval_quality.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tool = eval_tool()
    tmp = tmp_path_factory.mktemp("quality")
    loaded, ref = tool.build(STORIES, "fp32", 1, 128)
    ids = loaded.tokenizer.encode(open(TEXT, encoding="utf-8").read())[:2048]
    variants = {w: tool.build(convert(STORIES, str(tmp / w), weights=w), "auto", 1, 128)[1]
                for w in ("bf16", "q8", "q4")}
    return tool.evaluate(ref, variants, ids, 128)


def test_text_is_a_few_thousand_tokens():
    from corelm.loader import load_model
    n = len(load_model(STORIES).tokenizer.encode(open(TEXT, encoding="utf-8").read()))
    assert 5000 < n < 20000


def test_reference_is_consistent(results):
    r = results["fp32"]
    assert r["mean_kld"] == 0 and r["same_top1_pct"] == 100 and r["tokens"] == 2048 - 16
    assert 5 < r["ppl"] < 200            # a 260K-parameter model reading Alice: poor, but far from uniform (512)


def test_q8_close_to_fp32(results):
    r = results["q8"]
    assert abs(r["ppl_delta_pct"]) < 1.0
    assert r["mean_kld"] < 0.003
    assert r["same_top1_pct"] > 95


def test_bf16_closer_than_q8(results):
    assert results["bf16"]["mean_kld"] < min(5e-4, results["q8"]["mean_kld"])
    assert abs(results["bf16"]["ppl_delta_pct"]) < 0.2


def test_q4_bounded(results):
    r = results["q4"]
    assert results["q8"]["mean_kld"] < r["mean_kld"] < 0.5
    assert 0 < r["ppl_delta_pct"] < 30
