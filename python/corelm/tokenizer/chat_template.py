"""Render Jinja chat templates the way transformers does, inside a sandbox with a budget.

Templates come from model files, which may be hostile, so:
  - they run in jinja2's ImmutableSandboxedEnvironment (no attribute access to internals such as
    `__class__`, no mutation of the arguments, no way to reach `os`);
  - only whitelisted globals, filters, tests and methods of builtin values exist (no `lipsum`, no
    `pprint`/`urlize`/`random`/..., no `str.translate`, `int.to_bytes`, ...);
  - every render has a budget (see the constants below): operations (loop iterations, calls, attribute
    and item lookups, operators, filters), wall time, nested calls, the length of any one string or
    list it builds and of the rendered text, and the characters it allocates in total. Anything that
    can build a large value (`*`, `+`, `~`, `%`, `.format`, `center`, `indent`, `replace`, `join`,
    `wordwrap`, `tojson`, `str()` of a container, ...) checks the result size against the budget
    *before* building it. Jinja's compile-time constant folding runs none of these (they refuse to
    fold), so compiling a template costs no more than parsing it;
  - no value a template builds nests more than MAX_VALUE_DEPTH levels deep: hashing a tuple that holds
    a tuple ... 200k levels deep (a dict key, `unique`, `in`) overflows the C stack, which no Python
    exception catches. Every place a value can wrap others checks the depth of what it built: tuple,
    list and dict literals, calls (`dict()`, `namespace()`, `cycler()`, macros' varargs), filters and
    namespaces stored in a namespace; `+`, `*` and slicing never nest deeper, so a loop that grows a
    list (`ns.items + [x]`) is not traversed again at every step;
  - compiling has a budget as well: at most MAX_TEMPLATE_BYTES of source and MAX_TEMPLATE_TOKENS
    tokens (the cost of parsing and compiling follows the tokens), and a template that fails to
    compile is remembered, so asking again fails at once with the same error;
  - renders run on their own daemon threads, at most MAX_CONCURRENT_RENDERS at a time; the caller
    waits at most RENDER_DEADLINE_S (plus a grace second) and a runaway render stops itself at its
    next budget check, so no thread spins on.
Every failure, including MemoryError and RecursionError, becomes a ChatTemplateError (a ValueError).
The environment otherwise matches transformers' (`trim_blocks`, `lstrip_blocks`, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text and takes `indent`, and a no-op
`{% generation %}` block), so prompts are byte-identical to `tokenizer.apply_chat_template`.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import re
import threading
import time
import types
from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.tests
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.lexer import TokenStream
from jinja2.runtime import LoopContext, Macro, markup_join
from jinja2.sandbox import (ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter,
                            SecurityError)
from jinja2.utils import Cycler, Joiner, Namespace, _PassArg
from markupsafe import Markup

# Real templates are under 64 KiB (Qwen3's is 4 KiB and ~1,000 tokens; tool-calling ones reach ~20 KiB); these
# bounds leave room for 4x that while keeping a compile under ~0.3 s and a few MB.
MAX_TEMPLATE_BYTES = 256 << 10
MAX_TEMPLATE_TOKENS = 32_768        # lexer tokens: what parsing and compiling cost grows with
COMPILE_CACHE_SIZE = 16             # compiled templates kept, and failed ones remembered
MAX_VALUE_DEPTH = 256               # nesting of values built by a template (JSON tool schemas nest ~10-30)
MAX_RANGE_ITEMS = 1_000_000         # total items all `range()` calls of one render may produce
MAX_RENDER_OPS = 2_000_000          # loop iterations, calls, lookups, operators and filters per render
RENDER_DEADLINE_S = 1.0             # wall time per render
MAX_CALL_DEPTH = 64                 # nested macro / block / recursive-loop calls
MAX_TEXT_ITEMS = 2 << 20            # longest string or list a render builds, and its output...
TEXT_PER_INPUT_CHAR = 4             # ...plus this many per character of the conversation (and tools, ...)
ALLOCATED_PER_TEXT = 16             # characters allocated in total: this many times the longest allowed
MAX_INT_BITS = 1 << 16              # largest integer `*` and `**` may build
MAX_CONCURRENT_RENDERS = 4
MAX_REPEAT_ITEMS = MAX_TEXT_ITEMS   # the old name of the limit on `x * n`

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
    tools, documents, the special-token strings (bos_token, eos_token, ...) and any extra kwargs.
    Runs on a render thread under the budget; raises ChatTemplateError for anything that goes wrong."""
    _check_messages(messages)
    variables = {**special_tokens, "tools": None, "documents": None, **kwargs,
                 "messages": messages, "add_generation_prompt": add_generation_prompt}
    return _run_bounded(template, variables)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no 'role'")


