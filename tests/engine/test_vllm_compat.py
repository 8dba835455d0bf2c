"""Code written for vLLM's offline API runs unchanged: LLM.generate/LLM.chat take vLLM's arguments
(sampling_params=, a list of SamplingParams, TextPrompt/TokensPrompt dicts) and return vLLM's output
types (RequestOutput with request_id, CompletionOutput in vLLM's field order, logprobs as
{token id: Logprob})."""
import dataclasses
import math
import os

import pytest

from conftest import DEFAULT_GGUF, MODELS

import corelm
from corelm import CompletionOutput, LLM, Logprob, RequestOutput, SamplingParams, TextPrompt, TokensPrompt

STORIES = os.path.join(MODELS, "stories260K")


@pytest.fixture(scope="module")
def llm():
    return LLM(STORIES, dtype="fp32", threads=2)


def test_vllm_style_script_runs(llm):
    # as in vLLM's quickstart
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        assert isinstance(output, RequestOutput) and isinstance(output.outputs[0], CompletionOutput)
        assert output.prompt in prompts and isinstance(output.outputs[0].text, str)
    again = llm.generate(prompts=prompts, sampling_params=sampling_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]


def test_output_types_have_vllms_fields_in_order():
    assert [f.name for f in dataclasses.fields(CompletionOutput)][:7] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason"]
    assert [f.name for f in dataclasses.fields(RequestOutput)][:6] == [
        "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished"]
    assert [f.name for f in dataclasses.fields(Logprob)] == ["logprob", "rank", "decoded_token"]


def test_request_ids_are_unique_strings(llm):
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2, temperature=0))
    ids = [o.request_id for o in outs] + [o.request_id for o in llm.generate("c", SamplingParams(max_tokens=2))]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 3
    assert all(o.finished and o.outputs[0].finished() for o in outs)


def test_tokens_and_text_prompts(llm):
    params = SamplingParams(max_tokens=6, temperature=0)
    ids = llm.get_tokenizer().encode("Once upon a time")
    by_text = llm.generate("Once upon a time", params)[0]
    llm.reset()
    by_dict = llm.generate(TextPrompt(prompt="Once upon a time"), params)[0]
    llm.reset()
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=ids), params)[0]
    llm.reset()
    by_list = llm.generate([{"prompt_token_ids": ids}, ids], params)
    assert by_text.prompt_token_ids == by_dict.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert by_dict.prompt == "Once upon a time" and by_ids.prompt is None
    want = by_text.outputs[0].token_ids
    assert by_dict.outputs[0].token_ids == by_ids.outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in by_list] == [want, want]
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"text": "no such key"}, params)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(TokensPrompt(prompt_token_ids=[1, 10**6]), params)


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(["Once", "The dog"], [SamplingParams(max_tokens=3, temperature=0),
                                              SamplingParams(max_tokens=5, temperature=0, n=1)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate("a", [{"max_tokens": 3}])


def test_n_choices_come_from_the_engine(llm):
    params = SamplingParams(n=3, max_tokens=6, seed=7, ignore_eos=True)
    out = llm.generate("Once upon a time", params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1       # the choices differ
    assert llm.generate("Once upon a time", params)[0].outputs[2].token_ids == out.outputs[2].token_ids


def test_logprobs_shape(llm):
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=4, logprobs=2, seed=3))[0].outputs[0]
    total = 0.0
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert token_id in entry and all(isinstance(lp, Logprob) for lp in entry.values())
        assert 2 <= len(entry) <= 3            # the top 2, plus the sampled token when it is not among them
        best = max(entry.values(), key=lambda lp: lp.logprob)
        assert best.rank == 1 and entry[token_id].rank >= 1 and entry[token_id].decoded_token is not None
        total += entry[token_id].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-9)
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None


def test_chat_signature(llm):
    if not os.path.isfile(DEFAULT_GGUF):
        pytest.skip("embedded SmolLM2 GGUF missing")
    smol = LLM(DEFAULT_GGUF, threads=2)
    conversation = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi"}]
    sp = SamplingParams(max_tokens=8, temperature=0)
    one = smol.chat(conversation, sampling_params=sp, use_tqdm=False)
    smol.reset()
    two = smol.chat([conversation, conversation], sp, add_generation_prompt=True)
    assert len(one) == 1 and len(two) == 2
    assert one[0].outputs[0].token_ids == two[0].outputs[0].token_ids
    text = smol.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True)
    assert one[0].prompt_token_ids == smol.get_tokenizer().encode(text, add_special_tokens=False)


