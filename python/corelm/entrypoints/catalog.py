"""The models one `corelm serve` or `corelm batch` serves by name (the `model` field of a request): the GGUF
files and model folders of a --models-dir folder, and NAME=PATH arguments. Nothing is loaded here."""
from __future__ import annotations

import logging
import os
from typing import Dict, Iterable, Optional

from ..openai import APIError

log = logging.getLogger("corelm")


def _add(found: Dict[str, str], name: str, path: str) -> None:
    if name in found:   # DIR/x.gguf and DIR/x/: the first (sorted) keeps the name
        log.warning("models dir: %s is also named %r (as %s); skipped", path, name, found[name])
        return
    found[name] = path


def find_models(folder: str) -> Dict[str, str]:
    """name -> path of every model in `folder`, one level deep: DIR/NAME.gguf (named by the file's stem);
    DIR/NAME/ holding config.json (an HF or corelm folder, named NAME); and in a folder without config.json,
    its DIR/NAME/X.gguf files (named X). Hidden entries are skipped; files are not opened (a bad one fails when
    it is loaded). ValueError when `folder` is not a folder."""
    if not os.path.isdir(folder):
        raise ValueError(f"--models-dir {folder} is not a folder.")
    found: Dict[str, str] = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.name.lower().endswith(".gguf"):
            _add(found, entry.name[:-5], entry.path)
        elif entry.is_dir():
            if os.path.isfile(os.path.join(entry.path, "config.json")):
                _add(found, entry.name, entry.path)
                continue
            for inner in sorted(os.scandir(entry.path), key=lambda e: e.name):
                if not inner.name.startswith(".") and inner.is_file() and inner.name.lower().endswith(".gguf"):
                    _add(found, inner.name[:-5], inner.path)
    return found


def named_models(items: Iterable[str]) -> Dict[str, str]:
    """NAME=PATH arguments -> {NAME: PATH}; ValueError for one without a name or a name given twice."""
    out: Dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise ValueError(f"expected NAME=PATH, got {item!r}.")
        if name in out:
            raise ValueError(f"the model name {name!r} is given twice.")
        out[name] = path
    return out


def model_bytes(path: str) -> int:
    """Bytes of a model's files (a file, or a folder's files one level deep): the router's estimate of the
    memory its weights take."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    try:
        for entry in os.scandir(path):
            if entry.is_file():
                total += entry.stat().st_size
    except OSError:
        pass
    return total


def model_not_found(name: Optional[str], names: Iterable[str]) -> APIError:
    """The 404 for a request whose model is not served (OpenAI's code), naming the models that are; the name
    asked for is not echoed."""
    return APIError(404, ("The model does not exist" if name is not None else "No model was named")
                    + f". Available models: {', '.join(names)}.", "invalid_request_error", param="model",
                    code="model_not_found")


def model_load_failed(why: Optional[str]) -> APIError:
    return APIError(503, f"The model failed to load ({why}).", "unavailable_error", code="model_load_failed")
