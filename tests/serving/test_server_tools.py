"""Tool calling through the HTTP server (the official openai client) and batch files, on the embedded
SmolLM2-135M-Instruct; the Hermes tool-call parser on handwritten outputs."""
import json

import pytest

from corelm.openai.tool_parsers import hermes

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

import os  # noqa: E402

from corelm.entrypoints.batch.worker import BatchWorker  # noqa: E402
from corelm.openai import CHAT_URL, parse_request  # noqa: E402
from corelm.tokenizer import Tokenizer  # noqa: E402
from conftest import FIXTURES, MODELS  # noqa: E402
from test_server import assert_error, batch_answer, post  # noqa: E402
from test_server_structured_output import client, served, server  # noqa: E402,F401  (the fixtures)

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# --- the Hermes parser -------------------------------------------------------------------------------

def test_hermes_one_call():
    assert hermes.parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>') == \
        (None, [("f", {"x": 1})])


def test_hermes_two_calls_and_text_before():
    text = 'Let me check.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {"y": "z"}}</tool_call>'
    assert hermes.parse(text) == ("Let me check.", [("f", {}), ("g", {"y": "z"})])


def test_hermes_plain_and_malformed_stay_text():
    assert hermes.parse("Just text.") == ("Just text.", [])
    for bad in ['<tool_call>{"name": "f", "arguments": {</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "f", "arguments": 3}</tool_call>', '<tool_call>[1]</tool_call>']:
        assert hermes.parse(bad) == (bad, [])


def test_bare_call_object_naming_a_declared_tool():
    """Qwen2.5-Coder's way: the whole answer is the call object, bare or in a ```json fence."""
    call = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    for text in (call, "```json\n" + call + "\n```", "\n```\n" + call + "```\n"):
        assert hermes.parse(text, ["get_time"]) == (None, [("get_time", {"zone": "UTC"})])
    for text, names in ((call, ["get_weather"]), (call, []), ("Here: " + call, ["get_time"]),
                        ('{"name": "get_time", "arguments": {}, "x": 1}', ["get_time"]),
                        ('{"name": "get_time", "arguments": "UTC"}', ["get_time"]),
                        ("```python\n" + call + "\n```", ["get_time"])):
        assert hermes.parse(text, names) == (text, [])
    assert hermes.may_be_bare_call("") and hermes.may_be_bare_call("``") and hermes.may_be_bare_call("```json\n{")
    assert hermes.may_be_bare_call('{ "name": "get_ti')
    assert not hermes.may_be_bare_call("```python") and not hermes.may_be_bare_call("Sure") \
        and not hermes.may_be_bare_call('{"city"')


# --- responses: the output of an auto tool choice, streamed and whole ------------------------------------

def _answer(pieces, stream):
    """The model writing `pieces` (one token each) answered as a response to a request with TOOLS."""
    from corelm.engine.sequence import StreamChunk
    from corelm.openai import Response
    req = parse_request(CHAT_URL, {"messages": ASK, "tools": TOOLS})
    req.prompt_ids = [[1]]
    response = Response(req, 1, "m", None)
    entries = [response.add(0, StreamChunk(p, 7, "stop" if i == len(pieces) - 1 else None))
               for i, p in enumerate(pieces)]
    return [e for e in entries if e is not None] if stream else response.body()["choices"][0]


CALL = ["Sure", ".", "\n<tool", "_call", '>{"name": "get_time", ', '"arguments": {"zone": "UTC"}}</tool_call>']


