"""The OpenAI-compatible server (corelm.entrypoints.server), driven over loopback HTTP by the official `openai`
client and by httpx: chat and completions, streaming or not, logprobs, stop strings, n, errors, the
API key, the body-size limit, loading, and client disconnects (streaming and not) aborting work."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import MODELS  # noqa: E402

import corelm  # noqa: E402
from corelm import SamplingParams  # noqa: E402
from corelm.entrypoints.server import app as server_app  # noqa: E402
from corelm.entrypoints.server import DEFAULT_MAX_CONNECTIONS, create_app, uvicorn_config  # noqa: E402

KEY = "test-key-123"


def stories():
    return corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=2, max_seq_len=256)


@pytest.fixture(scope="module")
def llm():
    """For reference generations (and the short-lived servers of single tests)."""
    return stories()


@contextlib.contextmanager
def running_server(load_llm, max_connections=DEFAULT_MAX_CONNECTIONS, **kwargs):
    app = create_app(load_llm, "stories260K", **kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    # the configuration `corelm serve` runs with (connection limit, keep-alive timeout)
    server = uvicorn.Server(uvicorn_config(app, max_connections, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{port}", state=app.state.corelm)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def server():
    # A model of its own: the server's thread steps its engine, and a reference generation through the
    # same engine from the test's thread would race it for the chunks.
    served = stories()
    with running_server(lambda: served, api_key=KEY, max_body_bytes=64 * 1024) as s:
        assert s.state.wait_ready(30)
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def post(server, path, body, key=KEY, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={**headers, "Content-Type": "application/json"},
                      timeout=30, **kwargs)


def wait_idle(state, timeout=2.0):
    deadline = time.monotonic() + timeout
    while state.runner.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests were left running"
        time.sleep(0.005)


def greedy(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw))[0].outputs[0]


# --- the happy paths, through the official client --------------------------------------------------

def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["stories260K"]
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_matches_generate(server, client, llm):
    out = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=12, temperature=0)
    ref = greedy(llm, "Once upon a time", max_tokens=12)
    choice = out.choices[0]
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(llm.encode_prompt("Once upon a time"))
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_token_id_prompts_and_batches(client, llm):
    """A batch of prompts is all text or all token ids (a mix is refused, as by vLLM)."""
    ids = llm.encode_prompt("The dog")
    out = client.completions.create(model="m", prompt=[ids, llm.encode_prompt("Tom had a")], max_tokens=6,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == greedy(llm, ids, max_tokens=6).text
    assert out.choices[1].text == greedy(llm, "Tom had a", max_tokens=6).text
    out = client.completions.create(model="m", prompt=["The dog", "Tom had a"], max_tokens=6, temperature=0)
    assert out.choices[1].text == greedy(llm, "Tom had a", max_tokens=6).text


def test_chat_uses_the_template_and_content_parts(client, llm):
    messages = [{"role": "user", "content": "Tell me a story"}]
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story"}]}]
    again = client.chat.completions.create(model="m", messages=parts, max_completion_tokens=10, temperature=0)
    assert again.choices[0].message.content == ref.text


def test_streaming_chat_equals_whole_and_reports_usage(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and "\ufffd" not in text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_completion_with_logprobs(client, llm):
    ref = greedy(llm, "Once upon a time", max_tokens=8, logprobs=3)
    stream = client.completions.create(model="m", prompt="Once upon a time", max_tokens=8, temperature=0,
                                       logprobs=3, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    lps = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    ref_lps = [entry[t].logprob for entry, t in zip(ref.logprobs, ref.token_ids)]   # vLLM's {id: Logprob}
    assert lps == pytest.approx(ref_lps, abs=1e-6)
    assert all(len(t) == 3 for c in chunks for t in c.choices[0].logprobs.top_logprobs)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    # greedy: the chosen token is the most likely one
    assert all(e.token == e.top_logprobs[0].token for e in content)


def test_completion_logprobs_non_streaming(client):
    out = client.completions.create(model="m", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_stop_strings(client, llm):
    ref = greedy(llm, "Once upon a time", max_tokens=20).text
    word = ref.split()[3]
    out = client.completions.create(model="m", prompt="Once upon a time", max_tokens=20, temperature=0, stop=[word])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == ref[:ref.index(word)]
    stream = client.completions.create(model="m", prompt="Once upon a time", max_tokens=20, temperature=0,
                                       stop=word, stream=True)
    assert "".join(c.choices[0].text for c in stream) == ref[:ref.index(word)]


def test_n_and_seed_and_extra_sampling_fields(client):
    kw = dict(model="m", prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3, seed=7,
              extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
              presence_penalty=0.5, frequency_penalty=0.2, top_p=0.9)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]     # the seed makes it reproducible
    assert len({c.text for c in a.choices}) > 1                            # seed, seed+1, seed+2 differ
    assert 3 <= a.usage.completion_tokens <= 36


def test_streaming_several_choices(client):
    stream = client.completions.create(model="m", prompt=["Once upon a time", "The dog"], n=2, seed=3,
                                       max_tokens=8, temperature=0.8, stream=True)
    texts, finish = {}, {}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert sorted(finish) == [0, 1, 2, 3] and set(finish.values()) <= {"stop", "length"}


def test_concurrent_clients_share_the_engine(server, client, llm):
    prompts = ["Once upon a time", "The dog", "Tom had a", "Lily saw", "One day", "The sun"]
    refs = {p: greedy(llm, p, max_tokens=10).text for p in prompts}
    results, errors = {}, []

    def worker(p):
        try:
            s = client.completions.create(model="m", prompt=p, max_tokens=10, temperature=0, stream=True)
            results[p] = "".join(c.choices[0].text for c in s)
        except Exception as e:  # pragma: no cover
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and results == refs
    wait_idle(server.state)


# --- bad input ---------------------------------------------------------------------------------------

SECRET = "zebra-quokka-771"


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    assert SECRET not in r.text
    return err


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": SECRET}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 2, "temperature": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": 17}, "stop"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt": [1, 10**6]}, "prompt"),
    ({"prompt": SECRET * 200}, "prompt"),               # longer than the 256-token context
    ({"prompt": "x", "logit_bias": {"5000000": 1}}, "logit_bias"),   # outside the vocabulary
    ({"prompt": {"text": SECRET}}, "prompt"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),                # at most 16 stop strings
    ({"prompt": "x", "stop": "s" * 257}, "stop"),                 # of at most 256 characters
    ({"prompt": "x", "max_tokens": 256}, "max_tokens"),           # prompt + max_tokens > the context
    ({"prompt": [[1], "a"]}, "prompt"),                           # token ids and text mixed
    ({"prompt": ["a", [1]]}, "prompt"),
])
def test_bad_completion_requests_get_400(server, body, param):
    err = assert_error(post(server, "/v1/completions", body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": SECRET}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": SECRET}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": SECRET * 300}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 300}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 300}, "max_tokens"),
])
def test_bad_chat_requests_get_400(server, body, param):
    assert_error(post(server, "/v1/chat/completions", body), 400, param)


def test_context_overflow_is_a_400_with_code(server):
    err = assert_error(post(server, "/v1/completions", {"prompt": SECRET * 200}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"


def test_max_tokens_beyond_the_context_is_a_400_not_a_clamp(server, llm):
    """As vLLM's server: prompt + max_tokens over the context is refused, naming both; exactly the
    context is fine. corelm.LLM, like vLLM's offline LLM, stops at the context instead."""
    ids = [1, 403, 407]
    err = assert_error(post(server, "/v1/completions", {"prompt": ids, "max_tokens": 254}), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"
    assert err["message"] == ("This model's maximum context length is 256 tokens. However, you requested 257 "
                              "tokens (3 in the prompt, 254 in the completion). Please reduce the length of "
                              "the prompt or completion.")
    ok = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 253, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 253
    out = llm.generate([ids], SamplingParams(max_tokens=1000, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 253 and out.finish_reason == "length"


@pytest.mark.parametrize("raw", [b'{"prompt": "x",', b"\xff\xfe{}", b"[1, 2]", b"", b'"' + SECRET.encode() + b'"'])
def test_invalid_json_gets_400(server, raw):
    assert_error(post(server, "/v1/completions", raw), 400)


def test_client_errors_through_the_official_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", temperature=-1)
    assert e.value.status_code == 400 and "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": SECRET * 300}])


