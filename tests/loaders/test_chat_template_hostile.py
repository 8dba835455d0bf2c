"""Hostile chat templates end in a ChatTemplateError quickly and with bounded memory; normal templates
render exactly as plain jinja2 renders them. The corpus comes from the issue "Hostile input gets a
bounded, clear answer everywhere" (item 1) and more."""
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jinja2
import jinja2.ext
import psutil
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from corelm.tokenizer import ChatTemplateError, Tokenizer
from corelm.tokenizer import chat_template as ct

from conftest import FIXTURES, MODELS

STORIES_DIR = os.path.join(MODELS, "stories260K")
USER = [{"role": "user", "content": "hi"}]

_LOOP4 = ("{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}"
          "{% for d in range(1000) %}x{% endfor %}{% endfor %}{% endfor %}{% endfor %}")
_DOUBLE_MACRO = ("{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}{% endmacro %}"
                 "{{ d('x', 40) }}")
_DOUBLE_NS = ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
              "{{ ns.s|length }}")
_DOUBLE_NS_PLUS = ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
                   "{{ ns.s|length }}")
_DISTINCT = ("{% set ns = namespace(l=[], s='x' * 2000000) %}{% for i in range(1000) %}"
             "{% set ns.l = ns.l + [ns.s ~ i] %}{% endfor %}{{ ns.l|length }}")

