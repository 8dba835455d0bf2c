"""GGUF metadata that would cost far more memory than the file's bytes, and a context too small to run.

Issue 50: stories260K.gguf with tokenizer.ggml.token_type retyped to UINT8 and its count set to 268,435,455,
in a file long enough to hold that many bytes, peaked at 2.6 GB RSS for 9 s (a Python list of 2^28 ints)
before its ModelLoadError, and under a 2 GiB address-space limit a bare MemoryError escaped. A GGUF with
context_length = 1 loaded, and every prompt then raised ValueError."""
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from conftest import MODELS, ROOT, child_env

from corelm.loader import ModelLoadError, load_model
from corelm.loader import gguf as gguf_mod

STORIES_GGUF = os.path.join(MODELS, "stories260K", "stories260K.gguf")
HUGE_COUNT = 268_435_455
GGUF_UINT8, GGUF_UINT32, GGUF_ARRAY = 0, 4, 9


def _key_offset(data: bytes, key: str) -> int:
    """Where the value of metadata `key` starts (just after its name and value type)."""
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name)
    return at + 8 + len(name) + 4


def _patched_copy(tmp_path, edit) -> str:
    path = str(tmp_path / "stories260K.gguf")
    data = bytearray(open(STORIES_GGUF, "rb").read())
    edit(data)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _huge_uint8_array(tmp_path, key: str, rename: bytes = b"") -> str:
    """token_type as UINT8 x HUGE_COUNT (optionally renamed, to a key that is no vocabulary array), the
    file grown (sparse: no disk used) so that its bytes could hold them."""
    def edit(data):
        at = _key_offset(data, key)
        assert struct.unpack_from("<IIQ", data, at - 4) == (GGUF_ARRAY, 5, 512)     # ARRAY of 512 INT32
        struct.pack_into("<IQ", data, at, GGUF_UINT8, HUGE_COUNT)
        if rename:
            name_at = at - 4 - len(key)
            data[name_at:name_at + len(key)] = rename
    path = _patched_copy(tmp_path, edit)
    os.truncate(path, os.path.getsize(path) + HUGE_COUNT + (1 << 20))
    return path


CHILD = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from corelm.loader import ModelLoadError, load_model
t0 = time.monotonic()
try:
    load_model(sys.argv[1])
    out = "loaded"
except ModelLoadError as e:
    out = "ModelLoadError: " + str(e)
except BaseException as e:
    out = type(e).__name__ + ": " + str(e)
# this process's own peak (VmHWM starts afresh at exec; ru_maxrss keeps the forking parent's)
peak_kb = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"out": out, "seconds": time.monotonic() - t0, "maxrss_mb": peak_kb / 1024}))
"""


@pytest.mark.parametrize("rename, message", [
    (b"", "has 268435455 elements, but the vocabulary has 512 tokens"),
    (b"tokenizer.ggml.token_typX", "over the limit of"),       # not a per-token array: the general cap
])
def test_a_huge_metadata_array_is_refused_before_it_is_read(tmp_path, rename, message):
    path = _huge_uint8_array(tmp_path, "tokenizer.ggml.token_type", rename)
    r = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, env=child_env(),
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["out"].startswith("ModelLoadError: ") and message in res["out"], res
    assert res["seconds"] < 2.0, res
    assert res["maxrss_mb"] < 400, res          # the interpreter, numpy and corelm: ~100 MB


def test_memory_error_while_parsing_is_a_model_load_error(monkeypatch):
    def no_memory(*args, **kwargs):
        raise MemoryError()
    monkeypatch.setattr(gguf_mod, "_read_tensor_infos", no_memory)
    with pytest.raises(ModelLoadError, match="ran out of memory reading the GGUF metadata"):
        gguf_mod.read_gguf(STORIES_GGUF)


def test_per_token_arrays_must_match_the_vocabulary(tmp_path):
    def edit(data):     # scores: 511 entries (the last one's 4 bytes stay, as garbage for the next key)
        struct.pack_into("<Q", data, _key_offset(data, "tokenizer.ggml.scores") + 4, 511)
    with pytest.raises(ModelLoadError, match="'tokenizer.ggml.scores' has 511 elements, but the vocabulary "
                                             "has 512 tokens"):
        load_model(_patched_copy(tmp_path, edit))


@pytest.mark.parametrize("context", [0, 1])
def test_a_context_too_small_for_one_prompt_token_and_one_generated_is_refused(tmp_path, context):
    def edit(data):
        at = _key_offset(data, "llama.context_length")
        assert struct.unpack_from("<II", data, at - 4) == (GGUF_UINT32, 2048)
        struct.pack_into("<I", data, at, context)
    path = _patched_copy(tmp_path, edit)
    message = "must hold at least 2" if context else "is not a positive integer"
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)


def test_a_context_of_two_loads_and_generates_one_token(tmp_path):
    def edit(data):
        struct.pack_into("<I", data, _key_offset(data, "llama.context_length"), 2)
    from corelm import LLM, SamplingParams
    llm = LLM(_patched_copy(tmp_path, edit), threads=1)
    out = llm.generate([1], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_an_hf_config_with_a_one_token_context_is_refused(tmp_path):
    src = os.path.join(MODELS, "stories260K")
    dst = tmp_path / "stories"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.gguf"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="must hold at least 2"):
        load_model(str(dst))