def test_body_size_limit(server):
    big = json.dumps({"prompt": "x" * (100 * 1024)})
    assert_error(post(server, "/v1/completions", big), 413)

    def chunked():                      # no Content-Length: counted while reading
        for _ in range(100):
            yield b"x" * 1024
    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert_error(r, 413)


def _stalled_upload(port, key=None, path="/v1/completions"):
    """A raw connection that sends its headers (Content-Length: 100) and one byte of the body, then stalls."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n"
                 f"Content-Length: 100\r\n\r\n{{".encode())
    return sock


def _answer(sock):
    """What the server sent before closing the connection (raises socket.timeout if it does not close)."""
    data = b""
    while True:
        part = sock.recv(65536)
        if not part:
            return data.decode("latin-1")
        data += part


def _request_counts(s):
    counts = {}
    for line in httpx.get(s.url + "/metrics").text.splitlines():
        if line.startswith("corelm_http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels[len("corelm_http_requests_total"):]] = int(value)
    return counts


def test_stalled_uploads_get_a_408_and_are_closed(llm):
    """50 connections stall mid-body: each gets a 408 once the body timeout passes and is closed, so
    no file descriptor is held; with a limit of 20 connections, those beyond it get a 503 at once."""
    with running_server(lambda: llm, body_timeout=0.5, max_connections=20) as s:
        assert s.state.wait_ready(10)
        port = int(s.url.rsplit(":", 1)[1])
        t0 = time.monotonic()
        socks = [_stalled_upload(port) for _ in range(10)]
        time.sleep(0.2)                      # these ten are being read: under the limit
        socks += [_stalled_upload(port) for _ in range(40)]
        try:
            answers = [_answer(sock).split("\r\n", 1)[0] for sock in socks]   # each one closed
        finally:
            for sock in socks:
                sock.close()
        assert time.monotonic() - t0 < 5
        assert answers[:10] == ["HTTP/1.1 408 Request Timeout"] * 10
        assert set(answers) == {"HTTP/1.1 408 Request Timeout", "HTTP/1.1 503 Service Unavailable"}
        assert answers.count("HTTP/1.1 503 Service Unavailable") >= 25     # at most 20 held at a time
        counts = _request_counts(s)
        assert counts['{endpoint="/v1/completions",status="408"}'] == answers.count("HTTP/1.1 408 Request Timeout")
        ok = post(s, "/v1/completions", {"prompt": "Once", "max_tokens": 2}, key=None)   # still serving
        assert ok.status_code == 200


def test_a_client_leaving_mid_upload_is_a_client_abort_without_a_traceback(llm, caplog):
    with running_server(lambda: llm, body_timeout=5) as s:
        assert s.state.wait_ready(10)
        port = int(s.url.rsplit(":", 1)[1])
        for _ in range(5):
            _stalled_upload(port).close()
        deadline = time.monotonic() + 5
        while _request_counts(s).get('{endpoint="/v1/completions",status="499"}', 0) < 5:
            assert time.monotonic() < deadline, _request_counts(s)
            time.sleep(0.05)
        assert not any(k.endswith('status="500"}') for k in _request_counts(s))
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]


def test_api_key(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x"}, key=None), 401)
    assert_error(post(server, "/v1/completions", {"prompt": "x"}, key="wrong"), 401)
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200        # health needs no key


def test_unknown_route_is_an_openai_error(server):
    r = httpx.get(server.url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert_error(r, 404)


# --- loading, disconnects ---------------------------------------------------------------------------

def test_503_while_loading(llm):
    release = threading.Event()

    def slow_load():
        release.wait(10)
        return llm
    with running_server(slow_load) as s:
        r = httpx.get(s.url + "/health")
        err = assert_error(r, 503)
        assert err["type"] == "unavailable_error"
        assert_error(post(s, "/v1/completions", {"prompt": "x"}), 503)
        assert_error(post(s, "/tokenize", {"prompt": "x"}), 503)
        release.set()
        assert s.state.wait_ready(10)
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}


def test_load_failure_is_reported(llm):
    def broken():
        raise corelm.ModelLoadError("bad file")
    seen = []
    with running_server(broken, on_load_error=seen.append) as s:
        assert not s.state.wait_ready(10)
        assert_error(httpx.get(s.url + "/health"), 503)
    assert len(seen) == 1


class WrappedEngine:
    """The LLM's own engine, with a hook around step() for fault and timing tests."""

    def __init__(self, llm):
        self.inner = llm.engine

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self):
        return self.inner.step()