def test_auto_call_after_text():
    choice = _answer(CALL, stream=False)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    deltas = _answer(CALL, stream=True)
    assert "".join(e["delta"].get("content", "") for e in deltas) == "Sure."
    assert not any("<" in e["delta"].get("content", "") for e in deltas)      # the call's text is held back
    [last] = [e for e in deltas if "tool_calls" in e["delta"]]
    assert last is deltas[-1] and last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["index"] == 0
    assert last["delta"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_auto_bare_call_streamed_and_whole():
    pieces = ["```", "json", "\n{", '"name": "get_time", ', '"arguments": {"zone": "UTC"}}', "\n```"]
    choice = _answer(pieces, stream=False)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    deltas = _answer(pieces, stream=True)
    assert not any(e["delta"].get("content") for e in deltas)              # held back, then sent as the call
    assert deltas[-1]["finish_reason"] == "tool_calls"
    code = ["```", "python", "\nprint(1)", "\n```"]                      # a code answer streams as it comes
    deltas = _answer(code, stream=True)
    assert "".join(e["delta"].get("content", "") for e in deltas) == "".join(code)
    assert any(e["delta"].get("content") for e in deltas[:-1])              # before the answer ends


def test_auto_text_and_a_held_lookalike_stay_text():
    for pieces in (["Hello", " there."], ["a <", "tool", " b"], ["x <tool_call>{bad"]):
        text = "".join(pieces)
        choice = _answer(pieces, stream=False)
        assert (choice["message"]["content"], choice["finish_reason"]) == (text, "stop")
        assert "tool_calls" not in choice["message"]
        deltas = _answer(pieces, stream=True)
        assert "".join(e["delta"].get("content", "") for e in deltas) == text
        assert deltas[-1]["finish_reason"] == "stop"


# --- the chat template gets the tools, the calls and their results --------------------------------------

def test_qwen_template_renders_tools_calls_and_results():
    with open(os.path.join(FIXTURES, "tokenizer_qwen2.5-coder.json"), encoding="utf-8") as f:
        template = json.load(f)["chat_template"]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    req = parse_request(CHAT_URL, {"messages": messages, "tools": TOOLS})
    tok = Tokenizer.from_hf_folder(os.path.join(MODELS, "stories260K"))
    text = tok.apply_chat_template(req.messages, chat_template=template, **req.template_kwargs)
    assert "<tools>" in text and '"name": "get_time"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text


# --- through the server ------------------------------------------------------------------------------

def check_call(call, names=SCHEMAS):
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_call(client, choice):
    for seed in range(2):
        r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=80, temperature=0.8, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        calls = c.message.tool_calls
        assert len(calls) == 1 or (choice == "required" and len(calls) <= 8)
        for call in calls:
            check_call(call, ["get_time"] if isinstance(choice, dict) else SCHEMAS)


def test_forced_parallel_calls():
    """tool_choice "required" with parallel calls allowed forces a list of 1-8 calls, each parsed into
    tool_calls; without parallel calls, or naming a function, exactly one."""
    from corelm.openai.tools import check_tools
    cfg = check_tools(TOOLS, "required", None)
    schema = cfg.guide().json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 8
    two = json.dumps([{"name": "get_time", "arguments": {}},
                      {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}])
    content, calls = cfg.parse(two)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert len({c["id"] for c in calls}) == 2
    single = check_tools(TOOLS, "required", False)
    assert "array" not in json.dumps(single.guide().json)
    assert len(single.parse(two)[1]) == 1      # parallel_tool_calls false keeps the first call
    named = check_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    assert "array" not in json.dumps(named.guide().json)


def test_forced_parallel_calls_through_the_server(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0.8, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert 1 <= len(c.message.tool_calls) <= 8
    for call in c.message.tool_calls:
        check_call(call)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_streaming(client, choice):
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=80, temperature=0, stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert not any(d.delta.content for d in deltas)
    calls = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert [call.index for call in calls] == list(range(len(calls)))
    assert len(calls) == 1 or (choice == "required" and len(calls) <= 8)
    for call in calls:
        check_call(call, ["get_weather"] if isinstance(choice, dict) else SCHEMAS)
    assert deltas[-1].finish_reason == "tool_calls"


def test_two_step_loop(client):
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    call = message.tool_calls[0]
    messages = ASK + [message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=30, temperature=0)
    c = second.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.tool_calls is None
    assert isinstance(c.message.content, str) and c.message.content


def test_tool_choice_none_and_auto_answer_text(client):
    for choice in ("none", "auto"):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hello."}],
                                           tools=TOOLS, tool_choice=choice, max_tokens=12, temperature=0)
        assert isinstance(r.choices[0].message.content, str)


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "retrieval"}], None, "tools"),
    (["get_weather"], None, "tools"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}], None,
     "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "nope"}}], None, "tools"),
    (TOOLS, {"type": "function", "function": {"name": "unknown"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_400(server, tools, choice, param):
    body = {"messages": ASK, "max_tokens": 4}
    if tools is not None:
        body["tools"] = tools
    if choice is not None:
        body["tool_choice"] = choice
    assert_error(post(server, "/v1/chat/completions", body, key=None), 400, param)


@pytest.mark.parametrize("calls", ["f", [{"function": "f"}], [{"type": "function", "function": {"name": "f"}}],
                                   [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]])
def test_bad_assistant_tool_calls_are_400(server, calls):
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": calls}]
    assert_error(post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4}, key=None), 400,
                 "messages")


def test_batch_forced_call():
    worker = BatchWorker(None, 2)
    line, err = batch_answer(worker, "/v1/chat/completions",
                             {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120,
                              "temperature": 0})
    assert err is None, err
    choice = line["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    jsonschema.validate(json.loads(message["tool_calls"][0]["function"]["arguments"]),
                        SCHEMAS[message["tool_calls"][0]["function"]["name"]])


def test_real_model_calls_tools_in_auto_mode():
    """Qwen2.5-Coder-0.5B (a real GGUF, skipped without it) answers tool requests with bare call objects in
    a ```json fence: with tool_choice auto they come back as tool_calls."""
    from conftest import real_model
    from test_server import running_server
    import corelm
    llm = corelm.LLM(real_model("qwen2.5-coder-0.5b-instruct.gguf"), max_seq_len=1024)
    with running_server(lambda: llm, api_key=None) as s:
        assert s.state.wait_ready(120)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
        for question, name, args in (("What is the weather in Paris, in celsius?", "get_weather",
                                      {"city": "Paris", "unit": "celsius"}),
                                     ("What time is it in zone UTC?", "get_time", {"zone": "UTC"})):
            for stream in (False, True):
                r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": question}], tools=TOOLS,
                                              temperature=0, max_tokens=100, stream=stream)
                if stream:
                    chunks = list(r)
                    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                    [call] = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
                    assert chunks[-1].choices[0].finish_reason == "tool_calls"
                else:
                    assert r.choices[0].finish_reason == "tool_calls"
                    [call] = r.choices[0].message.tool_calls
                assert call.function.name == name and json.loads(call.function.arguments) == args


