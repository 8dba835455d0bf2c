"""What serving several models from one server costs (`corelm serve --models-dir`, server/router.py): time to
first token of a request whose model is not loaded yet (the load) against one whose model is loaded, and decode
tok/s of one model alone against both models decoding at once (the one engine thread steps them in turn and
parks the idle engine's workers at every switch).

    python tools/bench/bench_router.py [--models /work/models/qwen2.5-coder-0.5b-instruct.gguf
                                                  /work/models/SmolLM2-135M-Instruct.Q4_1.gguf]
                                       [--rounds 3] [--threads N] [--max-tokens 64]

One server over a temporary folder of symlinks to the models; every request is a streamed completion of a
prompt that starts with a fresh number (so no prefix cache hit), greedy, ignore_eos. A round: both models
unloaded (POST /models/unload); for each model in turn (order alternated by round) a request that loads it,
then one to it loaded; after a settle pause, each model alone and both at once (their order rotated), each
request --max-tokens tokens. Decode tok/s of a stream: (tokens - 1) / (last token - first token). With both at
once, a step of each in turn would give each stream 1 / (1/alone_a + 1/alone_b) tok/s if switching cost
nothing; the report gives each round's together over that ideal (from the same round's alone figures) and the
switch's cost per step. Last, in this process, the second model's decode step plain against with its workers
parked before every step (the switch's own cost, without the server). Prints each measurement and the medians."""
import argparse
import http.client
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

DEFAULT_MODELS = ["/work/models/qwen2.5-coder-0.5b-instruct.gguf", "/work/models/SmolLM2-135M-Instruct.Q4_1.gguf"]
PROMPT = "Write a long story about a lighthouse keeper and the storm that changed the village."
_counter = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict, timeout: float = 600):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def stream(port: int, model: str, max_tokens: int) -> dict:
    """One streamed completion: seconds to the first token, decode tok/s after it, tokens."""
    body = {"model": model, "prompt": f"{next(_counter)}. {PROMPT}", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn, r = post(port, "/v1/completions", body)
    if r.status != 200:
        raise RuntimeError(f"{model}: HTTP {r.status}: {r.read()[:300]!r}")
    first = last = None
    tokens = None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("choices"):
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    assert tokens == max_tokens, f"{model}: {tokens} tokens"
    return {"ttft_s": first - t0, "decode_tok_s": (tokens - 1) / (last - first) if last > first else None}


def unload(port: int, model: str) -> None:
    conn, r = post(port, "/models/unload", {"model": model})
    r.read()
    conn.close()
    if r.status not in (200, 400):            # 400: it was not loaded
        raise RuntimeError(f"unload {model}: HTTP {r.status}")


def at_once(port: int, models, max_tokens: int) -> dict:
    out, start = {}, threading.Barrier(len(models))

    def go(m):
        start.wait()
        out[m] = stream(port, m, max_tokens)
    threads = [threading.Thread(target=go, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def park_cost(model: str, rounds: int, max_tokens: int, threads) -> dict:
    """Median decode step of one engine in this process, plain against with Model.park_threads() before every
    step (what the server's switch does to an engine), alternated by round: the park's cost alone."""
    import corelm
    llm = corelm.LLM(model, speculative_model=None, threads=threads)
    llm.wait_for_huge_pages(timeout=30)
    engine = llm.engine

    def decode(park: bool) -> float:
        engine.add_request(f"park-{next(_counter)}", PROMPT, corelm.SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                                  ignore_eos=True))
        steps = []
        while engine.has_unfinished_requests():
            if park:
                engine.core.park_threads()
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        return statistics.median(steps[1:])    # the prompt's step left out
    got = {False: [], True: []}
    for i in range(rounds):
        for park in ((False, True) if i % 2 == 0 else (True, False)):
            got[park].append(decode(park))
    return {k: statistics.median(v) for k, v in got.items()}


def wait_ready(port: int, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs=2, default=DEFAULT_MODELS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="idle seconds after the loads before decode is timed (the weights' move onto huge pages "
                        "runs when no forward has run for 100 ms)")
    args = p.parse_args()
    names = [os.path.basename(m)[:-5] for m in args.models]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="corelm-router-bench-") as d:
        for m in args.models:
            os.symlink(os.path.abspath(m), os.path.join(d, os.path.basename(m)))
        cmd = [sys.executable, "-m", "corelm.entrypoints.cli", "serve", "--models-dir", d, "--port", str(port),
               "--draft-model", "[none]"] + (["--threads", str(args.threads)] if args.threads else [])
        log = open(os.path.join(d, "server.log"), "w")
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(port, server)
            got = {k: [] for k in [f"ttft_load {n}" for n in names] + [f"ttft_loaded {n}" for n in names]
                   + [f"alone {n}" for n in names] + [f"together {n}" for n in names]}
            for i in range(args.rounds):
                order = names if i % 2 == 0 else names[::-1]
                for n in names:
                    unload(port, n)
                for n in order:
                    cold = stream(port, n, 1)["ttft_s"]
                    warm = stream(port, n, 1)["ttft_s"]
                    got[f"ttft_load {n}"].append(cold)
                    got[f"ttft_loaded {n}"].append(warm)
                    print(f"round {i}: {n}: ttft loading {cold:.3f} s, loaded {warm:.3f} s", flush=True)
                time.sleep(args.settle_s)
                runs = [("alone", [n]) for n in names] + [("together", names)]
                for kind, models in runs[i % 3:] + runs[:i % 3]:
                    for n, r in at_once(port, models, args.max_tokens).items():
                        got[f"{kind} {n}"].append(r["decode_tok_s"])
                        print(f"round {i}: {kind} {n}: decode {r['decode_tok_s']:.2f} tok/s", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"\nmedians of {args.rounds} rounds, {args.max_tokens} tokens a stream:")
    for n in names:
        print(f"{n}: ttft loading {med[f'ttft_load {n}']:.3f} s, loaded {med[f'ttft_loaded {n}']:.3f} s; decode "
              f"alone {med[f'alone {n}']:.2f} tok/s, both at once {med[f'together {n}']:.2f} tok/s")
    # each round against its own alone figures, so a neighbour's load swinging between rounds cancels out
    ratio, switch = [], []
    for i in range(args.rounds):
        alone_pair = sum(1 / got[f"alone {n}"][i] for n in names)        # seconds of a step of each, alone
        together_pair = 1 / statistics.mean(got[f"together {n}"][i] for n in names)
        ratio.append(alone_pair / together_pair)
        switch.append((together_pair - alone_pair) / 2)
    print(f"both at once against a free switch (a step of each at its alone speed), median of the rounds' ratios: "
          f"{statistics.median(ratio):.2f}x (rounds {', '.join(f'{r:.2f}' for r in ratio)}); "
          f"{statistics.median(switch) * 1e3:.2f} ms a switch")
    small = args.models[1]
    park = park_cost(small, args.rounds, args.max_tokens, args.threads)
    print(f"{names[1]} in-process decode step: {park[False] * 1e3:.2f} ms, parked before every step "
          f"{park[True] * 1e3:.2f} ms ({(park[True] - park[False]) * 1e3:+.2f} ms)")

if __name__ == "__main__":
    main()