class SlowEngine(WrappedEngine):
    """Steps take 5 ms, so a long request is still running when its client leaves."""

    def step(self):
        time.sleep(0.005)
        return super().step()


@pytest.fixture
def slow_server(llm, monkeypatch):
    monkeypatch.setattr(server_app, "make_engine", SlowEngine)
    with running_server(lambda: llm) as s:
        assert s.state.wait_ready(10)
        yield s


class FailOnceEngine(WrappedEngine):
    failed = False

    def step(self):
        if not FailOnceEngine.failed and self.has_unfinished_requests():
            FailOnceEngine.failed = True
            raise RuntimeError("injected engine fault")
        return super().step()


def test_an_engine_fault_fails_the_request_not_the_server(llm, monkeypatch):
    monkeypatch.setattr(server_app, "make_engine", FailOnceEngine)
    with running_server(lambda: llm) as s:
        assert s.state.wait_ready(10)
        err = assert_error(post(s, "/v1/completions", {"prompt": "Once", "max_tokens": 4}), 500)
        assert err["type"] == "server_error" and "injected" not in err["message"]
        ok = post(s, "/v1/completions", {"prompt": "Once", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
        wait_idle(s.state)


def aborts(s):
    text = httpx.get(s.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith('corelm_requests_finished_total{finish_reason="abort"}'):
            return int(line.split()[-1])
    return 0


def test_streaming_disconnect_aborts_the_request(slow_server):
    s = slow_server
    body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", s.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 2:
                        break
    t0 = time.monotonic()
    wait_idle(s.state, timeout=1.0)        # 240 tokens would take > 1.2 s
    assert time.monotonic() - t0 < 1.0
    assert aborts(s) == 1
    assert s.state.runner.num_running == 0 and s.state.runner.num_waiting == 0


def test_non_streaming_disconnect_aborts_the_request(slow_server):
    s = slow_server
    body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/completions", json=body, timeout=0.3)
    wait_idle(s.state, timeout=1.0)
    assert aborts(s) == 1


def test_queued_requests_abort_too(slow_server):
    """Two streams: the second waits behind the first; both clients leave; nothing is left over."""
    s = slow_server
    body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2:
        with c1.stream("POST", s.url + "/v1/completions", json=body) as r1:
            next(r1.iter_lines())
            with c2.stream("POST", s.url + "/v1/completions", json=body) as r2:
                assert r2.status_code == 200
    wait_idle(s.state, timeout=1.0)
    assert aborts(s) == 2


# --- the command line -------------------------------------------------------------------------------

def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc, url, timeout=60):
    """Waits for a `corelm serve` process's /health to answer 200."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "corelm serve did not become healthy"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def _env():
    """Child processes import corelm from where this process did (installed or in place)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(corelm.__file__)))
    return dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_corelm_serve_command(tmp_path):
    """The API key comes from a file, so it is not in the process list (`ps`)."""
    port = _free_port()
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "corelm.entrypoints.cli", "serve", os.path.join(MODELS, "stories260K"),
                             "--port", str(port), "--dtype", "fp32", "-t", "1", "--api-key-file", str(key_file),
                             "--body-timeout", "10", "--max-connections", "64", "--log-level", "warning"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert c.models.list().data[0].id == "stories260K"
        out = c.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=4)
        assert out.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.terminate()
        proc.wait(15)


