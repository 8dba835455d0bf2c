import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
MODELS = os.path.join(DATA, "models")
FIXTURES = os.path.join(DATA, "fixtures")
DEFAULT_GGUF = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

# Tests run against the installed package; a source checkout with an in-place build also works.
try:
    import corelm  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(ROOT, "python"))


def run_with_isa(isa, code, *args, timeout=600):
    """Runs `python -c code args...` with CORELM_ISA=isa (the kernel table is chosen at import, so a
    test of another table needs a process of its own), on this checkout's corelm."""
    import subprocess
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["corelm"].__file__)))
    env = dict(os.environ, CORELM_ISA=isa,
               PYTHONPATH=os.pathsep.join(filter(None, [pkg_parent, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.fixture(scope="session")
def data_dir():
    return DATA


def tool_module(name):
    """tools/<name>.py as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def corpus_tool():
    """tools/make_corrupt_corpus.py: its byte-level GGUF/safetensors builders serve the tests."""
    return tool_module("make_corrupt_corpus")


# A prompt through a _core.Model's forward_batch with the identity block table (tools/core_forward.py):
# core_forward(model, tokens, pos, all_logits=False) -> the last token's logits, or every token's.
core_forward = tool_module("core_forward").core_forward


@pytest.fixture
def stub_tokenizer(monkeypatch):
    """The loaders only hand metadata to corelm.tokenizer; a stub keeps loader tests about the loader."""
    import types
    mod = types.ModuleType("corelm.tokenizer")

    class Tokenizer:
        @classmethod
        def from_gguf_metadata(cls, metadata):
            return ("gguf", metadata)

        @classmethod
        def from_hf_folder(cls, folder):
            return ("hf", folder)

    mod.Tokenizer = Tokenizer
    monkeypatch.setitem(sys.modules, "corelm.tokenizer", mod)
