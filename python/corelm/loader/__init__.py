"""Model loading: a local HF folder, a corelm folder (`corelm convert`), a local .gguf file or a Hugging Face
hub reference (`owner/name[@REVISION][:QUANT]`, hub.py) -> LoadedModel.

    from corelm.loader import load_model
    m = load_model("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    m.spec.num_layers, m.get_weight("layers.0.wq").shape

Parsers are strict: a corrupt, hostile or unsupported file raises ModelLoadError saying what is wrong.
PyTorch pickles (.bin/.pth) are refused, never unpickled.
"""
from __future__ import annotations

import os
from typing import Optional

from .spec import SUPPORTED_ARCHS, LoadedModel, ModelLoadError, ModelSpec, layer_weight_names, weight_shapes

__all__ = ["load_model", "LoadedModel", "ModelLoadError", "ModelSpec", "SUPPORTED_ARCHS", "weight_shapes",
           "layer_weight_names"]


def load_model(model: str, revision: Optional[str] = None, tokenizer_in_background: bool = False) -> LoadedModel:
    """Load `model`: a folder (config.json + safetensors), a .gguf file, or a hub reference ('owner/name',
    'owner/name:Q4_K_M', 'hf.co/owner/name:Q4_K_M'; see hub.py). `revision` (branch, tag or commit) applies
    to hub downloads only. tokenizer_in_background: a GGUF's tokenizer is built on a thread while the
    caller loads the weights (`LoadedModel.tokenizer` waits for it and raises what building it raised)."""
    # The parsers are imported when a model is loaded: `import corelm.loader` (every CLI command) stays light.
    from .gguf import GGUF_MAGIC, load_gguf_model
    from .hf import PICKLE_SUFFIXES, load_hf_folder
    from .hub import download_from_hub, looks_like_repo_id

    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model:
        raise ModelLoadError(f"expected a model path or hub repo id, got {model!r}")
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "weights.corelm")):   # a corelm folder (`corelm convert`)
            from .corelm_format import load_corelm_folder
            return load_corelm_folder(path)
        return load_hf_folder(path)
    if os.path.isfile(path):
        lower = path.lower()
        if lower.endswith(PICKLE_SUFFIXES):
            raise ModelLoadError(f"{path}: PyTorch pickle files can run arbitrary code when loaded; corelm refuses "
                                 f"them. Use a safetensors (HF folder) or GGUF version of the model.")
        if lower.endswith(".safetensors"):
            raise ModelLoadError(f"{path}: pass the folder that holds this file and its config.json, "
                                 f"not the .safetensors file itself")
        if lower.endswith(".gguf") or _starts_with(path, GGUF_MAGIC):
            return load_gguf_model(path, tokenizer_in_background)
        raise ModelLoadError(f"{path}: not a GGUF file or HF model folder")
    if looks_like_repo_id(model):
        return load_model(download_from_hub(model, revision), tokenizer_in_background=tokenizer_in_background)
    raise ModelLoadError(f"no such file or folder: {model!r} (and it is not a Hugging Face hub reference "
                         f"of the form 'owner/name' or 'owner/name:QUANT')")


def _starts_with(path: str, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False
