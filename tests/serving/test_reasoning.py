"""Reasoning models: <think>...</think> returned as reasoning_content (message and streamed deltas), the
rest as content; the parser under every split of its input, the Response builder, and a server round trip."""
import json
import os
import types

import pytest

from conftest import DATA, MODELS
from corelm.openai.protocol import CHAT_URL, parse_request
from corelm.openai.reasoning import ReasoningParser, prompt_opens_thought, split_reasoning, template_thinks
from corelm.openai.responses import Response

QWEN3 = os.path.join(DATA, "templates", "Qwen-Qwen3-0.6B.jinja")

# (output, the prompt opened the thought, reasoning, content)
CASES = [
    ("<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.", False, "Let me see: 2+2.", "It is 4."),
    ("\nLet me see.\n</think>\n\nIt is 4.", True, "Let me see.", "It is 4."),
    ("<think>\nStill thinking < about </thin", False, "Still thinking < about </thin", ""),   # max_tokens hit
    ("Hello <think> there", False, "", "Hello <think> there"),     # not at the start: content
    ("  <thin", False, "", "  <thin"),
    ("<think></think>Hi", False, "", "Hi"),
]


def _feed(parser, pieces):
    r, c = [], []
    for i, piece in enumerate(pieces):
        a, b = parser.feed(piece, final=i == len(pieces) - 1)
        r.append(a)
        c.append(b)
    return "".join(r), "".join(c)


@pytest.mark.parametrize("text,opened,reasoning,content", CASES)
def test_every_split_point_gives_the_same_split(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)
    for i in range(len(text) + 1):
        assert _feed(ReasoningParser(opened), [text[:i], text[i:]]) == (reasoning, content), i
        for j in range(i, len(text) + 1):
            assert _feed(ReasoningParser(opened), [text[:i], text[i:j], text[j:]]) == (reasoning, content), (i, j)
    assert _feed(ReasoningParser(opened), list(text) + [""]) == (reasoning, content)


def test_a_split_tag_is_held_not_sent():
    p = ReasoningParser()
    assert p.feed("<thi") == ("", "")
    assert p.feed("nk>abc</th") == ("abc", "")
    assert p.feed("ink>\n") == ("", "")
    assert p.feed("x", final=True) == ("", "x")


def test_qwen3_template_and_enable_thinking():
    from corelm.tokenizer.chat_template import render_chat_template
    template = open(QWEN3).read()
    assert template_thinks(template) and not template_thinks("{{ messages }}") and not template_thinks(None)
    msgs = [{"role": "user", "content": "hi"}]
    on = render_chat_template(template, msgs, add_generation_prompt=True, special_tokens={})
    off = render_chat_template(template, msgs, add_generation_prompt=True, special_tokens={},
                               enable_thinking=False)
    assert not prompt_opens_thought(on)     # Qwen3 opens the thought in its output
    assert off.endswith("<think>\n\n</think>\n\n") and not prompt_opens_thought(off)
    assert prompt_opens_thought(on + "<think>\n")     # templates that open it themselves (QwQ, Qwen3-2507)
    # thinking off: the output opens no thought, all of it is content
    assert split_reasoning("The answer is 4.", prompt_opens_thought(off)) == ("", "The answer is 4.")


def _chunk(text, finish=None):
    return types.SimpleNamespace(index=0, token_id=1, logprob=None, top_logprobs=None, text=text,
                                 finish_reason=finish, stop_reason=None)


def _response(opened, pieces, finish="stop", **body):
    req = parse_request(CHAT_URL, {"messages": [{"role": "user", "content": "hi"}], **body})
    req.reasoning = opened
    tokens = types.SimpleNamespace(tokenizer=None)
    resp = Response(req, 3, "m", tokens)
    deltas = [resp.add(0, _chunk(p, finish if i == len(pieces) - 1 else None)) for i, p in enumerate(pieces)]
    return resp, [d for d in deltas if d is not None]


def test_response_message_and_stream():
    text = "<think>\nHmm.\n</think>\n\nFour."
    resp, deltas = _response(False, [text[:5], text[5:12], text[12:20], text[20:]])
    msg = resp.body()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Four.", "reasoning_content": "Hmm."}
    seen = [list(d["delta"]) for d in deltas if d["delta"]]
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "Hmm."
    assert "".join(d["delta"].get("content", "") for d in deltas) == "Four."
    flat = [k for keys in seen for k in keys]
    assert flat.index("content") > max(i for i, k in enumerate(flat) if k == "reasoning_content")
    assert deltas[-1]["finish_reason"] == "stop"


def test_unclosed_thought_is_all_reasoning():
    resp, deltas = _response(True, ["I am ", "still thi", "nking"], finish="length")
    choice = resp.body()["choices"][0]
    assert choice["message"]["reasoning_content"] == "I am still thinking"
    assert choice["message"]["content"] is None and choice["finish_reason"] == "length"
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "I am still thinking"
    assert deltas[-1]["finish_reason"] == "length"


def test_no_reasoning_model_keeps_the_tags():
    resp, _ = _response(None, ["<think>a</think>b"])
    assert resp.body()["choices"][0]["message"] == {"role": "assistant", "content": "<think>a</think>b"}


