"""OpenAI's Responses API (/v1/responses) through the HTTP server, driven by the official `openai` client's
`responses.create`: text and instructions, input items (messages, function calls and their outputs), streamed
events in OpenAI's order, function tools (forced calls on the embedded SmolLM2), structured output through
text.format, a reasoning item, the stateless refusals of previous_response_id and conversation, and a
/v1/responses line in a batch file."""
import json
import os

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import corelm  # noqa: E402
from corelm import SamplingParams  # noqa: E402
from corelm.openai.responses_api import RESPONSES_URL, parse_responses  # noqa: E402
from conftest import DATA, MODELS  # noqa: E402
from test_server import KEY, batch_answer, running_server, stories  # noqa: E402
from test_server import client, llm, server  # noqa: E402,F401  (test_server's fixtures: its stories260K server)

GREEDY = {"temperature": 0}
ASK = "Tell me a story"
QWEN3 = os.path.join(DATA, "templates", "Qwen-Qwen3-0.6B.jinja")


def greedy_chat(llm, messages, **kw):
    return llm.chat(messages, SamplingParams(temperature=0, **kw))[0].outputs[0]


def post(server, body):
    return httpx.post(server.url + RESPONSES_URL, content=json.dumps(body), timeout=30,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


# --- text ----------------------------------------------------------------------------------------------

def test_text_input_is_the_greedy_chat(client, llm):
    r = client.responses.create(model="m", input=ASK, max_output_tokens=12, temperature=0)
    ref = greedy_chat(llm, [{"role": "user", "content": ASK}], max_tokens=12)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "stories260K"
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text == ref.text
    assert r.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == len(llm.engine.encode_chat([{"role": "user", "content": ASK}]))
    assert r.usage.output_tokens == len(ref.token_ids) and r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.max_output_tokens == 12
    assert r.model_extra.get("store") is False       # stateless: nothing is kept
    # the same prompt again: its blocks come from the prefix cache, and usage says so
    again = client.responses.create(model="m", input=ASK, max_output_tokens=12, temperature=0)
    assert again.usage.input_tokens_details.cached_tokens > 0 and again.output_text == r.output_text


def test_instructions_are_the_system_message(client, llm):
    r = client.responses.create(model="m", input=ASK, instructions="Be brief.", max_output_tokens=10, temperature=0)
    ref = greedy_chat(llm, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
                      max_tokens=10)
    assert r.output_text == ref.text and r.instructions == "Be brief."


def test_input_items_map_onto_chat_messages(client, llm):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                             {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"role": "user", "content": "Thanks"}]
    req = parse_responses({"input": items})
    assert req.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
    r = client.responses.create(model="m", input=items[:3] + items[-1:], max_output_tokens=8, temperature=0)
    assert r.output_text == greedy_chat(llm, req.messages[:3] + req.messages[-1:], max_tokens=8).text


# --- streaming -----------------------------------------------------------------------------------------

