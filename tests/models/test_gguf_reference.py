"""Real GGUF files of the types users download (Qwen2.5-Coder-0.5B: Q5_0/Q8_0 with Q4_K/Q6_K; 1.5B: Q4_K_M)
loaded directly, against transformers on the same file (tests/data/gguf_reference, made by
tools/fixtures/make_gguf_reference.py): the prompts tokenize and render as transformers does, and greedy
continuations are transformers' token for token, in fp32 and with the default settings. The files come
from ../shared/models/get_models.sh (CORELM_TEST_MODELS=DEST); without them these tests skip."""
import json
import os

import pytest

from conftest import DATA, real_model

import corelm
from corelm import SamplingParams

REFERENCE = os.path.join(DATA, "gguf_reference")
FILES = sorted(f for f in os.listdir(REFERENCE) if f.endswith(".json"))
SETTINGS = {"fp32": dict(dtype="fp32"), "default": {}}
MUST_MATCH = 32  # tokens, or up to a step where transformers' top two logits are nearly tied


def reference(name):
    with open(os.path.join(REFERENCE, name)) as f:
        return json.load(f)


_LLMS = {}


def llm_for(ref, setting):
    key = (ref["gguf"], setting)
    if key not in _LLMS:
        _LLMS.clear()  # one model at a time: the 1.5B in fp32 is 7 GB
        _LLMS[key] = corelm.LLM(real_model(ref["gguf"]), max_seq_len=512, **SETTINGS[setting])
    return _LLMS[key]


def required_tokens(case, tie):
    """MUST_MATCH, or fewer when transformers' choice at an earlier step was a near tie (margin < tie)."""
    ties = [i for i, m in enumerate(case["margins"]) if m < tie]
    return min([MUST_MATCH] + ties)


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(name, setting):
    ref = reference(name)
    llm = llm_for(ref, setting)
    tie = 0.01 if setting == "fp32" else 0.05
    for case in ref["cases"]:
        out = llm.generate({"prompt_token_ids": case["prompt_ids"]},
                           SamplingParams(max_tokens=len(case["generated_ids"]), temperature=0, ignore_eos=True))
        got, want = out[0].outputs[0].token_ids, case["generated_ids"]
        n = 0
        while n < min(len(got), len(want)) and got[n] == want[n]:
            n += 1
        need = required_tokens(case, tie)
        assert n >= need, f"{case['name']}: {n} tokens match, {need} required; got {got[:need + 2]}, want {want[:need + 2]}"


@pytest.mark.parametrize("name", FILES)
def test_prompts_tokenize_and_render_as_transformers(name):
    ref = reference(name)
    llm = llm_for(ref, "default")
    for case in ref["cases"]:
        if case["kind"] == "chat":
            ids = llm.get_tokenizer().encode(llm.apply_chat_template(case["messages"], add_generation_prompt=True),
                                             add_special_tokens=False)
            assert llm.apply_chat_template(case["messages"], add_generation_prompt=True) == case["prompt_text"]
        else:
            ids = llm.get_tokenizer().encode(case["prompt_text"], add_special_tokens=case["add_special_tokens"])
        assert list(ids) == case["prompt_ids"], case["name"]
