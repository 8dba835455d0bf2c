"""`corelm serve --prefix-cache-dir DIR` across a restart: the second server reads the prompt's full KV blocks
from DIR (usage.prompt_tokens_details.cached_tokens covers them) and answers as the first did; and
`corelm batch --prefix-cache-dir` hands the directory to its workers."""
import glob
import json
import os
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import MODELS  # noqa: E402
from test_server import _env, _free_port, wait_healthy  # noqa: E402

STORIES = os.path.join(MODELS, "stories260K")
STORY = " ".join(["Once upon a time there was a little girl named Lily who loved to play in the park."] * 10)
BODY = {"model": "stories260K", "messages": [{"role": "user", "content": STORY}], "max_tokens": 8, "temperature": 0}


def block_files(directory):
    return glob.glob(os.path.join(str(directory), "*", "*", "*.kvb"))


def serve_once(directory):
    """Starts `corelm serve`, sends BODY, waits until the prompt's full blocks are on disk, stops the server."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "corelm.entrypoints.cli", "serve", STORIES, "--port", str(port),
                             "--dtype", "fp32", "-t", "1", "--log-level", "warning", "--prefix-cache-dir", str(directory),
                             "--prefix-cache-gb", "0.5"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        r = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        deadline = time.monotonic() + 30   # the blocks are written off the request path
        while len(block_files(directory)) < (body["usage"]["prompt_tokens"] - 1) // 16:
            assert time.monotonic() < deadline, "the prompt's blocks were not written"
            time.sleep(0.1)
        return body
    finally:
        proc.terminate()
        proc.wait(15)


def test_a_restarted_server_reads_the_prompt_from_the_disk_cache(tmp_path):
    first = serve_once(tmp_path)
    prompt_tokens = first["usage"]["prompt_tokens"]
    full = (prompt_tokens - 1) // 16 * 16
    assert prompt_tokens >= 100 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = serve_once(tmp_path)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == full
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_batch_workers_share_the_disk_cache(tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                    "body": BODY}) + "\n")
    cache = tmp_path / "cache"

    def batch(out):
        subprocess.run([sys.executable, "-m", "corelm.entrypoints.cli", "batch", STORIES, str(requests), "-o",
                        str(tmp_path / out), "--dtype", "fp32", "-t", "1", "--no-progress",
                        "--prefix-cache-dir", str(cache)], env=_env(), check=True, timeout=120)
        line = json.loads((tmp_path / out).read_text())
        return line["response"]["body"]

    first = batch("1.jsonl")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and block_files(cache)
    second = batch("2.jsonl")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"] == first["choices"]
