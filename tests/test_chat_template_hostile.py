"""Hostile chat templates end in a ChatTemplateError quickly and with bounded memory; normal templates
render exactly as plain jinja2 renders them. The corpus comes from the issue "Hostile input gets a
bounded, clear answer everywhere" (item 1) and more."""
import json
import os
import threading
import time

import jinja2
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
