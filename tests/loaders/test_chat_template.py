"""Chat templates: transformers-compatible rendering, the ChatML fallback, and the sandbox."""
import json
import os

import pytest

from corelm.loader.gguf import read_gguf
from corelm.tokenizer import CHATML_TEMPLATE, ChatTemplateError, ChatTemplateSecurityError, Tokenizer
from corelm.tokenizer.chat_template import MAX_TEMPLATE_BYTES

from conftest import FIXTURES, MODELS, real_model

STORIES_DIR = os.path.join(MODELS, "stories260K")
SMOLLM2_HF_DIR = os.path.join(MODELS, "smollm2-hf-meta")     # committed tokenizer files of SmolLM2
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"             # real models: names for conftest.real_model
QWEN2_GGUF = "qwen2.5-coder-0.5b-instruct.gguf"

USER = [{"role": "user", "content": "Hi there"}]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "Thanks ünïcode 😀"}]


@pytest.fixture(scope="module")
def stories():
    """A tokenizer without a chat template; tests pass their own."""
    return Tokenizer.from_hf_folder(STORIES_DIR)


@pytest.fixture(scope="module")
def smollm2():
    return Tokenizer.from_gguf_metadata(read_gguf(real_model(SMOLLM2_GGUF)).metadata)


def render(tok, template, messages=USER, **kwargs):
    return tok.apply_chat_template(messages, chat_template=template, **kwargs)


# ---------------------------------------------------------------------------------------------
# Rendering like transformers

def test_smollm2_template(smollm2):
    expected = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.apply_chat_template(USER) == expected
    assert smollm2.apply_chat_template(USER, add_generation_prompt=False) == expected[:-len("<|im_start|>assistant\n")]
    text = smollm2.apply_chat_template(CONVERSATION)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nThanks ünïcode 😀<|im_end|>\n<|im_start|>assistant\n")


def _fixture(name):
    with open(os.path.join(FIXTURES, f"tokenizer_{name}.json"), encoding="utf-8") as f:  # committed: never skip
        return json.load(f)


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5-coder"])
def test_fixture_template_renders_like_transformers(name):
    """The fixture's own template, rendered by our engine, gives transformers' text: needs no model files
    (neither template uses bos_token or eos_token, so the stories260K tokenizer can carry it)."""
    doc = _fixture(name)
    assert doc["chat"], "the fixture has no chat cases"
    assert "bos_token" not in doc["chat_template"] and "eos_token" not in doc["chat_template"]
    tok = Tokenizer.from_hf_folder(STORIES_DIR)
    for case in doc["chat"]:
        text = tok.apply_chat_template(case["messages"], chat_template=doc["chat_template"],
                                       add_generation_prompt=case["add_generation_prompt"])
        assert text == case["text"], case["messages"]


# The tokenizers whose template and ids are checked against tokenizer_<name>.json: the committed SmolLM2
# HF files always; the GGUFs through conftest.real_model.
FIXTURE_SOURCES = {
    "smollm2-hf": ("smollm2", lambda: Tokenizer.from_hf_folder(SMOLLM2_HF_DIR)),
    "smollm2-gguf": ("smollm2", lambda: Tokenizer.from_gguf_metadata(read_gguf(real_model(SMOLLM2_GGUF)).metadata)),
    "qwen2.5-coder-gguf": ("qwen2.5-coder",
                           lambda: Tokenizer.from_gguf_metadata(read_gguf(real_model(QWEN2_GGUF)).metadata)),
}


@pytest.mark.parametrize("source", list(FIXTURE_SOURCES))
def test_matches_transformers_fixture(source):
    """Prompts rendered by transformers' apply_chat_template (tools/fixtures/make_fixtures.py), byte for byte."""
    name, build = FIXTURE_SOURCES[source]
    doc = _fixture(name)
    tok = build()
    assert tok.chat_template == doc["chat_template"]
    assert doc["chat"], "the fixture has no chat cases"
    for case in doc["chat"]:
        text = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert text == case["text"], case["messages"]
        assert tok.encode(text, add_special_tokens=False) == case["ids"], case["messages"]


def test_chatml_fallback_when_model_has_none(stories, caplog):
    assert stories.chat_template is None
    text = stories.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "no chat template" in caplog.text
    assert stories.apply_chat_template(USER, chat_template=CHATML_TEMPLATE, add_generation_prompt=False) == \
        "<|im_start|>user\nHi there<|im_end|>\n"


def test_trim_and_lstrip_blocks(stories):
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    assert render(stories, template, CONVERSATION) == "[2+2?]\n[Thanks ünïcode 😀]\n"


def test_special_token_variables_and_kwargs(stories):
    template = "{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}|{{ custom }}"
    assert render(stories, template, custom=7) == "<s>|</s>|True|True|True|7"
    assert render(stories, "{{ tools | length }}", tools=[{"name": "f"}]) == "1"


