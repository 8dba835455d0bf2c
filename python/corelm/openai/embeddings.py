"""The pooling APIs' bodies: OpenAI's embeddings, and the score and rerank APIs vLLM and llama-server serve
(Jina/Cohere's shape); the vectors come from LLMEngine.embed, a score is the cosine of two embeddings.

    POST /v1/embeddings {"input": "text" | ["text", ...] | [ids] | [[ids], ...], "encoding_format": "float" |
                         "base64", "dimensions": d}
         -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}], "usage"}
    POST /v1/score      {"text_1": "query" | [...], "text_2": "doc" | [...]}  (1 -> N or N -> N pairs)
         -> {"object": "list", "data": [{"object": "score", "index": i, "score": s}], "usage"}
    POST /v1/rerank     {"query": "q", "documents": ["doc" | {"text": "doc"}, ...], "top_n": k,
                         "return_documents": true}
         -> {"results": [{"index": i, "relevance_score": s, "document": {"text": ...}}] best first, "usage"}
"""
from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional, Union

import numpy as np

from ..engine.pooling import PoolingParams, cosine
from .errors import bad_request
from .protocol import _Body, parse_body_as

EMBEDDINGS_URL = "/v1/embeddings"
SCORE_URL = "/v1/score"
RERANK_URL = "/v1/rerank"
RERANK_URLS = (RERANK_URL, "/rerank", "/v2/rerank")   # vLLM's and llama-server's spellings
MAX_INPUTS = 2048   # OpenAI's limit on inputs per embeddings request


class EmbeddingsBody(_Body):
    model: Optional[str] = None
    input: Union[str, List[str], List[int], List[List[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None   # vLLM's: keep this many tokens of a longer input


class ScoreBody(_Body):
    model: Optional[str] = None
    text_1: Union[str, List[str], None] = None
    text_2: Union[str, List[str], None] = None
    truncate_prompt_tokens: Optional[int] = None


class Document(_Body):
    text: str


class RerankBody(_Body):
    model: Optional[str] = None
    query: str
    documents: List[Union[str, Document]]
    top_n: Optional[int] = None
    return_documents: bool = True
    truncate_prompt_tokens: Optional[int] = None


POOLING_URLS = frozenset({EMBEDDINGS_URL, SCORE_URL, *RERANK_URLS})
_BODIES = {EMBEDDINGS_URL: EmbeddingsBody, SCORE_URL: ScoreBody, **{u: RerankBody for u in RERANK_URLS}}


@dataclass
class PoolingRequest:
    """A pooling request's checked body (what a batch file line holds before a model tokenizes it)."""
    url: str
    body: Any
    stream: bool = False

    @property
    def model(self) -> Optional[str]:
        return self.body.model


@dataclass
class PoolingJob:
    """A parsed request: the token ids to embed (the engine thread embeds them), and how to answer."""
    url: str
    body: Any
    ids: List[List[int]]
    params: PoolingParams

    @property
    def prompt_tokens(self) -> int:
        return sum(len(i) for i in self.ids)


def _encode(engine, prompts: List[Any], truncate: Optional[int], param: str) -> List[List[int]]:
    if not prompts:
        raise bad_request(f"The '{param}' is empty.", param)
    if len(prompts) > MAX_INPUTS:
        raise bad_request(f"At most {MAX_INPUTS} inputs per request.", param)
    try:
        return [engine.encode_embedding_input(p, truncate) for p in prompts]
    except ValueError as e:
        raise bad_request(str(e), param) from None


def validate(url: str, raw) -> PoolingRequest:
    """The body checked against its API's schema (APIError 400), before any model is at hand."""
    return PoolingRequest(RERANK_URL if url in RERANK_URLS else url, parse_body_as(_BODIES[url], raw))


def parse(engine, url: str, raw) -> PoolingJob:
    """The request's ids, tokenized with the model's tokenizer (slow for long inputs: off the event loop).
    Raises APIError (400) for a bad body."""
    return prepare(engine, validate(url, raw))


def prepare(engine, req: PoolingRequest) -> PoolingJob:
    url, body = req.url, req.body
    if url == EMBEDDINGS_URL:
        inputs = body.input
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        params = PoolingParams(dimensions=body.dimensions)
        try:
            params.check(engine.spec.hidden_size)
        except ValueError as e:
            raise bad_request(str(e), "dimensions") from None
        return PoolingJob(url, body, _encode(engine, list(inputs), body.truncate_prompt_tokens, "input"), params)
    if url == SCORE_URL:
        if body.text_1 is None or body.text_2 is None:
            raise bad_request("Give both 'text_1' and 'text_2'.", "text_1" if body.text_1 is None else "text_2")
        left = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        right = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(left) != 1 and len(left) != len(right):
            raise bad_request(f"Pair one text_1 with many text_2, or as many with as many; got {len(left)} and "
                              f"{len(right)}.", "text_2")
        ids = _encode(engine, left, body.truncate_prompt_tokens, "text_1") + \
            _encode(engine, right, body.truncate_prompt_tokens, "text_2")
        return PoolingJob(url, body, ids, PoolingParams(normalize=True))
    if body.top_n is not None and body.top_n < 1:
        raise bad_request("top_n must be at least 1.", "top_n")
    docs = [d if isinstance(d, str) else d.text for d in body.documents]
    ids = _encode(engine, [body.query], body.truncate_prompt_tokens, "query") + \
        _encode(engine, docs, body.truncate_prompt_tokens, "documents")
    return PoolingJob(url, body, ids, PoolingParams(normalize=True))


def respond(job: PoolingJob, vectors: List[np.ndarray], model: str) -> Dict[str, Any]:
    usage = {"prompt_tokens": job.prompt_tokens, "total_tokens": job.prompt_tokens}
    if job.url == EMBEDDINGS_URL:
        def encoded(v: np.ndarray):
            if job.body.encoding_format == "base64":   # little-endian float32 bytes, as OpenAI sends them
                return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
            return v.tolist()
        data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": model, "usage": usage}
    if job.url == SCORE_URL:
        n_left = 1 if isinstance(job.body.text_1, str) else len(job.body.text_1)
        left, right = vectors[:n_left], vectors[n_left:]
        data = [{"object": "score", "index": j, "score": cosine(left[0 if n_left == 1 else j], v)}
                for j, v in enumerate(right)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": usage}
    query, docs = vectors[0], vectors[1:]
    results = [{"index": j, "relevance_score": cosine(query, v)} for j, v in enumerate(docs)]
    results.sort(key=lambda r: -r["relevance_score"])
    if job.body.top_n is not None:
        results = results[:job.body.top_n]
    if job.body.return_documents:
        for r in results:
            d = job.body.documents[r["index"]]
            r["document"] = {"text": d if isinstance(d, str) else d.text}
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": job.prompt_tokens},
            "results": results}