# ---------------------------------------------------------------------------------------------
# Render threads

_slots_lock = threading.Lock()
_slots_pid = -1
_slots: threading.BoundedSemaphore


def _render_slots() -> threading.BoundedSemaphore:
    global _slots, _slots_pid
    with _slots_lock:
        if _slots_pid != os.getpid():      # after a fork the parent's render threads are not ours
            _slots, _slots_pid = threading.BoundedSemaphore(MAX_CONCURRENT_RENDERS), os.getpid()
        return _slots


def _run_bounded(template: str, variables: Dict[str, Any]) -> str:
    """Render on a daemon thread holding one of MAX_CONCURRENT_RENDERS slots; wait at most the deadline
    plus a grace second. The thread gives its slot back when it ends, which its budget makes soon."""
    slots = _render_slots()
    if not slots.acquire(timeout=RENDER_DEADLINE_S):
        raise ChatTemplateError(f"too many chat templates are rendering at once (at most {MAX_CONCURRENT_RENDERS}); "
                                "retry later")
    budget = _Budget(variables)
    result: List[Any] = []

    def work() -> None:
        try:
            result.append((True, _render(template, variables, budget)))
        except BaseException as e:          # noqa: B036 -- handed to the caller
            result.append((False, e))
        finally:
            slots.release()

    thread = threading.Thread(target=work, name="chat-template", daemon=True)
    try:
        thread.start()
    except BaseException:
        slots.release()
        raise
    thread.join(RENDER_DEADLINE_S + 1.0)
    if not result:
        budget.abandoned = True             # the thread stops at its next budget check
        raise ChatTemplateError(f"chat template took longer than {RENDER_DEADLINE_S:g} s to render")
    ok, value = result[0]
    if ok:
        return value
    raise value


def _render(template: str, variables: Dict[str, Any], budget: "_Budget") -> str:
    try:
        compiled = _compile(template)
        _state.budget = budget
        try:
            budget.start()
            out: List[str] = []
            total = 0
            for chunk in compiled.generate(**variables):
                total += len(chunk)
                if total > budget.cap:
                    raise ChatTemplateError(f"chat template output is over the {budget.cap}-character limit")
                out.append(chunk)
            return "".join(out)
        finally:
            _state.budget = None
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
    except MemoryError:
        raise ChatTemplateError("chat template ran out of memory") from None
    except Exception as e:      # a template can raise anything (TypeError on `+`, KeyError, ...)
        raise ChatTemplateError(f"chat template failed while rendering: {type(e).__name__}: {e}") from None


_failed_lock = threading.Lock()
_failed: "collections.OrderedDict[str, str]" = collections.OrderedDict()   # template -> why it does not compile


def _compile(template: str) -> jinja2.Template:
    """The compiled template (cached). A template that does not compile fails again at once, with the same
    error, from the cache of failures: a model's broken template costs one compile, not one per request."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a string, got {type(template).__name__}")
    if len(template) > MAX_TEMPLATE_BYTES:          # characters <= bytes: no need to encode it to know
        raise ChatTemplateError(f"chat template is at least {len(template)} bytes, over the "
                                f"{MAX_TEMPLATE_BYTES}-byte limit")
    size = len(template.encode("utf-8", "surrogatepass"))
    if size > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"chat template is {size} bytes, over the {MAX_TEMPLATE_BYTES}-byte limit")
    with _failed_lock:
        why = _failed.get(template)
        if why is not None:
            _failed.move_to_end(template)
    if why is not None:
        raise ChatTemplateError(why)
    try:
        return _compile_cached(template)
    except ChatTemplateError as e:
        if not getattr(e, "transient", False):
            with _failed_lock:
                _failed[template] = str(e)
                while len(_failed) > COMPILE_CACHE_SIZE:
                    _failed.popitem(last=False)
        raise


@functools.lru_cache(maxsize=COMPILE_CACHE_SIZE)
def _compile_cached(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except ChatTemplateError:
        raise
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error on line {e.lineno}: {e.message}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template could not be compiled: {e}") from None
    except RecursionError:
        raise ChatTemplateError("chat template is nested too deeply to compile") from None
    except MemoryError:
        e = ChatTemplateError("chat template ran out of memory while compiling")
        e.transient = True          # another try may have the memory: not remembered as a failure
        raise e from None
    except Exception as e:
        raise ChatTemplateError(f"chat template could not be compiled: {type(e).__name__}: {e}") from None


def _counted_tokens(stream: TokenStream):
    """The lexer's tokens, refused past MAX_TEMPLATE_TOKENS (before the parser and compiler see them)."""
    for n, token in enumerate(stream):
        if n >= MAX_TEMPLATE_TOKENS:
            raise ChatTemplateError(f"chat template has more than {MAX_TEMPLATE_TOKENS} tokens (tags, names, "
                                    "operators, text runs); real templates have a few thousand")
        yield token


