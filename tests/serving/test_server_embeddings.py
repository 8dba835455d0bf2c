"""The pooling APIs through the HTTP server: /v1/embeddings with the official openai client (float and
base64, dimensions, token-id input), /v1/score and /v1/rerank (and its /rerank, /v2/rerank spellings) in
vLLM's and Jina/Cohere's shapes, equal to LLM.embed and LLM.score on the same model; bad bodies are 400s;
embeddings run between generation steps while a generation streams."""
import base64
import json
import threading

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_server import KEY, assert_error  # noqa: E402
from test_server import client, llm, server  # noqa: E402,F401  (test_server's fixtures: its stories260K server)

TEXTS = ["Once upon a time", "The little dog ran to the park and", "a", "Lily liked to play with her ball"]


def post(server, path, body):
    return httpx.post(server.url + path, content=json.dumps(body), timeout=30,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


def test_embeddings_equal_llm_embed(client, llm):
    want = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    # the client asks for base64 by default and decodes it; as floats too
    got = client.embeddings.create(model="stories260K", input=TEXTS)
    floats = client.embeddings.create(model="stories260K", input=TEXTS, encoding_format="float")
    for r in (got, floats):
        assert [d.index for d in r.data] == list(range(len(TEXTS)))
        np.testing.assert_allclose(np.array([d.embedding for d in r.data]), want, rtol=1e-5, atol=1e-6)
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(o.prompt_token_ids) for o in llm.embed(TEXTS))


def test_base64_is_little_endian_float32(server, llm):
    r = post(server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    v = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(v, llm.embed(TEXTS[0])[0].outputs.embedding, rtol=1e-6)


def test_dimensions_and_token_ids(client, llm):
    r = client.embeddings.create(model="stories260K", input=TEXTS[1], dimensions=8, encoding_format="float")
    v = np.array(r.data[0].embedding)
    assert len(v) == 8 and abs(np.linalg.norm(v) - 1) < 1e-5
    ids = llm.engine.encode_embedding_input(TEXTS[1])
    by_ids = client.embeddings.create(model="stories260K", input=[ids, ids[:3]], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, llm.embed(TEXTS[1])[0].outputs.embedding, rtol=1e-5,
                               atol=1e-6)


def test_score_equals_llm_score(server, llm):
    r = post(server, "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    want = [s.outputs.score for s in llm.score(TEXTS[0], TEXTS)]
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, rtol=1e-5)
    pairs = post(server, "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:]}).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]],
                               [s.outputs.score for s in llm.score(TEXTS[:2], TEXTS[2:])], rtol=1e-5)


def test_rerank_orders_documents_best_first(server, llm):
    scores = [s.outputs.score for s in llm.score(TEXTS[1], TEXTS)]
    order = sorted(range(len(TEXTS)), key=lambda j: -scores[j])
    for url in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = post(server, url, {"query": TEXTS[1], "documents": TEXTS, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:3]
        assert results[0]["document"]["text"] == TEXTS[order[0]]
        np.testing.assert_allclose([x["relevance_score"] for x in results], [scores[j] for j in order[:3]], rtol=1e-5)
    bare = post(server, "/v1/rerank", {"query": TEXTS[1], "documents": [{"text": t} for t in TEXTS],
                                       "return_documents": False}).json()["results"]
    assert len(bare) == len(TEXTS) and all("document" not in x for x in bare)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": [[1] * 300]}, "input"),
    ("/v1/embeddings", {"input": [[10 ** 7]]}, "input"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n"),
])
def test_bad_bodies_are_400s(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


def test_embeddings_run_while_a_generation_streams(server, client, llm):
    want = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    text = []

    def generate():
        stream = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=120,
                                           temperature=0, stream=True)
        text.extend(c.choices[0].text for c in stream)

    t = threading.Thread(target=generate)
    t.start()
    for _ in range(5):
        got = client.embeddings.create(model="stories260K", input=TEXTS, encoding_format="float")
        np.testing.assert_allclose(np.array([d.embedding for d in got.data]), want, rtol=1e-5, atol=1e-6)
    t.join(30)
    assert "".join(text) == llm.generate("Once upon a time", __import__("corelm").SamplingParams(
        max_tokens=120, temperature=0))[0].outputs[0].text


def test_batch_file_embeddings_score_and_rerank_lines(tmp_path, llm):
    from corelm.entrypoints.batch import run_batch
    from test_batch_cli import STORIES, read_output, write_input
    lines = [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": TEXTS}},
             {"custom_id": "s", "method": "POST", "url": "/v1/score", "body": {"text_1": TEXTS[0], "text_2": TEXTS}},
             {"custom_id": "r", "method": "POST", "url": "/v1/rerank",
              "body": {"query": TEXTS[1], "documents": TEXTS, "top_n": 2}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": []}},
             {"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Once upon a time", "max_tokens": 4}}]
    out = str(tmp_path / "out.jsonl")
    s = run_batch(write_input(tmp_path / "in.jsonl", lines), out, workers=1, model=STORIES, progress=False)
    assert (s["requests"], s["errors"]) == (5, 1)
    got = {r["custom_id"]: r for r in read_output(out)}
    # the worker's model has the default dtype (bf16 where the CPU has it), the reference fp32
    data = got["e"]["response"]["body"]["data"]
    for d, o in zip(data, llm.embed(TEXTS)):
        assert np.dot(d["embedding"], o.outputs.embedding) > 0.999
    np.testing.assert_allclose([d["score"] for d in got["s"]["response"]["body"]["data"]],
                               [x.outputs.score for x in llm.score(TEXTS[0], TEXTS)], atol=3e-3)
    assert len(got["r"]["response"]["body"]["results"]) == 2
    assert got["bad"]["error"]["code"] and got["c"]["response"]["body"]["object"] == "text_completion"


def test_an_encoder_embeds_and_refuses_to_generate():
    import corelm
    from conftest import MODELS
    from test_server import running_server
    encoder = corelm.LLM(f"{MODELS}/tiny-bert", dtype="fp32", threads=1)
    with running_server(lambda: encoder, api_key=None) as s:
        assert s.state.wait_ready(30)
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            r = httpx.post(s.url + path, json=body, timeout=30)
            assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"], r.text
        r = httpx.post(s.url + "/v1/embeddings", json={"input": ["hello world", "x " * 500]}, timeout=30)
        assert r.status_code == 400 and "at most 128" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "hello world"}, timeout=30)
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], encoder.embed("hello world")[0].outputs.embedding,
                                   rtol=1e-5, atol=1e-6)
