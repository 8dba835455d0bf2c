"""The package's layers hold by construction (docs/architecture.md, "Layers"): an AST walk over python/corelm
(no import of corelm) that fails, naming the import, when a module imports a layer above its own, when an
entry point reaches past the public API, or when modules import each other in a cycle."""
import ast
import collections
import functools
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "python", "corelm")

# Lowest first: a module may import its own layer and those below. "corelm" is the package's __init__, the
# lazy facade (corelm.LLM, corelm.SamplingParams, ...); `from corelm import __version__` names a constant of
# it and counts as the bottom layer.
LAYERS = [
    ("corelm.errors", "corelm.options", "corelm.threads", "corelm._core"),
    ("corelm.tokenizer",),
    ("corelm.loader",),
    ("corelm.convert", "corelm.calibrate", "corelm.engine.model_builder"),   # calibration runs the built model
    ("corelm.engine",),
    ("corelm.openai",),
    ("corelm.llm", "corelm", "corelm.lora"),
    ("corelm.entrypoints",),
]
# What entry points may import besides each other: the public API. Never loader, tokenizer, conversion,
# _core or the engine's modules: corelm.engine's __init__ exports what they need.
ENTRYPOINT_API = ("corelm", "corelm.llm", "corelm.engine", "corelm.openai", "corelm.options", "corelm.errors")
EXTENSIONS = ("corelm._core", "corelm._core.testing")   # built from cpp/bindings
BOTTOM_NAMES = {"__version__"}

Import = collections.namedtuple("Import", "target line runs text local")


def layer_of(module):
    """The index in LAYERS of the longest name that is `module` or a package holding it; None if none."""
    best, rank = "", None
    for i, names in enumerate(LAYERS):
        for name in names:
            inside = module == name or (name != "corelm" and module.startswith(name + "."))
            if inside and len(name) > len(best):
                best, rank = name, i
    return rank


