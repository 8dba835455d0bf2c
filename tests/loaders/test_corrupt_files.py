"""Every hostile file in tests/data/corrupt/ is refused with a ModelLoadError that names the problem,
the valid_* files still load, and nothing crashes the process (checked in a subprocess, where a segfault,
an abort or a runaway allocation would show up as a bad exit status)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from corelm.loader import ModelLoadError, load_model
from corelm.loader.gguf import read_gguf
from corelm.loader.safetensors import SafetensorsFile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO, "tests", "data", "corrupt")


from conftest import child_env, corpus_tool  # noqa: E402

tool = corpus_tool()
CASES = tool.cases()


def probe(path):
    """Parse the file and decode every tensor, as a model load would."""
    if path.endswith(".gguf"):
        g = read_gguf(path)
        for name in g.tensors:
            g.dequantize(name)
    else:
        f = SafetensorsFile(path)
        for name in f.tensors:
            f.get(name)


FOLDER_CASES = tool.folder_cases() + tool.sparse_folder_cases() + tool.sparse_quant_folder_cases()


def test_corpus_is_committed_and_up_to_date():
    on_disk = sorted(os.listdir(CORPUS))
    assert on_disk == sorted([c.name for c in CASES] + [c.name for c in FOLDER_CASES]), \
        "run: python tools/fixtures/make_corrupt_corpus.py"
    for c in CASES:
        with open(os.path.join(CORPUS, c.name), "rb") as f:
            assert f.read() == c.data, f"{c.name} is stale; run: python tools/fixtures/make_corrupt_corpus.py"
        assert len(c.data) < 64 * 1024
    for c in FOLDER_CASES:
        assert sorted(os.listdir(os.path.join(CORPUS, c.name))) == sorted(c.files), c.name
        for fname, data in c.files.items():
            with open(os.path.join(CORPUS, c.name, fname), "rb") as f:
                assert f.read() == data, f"{c.name}/{fname} is stale; run: python tools/fixtures/make_corrupt_corpus.py"


def test_generator_is_deterministic(tmp_path):
    tool.write_corpus(str(tmp_path))
    for c in CASES:
        assert (tmp_path / c.name).read_bytes() == c.data
    for c in FOLDER_CASES:
        for fname, data in c.files.items():
            assert (tmp_path / c.name / fname).read_bytes() == data


def load_folder_fully(path):
    """load_model, then every weight and the RoPE frequencies, as building the engine would."""
    from corelm.engine.model_builder import rope_inv_freq
    m = load_model(path)
    for name in m.weight_names():
        m.get_weight(name)
    assert np.isfinite(rope_inv_freq(m.spec)).all()
    m.tokenizer.encode("hello world")
    return m


@pytest.mark.parametrize("case", FOLDER_CASES, ids=[c.name for c in FOLDER_CASES])
def test_corrupt_folder_is_refused_for_the_right_reason(case, caplog):
    path = os.path.join(CORPUS, case.name)
    if case.expect is None:
        with caplog.at_level("WARNING", logger="corelm.loader"):
            load_folder_fully(path)
        warned = [r.getMessage() for r in caplog.records if r.name == "corelm.loader"]
        if case.warning is None:
            assert not warned
        else:
            assert any(case.warning in w and path in w for w in warned), warned
        return
    with pytest.raises(ModelLoadError) as e:
        load_folder_fully(path)
    assert case.expect.lower() in str(e.value).lower()
    assert path in str(e.value)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_corrupt_file_is_refused_for_the_right_reason(case):
    path = os.path.join(CORPUS, case.name)
    if case.expect is None:
        probe(path)
        return
    with pytest.raises(ModelLoadError) as e:
        probe(path)
    assert case.expect.lower() in str(e.value).lower()


@pytest.mark.parametrize("case", [c for c in CASES if c.name.endswith(".gguf")], ids=lambda c: c.name)
def test_load_model_refuses_every_corpus_gguf(case):
    # Even the valid ones lack the model metadata, so load_model must refuse them all, cleanly.
    with pytest.raises(ModelLoadError):
        load_model(os.path.join(CORPUS, case.name))


def test_a_tokenizers_panic_is_a_model_load_error():
    # pyo3's PanicException derives from BaseException, so it passes `except Exception`; a broken
    # tokenizer.json must still come out of loading as a ModelLoadError naming the file.
    from corelm.tokenizer import _self_tested

    class PanicException(BaseException):
        pass

    def make():
        raise PanicException("no entry found for key")
    with pytest.raises(ModelLoadError, match="some/tokenizer.json: the tokenizer is broken.*no entry found"):
        _self_tested(make, "some/tokenizer.json")
    with pytest.raises(KeyboardInterrupt):
        _self_tested(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), "x")


_SUBPROCESS_PROBE = textwrap.dedent("""
    import os, resource, sys
    # A parser that trusts a declared size would try to allocate it; cap the address space so that shows.
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    from corelm.loader import ModelLoadError
    from corelm.loader.gguf import read_gguf
    from corelm.loader.safetensors import SafetensorsFile
    corpus = sys.argv[1]
    bad = 0
    for name in sorted(os.listdir(corpus)):
        path = os.path.join(corpus, name)
        if os.path.isdir(path):
            continue
        try:
            if name.endswith(".gguf"):
                g = read_gguf(path)
                [g.dequantize(t) for t in g.tensors]
            else:
                f = SafetensorsFile(path)
                [f.get(t) for t in f.tensors]
            print("OK", name)
        except ModelLoadError as e:
            print("REFUSED", name, "|", e)
        except BaseException as e:
            bad += 1
            print("CRASH", name, "|", type(e).__name__, e)
    sys.exit(1 if bad else 0)
""")


def test_no_crash_in_a_subprocess():
    r = subprocess.run([sys.executable, "-c", _SUBPROCESS_PROBE, CORPUS], capture_output=True, text=True,
                       env=child_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert len(lines) == len(CASES)
    for c in CASES:
        assert any(line.split(" ", 2)[1] == c.name and line.startswith("OK" if c.expect is None else "REFUSED")
                   for line in lines), c.name


# A small deterministic fuzz: truncations and byte mutations of the valid files must only ever give
# a clean load or a ModelLoadError, never another exception.

def _mutants(data: bytes, seed: int, n_random: int):
    rng = np.random.default_rng(seed)
    for cut in range(0, len(data), max(1, len(data) // 200)):
        yield f"cut{cut}", data[:cut]
    for i in range(n_random):
        b = bytearray(data)
        for pos in rng.integers(0, len(b), size=int(rng.integers(1, 4))):
            b[pos] = int(rng.choice([0x00, 0xFF, 0x7F, 0x80, int(rng.integers(0, 256))]))
        yield f"mut{i}", bytes(b)


@pytest.mark.parametrize("source", ["valid_tiny.gguf", "valid_tiny.safetensors"])
def test_fuzzed_files_only_raise_model_load_error(tmp_path, source):
    data = next(c.data for c in CASES if c.name == source)
    path = str(tmp_path / source)
    outcomes = {"ok": 0, "refused": 0}
    for label, blob in _mutants(data, seed=1234, n_random=400):
        with open(path, "wb") as f:
            f.write(blob)
        try:
            probe(path)
            outcomes["ok"] += 1
        except ModelLoadError:
            outcomes["refused"] += 1
        except Exception as e:  # pragma: no cover - this is the failure being tested for
            pytest.fail(f"{source} {label}: {type(e).__name__}: {e}")
    assert outcomes["refused"] > 0
