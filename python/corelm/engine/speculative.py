"""Speculative decoding: proposers that guess a sequence's next tokens cheaply, so that one forward pass
of the model checks several of them at once (decode reads every weight once per pass, and a pass over a
few rows costs about what a pass over one does).

    PromptLookup(k_max=4)            # n-gram copy from the prompt and the text so far (LLMA)
    DraftModel(core, k_max=4)        # a smaller model (or the same one in fewer bits), greedy

The scheduler asks `propose` for the running sequences, runs each sequence's last token plus its proposal
through the model with logits for every row, lets the sequence sample each row in turn (Sequence.step,
with its own sampler, penalties, grammar and stop conditions) and stops at the first sampled token that
differs from the proposal. That is the modified rejection sampling of the speculative-sampling papers for
a proposal that puts all its probability on one token: the token kept at every position is drawn from the
target's distribution exactly as without speculation, so the output is unchanged (with a seed, token for
token, wherever the kernels give a row of a multi-row pass the bits of a one-row pass).

Each sequence adapts its own proposal length to what it gets accepted (longer while every guess is
taken, shorter after a miss), and prompt lookup backs off for a growing number of steps after repeated
misses, so a prompt with nothing to copy costs next to nothing.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence as Seq, Tuple

import numpy as np


class SpecStats:
    """Counters for /metrics and /stats: proposed (drafted) and accepted tokens, verification passes."""

    def __init__(self):
        self.proposed = 0
        self.accepted = 0
        self.steps = 0

    def as_dict(self) -> Dict[str, float]:
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return {"proposed_tokens": self.proposed, "accepted_tokens": self.accepted,
                "acceptance_rate": round(rate, 4), "verify_steps": self.steps}


class _Adaptive:
    """One sequence's proposal length: +1 after a fully accepted proposal, down to what was accepted + 1
    after a miss; after `patience` proposals in a row with nothing accepted, a pause of a doubling number
    of steps (up to 64) before the next try."""

    def __init__(self, k_max: int, k_start: int, patience: int):
        self.k_max = k_max
        self.k = max(1, min(k_start, k_max))
        self.patience = patience
        self.misses = 0
        self.pause = 0
        self.backoff = 4

    def want(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted == proposed:
            self.k = min(self.k_max, self.k + 1)
        else:
            self.k = max(1, accepted + 1) if accepted else max(1, self.k // 2)
        if accepted:
            self.misses, self.backoff = 0, 4
            return
        self.misses += 1
        if self.misses >= self.patience:
            self.pause, self.backoff, self.misses = self.backoff, min(64, self.backoff * 2), 0


class Proposer:
    """What the scheduler needs of a proposer. Keys name running sequences (the scheduler's)."""
    name = "none"

    def __init__(self, k_max: int, k_start: int, patience: int):
        if not isinstance(k_max, int) or isinstance(k_max, bool) or not 1 <= k_max <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k_max!r}.")
        self.k_max = k_max
        self._k_start = k_start
        self._patience = patience
        self._adapt: Dict[Hashable, _Adaptive] = {}
        self.stats = SpecStats()

    def want(self, key: Hashable) -> int:
        """How many tokens this sequence should be proposed this step (0: none)."""
        a = self._adapt.get(key)
        if a is None:
            a = self._adapt[key] = _Adaptive(self.k_max, self._k_start, self._patience)
        return a.want()

    def propose(self, items: List[Tuple[Hashable, List[int], int]]) -> Dict[Hashable, List[int]]:
        """items: (key, the sequence's tokens so far, at most k); returns key -> proposed tokens."""
        raise NotImplementedError

    def verified(self, key: Hashable, n_before: int, proposed: int, accepted: int) -> None:
        """The sequence had n_before tokens, `proposed` were proposed and the first `accepted` taken."""
        a = self._adapt.get(key)
        if a is not None:
            a.update(proposed, accepted)
        self.stats.proposed += proposed
        self.stats.accepted += accepted

    def forget(self, key: Hashable) -> None:
        """The sequence finished, was aborted or preempted (its state, if any, is dropped)."""
        self._adapt.pop(key, None)


