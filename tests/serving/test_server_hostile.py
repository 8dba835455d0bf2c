"""`corelm serve` against hostile or careless clients (issue 50): idle and slow-header connections and
one peer holding many connections (they are timed out and capped, and other clients keep getting
answers), a prompt too big for the context by its size alone (refused before tokenizing, while /health
answers), DNS rebinding and cross-site requests (Host check, application/json only, CORS for named
origins), constraints no output can satisfy (400), Ctrl-C during a stream (error event, [DONE], no
traceback, a prompt exit), and the server target of tools/fuzz/fuzz.py."""
import concurrent.futures
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import corelm  # noqa: E402
from conftest import EMBEDDED_MODELS, MODELS, tool_module  # noqa: E402
from corelm import SamplingParams  # noqa: E402
from corelm.entrypoints.server import app as server_app  # noqa: E402
from corelm.entrypoints.server import create_app, make_server, uvicorn_config  # noqa: E402
from test_server import WrappedEngine, _env, _free_port, assert_error, wait_healthy  # noqa: E402

SMOLLM2 = os.path.join(EMBEDDED_MODELS, "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def served():
    """One model for this file's servers (one at a time; no test generates with it directly)."""
    return corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=1, max_seq_len=256)


@contextlib.contextmanager
def serving(load_llm, app_kwargs=None, **config):
    """A server as `corelm serve` runs it (make_server, uvicorn_config), with this test's options."""
    app = create_app(load_llm, "stories260K", **(app_kwargs or {}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    server = make_server(uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=2, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        s = types.SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, state=app.state.corelm, server=server)
        assert s.state.wait_ready(30)
        yield s
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def complete(url, prompt="Once", **headers):
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=headers, timeout=20)


def drain(socks, deadline):
    """Reads every socket until the server closes it or `deadline`: {socket: (bytes, closed)}."""
    got = {s: bytearray() for s in socks}
    open_ = set(socks)
    while open_ and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_), [], [], max(0.0, min(0.2, deadline - time.monotonic())))
        for s in ready:
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                part = b""
            if part:
                got[s] += part
            else:
                open_.discard(s)
    return {s: (bytes(got[s]), s not in open_) for s in socks}


def connect_from(address, port):
    s = socket.socket()
    s.bind((address, 0))
    s.connect(("127.0.0.1", port))
    return s


# --- idle and slow connections ----------------------------------------------------------------------

def test_idle_connections_from_one_peer_do_not_lock_out_the_others(served):
    """256 sockets from one address (127.0.0.2) that send nothing: the per-client cap (32) answers 503 and
    closes the 224 beyond it at once, the header deadline closes the 32 it let in; meanwhile 16 clients
    from 127.0.0.1 all get answers. (Before: all 256 held for ever, and everyone else got a 503.)"""
    with serving(lambda: served, header_timeout=1.5, max_connections_per_client=32) as s:
        t0 = time.monotonic()
        idle = [connect_from("127.0.0.2", s.port) for _ in range(256)]
        try:
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(lambda i: complete(s.url, f"Once {i}").status_code, range(16)))
            assert answers == [200] * 16
            result = drain(idle, t0 + 6)
        finally:
            for sock in idle:
                sock.close()
        assert all(closed for _, closed in result.values()), "idle connections were left open"
        kinds = [data.split(b"\r\n", 1)[0] for data, _ in result.values()]
        assert kinds.count(b"HTTP/1.1 503 Service Unavailable") == 256 - 32
        assert kinds.count(b"") == 32          # timed out: they sent nothing, nothing is answered
        assert time.monotonic() - t0 < 6
        assert complete(s.url).status_code == 200


