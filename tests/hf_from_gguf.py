"""Builds an HF folder of SmolLM2-135M-Instruct for the tests: the committed config/tokenizer files
plus a model.safetensors (fp32) written from the embedded GGUF, as transformers' own GGUF conversion
does (its fixtures were made from that conversion). The name mapping here is written independently of
corelm's loader, so the HF loading path is checked rather than mirrored."""
import atexit
import json
import os
import shutil
import struct
import tempfile

import numpy as np

from conftest import DEFAULT_GGUF, MODELS

_FOLDER = None


def hf_name(internal: str) -> str:
    if internal == "tok_embeddings":
        return "model.embed_tokens.weight"
    if internal == "norm":
        return "model.norm.weight"
    if internal == "lm_head":
        return "lm_head.weight"
    _, i, part = internal.split(".")
    mapping = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
               "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    return f"model.layers.{i}.{mapping[part]}.weight"


def write_safetensors(path, tensors):
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a, np.float32).tobytes())


def materialize_smollm2_hf() -> str:
    global _FOLDER
    if _FOLDER is None:
        from corelm.loader import load_model
        loaded = load_model(DEFAULT_GGUF)
        folder = tempfile.mkdtemp(prefix="corelm-smollm2-hf-")
        atexit.register(shutil.rmtree, folder, True)
        meta = os.path.join(MODELS, "smollm2-hf-meta")
        for f in os.listdir(meta):
            if f != "README.md":
                shutil.copy(os.path.join(meta, f), folder)
        write_safetensors(os.path.join(folder, "model.safetensors"),
                          {hf_name(n): loaded.get_weight(n) for n in loaded.weight_names()})
        _FOLDER = folder
    return _FOLDER
