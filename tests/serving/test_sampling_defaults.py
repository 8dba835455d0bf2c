"""The model's sampling defaults (vLLM's --generation-config auto): requests that leave temperature, top_p, top_k,
min_p or repetition_penalty unset take generation_config.json's (or GGUF general.sampling.*'s); --generation-config
vllm turns that off."""
import json
import os
import shutil

import pytest

from conftest import MODELS
from corelm.engine.llm_engine import model_sampling_defaults
from corelm.openai.protocol import CHAT_URL, parse_request, encode_prompts

ASK = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """stories260K with a generation_config.json that asks for greedy decoding."""
    out = tmp_path_factory.mktemp("m") / "stories-greedy"
    shutil.copytree(os.path.join(MODELS, "stories260K"), out, ignore=shutil.ignore_patterns("*.gguf"))
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "top_k": 20, "top_p": 0.8}))
    return str(out)


def _llm(folder, **kw):
    import corelm
    return corelm.LLM(folder, dtype="fp32", threads=1, max_seq_len=256, **kw)


def test_unset_fields_take_the_models_defaults(folder):
    llm = _llm(folder)
    assert llm.engine.sampling_defaults == {"temperature": 0.0, "top_k": 20, "top_p": 0.8}
    req = parse_request(CHAT_URL, {"messages": ASK})
    encode_prompts(llm.engine, req)
    assert req.params.temperature == 0.0 and req.params.is_greedy
    req = parse_request(CHAT_URL, {"messages": ASK, "temperature": 0.7, "top_p": 0.9})
    encode_prompts(llm.engine, req)
    assert (req.params.temperature, req.params.top_p, req.params.top_k) == (0.7, 0.9, 20)
    off = _llm(folder, generation_config="vllm")
    assert off.engine.sampling_defaults == {}
    req = parse_request(CHAT_URL, {"messages": ASK})
    encode_prompts(off.engine, req)
    assert req.params.temperature == 1.0
    assert model_sampling_defaults({"temperature": -1, "top_p": "x", "min_p": 0.1}) == {"min_p": 0.1}


def test_server_answers_greedily_by_the_models_default(folder):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_server import running_server
    served, ref = _llm(folder), _llm(folder)
    from corelm import SamplingParams
    greedy = ref.chat(ASK, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    with running_server(lambda: served) as s:
        assert s.state.wait_ready(30)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)
        for _ in range(2):      # the model's temperature 0: the same greedy answer every time
            r = client.chat.completions.create(model="m", messages=ASK, max_tokens=12)
            assert r.choices[0].message.content == greedy


def test_generation_config_flag():
    import argparse
    from corelm.entrypoints.cli.flags import add_engine_flags, engine_options
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert "generation_config" not in engine_options(p.parse_args([]))
    assert engine_options(p.parse_args(["--generation-config", "vllm"]))["generation_config"] == "vllm"


def test_the_embedded_model_answers_plainly_by_default():
    """The embedded SmolLM2's file sets no sampling defaults: corelm gives it its model card's (at llama-cli's
    temperature 0.8 it rambled), unless asked for vLLM's own."""
    import corelm
    from corelm.engine.llm_engine import EMBEDDED_MODEL_SAMPLING
    assert corelm.LLM(threads=1).engine.sampling_defaults == EMBEDDED_MODEL_SAMPLING
    assert corelm.LLM(threads=1, generation_config="vllm").engine.sampling_defaults == {}
    assert corelm.LLM(os.path.join(MODELS, "stories260K"), threads=1).engine.sampling_defaults == {}


def test_cli_flags_then_the_models_defaults_then_llama_clis():
    from corelm.entrypoints import cli
    from corelm.entrypoints.cli.flags import describe_sampling, sampling_choices, sampling_params
    parser = cli.build_parser()
    args = parser.parse_args(["chat", "--top-k", "7"])
    choices = sampling_choices(args, {"temperature": 0.2, "top_p": 0.9})
    assert choices == {"temperature": (0.2, "model"), "top_k": (7, "flag"), "top_p": (0.9, "model"),
                       "min_p": (0.05, "llama-cli"), "repetition_penalty": (1.0, "llama-cli")}
    p = sampling_params(args, {"temperature": 0.2, "top_p": 0.9})
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.2, 7, 0.9, 0.05)
    assert describe_sampling(choices).startswith("sampling: temperature 0.2 (model), top_k 7 (flag)")
    flat = sampling_params(parser.parse_args(["chat"]))          # no model defaults: llama-cli's
    assert (flat.temperature, flat.top_k, flat.top_p, flat.min_p) == (0.8, 40, 0.95, 0.05)
