import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
MODELS = os.path.join(DATA, "models")
FIXTURES = os.path.join(DATA, "fixtures")
DEFAULT_GGUF = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

# Optional real models: the files ../shared/models/get_models.sh writes into its DEST folder. Tests that
# need one call real_model(name); nothing else in tests/ names a path outside the repository.
# CORELM_TEST_MODELS=DEST names that folder; unset, ../shared/models (next to the repository) is used if it
# exists. Set explicitly, a file missing from it fails the test instead of skipping it.
MODELS_ENV = "CORELM_TEST_MODELS"
DEFAULT_REAL_MODELS = os.path.join(os.path.dirname(ROOT), "shared", "models")
REAL_MODELS = {  # get_models.sh file name -> what it is (named in skip reasons)
    "SmolLM2-135M-Instruct.Q4_1.gguf": "SmolLM2-135M-Instruct GGUF (Q4_1)",
    "qwen2.5-coder-0.5b-instruct.gguf": "Qwen2.5-Coder-0.5B-Instruct GGUF",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": "Qwen2.5-Coder-1.5B-Instruct GGUF (Q4_K_M)",
}
EMBEDDED_MODELS = os.path.join(ROOT, "models")  # the committed default model (models/README.md)


def real_models_dir():
    """(folder, explicit): $CORELM_TEST_MODELS, else ../shared/models if it exists, else (None, False)."""
    env = os.environ.get(MODELS_ENV)
    if env:
        return os.path.abspath(env), True
    return (DEFAULT_REAL_MODELS if os.path.isdir(DEFAULT_REAL_MODELS) else None), False


def real_model(name):
    """Path of the real model `name` (a file name get_models.sh writes, a key of REAL_MODELS), looked up in
    real_models_dir() and then in the committed models/ folder. Skips the calling test when it is absent
    and CORELM_TEST_MODELS is unset; fails it when CORELM_TEST_MODELS is set (the run asked for real models)."""
    if name not in REAL_MODELS:
        raise ValueError(f"unknown real model {name!r}; known: {sorted(REAL_MODELS)}")
    folder, explicit = real_models_dir()
    if explicit and not os.path.isdir(folder):
        pytest.fail(f"{MODELS_ENV}={folder} is not a folder")
    for d in filter(None, (folder, EMBEDDED_MODELS)):
        if os.path.isfile(os.path.join(d, name)):
            return os.path.join(d, name)
    how = (f"needs {REAL_MODELS[name]}: run `bash ../shared/models/get_models.sh DIR` from the repository "
           f"root and set {MODELS_ENV}=DIR (the folder it fills with {name})")
    if explicit:
        pytest.fail(f"{how} ({MODELS_ENV}={folder} has no {name})")
    pytest.skip(how)

# Test modules share helpers by importing one another (`from test_quant import ggml_quantize`), across
# the folders too, so every folder of tests is on the path.
sys.path[1:1] = [os.path.join(ROOT, "tests", d) for d in ("kernels", "loaders", "models", "engine", "serving", "runtime")]

# Tests run against the installed package; a source checkout with an in-place build also works.
try:
    import corelm  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(ROOT, "python"))


def pytest_sessionstart(session):
    from corelm import _core
    if not hasattr(_core, "testing"):
        pytest.exit("corelm was built without its test module corelm._core.testing: install it with README's test "
                    "command (pip install --no-build-isolation \".[test]\" -C cmake.define.CORELM_TESTING=ON)", returncode=4)


# Crash injection for `corelm batch` workers (tests/data/batch_crash_hook/sitecustomize.py): the env vars
# that choose the crash, and the PYTHONPATH that puts the hook in every Python the test starts.
BATCH_CRASH = "CORELM_BATCH_TEST_CRASH"
BATCH_CRASH_ON = "CORELM_BATCH_TEST_CRASH_ON"


def batch_crash_env(env, **crash):
    """`env` (a dict, or pytest's monkeypatch) with the crash hook on PYTHONPATH and `crash` set."""
    hook = os.path.join(DATA, "batch_crash_hook")
    if isinstance(env, dict):
        return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [hook, env.get("PYTHONPATH")])), **crash)
    env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [hook, os.environ.get("PYTHONPATH")])))
    for k, v in crash.items():
        env.setenv(k, v)


def child_env(**extra):
    """os.environ for a child Python that imports the same corelm as these tests (with its compiled
    _core: the installed package, or the checkout's python/ with an in-place build), plus `extra`."""
    import corelm
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(corelm.__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pkg_parent, os.environ.get("PYTHONPATH")])),
                **extra)


def run_with_isa(isa, code, *args, timeout=600):
    """Runs `python -c code args...` with CORELM_ISA=isa (the kernel table is chosen at import, so a
    test of another table needs a process of its own), on this checkout's corelm."""
    import subprocess
    return subprocess.run([sys.executable, "-c", code, *args], env=child_env(CORELM_ISA=isa), capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


def amx_prefill():
    """Whether this process's default table multiplies a prompt's quantized weights as bf16 on AMX
    (kernels/amx/amx_table.cc), so a quantized model's prompt logits are not the integer kernels' bits."""
    from corelm import _core
    return _core.kernel_tables()[0] == "amx" and os.environ.get("CORELM_AMX_PREFILL", "1") != "0"


def rerun_with_integer_prefill(request):
    """For tests of the integer kernels' promises (same bits for any batch, int16's fidelity): where
    amx_prefill() holds, runs this test in a subprocess with CORELM_AMX_PREFILL=0 and returns True (the
    caller then returns); elsewhere returns False."""
    if not amx_prefill():
        return False
    import subprocess
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                       env=dict(os.environ, CORELM_AMX_PREFILL="0"), capture_output=True, text=True,
                       cwd=str(request.config.rootpath), timeout=600)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:]
    return True


@pytest.fixture(scope="session")
def data_dir():
    return DATA


def tool_module(name):
    """tools/<folder>/<name>.py (bench/, fixtures/ or fuzz/) as a module."""
    import glob
    import importlib.util
    path, = glob.glob(os.path.join(ROOT, "tools", "*", name + ".py"))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def corpus_tool():
    """tools/fixtures/make_corrupt_corpus.py: its byte-level GGUF/safetensors builders serve the tests."""
    return tool_module("make_corrupt_corpus")


# A prompt through a _core.Model's forward_batch with the identity block table (tools/bench/core_forward.py):
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