# ---------------------------------------------------------------------------------------------
# The budget

class _Budget:
    """What one render may still spend. Lives on the render thread (`_state.budget`); outside a render
    (while jinja compiles and folds constants) every budgeted operation refuses to run."""

    def __init__(self, variables: Mapping[str, Any]):
        self.ops = MAX_RENDER_OPS
        self.range_left = MAX_RANGE_ITEMS
        self.depth = 0
        self.cap = MAX_TEXT_ITEMS + TEXT_PER_INPUT_CHAR * _input_chars(variables)
        self.allocated = ALLOCATED_PER_TEXT * self.cap
        self.deadline = float("inf")
        self.abandoned = False

    def start(self) -> None:
        self.deadline = time.monotonic() + RENDER_DEADLINE_S

    def charge(self, n: int = 1) -> None:
        self.ops -= n
        if self.ops < 0:
            raise ChatTemplateError(f"chat template did more than {MAX_RENDER_OPS} operations")
        if time.monotonic() > self.deadline or self.abandoned:
            raise ChatTemplateError(f"chat template took longer than {RENDER_DEADLINE_S:g} s to render")

    def size(self, n: int, what: str = "a sequence") -> None:
        """About to build `what` of `n` characters or items."""
        if n > self.cap:
            raise ChatTemplateError(f"chat template builds {what} of {n} items, over the {self.cap}-item limit")
        self.allocated -= n
        if self.allocated < 0:
            raise ChatTemplateError(f"chat template allocates more than {ALLOCATED_PER_TEXT * self.cap} "
                                    "characters in total")
        self.charge()


_state = threading.local()


def _budget() -> _Budget:
    b = getattr(_state, "budget", None)
    if b is None:
        raise nodes.Impossible()            # compile time: jinja must not fold this into a constant
    return b


def _input_chars(value: Any, limit: int = 64 << 20) -> int:
    """Characters in the strings of the render's variables (messages, tools, ...), the size a
    legitimate prompt scales with. Stops counting past `limit`."""
    total, stack, seen = 0, [value], 0
    while stack and total < limit and seen < 1_000_000:
        v = stack.pop()
        seen += 1
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return min(total, limit)


# Upper bounds of str()/repr()/json.dumps() of a value, computed without building it. A list holding
# the same long string a million times is cheap to build and must not be printed.

_SCALARS = (int, float, bool, type(None))


def _text_bound(value: Any, b: _Budget, json_mode: bool = False, ensure_ascii: bool = False,
                indent: int = 0, sep: int = 2) -> int:
    memo: Dict[Any, int] = {}
    limit = b.cap

    def bound(v: Any, depth: int) -> int:
        if isinstance(v, str):
            n = len(v)
            if v.isprintable() and (v.isascii() or not ensure_ascii):
                return 2 * n + 2
            return (12 if json_mode else 10) * n + 2
        if isinstance(v, _SCALARS):
            return 24 if not isinstance(v, int) or v.bit_length() < 64 else v.bit_length() // 3 + 2
        key = (id(v), depth)
        if key in memo:
            return memo[key]
        memo[key] = 16                      # a cycle prints as [...] (json refuses it)
        if isinstance(v, Namespace):
            items: Any = object.__getattribute__(v, "_Namespace__attrs")
        else:
            items = v
        total = 16
        if isinstance(items, Mapping):
            b.charge(1 + len(items))
            per = sep + 2 + indent * (depth + 1) + 1
            for k, x in items.items():
                total += per + bound(k, depth + 1) + bound(x, depth + 1)
                if total > limit:
                    break
        elif isinstance(items, (list, tuple, set, frozenset)):
            b.charge(1 + len(items))
            per = sep + indent * (depth + 1) + 1
            for x in items:
                total += per + bound(x, depth + 1)
                if total > limit:
                    break
        else:
            total = 256                     # Undefined, macros, loop objects: a short repr
        memo[key] = total
        return total

    return bound(value, 0)


