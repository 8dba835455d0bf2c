"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the HTTP server, driven by the
official `anthropic` client: text, streamed events, system prompts and turns, stop sequences, max_tokens,
tools (forced calls on the embedded SmolLM2, a tool result passed back), token counts, Anthropic's error
shapes and the x-api-key header; a /v1/messages line in a batch file."""
import json
import os

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
anthropic = pytest.importorskip("anthropic")

import corelm  # noqa: E402
from corelm import SamplingParams  # noqa: E402
from corelm.entrypoints.server import app as server_app  # noqa: E402
from corelm.openai.anthropic import MESSAGES_URL, parse_messages  # noqa: E402
from conftest import FIXTURES, MODELS  # noqa: E402
from test_server import KEY, SECRET, WrappedEngine, batch_answer, running_server, stories, wait_idle  # noqa: E402
from test_server import llm, server  # noqa: E402,F401  (test_server's fixtures: its stories260K server)

GREEDY = {"temperature": 0}     # anthropic>=2 has no temperature argument: sent as an extra field
ASK = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=30)


def greedy_chat(llm, messages, **kw):
    return llm.chat(messages, SamplingParams(temperature=0, **kw))[0].outputs[0]


def post(server, path, body, headers=None, **kwargs):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, timeout=30, **kwargs,
                      headers={"x-api-key": KEY, "Content-Type": "application/json", **(headers or {})})


def assert_error(r, status, kind):
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    assert SECRET not in r.text
    return body["error"]["message"]


# --- text ----------------------------------------------------------------------------------------------

def test_text_message_is_the_greedy_chat(client, llm):
    m = client.messages.create(model="stories260K", max_tokens=12, messages=ASK, extra_body=GREEDY)
    ref = greedy_chat(llm, ASK, max_tokens=12)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "stories260K"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref.text
    assert m.stop_reason == ("max_tokens" if ref.finish_reason == "length" else "end_turn")
    assert m.stop_sequence is None
    assert m.usage.input_tokens == len(llm.engine.encode_chat(ASK)) and m.usage.output_tokens == len(ref.token_ids)


def test_max_tokens(client):
    m = client.messages.create(model="m", max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def events_of(client, **kw):
    with client.messages.create(stream=True, **kw) as stream:
        return list(stream)


def test_streamed_events_in_order_and_the_same_text(client, server):
    whole = client.messages.create(model="m", max_tokens=16, messages=ASK, extra_body=GREEDY)
    events = events_of(client, model="m", max_tokens=16, messages=ASK, extra_body=GREEDY)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    body = [k for k in kinds[1:-2] if k != "ping"]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == whole.usage.input_tokens
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert all(e.index == 0 and e.delta.type == "text_delta" for e in deltas)
    assert "".join(e.delta.text for e in deltas) == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    # the client's own accumulator builds the same message
    with client.messages.stream(model="m", max_tokens=16, messages=ASK, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    # on the wire: each event named by an `event:` line matching its data's type
    r = post(server, MESSAGES_URL, {"model": "m", "max_tokens": 4, "messages": ASK, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == name[7:]
    assert "[DONE]" not in r.text


def test_system_prompt_and_turns(client, llm):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once there was a cat."},
             {"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "more"}]}]
    ref = greedy_chat(llm, [{"role": "system", "content": "Be brief."}, turns[0], turns[1],
                            {"role": "user", "content": "Tell me more"}], max_tokens=10)
    for system in ("Be brief.", [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]):
        assistant_blocks = [{"type": "text", "text": "Once there was a cat."}]
        for assistant in (turns[1], {"role": "assistant", "content": assistant_blocks}):
            m = client.messages.create(model="m", max_tokens=10, system=system, extra_body=GREEDY,
                                       messages=[turns[0], assistant, turns[2]])
            assert m.content[0].text == ref.text


def test_stop_sequences(client, llm):
    ref = greedy_chat(llm, ASK, max_tokens=24).text
    word = next(w for w in ref.split()[1:] if len(w) > 2 and ref.index(w) > 0)
    stop = " " + word
    m = client.messages.create(model="m", max_tokens=24, messages=ASK, stop_sequences=["zzqx", stop],
                               extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == ref[:ref.index(stop)]
    events = events_of(client, model="m", max_tokens=24, messages=ASK, stop_sequences=[stop], extra_body=GREEDY)
    assert events[-2].delta.stop_reason == "stop_sequence" and events[-2].delta.stop_sequence == stop
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == m.content[0].text


def test_assistant_prefill_is_continued(client, llm):
    """A final assistant turn of text is continued (after the template's generation prompt), and the answer
    holds only the continuation, as Anthropic's API does."""
    tok = llm.engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True) + "Once upon a",
                     add_special_tokens=False)
    ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    for prefill in ("Once upon a", [{"type": "text", "text": "Once upon"}, {"type": "text", "text": " a"}]):
        messages = ASK + [{"role": "assistant", "content": prefill}]
        m = client.messages.create(model="m", max_tokens=8, messages=messages, extra_body=GREEDY)
        assert m.content[0].text == ref.text and m.usage.input_tokens == len(ids)
        assert client.messages.count_tokens(model="m", messages=messages).input_tokens == len(ids)
    whole = client.messages.create(model="m", max_tokens=8, messages=ASK, extra_body=GREEDY)
    assert whole.usage.input_tokens < len(ids)