def test_slow_headers_are_timed_out(served):
    """A header line every 0.2 s (slowloris), a partial header after a keep-alive response, and a
    connection that sends nothing are all closed once the 1 s header deadline passes."""
    with serving(lambda: served, header_timeout=1.0) as s:
        slow = socket.create_connection(("127.0.0.1", s.port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        kept = socket.create_connection(("127.0.0.1", s.port))
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += kept.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        silent = socket.create_connection(("127.0.0.1", s.port))
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 3:
                ready, _, _ = select.select([slow], [], [], 0.2)
                if ready:
                    break
                try:
                    slow.sendall(b"X-Slow: 1\r\n")
                except OSError:          # closed between select and send
                    break
            result = drain([slow, kept, silent], t0 + 3)
        finally:
            for sock in (slow, kept, silent):
                sock.close()
        assert time.monotonic() - t0 < 2.5
        assert result[slow][1] and result[slow][0].startswith(b"HTTP/1.1 408")
        assert result[kept][1] and result[kept][0].startswith(b"HTTP/1.1 408")
        assert result[silent] == (b"", True)
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200


# --- oversized prompts --------------------------------------------------------------------------------

class CountingEngine(WrappedEngine):
    """Counts the prompts the server asks the engine to tokenize."""
    encoded = 0

    def encode_prompt(self, prompt):
        CountingEngine.encoded += 1
        return self.inner.encode_prompt(prompt)

    def encode_chat(self, *args, **kwargs):
        CountingEngine.encoded += 1
        return self.inner.encode_chat(*args, **kwargs)


def test_a_prompt_too_big_for_the_context_is_refused_before_tokenizing(served, monkeypatch):
    monkeypatch.setattr(server_app, "make_engine", CountingEngine)
    CountingEngine.encoded = 0
    huge = "Once upon a time there was a dog. " * (3_000_000 // 34)
    with serving(lambda: served, app_kwargs={"max_body_bytes": 8 << 20}) as s:
        limit = s.state.max_prompt_bytes
        assert 256 <= limit < 100_000          # 256 tokens of at most a few bytes each
        health = []
        stop = threading.Event()

        def poll():
            with httpx.Client(timeout=10) as c:
                while not stop.is_set():
                    t = time.monotonic()
                    assert c.get(s.url + "/health").status_code == 200
                    health.append(time.monotonic() - t)
                    time.sleep(0.01)
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            t0 = time.monotonic()
            r1 = httpx.post(s.url + "/v1/completions", json={"prompt": huge, "max_tokens": 2}, timeout=30)
            r2 = httpx.post(s.url + "/v1/chat/completions", timeout=30,
                            json={"messages": [{"role": "user", "content": huge}], "max_tokens": 2})
            refused_in = time.monotonic() - t0
        finally:
            stop.set()
            poller.join(15)
        assert assert_error(r1, 400, "prompt")["code"] == "context_length_exceeded"
        assert assert_error(r2, 400, "messages")["code"] == "context_length_exceeded"
        assert "bytes" in r1.json()["error"]["message"]
        assert CountingEngine.encoded == 0, "the oversized prompts were tokenized"
        assert refused_in < 2
        assert health and max(health) < 0.5, max(health)
        # under the byte cap the prompt is tokenized as before, and its token count decides
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "a " * (limit // 2 - 8), "max_tokens": 2},
                       timeout=30)
        assert assert_error(r, 400, "prompt")["code"] == "context_length_exceeded"
        assert "tokens" in r.json()["error"]["message"] and CountingEngine.encoded == 1
        assert complete(s.url).status_code == 200


# --- DNS rebinding, cross-site requests, CORS ------------------------------------------------------------

def test_host_header_content_type_and_cors(served):
    app_kwargs = {"allowed_hosts": ["corelm.test", "*.corelm.example"], "allowed_origins": ["https://app.example"]}
    with serving(lambda: served, app_kwargs=app_kwargs) as s:
        port = s.port
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example",
                     "corelm.example", "[::1", f"127.0.0.1:{port}x"):
            for r in (httpx.get(s.url + "/health", headers={"Host": host}),
                      httpx.get(s.url + "/", headers={"Host": host}),
                      complete(s.url, Host=host)):
                assert assert_error(r, 400)["code"] == "invalid_host", host
        for host in (f"127.0.0.1:{port}", "localhost", f"localhost:{port}", "api.localhost", f"[::1]:{port}",
                     "10.1.2.3", "corelm.test", "CORELM.TEST.", "a.corelm.example"):
            assert complete(s.url, Host=host).status_code == 200, host
        assert httpx.get(s.url + "/", headers={"Host": f"localhost:{port}"}).status_code == 200   # the web chat

        # a cross-site form or fetch can send these without a preflight: refused before anything runs
        for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x", None):
            headers = {"Content-Type": ctype} if ctype else {}
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
                r = httpx.post(s.url + path, content=b'{"prompt": "x", "messages": []}', headers=headers)
                assert assert_error(r, 415)["code"] == "unsupported_media_type", (path, ctype)
        r = httpx.post(s.url + "/v1/completions", content=json.dumps({"prompt": "Once", "max_tokens": 2}),
                       headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200

        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        r = httpx.options(s.url + "/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
        assert "access-control-allow-origin" not in r.headers
        r = httpx.options(s.url + "/v1/chat/completions", headers={"Origin": "https://app.example", **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = complete(s.url, Origin="https://app.example")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "access-control-allow-origin" not in complete(s.url, Origin="https://evil.example").headers
    with serving(lambda: served, app_kwargs={"allowed_hosts": ["*"]}) as s:     # any host; no CORS by default
        assert complete(s.url, Host="evil.example").status_code == 200
        r = httpx.options(s.url + "/v1/chat/completions", headers={"Origin": "https://app.example", **preflight})
        assert "access-control-allow-origin" not in r.headers


# --- constraints nothing satisfies ------------------------------------------------------------------------

UNSATISFIABLE = [("guided_grammar", "start: start"), ("guided_json", {"$ref": "#"}),
                 ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}})]


def test_unsatisfiable_constraints_are_400s(served):
    pytest.importorskip("llguidance")
    with serving(lambda: served) as s:
        for field, value in UNSATISFIABLE:
            for path, body in (("/v1/completions", {"prompt": "Once"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
                r = httpx.post(s.url + path, json={**body, field: value, "max_tokens": 4}, timeout=30)
                err = assert_error(r, 400, field)
                assert err["code"] == "unsatisfiable_constraint" and "never be satisfied" in err["message"]
        r = httpx.post(s.url + "/v1/completions", timeout=30,
                       json={"prompt": "Once", "max_tokens": 4, "guided_grammar": 'start: "yes" | "no"'})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")


def test_unsatisfiable_constraints_raise_in_the_python_api():
    pytest.importorskip("llguidance")
    from corelm.engine.guided import StructuredOutputsParams, UnsatisfiableConstraint
    llm = corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=1, max_seq_len=128)
    for so in (StructuredOutputsParams(grammar="start: start"), StructuredOutputsParams(json={"$ref": "#"}),
               StructuredOutputsParams(regex="[^\\s\\S]")):
        with pytest.raises(UnsatisfiableConstraint, match="never be satisfied"):
            llm.generate("Once", SamplingParams(max_tokens=4, structured_outputs=so))
    for so in (StructuredOutputsParams(grammar='start: "a" | ""'), StructuredOutputsParams(choice=["yes", "no"])):
        out = llm.generate("Once", SamplingParams(max_tokens=4, structured_outputs=so))[0].outputs[0].text
        assert out in ("a", "", "yes", "no")


# --- shutdown -----------------------------------------------------------------------------------------

class SlowEngine(WrappedEngine):
    def step(self):
        time.sleep(0.01)
        return super().step()


def test_shutdown_ends_open_streams_with_done(served, monkeypatch):
    """In process: the server stops while a stream and a whole-answer request run; both end at once."""
    monkeypatch.setattr(server_app, "make_engine", SlowEngine)
    body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    with serving(lambda: served) as s:
        lines, whole = [], {}

        def ask():
            whole["r"] = httpx.post(s.url + "/v1/completions", json=body, timeout=20)
        asker = threading.Thread(target=ask)
        with httpx.Client(timeout=20) as c, c.stream("POST", s.url + "/v1/completions",
                                                     json={**body, "stream": True}) as r:
            asker.start()
            deadline = time.monotonic() + 10
            while len(s.state.open_queues) < 2:      # both requests are generating
                assert time.monotonic() < deadline
                time.sleep(0.01)
            t0 = time.monotonic()
            s.server.should_exit = True
            lines = [line for line in r.iter_lines() if line]
        took = time.monotonic() - t0
        asker.join(10)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "server_shutdown"
    assert took < 1.5, took                      # 240 tokens at 10 ms a step would take 2.4 s
    assert assert_error(whole["r"], 503)["code"] == "server_shutdown"


def test_ctrl_c_during_a_stream_ends_it_cleanly():
    """`corelm serve` gets SIGINT while it streams: the client sees an error event and [DONE], the
    process exits within a few seconds, and prints no traceback."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "corelm.entrypoints.cli", "serve", SMOLLM2, "--port", str(port),
                             "-t", "1", "--log-level", "warning"], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 2000,
                "ignore_eos": True, "stream": True}
        lines, t0 = [], None
        with httpx.Client(timeout=20) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3 and t0 is None:    # once: a second Ctrl-C is uvicorn's force quit
                    t0 = time.monotonic()
                    proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err.decode("utf-8", "replace")
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "server_shutdown"
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert took < 4, took
    assert proc.returncode in (0, 130, -signal.SIGINT)


def test_serve_flag_errors():
    from corelm.entrypoints import cli
    assert cli.main(["serve", "--header-timeout", "0"]) == 1
    assert cli.main(["serve", "--max-connections-per-client", "0"]) == 1


# --- fuzzing ------------------------------------------------------------------------------------------

def test_server_fuzz_target_finds_nothing(tmp_path):
    """tools/fuzz/fuzz.py --target server, bounded: slow, idle, partial and garbage clients against a
    running `corelm serve` with short timeouts; the server must keep answering, close every connection
    within its timeouts, and never answer 500 or log a traceback."""
    fuzz = tool_module("fuzz")
    seconds = float(os.environ.get("CORELM_FUZZ_SECONDS", "25")) * 0.5
    r = fuzz.fuzz("server", seconds, seed=1, failures_dir=str(tmp_path / "failures"), verbose=False)
    assert r["counts"]["ok"] > 0 and r["counts"]["refused"] > 0, r
    assert r["inputs"] >= 100, r
    assert not r["failures"], "\n\n".join(f"{f['status']}: {f['error']}\n{f.get('where', '')}"
                                          for f in r["failures"][:5])
