"""`corelm serve --data-parallel-size N` (corelm.entrypoints.server.replicas): N engine processes behind one
server. Driven by the official `openai` client and httpx over loopback: concurrent clients, answers equal
to the one-engine server's, prefix routing seen in /metrics, and a killed replica (its requests fail with
a 503, /health says degraded, it restarts; past --replica-restarts the server exits 1)."""
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import MODELS  # noqa: E402

import corelm  # noqa: E402
from corelm import SamplingParams  # noqa: E402
from corelm.entrypoints.server import create_app, uvicorn_config  # noqa: E402
from corelm.entrypoints.server.replicas import (PrefixRouter, block_hashes, chunk_from_wire,  # noqa: E402
                                                chunk_to_wire, params_from_wire, params_to_wire)

STORIES = os.path.join(MODELS, "stories260K")
# Two prompts of several KV blocks (16 tokens) that share nothing, and suffixes to extend them.
LONG_A = "Once upon a time there was a little girl named Lily. She loved to play outside in the park with her mom."
LONG_B = "Tom had a big red ball. He liked to throw it high in the sky and catch it with his friend Sam every day."
LONG_C = "One day a small bird flew into the garden. It sang a happy song and all the flowers began to dance."


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env():
    here = os.path.dirname(os.path.dirname(os.path.abspath(corelm.__file__)))
    return dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))


def start_serve(*flags, log=None):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "corelm.entrypoints.cli", "serve", STORIES, "--port", str(port),
                             "--dtype", "fp32", "-t", "1", "-c", "256", "--log-level", "warning", *flags],
                            env=_env(), stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT if log else
                            subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc, url, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "corelm serve exited"
        assert time.monotonic() < deadline, "corelm serve did not become healthy"
        try:
            r = httpx.get(url + "/health", timeout=1)
            if r.status_code == 200 and r.json()["status"] == "ok":
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        proc.wait(15)


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    log = open(tmp_path_factory.mktemp("dp") / "serve.log", "w+")
    proc, url = start_serve("--data-parallel-size", "2", log=log)
    try:
        health = wait_healthy(proc, url)
        assert health["replicas"] == [{"replica": 0, "status": "ready"}, {"replica": 1, "status": "ready"}]
        yield url
    finally:
        stop(proc)
        log.close()


@pytest.fixture(scope="module")
def dp_client(dp_server):
    return openai.OpenAI(base_url=dp_server + "/v1", api_key="none", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def single_client():
    """The one-engine server (in this process), on the same model, context and thread count as a replica."""
    llm = corelm.LLM(STORIES, dtype="fp32", threads=1, max_seq_len=256)
    app = create_app(lambda: llm, "stories260K")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    assert app.state.corelm.wait_ready(30)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="none", max_retries=0,
                            timeout=30)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def replica_metrics(url):
    """{metric name: {replica: value}} of the corelm_replica_* samples, and {replica: pid}."""
    out, pids = {}, {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        m = re.match(r'corelm_(replica_\w+)\{replica="(\d+)"([^}]*)\} (\S+)$', line)
        if m:
            out.setdefault(m.group(1), {})[int(m.group(2))] = float(m.group(4))
            pid = re.search(r'pid="(\d+)"', m.group(3))
            if pid:
                pids[int(m.group(2))] = int(pid.group(1))
    return out, pids


def complete(client, prompt, **kw):
    return client.completions.create(model="m", prompt=prompt, max_tokens=kw.pop("max_tokens", 12), temperature=0,
                                     **kw)


# --- serving ----------------------------------------------------------------------------------------

def test_concurrent_clients_get_the_single_engine_answers(dp_server, dp_client, single_client):
    """8 clients at once (completions streamed and not, chats) across both replicas; every greedy answer is
    the one-engine server's."""
    before, _ = replica_metrics(dp_server)
    jobs = [("completion", p) for p in ["Once upon a time", "The dog", "Tom had a", "Lily saw"]] + \
           [("stream", p) for p in ["One day", "The sun"]] + [("chat", p) for p in ["Tell me a story", "Hi"]]

    def ask(client, kind, p):
        if kind == "completion":
            return complete(client, p).choices[0].text
        if kind == "stream":
            return "".join(c.choices[0].text for c in complete(client, p, stream=True))
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": p}], max_tokens=12,
                                             temperature=0)
        return out.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: ask(dp_client, *job), jobs, timeout=60))
    want = [ask(single_client, *job) for job in jobs]
    assert got == want and all(got)
    after, _ = replica_metrics(dp_server)
    routed = {r: after["replica_requests_total"][r] - before["replica_requests_total"].get(r, 0) for r in (0, 1)}
    assert sum(routed.values()) == len(jobs) and min(routed.values()) > 0, routed   # both replicas served
    assert after["replica_load"] == {0: 0, 1: 0}


