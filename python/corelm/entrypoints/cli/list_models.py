"""`corelm list`: the models in huggingface_hub's cache, as the reference that loads each (corelm.engine.models)."""
from __future__ import annotations

import argparse

from ...engine import cached_models, hub_cache_dir


def add_parser(commands) -> None:
    p = commands.add_parser(
        "list", help="list the models downloaded from the Hugging Face hub",
        description="List the models in huggingface_hub's cache ($HF_HUB_CACHE, else $HF_HOME/hub): each GGUF "
                    "file as owner/name:QUANT, each safetensors snapshot as owner/name (@REVISION when it is "
                    "not main), with its size and local path. Any of them can be passed as MODEL.")
    p.set_defaults(func=run)


def _size(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    models = cached_models()
    if not models:
        print(f"no models in the Hugging Face cache ({hub_cache_dir()}); `corelm pull ID[:QUANT]` downloads one")
        return 0
    rows = [("MODEL", "SIZE", "PATH")] + [(m.model, _size(m.size), m.path) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    for model, size, path in rows:
        print(f"{model:<{widths[0]}}  {size:>{widths[1]}}  {path}")
    return 0
