"""A model whose forward pass overflows float32 (NaN or infinite logits) gives an error naming the cause,
never a made-up answer. Issue 50: stories260K with blk.4.ffn_norm.weight[0] = 1e38 (a finite float32, so
the loader takes it) answered "" with token [0] and finish_reason "stop", silently."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import MODELS, ROOT, child_env

from corelm import LLM, SamplingParams
from corelm.engine.llm_engine import LLMEngine
from corelm.engine.sequence import GenerationError
from corelm.loader.gguf import read_gguf

STORIES_GGUF = os.path.join(MODELS, "stories260K", "stories260K.gguf")
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def overflowing_gguf(tmp_path_factory):
    """stories260K with one norm weight of the last layer set to 1e38."""
    path = str(tmp_path_factory.mktemp("nonfinite") / "stories260K-1e38.gguf")
    shutil.copyfile(STORIES_GGUF, path)
    info = read_gguf(STORIES_GGUF).tensors["blk.4.ffn_norm.weight"]
    assert info.type_name == "F32"
    with open(path, "r+b") as f:
        f.seek(info.offset)
        f.write(np.float32(1e38).tobytes())
    return path


@pytest.fixture(scope="module")
def llm(overflowing_gguf):
    return LLM(overflowing_gguf, threads=1)


def test_the_engine_ends_the_request_with_an_error_chunk(overflowing_gguf):
    engine = LLMEngine(overflowing_gguf, threads=1)
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=8, temperature=0.8, seed=1, n=2))
    chunks = engine.run_to_completion()["a"]
    assert len(chunks) == 2 and {c.index for c in chunks} == {0, 1}
    for c in chunks:
        assert c.finish_reason == "error" and c.token_id is None and c.text == ""
        assert "non-finite logits" in c.error and "NaN" in c.error
    assert not engine.has_unfinished_requests()


def test_generate_chat_and_stream_raise_instead_of_answering(llm):
    with pytest.raises(GenerationError, match="non-finite logits"):
        llm.generate("Once upon a time", GREEDY)
    with pytest.raises(GenerationError, match="prompt 0: the model produced non-finite logits"):
        llm.generate(["Once", "Once upon a time"], GREEDY)
    with pytest.raises(GenerationError, match="non-finite logits"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    with pytest.raises(GenerationError, match="non-finite logits"):
        list(llm.stream("Once upon a time", GREEDY))
    assert not llm.engine.has_unfinished_requests()


def test_the_healthy_model_is_unaffected():
    out = LLM(STORIES_GGUF, threads=1).generate("Once upon a time", GREEDY)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8 and out.text


def test_the_server_answers_500_with_the_cause(llm):
    fastapi = pytest.importorskip("fastapi")  # noqa: F841
    from starlette.testclient import TestClient
    from corelm.entrypoints.server import create_app
    app = create_app(lambda: llm, "stories260K-1e38")
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert app.state.corelm.wait_ready(30)
        for stream in (False, True):
            r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4,
                                                     "temperature": 0, "stream": stream})
            if not stream:
                assert r.status_code == 500, r.text
                body = r.json()
            else:                       # the stream has begun (200): an error event ends it
                events = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
                body = events[-1]
                assert not any(c.get("text") for e in events for c in e.get("choices", ())), events
            assert "non-finite logits" in body["error"]["message"], body
            assert body["error"]["type"] == "server_error"


def test_the_cli_prints_the_error(overflowing_gguf):
    r = subprocess.run([sys.executable, "-m", "corelm.entrypoints.cli", "generate", overflowing_gguf,
                        "-p", "Once upon a time", "-n", "4", "--temp", "0", "-t", "1"],
                       capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "error: the model produced non-finite logits" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_batch_line_gets_an_error_with_the_cause(overflowing_gguf):
    from corelm.entrypoints.batch.protocol import parse_line
    from corelm.entrypoints.batch.worker import BatchWorker
    worker = BatchWorker(overflowing_gguf, threads=1)
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": ["Once", "Once upon"], "max_tokens": 4, "temperature": 0}})
    (rec, tokens), = worker.run_task([parse_line(line)])
    assert rec["custom_id"] == "a" and rec["response"] is None and tokens == 0
    assert rec["error"]["code"] == "server_error" and "non-finite logits" in rec["error"]["message"]
    left = []                   # at most the other prompt's abort, which finds nothing left to stop
    while worker.engine.has_unfinished_requests():
        left += worker.engine.step()
    assert left == []