# Values that hold others. Hashing nests through tuples with no recursion check in C; the others are
# bounded too, so no mix of them can carry a deep tuple (and repr/compare stay far from their limits).
_NESTING = (list, tuple, dict, set, frozenset, Namespace, Cycler)


def _inner(v: Any) -> List[Any]:
    """The values v holds directly that hold others in turn."""
    if isinstance(v, Namespace):
        items: Any = object.__getattribute__(v, "_Namespace__attrs").values()
    elif isinstance(v, Cycler):
        items = v.items
    elif isinstance(v, dict):
        items = [*v, *v.values()]
    else:
        items = v
    kinds = set(map(type, items))           # flat lists of strings and numbers: one pass in C
    if not any(issubclass(k, _NESTING) for k in kinds):
        return []
    return [x for x in items if isinstance(x, _NESTING)]


def _check_depth(value: Any) -> Any:
    """`value` unchanged if it nests at most MAX_VALUE_DEPTH levels deep, else ChatTemplateError. Each value
    it holds is visited once (shared ones are not walked again); each one visited costs an operation."""
    if not isinstance(value, _NESTING):
        return value
    b = _budget()
    height: Dict[int, int] = {}             # id -> levels, of the values already walked (all alive: in value)
    walking = {id(value)}                   # a namespace may hold itself
    stack = [[value, _inner(value), 0, 0]]  # value, what it holds, next index, deepest of those so far
    visited, deep = 1, False
    while stack and not deep:
        top = stack[-1]
        held = top[1]
        if top[2] < len(held):
            x = held[top[2]]
            top[2] += 1
            h = height.get(id(x))
            if h is not None:
                top[3] = max(top[3], h)
            elif id(x) not in walking:
                deep = len(stack) >= MAX_VALUE_DEPTH
                walking.add(id(x))
                stack.append([x, _inner(x), 0, 0])
                visited += 1
            continue
        stack.pop()
        walking.discard(id(top[0]))
        h = top[3] + 1
        deep = h > MAX_VALUE_DEPTH
        height[id(top[0])] = h
        if stack:
            stack[-1][3] = max(stack[-1][3], h)
    b.charge(visited)
    if deep:
        raise ChatTemplateError(f"chat template builds a value nested more than {MAX_VALUE_DEPTH} levels deep")
    return value


class _Namespace(Namespace):
    """namespace(): storing a namespace in another can chain them, so that is where their depth is checked
    (other values grow deeper only where they are built, which checks them)."""

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(value, (Namespace, Cycler)):
            _check_depth(value)
        super().__setitem__(name, value)


def _str(value: Any) -> str:
    """str(value), refused when it would be too long."""
    if type(value) is str:
        return value
    if isinstance(value, str):
        return str(value)
    b = _budget()
    if not isinstance(value, _SCALARS):
        b.size(_text_bound(value, b), "a string")
    return str(value)


def _keep_str(value: Any) -> Any:
    """`value` unchanged if it is a string (Markup stays Markup), else `_str(value)`."""
    return value if isinstance(value, str) else _str(value)


def _join(markup: bool, parts: Any) -> str:
    parts = [_keep_str(p) for p in parts]
    _budget().size(sum(map(len, parts)), "a string")
    return markup_join(parts) if markup else "".join(parts)


def _concat(parts: Any) -> str:
    """environment.concat: joins the output buffers of macros, blocks, `{% set %}` and `{% filter %}`."""
    parts = parts if isinstance(parts, list) else list(parts)
    b = getattr(_state, "budget", None)
    if b is not None:
        b.size(sum(map(len, parts)), "a string")
    return "".join(parts)


class _Counted:
    """What a `{% for %}` loops over: each item costs one operation."""
    __slots__ = ("_it", "_b")

    def __init__(self, iterable: Any, b: _Budget):
        self._it, self._b = iterable, b

    def __len__(self) -> int:
        return len(self._it)

    def __bool__(self) -> bool:
        return bool(self._it)

    def __iter__(self):
        charge = self._b.charge
        for x in self._it:
            charge()
            yield x


def _loop_iter(iterable: Any) -> Any:
    return _Counted(iterable, _budget())


# ---------------------------------------------------------------------------------------------
# Formatting: `%`, str.format and the `format` filter

