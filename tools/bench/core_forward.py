"""One prompt through a `corelm._core.Model` without the scheduler: `forward_batch` with a single sequence
whose block table is the identity (blocks 0, 1, 2, ...), for tests and tools that drive the core
directly. The core has no single-sequence forward of its own."""
import numpy as np

CHUNK = 256  # tokens per forward_batch call: bounds the model's scratch buffers, as the engine's prefill chunks do


def core_forward(model, tokens, pos, all_logits=False):
    """Runs `tokens` at positions [pos, pos + len(tokens)) of the default sequence, writing their keys and
    values into blocks 0, 1, 2, ... of the cache. Returns the last token's logits [vocab] or, with
    all_logits, every token's [len(tokens), vocab]."""
    tokens = np.ascontiguousarray(tokens, np.int32)
    blocks = np.arange(model.kv_blocks, dtype=np.int32)
    out = []
    for c0 in range(0, max(len(tokens), 1), CHUNK):  # an empty prompt goes to the core, which rejects it
        piece = tokens[c0:c0 + CHUNK]
        out.append(model.forward_batch(piece, [(len(piece), pos + c0, blocks, all_logits)]))
    return np.concatenate(out) if all_logits else out[-1][0]
