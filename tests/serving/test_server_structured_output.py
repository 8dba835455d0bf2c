"""Structured output and logit_bias through the HTTP server (the official openai client), on the
embedded SmolLM2-135M-Instruct."""
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

import corelm  # noqa: E402
from corelm.entrypoints.batch.worker import BatchWorker  # noqa: E402
from test_server import SECRET, assert_error, batch_answer, post, running_server  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]},
                                  "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served():
    return corelm.LLM()


@pytest.fixture(scope="module")
def server(served):
    with running_server(lambda: served, api_key=None) as s:
        assert s.state.wait_ready(60)
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_response_format_json_schema(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Describe a person."}], temperature=0.8,
            seed=seed, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                    "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_object_and_vllm_extras(client):
    chunks = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "A cat as JSON with name and age."}], temperature=0,
        max_tokens=80, stream=True, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    r = client.completions.create(model="m", prompt="The answer is", max_tokens=10, temperature=0.8, seed=1,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="m", prompt="Date:", max_tokens=20, temperature=0.8, seed=2,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}})
    assert len(r.choices[0].text) == 7 and r.choices[0].text[4] == "-"


def test_logit_bias(client, served):
    tok = served.get_tokenizer().encode("!", add_special_tokens=False)[0]
    out = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0.8, seed=1,
                                    logit_bias={str(tok): 100})
    assert out.choices[0].text == "!!!"
    out = client.completions.create(model="m", prompt="Hello!", max_tokens=8, temperature=0,
                                    logit_bias={str(tok): -100})
    assert "!" not in out.choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": SECRET}}}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_regex": SECRET + "(("}, "guided_regex"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"4000000": 5}}, "logit_bias"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    err = assert_error(post(server, "/v1/chat/completions", body, key=None), 400, param)
    assert SECRET not in json.dumps(err)


def test_batch_lines_take_the_same_fields():
    worker = BatchWorker(None, 2)
    body = {"messages": [{"role": "user", "content": "Describe a person."}], "temperature": 0.8, "seed": 4,
            "max_tokens": 120, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "p", "schema": SCHEMA}}}
    line, err = batch_answer(worker, "/v1/chat/completions", body)
    assert err is None
    choice = line["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    line, err = batch_answer(worker, "/v1/completions", {"prompt": "x", "guided_regex": SECRET + "(("})
    assert line is None and SECRET not in err[1]