# name -> template; each must raise ChatTemplateError within TIME_LIMIT_S with bounded memory.
HOSTILE = {
    # the examples
    "lipsum": "{{ lipsum(100000000) }}",
    "nested_loops_string": "{% for a in 'x' * 1000000 %}{% for b in 'x' * 1000000 %}{% endfor %}{% endfor %}",
    "nested_loops_messages": "{% for a in messages * 1000000 %}{% for b in messages * 1000000 %}{% endfor %}{% endfor %}",
    "replace_blowup": "{{ ('a' * 1000)|replace('a', 'b' * 1000000) }}",
    "format_width": "{{ '{:>1000000000}'.format('a') }}",
    "center_compile_time": "{{ 'a'|center(2000000000) }}",
    "wordwrap_1": "{{ ('x' * 1000000)|wordwrap(1) }}",
    "indent_huge": "{{ 'a\nb'|indent(1000000000) }}",
    "percent_width": "{{ '%01000000000d' % 1 }}",
    "double_macro": _DOUBLE_MACRO,
    "double_namespace": _DOUBLE_NS,
    "double_namespace_plus": _DOUBLE_NS_PLUS,
    # more
    "recursive_macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "recursive_macro_wide": "{% macro f(n) %}{{ f(n + 1) }}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "recursive_block": "{% block a %}{{ self.a() }}{{ self.a() }}{% endblock %}",
    "recursive_loop": "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "range_huge": "{% for i in range(10**9) %}{% endfor %}",
    "range_list": "{{ range(10**9)|list|length }}",
    "nested_4_deep": _LOOP4,
    "repeat_string": "{{ 'x' * 10**9 }}",
    "repeat_list": "{{ [0] * 10**9 }}",
    "repeat_list_of_big": "{{ ['x' * 2000000] * 1000 }}",
    "repeat_list_join": "{{ (['x' * 2000000] * 1000)|join }}",
    "repeat_list_tojson": "{{ (['x' * 2000000] * 1000)|tojson }}",
    "repeat_list_string": "{{ (['x' * 2000000] * 1000)|string|length }}",
    "repeat_list_concat": "{{ ((['x' * 2000000] * 1000) ~ 'a')|length }}",
    "repeat_list_percent": "{{ ('%s' % [['x' * 2000000] * 1000])|length }}",
    "repeat_list_format": "{{ '{}'.format(['x' * 2000000] * 1000)|length }}",
    "repeat_list_format_r": "{{ '{!r}'.format('x' * 2000000)|length }}{{ '{0}{0}{0}{0}{0}{0}{0}{0}'.format('x' * 2000000) }}",
    "distinct_big_strings": _DISTINCT,
    "map_upper_big": "{{ (['x' * 2000000] * 1000)|map('upper')|list|length }}",
    "dict_loop": "{% set d = dict(a=1) %}{% for k in (d.items()|list) * 1000000 %}{% for j in range(10) %}{% endfor %}{% endfor %}",
    "self_tricks": "{{ self }}{{ self.__init__.__globals__ }}",
    "self_context": "{{ self._TemplateReference__context.environment }}",
    "cycler_abuse": "{% set c = cycler(*range(1000000)) %}{% for i in range(1000000) %}{{ c.next() }}{% endfor %}",
    "joiner_abuse": "{% set j = joiner('x' * 1000000) %}{% for i in range(100000) %}{{ j() }}{% endfor %}",
    "format_nested_width": "{{ '{:>{w}}'.format('a', w=10**9) }}",
    "format_filter_width": "{{ '%1000000000s'|format('a') }}",
    "percent_star": "{{ '%*d' % (10**9, 1) }}",
    "percent_precision": "{{ '%.1000000000f' % 1.0 }}",
    "batch_huge": "{{ [1]|batch(10**9, 'x')|list }}",
    "slice_huge": "{{ [1]|slice(10**9)|list }}",
    "class_access": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals_access": "{{ cycler.__init__.__globals__ }}",
    "ljust_method": "{{ 'a'.ljust(10**9) }}",
    "center_method": "{{ 'a'.center(10**9) }}",
    "zfill_method": "{{ 'a'.zfill(10**9) }}",
    "expandtabs_method": "{{ ('\t' * 1000000).expandtabs(100000) }}",
    "replace_method": "{{ ('a' * 1000).replace('a', 'b' * 1000000) }}",
    "join_method": "{{ ('x' * 1000000).join(['y' * 1000000] * 1000) }}",
    "translate_method": "{{ 'a'.translate({97: 'b' * 1000}) }}",
    "to_bytes": "{{ (1).to_bytes(10**9, 'big') }}",
    "int_power_chain": "{{ ((9 ** 1024) ** 1024) ** 1024 }}",
    "int_square_loop": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
                        "{% endfor %}{{ ns.x > 0 }}"),
    "output_flood": "{% for i in range(1000000) %}{{ 'x' * 1000 }}{% endfor %}",
    "const_output_flood": "{% for i in range(1000000) %}" + "y" * 10000 + "{% endfor %}",
    "macro_buffer_flood": ("{% macro m() %}{% for i in range(1000) %}{{ 'x' * 1000000 }}{% endfor %}{% endmacro %}"
                           "{{ m()|length }}"),
    "set_block_flood": "{% set x %}{% for i in range(1000) %}{{ 'x' * 1000000 }}{% endfor %}{% endset %}{{ x|length }}",
    "sum_lists": "{{ ([[0] * 1000] * 100000)|sum(start=[])|length }}",
    "sort_big": "{% for i in range(100) %}{{ (range(1000000)|list)|sort|length }}{% endfor %}",
    "split_loop": "{% for i in range(100000) %}{{ (('a ' * 100000).split())|length }}{% endfor %}",
    "strftime_width": "{{ strftime_now('%1000000000Y') }}",
    "autoescape_container": "{% autoescape true %}{{ ['x' * 2000000] * 1000 }}{% endautoescape %}",
    "escape_filter": "{{ (['&' * 2000000] * 1000)|map('e')|list|length }}",
    "unicode_repeat": "{{ ('😀' * 2000000) ~ ('😀' * 2000000) }}",
    "deep_parens": "{{ " + "(" * 50000 + "1" + ")" * 50000 + " }}",
    "while_true_ish": "{% for i in range(1000000) %}{% for j in range(1000000) %}{{ i }}{% endfor %}{% endfor %}",
    "loop_length_big": "{% for i in range(1000000) %}{{ loop.length }}{% endfor %}",
    "attr_spin": "{% for i in range(1000000) %}{{ messages[0].role.upper().lower() }}{% endfor %}{% for i in range(1000000) %}{% endfor %}",
}
TIME_LIMIT_S = 2.0
RSS_LIMIT = 200 << 20


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_hf_folder(STORIES_DIR)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_stopped(tok, name):
    proc = psutil.Process()
    rss = proc.memory_info().rss
    peak = [rss]
    done = threading.Event()

    def watch():      # the peak resident size while the template renders
        while not done.wait(0.005):
            peak[0] = max(peak[0], proc.memory_info().rss)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.monotonic()
    try:
        with pytest.raises(ChatTemplateError) as info:
            tok.apply_chat_template(USER, chat_template=HOSTILE[name])
    finally:
        elapsed = time.monotonic() - start
        done.set()
        watcher.join()
    assert elapsed < TIME_LIMIT_S, (name, elapsed, str(info.value))
    assert peak[0] - rss < RSS_LIMIT, (name, (peak[0] - rss) >> 20)
    assert str(info.value).startswith("chat template"), str(info.value)


