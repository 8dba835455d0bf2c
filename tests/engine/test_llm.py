"""The Python API: generate/stream/chat semantics, stop conditions, prefix reuse, bad input."""
import os

import numpy as np
import pytest

from conftest import DEFAULT_GGUF, MODELS, core_forward

import corelm
from corelm import SamplingParams
from corelm.llm import default_model_path

STORIES = os.path.join(MODELS, "stories260K")
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def llm():
    return corelm.LLM(STORIES, dtype="fp32", threads=2)


@pytest.fixture(scope="module")
def smol():
    return corelm.LLM(DEFAULT_GGUF, threads=2)


def test_default_model_is_found():
    assert os.path.samefile(default_model_path(), DEFAULT_GGUF) or os.path.basename(default_model_path()) == os.path.basename(DEFAULT_GGUF)


def test_generate_keeps_input_order_and_matches_single_runs(llm):
    prompts = ["Once upon a time", "The cat", "Lily and Tom went to"]
    params = SamplingParams(max_tokens=20, **GREEDY)
    batch = llm.generate(prompts, params)
    assert [o.prompt for o in batch] == prompts
    for p, out in zip(prompts, batch):
        llm.reset()
        single = llm.generate(p, params)[0]
        assert single.outputs[0].token_ids == out.outputs[0].token_ids
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_stream_equals_generate(llm):
    params = SamplingParams(max_tokens=40, **GREEDY)
    whole = llm.generate("Once upon a time", params)[0].outputs[0]
    chunks = list(llm.stream("Once upon a time", params))
    assert "".join(c.text for c in chunks) == whole.text
    assert [c.token_id for c in chunks] == whole.token_ids
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


def test_max_tokens_and_length_finish(llm):
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=7, ignore_eos=True, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_string_cuts_text(llm):
    base = llm.generate("Once upon a time", SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0].text
    stop = base[15:22]  # a piece of text that spans token boundaries
    assert stop and base.find(stop) == 15
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=40, stop=[stop], **GREEDY))[0].outputs[0]
    assert out.text == base[:15] and out.finish_reason == "stop" and out.stop_reason == stop
    inc = llm.generate("Once upon a time",
                       SamplingParams(max_tokens=40, stop=stop, include_stop_str_in_output=True, **GREEDY))[0].outputs[0]
    assert inc.text == base[:22]
    streamed = "".join(c.text for c in llm.stream("Once upon a time", SamplingParams(max_tokens=40, stop=[stop], **GREEDY)))
    assert streamed == base[:15]


def test_stop_token_ids(llm):
    base = llm.generate("Once upon a time", SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=30, stop_token_ids=[stop_id], **GREEDY))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_unless_ignored(llm):
    eos = llm.eos_token_ids[0]
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=400, **GREEDY))[0].outputs[0]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == eos
    long = llm.generate("Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True, **GREEDY))[0].outputs[0]
    assert len(long.token_ids) == 400


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=42)
    a = llm.generate("Once upon a time", p)[0].outputs[0].token_ids
    b = llm.generate("Once upon a time", p)[0].outputs[0].token_ids
    c = llm.generate("Once upon a time", SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=7))[0].outputs[0].token_ids
    assert a == b and a != c
    two = llm.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=30, seed=42, n=2))[0]
    assert [o.index for o in two.outputs] == [0, 1] and two.outputs[0].token_ids != two.outputs[1].token_ids


def test_aborted_stream_leaves_engine_consistent(llm):
    params = SamplingParams(max_tokens=30, **GREEDY)
    llm.reset()
    expected = llm.generate("Lily and Tom", params)[0].outputs[0].token_ids
    it = llm.stream("Once upon a time there was", params)
    for _ in range(3):
        next(it)
    it.close()
    assert llm.last_metrics["finish_reason"] == "abort"
    assert llm.generate("Lily and Tom", params)[0].outputs[0].token_ids == expected


def test_prefix_reuse_gives_the_same_tokens(llm):
    params = SamplingParams(max_tokens=25, ignore_eos=True, **GREEDY)
    first = llm.generate("Once upon a time", params)[0]
    follow = first.prompt_token_ids + first.outputs[0].token_ids + llm.tokenizer.encode(" The end", add_special_tokens=False)
    reused = llm.generate([follow], params)[0]
    assert llm.last_metrics["cached_prompt_tokens"] > len(first.prompt_token_ids)
    llm.reset()
    fresh = llm.generate([follow], params)[0]
    assert reused.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_logprobs(llm):
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=5, logprobs=3, **GREEDY))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token_id, entry in zip(out.token_ids, out.logprobs):   # vLLM's shape: {token id: Logprob}
        assert len(entry) == 3 and all(lp.logprob <= 0 for lp in entry.values())
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert entry[token_id].rank == 1          # greedy picks the most likely token
        assert entry[token_id].decoded_token == llm.tokenizer.decode([token_id], skip_special_tokens=False)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_prompt_too_long_is_a_clear_error_and_harmless(llm):
    small = corelm.LLM(STORIES, dtype="fp32", threads=1, max_seq_len=32)
    with pytest.raises(ValueError, match="context"):
        small.generate([[1] + [300] * 40], SamplingParams(max_tokens=4))
    out = small.generate("Once upon a time", SamplingParams(max_tokens=100, ignore_eos=True, **GREEDY))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) + 5 == 32  # generation stops at the context end