_PERCENT = re.compile(r"%(?:\(([^)]*)\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


def _number(part: str, b: _Budget) -> int:
    if len(part) > 9 or int(part) > b.cap:
        raise ChatTemplateError(f"chat template formats with a width of {part}, over the {b.cap}-item limit")
    return int(part)


def _checked_percent(fmt: str, args: Any) -> None:
    b = _budget()
    values = args if isinstance(args, tuple) else (args,)
    i, total = 0, len(fmt)
    for m in _PERCENT.finditer(fmt):
        key, width, prec, conv = m.groups()
        if conv == "%":
            continue
        for part in (width, prec):
            if part == "*":
                n = values[i] if i < len(values) else 0
                i += 1
                if not isinstance(n, int) or abs(n) > b.cap:
                    raise ChatTemplateError(f"chat template formats with a width of {n}, over the "
                                            f"{b.cap}-item limit")
                total += abs(n)
            elif part:
                total += _number(part, b)
        if key is not None:
            v = args.get(key) if isinstance(args, Mapping) else None
        else:
            v = values[i] if i < len(values) else None
            i += 1
        total += _text_bound(v, b) if conv in "sra" else 32
    b.size(total, "a string")


class _BoundedFormatterMixin:
    """str.format with every field's width checked and the running length of the result bounded."""
    _b: _Budget
    _total: int

    def convert_field(self, value: Any, conversion: Optional[str]) -> Any:
        if conversion is not None and not isinstance(value, _SCALARS):
            self._b.size(_text_bound(value, self._b), "a string")
        return super().convert_field(value, conversion)     # type: ignore[misc]

    def format_field(self, value: Any, format_spec: str) -> Any:
        for part in re.findall(r"\d+", format_spec):
            _number(part, self._b)
        if not isinstance(value, (str, *_SCALARS)):
            self._b.size(_text_bound(value, self._b), "a string")
        rv = super().format_field(value, format_spec)        # type: ignore[misc]
        self._total += len(rv)
        self._b.size(self._total, "a string")
        return rv


class _BoundedFormatter(_BoundedFormatterMixin, SandboxedFormatter):
    pass


class _BoundedEscapeFormatter(_BoundedFormatterMixin, SandboxedEscapeFormatter):
    pass


def _make_formatter(env: jinja2.Environment, f_self: str):
    formatter = (_BoundedEscapeFormatter(env, escape=f_self.escape) if isinstance(f_self, Markup)
                 else _BoundedFormatter(env))
    formatter._b, formatter._total = _budget(), 0
    return formatter


# ---------------------------------------------------------------------------------------------
# Methods of builtin values: a whitelist; the ones that can build large values are checked first

def _checked_width(s: str, width: Any, *rest: Any) -> None:
    if isinstance(width, int):
        _budget().size(max(len(s), width), "a string")


def _checked_replace(s: str, old: Any, new: Any, count: int = -1) -> None:
    if isinstance(old, str) and isinstance(new, str):
        n = len(s) + 1 if old == "" else s.count(old)
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        _budget().size(len(s) + n * max(0, len(new) - len(old)), "a string")


def _checked_expandtabs(s: str, tabsize: Any = 8) -> None:
    if isinstance(tabsize, int):
        _budget().size(len(s) + s.count("\t") * max(tabsize, 0), "a string")


def _checked_join(s: str, iterable: Any) -> None:
    b = _budget()
    if isinstance(iterable, (list, tuple)):
        b.charge(len(iterable))
        if all(isinstance(x, str) for x in iterable):
            b.size(sum(map(len, iterable)) + len(s) * max(len(iterable) - 1, 0), "a string")
            return
    elif isinstance(iterable, str):
        b.charge(len(iterable))
        b.size(len(iterable) * (len(s) + 1), "a string")
        return
    raise ChatTemplateError("chat template joins something other than a list of strings with str.join")


_STR_CHECKED = {"center": _checked_width, "ljust": _checked_width, "rjust": _checked_width,
                "zfill": _checked_width, "replace": _checked_replace, "expandtabs": _checked_expandtabs,
                "join": _checked_join}
_STR_PLAIN = frozenset("""capitalize casefold count endswith find index isalnum isalpha isascii isdecimal
    isdigit isidentifier islower isnumeric isprintable isspace istitle isupper lower lstrip partition
    removeprefix removesuffix rfind rindex rpartition rsplit rstrip split splitlines startswith strip
    swapcase title upper""".split())
_PLAIN = {list: frozenset(["count", "index"]), tuple: frozenset(["count", "index"]),
          dict: frozenset(["get", "items", "keys", "values"]),
          int: frozenset(["bit_length", "is_integer"]), float: frozenset(["is_integer"]),
          bool: frozenset()}


def _guard_method(value: Any) -> Any:
    """A method of a builtin value that a template looked up: itself, a checked wrapper, or refused."""
    if not isinstance(value, (types.BuiltinMethodType, types.MethodType)):
        return value
    owner = getattr(value, "__self__", None)
    name = getattr(value, "__name__", "")
    if isinstance(owner, str):
        if name in _STR_PLAIN:
            return _sized_result(value)
        check = _STR_CHECKED.get(name)
        if check is not None:
            return _checked_call(check, owner, value)
    else:
        for kind, names in _PLAIN.items():
            if isinstance(owner, kind):
                if name in names:
                    return _sized_result(value)
                break
        else:
            return value                   # jinja's own objects: loop.cycle, cycler.next, ...
    raise SecurityError(f"{type(owner).__name__}.{name}() is not available in chat templates")


def _sized_result(method: Any):
    def call(*args: Any, **kwargs: Any) -> Any:
        rv = method(*args, **kwargs)
        if isinstance(rv, (str, list, tuple)):
            _budget().size(len(rv) * (8 if isinstance(rv, list) else 1), "a string")
        return rv
    return call


def _checked_call(check: Any, owner: str, method: Any):
    def call(*args: Any, **kwargs: Any) -> Any:
        check(owner, *args, **kwargs)
        return method(*args, **kwargs)
    return call


# ---------------------------------------------------------------------------------------------
# Filters and tests: a whitelist, each charged; the ones that can build large values are checked first

_ITERATING = frozenset("""batch dictsort first groupby items join last length list map max min reject
    rejectattr reverse select selectattr slice sort sum unique count""".split())
_CHEAP = frozenset(["length", "count", "first", "last", "reverse", "items"])
_STRINGY = frozenset("""capitalize center escape e forceescape indent lower replace striptags title trim
    truncate upper wordcount wordwrap string safe""".split())
_PLAIN_FILTERS = sorted(_ITERATING | _STRINGY | {"abs", "attr", "d", "default", "filesizeformat", "float",
                                                  "int", "round"})


def _wrap_filter(name: str, f: Any) -> Any:
    pass_arg = _PassArg.from_obj(f)
    at = 0 if pass_arg is None else 1

    @functools.wraps(f)
    def filt(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.charge()
        if len(args) > at:
            value = args[at]
            if name in _ITERATING:
                if name in _CHEAP:
                    pass
                elif hasattr(value, "__len__"):
                    b.charge(len(value))
                elif not isinstance(value, jinja2.Undefined):
                    args = (*args[:at], _Counted(value, b), *args[at + 1:])
            elif name in _STRINGY and not isinstance(value, (str, jinja2.Undefined)):
                args = (*args[:at], _str(value), *args[at + 1:])
            if name in _PRECHECKS:
                _PRECHECKS[name](b, *args[at:], **kwargs)
        rv = f(*args, **kwargs)
        if isinstance(rv, (str, list, tuple)):
            b.size(len(rv) * (1 if isinstance(rv, str) else 8), "a string")
        return _check_depth(rv)             # batch, slice, groupby, dictsort, items|list wrap what they get
    return filt


def _pre_center(b: _Budget, s: Any, width: Any = 80) -> None:
    if isinstance(width, int):
        b.size(max(len(s), width), "a string")


def _pre_indent(b: _Budget, s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> None:
    w = width if isinstance(width, int) else len(_str(width))
    b.size(len(s) + (s.count("\n") + 1) * max(w, 0), "a string")


def _pre_wordwrap(b: _Budget, s: Any, width: Any = 79, break_long_words: bool = True,
                  wrapstring: Optional[str] = None, break_on_hyphens: bool = True) -> None:
    if not isinstance(width, int) or width < 1:
        return                              # textwrap refuses it
    lines = len(s) // width + s.count("\n") + 1
    b.size(len(s) + lines * len(wrapstring or "\n"), "a string")
    # textwrap copies the rest of a long word for every line it cuts from it
    b.charge(len(s) * (len(s) // width + 1) // 4096)


def _pre_replace(b: _Budget, s: Any, old: Any, new: Any, count: Any = None) -> None:
    old, new = _keep_str(old), _keep_str(new)
    n = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int):
        n = min(n, max(count, 0))
    b.size(len(s) + n * max(0, len(new) - len(old)), "a string")


@jinja2.pass_eval_context
def _join_filter(eval_ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> str:
    b = _budget()
    b.charge(1 + (len(value) if hasattr(value, "__len__") else 0))
    if attribute is not None:
        value = map(jinja2.filters.make_attrgetter(_environment(), attribute), value)
    parts = [_keep_str(x) for x in _Counted(value, b)]
    sep = _keep_str(d)
    b.size(sum(map(len, parts)) + len(sep) * max(len(parts) - 1, 0), "a string")
    if eval_ctx.autoescape:
        return jinja2.filters.do_join(eval_ctx, parts, sep)
    return sep.join(parts)


def _pre_escape(b: _Budget, s: Any) -> None:
    b.size(5 * len(s), "a string")


def _pre_batch(b: _Budget, value: Any, linecount: Any, fill_with: Any = None) -> None:
    if isinstance(linecount, int):
        b.size(linecount, "a list")


def _pre_slice(b: _Budget, value: Any, slices: Any, fill_with: Any = None) -> None:
    if isinstance(slices, int):
        b.size(slices, "a list")
        b.charge(slices)


_PRECHECKS = {"center": _pre_center, "indent": _pre_indent, "wordwrap": _pre_wordwrap, "replace": _pre_replace,
              "escape": _pre_escape, "e": _pre_escape, "forceescape": _pre_escape,
              "batch": _pre_batch, "slice": _pre_slice}


def _format_filter(value: Any, *args: Any, **kwargs: Any) -> str:
    b = _budget()
    b.charge()
    if args and kwargs:
        raise jinja2.FilterArgumentError("can't handle positional and keyword arguments at the same time")
    fmt = _str(value)
    arg = kwargs or args
    _checked_percent(fmt, arg)
    return fmt % arg


def _sum_filter(iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    b = _budget()
    b.charge()
    items = list(_Counted(iterable, b))
    if attribute is not None:
        get = jinja2.filters.make_attrgetter(_environment(), attribute)
        items = [get(x) for x in items]
    if isinstance(start, (list, tuple)) or any(isinstance(x, (str, list, tuple)) for x in items):
        b.size(sum(len(x) for x in items if isinstance(x, (str, list, tuple))) +
               (len(start) if isinstance(start, (list, tuple)) else 0), "a list")
        if isinstance(start, (list, tuple)):
            out = list(start)
            for x in items:
                out += x
            return type(start)(out) if isinstance(start, tuple) else out
    return sum(items, start)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & for HTML and has no ensure_ascii; transformers replaces it.
    b = _budget()
    b.charge()
    width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    if width > b.cap:
        raise ChatTemplateError(f"chat template indents JSON by {width}, over the {b.cap}-item limit")
    sep = sum(len(_keep_str(s)) for s in separators) if isinstance(separators, (list, tuple)) else 2
    b.size(_text_bound(value, b, json_mode=True, ensure_ascii=bool(ensure_ascii), indent=width, sep=sep),
           "a string")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _wrap_test(name: str, t: Any) -> Any:
    @functools.wraps(t)
    def test(*args: Any, **kwargs: Any) -> Any:
        _budget().charge()
        if name in ("lower", "upper") and args and not isinstance(args[0], str):
            args = (_str(args[0]), *args[1:])
        return t(*args, **kwargs)
    return test


# ---------------------------------------------------------------------------------------------
# Globals

def _bounded_range(*args: int) -> range:
    b = _budget()
    b.charge()
    r = range(*args)
    b.range_left -= len(r)
    if b.range_left < 0:
        raise ChatTemplateError(f"chat template loops over more than {MAX_RANGE_ITEMS} items in total")
    return r


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message)[:2000])


def _strftime_now(fmt: str) -> str:
    _budget().charge()
    fmt = _keep_str(fmt)
    if len(fmt) > 1000 or re.search(r"%[-_0^#]*\d", fmt):
        raise ChatTemplateError("chat template calls strftime_now with a format too long or with a field width")
    return datetime.now().strftime(fmt)


def _global(f: Any) -> Any:
    @functools.wraps(f, updated=())
    def call(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.charge(1 + len(args) + len(kwargs))
        return f(*args, **kwargs)
    return call


# ---------------------------------------------------------------------------------------------
# The environment

class _BoundedCodeGenerator(CodeGenerator):
    """Everything a template prints goes through `environment.bounded_str`, every `~` through
    `environment.bounded_join`."""

    def _output_child_pre(self, node, frame, finalize) -> None:
        super()._output_child_pre(node, frame, finalize)
        self.write("environment.bounded_str(")

    def _output_child_post(self, node, frame, finalize) -> None:
        self.write(")")
        super()._output_child_post(node, frame, finalize)

    def _bounded(self, visit, node, frame) -> None:
        if getattr(node, "ctx", "load") != "load":     # `{% for a, b in ... %}`: a target, not a value
            return visit(node, frame)
        self.write("environment.bounded_value(")
        visit(node, frame)
        self.write(")")

    def visit_Tuple(self, node: nodes.Tuple, frame) -> None:
        self._bounded(super().visit_Tuple, node, frame)

    def visit_List(self, node: nodes.List, frame) -> None:
        self._bounded(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame) -> None:
        self._bounded(super().visit_Dict, node, frame)

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        if frame.eval_ctx.volatile:
            self.write("environment.bounded_join(context.eval_ctx.autoescape, (")
        else:
            self.write(f"environment.bounded_join({bool(frame.eval_ctx.autoescape)}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the budget: every operator, lookup and call is charged and checked."""
    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])
    intercepted_unops = frozenset(["+", "-"])
    code_generator_class = _BoundedCodeGenerator
    concat = staticmethod(_concat)
    bounded_str = staticmethod(_keep_str)
    bounded_join = staticmethod(_join)
    bounded_value = staticmethod(_check_depth)

    def _tokenize(self, source, name, filename=None, state=None):
        stream = super()._tokenize(source, name, filename, state)
        return TokenStream(_counted_tokens(stream), stream.name, stream.filename)

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):     # every `{% for %}` pays per item
            loop.iter = nodes.Filter(loop.iter, "__corelm_loop", [], [], None, None, lineno=loop.lineno)
        tree.set_environment(self)
        return tree

    def call_binop(self, context, operator, left, right):
        b = _budget()
        b.charge()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > b.cap:
                    raise ChatTemplateError(f"chat template builds a sequence of {len(seq) * n} items, "
                                            f"over the {b.cap}-item limit")
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    b.size(len(seq) * max(n, 0))
            if isinstance(left, int) and isinstance(right, int) and \
                    left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise ChatTemplateError("chat template builds an integer too large")
        elif operator == "**":
            if isinstance(right, int) and abs(right) > 1024:
                raise ChatTemplateError(f"chat template raises to the power {right}")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > MAX_INT_BITS:
                raise ChatTemplateError("chat template builds an integer too large")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                b.size(len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            _checked_percent(left, right)
        return super().call_binop(context, operator, left, right)

    def call_unop(self, context, operator, arg):
        _budget().charge()
        return super().call_unop(context, operator, arg)

    def getattr(self, obj, attribute):
        _budget().charge()
        return _guard_method(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        b = _budget()
        b.charge()
        if isinstance(argument, slice) and isinstance(obj, (str, list, tuple)):
            b.size(len(obj))
        return _guard_method(super().getitem(obj, argument))

    def wrap_str_format(self, value):
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or \
                value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str):
            return None
        f_self, is_map = value.__self__, value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return type(f_self)(_make_formatter(self, f_self).vformat(f_self, args, kwargs))

        return functools.update_wrapper(wrapper, value)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- jinja's signature
        b = _budget()
        b.charge()
        if isinstance(__obj, LoopContext) and args:      # a recursive loop's next level
            args = (_Counted(args[0], b), *args[1:])
        if b.depth >= MAX_CALL_DEPTH:
            raise ChatTemplateError(f"chat template recursed too deeply (more than {MAX_CALL_DEPTH} nested calls)")
        if isinstance(__obj, Macro):        # `varargs` / `kwargs` hold the arguments
            if __obj.catch_varargs:
                _check_depth(args)
            if __obj.catch_kwargs:
                _check_depth(kwargs)
        b.depth += 1
        try:
            return _check_depth(super().call(__context, __obj, *args, **kwargs))
        finally:
            b.depth -= 1


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


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    builtin = jinja2.filters.FILTERS
    env.filters = {name: _wrap_filter(name, builtin[name]) for name in _PLAIN_FILTERS}
    env.filters["format"] = _format_filter
    env.filters["sum"] = _sum_filter
    env.filters["join"] = _join_filter
    env.filters["tojson"] = _tojson
    env.filters["__corelm_loop"] = _loop_iter
    env.tests = {name: _wrap_test(name, t) for name, t in jinja2.tests.TESTS.items()}
    env.globals = {"range": _bounded_range, "raise_exception": _raise_exception, "strftime_now": _strftime_now,
                   "dict": _global(dict), "namespace": _global(_Namespace), "cycler": _global(Cycler),
                   "joiner": _global(Joiner)}
    return env