def test_streamed_events_in_order_and_the_same_text(client, server):
    whole = client.responses.create(model="m", input=ASK, max_output_tokens=16, temperature=0)
    events = list(client.responses.create(model="m", input=ASK, max_output_tokens=16, temperature=0, stream=True))
    kinds = [e.type for e in events]
    final = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          final]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    done = events[-1].response
    assert done.output_text == whole.output_text and done.output[0].id == item_id
    assert done.usage.output_tokens == whole.usage.output_tokens and done.status == whole.status
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # on the wire: each event named by an `event:` line matching its data's type, no [DONE]
    r = post(server, {"model": "m", "input": ASK, "max_output_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    for block in (b for b in r.text.split("\n\n") if b.strip()):
        name, data = block.split("\n")
        assert json.loads(data[6:])["type"] == name[7:]
    assert "[DONE]" not in r.text


# --- structured output, reasoning ------------------------------------------------------------------------

def test_text_format_json_schema(client):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"],
              "additionalProperties": False}
    r = client.responses.create(model="m", input=ASK, max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "mood", "schema": schema}})
    assert json.loads(r.output_text)["mood"] in ("happy", "sad") and r.status == "completed"
    assert r.text.format.type == "json_schema"
    # the client's own accumulator (it wants response.completed: a finished answer) builds the same response
    with client.responses.stream(model="m", input=ASK, max_output_tokens=40, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "mood", "schema": schema}}) as stream:
        assert stream.get_final_response().output_text == r.output_text
    r = client.responses.create(model="m", input=ASK, max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_object"}})
    assert r.status == "incomplete" or isinstance(json.loads(r.output_text), dict)


def test_a_thought_is_a_reasoning_item():
    pytest.importorskip("llguidance")
    served = corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=1, max_seq_len=256)
    served.engine.tokenizer.chat_template = open(QWEN3).read()
    body = {"input": "hi", "max_output_tokens": 60, "temperature": 0,
            "structured_outputs": {"regex": "<think>\nab\n</think>\n\nok"}}
    with running_server(lambda: served) as s:
        assert s.state.wait_ready(30)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)
        body["extra_body"] = {"structured_outputs": body.pop("structured_outputs")}
        r = c.responses.create(model="m", **body)
        assert [item.type for item in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "ab" and r.output_text == "ok"
        assert r.usage.output_tokens_details.reasoning_tokens > 0
        events = list(c.responses.create(model="m", stream=True, **body))
        kinds = [e.type for e in events]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "ab"
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "ok"
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
        assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]


# --- errors: stateless, and what is not supported -------------------------------------------------------

def test_previous_response_id_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="Hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "stateless" in e.value.body["message"]
    assert e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="Hi", conversation="conv_123")
    assert e.value.body["param"] == "conversation"


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": 3}, "temperature"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema"}}}, "text"),
])
def test_bad_requests_name_the_field(server, body, param):
    r = post(server, {"model": "m", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


# --- batch ---------------------------------------------------------------------------------------------

def test_batch_line(client):
    from corelm.entrypoints.batch.worker import BatchWorker
    worker = BatchWorker(os.path.join(MODELS, "stories260K"), 2, {"dtype": "fp32", "max_seq_len": 256})
    body = {"model": "m", "max_output_tokens": 8, "input": ASK, "instructions": "Be brief.", "temperature": 0}
    line, err = batch_answer(worker, RESPONSES_URL, body)
    assert err is None, err
    answer = line["response"]["body"]
    served = client.responses.create(**body)
    assert answer["object"] == "response" and answer["output"][0]["content"][0]["text"] == served.output_text


# --- tools, on the embedded SmolLM2 ------------------------------------------------------------------------

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": WEATHER, "strict": True}]


@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("llguidance")
    served = corelm.LLM()
    with running_server(lambda: served, api_key=None) as s:
        assert s.state.wait_ready(60)
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_forced_tool_call_is_a_function_call_item(smol):
    jsonschema = pytest.importorskip("jsonschema")
    ask = "What is the weather in Paris?"
    r = smol.responses.create(model="m", input=ask, tools=TOOLS, max_output_tokens=80, temperature=0,
                              tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # streamed: the call's item, its arguments' delta and done, then the response
    events = list(smol.responses.create(model="m", input=ask, tools=TOOLS, max_output_tokens=80, temperature=0,
                                        tool_choice="required", parallel_tool_calls=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2].item.arguments == "" and events[4].arguments == events[3].delta == events[5].item.arguments
    assert events[-1].response.output[0].call_id == events[5].item.call_id
    # the call and its output passed back as items: the model answers in text
    follow = smol.responses.create(model="m", max_output_tokens=16, temperature=0, tools=TOOLS, tool_choice="none",
                                   input=[{"role": "user", "content": ask},
                                          {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                           "arguments": call.arguments},
                                          {"type": "function_call_output", "call_id": call.call_id,
                                           "output": "Sunny, 21 C."}])
    assert [item.type for item in follow.output] == ["message"] and follow.output_text
    assert follow.usage.input_tokens > r.usage.input_tokens
