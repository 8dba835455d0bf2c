"""Model files, for the CLI's pull, list, convert and info commands and the server's replicas: entry points
reach the loader and conversion through these, never directly (docs/architecture.md, Layers)."""
from __future__ import annotations

import os
from typing import Any, Iterable, List, Optional, Tuple

from ..loader import hub, load_model
from .llm_engine import default_model_path


def download_model(model: str, revision: Optional[str] = None) -> str:
    """A hub reference (owner/name[@REVISION][:QUANT]) downloaded into huggingface_hub's cache unless it is
    there already; returns the local path: a GGUF file, or a safetensors repository's snapshot folder."""
    return hub.download_from_hub(model, revision)


def local_model_path(model: Optional[str]) -> str:
    """A local path for `model`: the embedded default (None), a file or folder, or a hub reference
    downloaded here (once, before processes that each load it start)."""
    if model is None:
        return default_model_path()
    if not os.path.exists(os.path.expanduser(model)) and hub.looks_like_repo_id(model):
        return hub.download_from_hub(model)
    return model


def model_tokenizer(model: str) -> Tuple[Any, int]:
    """(the model's Tokenizer, its vocabulary size), the model not built and its weights released unread:
    what a process needs to parse and check requests for engines that run elsewhere."""
    loaded = load_model(model)
    tokenizer = loaded.tokenizer
    loaded.release_all()
    return tokenizer, loaded.spec.vocab_size


def cached_models() -> List["hub.CachedModel"]:
    """The models in huggingface_hub's cache, each as the reference that loads it (.model), .size, .path."""
    return hub.cached_models()


def hub_cache_dir() -> str:
    """huggingface_hub's cache folder ($HF_HUB_CACHE, else $HF_HOME/hub)."""
    return hub.cache_dir()


def convert_model(src: str, out: str, **options) -> str:
    """Writes the corelm folder `out` from `src` (an HF folder, a .gguf file or a corelm folder); returns
    `out`. options: corelm.convert.convert's (weights, progress, overwrite, sparsity, prune, keep_dense)."""
    from ..convert import convert   # conversion loads when asked for: the CLI starts light
    return convert(src, out, **options)


def sparsity_summary(fractions: Iterable[float], fmt: str = "sbf16") -> str:
    """"N matrices sparse (fmt): z% zeros on average (a-b% per matrix)" for the stored fractions of zeros."""
    from ..convert import sparsity_summary
    return sparsity_summary(fractions, fmt)
