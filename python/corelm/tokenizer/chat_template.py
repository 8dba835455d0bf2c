"""Render Jinja chat templates the way transformers does, inside a sandbox.

Templates come from model files, which may be hostile, so:
  - they run in jinja2's ImmutableSandboxedEnvironment (no attribute access to internals such as
    `__class__`, no mutation of the arguments, no way to reach `os`);
  - templates over 1 MiB are refused; `range` has a per-render budget and `*` / `**` refuse huge
    results, so a template cannot loop or allocate without bound.
The environment otherwise matches transformers' (`trim_blocks`, `lstrip_blocks`, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text and takes `indent`, and a no-op
`{% generation %}` block), so prompts are byte-identical to `tokenizer.apply_chat_template`.
"""
from __future__ import annotations

import contextvars
import functools
import json
from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_TEMPLATE_BYTES = 1 << 20
MAX_RANGE_ITEMS = 1_000_000         # total items all `range()` calls of one render may produce
MAX_REPEAT_ITEMS = 1_000_000        # longest string/list `x * n` may build

# Used when a model ships no template: ChatML, the format transformers used as its default and that
# SmolLM2 and Qwen use. A base model without a template was not trained on any chat format, so the
# fallback only gives chat a reasonable shape; `Tokenizer.apply_chat_template` logs a warning.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template is malformed, rejected the conversation, or failed while rendering."""


class ChatTemplateSecurityError(ChatTemplateError):
    """The chat template tried something the sandbox forbids; nothing unsafe was executed."""


class _TemplateRaised(jinja2.TemplateError):
    """Raised by the template's own `raise_exception(...)`."""


def render_chat_template(template: str, messages: List[Mapping[str, Any]], *, add_generation_prompt: bool,
                         special_tokens: Dict[str, str], **kwargs: Any) -> str:
    """Render `template` with the variables transformers passes: messages, add_generation_prompt,
    tools, documents, the special-token strings (bos_token, eos_token, ...) and any extra kwargs."""
    _check_messages(messages)
    compiled = _compile(template)
    variables = {**special_tokens, "tools": None, "documents": None, **kwargs,
                 "messages": messages, "add_generation_prompt": add_generation_prompt}
    token = _range_budget.set(MAX_RANGE_ITEMS)
    try:
        return compiled.render(**variables)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateSecurityError(f"chat template tried an unsafe operation and was stopped: {e}") from None
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template rejected the conversation: {e.message}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed while rendering: {e}") from None
    except RecursionError:
        raise ChatTemplateError("chat template recursed too deeply") from None
    except Exception as e:      # a template can raise anything (TypeError on `+`, KeyError, ...)
        raise ChatTemplateError(f"chat template failed while rendering: {type(e).__name__}: {e}") from None
    finally:
        _range_budget.reset(token)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no 'role'")


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a string, got {type(template).__name__}")
    size = len(template.encode("utf-8", "surrogatepass"))
    if size > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"chat template is {size} bytes, over the {MAX_TEMPLATE_BYTES}-byte limit")
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error on line {e.lineno}: {e.message}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template could not be compiled: {e}") from None


# ---------------------------------------------------------------------------------------------
# The environment

_range_budget: contextvars.ContextVar[int] = contextvars.ContextVar("corelm_chat_template_range_budget",
                                                                     default=MAX_RANGE_ITEMS)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Refuses `x * n` and `a ** b` results too large to be legitimate prompt text."""
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT_ITEMS:
                    raise ChatTemplateError(f"chat template builds a sequence of {len(seq) * n} items")
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise ChatTemplateError(f"chat template raises to the power {right}")
        return super().call_binop(context, operator, left, right)


def _bounded_range(*args: int) -> range:
    r = range(*args)
    left = _range_budget.get() - len(r)
    if left < 0:
        raise ChatTemplateError(f"chat template loops over more than {MAX_RANGE_ITEMS} items in total")
    _range_budget.set(left)
    return r


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    for inference it only renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & for HTML and has no ensure_ascii; transformers replaces it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    return env
