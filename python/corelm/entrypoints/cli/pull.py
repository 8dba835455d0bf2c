"""`corelm pull`: download a model from the Hugging Face hub into huggingface_hub's cache and print its
local path (corelm.engine.models; `owner/name[@REVISION][:QUANT]` picks one GGUF file of a repository)."""
from __future__ import annotations

import argparse

from ...engine import download_model


def add_parser(commands) -> None:
    p = commands.add_parser(
        "pull", help="download a model from the Hugging Face hub and print its local path",
        description="Download a model from the Hugging Face hub into huggingface_hub's cache ($HF_HUB_CACHE, "
                    "else $HF_HOME/hub) and print the local path: a GGUF file, or the snapshot folder of a "
                    "safetensors repository. A cached model is not downloaded again.",
        epilog="QUANT picks a GGUF file by its quant (Q4_K_M, q8_0, ...; case does not matter) or file name; "
               "without it a GGUF-only repository gives its Q4_K_M file, else its first GGUF file by name, and "
               "a repository with safetensors weights is downloaded as a folder. The hub can also be spelled "
               "hf.co/owner/name:QUANT (as Ollama takes it).")
    p.add_argument("model", metavar="ID[:QUANT]", help="owner/name[@REVISION][:QUANT], e.g. "
                                                       "bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(download_model(args.model))
    return 0
