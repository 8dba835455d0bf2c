"""The server's log (logger "corelm.server"): the block at start (model, format and dtype, threads, kernels, the
web page's URL) and one line per request (id, route, status, prompt/cached/completion tokens, time to first
token, tok/s; a refusal's reason)."""
import logging
import re
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import corelm._core  # noqa: E402
import corelm.entrypoints.server as server_pkg  # noqa: E402
from test_server import running_server, stories  # noqa: E402

LINE = re.compile(r"request (\S+) POST (\S+) (\d+) prompt=(\d+) cached=(\d+) completion=(\d+) ttft=([\d.]+)s "
                  r"([\d.]+) tok/s")


def lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "corelm.server"]


def test_start_block_and_one_line_per_request(caplog):
    caplog.set_level(logging.INFO, logger="corelm.server")
    served = stories()
    with running_server(lambda: served) as s:
        assert s.state.wait_ready(30)
        block = next(m for m in lines(caplog) if m.startswith("model loaded: stories260K"))
        isa = set(corelm._core.cpu_info()["kernels"].values())
        assert f"threads: {served.engine.threads}" in block and "stories260K (hf)" in block
        assert all(name in block for name in isa) and "dtype:   fp32" in block
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)
        ask = [{"role": "user", "content": "Tell me a story"}]
        caplog.clear()
        r = client.chat.completions.create(model="m", messages=ask, max_tokens=6, temperature=0)
        again = client.chat.completions.create(model="m", messages=ask, max_tokens=6, temperature=0, stream=True)
        streamed_id = [c.id for c in again][0]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="m", messages=ask, temperature=3)
        logged = lines(caplog)
        done = [LINE.match(m) for m in logged if LINE.match(m)]
        assert [m.group(1) for m in done] == [r.id, streamed_id]
        first = done[0]
        assert first.group(2) == "/v1/chat/completions" and first.group(3) == "200"
        assert int(first.group(4)) == r.usage.prompt_tokens and int(first.group(6)) == r.usage.completion_tokens
        assert int(done[1].group(5)) > 0       # the second time the prompt came from the prefix cache
        refused = [m for m in logged if " 400 reason=" in m]
        assert len(refused) == 1 and "POST /v1/chat/completions" in refused[0] and "'temperature'" in refused[0]


def test_the_url_is_logged_at_start(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="corelm.server")
    monkeypatch.setattr(server_pkg, "make_server", lambda config: types.SimpleNamespace(run=lambda: None,
                                                                                       interrupted=False))
    assert server_pkg.run(lambda: None, "m", host="127.0.0.1", port=8123) == 0
    assert "web chat page and API at http://127.0.0.1:8123/" in lines(caplog)
