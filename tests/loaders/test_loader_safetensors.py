"""safetensors: values and dtype conversion, header validation, sharded folders and their index."""
import json
import os

import numpy as np
import pytest

from corelm.loader import ModelLoadError
from corelm.loader.safetensors import SafetensorsFile, open_safetensors_folder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO, "tests", "data", "corrupt")


from conftest import corpus_tool  # noqa: E402

tool = corpus_tool()


def _stories_safetensors():
    return os.path.join(REPO, "tests", "data", "models", "stories260K", "model.safetensors")


def test_valid_tiny_values():
    f = SafetensorsFile(os.path.join(CORPUS, "valid_tiny.safetensors"))
    assert f.metadata == {"format": "pt"}
    assert {n: (t.dtype, t.shape) for n, t in f.tensors.items()} == {
        "f32": ("F32", (2, 3)), "f16": ("F16", (4,)), "bf16": ("BF16", (2, 2)), "i8": ("I8", (3,)),
        "scalar": ("F32", ()), "empty": ("F32", (0, 4))}
    np.testing.assert_array_equal(f.get("f32"), (np.arange(6) - 2.5).reshape(2, 3))
    np.testing.assert_array_equal(f.get("f16"), [0.5, -1.0, 2.0, 1024.0])
    np.testing.assert_array_equal(f.get("bf16"), [[1.0, -2.0], [0.5, 3.0]])
    np.testing.assert_array_equal(f.get("i8"), [-1.0, 0.0, 7.0])
    assert f.get("scalar").shape == () and float(f.get("scalar")) == 42.0
    assert f.get("empty").shape == (0, 4)
    for name in f.tensors:
        w = f.get(name)
        assert w.dtype == np.float32 and w.flags.c_contiguous
    assert "f32" in f and "nope" not in f and sorted(f.keys()) == sorted(f.tensors)


def test_f32_is_a_read_only_view_of_the_mapping():
    w = SafetensorsFile(os.path.join(CORPUS, "valid_tiny.safetensors")).get("f32")
    assert not w.flags.writeable
    with pytest.raises(ValueError):
        w[0, 0] = 1.0


def test_bf16_widening_is_exact(tmp_path):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, 1000, dtype=np.uint16)
    bits = bits[(bits & 0x7F80) != 0x7F80]          # skip inf/nan patterns so comparisons are plain
    p = tmp_path / "b.safetensors"
    p.write_bytes(tool.safetensors_from_arrays({"w": ("BF16", [len(bits)], bits.astype("<u2").tobytes())}))
    got = SafetensorsFile(str(p)).get("w")
    np.testing.assert_array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)


def test_zero_sized_tensors_may_share_an_offset(tmp_path):
    p = tmp_path / "z.safetensors"
    header = {"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    p.write_bytes(tool.build_safetensors(header, b"\0" * 8))
    assert SafetensorsFile(str(p)).get("a").shape == (0,)


def test_missing_tensor_and_missing_file(tmp_path):
    f = SafetensorsFile(os.path.join(CORPUS, "valid_tiny.safetensors"))
    with pytest.raises(ModelLoadError, match="no tensor named 'nope'"):
        f.get("nope")
    with pytest.raises(ModelLoadError, match="cannot open"):
        SafetensorsFile(str(tmp_path / "absent.safetensors"))


def test_matches_the_safetensors_package():
    st = pytest.importorskip("safetensors.numpy")
    path = _stories_safetensors()
    ref = st.load_file(path)
    ours = SafetensorsFile(path)
    assert sorted(ours.keys()) == sorted(ref)
    for name, arr in ref.items():
        np.testing.assert_array_equal(ours.get(name), arr.astype(np.float32))


# ---------------------------------------------------------------------------------------------------
# Sharded folders.

def _write_sharded(folder, weight_map=None, index_text=None):
    a = tool.safetensors_from_arrays({"x": ("F32", [2], tool.f32_bytes([1, 2]))})
    b = tool.safetensors_from_arrays({"y": ("F16", [2], tool.f16_bytes([3, 4])),
                                      "z": ("F32", [1], tool.f32_bytes([5]))})
    (folder / "model-00001-of-00002.safetensors").write_bytes(a)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b)
    if weight_map is None:
        weight_map = {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors",
                      "z": "model-00002-of-00002.safetensors"}
    text = index_text if index_text is not None else json.dumps({"metadata": {}, "weight_map": weight_map})
    (folder / "model.safetensors.index.json").write_text(text)


def test_sharded_folder(tmp_path):
    _write_sharded(tmp_path)
    c = open_safetensors_folder(str(tmp_path))
    assert sorted(c) == ["x", "y", "z"]
    np.testing.assert_array_equal(c.get("y"), [3, 4])
    assert c.info("z").shape == (1,)
    with pytest.raises(ModelLoadError, match="no tensor named"):
        c.get("w")


def test_single_file_folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(tool.valid_safetensors())
    assert "f32" in open_safetensors_folder(str(tmp_path))


def test_folder_without_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        open_safetensors_folder(str(tmp_path))


@pytest.mark.parametrize("shard", ["../model-00001-of-00002.safetensors", "/etc/passwd", "sub/x.safetensors",
                                   "..", "", "a\\b.safetensors", "config.json"])
def test_index_shard_names_must_be_plain_files_in_the_folder(tmp_path, shard):
    _write_sharded(tmp_path, {"x": shard})
    with pytest.raises(ModelLoadError, match="not a plain .safetensors file name"):
        open_safetensors_folder(str(tmp_path))


def test_index_missing_shard(tmp_path):
    _write_sharded(tmp_path, {"x": "model-00003-of-00003.safetensors"})
    with pytest.raises(ModelLoadError, match="shard model-00003-of-00003.safetensors is missing"):
        open_safetensors_folder(str(tmp_path))


def test_index_points_to_the_wrong_shard(tmp_path):
    _write_sharded(tmp_path, {"x": "model-00002-of-00002.safetensors"})
    with pytest.raises(ModelLoadError, match="does not contain it"):
        open_safetensors_folder(str(tmp_path))


def test_tensor_in_two_shards(tmp_path):
    _write_sharded(tmp_path, {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"})
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(
        tool.safetensors_from_arrays({"x": ("F32", [1], tool.f32_bytes([0])), "y": ("F32", [1], tool.f32_bytes([0]))}))
    with pytest.raises(ModelLoadError, match="appears in both"):
        open_safetensors_folder(str(tmp_path))


@pytest.mark.parametrize("text,match", [
    ("not json", "not a valid shard index"),
    ('{"weight_map": {"x": "a.safetensors"}, "weight_map": {}}', "duplicate"),
    ('{"metadata": {}}', "weight_map"),
    ('{"weight_map": {"x": 3}}', "weight_map"),
    ('[]', "weight_map"),
])
def test_bad_index(tmp_path, text, match):
    _write_sharded(tmp_path, index_text=text)
    with pytest.raises(ModelLoadError, match=match):
        open_safetensors_folder(str(tmp_path))