class PromptLookup(Proposer):
    """LLMA / prompt-lookup decoding: the longest recent n-gram (n_max down to n_min) ending the sequence
    that occurred before, and the tokens that followed it there. An index per sequence maps each n-gram to
    where its latest earlier occurrence ended, kept up to date as tokens arrive, so a lookup is O(n_max)."""
    name = "ngram"

    def __init__(self, k_max: int = 4, n_max: int = 4, n_min: int = 2):
        super().__init__(k_max, k_start=k_max, patience=2)
        if not 1 <= n_min <= n_max <= 16:
            raise ValueError(f"prompt lookup n-gram sizes must satisfy 1 <= min <= max <= 16, got {n_min}, {n_max}.")
        self.n_max, self.n_min = n_max, n_min
        self._index: Dict[Hashable, Tuple[int, Dict[Tuple[int, ...], int]]] = {}

    def _indexed(self, key: Hashable, tokens: List[int]) -> Dict[Tuple[int, ...], int]:
        done, index = self._index.get(key, (0, None))
        if index is None or done > len(tokens):
            done, index = 0, {}
        # the n-grams ending just before position i (so that token i follows them), for every new i;
        # the last position is left out: what follows it is what we are looking for
        for i in range(max(done, 1), len(tokens)):
            for n in range(self.n_min, self.n_max + 1):
                if i >= n:
                    index[tuple(tokens[i - n:i])] = i
        self._index[key] = (max(done, len(tokens)), index)
        return index

    def propose(self, items):
        out = {}
        for key, tokens, k in items:
            index = self._indexed(key, tokens)
            L = len(tokens)
            for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
                start = index.get(tuple(tokens[L - n:]))
                if start is not None:
                    out[key] = tokens[start:start + k]
                    break
        return out

    def forget(self, key):
        super().forget(key)
        self._index.pop(key, None)


class DraftModel(Proposer):
    """A smaller model over the same vocabulary proposes greedily (argmax), each step in one batched pass
    per proposed token over every speculating sequence. Its KV cache is its own paged pool; a sequence's
    draft entries past the last accepted token are simply overwritten next time."""
    name = "draft"

    def __init__(self, core, target_core, k_max: int = 4, vocab_limit: Optional[int] = None):
        super().__init__(k_max, k_start=k_max, patience=4)
        from .scheduler import BlockManager
        self.core = core
        self.target_core = target_core
        self.blocks = BlockManager(core.kv_blocks, core.kv_block_size)
        self.block_size = core.kv_block_size
        self.vocab_limit = vocab_limit   # the target's vocabulary size: draft ids past it are cut
        self._state: Dict[Hashable, List] = {}   # key -> [blocks, n_computed]

    def _grow(self, st, n_tokens: int) -> bool:
        while len(st[0]) * self.block_size < n_tokens:
            b = self.blocks.allocate()
            if b is None:
                return False
            st[0].append(b)
        return True

    def propose(self, items):
        live = []   # [key, tokens, k, state, proposal]
        for key, tokens, k in items:
            st = self._state.setdefault(key, [[], 0])
            st[1] = min(st[1], len(tokens) - 1)   # at least the last token is run, for its logits
            k = min(k, self.core.max_seq_len - len(tokens))
            if k <= 0 or not self._grow(st, len(tokens) + k - 1):
                self.blocks.release(st[0])
                self._state.pop(key, None)
                continue
            live.append([key, tokens, k, st, []])
        if not live:
            return {}
        self.target_core.park_threads()
        # first pass: every sequence's tokens the draft has not seen, logits of the last
        feed = live
        ids = np.asarray([t for e in feed for t in e[1][e[3][1]:]], dtype=np.int32)
        slices = [(len(e[1]) - e[3][1], e[3][1], np.asarray(e[3][0], dtype=np.int32), False) for e in feed]
        for e in feed:
            e[3][1] = len(e[1])
        while True:
            logits = self.core.forward_batch(ids, slices)
            nxt = np.argmax(logits, axis=1)
            for e, t in zip(feed, nxt):
                e[4].append(int(t))
            feed = [e for e in feed if len(e[4]) < e[2]]
            if not feed:
                break
            ids = np.asarray([e[4][-1] for e in feed], dtype=np.int32)
            slices = [(1, e[3][1], np.asarray(e[3][0], dtype=np.int32), False) for e in feed]
            for e in feed:
                e[3][1] += 1
        self.core.park_threads()
        limit = self.vocab_limit
        out = {}
        for key, _, _, _, prop in live:
            if limit is not None:
                cut = next((i for i, t in enumerate(prop) if t >= limit), len(prop))
                prop = prop[:cut]
            if prop:
                out[key] = prop
        return out

    def verified(self, key, n_before, proposed, accepted):
        super().verified(key, n_before, proposed, accepted)
        st = self._state.get(key)
        if st is not None:   # entries past the accepted tokens hold rejected guesses
            st[1] = min(st[1], n_before + accepted)

    def forget(self, key):
        super().forget(key)
        st = self._state.pop(key, None)
        if st is not None:
            self.blocks.release(st[0])


def check_same_vocabulary(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> None:
    """ValueError unless the draft's tokens mean what the target's do: every id both vocabularies hold
    is the same token string (models of one family often pad their embedding tables differently)."""
    n = min(target_vocab, draft_vocab)
    diffs = []
    for i in range(n):
        a, b = target_tok.id_to_token(i), draft_tok.id_to_token(i)
        if a != b:
            diffs.append((i, a, b))
            if len(diffs) >= 3:
                break
    if diffs:
        i, a, b = diffs[0]
        raise ValueError(f"the draft model's vocabulary differs from the target's (token {i} is {b!r} in the draft, "
                         f"{a!r} in the target); a draft must share the target's tokenizer.")
