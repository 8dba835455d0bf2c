"""Models on the Hugging Face hub: references, picking a repository's GGUF file, downloads into
huggingface_hub's cache ($HF_HUB_CACHE, else $HF_HOME/hub), and what that cache holds.

A reference is `owner/name[@REVISION][:QUANT]`, optionally written `hf.co/...` or `huggingface.co/...`
as Ollama and llama.cpp's `-hf` take it:

    download_from_hub("bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")   # -> .../snapshots/<commit>/...Q4_K_M.gguf
    download_from_hub("HuggingFaceTB/SmolLM2-135M-Instruct")          # -> the snapshot folder (safetensors)

Which files (choose_gguf):
- with QUANT, the repository's GGUF file whose name holds it, case-insensitively: the file named QUANT,
  else a file with QUANT as a part of its name between '-', '.' or '/', else one with QUANT anywhere in
  its name. No match, or several, is an error listing the repository's quants.
- without QUANT, a repository with *.safetensors weights is downloaded as a folder (configs, tokenizer
  and safetensors files, HUB_PATTERNS); one with GGUF files only gives its Q4_K_M file if it has one,
  else its first GGUF file by name (Ollama's and the hub's default).
Vision projectors (mmproj files) are never picked. Split GGUFs (`-00001-of-00003.gguf`) are refused:
corelm reads single-file GGUFs.

The repository is listed on the hub (huggingface_hub.list_repo_files). When the hub cannot be reached
(HF_HUB_OFFLINE=1, no network, an HTTP error), the local cache's copy of the revision is listed instead, so
a pulled model loads offline; with nothing cached, the error says why the hub could not be reached.
"""
from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from typing import Dict, List, Optional