def modules():
    """{dotted name: path} for every module of the package."""
    found = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(PACKAGE))[:-3].split(os.sep)
                found[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(folder, f)
    return found


def _type_checking(stmt):
    test = stmt.test if isinstance(stmt, ast.If) else None
    return isinstance(test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in (getattr(test, "id", "") or test.attr)


def _targets(stmt, module, is_package, known):
    """The corelm modules an import statement names: `from X import n` names X.n where that is a module,
    else X."""
    if isinstance(stmt, ast.Import):
        return [a.name for a in stmt.names if a.name.split(".")[0] == "corelm"]
    if stmt.level:
        parts = module.split(".")
        base = parts[:len(parts) - stmt.level + (1 if is_package else 0)]
        src = ".".join(base + ([stmt.module] if stmt.module else []))
    else:
        src = stmt.module or ""
    if src.split(".")[0] != "corelm":
        return []
    out = []
    for a in stmt.names:
        if src == "corelm" and a.name in BOTTOM_NAMES:
            out.append(LAYERS[0][0])
        else:
            out.append(f"{src}.{a.name}" if f"{src}.{a.name}" in known else src)
    return list(dict.fromkeys(out))


def _dynamic(tree):
    """importlib.import_module("corelm...") and __import__("corelm...") calls: (line, module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            arg = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(arg, str) and arg.split(".")[0] == "corelm":
                yield node, arg


def imports(module, path, known):
    """Every corelm import in the file, module-level and function-local (Import.local), relative and
    absolute; Import.runs is False under `if TYPE_CHECKING:`."""
    is_package = os.path.basename(path) == "__init__.py"
    with open(path, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source, path)
    out = []

    def visit(stmts, runs, local):
        for stmt in stmts:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for t in _targets(stmt, module, is_package, known):
                    out.append(Import(t, stmt.lineno, runs, ast.unparse(stmt), local))
                continue
            inner_runs = runs and not _type_checking(stmt)
            inner_local = local or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(stmt, field, None) or ():
                    visit(child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else [child],
                          inner_runs if field == "body" else runs, inner_local)
    visit(tree.body, True, False)
    if "import_module" in source or "__import__" in source:
        out += [Import(t, node.lineno, True, ast.unparse(node), True) for node, t in _dynamic(tree)]
    return out


@functools.lru_cache(maxsize=None)
def package_imports():
    known = modules()
    names = set(known) | set(EXTENSIONS)
    return known, {m: imports(m, p, names) for m, p in known.items()}


def layer_violations(graph):
    bad = []
    for module, found in graph.items():
        mine = layer_of(module)
        for imp in found:
            theirs = layer_of(imp.target)
            where = f"{module}:{imp.line}: {imp.text}"
            if mine is None or theirs is None:
                bad.append(f"{where} ({module if mine is None else imp.target} is in no layer: add it to LAYERS)")
            elif theirs > mine:
                bad.append(f"{where} (layer {mine} imports {imp.target}, layer {theirs})")
            elif module.startswith("corelm.entrypoints") and not imp.target.startswith("corelm.entrypoints") \
                    and imp.target not in ENTRYPOINT_API and not imp.target.startswith("corelm.openai."):
                bad.append(f"{where} (an entry point reaches past the public API to {imp.target})")
    return bad


def cycles(graph):
    """Groups of modules that import each other, over every import that runs: module-level and
    function-local alike (a local import that closes a loop only hides it). Tarjan's algorithm."""
    edges = {m: sorted({i.target for i in found if i.runs and i.target in graph and i.target != m})
             for m, found in graph.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def describe_cycle(group, graph):
    lines = [f"  {m}:{i.line}: {i.text}" for m in group for i in graph[m] if i.runs and i.target in group
             and i.target != m]
    return "import cycle between " + ", ".join(group) + ":\n" + "\n".join(lines)


def test_every_module_has_a_layer():
    known, _ = package_imports()
    assert len(known) > 40
    assert [m for m in known if layer_of(m) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    _, graph = package_imports()
    bad = layer_violations(graph)
    assert not bad, "layer violations:\n" + "\n".join(bad)


def test_no_import_cycles():
    _, graph = package_imports()
    found = cycles(graph)
    assert not found, "\n".join(describe_cycle(c, graph) for c in found)


def test_the_checks_find_what_they_look_for():
    """Planted faults (this tree's own, before the layers held): an upward import, an entry point that
    reaches into the loader, and a loop closed by a function-local import."""
    graph = {
        "corelm.tokenizer": [Import("corelm.loader.spec", 23, True, "from ..loader.spec import ModelLoadError", False)],
        "corelm.entrypoints.cli.pull": [Import("corelm.loader.hub", 7, True, "from ...loader.hub import x", False)],
        "corelm.engine.scheduler": [Import("corelm.engine.speculative", 22, True, "from .speculative import x", False)],
        "corelm.engine.speculative": [Import("corelm.engine.scheduler", 335, True, "from .scheduler import x", True)],
        "corelm.loader.spec": [],
        "corelm.loader.hub": [],
    }
    bad = layer_violations(graph)
    assert any(b.startswith("corelm.tokenizer:23: ") and "layer 1 imports corelm.loader.spec, layer 2" in b
               for b in bad), bad
    assert any("reaches past the public API to corelm.loader.hub" in b for b in bad), bad
    assert cycles(graph) == [["corelm.engine.scheduler", "corelm.engine.speculative"]]
    graph["corelm.engine.speculative"][0] = Import("corelm.engine.scheduler", 335, False, "(TYPE_CHECKING)", True)
    assert cycles(graph) == []
    assert layer_of("corelm") == layer_of("corelm.llm") and layer_of("corelm.engine.distributed.shard") == 4
    assert layer_of("corelm.errors") == 0 and layer_of("corelm.entrypoints.cli") == len(LAYERS) - 1


@pytest.mark.parametrize("source, module, package, want", [
    ("from .. import loader\n", "corelm.engine.system", False, ["corelm.loader"]),
    ("def f():\n    if x:\n        from ..convert import folder_dtype\n", "corelm.engine.llm_engine", False,
     ["corelm.convert"]),
    ("from . import hermes\n", "corelm.openai.tool_parsers", True, ["corelm.openai.tool_parsers.hermes"]),
    ("from .. import __version__\n", "corelm.engine.system", False, ["corelm.errors"]),
    ("from ...engine import SamplingParams\n", "corelm.entrypoints.cli.flags", False, ["corelm.engine"]),
    ("try:\n    import corelm._core\nexcept ImportError:\n    pass\n", "corelm.llm", False, ["corelm._core"]),
    ("import importlib\nm = importlib.import_module('corelm._core')\n", "corelm.engine.system", False,
     ["corelm._core"]),
])
def test_imports_resolve(tmp_path, source, module, package, want):
    path = tmp_path / ("__init__.py" if package else "m.py")
    path.write_text(source)
    known = set(modules()) | set(EXTENSIONS)
    assert [i.target for i in imports(module, str(path), known)] == want
