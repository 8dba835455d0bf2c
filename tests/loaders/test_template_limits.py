"""Chat templates that crashed the process or cost seconds before failing (issue 50).

- A value nested ~240k levels deep (`{% set ns.t = ((...(ns.t,)...),) %}` in a loop) made hash() of it (a dict
  key, `unique`) overflow the C stack: SIGSEGV, no exception. Values are now bounded to MAX_VALUE_DEPTH
  levels wherever the sandbox builds them. The reproducers run in child processes: a segfault there is a
  failed test, not a dead pytest.
- A 1 MiB template of 44,000 `{% set %}` lines cost 2 s of compiling (plus 1.8 s more on an abandoned
  thread) before failing, and a template ending in a syntax error was compiled again for every request.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import MODELS, ROOT, child_env

from corelm.tokenizer import chat_template as ct
from corelm.tokenizer.chat_template import (MAX_TEMPLATE_BYTES, MAX_TEMPLATE_TOKENS, MAX_VALUE_DEPTH,
                                            ChatTemplateError, render_chat_template)

USER = [{"role": "user", "content": "hi"}]
LOOP = "{% set ns = namespace(t=()) %}{% for i in range(4000) %}{% set ns.t = " + "(" * 60 + "ns.t" + ",)" * 60 + \
       " %}{% endfor %}"
# Each grows a chain of tuples one way or another, then hashes it.
DEEP = {
    "tuple_literal_dict_key": LOOP + "{{ {ns.t: 1} }}",
    "tuple_literal_unique": LOOP + "{{ [ns.t, ns.t]|unique|list }}",
    "items_filter": "{% set ns = namespace(t=()) %}{% for i in range(300000) %}"
                    "{% set ns.t = dict(a=ns.t)|items|first %}{% endfor %}{{ {ns.t: 1} }}",
    "dictsort_filter": "{% set ns = namespace(t=()) %}{% for i in range(300000) %}"
                       "{% set ns.t = dict(a=ns.t)|dictsort|first %}{% endfor %}{{ {ns.t: 1} }}",
    "groupby_filter": "{% set ns = namespace(t=()) %}{% for i in range(300000) %}"
                      "{% set ns.t = (dict(a=ns.t),)|groupby('a')|first %}{% endfor %}{{ {ns.t: 1} }}",
    "macro_varargs": "{% set ns = namespace(t=()) %}{% macro f() %}{% set ns.t = varargs %}{% endmacro %}"
                     "{% for i in range(300000) %}{{ f(ns.t) }}{% endfor %}{{ {ns.t: 1} }}",
    "cycler_items": "{% set ns = namespace(t=()) %}{% for i in range(300000) %}"
                    "{% set ns.t = cycler(ns.t).items %}{% endfor %}{{ {ns.t: 1} }}",
    "namespace_chain": "{% set n = namespace(cur=none) %}{% for i in range(300000) %}{% set m = namespace() %}"
                       "{% set m.p = n.cur %}{% set n.cur = m %}{% endfor %}{{ n.cur }}",
    "unrolled_sets": "{% set x = () %}" + "{% set x = (((((((((((x,),),),),),),),),),),) %}" * 700 + "{{ {x: 1} }}",
}

CHILD = r"""
import json, sys
from corelm.tokenizer.chat_template import render_chat_template
out = {}
for name, template in json.load(sys.stdin).items():
    print(name, flush=True, file=sys.stderr)        # the last name printed is the one that crashed
    try:
        render_chat_template(template, [{"role": "user", "content": "hi"}], add_generation_prompt=True,
                             special_tokens={})
        out[name] = "rendered"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_deeply_nested_values_are_refused_not_a_segfault():
    r = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(DEEP), capture_output=True, text=True,
                       env=child_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, f"status {r.returncode} after: {r.stderr[-2000:]}"
    results = json.loads(r.stdout)
    for name, out in results.items():
        assert out == f"ChatTemplateError: chat template builds a value nested more than {MAX_VALUE_DEPTH} " \
                      "levels deep", (name, out)