def test_no_render_thread_outlives_its_budget(tok):
    spin = HOSTILE["attr_spin"]
    with ThreadPoolExecutor(8) as pool:
        errors = list(pool.map(lambda _: _error(tok, spin), range(8)))
    assert all(isinstance(e, ChatTemplateError) for e in errors), errors
    deadline = time.monotonic() + 2
    while any(t.name == "chat-template" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a chat-template thread is still running"
        time.sleep(0.01)


def _error(tok, template):
    try:
        tok.apply_chat_template(USER, chat_template=template)
    except Exception as e:      # noqa: BLE001 -- returned to the test
        return e
    return None


# ---------------------------------------------------------------------------------------------
# Normal templates render exactly as plain jinja2 renders them

def _fixture_template(name):
    with open(os.path.join(FIXTURES, f"tokenizer_{name}.json"), encoding="utf-8") as f:
        return json.load(f)["chat_template"]


NORMAL = {
    "smollm2": _fixture_template("smollm2"),
    "qwen2.5": _fixture_template("qwen2.5-coder"),
    "chatml": ct.CHATML_TEMPLATE,
    "llama3": (
        "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
        "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
        "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools is not none %}"
        "{{- 'Environment: ipython\\n' }}{%- endif %}{{- 'Cutting Knowledge Date: December 2023\\n' }}"
        "{{- 'Today Date: ' + strftime_now('%d %b %Y')|length|string + '\\n\\n' }}{%- if tools is not none %}"
        "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}{%- endif %}"
        "{{- system_message }}{{- '<|eot_id|>' }}{%- for message in messages %}"
        "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}"
        "{%- elif 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}"
        "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
        "{{- '}' }}{{- '<|eot_id|>' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"),
    "mistral": (
        "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
        "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
        "{{- bos_token }}{%- for message in loop_messages %}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
        "{%- if message['role'] == 'user' %}{%- if loop.first and system_message is defined %}"
        "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
        "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
        "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token}}{%- endif %}{%- endfor %}"),
    "gemma": (
        "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"),
    "deepseek_r1_like": (
        "{% set ns = namespace(is_first=false, system_prompt='') %}{%- for message in messages %}"
        "{%- if message['role'] == 'system' %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{%- endif %}"
        "{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}"
        "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
        "{%- if message['role'] == 'assistant' %}{% set content = message['content'] %}"
        "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
        "{{ '<｜Assistant｜>' + content.strip() + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
        "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"),
    "features": (
        "{% macro render(m, depth=0) %}{{ '  ' * depth }}{{ m.role|upper }}: {{ m.content|replace('\\n', ' ')|truncate(40) }}"
        "{% endmacro %}{% set sep = joiner(' | ') %}{% for m in messages %}{{ sep() }}{{ render(m, loop.index0) }}"
        "[{{ loop.cycle('odd', 'even') }} {{ loop.index }}/{{ loop.length }}{{ ' last' if loop.last }}]{% endfor %}\n"
        "{{ messages|map(attribute='role')|join(',') }} {{ messages|selectattr('role', 'equalto', 'user')|list|length }}"
        " {{ messages|rejectattr('role', 'in', ['system'])|map(attribute='content')|map('length')|sum }}"
        " {{ '%s=%05.1f' % ('x', 3.14159) }} {{ '{}-{:>6}-{!r}'.format('a', 'b', 'c') }} {{ 'ab'|center(6) }}|"
        "{{ 'a\\nb'|indent(2, true) }} {{ ('word ' * 5)|wordwrap(8) }} {{ [3, 1, 2]|sort|reverse|list }}"
        " {{ {'b': 1, 'a': 2}|dictsort }} {{ [1, 2, 3, 4, 5]|batch(2)|list }} {{ [1, 2, 3]|slice(2)|list }}"
        " {{ 'x' ~ 1 ~ none }} {{ (tools or [])|tojson }} {{ 7 is divisibleby 7 }} {{ 'Ab'.lower().startswith('a') }}"
        " {{ 2 ** 10 }} {{ [1] + [2] }} {{ 'a,b'.split(',') }} {{ messages[0] }} {{ range(3)|list }}"
        "{% for x in [[1, [2]], [3]] recursive %}({{ x if x is number else loop(x) }}){% endfor %}"
        "{% set c = cycler('a', 'b') %}{{ c.next() }}{{ c.next() }}{{ c.next() }} {{ 'é'|title }} {{ 12345|filesizeformat }}"
        "{% filter upper %}shout{% endfilter %}{% set block %}set {{ 1 }}{% endset %}{{ block }}"
        "{{ dict(a=1).items()|list }} {{ 'x'.zfill(4) }} {{ 'ab'.replace('a', 'c') }} {{ '-'.join(['a', 'b']) }}"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>sum</think>4"}, {"role": "user", "content": "Thanks ünïcode 😀\nbye"}],
]


def _reference_environment():
    """The sandbox as it was before budgets: plain jinja2 with transformers' settings."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[ct._GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env


@pytest.mark.parametrize("name", list(NORMAL))
@pytest.mark.parametrize("tools", [None, [{"name": "f", "parameters": {"x": "météo <&>"}}]], ids=["", "tools"])
def test_normal_templates_render_as_before(tok, name, tools):
    reference = _reference_environment().from_string(NORMAL[name])
    for messages in CONVERSATIONS:
        for gen in (True, False):
            variables = {"bos_token": "<s>", "eos_token": "</s>", "tools": tools, "documents": None,
                         "messages": messages, "add_generation_prompt": gen}
            try:
                expected = reference.render(**variables)
            except ValueError:          # the template's raise_exception
                with pytest.raises(ChatTemplateError, match="rejected the conversation"):
                    tok.apply_chat_template(messages, add_generation_prompt=gen, chat_template=NORMAL[name],
                                            tools=tools)
                continue
            got = tok.apply_chat_template(messages, add_generation_prompt=gen, chat_template=NORMAL[name], tools=tools)
            assert got == expected


def test_long_conversations_fit_the_budget(tok):
    """The size limits grow with the input: a 3 MB message (over the fixed 2 Mi part) and a thousand
    turns render with the real templates, quickly."""
    big = [{"role": "user", "content": "word " * 600_000}]
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 20} for i in range(1000)]
    for name in ("smollm2", "qwen2.5", "llama3", "deepseek_r1_like"):
        for messages in (big, many):
            start = time.monotonic()
            text = tok.apply_chat_template(messages, chat_template=NORMAL[name])
            assert time.monotonic() - start < 1.0
            assert messages[-1]["content"].strip() in text