def test_tool_calls_are_parsed_from_the_content_only():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    fake = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    # a call written in the thought is not made
    resp, deltas = _response(False, ["<think>maybe " + fake, "</think>No call."], tools=tools)
    choice = resp.body()["choices"][0]
    assert choice["message"]["content"] == "No call." and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "maybe " + fake
    # a call after it is
    resp, deltas = _response(False, ["<think>call f</think>\n", fake], tools=tools)
    choice = resp.body()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "call f"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    assert deltas[-1]["finish_reason"] == "tool_calls" and deltas[-1]["delta"]["tool_calls"]


def test_server_round_trip_with_a_thinking_template():
    """A tiny model served with Qwen3's template, its output forced by a regex to hold a thought."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import corelm
    from test_server import running_server
    served = corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=1, max_seq_len=256)
    served.engine.tokenizer.chat_template = open(QWEN3).read()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "temperature": 0,
            "structured_outputs": {"regex": "<think>\nab\n</think>\n\nok"}}
    with running_server(lambda: served) as s:
        assert s.state.wait_ready(30)
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == ("ab", "ok"), msg
        deltas = []
        with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    deltas += [c["delta"] for c in json.loads(line[6:])["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "ab"
        assert "".join(d.get("content") or "" for d in deltas) == "ok"


# --- the thinking budget (max_thinking_tokens, --reasoning-budget) -------------------------------------------

# Qwen3's template, but opening the thought in the prompt (as QwQ's and Qwen3-2507's do): stories260K then
# "thinks" until a budget ends the thought
OPENS_THOUGHT = open(QWEN3).read().replace("{{- '<|im_start|>assistant\\n' }}",
                                           "{{- '<|im_start|>assistant\\n<think>\\n' }}")
HI = [{"role": "user", "content": "hi"}]


def _thinking_llm(**options):
    import corelm
    llm = corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=1, max_seq_len=256, **options)
    llm.engine.tokenizer.chat_template = OPENS_THOUGHT
    return llm


def _steps(budget, in_thought, pieces):
    """ThinkingBudget over (text per token): the step at which it first forces a token, or None."""
    from corelm.engine.thinking import ThinkingBudget
    b = ThinkingBudget(budget, [7, 8], in_thought)
    for i, text in enumerate(pieces):
        if b.forced() is not None:
            return i
        b.advance(i, text)
    return None if b.forced() is None else len(pieces)


def test_budget_counts_the_tokens_inside_the_thought():
    assert _steps(3, True, ["a", "b", "c", "d"]) == 3
    assert _steps(0, True, ["a"]) == 0
    assert _steps(2, False, [" <th", "ink>", "a", "b", "c"]) == 4      # the model opened it: counted after
    assert _steps(0, False, ["<think>", "a"]) == 1
    assert _steps(3, True, ["a", "</th", "ink>", "b", "c"]) is None    # closed in time: nothing forced
    assert _steps(2, False, ["Hello", "a", "b", "c"]) is None          # no thought at all


def test_the_thought_ends_at_the_budget_and_the_answer_follows():
    from corelm import SamplingParams
    from corelm.engine.thinking import END_OF_THOUGHT
    llm = _thinking_llm()
    tok = llm.engine.tokenizer
    free = llm.chat(HI, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert "</think>" not in free.text      # left alone, it never ends the thought
    for budget in (0, 5):
        out = llm.chat(HI, SamplingParams(temperature=0, max_tokens=40, max_thinking_tokens=budget))[0].outputs[0]
        end = tok.encode(END_OF_THOUGHT, add_special_tokens=False)
        assert out.token_ids[:budget] == free.token_ids[:budget]        # the thought as the model thinks it
        assert out.token_ids[budget:budget + len(end)] == end           # then ended
        assert len(out.token_ids) == 40 and split_reasoning(out.text, True)[1]    # and an answer follows
    # an engine default for requests without one; -1 in a request lifts it
    llm = _thinking_llm(reasoning_budget=3)
    out = llm.chat(HI, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert out.token_ids[:3] == free.token_ids[:3] and out.token_ids[3:3 + len(end)] == end
    out = llm.chat(HI, SamplingParams(temperature=0, max_tokens=40, max_thinking_tokens=-1))[0].outputs[0]
    assert out.token_ids == free.token_ids


def test_max_thinking_tokens_through_the_server():
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_server import running_server
    served = _thinking_llm()
    with running_server(lambda: served) as s:
        assert s.state.wait_ready(30)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)
        free = client.chat.completions.create(model="m", messages=HI, max_tokens=40, temperature=0)
        assert free.choices[0].message.content is None      # all thought
        r = client.chat.completions.create(model="m", messages=HI, max_tokens=40, temperature=0,
                                           extra_body={"max_thinking_tokens": 4})
        msg = r.choices[0].message
        thought = msg.model_extra["reasoning_content"]
        assert free.choices[0].message.model_extra["reasoning_content"].startswith(thought) and msg.content
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=HI, extra_body={"max_thinking_tokens": -2})
        assert e.value.body["param"] == "max_thinking_tokens"
        # the Responses API takes it too
        r = client.responses.create(model="m", input="hi", max_output_tokens=40, temperature=0,
                                    extra_body={"max_thinking_tokens": 4})
        assert [i.type for i in r.output] == ["reasoning", "message"] and r.output[0].content[0].text == thought


def test_reasoning_budget_flag():
    import argparse
    from corelm.entrypoints.cli.flags import add_engine_flags, engine_options
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert "reasoning_budget" not in engine_options(p.parse_args([]))
    assert engine_options(p.parse_args(["--reasoning-budget", "0"]))["reasoning_budget"] == 0
    with pytest.raises(ValueError):
        _thinking_llm(reasoning_budget=-2)