def test_corelm_generate_chat_with_the_template_in_a_model_folder(tmp_path):
    model = tmp_path / "stories"
    shutil.copytree(os.path.join(MODELS, "stories260K"), model, ignore=shutil.ignore_patterns("*.gguf"))
    (model / "chat_template.jinja").write_text(DEEP["tuple_literal_dict_key"])
    r = subprocess.run([sys.executable, "-m", "corelm.entrypoints.cli", "generate", str(model), "--chat",
                        "-p", "hi", "-n", "4", "-t", "1"], capture_output=True, text=True, env=child_env(),
                       cwd=ROOT, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert f"error: chat template builds a value nested more than {MAX_VALUE_DEPTH} levels deep" in r.stderr


def _render(template, messages=USER):
    return render_chat_template(template, messages, add_generation_prompt=True, special_tokens={})


def test_values_up_to_the_depth_limit_render():
    # a chain exactly MAX_VALUE_DEPTH levels deep (the outermost literal included) renders, one more does not
    build = "{% set ns = namespace(t=1) %}{% for i in range(N) %}{% set ns.t = [ns.t] %}{% endfor %}" \
            "{{ ns.t|tojson|length }}"
    assert _render(build.replace("N", str(MAX_VALUE_DEPTH))) == str(2 * MAX_VALUE_DEPTH + 1)
    with pytest.raises(ChatTemplateError, match="nested more than"):
        _render(build.replace("N", str(MAX_VALUE_DEPTH + 1)))


def test_shared_and_self_holding_values_are_cheap_and_fine():
    # [x, x] doubled 200 times: 2^200 paths, 200 distinct values; a namespace holding itself
    doubled = "{% set ns = namespace(t=0) %}{% for i in range(200) %}{% set ns.t = [ns.t, ns.t] %}{% endfor %}" \
              "{{ ns.t[1][0][1]|length }}"
    assert _render(doubled) == "2"
    assert _render("{% set ns = namespace() %}{% set ns.me = ns %}{% set x = [ns, (ns,)] %}{{ x|length }}") == "2"


def test_a_list_grown_in_a_loop_is_not_walked_again_at_every_step():
    # ns.l + [m]: `+` nests no deeper, so 5,000 appends cost 5,000 small checks, not the 1.25*10^7 visits
    # (over the operation budget) of walking the list at every step
    template = "{% set ns = namespace(l=[]) %}{% for m in messages * 2500 %}{% set ns.l = ns.l + [m] %}" \
               "{% endfor %}{{ ns.l|length }}"
    assert _render(template, USER * 2) == "5000"


def test_a_1mib_template_of_set_lines_is_refused_at_once():
    template = "".join(f"{{% set a = {i} %}}\n" for i in range(44_000))
    assert 800_000 < len(template) <= 1 << 20      # under the old 1 MiB limit: it used to be compiled
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=f"over the {MAX_TEMPLATE_BYTES}-byte limit"):
        _render(template)
    assert time.perf_counter() - t0 < 0.5


def test_too_many_tokens_are_refused_before_parsing():
    template = "{% set v = 1 %}\n" * (MAX_TEMPLATE_TOKENS // 4)      # ~7 tokens each, under the byte limit
    assert len(template.encode()) <= MAX_TEMPLATE_BYTES
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=f"more than {MAX_TEMPLATE_TOKENS} tokens"):
        _render(template)
    assert time.perf_counter() - t0 < 1.0


def test_a_template_that_does_not_compile_fails_from_the_cache_the_second_time(monkeypatch):
    parses = []
    original = ct._BoundedSandbox._parse

    def counting_parse(self, source, name, filename):
        parses.append(source)
        return original(self, source, name, filename)

    monkeypatch.setattr(ct._BoundedSandbox, "_parse", counting_parse)
    template = f"{{{{ messages[0].content }}}} {time.time_ns()} {{% if x %}}"     # unique: nothing cached yet
    errors = []
    for _ in range(3):
        with pytest.raises(ChatTemplateError) as e:
            _render(template)
        errors.append(str(e.value))
    assert len(parses) == 1
    assert errors[0] == errors[1] == errors[2] and "syntax error" in errors[0]
    # a good template still compiles once and is reused
    stamp = str(time.time_ns())
    good = "{{ messages[0].content }} " + stamp
    assert _render(good) == _render(good) == "hi " + stamp
    assert len(parses) == 2