def test_corelm_serve_exits_when_the_model_fails_to_load(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    proc = subprocess.run([sys.executable, "-m", "corelm.entrypoints.cli", "serve", str(bad), "--port", str(_free_port()),
                           "--log-level", "warning"], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "error:" in proc.stderr


def test_serve_flag_errors():
    from corelm.entrypoints import cli
    assert cli.main(["serve", "--port", "70000"]) == 1
    assert cli.main(["serve", "--max-body-bytes", "5"]) == 1
    assert cli.main(["serve", "--body-timeout", "0"]) == 1
    assert cli.main(["serve", "--max-connections", "0"]) == 1
    assert cli.main(["serve", "--api-key-file", "/nonexistent/key"]) == 1
    assert cli.main(["serve", "--api-key", "k", "--api-key-file", "f"]) == 2     # one or the other


def test_api_key_sources(tmp_path, monkeypatch):
    from corelm.entrypoints.cli import build_parser
    from corelm.entrypoints.cli.serve import api_key_of
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("CORELM_API_KEY", "from-env")
    assert api_key_of(build_parser().parse_args(["serve", "--api-key-file", str(key_file)])) == "from-file"
    assert api_key_of(build_parser().parse_args(["serve", "--api-key", "given"])) == "given"
    assert api_key_of(build_parser().parse_args(["serve"])) == "from-env"
    monkeypatch.delenv("CORELM_API_KEY")
    assert api_key_of(build_parser().parse_args(["serve"])) is None
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        api_key_of(build_parser().parse_args(["serve", "--api-key-file", str(key_file)]))


# --- the server and batch files: one vocabulary (corelm.openai) -------------------------------------

from corelm.entrypoints.batch import BatchLineError, parse_line  # noqa: E402
from corelm.entrypoints.batch.worker import BatchWorker  # noqa: E402
from corelm.openai import served_model_name  # noqa: E402


class RecordingEngine(WrappedEngine):
    """Records the (prompt ids, SamplingParams) of every request handed to the engine."""

    def __init__(self, llm):
        super().__init__(llm)
        self.seen = []

    def add_request(self, request_id, prompt, params):
        self.seen.append((list(prompt), params))
        return self.inner.add_request(request_id, prompt, params)


@contextlib.contextmanager
def engine_server(make_engine, load_llm, **kwargs):
    """A running, ready server whose engine is make_engine(llm) (a wrapper recording or slowing it)."""
    original = server_app.make_engine
    server_app.make_engine = make_engine
    try:
        with running_server(load_llm, **kwargs) as s:
            assert s.state.wait_ready(30)
            yield s
    finally:
        server_app.make_engine = original


@pytest.fixture(scope="module")
def recording_server():
    served = stories()
    with engine_server(RecordingEngine, lambda: served) as s:
        yield s


@pytest.fixture(scope="module")
def batch_worker():
    """A batch worker in this process, on the same model and context as the server's."""
    worker = BatchWorker(os.path.join(MODELS, "stories260K"), 2, {"dtype": "fp32", "max_seq_len": 256})
    worker.engine = RecordingEngine(types.SimpleNamespace(engine=worker.engine))
    return worker


def batch_answer(worker, url, body):
    """(output line, None) for a line with this body, or (None, (code, message)) for its error."""
    try:
        req = parse_line(json.dumps({"custom_id": "x", "method": "POST", "url": url, "body": body}))
    except BatchLineError as e:
        return None, (e.code, e.message)
    [(line, _)] = worker.run_task([req])
    return (line, None) if line["error"] is None else (None, (line["error"]["code"], line["error"]["message"]))


STOP = "upon"
SAME_BODIES = [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.8, "top_p": 0.9,
                         "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                         "frequency_penalty": 0.2, "seed": 5, "n": 2, "stop_token_ids": [3], "ignore_eos": True,
                         "min_tokens": 2, "logprobs": 2, "skip_special_tokens": False}),
    ("/v1/completions", {"prompt": [[1, 403], [1, 403, 407]], "max_tokens": 4, "temperature": 0, "stop": " a",
                         "include_stop_str_in_output": True}),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                              "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3, "temperature": 0.7,
                              "seed": 1, "n": 3, "skip_special_tokens": False,
                              "include_stop_str_in_output": True, "stop": [STOP]}),
]