def test_multi_prompt_requests_and_n(dp_client, single_client):
    """A request of several prompts (each routed on its own) and n choices come back whole and in order."""
    prompts = ["The dog", "Tom had a", "One day"]
    out = dp_client.completions.create(model="m", prompt=prompts, max_tokens=8, temperature=0)
    ref = single_client.completions.create(model="m", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in out.choices] == [c.text for c in ref.choices]
    assert [c.index for c in out.choices] == [0, 1, 2]
    out = dp_client.completions.create(model="m", prompt=[1, 40, 41, 42], max_tokens=6, n=3, temperature=1.0, seed=7,
                                       logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2] and out.usage.completion_tokens == 18
    assert all(len(c.logprobs.tokens) == 6 for c in out.choices)


def test_bad_requests_are_refused_by_the_server_process(dp_server):
    """Validation happens before routing, with the one-engine server's answers."""
    r = httpx.post(dp_server + "/v1/completions", json={"prompt": "x " * 400, "max_tokens": 4}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(dp_server + "/v1/completions", json={"prompt": [1, 2, 10 ** 6]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(dp_server + "/v1/completions", json={"prompt": "Hi", "temperature": -1}, timeout=10)
    assert r.status_code == 400


@contextlib.contextmanager
def paused(url):
    """Both replicas stopped (SIGSTOP): requests sent meanwhile are routed and queued, not run."""
    _, pids = replica_metrics(url)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def wait_load(url, total, timeout=10):
    """The replicas' loads once `total` choices are routed."""
    deadline = time.monotonic() + timeout
    while True:
        loads = replica_metrics(url)[0]["replica_load"]
        if sum(loads.values()) >= total:
            return loads
        assert time.monotonic() < deadline, loads
        time.sleep(0.01)


def test_a_shared_prefix_stays_on_one_replica(dp_server, dp_client):
    """Two unrelated prompts sent at once land on different replicas (by load); then every request that
    shares one's leading KV blocks goes where it went (corelm_replica_prefix_routed_total)."""
    def counts():
        m = replica_metrics(dp_server)[0]
        return m["replica_requests_total"], m["replica_prefix_routed_total"]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with paused(dp_server):
            first = pool.submit(complete, dp_client, LONG_A, max_tokens=4)
            assert sum(wait_load(dp_server, 1).values()) == 1
            a = max(replica_metrics(dp_server)[0]["replica_load"].items(), key=lambda kv: kv[1])[0]
            second = pool.submit(complete, dp_client, LONG_B, max_tokens=4)
            assert wait_load(dp_server, 2) == {0: 1, 1: 1}          # B went to the other one
        first.result(30), second.result(30)
    req0, pre0 = counts()
    for suffix in [" Lily", " One day she", " The end", " Her mom said"]:
        complete(dp_client, LONG_A + suffix, max_tokens=4)
    for suffix in [" Sam", " Then"]:
        complete(dp_client, LONG_B + suffix, max_tokens=4)
    req, pre = counts()
    assert {r: req[r] - req0[r] for r in (0, 1)} == {a: 4, 1 - a: 2}
    assert {r: pre[r] - pre0[r] for r in (0, 1)} == {a: 4, 1 - a: 2}


def test_router_rules():
    hashes = block_hashes(list(range(64)), 16)
    assert len(hashes) == 4 and block_hashes(list(range(40)), 16) == hashes[:2]
    inc = {0: 1, 1: 1}

    def served_by_1():                   # a router that sent these 4 blocks to replica 1
        r = PrefixRouter(slack=4)
        assert r.choose(hashes, 64, 16, {0: 0, 1: 0}, {0: 5, 1: 3}, inc) == (1, False)   # a tie: fewer routed
        return r
    assert served_by_1().choose(hashes, 70, 16, {0: 0, 1: 4}, {}, inc) == (1, True)   # mostly cached, in the slack
    assert served_by_1().choose(hashes, 70, 16, {0: 0, 1: 5}, {}, inc) == (0, False)  # overloaded: least loaded
    assert served_by_1().choose(hashes[:1], 200, 16, {0: 0, 1: 1}, {}, inc) == (0, False)  # a short match: by load
    assert served_by_1().choose(hashes[:1], 200, 16, {0: 2, 1: 2}, {}, inc) == (1, True)   # unless as idle
    assert served_by_1().choose(hashes, 64, 16, {0: 0, 1: 0}, {}, {0: 1, 1: 2}) == (0, False)  # 1 restarted since
    assert served_by_1().choose(hashes, 64, 16, {0: 0}, {}, inc) == (0, False)      # only ready replicas count
    r = served_by_1()
    r.choose(hashes[:2], 40, 16, {0: 0, 1: 9}, {}, inc)        # the first 2 blocks move to replica 0
    assert r.choose(hashes, 64, 16, {0: 0, 1: 0}, {0: 9}, inc) == (1, True)   # the longest match wins
    small = PrefixRouter(size=3)
    small.choose(hashes, 64, 16, {0: 0, 1: 0}, {}, inc)
    assert len(small.owner) == 3 and hashes[0] not in small.owner


def test_wire_format_is_plain_json():
    from corelm.engine.sequence import StreamChunk
    p = SamplingParams(temperature=0.5, top_k=3, stop=["x"], logit_bias={5: -1.5}, seed=3, n=2,
                       structured_outputs={"choice": ["yes", "no"]}, logprobs=2)
    wire = json.loads(json.dumps(params_to_wire(p)))
    back = params_from_wire(wire)
    assert back == p and back.structured_outputs.choice == ["yes", "no"] and back.logit_bias == {5: -1.5}
    c = StreamChunk("hi\ud800", 7, "stop", "x", -0.25, [[7, -0.25]], 1, 1, None)
    rid, back = chunk_from_wire(json.loads(json.dumps(chunk_to_wire("r-0", c))))
    assert rid == "r-0" and back == c


def finished(url, reason):
    m = re.search(rf'corelm_requests_finished_total{{finish_reason="{reason}"}} (\d+)', httpx.get(url + "/metrics").text)
    return int(m.group(1)) if m else 0


def test_a_client_that_leaves_has_its_request_aborted_on_the_replica(dp_server):
    """The abort crosses to the replica: its "abort" chunk comes back and its load drops to 0."""
    aborted = finished(dp_server, "abort")
    with paused(dp_server):                  # the request is still queued when the client leaves
        with httpx.stream("POST", dp_server + "/v1/completions", timeout=30,
                          json={"prompt": "The cat", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            wait_load(dp_server, 1)
    deadline = time.monotonic() + 10
    while finished(dp_server, "abort") == aborted or replica_metrics(dp_server)[0]["replica_load"] != {0: 0, 1: 0}:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.01)


# --- failures ---------------------------------------------------------------------------------------

def test_a_killed_replica_fails_its_requests_and_is_restarted(dp_server, dp_client):
    """Both replicas paused; a stream and a plain request share a prompt, so they land on one replica; it is
    killed: the stream ends with a replica_failed error event and [DONE], the other gets a 503, /health says
    degraded, the replica comes back (a new process) and answers again. The other replica is untouched."""
    events, plain = [], []
    body = {"prompt": LONG_C, "max_tokens": 8, "temperature": 0}

    def stream():
        with httpx.stream("POST", dp_server + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            events.append(r.status_code)
            events.extend(line for line in r.iter_lines() if line)

    def whole():
        plain.append(httpx.post(dp_server + "/v1/completions", json=body, timeout=30))
    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    with paused(dp_server) as pids:
        threads[0].start()
        wait_load(dp_server, 1)
        threads[1].start()
        loads = wait_load(dp_server, 2)
        victim = max(loads, key=loads.get)
        assert loads[victim] == 2            # the shared prompt put both on one replica
        os.kill(pids[victim], signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert events[0] == 200 and events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "replica_failed" and f"Replica {victim} stopped unexpectedly (killed by SIGKILL)" in \
        error["message"]
    assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "replica_failed"
    health = httpx.get(dp_server + "/health", timeout=5).json()
    assert health["status"] == "degraded" and health["replicas"][victim]["status"] in ("failed", "restarting")
    assert health["replicas"][1 - victim]["status"] == "ready"
    deadline = time.monotonic() + 30
    while httpx.get(dp_server + "/health", timeout=5).json()["status"] != "ok":
        assert time.monotonic() < deadline, "the replica did not come back"
        time.sleep(0.05)
    metrics, new_pids = replica_metrics(dp_server)
    assert new_pids[victim] != pids[victim] and new_pids[1 - victim] == pids[1 - victim]
    assert metrics["replica_restarts_total"] == {victim: 1, 1 - victim: 0}
    assert complete(dp_client, LONG_C, max_tokens=8).choices[0].finish_reason == "length"


def test_deaths_past_the_restart_budget_stop_the_server():
    """--replica-restarts 0: the first death stops the server with exit status 1 and says why."""
    proc, url = start_serve("--data-parallel-size", "2", "--replica-restarts", "0")
    try:
        wait_healthy(proc, url)
        _, pids = replica_metrics(url)
        os.kill(pids[1], signal.SIGKILL)
        assert proc.wait(30) == 1
        err = proc.stderr.read()
        assert "error: replica 1 died (killed by SIGKILL)" in err and "--replica-restarts 0" in err
        for pid in pids.values():               # the other replica went with it
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]:
                assert time.monotonic() < deadline, "a replica outlived the server"
                time.sleep(0.05)
    finally:
        stop(proc)


def test_a_replica_that_cannot_load_fails_the_start(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    proc = subprocess.run([sys.executable, "-m", "corelm.entrypoints.cli", "serve", str(bad), "--port",
                           str(_free_port()), "-dp", "2", "--log-level", "warning"], env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "error:" in proc.stderr


def test_flag_errors():
    from corelm.entrypoints import cli
    assert cli.main(["serve", "--data-parallel-size", "0"]) == 1
    assert cli.main(["serve", "-dp", "2", "--replica-restarts", "-1"]) == 1
    assert cli.main(["serve", "-dp", "2", "--tensor-parallel-size", "2"]) == 1
