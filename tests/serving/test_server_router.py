"""Several models behind one server (corelm serve --models-dir DIR, or NAME=PATH): listing with status, load on
first use, LRU unloading under --max-loaded-models and --models-memory-gb, /models/load and /models/unload,
a corrupt file listed as failed, an unknown name a 404, two models answering at once, the engines stepped in
turn with parked workers; and corelm batch with two model names."""
import contextlib
import json
import os
import shutil
import threading
import time
import types

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import MODELS  # noqa: E402
from test_server import running_server  # noqa: E402

import corelm  # noqa: E402
from corelm import SamplingParams, StreamChunk  # noqa: E402
from corelm.entrypoints.cli import build_parser  # noqa: E402
from corelm.entrypoints.cli.serve import model_router  # noqa: E402
from corelm.entrypoints.cli.flags import engine_options  # noqa: E402
from corelm.entrypoints.server.router import EngineSet, ModelRouter  # noqa: E402

STORIES = os.path.join(MODELS, "stories260K")
PROMPT = [{"role": "user", "content": "Tell me a story"}]


def make_llm(path):
    return corelm.LLM(path, dtype="fp32", threads=2, max_seq_len=256)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """A GGUF file, an HF folder (the same model: the same answers), a tiny random Llama folder, a corrupt
    GGUF and a file that is no model."""
    d = tmp_path_factory.mktemp("models")
    shutil.copy(os.path.join(STORIES, "stories260K.gguf"), d / "stories-gguf.gguf")
    shutil.copytree(STORIES, d / "stories-hf", ignore=shutil.ignore_patterns("*.gguf"))
    shutil.copytree(os.path.join(MODELS, "tiny-llama3"), d / "tiny-llama3")
    (d / "broken.gguf").write_bytes(b"GGUF" + os.urandom(300))
    (d / "notes.txt").write_text("not a model")
    return d


@pytest.fixture(scope="module")
def reference():
    llm = make_llm(STORIES)
    return {"chat": llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text,
            "completion": llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12))[0]
            .outputs[0].text}


@contextlib.contextmanager
def router_server(router):
    with running_server(None, router=router) as s:
        yield types.SimpleNamespace(url=s.url, router=router, client=openai.OpenAI(
            base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60))


def statuses(url):
    r = httpx.get(url + "/v1/models", timeout=10)
    assert r.status_code == 200 and r.json()["object"] == "list"
    return {m["id"]: m["status"] for m in r.json()["data"]}


def post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


def chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=0, **kw)


@pytest.fixture(scope="module")
def served(models_dir):
    from corelm.entrypoints.catalog import find_models
    with router_server(ModelRouter(find_models(str(models_dir)), make_llm)) as s:
        yield s


def test_every_model_is_listed_and_loads_on_first_use(served, reference):
    models = served.client.models.list()
    assert [m.id for m in models.data] == ["broken", "stories-gguf", "stories-hf", "tiny-llama3"]
    assert statuses(served.url)["stories-gguf"] == {"value": "unloaded"}
    out = chat(served.client, "stories-gguf")
    assert out.model == "stories-gguf" and out.choices[0].message.content == reference["chat"]
    now = statuses(served.url)
    assert now["stories-gguf"] == {"value": "loaded"} and now["tiny-llama3"] == {"value": "unloaded"}


def test_two_models_answer_concurrent_requests(served, reference):
    results, errors = {}, []

    def ask(model, kind, i):
        try:
            if kind == "chat":
                stream = served.client.chat.completions.create(model=model, messages=PROMPT, max_tokens=12,
                                                               temperature=0, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            else:
                text = served.client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                                        temperature=0).choices[0].text
            results[(model, kind, i)] = text
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(m, k, i)) for m in ("stories-gguf", "stories-hf")
               for k in ("chat", "completion") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert len(results) == 12 and all(text == reference[kind] for (_, kind, _), text in results.items())
    now = statuses(served.url)
    assert now["stories-gguf"]["value"] == now["stories-hf"]["value"] == "loaded"


