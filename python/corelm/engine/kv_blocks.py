"""The KV cache's blocks as the Python side keeps them: which are free, who holds each, and the prefix cache.
The scheduler keeps the target model's; a draft model (speculative.py) keeps its own pool's."""
from __future__ import annotations

import collections
from typing import Dict, List, Optional, Sequence, Tuple


class BlockManager:
    """KV blocks of a fixed number of tokens: a free list, reference counts, and a prefix cache that
    maps a full block's contents (hashed together with everything before it) to the block holding
    its keys and values, so requests that share a prompt prefix share its blocks."""

    def __init__(self, n_blocks: int, block_size: int):
        self.block_size = block_size
        # A stack: the most recently freed block is reused first, so steady traffic keeps touching the
        # same few blocks and the pool's resident memory follows the working set, not the whole pool
        # (its pages are reserved, not touched, until a block is first written).
        self.free: List[int] = list(range(n_blocks - 1, -1, -1))
        self.refs = [0] * n_blocks
        self.cached: "collections.OrderedDict[int, int]" = collections.OrderedDict()  # hash -> block (LRU order)
        self.hash_of: Dict[int, int] = {}                                             # block -> hash

    @property
    def num_free(self) -> int:
        """Blocks available now: truly free plus cached ones nobody uses (evictable)."""
        return len(self.free) + sum(1 for b in self.cached.values() if self.refs[b] == 0)

    def allocate(self) -> Optional[int]:
        if self.free:
            b = self.free.pop()
        else:
            victim = next((h for h, b in self.cached.items() if self.refs[b] == 0), None)
            if victim is None:
                return None
            b = self.cached.pop(victim)
            del self.hash_of[b]
        self.refs[b] = 1
        return b

    def release(self, blocks: List[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0 and b not in self.hash_of:
                self.free.append(b)

    @staticmethod
    def chain_hash(prev: int, tokens: Tuple[int, ...]) -> int:
        return hash((prev, tokens))

    @staticmethod
    def root_hash(adapter: int) -> int:
        """Where a sequence's chain starts: a block computed through a LoRA adapter holds other keys and values
        than the base model's for the same tokens, so each adapter's chain starts apart (0: the base model)."""
        return 0 if adapter < 0 else hash(("lora", adapter))

    def match_prefix(self, token_ids: List[int], root: int = 0) -> List[int]:
        """The cached blocks holding the longest run of full blocks of token_ids (references taken), for a
        chain starting at root (root_hash)."""
        blocks, h = [], root
        for i in range(len(token_ids) // self.block_size):
            h = self.chain_hash(h, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            b = self.cached.get(h)
            if b is None:
                break
            self.cached.move_to_end(h)
            self.refs[b] += 1
            blocks.append(b)
        return blocks

    def register(self, block: int, h: int) -> None:
        """Offers a full, computed block to the prefix cache (the first copy of a prefix wins)."""
        if block not in self.hash_of and h not in self.cached:
            self.cached[h] = block
            self.hash_of[block] = h

    def clear_cache(self) -> None:
        for b in list(self.hash_of):
            del self.hash_of[b]
            if self.refs[b] == 0:
                self.free.append(b)
        self.cached.clear()


def block_hashes(ids: Sequence[int], block_size: int) -> List[int]:
    """The chain hash of each full block of `ids`, as the prefix cache keys them."""
    hashes, h = [], 0
    for i in range(len(ids) // block_size):
        h = BlockManager.chain_hash(h, tuple(ids[i * block_size:(i + 1) * block_size]))
        hashes.append(h)
    return hashes


def check_prompt_fits(prompt_ids, max_seq_len: int, kv_blocks: int, block_size: int) -> None:
    """ValueError unless a prompt leaves room for one generated token in the context and fits the KV pool
    alone (LLMEngine's check, and the server's for its replicas)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty (no tokens to start from).")
    if len(prompt_ids) >= max_seq_len:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens, but the context holds {max_seq_len} "
                         f"(including at least one generated token); shorten the prompt or raise max_seq_len.")
    if -(-(len(prompt_ids) + 1) // block_size) > kv_blocks:
        raise ValueError(f"the prompt needs more KV-cache blocks than the cache holds ({kv_blocks}); "
                         f"raise kv_cache_gb.")