from .spec import ModelLoadError

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "chat_template.jinja"]
DEFAULT_QUANT = "Q4_K_M"
_PREFIXES = ("https://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
_REF_RE = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[^:@\s]+))?(?::(?P<quant>[^:@\s]+))?")
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# ggml type names as files carry them: Q4_K_M, Q8_0, IQ4_XS, TQ1_0, F16, BF16...
_QUANT_RE = re.compile(r"(?<![a-z0-9])([it]?q\d+(?:_[a-z0-9]+)*|bf16|fp?16|fp?32)(?![a-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    quant: Optional[str] = None      # a quant name or file name; None: the default choice
    revision: Optional[str] = None   # a branch, tag or commit; None: main

    def __str__(self) -> str:
        return (self.repo_id + (f"@{self.revision}" if self.revision else "")
                + (f":{self.quant}" if self.quant else ""))


def parse_hub_ref(model: str) -> Optional[HubRef]:
    """The HubRef that `model` spells, or None when it is not one (nothing that reads as a path: no '..',
    no leading '/' or '.')."""
    text = model
    for prefix in _PREFIXES:
        if text.lower().startswith(prefix):
            text = text[len(prefix):]
            break
    m = _REF_RE.fullmatch(text)
    if not m or ".." in m["repo"] or len(m["repo"]) > 96:
        return None
    return HubRef(m["repo"], m["quant"], m["revision"])


def looks_like_repo_id(model: str) -> bool:
    return parse_hub_ref(model) is not None


def quant_name(file: str) -> Optional[str]:
    """The quant a GGUF file's name gives ('qwen2.5-1.5b-instruct-q4_k_m.gguf' -> 'Q4_K_M'), if any."""
    found = _QUANT_RE.findall(posixpath.basename(file)[:-len(".gguf")])
    return found[-1].upper() if found else None


# ---------------------------------------------------------------------------------------------------
# Choosing a file from a repository's listing.

def choose_gguf(ref: HubRef, files: List[str], source: str = "") -> Optional[str]:
    """The GGUF file of `files` (the repository's listing) that `ref` asks for, or None for a repository
    to download as a safetensors folder. `source` says where the listing came from, for errors."""
    models = _gguf_models(files)
    has_safetensors = any(f.endswith(".safetensors") for f in files)
    if ref.quant is None:
        if has_safetensors or not models:
            return None
        name = (_matching(models, DEFAULT_QUANT) or sorted(models))[0]
    else:
        if not models:
            hint = f"; drop ':{ref.quant}' to download its safetensors weights" if has_safetensors else ""
            raise ModelLoadError(f"{ref.repo_id}{source} has no GGUF files{hint}")
        picked = _matching(models, ref.quant)
        if len(picked) != 1:
            what = "several" if picked else "no"
            choices = picked or sorted(models)
            raise ModelLoadError(f"{ref.repo_id}{source} has {what} GGUF files matching {ref.quant!r}: "
                                 f"{_describe(choices)}; name one as {ref.repo_id}:QUANT or by its file name")
        name = picked[0]
    parts = models[name]
    if len(parts) > 1 or _SPLIT_RE.search(parts[0]):
        raise ModelLoadError(
            f"{ref.repo_id}: {name} is split into {len(parts)} files ({', '.join(parts)}); corelm reads "
            f"single-file GGUFs only: pick another quant, or download the parts and merge them with llama.cpp's "
            f"`llama-gguf-split --merge FIRST_PART OUT.gguf`, then pass OUT.gguf")
    return parts[0]


def _gguf_models(files: List[str]) -> Dict[str, List[str]]:
    """{model name: its files}: each .gguf file, the parts of a split one under one name (no -0000N-of-0000M)."""
    models: Dict[str, List[str]] = {}
    for f in sorted(files):
        if f.lower().endswith(".gguf") and "mmproj" not in posixpath.basename(f).lower():
            models.setdefault(_SPLIT_RE.sub(".gguf", f), []).append(f)
    return models


def _matching(models: Dict[str, List[str]], selector: str) -> List[str]:
    """The model names `selector` picks: by file name, else as a part of the name, else anywhere in it."""
    sel = selector.lower()
    names = sorted(models)

    def named(name: str) -> bool:
        return any(sel in (f.lower(), posixpath.basename(f).lower()) for f in [name] + models[name])

    def part(name: str) -> bool:
        return sel in re.split(r"[-./]", name.lower()[:-len(".gguf")])

    for test in (named, part, lambda name: sel in name.lower()):
        found = [n for n in names if test(n)]
        if found:
            return found
    return []


def _describe(names: List[str]) -> str:
    return ", ".join(f"{quant_name(n)} ({n})" if quant_name(n) else n for n in names)


# ---------------------------------------------------------------------------------------------------
# Downloads.

def _hub(model: Optional[str] = None):
    try:
        import huggingface_hub
    except ImportError:
        what = f"{model!r} is not a local path, and " if model else ""
        raise ModelLoadError(f"{what}huggingface_hub is not installed to download models from the hub; "
                             f"pass a local folder or .gguf file") from None
    return huggingface_hub


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip().splitlines()[0].rstrip(".")


def _download_error(model: str, e: BaseException) -> ModelLoadError:
    return ModelLoadError(f"could not download {model!r} from the Hugging Face hub (and there is no local file or "
                          f"folder by that name): {_reason(e)}; pass a local folder or .gguf file")


def download_from_hub(model: str, revision: Optional[str] = None) -> str:
    """The local path of hub reference `model`: its GGUF file, or the snapshot folder of a safetensors
    repository. Downloads what huggingface_hub's cache lacks; `revision` is the same as `@REVISION`."""
    ref = parse_hub_ref(model)
    if ref is None:
        raise ModelLoadError(f"{model!r} is not a Hugging Face hub reference (owner/name[@REVISION][:QUANT])")
    if revision and ref.revision and revision != ref.revision:
        raise ModelLoadError(f"{model!r} names revision {ref.revision!r} but revision={revision!r} was given")
    ref = HubRef(ref.repo_id, ref.quant, ref.revision or revision)
    hub = _hub(model)
    cached, source = None, ""
    try:
        files = hub.list_repo_files(ref.repo_id, revision=ref.revision)
    except Exception as e:  # offline, 404, gated, auth: what the cache holds, if anything
        cached = cached_snapshot(ref.repo_id, ref.revision)
        if cached is None:
            raise _download_error(model, e) from e
        files = _files_under(cached)
        source = f" (as cached in {cached}; the hub could not be reached: {_reason(e)})"
    name = choose_gguf(ref, files, source)
    try:
        if name is None:
            return hub.snapshot_download(repo_id=ref.repo_id, revision=ref.revision, allow_patterns=HUB_PATTERNS,
                                         local_files_only=cached is not None)
        if cached is not None:
            return os.path.join(cached, name)
        return hub.hf_hub_download(ref.repo_id, name, revision=ref.revision)
    except Exception as e:  # the listing worked but the download did not: disk full, connection lost
        raise _download_error(model, e) from e


# ---------------------------------------------------------------------------------------------------
# The local cache.

def cache_dir() -> str:
    """huggingface_hub's cache folder ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    return str(_hub().constants.HF_HUB_CACHE)


def _cached_revisions():
    """(repo id, CachedRevisionInfo) of every model revision in the cache; none when there is no cache."""
    hub = _hub()
    try:
        info = hub.scan_cache_dir(cache_dir())
    except (hub.CacheNotFound, ValueError):
        return []
    return sorted(((repo.repo_id, rev) for repo in info.repos if repo.repo_type == "model"
                   for rev in repo.revisions), key=lambda r: (r[0].lower(), sorted(r[1].refs), r[1].commit_hash))


def cached_snapshot(repo_id: str, revision: Optional[str] = None) -> Optional[str]:
    """The cached snapshot folder of `repo_id` at `revision` (a branch, tag or commit; None: main)."""
    for rid, rev in _cached_revisions():
        if rid == repo_id and ((revision or "main") in rev.refs or rev.commit_hash == revision):
            return str(rev.snapshot_path)
    return None


def _files_under(folder: str) -> List[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
                  for d, _, names in os.walk(folder) for f in names)


@dataclass(frozen=True)
class CachedModel:
    model: str      # the reference that loads it: owner/name:QUANT for a GGUF file, owner/name for a folder
    size: int       # bytes
    path: str       # the GGUF file or the snapshot folder


def cached_models() -> List[CachedModel]:
    """What the cache holds: each GGUF file, and each snapshot with safetensors weights as one folder
    (its files but the GGUFs)."""
    out = []
    for repo_id, rev in _cached_revisions():
        at = "" if "main" in rev.refs else "@" + (sorted(rev.refs)[0] if rev.refs else rev.commit_hash)
        ggufs = [f for f in rev.files if f.file_name.lower().endswith(".gguf")]
        for f in sorted(ggufs, key=lambda f: str(f.file_path)):
            name = os.path.relpath(f.file_path, rev.snapshot_path).replace(os.sep, "/")
            out.append(CachedModel(f"{repo_id}{at}:{quant_name(name) or name}", f.size_on_disk, str(f.file_path)))
        if any(f.file_name.endswith(".safetensors") for f in rev.files):
            size = sum(f.size_on_disk for f in rev.files if f not in ggufs)
            out.append(CachedModel(repo_id + at, size, str(rev.snapshot_path)))
    return out