# --- token counts ----------------------------------------------------------------------------------------

def test_count_tokens_is_the_reported_prompt_length(client):
    system = "You tell stories."
    for messages in (ASK, ASK + [{"role": "assistant", "content": "Once"}, {"role": "user", "content": "More"}]):
        counted = client.messages.count_tokens(model="m", system=system, messages=messages)
        m = client.messages.create(model="m", max_tokens=1, system=system, messages=messages)
        assert counted.input_tokens == m.usage.input_tokens > 0


# --- errors --------------------------------------------------------------------------------------------

def test_missing_max_tokens_is_an_invalid_request(server):
    msg = assert_error(post(server, MESSAGES_URL, {"model": "m", "messages": ASK}), 400, "invalid_request_error")
    assert "max_tokens" in msg


@pytest.mark.parametrize("body,word", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": SECRET}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": SECRET,
                                                                            "media_type": "image/png"}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "messages"),
    ({"system": [{"type": "image"}]}, "image"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stop_sequences": ["s"] * 17}, "stop_sequences"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": -5}, "top_k"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"name": "f"}]}, "tools"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
     "tool_choice"),
    ({"max_tokens": 300}, "max_tokens"),                            # prompt + max_tokens > the 256-token context
    ({"messages": [{"role": "user", "content": SECRET * 300}]}, "context"),   # over the prompt byte cap
])
def test_bad_requests_are_invalid_request_errors(server, body, word):
    full = {"model": "m", "max_tokens": 4, "messages": ASK, **body}
    assert word in assert_error(post(server, MESSAGES_URL, full), 400, "invalid_request_error")


def test_errors_through_the_client(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=0, messages=ASK)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=4, messages=ASK)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"


def test_api_key_as_x_api_key_or_bearer(server):
    body = {"model": "m", "max_tokens": 2, "messages": ASK}
    assert post(server, MESSAGES_URL, body).status_code == 200
    assert post(server, MESSAGES_URL, body, headers={"x-api-key": "", "Authorization": f"Bearer {KEY}"}) \
        .status_code == 200
    assert_error(post(server, MESSAGES_URL, body, headers={"x-api-key": KEY + "x"}), 401, "authentication_error")
    assert_error(post(server, MESSAGES_URL, body, headers={"x-api-key": ""}), 401, "authentication_error")
    assert_error(post(server, "/v1/messages/count_tokens", {"messages": ASK}, headers={"x-api-key": "no"}), 401,
                 "authentication_error")
    # the other routes take x-api-key too
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_the_server_hardening_answers_in_anthropic_shape(server):
    body = {"model": "m", "max_tokens": 2, "messages": ASK}
    assert_error(post(server, MESSAGES_URL, json.dumps(body), headers={"Content-Type": "text/plain"}), 415,
                 "invalid_request_error")
    assert_error(post(server, MESSAGES_URL, {**body, "system": "x" * (100 * 1024)}), 413, "request_too_large")
    assert_error(post(server, MESSAGES_URL, b"{not json"), 400, "invalid_request_error")
    assert_error(post(server, "/v1/messages/batches", body), 404, "not_found_error")
    assert_error(httpx.get(server.url + MESSAGES_URL, headers={"x-api-key": KEY}), 405, "invalid_request_error")
    assert post(server, MESSAGES_URL, body, headers={"Host": "evil.example"}).status_code == 400
    # count_tokens counts a prompt longer than the context, but not one whose text alone is over the byte cap
    assert post(server, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": SECRET * 300}]}) \
        .json()["input_tokens"] > 256
    assert "context" in assert_error(post(server, "/v1/messages/count_tokens",
                                          {"messages": [{"role": "user", "content": SECRET * 3000}]}),
                                     400, "invalid_request_error")
    # the OpenAI routes keep OpenAI's shape
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 0})
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "max_tokens"


class FailLaterEngine(WrappedEngine):
    """Fails its third step with work: a stream has begun by then."""
    steps = 0

    def step(self):
        if self.has_unfinished_requests():
            FailLaterEngine.steps += 1
            if FailLaterEngine.steps == 3:
                raise RuntimeError("injected engine fault")
        return super().step()


