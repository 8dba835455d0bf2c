"""The request-level engine interface (LLMEngine over its Scheduler): every request ends exactly once, aborts work
before and during generation, results equal LLM.generate's."""
import os

import pytest

from conftest import MODELS

import corelm
from corelm import SamplingParams


@pytest.fixture(scope="module")
def llm():
    return corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=2)


def test_requests_finish_once_with_the_same_tokens_as_generate(llm):
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = {"a": "Once upon a time", "b": "The dog", "c": "Tom had a"}
    engine = llm.engine
    for rid, p in prompts.items():
        engine.add_request(rid, llm.encode_prompt(p), params)
    chunks = engine.run_to_completion()
    assert set(chunks) == set(prompts)
    for rid, p in prompts.items():
        finals = [c for c in chunks[rid] if c.finish_reason]
        assert len(finals) == 1 and chunks[rid][-1] is finals[0]
        expected = llm.generate(p, params)[0].outputs[0]
        assert [c.token_id for c in chunks[rid]] == expected.token_ids
        assert "".join(c.text for c in chunks[rid]) == expected.text


def test_abort_waiting_and_running(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("run", llm.encode_prompt("Once"), params)
    engine.add_request("wait", llm.encode_prompt("Twice"), params)
    first = engine.step()
    assert first[0][0] == "run" and first[0][1].finish_reason is None
    engine.abort_request("wait")
    engine.abort_request("run")
    chunks = engine.run_to_completion()
    assert chunks == {"wait": chunks["wait"], "run": chunks["run"]}
    assert chunks["wait"][-1].finish_reason == "abort" and chunks["run"][-1].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_bad_requests_are_refused_up_front(llm):
    engine = llm.engine
    with pytest.raises(ValueError):
        engine.add_request("x", [1, 10**6], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("y", [], SamplingParams())
    engine.add_request("z", [1, 5], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("z", [1, 5], SamplingParams(max_tokens=2))
    assert engine.run_to_completion()["z"][-1].finish_reason in ("stop", "length")


def test_steady_traffic_reuses_the_same_blocks():
    """The free list is a stack: requests one after another (distinct prompts, no prefix sharing) keep
    using the few blocks a request needs, so the pool's resident memory follows the working set."""
    from corelm.engine.scheduler import BlockManager
    bm = BlockManager(100, 16)
    touched = set()
    for _ in range(50):
        blocks = [bm.allocate() for _ in range(3)]
        touched.update(blocks)
        bm.release(blocks)
    assert touched == {0, 1, 2}
    llm = corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=1, max_seq_len=64)
    seen = set()
    engine = llm.engine
    manager = engine.scheduler.blocks
    original = manager.allocate

    def spy():
        b = original()
        seen.add(b)
        return b
    manager.allocate = spy
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(20):
        llm.reset()          # no prefix cache: every request needs fresh blocks
        llm.generate([[1, 300 + i, 40 + i]], params)
    assert len(seen) <= 2 < engine.core.kv_blocks       # 23 tokens: 2 blocks of 16, whatever the pool's size
