"""Activation statistics for importance-weighted quantization (`corelm convert --weights q4`).

The engine's own forward pass (an fp32 `_core.Model` built from the loaded model) runs over calibration
tokens and records, for every layer matrix, the mean square of each input column: an error in weight
column k costs about E[x_k^2] in the output's squared error, so the q4 quantizer spends its precision
where activations are large (llama.cpp calls these statistics an importance matrix). Memory: the model's
fp32 size (4 bytes a parameter), freed before quantizing starts.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

import numpy as np

from .engine.model_builder import build_core_model, trained_context
from .loader.spec import LoadedModel

# Mixed English prose, dialogue, code, SQL/JSON, a recipe and a few other languages (written for corelm,
# ~1,300 tokens): what the statistics are taken on. Not the text docs/quality.md evaluates on.
CALIBRATION_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "calibration.txt")


def calibration_ids(loaded: LoadedModel) -> List[int]:
    with open(CALIBRATION_TEXT, encoding="utf-8") as f:
        return list(loaded.tokenizer.encode(f.read(), add_special_tokens=True))


def input_squares(loaded: LoadedModel, ids: Sequence[int], chunk: int = 512,
                  progress: bool = False) -> Dict[str, tuple]:
    """{internal matrix name: (float64 [cols] sum over the rows of each input column's square, rows)} of every
    matrix the engine's fp32 forward multiplies (Model.input_squares), over `ids` run as independent
    sequences of `chunk` tokens (at most the model's trained context), each from position 0. The loaded
    model's weights are released as they are packed."""
    chunk = max(1, min(chunk, trained_context(loaded.spec)))
    chunks = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    longest = max((len(c) for c in chunks), default=1)
    model = build_core_model(loaded, dtype="fp32", max_seq_len=longest, progress=progress)
    blocks = np.arange(-(-longest // model.kv_block_size), dtype=np.int32)
    # every row's logits: lm_head multiplies the final hidden states of all tokens (an encoder has no logits)
    run = model.hidden_batch if loaded.spec.encoder else model.forward_batch
    if progress:
        from tqdm import tqdm
        chunks = tqdm(chunks, desc="calibrating", unit="chunk")
    model.record_input_squares(True)
    for c in chunks:
        run(np.asarray(c, np.int32), [(len(c), 0, blocks, True)])
    return model.input_squares()


def activation_importance(loaded: LoadedModel, ids: Sequence[int], chunk: int = 512,
                          progress: bool = False) -> Dict[str, np.ndarray]:
    """{"layers.i.wq": mean x^2 per input column (float32 [cols]), ...} for every layer matrix and "lm_head"
    (also when the embedding is tied to it), over `ids` run as input_squares runs them (an expert's: over
    the tokens routed to it; an expert no token chose has none, and is quantized without weights). The
    routers stay fp32: none of theirs."""
    return {name: (sums / rows).astype(np.float32)
            for name, (sums, rows) in input_squares(loaded, ids, chunk, progress).items()
            if not name.endswith(".router")}
