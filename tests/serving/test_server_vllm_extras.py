"""vLLM's and browsers' small expectations of the server: `stop_reason` in chat and completion choices (the stop
string or token id that ended a choice, null otherwise), /tokenize rendering `tools` and assistant `tool_calls`
through the same template path as chat completions, and /favicon.ico served."""
import json
import os

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from conftest import FIXTURES  # noqa: E402
from corelm.openai.protocol import CHAT_URL, encode_chat, parse_request  # noqa: E402
from test_server import running_server, stories  # noqa: E402

ASK = [{"role": "user", "content": "Tell me a story"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server():
    served = stories()
    with open(os.path.join(FIXTURES, "tokenizer_qwen2.5-coder.json"), encoding="utf-8") as f:
        served.engine.tokenizer.chat_template = json.load(f)["chat_template"]   # writes tools and tool calls
    with running_server(lambda: served) as s:
        assert s.state.wait_ready(30)
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)


def test_stop_reason_names_the_stop_string(client):
    free = client.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0)
    assert free.choices[0].finish_reason == "length" and free.choices[0].model_extra["stop_reason"] is None
    word = free.choices[0].message.content.split()[1]
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0, stop=[word])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == word
    chunks = list(client.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0, stop=[word],
                                                 stream=True))
    assert chunks[-1].choices[0].model_extra["stop_reason"] == word
    c = client.completions.create(model="m", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.choices[0].model_extra["stop_reason"] is None


def test_stop_token_id_and_end_of_sequence(server):
    from corelm import SamplingParams
    llm = server.state.llm
    ids = llm.engine.encode_prompt("Once upon a time")
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "prompt": ids, "max_tokens": 12, "temperature": 0, "stop_token_ids": [out.token_ids[3]]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == out.token_ids[3]
    # the end of sequence is no stop reason (vLLM's): min_tokens 0, EOS allowed; a prompt ending a story
    eos = llm.engine.eos_token_ids[0]
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "prompt": ids, "max_tokens": 12, "temperature": 0, "logit_bias": {str(eos): 100}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None


def test_tokenize_renders_tools_and_tool_calls_as_chat_does(server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text
    req = parse_request(CHAT_URL, {"messages": messages, "tools": TOOLS})      # what a chat completion renders
    assert r.json()["tokens"] == encode_chat(server.state.engine, req.messages, req.template_kwargs)
    text = server.state.engine.tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nSunny.\n</tool_response>" in text
    bad = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": [{"type": "x"}]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def test_favicon(server):
    r = httpx.get(server.url + "/favicon.ico", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml")
    assert r.text.startswith("<svg")
