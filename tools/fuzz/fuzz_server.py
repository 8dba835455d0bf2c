"""The `server` target of fuzz.py: seeded hostile clients against a running `corelm serve`.

    python tools/fuzz/fuzz.py --target server --seconds 120 --seed 1

The server (the committed stories260K test model) runs in a subprocess with short timeouts (1 s for
headers, 1 s for bodies) and a small per-client connection cap. Rounds of concurrent clients each do
one thing: stay idle, send headers a line at a time (slowloris), stop inside the headers or the body,
send random bytes, send a mutated valid request, send a valid one, or hang up early. After each round
/health and a completion must answer. Outcomes per client: ok (a 2xx answer), refused (a 4xx or 503
answer, or the server closed the connection); failures: foreign (a 5xx answer other than 503, or a
traceback or ERROR line in the server's log), hang (the server neither answered nor closed within its
timeouts, or missed a probe), crash (the server exited).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import select
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
PER_CLIENT = 24
ROUND = 32                      # clients at once (more than PER_CLIENT: the cap is exercised too)
SLACK = 3.0                     # seconds past the server's own timeouts before a connection counts as held

ACTIONS = ("idle", "slow_headers", "partial_headers", "partial_body", "garbage", "mutated", "valid", "early_close")
_BODIES = [("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 2}),
           ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
           ("POST", "/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                                     "stream": True}),
           ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                                            "text": "Hi"}]}]}),
           ("POST", "/tokenize", {"prompt": "Once upon a time"}),
           ("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/", None), ("GET", "/metrics", None)]


def _request(rng: random.Random, close: bool = True) -> bytes:
    method, path, body = rng.choice(_BODIES)
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    if close:
        head += "Connection: close\r\n"
    return (head + "\r\n").encode() + data


def _read(sock: socket.socket, deadline: float) -> Dict[str, Any]:
    """What the server sent until it closed the connection, or until `deadline`."""
    data = bytearray()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], max(0.0, min(0.2, deadline - time.monotonic())))
        if not ready:
            continue
        try:
            part = sock.recv(65536)
        except OSError:
            part = b""
        if not part:
            return {"data": bytes(data), "closed": True}
        data += part
    return {"data": bytes(data), "closed": False}


def _outcome(got: Dict[str, Any]) -> Dict[str, Any]:
    data = got["data"]
    if data.startswith(b"HTTP/1.1 "):
        try:
            status = int(data[9:12])
        except ValueError:
            return {"status": "foreign", "error": f"a malformed status line: {data[:60]!r}"}
        if 500 <= status and status != 503:
            return {"status": "foreign", "error": f"answered {status}: {data[:300]!r}"}
        return {"status": "ok" if status < 300 else "refused"}
    if data:
        return {"status": "foreign", "error": f"answered something that is not HTTP: {data[:60]!r}"}
    if got["closed"]:
        return {"status": "refused"}
    return {"status": "hang", "error": "the server neither answered nor closed the connection within its timeouts"}


def run_client(kind: str, seed: str, port: int, mutate) -> Dict[str, Any]:
    """One hostile client; returns its outcome and what it sent."""
    rng = random.Random(seed)
    sent = bytearray()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError as e:
        return {"status": "refused", "error": f"connect: {e}", "sent": b""}
    # any answer comes within the server's timeouts (a valid request also generates 2 tokens)
    deadline_after = HEADER_TIMEOUT + BODY_TIMEOUT + SLACK

    def send(data: bytes) -> bool:
        try:
            sock.sendall(data)
        except OSError:
            return False
        sent.extend(data)
        return True
    try:
        if kind == "idle":
            pass
        elif kind == "slow_headers":
            send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            t0 = time.monotonic()
            while time.monotonic() - t0 < HEADER_TIMEOUT + SLACK:
                ready, _, _ = select.select([sock], [], [], rng.uniform(0.05, 0.4))
                if ready or not send(f"X-{rng.randrange(1000)}: {rng.randrange(1000)}\r\n".encode()):
                    break
        elif kind == "partial_headers":
            req = _request(rng)
            send(req[:rng.randrange(1, req.index(b"\r\n\r\n") + 2)])
        elif kind == "partial_body":
            req = _request(random.Random(seed + "p"))
            while b"Content-Length" not in req:
                req = _request(rng)
            cut = req.index(b"\r\n\r\n") + 4
            send(req[:cut + rng.randrange(0, len(req) - cut)])
        elif kind == "garbage":
            junk = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 2048)))
            if rng.random() < 0.5:
                junk += b"\r\n\r\n"
            send(junk)
        elif kind == "mutated":
            send(mutate(_request(rng, close=rng.random() < 0.8), rng))
        elif kind == "valid":
            send(_request(rng))
        elif kind == "early_close":
            req = _request(rng)
            send(req[:rng.randrange(0, len(req))])
            return {"status": "refused", "sent": bytes(sent)}
        got = _read(sock, time.monotonic() + deadline_after)
        out = _outcome(got)
        if kind == "mutated" and out["status"] == "hang":
            out = {"status": "refused"}      # a mutant may still be waiting for its body: nothing was promised
        return dict(out, sent=bytes(sent))
    finally:
        sock.close()


def _probe(port: int) -> Optional[str]:
    """None when /health and a completion answer in time, else what went wrong."""
    import http.client
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        if r.status != 200:
            return f"/health answered {r.status}"
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": "Once", "max_tokens": 2}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        c.close()
        return None if r.status == 200 else f"a completion answered {r.status}"
    except OSError as e:
        return f"no answer: {type(e).__name__}: {e}"


def start_server(model: str, log_path: str, pythonpath: str = ""):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "corelm.entrypoints.cli", "serve", model, "--port", str(port),
                             "--dtype", "fp32", "-t", "1", "--ctx-size", "256", "--log-level", "warning",
                             "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                             "--max-connections", "128", "--max-connections-per-client", str(PER_CLIENT)],
                            stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1",
                                     PYTHONPATH=os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")]))))
    deadline = time.monotonic() + 120
    while _probe(port) is not None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"corelm serve did not start: {open(log_path, 'rb').read()[-2000:]!r}")
        time.sleep(0.2)
    return proc, port


def fuzz_server(seconds: float, seed: int, failures_dir: str, repo: str, mutate, verbose: bool = True,
                max_inputs: Optional[int] = None, pythonpath: str = "") -> Dict[str, Any]:
    counts = {k: 0 for k in ("ok", "refused", "crash", "hang", "foreign")}
    found: List[Dict[str, Any]] = []
    rng = random.Random(f"server:{seed}")
    log_path = tempfile.mktemp(prefix="corelm-fuzz-server-")
    model = os.path.join(repo, "tests", "data", "models", "stories260K")

    def fail(status: str, error: str, sent: bytes = b"", where: str = "") -> None:
        counts[status] += 1
        dest = os.path.join(failures_dir, f"{status}-{len(found):06d}")
        os.makedirs(dest, exist_ok=True)
        with open(os.path.join(dest, "input"), "wb") as f:
            f.write(sent)
        with open(os.path.join(dest, "what.json"), "w") as f:
            json.dump({"status": status, "error": error, "target": "server", "seed": seed}, f, indent=2)
        found.append({"status": status, "error": error, "where": where, "input": dest})
        if verbose:
            print(f"[server] {status}: {error} (saved to {dest})", flush=True)

    proc, port = start_server(model, log_path, pythonpath)
    t0 = time.monotonic()
    n = 0
    try:
        with concurrent.futures.ThreadPoolExecutor(ROUND) as pool:
            while time.monotonic() - t0 < seconds and (max_inputs is None or n < max_inputs):
                kinds = [(rng.choice(ACTIONS), f"{seed}:{n + i}") for i in range(ROUND)]
                n += ROUND
                for r in pool.map(lambda k: run_client(k[0], k[1], port, mutate), kinds):
                    if r["status"] in ("ok", "refused"):
                        counts[r["status"]] += 1
                    else:
                        fail(r["status"], r.get("error", ""), r.get("sent", b""))
                if proc.poll() is not None:
                    fail("crash", f"corelm serve exited with status {proc.returncode}")
                    break
                problem = _probe(port)
                if problem is not None:
                    fail("hang", f"after a round of clients: {problem}")
                    break
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with open(log_path, "rb") as f:
            log = f.read().decode("utf-8", "replace")
        os.remove(log_path)
    bad = [line for line in log.splitlines() if "Traceback" in line or line.startswith("ERROR")]
    if bad:
        fail("foreign", f"the server logged {bad[0]!r}", where=log[-3000:])
    elapsed = time.monotonic() - t0
    if verbose:
        print(f"server: {n} clients in {elapsed:.1f} s: " + ", ".join(f"{k} {v}" for k, v in counts.items()),
              flush=True)
    return {"target": "server", "inputs": n, "seconds": round(elapsed, 1), "counts": counts, "failures": found,
            "seed_problems": []}
