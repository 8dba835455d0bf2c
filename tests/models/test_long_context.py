"""Long positions: logits of the tiny Qwen2 with YaRN RoPE scaling at positions far past the scaling's
original context equal transformers' (tools/fixtures/make_long_context_fixtures.py), prompt read whole and
in chunks through the KV cache; the context is the model's trained one, with a clear error past it."""
import json
import os
import shutil

import numpy as np
import pytest

import corelm
from conftest import FIXTURES, MODELS

CASES = json.load(open(os.path.join(FIXTURES, "long_context.json")))["cases"]


def scaled_model(tmp_path, scaling):
    folder = tmp_path / "model"
    shutil.copytree(os.path.join(MODELS, "tiny-qwen2"), folder)
    config = json.load(open(folder / "config.json"))
    config["rope_scaling"] = scaling
    config["rope_parameters"] = {"rope_theta": config["rope_theta"], **scaling}
    json.dump(config, open(folder / "config.json", "w"))
    return str(folder)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
@pytest.mark.parametrize("chunk", [None, 96])
def test_yarn_logits_at_long_positions_match_transformers(tmp_path, case, chunk):
    llm = corelm.LLM(scaled_model(tmp_path, case["rope_scaling"]), dtype="fp32", threads=2, max_seq_len=1024,
                     max_batch_tokens=chunk or 1024)
    ids, positions = case["prompt_ids"], case["logit_positions"]
    want = np.load(os.path.join(FIXTURES, case["logits_file"]))
    core = llm.engine.core
    blocks = np.arange(-(-len(ids) // core.kv_block_size), dtype=np.int32)
    step = chunk or len(ids)
    rows = []
    for start in range(0, len(ids), step):
        part = ids[start:start + step]
        rows.append(core.forward_batch(np.array(part, np.int32), [(len(part), start, blocks, True)]))
    logits = np.concatenate(rows)[positions]
    np.testing.assert_allclose(logits, want, rtol=2e-4, atol=2e-4)


def test_context_is_the_trained_one_with_a_clear_error_past_it(tmp_path):
    llm = corelm.LLM(os.path.join(MODELS, "tiny-qwen2"), dtype="fp32", threads=1, max_seq_len=512)
    with pytest.raises(ValueError, match="512"):
        llm.generate([1] * 600, corelm.SamplingParams(max_tokens=1))