@pytest.mark.parametrize("url,body", SAME_BODIES)
def test_server_and_batch_hand_the_engine_the_same_request(recording_server, batch_worker, url, body):
    """The same body through both front ends: the same prompt ids and SamplingParams reach the engine
    (every field honoured, skip_special_tokens and include_stop_str_in_output included), and the same
    choices, logprobs and usage come back."""
    recording_server.state.engine.seen.clear()
    batch_worker.engine.seen.clear()
    r = post(recording_server, url, body, key=None)
    assert r.status_code == 200, r.text
    line, err = batch_answer(batch_worker, url, body)
    assert err is None
    assert batch_worker.engine.seen == recording_server.state.engine.seen
    params = batch_worker.engine.seen[0][1]
    for name in ("skip_special_tokens", "include_stop_str_in_output"):   # the fields batch used to drop
        assert getattr(params, name) == body.get(name, getattr(SamplingParams(), name))
    served, batched = r.json(), line["response"]["body"]
    assert batched["choices"] == served["choices"] and batched["usage"] == served["usage"]
    assert batched["object"] == served["object"]


def test_batch_keeps_the_stop_string_when_asked(batch_worker):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stop": [" a"]}
    line, _ = batch_answer(batch_worker, "/v1/completions", body)
    without = line["response"]["body"]["choices"][0]
    line, _ = batch_answer(batch_worker, "/v1/completions", dict(body, include_stop_str_in_output=True))
    kept = line["response"]["body"]["choices"][0]
    assert without["finish_reason"] == kept["finish_reason"] == "stop"
    assert kept["text"] == without["text"] + " a"


