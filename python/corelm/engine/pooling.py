"""Embeddings: prompts run through the model's forward pass to its final hidden states (_core
Model.hidden_batch), pooled into one vector each (mean over the tokens, the first token's (CLS) or the last
token's) and scaled to unit length where the model was trained so; similarity scores between them. Encoders
(BERT) only embed; any decoder family embeds too (last-token pooling by default, as Qwen3-Embedding and
gte-Qwen are used).

The KV blocks a batch needs are taken from the engine's pool for the one pass and given back, so embedding
runs between generation steps on the engine's thread and shares its cache without holding any of it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

POOLINGS = ("mean", "cls", "last")
# Tokens per hidden_batch call: enough rows for the matmuls to run as GEMMs, few enough that a pass's
# activations stay in the caches the GEMMs sweep them from (2048 ran slower than 1024 and 512).
BATCH_TOKENS = 1024


@dataclass
class PoolingParams:
    """vLLM's per-request pooling options. dimensions: keep the first d components (Matryoshka embeddings),
    renormalized when normalizing; normalize: None takes the model's own choice."""
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None

    def check(self, dim: int) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= dim):
            raise ValueError(f"dimensions must be an integer from 1 to the model's {dim}, got {d!r}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}.")


def pool(hidden: np.ndarray, how: str) -> np.ndarray:
    """One vector from a prompt's hidden states [tokens, dim] (float64 sums, as the reference tools')."""
    if how == "mean":
        return hidden.astype(np.float64).mean(axis=0).astype(np.float32)
    return hidden[0 if how == "cls" else -1].copy()


def finish(vector: np.ndarray, params: PoolingParams, normalize_default: bool) -> np.ndarray:
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if normalize_default if params.normalize is None else params.normalize:
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        vector = vector / np.float32(max(norm, 1e-12))
    return vector.astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    den = math.sqrt(float(a64 @ a64) * float(b64 @ b64))
    return float(a64 @ b64) / den if den > 0 else 0.0


class Embedder:
    """Runs token lists through the model in batches of about BATCH_TOKENS, each in blocks of the engine's
    KV pool (`blocks`, the scheduler's BlockManager) taken for the pass and released after it."""

    def __init__(self, core, blocks, dim: int, pooling: str, normalize: bool):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}.")
        self.core, self.blocks, self.dim = core, blocks, dim
        self.pooling, self.normalize = pooling, normalize
        self.block_size = int(core.kv_block_size)

    def embed(self, prompts: Sequence[List[int]], params: Optional[PoolingParams] = None) -> List[np.ndarray]:
        params = params or PoolingParams()
        params.check(self.dim)
        out: List[np.ndarray] = []
        for batch in self._batches(prompts):
            for hidden in self._hidden(batch):
                out.append(finish(pool(hidden, self.pooling), params, self.normalize))
        return out

    def _batches(self, prompts: Sequence[List[int]]):
        """Runs of prompts of at most BATCH_TOKENS tokens whose blocks the pool has free now (read again for
        each batch: the blocks of the one before are back by then)."""
        batch: List[List[int]] = []
        tokens = blocks = 0
        for ids in prompts:
            need = -(-len(ids) // self.block_size)
            if batch and (tokens + len(ids) > BATCH_TOKENS or blocks + need > self.blocks.num_free):
                yield batch
                batch, tokens, blocks = [], 0, 0
            batch.append(ids)
            tokens, blocks = tokens + len(ids), blocks + need
        if batch:
            yield batch

    def _hidden(self, batch: List[List[int]]) -> List[np.ndarray]:
        taken: List[int] = []
        try:
            seqs = []
            for ids in batch:
                table = []
                for _ in range(-(-len(ids) // self.block_size)):
                    b = self.blocks.allocate()
                    if b is None:
                        raise RuntimeError("the KV cache has no free blocks for this embedding batch now; retry "
                                           "when fewer requests run, or give the engine a larger kv_cache_gb")
                    table.append(b)
                    taken.append(b)
                seqs.append((len(ids), 0, np.array(table, np.int32), False))
            tokens = np.fromiter((t for ids in batch for t in ids), np.int32)
            hidden = self.core.hidden_batch(tokens, seqs)
        finally:
            self.blocks.release(taken)
        out, t = [], 0
        for ids in batch:
            out.append(hidden[t:t + len(ids)])
            t += len(ids)
        return out
