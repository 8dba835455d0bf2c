#!/usr/bin/env python3
"""Load test for `corelm serve`: N concurrent streaming clients send a bounded number of requests and
the tool reports throughput, time to first token and inter-token latency (p50/p99), and errors.

    python tools/bench/load_test.py                                   # starts `corelm serve` (embedded model)
    python tools/bench/load_test.py --clients 32 --requests 96 --max-tokens 32 --disconnect-fraction 0.25
    python tools/bench/load_test.py --url http://127.0.0.1:8000 --api-key KEY --endpoint completions

Every request streams with ignore_eos (so each asks for exactly --max-tokens tokens) and
stream_options.include_usage. With --disconnect-fraction F, that share of the requests closes its
connection after half of its tokens; the server must abort them, so after the run /metrics must
show no request waiting or running. Exit status 1 when any request failed or work was left over.
Needs httpx (in corelm's test extra).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

import httpx

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue in two sentences.",
    "List three tips for learning a new language.",
    "What is the capital of France, and what is it famous for?",
    "Describe a rainy day in a small village.",
    "Give me a recipe idea that uses tomatoes and basil.",
    "Summarize the plot of a detective novel you invent.",
    "How do plants make food from sunlight?",
]


def percentile(values: List[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Optional[str], threads: Optional[int], api_key: Optional[str]) -> (subprocess.Popen, str):
    port = free_port()
    cmd = [sys.executable, "-m", "corelm.entrypoints.cli", "serve"] + ([model] if model else []) + [
        "--port", str(port), "--log-level", "warning"]
    if threads:
        cmd += ["--threads", str(threads)]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("the server did not become healthy within 300 s")


class Stats:
    def __init__(self):
        self.ttft: List[float] = []
        self.itl: List[float] = []
        self.tokens = 0
        self.ok = 0
        self.disconnected = 0
        self.errors: Dict[str, int] = {}

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def one_request(client: httpx.AsyncClient, args, i: int, disconnect: bool, stats: Stats) -> None:
    chat = args.endpoint == "chat"
    prompt = PROMPTS[i % len(PROMPTS)]
    body = {"model": "corelm", "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
            "temperature": args.temperature, "seed": i, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    last = None
    pieces = 0
    done = False
    usage = None
    try:
        async with client.stream("POST", args.url + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                stats.error(f"http {r.status_code}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    stats.error("stream error")
                    return
                if obj.get("usage"):
                    usage = obj["usage"]
                for c in obj.get("choices", []):
                    text = c.get("delta", {}).get("content") if chat else c.get("text")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            stats.ttft.append(now - t0)
                        else:
                            stats.itl.append(now - last)
                        last = now
                        pieces += 1
                if disconnect and pieces >= max(1, args.max_tokens // 2):
                    stats.disconnected += 1
                    stats.tokens += pieces
                    return                      # leaving the block closes the connection
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        stats.error(type(e).__name__)
        return
    if not done:
        stats.error("no [DONE]")
        return
    stats.ok += 1
    stats.tokens += usage["completion_tokens"] if usage else pieces


async def run_load(args) -> Dict[str, object]:
    stats = Stats()
    counter = iter(range(args.requests))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)

    async def client_loop(client):
        for i in counter:
            disconnect = int((i + 1) * args.disconnect_fraction) > int(i * args.disconnect_fraction)
            await one_request(client, args, i, disconnect, stats)

    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
        wall = time.perf_counter() - t0
        leftover = await leftover_requests(client, args.url)
    return {
        "clients": args.clients, "requests": args.requests, "max_tokens": args.max_tokens,
        "disconnect_fraction": args.disconnect_fraction, "endpoint": args.endpoint,
        "ok": stats.ok, "disconnected": stats.disconnected, "errors": sum(stats.errors.values()),
        "error_kinds": stats.errors, "wall_s": round(wall, 2), "tokens": stats.tokens,
        "throughput_tok_s": round(stats.tokens / wall, 1), "requests_per_s": round(args.requests / wall, 2),
        "ttft_p50_ms": round(1e3 * percentile(stats.ttft, 50), 1),
        "ttft_p99_ms": round(1e3 * percentile(stats.ttft, 99), 1),
        "itl_p50_ms": round(1e3 * percentile(stats.itl, 50), 2),
        "itl_p99_ms": round(1e3 * percentile(stats.itl, 99), 2),
        "server_leftover": leftover,
    }


async def leftover_requests(client: httpx.AsyncClient, url: str, wait_s: float = 2.0) -> Dict[str, float]:
    """Waiting + running requests and aborts from /metrics, after giving aborts a moment to land."""
    deadline = time.monotonic() + wait_s
    while True:
        values = {}
        try:
            text = (await client.get(url + "/metrics")).text
        except httpx.HTTPError:
            return {"metrics": float("nan")}
        for line in text.splitlines():
            for name in ("corelm_requests_waiting", "corelm_requests_running"):
                if line.startswith(name + " "):
                    values[name[len("corelm_requests_"):]] = float(line.split()[-1])
            if line.startswith('corelm_requests_finished_total{finish_reason="abort"}'):
                values["aborted_total"] = float(line.split()[-1])
        if values.get("waiting", 0) + values.get("running", 0) == 0 or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.05)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start `corelm serve` on a free port)")
    p.add_argument("--model", default=None, help="MODEL for the started server (default: the embedded one)")
    p.add_argument("--threads", type=int, default=None, help="--threads for the started server")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--disconnect-fraction", type=float, default=0.0,
                   help="share of requests that disconnect after half their tokens (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if not 0.0 <= args.disconnect_fraction <= 1.0:
        p.error("--disconnect-fraction must be in [0, 1]")
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--clients, --requests and --max-tokens must be positive")
    proc = None
    if args.url is None:
        proc, args.url = start_server(args.model, args.threads, args.api_key)
    try:
        report = asyncio.run(run_load(args))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['clients']} clients, {report['requests']} requests x {report['max_tokens']} tokens "
              f"({report['endpoint']}), disconnect fraction {report['disconnect_fraction']}")
        print(f"  ok {report['ok']}, disconnected {report['disconnected']}, errors {report['errors']} "
              f"{report['error_kinds'] or ''}")
        print(f"  wall {report['wall_s']} s, {report['tokens']} tokens, {report['throughput_tok_s']} tok/s, "
              f"{report['requests_per_s']} req/s")
        print(f"  TTFT p50 {report['ttft_p50_ms']} ms, p99 {report['ttft_p99_ms']} ms")
        print(f"  ITL  p50 {report['itl_p50_ms']} ms, p99 {report['itl_p99_ms']} ms")
        print(f"  server after the run: {report['server_leftover']}")
    left = report["server_leftover"]
    bad = report["errors"] or left.get("waiting", 1) or left.get("running", 1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