@pytest.mark.parametrize("url,body", [
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}),
    ("/v1/completions", {"prompt": [1, 2], "suffix": "x"}),          # suffix needs a text prompt
    ("/v1/completions", {"prompt": "x", "suffix": SECRET}),
    ("/v1/completions", {"prompt": "x", "best_of": 3}),
    ("/v1/completions", {"prompt": "x", "n": 17}),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 9}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "temperature": SECRET}),
    ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}),
    ("/v1/completions", {"prompt": "x", "stop": [""]}),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}),
    ("/v1/completions", {"prompt": [1, 10**6]}),
    ("/v1/completions", {"prompt": SECRET * 200}),
    ("/v1/completions", {"max_tokens": 5}),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 100_000}),
    ("/v1/completions", {"prompt": "x", "stop": ["s" * 257]}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 300}),
    ("/v1/completions", {"prompt": [[1], "a"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 300}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET * 300}]}),
])
def test_server_and_batch_refuse_alike(recording_server, batch_worker, url, body):
    """Each refusal has the same message in both; the code is the server's, or "invalid_request" in a
    batch line where the server's code is only the HTTP status."""
    err = assert_error(post(recording_server, url, body, key=None), 400)
    line, batch_err = batch_answer(batch_worker, url, body)
    assert line is None
    assert batch_err == (err["code"] if isinstance(err["code"], str) else "invalid_request", err["message"])


def test_one_served_model_name(tmp_path):
    """`corelm serve` and `corelm batch` name a model alike: its file or folder name without .gguf."""
    from corelm.entrypoints.cli import serve   # names the served model with served_model_name
    assert serve.served_model_name is served_model_name
    gguf = os.path.join(MODELS, "stories260K", "stories260K.gguf")
    assert served_model_name(gguf) == "stories260K"
    worker = BatchWorker(gguf, 1, {"dtype": "fp32"})
    line, _ = batch_answer(worker, "/v1/completions", {"prompt": "Once", "max_tokens": 2})
    assert line["response"]["body"]["model"] == "stories260K"