def test_bad_input_raises_clearly(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 99999]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="vocabulary"):
        core_forward(llm.engine.core, np.array([1, -5], np.int32), 0, False)
    with pytest.raises(ValueError, match="context"):
        core_forward(llm.engine.core, np.array([1], np.int32), llm.max_seq_len, False)
    with pytest.raises(ValueError):
        llm.generate("x", SamplingParams(max_tokens=2, stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="dtype"):
        corelm.LLM(STORIES, dtype="fp8")
    with pytest.raises(ValueError, match="threads"):
        corelm.LLM(STORIES, threads=0)
    with pytest.raises(corelm.ModelLoadError):
        corelm.LLM(os.path.join(MODELS, "does-not-exist"))
    # the engine still works afterwards
    assert llm.generate("Once", SamplingParams(max_tokens=3, **GREEDY))[0].outputs[0].token_ids


def test_chat_uses_the_model_template(smol):
    messages = [{"role": "user", "content": "Say hello."}]
    text = smol.apply_chat_template(messages)
    assert "<|im_start|>user\nSay hello.<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    out = smol.chat(messages, SamplingParams(max_tokens=16, **GREEDY))
    assert len(out) == 1 and out[0].outputs[0].text
    # read the prompt afresh as the first call did: a cached prefix would change which tokens go through
    # the batched (m > 1) matrix products, whose rounding differs from the one-row ones
    smol.reset()
    streamed = "".join(c.text for c in smol.chat_stream(messages, SamplingParams(max_tokens=16, **GREEDY)))
    assert streamed == out[0].outputs[0].text
    assert "\ufffd" not in streamed


def test_streamed_text_never_splits_characters(smol):
    prompt = smol.apply_chat_template([{"role": "user", "content": "Écris une phrase avec des émojis 🎉 et du 日本語."}])
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=3)
    chunks = [c.text for c in smol.stream(smol.tokenizer.encode(prompt, add_special_tokens=False), params)]
    for c in chunks:
        c.encode("utf-8")  # no lone surrogates
        assert "\ufffd" not in c


def test_tokenizer_built_while_the_weights_load(tmp_path):
    """LLM builds a GGUF's tokenizer on a thread while the weights load: the same tokenizer, and a broken
    one still fails the load with the loader's error."""
    from corelm.loader import ModelLoadError, load_model
    path = os.path.join(STORIES, "stories260K.gguf")
    now, later = load_model(path), load_model(path, tokenizer_in_background=True)
    assert later.tokenizer.encode("Once upon a time") == now.tokenizer.encode("Once upon a time")
    assert later.tokenizer is later.tokenizer
    assert corelm.LLM(path, threads=1, speculative_model=None).tokenizer.encode("Hi") == now.tokenizer.encode("Hi")
    data = open(path, "rb").read()
    key = b"tokenizer.ggml.model"
    i = data.index(key) + len(key) + 4 + 8            # past the key, its value type and the string's length
    assert data[i:i + 5] == b"llama"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:i] + b"bogus" + data[i + 5:])
    loaded = load_model(str(bad), tokenizer_in_background=True)     # the header and the weights are fine
    with pytest.raises(ModelLoadError, match="tokenizer model 'bogus' is not supported"):
        loaded.tokenizer
    with pytest.raises(ModelLoadError, match="tokenizer model 'bogus' is not supported"):
        corelm.LLM(str(bad), threads=1, speculative_model=None)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_a_loaded_gguf_keeps_none_of_its_file_mapped():
    """Once the engine holds the weights and the tokenizer, no page of the file stays in this process's
    memory (the tokenizer's metadata pages included): peak memory is the packed model, not it plus the file."""
    path = os.path.realpath(os.path.join(STORIES, "stories260K.gguf"))

    def mapped_kib():
        kib, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
                    inside = head[-1] == path
                elif inside and head[0] == "Rss:":
                    kib += int(head[1])
        return kib

    llm = corelm.LLM(path, threads=1, max_seq_len=64)
    assert llm.generate("Once", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    assert mapped_kib() == 0
