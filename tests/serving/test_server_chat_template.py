"""The server with a hostile chat template: concurrent chat requests get a 400 quickly, and the server
still answers string-prompt completions afterwards (render threads are bounded and stop themselves)."""
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import corelm  # noqa: E402
from conftest import MODELS  # noqa: E402
from test_server import running_server  # noqa: E402

# runs until the 1 s deadline (attribute lookups and calls, no output); the second one until the op budget
SPIN = "{% for i in range(1000000) %}{% if messages[0].role.upper().lower() %}{% endif %}{% endfor %}"
LOOPS = "{% for a in messages * 1000000 %}{% for b in messages * 1000000 %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("template", [SPIN, LOOPS], ids=["deadline", "operations"])
def test_hostile_template_gets_400s_and_completions_still_answer(template):
    served = corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=2, max_seq_len=256)
    served.engine.tokenizer.chat_template = template
    with running_server(lambda: served) as s:
        assert s.state.wait_ready(30)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

        def ask(_):
            start = time.monotonic()
            r = httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=30)
            return r.status_code, r.json(), time.monotonic() - start

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        for status, body, elapsed in answers:
            assert status == 400, body
            assert body["error"]["message"] == "The chat template could not be applied to these messages."
            assert elapsed < 5, elapsed
        start = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once upon", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert time.monotonic() - start < 5
        assert r.json()["choices"][0]["text"]