def test_real_model_two_step_agent_loop():
    """The official client's agent loop with Qwen2.5-Coder-0.5B (skipped without the file): the model calls
    get_weather, the tool's result goes back as a role "tool" message, the model answers in text using it;
    streamed and not."""
    from conftest import real_model
    from test_server import running_server
    import corelm
    llm = corelm.LLM(real_model("qwen2.5-coder-0.5b-instruct.gguf"), max_seq_len=1024)
    with running_server(lambda: llm, api_key=None) as s:
        assert s.state.wait_ready(120)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
        for stream in (False, True):
            messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
            r = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=100)
            [call] = r.choices[0].message.tool_calls
            assert call.function.name == "get_weather"
            messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 17, "sky": "rain"}'})
            r = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=60,
                                          stream=stream)
            if stream:
                chunks = [ch for ch in r if ch.choices]
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
                finish = chunks[-1].choices[0].finish_reason
            else:
                text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            assert finish in ("stop", "length") and "17" in text, text
        # tool_choice "required" forces a list of calls; this 0.5B model makes one call for two cities
        # (in auto mode too), so only the calls' validity is checked
        messages = [{"role": "user", "content": "What is the weather in Paris and in London, in celsius?"}]
        r = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                      temperature=0, max_tokens=120)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls
        for t in calls:
            assert t.function.name == "get_weather" and json.loads(t.function.arguments)["city"] in ("Paris", "London")