def test_an_engine_fault_mid_stream_is_an_error_event(llm, monkeypatch):
    monkeypatch.setattr(server_app, "make_engine", FailLaterEngine)
    with running_server(lambda: llm) as s:
        assert s.state.wait_ready(10)
        r = post(s, MESSAGES_URL, {"model": "m", "max_tokens": 20, "messages": ASK, "stream": True})
        assert r.status_code == 200
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        assert names[0] == "message_start" and "content_block_delta" in names and names[-1] == "error"
        error = json.loads(r.text.strip().splitlines()[-1][6:])
        assert error["type"] == "error" and error["error"]["type"] == "api_error" and error["error"]["message"]
        c = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=30)
        m = c.messages.create(model="m", max_tokens=3, messages=ASK)          # the server carries on
        assert m.stop_reason in ("max_tokens", "end_turn")
        wait_idle(s.state)


# --- batch ---------------------------------------------------------------------------------------------

def test_batch_line(client):
    from corelm.entrypoints.batch.worker import BatchWorker
    worker = BatchWorker(os.path.join(MODELS, "stories260K"), 2, {"dtype": "fp32", "max_seq_len": 256})
    body = {"model": "m", "max_tokens": 8, "messages": ASK, "system": "Be brief.", "temperature": 0}
    line, err = batch_answer(worker, MESSAGES_URL, body)
    assert err is None, err
    message = line["response"]["body"]
    served = client.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    assert message["type"] == "message" and message["id"].startswith("msg_")
    assert message["content"] == [{"type": "text", "text": served.content[0].text}]
    assert message["stop_reason"] == served.stop_reason and message["usage"] == served.usage.model_dump(
        include={"input_tokens", "output_tokens"})
    _, err = batch_answer(worker, MESSAGES_URL, {"messages": ASK})
    assert err[0] == "invalid_request" and "max_tokens" in err[1]


# --- tools, on the embedded SmolLM2 ------------------------------------------------------------------------

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time in a zone.", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_turns_reach_the_template():
    """tool_use blocks become the assistant's tool calls and tool_result blocks role "tool" messages, which a
    tool-calling template (Qwen2.5's) writes as <tool_call> and <tool_response>; the tools go in too."""
    from corelm.tokenizer import Tokenizer
    with open(os.path.join(FIXTURES, "tokenizer_qwen2.5-coder.json"), encoding="utf-8") as f:
        template = json.load(f)["chat_template"]
    messages = WEATHER_ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": '{"temperature": 21}'}]},
                                     {"type": "text", "text": "Thanks."}]}]
    req = parse_messages({"model": "m", "max_tokens": 8, "messages": messages, "tools": TOOLS})
    assert [m["role"] for m in req.messages] == ["user", "assistant", "tool", "user"]
    assert req.messages[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temperature": 21}'}
    tok = Tokenizer.from_hf_folder(os.path.join(MODELS, "stories260K"))
    text = tok.apply_chat_template(req.messages, chat_template=template, **req.template_kwargs)
    assert "<tools>" in text and '"name": "get_time"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text


@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("llguidance")
    served = corelm.LLM()
    with running_server(lambda: served, api_key=None) as s:
        assert s.state.wait_ready(60)
        yield anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=60)


def check_tool_use(block, names=SCHEMAS):
    jsonschema = pytest.importorskip("jsonschema")
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name in names
    jsonschema.validate(block.input, SCHEMAS[block.name])


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_forced_tool_use(smol, choice):
    m = smol.messages.create(model="m", max_tokens=80, messages=WEATHER_ASK, tools=TOOLS, tool_choice=choice,
                             extra_body=GREEDY)
    assert m.stop_reason == "tool_use" and m.content and all(b.type == "tool_use" for b in m.content)
    for block in m.content:
        check_tool_use(block, ["get_time"] if choice["type"] == "tool" else SCHEMAS)
    with smol.messages.stream(model="m", max_tokens=80, messages=WEATHER_ASK, tools=TOOLS, tool_choice=choice,
                              extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in m.content]
    assert final.stop_reason == "tool_use"
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)


def test_tool_result_passed_back(smol):
    first = smol.messages.create(model="m", max_tokens=80, messages=WEATHER_ASK, tools=TOOLS, extra_body=GREEDY,
                                 tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    [call] = first.content
    check_tool_use(call, ["get_weather"])
    messages = WEATHER_ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C."}]}]
    counted = smol.messages.count_tokens(model="m", messages=messages, tools=TOOLS)
    second = smol.messages.create(model="m", max_tokens=20, messages=messages, tools=TOOLS, extra_body=GREEDY,
                                  tool_choice={"type": "none"})
    assert second.usage.input_tokens == counted.input_tokens
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and second.content[0].text
    without = smol.messages.count_tokens(model="m", messages=messages[:-1] + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": ""}]}])
    assert counted.input_tokens > without.input_tokens          # the result is in the prompt