def test_engine_is_public_and_shared(llm):
    assert isinstance(llm.engine, corelm.LLMEngine)
    engine = llm.engine
    engine.add_request("x", "Once", SamplingParams(max_tokens=3, n=2, seed=1))
    chunks = engine.run_to_completion()["x"]
    assert sorted(c.index for c in chunks if c.finish_reason is not None) == [0, 1]
    with pytest.raises(ValueError, match="context"):
        engine.add_request("y", [1] * engine.max_seq_len, SamplingParams())
    assert not engine.has_unfinished_requests()


def test_vllm_constructor_names_map_to_corelms():
    llm = LLM(STORIES, dtype="float32", threads=2, max_model_len=128, max_num_batched_tokens=64,
              tokenizer=STORIES, tokenizer_mode="auto", device="cpu")
    assert llm.max_seq_len == 128 and llm.engine.scheduler.max_batch_tokens == 64
    assert llm.engine.core.weight_type == LLM(STORIES, dtype="fp32", threads=2, max_seq_len=128).engine.core.weight_type


def test_gpu_only_options_warn_and_unknown_ones_name_llm():
    for key, value in [("gpu_memory_utilization", 0.9), ("enforce_eager", True), ("swap_space", 4),
                       ("trust_remote_code", True)]:
        with pytest.warns(UserWarning, match=key):
            LLM(STORIES, dtype="fp32", threads=2, **{key: value})
    with pytest.raises(TypeError, match=r"^LLM\(\) got an unexpected keyword argument 'no_such_option'"):
        LLM(STORIES, no_such_option=1)
    with pytest.raises(ValueError, match="device"):
        LLM(STORIES, device="cuda")
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(STORIES, tokenizer="some/other-tokenizer")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(STORIES, max_model_len=128, max_seq_len=64)


def test_seed_makes_a_run_reproducible():
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)

    def run():
        llm = LLM(STORIES, dtype="fp32", threads=2, seed=5)
        return [o.outputs[0].token_ids for o in llm.generate(["Once upon a time"] * 3, params)]

    first = run()
    assert run() == first
    assert len({tuple(t) for t in first}) > 1        # each request draws its own seed
    with pytest.raises(ValueError, match="seed"):
        LLM(STORIES, seed="x")


def test_enable_prefix_caching_false_reads_every_prompt_whole():
    prompt = "Once upon a time there was a little girl who lived in a big house with her mom. " * 3
    params = SamplingParams(max_tokens=3, temperature=0)
    cached = []
    for enable in (True, False):
        llm = LLM(STORIES, dtype="fp32", threads=2, enable_prefix_caching=enable)
        outs = [llm.generate(prompt, params)[0] for _ in range(2)]
        assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
        cached.append(outs[1].num_cached_tokens)
    assert cached[0] > 0 and cached[1] == 0
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(STORIES, enable_prefix_caching="no")


def test_best_of_must_equal_n():
    assert SamplingParams(n=2, best_of=2).best_of == 2 and SamplingParams(best_of=None).n == 1
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=1, best_of=3)


def test_chat_takes_tools_and_template_kwargs(llm):
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if tools %} TOOLS {{ tools[0].function.name }}{% endif %} {{ flavour }}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    sp = SamplingParams(max_tokens=2, temperature=0)
    out = llm.chat([{"role": "user", "content": "Hi"}], sp, chat_template=template, tools=tools,
                   chat_template_kwargs={"flavour": "mint"})[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Hi TOOLS get_weather mint", add_special_tokens=False)
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat([{"role": "user", "content": "Hi"}], sp, chat_template=template, chat_template_kwargs={"tools": 1})
    with pytest.raises(ValueError, match="tools"):
        llm.chat([{"role": "user", "content": "Hi"}], sp, chat_template=template, tools=[{"type": "nope"}])


def test_vllm_pooling_examples_run():
    # vLLM's offline embedding and scoring examples (examples/offline_inference/basic/embed.py, score.py)
    llm = LLM(model=STORIES, task="embed", runner="pooling", dtype="fp32", threads=2)
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is"]
    outputs = llm.embed(prompts)
    for prompt, output in zip(prompts, outputs):
        embeds = output.outputs.embedding
        assert len(embeds) == llm.spec.hidden_size and isinstance(embeds[0], float)
        assert output.prompt_token_ids == llm.encode_prompt(prompt)
    text_1 = "What is the capital of France?"
    texts_2 = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
    scores = llm.score(text_1, texts_2)
    assert [type(s).__name__ for s in scores] == ["ScoringRequestOutput"] * 2
    assert all(-1 <= s.outputs.score <= 1 for s in scores)
    with pytest.raises(ValueError, match="task='classify'"):
        LLM(model=STORIES, task="classify")
