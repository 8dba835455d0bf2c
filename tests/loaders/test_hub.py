"""Models from the Hugging Face hub (corelm.loader.hub, `corelm pull`, `corelm list`), against a fake hub:
huggingface_hub's list_repo_files, hf_hub_download and snapshot_download replaced by FakeHub's, which serve
repositories from local folders and write huggingface_hub's cache layout in tmp_path ($HF_HUB_CACHE)."""
import fnmatch
import os
import shutil
import subprocess
import sys

import pytest

import corelm
from corelm.engine.sampling import SamplingParams
from corelm.entrypoints import cli
from corelm.loader import ModelLoadError, load_model
from corelm.loader.hub import HUB_PATTERNS, HubRef, cached_models, choose_gguf, download_from_hub, parse_hub_ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORIES = os.path.join(ROOT, "tests", "data", "models", "stories260K")
GGUF = os.path.join(STORIES, "stories260K.gguf")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "corelm-test/stories-GGUF"


class FakeHub:
    """Repositories as folders (root/owner/name/FILE); downloads land where huggingface_hub puts them
    (cache/models--owner--name/snapshots/COMMIT/FILE, with refs/main), so scan_cache_dir reads them."""

    def __init__(self, root, cache):
        self.root, self.cache, self.calls, self.error = root, cache, [], None

    def add(self, repo_id, files):
        """files: {name in the repository: a path to copy or bytes}."""
        for name, content in files.items():
            dst = self.root / repo_id / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                dst.write_bytes(content)
            else:
                shutil.copyfile(content, dst)

    def _repo(self, repo_id):
        if self.error is not None:
            raise self.error
        if not (self.root / repo_id).is_dir():
            raise OSError(f"404 Client Error: Repository Not Found for url: https://huggingface.co/{repo_id}")
        return self.root / repo_id

    def _snapshot(self, repo_id):
        folder = self.cache / ("models--" + repo_id.replace("/", "--"))
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / "main").write_text(COMMIT)
        return folder / "snapshots" / COMMIT

    def list_repo_files(self, repo_id, *, revision=None, **kw):
        self.calls.append(("list", repo_id, revision))
        repo = self._repo(repo_id)
        return sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())

    def hf_hub_download(self, repo_id, filename, *, revision=None, **kw):
        self.calls.append(("download", repo_id, filename, revision))
        dst = self._snapshot(repo_id) / filename
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._repo(repo_id) / filename, dst)
        return str(dst)

    def snapshot_download(self, repo_id, *, revision=None, allow_patterns=None, local_files_only=False, **kw):
        self.calls.append(("snapshot", repo_id, revision, tuple(allow_patterns or ()), local_files_only))
        if not local_files_only:
            for name in self.list_repo_files(repo_id, revision=revision):
                if any(fnmatch.fnmatch(name, p) for p in allow_patterns or ["*"]):
                    self.hf_hub_download(repo_id, name, revision=revision)
        return str(self._snapshot(repo_id))

    def downloads(self):
        return [c[2] for c in self.calls if c[0] == "download"]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub
    fake = FakeHub(tmp_path / "hub", tmp_path / "cache")
    for name in ("list_repo_files", "hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, getattr(fake, name))
    monkeypatch.setenv("HF_HUB_CACHE", str(fake.cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(fake.cache))
    fake.add(REPO, {"stories-Q4_K_M.gguf": GGUF, "stories-Q8_0.gguf": GGUF, "README.md": b"# stories\n"})
    return fake


def greedy(llm, n=8):
    return llm.generate("Once upon a time", SamplingParams(max_tokens=n, temperature=0))[0].outputs[0].text


# --------------------------------------------------------------------------------------------------
# references and the choice of a file

@pytest.mark.parametrize("text, ref", [
    ("owner/name", HubRef("owner/name")),
    ("owner/name:Q4_K_M", HubRef("owner/name", "Q4_K_M")),
    ("hf.co/owner/name:q8_0", HubRef("owner/name", "q8_0")),
    ("huggingface.co/Owner/Name-1.5B-GGUF", HubRef("Owner/Name-1.5B-GGUF")),
    ("https://huggingface.co/owner/name:Q4_K_M", HubRef("owner/name", "Q4_K_M")),
    ("owner/name@v1.0:model-f16.gguf", HubRef("owner/name", "model-f16.gguf", "v1.0")),
    ("owner/name@refs/pr/1", HubRef("owner/name", None, "refs/pr/1")),
])
def test_parse_hub_ref(text, ref):
    assert parse_hub_ref(text) == ref
    assert parse_hub_ref(str(ref)) == ref


@pytest.mark.parametrize("text", ["name", "./owner/name", "/owner/name", "~/owner/name", "owner/../name",
                                  "a/b/c", "owner/name:", "owner/name:a:b", "", "owner/ name"])
def test_paths_and_junk_are_not_references(text):
    assert parse_hub_ref(text) is None


QWEN = "qwen2.5-coder-1.5b-instruct"
LISTING = [".gitattributes", "README.md", f"{QWEN}-q4_k_m.gguf", f"{QWEN}-q4_k_s.gguf", f"{QWEN}-q8_0.gguf",
           f"{QWEN}-fp16-00001-of-00002.gguf", f"{QWEN}-fp16-00002-of-00002.gguf", "mmproj-qwen-f16.gguf"]


@pytest.mark.parametrize("quant, file", [
    ("Q4_K_M", f"{QWEN}-q4_k_m.gguf"),
    ("q8_0", f"{QWEN}-q8_0.gguf"),
    ("Q4_K_S", f"{QWEN}-q4_k_s.gguf"),
    (f"{QWEN}-Q4_K_S.gguf", f"{QWEN}-q4_k_s.gguf"),   # a file name, whatever its case
    (None, f"{QWEN}-q4_k_m.gguf"),                    # the default: Q4_K_M
])
def test_a_quant_picks_its_file(quant, file):
    assert choose_gguf(HubRef("o/n", quant), LISTING) == file


def test_without_q4_k_m_the_default_is_the_first_gguf_by_name():
    assert choose_gguf(HubRef("o/n"), ["README.md", "m-Q8_0.gguf", "m-Q2_K.gguf"]) == "m-Q2_K.gguf"
    assert choose_gguf(HubRef("o/n"), ["Q6_K.gguf"]) == "Q6_K.gguf"


def test_a_repository_with_safetensors_stays_a_folder_unless_a_quant_is_named():
    files = ["config.json", "model.safetensors", "tokenizer.json", "model-Q8_0.gguf"]
    assert choose_gguf(HubRef("o/n"), files) is None
    assert choose_gguf(HubRef("o/n"), ["config.json", "README.md"]) is None
    assert choose_gguf(HubRef("o/n", "q8_0"), files) == "model-Q8_0.gguf"
    with pytest.raises(ModelLoadError, match=r"o/n has no GGUF files; drop ':Q4_K_M' to download its safetensors"):
        choose_gguf(HubRef("o/n", "Q4_K_M"), files[:3])


def test_an_ambiguous_quant_names_the_matches():
    with pytest.raises(ModelLoadError) as e:
        choose_gguf(HubRef("o/n", "Q4_K"), LISTING)
    assert str(e.value) == (f"o/n has several GGUF files matching 'Q4_K': Q4_K_M ({QWEN}-q4_k_m.gguf), "
                            f"Q4_K_S ({QWEN}-q4_k_s.gguf); name one as o/n:QUANT or by its file name")


def test_an_unknown_quant_lists_the_repositorys_quants():
    with pytest.raises(ModelLoadError) as e:
        choose_gguf(HubRef("o/n", "Q5_K_M"), LISTING)
    msg = str(e.value)
    assert msg.startswith("o/n has no GGUF files matching 'Q5_K_M': FP16 (")
    for quant in ("Q4_K_M", "Q4_K_S", "Q8_0"):
        assert f"{quant} ({QWEN}-{quant.lower()}.gguf)" in msg
    assert "mmproj" not in msg      # vision projectors are not models


def test_split_ggufs_are_refused_with_the_way_out():
    with pytest.raises(ModelLoadError) as e:
        choose_gguf(HubRef("o/n", "FP16"), LISTING)
    msg = str(e.value)
    assert f"{QWEN}-fp16.gguf is split into 2 files ({QWEN}-fp16-00001-of-00002.gguf, " in msg
    assert "single-file GGUFs only" in msg and "llama-gguf-split --merge" in msg


# --------------------------------------------------------------------------------------------------
# pull, load, list

def test_pull_downloads_one_file_and_prints_its_path(hub, capsys):
    assert cli.main(["pull", REPO + ":q8_0"]) == 0
    path = capsys.readouterr().out.strip()
    assert path == str(hub.cache / "models--corelm-test--stories-GGUF" / "snapshots" / COMMIT / "stories-Q8_0.gguf")
    assert hub.downloads() == ["stories-Q8_0.gguf"]
    assert greedy(corelm.LLM(path, threads=1)) == greedy(corelm.LLM(GGUF, threads=1))
    assert cli.main(["pull", "hf.co/" + REPO]) == 0      # the default: Q4_K_M
    assert capsys.readouterr().out.strip().endswith("stories-Q4_K_M.gguf")


def test_llm_and_the_commands_take_a_reference(hub, capsys):
    expected = greedy(corelm.LLM(GGUF, threads=1))
    assert greedy(corelm.LLM("hf.co/" + REPO + ":Q4_K_M", threads=1)) == expected
    argv = ["-p", "Once upon a time", "-n", "8", "--temp", "0", "-t", "1", "--no-stream"]
    assert cli.main(["generate", REPO + ":Q8_0"] + argv) == 0
    assert cli.main(["generate", GGUF] + argv) == 0
    out = capsys.readouterr().out
    assert out[:len(out) // 2] == out[len(out) // 2:] and out.strip()
    assert hub.downloads() == ["stories-Q4_K_M.gguf", "stories-Q8_0.gguf"]


def test_a_safetensors_repository_is_still_a_snapshot_folder(hub, capsys):
    names = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    hub.add("corelm-test/stories", {**{n: os.path.join(STORIES, n) for n in names}, "pytorch_model.bin": b"no"})
    m = load_model("corelm-test/stories")
    assert m.spec.num_layers == 5 and m.source_format != "gguf"
    assert [c[:4] for c in hub.calls if c[0] == "snapshot"] == [("snapshot", "corelm-test/stories", None,
                                                                  tuple(HUB_PATTERNS))]
    assert sorted(hub.downloads()) == sorted(names)      # no pickle
    assert cli.main(["pull", "corelm-test/stories"]) == 0
    assert capsys.readouterr().out.strip() == str(hub.cache / "models--corelm-test--stories" / "snapshots" / COMMIT)


def test_a_revision_reaches_the_hub(hub):
    download_from_hub(REPO + "@v1:Q8_0")
    assert hub.calls == [("list", REPO, "v1"), ("download", REPO, "stories-Q8_0.gguf", "v1")]
    download_from_hub(REPO + ":Q8_0", revision="v2")
    assert hub.calls[-1] == ("download", REPO, "stories-Q8_0.gguf", "v2")
    with pytest.raises(ModelLoadError, match="names revision 'v1' but revision='v2' was given"):
        download_from_hub(REPO + "@v1", revision="v2")


def test_pull_errors_exit_1(hub, capsys):
    hub.add("corelm-test/split-GGUF", {"m-Q8_0-00001-of-00002.gguf": b"GGUF", "m-Q8_0-00002-of-00002.gguf": b"x"})
    for argv, message in [
            (["pull", "corelm-test/split-GGUF"], "m-Q8_0.gguf is split into 2 files"),
            (["pull", REPO + ":Q5_K_M"], f"{REPO} has no GGUF files matching 'Q5_K_M': Q4_K_M (stories-Q4_K_M.gguf), "
                                         f"Q8_0 (stories-Q8_0.gguf)"),
            (["pull", "corelm-test/missing"], "could not download 'corelm-test/missing' from the Hugging Face hub"),
            (["pull", "./local/path"], "'./local/path' is not a Hugging Face hub reference")]:
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
    assert hub.downloads() == []


def test_list_shows_the_cache(hub, capsys):
    assert cli.main(["list"]) == 0      # no cache folder yet
    assert capsys.readouterr().out == f"no models in the Hugging Face cache ({hub.cache}); " \
                                       f"`corelm pull ID[:QUANT]` downloads one\n"
    names = ["config.json", "model.safetensors", "tokenizer.json"]
    hub.add("corelm-test/stories", {n: os.path.join(STORIES, n) for n in names})
    for ref in (REPO + ":Q8_0", REPO + ":Q4_K_M", "corelm-test/stories"):
        download_from_hub(ref)
    assert [m.model for m in cached_models()] == ["corelm-test/stories", REPO + ":Q4_K_M", REPO + ":Q8_0"]
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    snapshot = hub.cache / "models--corelm-test--stories-GGUF" / "snapshots" / COMMIT
    assert lines[0].split() == ["MODEL", "SIZE", "PATH"]
    assert lines[1].split()[0] == "corelm-test/stories" and lines[1].endswith("snapshots/" + COMMIT)
    assert lines[2].split() == [REPO + ":Q4_K_M", "1.1", "MiB", str(snapshot / "stories-Q4_K_M.gguf")]
    assert lines[3].split()[0] == REPO + ":Q8_0"
    assert len({line.index(str(hub.cache)) for line in lines[1:]}) == 1     # aligned columns


# --------------------------------------------------------------------------------------------------
# offline

def test_an_unreachable_hub_falls_back_to_the_cache(hub):
    path = download_from_hub(REPO + ":Q8_0")
    hub.error = ConnectionError("[Errno -2] Name or service not known")
    assert download_from_hub(REPO + ":q8_0") == path
    assert load_model(REPO + ":Q8_0").spec.num_layers == 5
    with pytest.raises(ModelLoadError) as e:     # the cache's listing, said to be the cache's
        download_from_hub(REPO + ":Q4_K_M")
    assert str(e.value).startswith(f"{REPO} (as cached in {os.path.dirname(path)}; the hub could not be reached: "
                                   f"ConnectionError: [Errno -2] Name or service not known) has no GGUF files "
                                   f"matching 'Q4_K_M': Q8_0 (stories-Q8_0.gguf)")
    assert hub.downloads() == ["stories-Q8_0.gguf"]


def test_an_unreachable_hub_with_nothing_cached_says_so(hub, capsys):
    from huggingface_hub.errors import OfflineModeIsEnabled
    hub.error = OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/models/x: offline mode is enabled.")
    assert cli.main(["pull", REPO + ":Q4_K_M"]) == 1
    assert capsys.readouterr().err == (
        f"error: could not download '{REPO}:Q4_K_M' from the Hugging Face hub (and there is no local file or folder "
        f"by that name): OfflineModeIsEnabled: Cannot reach https://huggingface.co/api/models/x: offline mode is "
        f"enabled; pass a local folder or .gguf file\n")


def run_cli(args, cache):
    """The real `corelm` in a child process: the real huggingface_hub, offline, on the cache folder `cache`."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache) + "-home",
               PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "corelm.entrypoints.cli"] + args, capture_output=True, text=True,
                          env=env, timeout=120)


def test_offline_with_the_real_huggingface_hub(hub):
    """HF_HUB_OFFLINE=1 and $HF_HUB_CACHE as the real huggingface_hub reads them: a pulled model resolves
    from the cache, anything else is the clear error, and `corelm list` reads that cache."""
    path = download_from_hub(REPO + ":Q8_0")
    r = run_cli(["pull", REPO + ":Q8_0"], hub.cache)
    assert (r.returncode, r.stdout) == (0, path + "\n"), r.stderr
    r = run_cli(["pull", "corelm-test/not-cached:Q4_K_M"], hub.cache)
    assert r.returncode == 1
    assert r.stderr.startswith("error: could not download 'corelm-test/not-cached:Q4_K_M' from the Hugging Face "
                               "hub (and there is no local file or folder by that name): OfflineModeIsEnabled: ")
    assert "HF_HUB_OFFLINE" in r.stderr and r.stderr.endswith("; pass a local folder or .gguf file\n")
    r = run_cli(["list"], hub.cache)
    assert r.returncode == 0 and r.stdout.splitlines()[1].split()[::3] == [REPO + ":Q8_0", path], r.stdout
