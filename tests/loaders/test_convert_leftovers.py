"""What a `corelm convert` killed with SIGKILL leaves beside its output (issue 50), and the next convert into
the same folder cleaning it up: the hidden unfinished folder is removed once its process is dead, and the
old output that `--force` had moved aside is put back. The kills are real: a child convert ends itself with
os._exit (no cleanup runs, as under SIGKILL) at the chosen point."""
import json
import logging
import os
import subprocess
import sys
import tempfile

from conftest import MODELS, child_env

import corelm.convert as conv
from corelm.convert import convert
from corelm.entrypoints.cli import main as cli_main
from corelm.loader import load_model

STORIES = os.path.join(MODELS, "stories260K")

KILLED_WRITING = """
import os, sys
import corelm.convert as conv
real, n = conv.WeightsWriter.add, [0]
def add(self, name, data):
    n[0] += 1
    if n[0] == 3:
        os._exit(9)
    real(self, name, data)
conv.WeightsWriter.add = add
conv.convert(sys.argv[1], sys.argv[2], weights="q8", progress=False)
"""

# os._exit right after the rename whose source (1: `out` moved aside) or destination (2: the new folder in place)
# is the output folder.
KILLED_RENAMING = """
import os, sys
import corelm.convert as conv
out, which = os.path.abspath(sys.argv[2]), sys.argv[3]
real = os.rename
def rename(a, b):
    real(a, b)
    if (a if which == "aside" else b) == out:
        os._exit(9)
os.rename = rename
conv.convert(sys.argv[1], out, weights="bf16", overwrite=True, progress=False)
"""


def killed_convert(script, *args):
    p = subprocess.run([sys.executable, "-c", script, STORIES, *map(str, args)], env=child_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 9, p.stderr


def hidden(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith(".corelm-"))


def contents(folder):
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}


def test_a_killed_conversions_unfinished_folder_is_removed_by_the_next_convert(tmp_path, caplog):
    killed_convert(KILLED_WRITING, tmp_path / "m")
    assert not os.path.exists(tmp_path / "m") and len(hidden(tmp_path)) == 1      # what the kill leaves
    left = hidden(tmp_path)[0]
    with caplog.at_level(logging.WARNING, logger="corelm"):
        convert(STORIES, str(tmp_path / "other"), weights="q8")
    assert sorted(os.listdir(tmp_path)) == ["other"]
    assert left in caplog.text and "removed" in caplog.text


def test_a_force_killed_between_its_renames_gets_the_old_folder_back(tmp_path, capsys, caplog):
    """The kill between `out` -> aside and new -> `out` left no output and the old folder hidden."""
    d = tmp_path / "m"
    convert(STORIES, str(d), weights="q8")
    before = contents(d)
    killed_convert(KILLED_RENAMING, d, "aside")
    assert not os.path.exists(d) and any(n.startswith(".corelm-old-") for n in hidden(tmp_path))
    # the next convert into the folder (here without --force: it finds the old output back, and keeps it)
    with caplog.at_level(logging.WARNING, logger="corelm"):
        assert cli_main(["convert", STORIES, "-o", str(d), "--weights", "q4", "--no-progress"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert f"restored {d}" in caplog.text
    assert contents(d) == before and hidden(tmp_path) == []
    assert load_model(str(d)).description.startswith("corelm v1 q8_0")


def test_a_force_killed_after_its_renames_has_the_old_folder_deleted(tmp_path):
    d = tmp_path / "m"
    convert(STORIES, str(d), weights="q8")
    killed_convert(KILLED_RENAMING, d, "in place")
    assert len(hidden(tmp_path)) == 1                   # the new folder is in place, the old one not deleted
    convert(STORIES, str(tmp_path / "other"), weights="q8")
    assert sorted(os.listdir(tmp_path)) == ["m", "other"]
    assert json.load(open(d / "config.json"))["weights"] == "bf16"


def test_leftovers_of_a_running_convert_or_of_no_known_owner_are_left_alone(tmp_path, caplog):
    """A live owner's folders (here this process's) are a convert running now; a folder without an owner
    (an older corelm's name, or another host's) is reported, never deleted."""
    mine = tempfile.mkdtemp(prefix=conv._owned(conv.STAGING_PREFIX), dir=tmp_path)
    mine_aside = tempfile.mkdtemp(prefix=conv._owned(conv.ASIDE_PREFIX), dir=tmp_path)
    os.mkdir(os.path.join(mine_aside, "gone"))
    legacy = tmp_path / ".corelm-convert-k2x9_q7a"      # tempfile.mkdtemp(prefix=".corelm-convert-"), as before
    legacy.mkdir()
    (legacy / "weights.corelm").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="corelm"):
        convert(STORIES, str(tmp_path / "other"), weights="q8")
    assert sorted(os.listdir(tmp_path)) == sorted(["other", os.path.basename(mine), os.path.basename(mine_aside),
                                                   legacy.name])
    assert os.path.isdir(os.path.join(mine_aside, "gone")) and not os.path.exists(tmp_path / "gone")
    assert str(legacy) in caplog.text and "killed" in caplog.text
    assert os.path.basename(mine) not in caplog.text