def test_tojson_keeps_unicode_and_supports_indent(stories):
    data = [{"name": "météo", "args": {"b": 1, "a": "<&>"}}]
    assert render(stories, "{{ tools | tojson }}", tools=data) == json.dumps(data, ensure_ascii=False)
    assert render(stories, "{{ tools | tojson(indent=2) }}", tools=data) == json.dumps(data, ensure_ascii=False, indent=2)


def test_loop_controls_strftime_and_generation_block(stories):
    template = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.role[0] }}{% endfor %}"
                "|{{ strftime_now('%Y') | length }}|{% generation %}gen{% endgeneration %}")
    assert render(stories, template, CONVERSATION) == "su|4|gen"


def test_messages_must_be_dicts_with_roles(stories):
    with pytest.raises(ValueError, match="list of dicts"):
        stories.apply_chat_template("hello")
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict"):
        stories.apply_chat_template(["hello"])
    with pytest.raises(ValueError, match=r"messages\[1\] has no 'role'"):
        stories.apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])


# ---------------------------------------------------------------------------------------------
# Errors raised by or about the template

def test_raise_exception_gives_clear_error(stories):
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation must start with a system message') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="rejected the conversation: Conversation must start with a system"):
        render(stories, template)
    assert isinstance(ChatTemplateError("x"), ValueError)


def test_syntax_error_names_the_line(stories):
    with pytest.raises(ChatTemplateError, match="syntax error on line 2"):
        render(stories, "ok\n{% for m in messages %}no end")


@pytest.mark.parametrize("template, message", [
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ messages[5].content.upper() }}", "failed while rendering"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
])
def test_runtime_errors_become_chat_template_errors(stories, template, message):
    with pytest.raises(ChatTemplateError, match=message):
        render(stories, template)


def test_template_over_the_size_limit_is_rejected(stories):
    with pytest.raises(ChatTemplateError, match=f"over the {MAX_TEMPLATE_BYTES}-byte limit"):
        render(stories, "x" * (MAX_TEMPLATE_BYTES + 1))


def test_non_string_template_is_rejected(stories):
    tok = Tokenizer.from_hf_folder(STORIES_DIR)
    tok.chat_template = 42
    with pytest.raises(ChatTemplateError, match="must be a string"):
        tok.apply_chat_template(USER)


# ---------------------------------------------------------------------------------------------
# The sandbox: hostile templates are stopped before they do anything

@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('touch /tmp/corelm_pwned') }}",
    "{{ joiner.__init__.__globals__.os.popen('id').read() }}",
    "{{ raise_exception.__globals__['os'].system('id') }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('id') }}",
    "{% set x = messages.append({'role': 'user', 'content': 'injected'}) %}{{ x }}",
    "{% set _ = messages[0].update({'content': 'changed'}) %}",
])
def test_sandbox_blocks_escapes(stories, template, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(os, "popen", lambda *a: calls.append(a))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateSecurityError, match="unsafe"):
        render(stories, template, messages)
    assert calls == []
    assert messages == [{"role": "user", "content": "hi"}]
    assert not os.path.exists("/tmp/corelm_pwned")


@pytest.mark.parametrize("template, message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loops over more than"),
    ("{{ 'x' * 1000000000 }}", "builds a sequence of"),
    ("{{ [1, 2] * 1000000000 }}", "builds a sequence of"),
    ("{{ 10 ** 100000000 }}", "raises to the power"),
])
def test_rendering_is_bounded(stories, template, message):
    with pytest.raises(ChatTemplateError, match=message):
        render(stories, template)


def test_range_budget_is_per_render(stories):
    template = "{% for i in range(600000) %}{% endfor %}ok"
    assert render(stories, template) == "ok"
    assert render(stories, template) == "ok"     # the budget of the previous render does not carry over


# ---------------------------------------------------------------------------------------------
# Real models' templates (tests/data/templates, from llama.cpp's models/templates) against transformers'
# renderings (tools/fixtures/make_template_fixtures.py): Qwen3's enable_thinking and reasoning turns, tools, Gemma's
# and Phi-3.5's turns.

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "templates")


def _real_template_cases():
    doc = json.load(open(os.path.join(FIXTURES, "templates_real.json"), encoding="utf-8"))
    return [pytest.param(name, case, id=f"{name[:-6]}-{i}") for name, cases in doc.items() for i, case in enumerate(cases)]


@pytest.mark.parametrize("name,case", _real_template_cases())
def test_real_templates_render_as_transformers(name, case):
    tok = Tokenizer.from_hf_folder(os.path.join(MODELS, "stories260K"))
    template = open(os.path.join(TEMPLATES, name), encoding="utf-8").read()
    text = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                   chat_template=template, **case["kwargs"])
    assert text == case["text"]
