"""usage.prompt_tokens_details.cached_tokens reports the prompt tokens the prefix cache supplied, and the
server keeps temperature to OpenAI's range [0, 2]."""
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from test_server import post, running_server, stories  # noqa: E402

PREFIX = "Once upon a time there was a little girl who lived in a big house with her mom and dad. " * 3


@pytest.fixture(scope="module")
def server():
    served = stories()
    with running_server(lambda: served) as s:
        assert s.state.wait_ready(30)
        yield s


def cached(body):
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path,make", [
    ("/v1/chat/completions", lambda tail: {"messages": [{"role": "system", "content": "Chat. " + PREFIX},
                                                         {"role": "user", "content": tail}]}),
    ("/v1/completions", lambda tail: {"prompt": "Text. " + PREFIX + tail}),
])
def test_a_shared_prefix_is_reported_as_cached_tokens(server, path, make):
    # each case's prefix starts differently: nothing before it is in the cache
    first = post(server, path, {**make("She had a dog."), "max_tokens": 2, "temperature": 0}, key=None)
    assert first.status_code == 200, first.text
    assert cached(first.json()) == 0
    second = post(server, path, {**make("He liked to run."), "max_tokens": 2, "temperature": 0}, key=None)
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert 0 < cached(second.json()) < usage["prompt_tokens"]


def test_streamed_usage_has_the_details_too(server):
    body = {"prompt": PREFIX, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    r = post(server, "/v1/completions", body, key=None)
    assert r.status_code == 200 and '"prompt_tokens_details"' in r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 2.5}),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}),
])
def test_temperature_above_two_is_a_400(server, path, body):
    r = post(server, path, body, key=None)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "temperature" and "temperature" in err["message"]
    assert post(server, path, {**body, "temperature": 2.0, "max_tokens": 1}, key=None).status_code == 200