def test_an_unknown_model_is_a_404_naming_the_models(served):
    with pytest.raises(openai.NotFoundError) as e:
        chat(served.client, "no-such-model")
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "no-such-model" not in err["message"]     # the name asked for is not echoed
    assert "stories-gguf" in err["message"] and "tiny-llama3" in err["message"]
    r = post(served.url, "/tokenize", {"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_corrupt_file_is_listed_as_failed_and_the_others_serve_on(served, reference):
    r = post(served.url, "/models/load", {"model": "broken"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    status = statuses(served.url)["broken"]
    assert status["value"] == "failed" and status["error"]
    with pytest.raises(openai.APIStatusError) as e:
        chat(served.client, "broken")
    assert e.value.status_code == 503
    assert chat(served.client, "stories-hf").choices[0].message.content == reference["chat"]
    assert httpx.get(served.url + "/health").status_code == 200


def test_load_and_unload(served, reference):
    assert post(served.url, "/models/load", {"model": "tiny-llama3"}).json() == {"success": True}
    assert statuses(served.url)["tiny-llama3"] == {"value": "loaded"}
    tokens = post(served.url, "/tokenize", {"model": "tiny-llama3", "prompt": "hi"})
    assert tokens.status_code == 200 and tokens.json()["tokens"]
    assert post(served.url, "/models/unload", {"model": "tiny-llama3"}).json() == {"success": True}
    assert statuses(served.url)["tiny-llama3"] == {"value": "unloaded"}
    r = post(served.url, "/models/unload", {"model": "tiny-llama3"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_loaded"
    assert post(served.url, "/models/load", {}).status_code == 400
    assert post(served.url, "/models/load", {"model": "nope"}).status_code == 404
    # a request loads an unloaded model again
    post(served.url, "/models/unload", {"model": "stories-gguf"})
    assert chat(served.client, "stories-gguf").choices[0].message.content == reference["chat"]


def test_a_model_with_a_request_in_flight_is_not_unloaded(served):
    """A request holds a lease on its model from the moment it names it to its last chunk (the tiny model
    answers too fast for a real request to stay in flight, so the test takes a lease as a request does)."""
    import asyncio
    lease = asyncio.run(served.router.acquire("stories-hf"))
    busy = post(served.url, "/models/unload", {"model": "stories-hf"})
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"
    lease.release()
    lease.release()                      # once only
    assert post(served.url, "/models/unload", {"model": "stories-hf"}).status_code == 200


@pytest.mark.parametrize("budget", [{"max_loaded": 1}, {"memory_bytes": 1}])
def test_the_least_recently_used_idle_model_is_unloaded_under_the_budget(models_dir, reference, budget):
    """--max-loaded-models 1, and a memory budget smaller than any two models (one alone still loads)."""
    models = {"a": str(models_dir / "stories-gguf.gguf"), "b": str(models_dir / "stories-hf"),
              "c": str(models_dir / "tiny-llama3")}
    with router_server(ModelRouter(models, make_llm, **budget)) as s:
        assert chat(s.client, "a").choices[0].message.content == reference["chat"]
        assert chat(s.client, "c").choices[0].message.content
        assert statuses(s.url) == {"a": {"value": "unloaded"}, "b": {"value": "unloaded"}, "c": {"value": "loaded"}}
        assert chat(s.client, "b").choices[0].message.content == reference["chat"]
        assert [n for n, st in statuses(s.url).items() if st["value"] == "loaded"] == ["b"]
        # two clients on two models with room for one: each waits its turn, both are answered
        outs = {}
        threads = [threading.Thread(target=lambda m=m: outs.__setitem__(m, chat(s.client, m)))
                   for m in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert {m: o.choices[0].message.content for m, o in outs.items()} == {"a": reference["chat"],
                                                                             "b": reference["chat"]}


class FakeEngine:
    """Each step emits one token for every request until it has `steps` of them."""

    def __init__(self, name, log):
        self.name, self.log, self.reqs, self.parked = name, log, {}, 0
        self.core = types.SimpleNamespace(park_threads=self.park)

    def park(self):
        self.parked += 1
        self.log.append(("park", self.name))

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = 3

    def abort_request(self, rid):
        pass

    def has_unfinished_requests(self):
        return bool(self.reqs)

    num_waiting = num_running = 0

    def step(self):
        self.log.append(("step", self.name))
        out = []
        for rid in list(self.reqs):
            self.reqs[rid] -= 1
            out.append((rid, StreamChunk("x", 1, finish_reason="stop" if self.reqs[rid] == 0 else None)))
            if self.reqs[rid] == 0:
                del self.reqs[rid]
        return out


def test_busy_engines_step_in_turn_and_park_their_workers_for_the_next():
    log = []
    a, b = FakeEngine("a", log), FakeEngine("b", log)
    engines = EngineSet()
    engines.attach("a", a)
    engines.attach("b", b)
    for rid, e in (("r1", a), ("r2", b)):
        engines.expect(rid, e)
        engines.add_request(rid, [1], SamplingParams(max_tokens=3))
    assert not engines.detach("a")         # requests on it: it stays
    while engines.has_unfinished_requests():
        engines.step()
    turn = [("step", "a"), ("park", "a"), ("step", "b"), ("park", "b")]
    assert log == turn * 2 + turn[:3]      # b's last step: nothing else is busy
    assert engines.detach("a")
    # one busy engine alone keeps its workers spinning for its next step
    log.clear()
    engines.expect("r3", b)
    engines.add_request("r3", [1], SamplingParams(max_tokens=3))
    while engines.has_unfinished_requests():
        engines.step()
    assert log == [("step", "b")] * 3


def test_serve_command_line(tmp_path, models_dir):
    def parse(*argv):
        args = build_parser().parse_args(["serve", *argv])
        return model_router(args, engine_options(args)), args

    router, args = parse(str(models_dir / "stories-gguf.gguf"))
    assert router is None and args.model == [str(models_dir / "stories-gguf.gguf")]
    router, _ = parse(f"x={models_dir / 'stories-gguf.gguf'}", f"y={models_dir / 'tiny-llama3'}",
                      "--max-loaded-models", "1", "--models-memory-gb", "2")
    assert set(router.models) == {"x", "y"} and router.max_loaded == 1 and router.memory_bytes == 2 << 30
    router, _ = parse("--models-dir", str(models_dir), f"x={models_dir / 'tiny-llama3'}")
    assert set(router.models) == {"broken", "stories-gguf", "stories-hf", "tiny-llama3", "x"}
    for bad in ([str(models_dir / "stories-gguf.gguf"), f"x={models_dir / 'tiny-llama3'}"],
                ["--models-dir", str(models_dir), "-dp", "2"],
                ["--models-dir", str(models_dir), "--served-model-name", "n"],
                ["--models-dir", str(tmp_path / "missing")],
                ["--models-dir", str(tmp_path)],                       # empty
                ["a=x", "a=y"],
                [str(models_dir / "stories-gguf.gguf"), "--max-loaded-models", "1"]):
        with pytest.raises(ValueError):
            parse(*bad)


def test_batch_routes_each_line_by_its_model(tmp_path, models_dir, reference):
    from corelm.entrypoints.cli import main
    lines = [{"custom_id": f"{m}-{i}", "url": "/v1/chat/completions",
              "body": {"model": m, "messages": PROMPT, "max_tokens": 12, "temperature": 0}}
             for i in range(2) for m in ("stories-gguf", "stories-hf", "tiny-llama3")]
    lines += [{"custom_id": "unknown", "url": "/v1/completions", "body": {"model": "nope", "prompt": "hi"}},
              {"custom_id": "broken", "url": "/v1/completions", "body": {"model": "broken", "prompt": "hi"}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["batch", str(src), "-o", str(out), "--models-dir", str(models_dir), "--max-loaded-models", "2",
                 "-c", "256", "--dtype", "fp32", "-t", "2", "--no-progress"]) == 0
    got = {rec["custom_id"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    assert set(got) == {line["custom_id"] for line in lines}
    for m in ("stories-gguf", "stories-hf"):
        for i in range(2):
            body = got[f"{m}-{i}"]["response"]["body"]
            assert body["model"] == m and body["choices"][0]["message"]["content"] == reference["chat"]
    assert got["tiny-llama3-0"]["response"]["body"]["model"] == "tiny-llama3"
    assert got["unknown"]["error"]["code"] == "model_not_found"
    assert got["broken"]["error"]["code"] == "model_load_failed"
