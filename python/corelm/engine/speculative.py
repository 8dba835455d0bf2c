"""Speculative decoding: proposers that guess a sequence's next tokens cheaply, so that one forward pass
of the model checks several of them at once (decode reads every weight once per token; a pass over a few
rows reads them once for all, and costs less than that many passes where the rows' arithmetic is cheap).

    PromptLookup(k_max=8)                  # n-gram copy from the prompt and the text so far (LLMA)
    Lookahead(k_max=8)                     # that, plus n-grams from the model's own guesses (Jacobi)
    DraftModel(core, target_core, k_max=4) # a smaller model (or the same one in fewer bits), greedy;
                                           # with lookup=PromptLookup(), copies first where they match

The scheduler asks `propose` for the running sequences, runs each sequence's last token plus its proposal
through the model with logits for every row, lets the sequence sample each row in turn (Sequence.step,
with its own sampler, penalties, grammar and stop conditions) and stops at the first sampled token that
differs from the proposal. That is the modified rejection sampling of the speculative-sampling papers for
a proposal that puts all its probability on one token: the token kept at every position is drawn from the
target's distribution exactly as without speculation, so the output is unchanged (with a seed, token for
token, wherever the kernels give a row of a multi-row pass the bits of a one-row pass).

How many tokens each sequence is proposed is planned every step (plan_lengths): from each sequence's
measured acceptance and the measured cost of a pass by its rows (StepCosts), the lengths that give the
most tokens per second, none where speculation would not pay (a batch already compute-bound, a sequence
whose guesses keep missing). SpecGuard checks the plans against what steps actually gave and pauses
speculation where steps with proposals fall behind steps without.
"""
from __future__ import annotations

import itertools
import time
from typing import Dict, Hashable, List, Optional, Tuple

import numpy as np

from .kv_blocks import BlockManager


class SpecStats:
    """Counters for /metrics and /stats: tokens proposed (drafted) and tokens accepted."""

    def __init__(self):
        self.proposed = 0
        self.accepted = 0


class Acceptance:
    """One sequence's chance that a proposed token is taken, given the ones before it were (the geometric
    model of the speculative-sampling papers): positions tried and taken, older ones forgotten. While the
    planner gives the sequence no proposals, the estimate drifts back toward the prior, so a sequence that
    once guessed badly is tried again now and then (a probe costs one row)."""

    def __init__(self, prior: float = 0.6, weight: float = 2.0, keep: float = 0.85, drift: float = 0.97):
        self.prior, self.keep, self.drift = prior, keep, drift
        self.tried, self.taken = weight, prior * weight

    @property
    def rate(self) -> float:
        return min(0.98, self.taken / self.tried)

    def update(self, proposed: int, accepted: int) -> None:
        tried = accepted + (accepted < proposed)   # the first miss was tried too; later guesses were not
        self.tried = self.tried * self.keep + tried
        self.taken = self.taken * self.keep + accepted

    def idle(self) -> None:
        """A step with a proposal at hand but none asked for."""
        rate = self.rate + (self.prior - self.rate) * (1 - self.drift)
        self.taken = rate * self.tried


class Proposer:
    """What the scheduler needs of a proposer. Keys name running sequences (the scheduler's). Every step
    `copy` is asked first (prompt lookup's matches, alone or ahead of a draft model) and its proposals
    trimmed by the planner; a draft model is then asked `propose` only for the other sequences and the
    lengths the planner chose, and reports the seconds a drafting pass takes. `cheap`: copies only."""
    name = "none"
    cheap = False
    wants_predictions = False   # True: verified() gets the argmax of every row the proposal was checked on

    def __init__(self, k_max: int):
        if not isinstance(k_max, int) or isinstance(k_max, bool) or not 1 <= k_max <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k_max!r}.")
        self.k_max = k_max
        self.adaptive = True      # False: always k_max tokens where there are any (vLLM's and llama.cpp's way)
        self._acceptance: Dict[Hashable, Acceptance] = {}
        self._pooled: Dict[Hashable, Acceptance] = {}   # kind of guess -> its acceptance over every sequence
        self.stats = SpecStats()
        self.pass_seconds = 0.0   # a drafting pass, measured (0: no passes, e.g. prompt lookup)

    def acceptance(self, key: Hashable) -> Acceptance:
        """The sequence's acceptance estimate for what it is proposed now."""
        k = self._estimate_key(key)
        a = self._acceptance.get(k)
        if a is None:
            a = self._acceptance[k] = self._new_estimate(k, self._kind(key))
        return a

    def _new_estimate(self, k: Hashable, kind: Hashable) -> Acceptance:
        return Acceptance(prior=self.learned_prior(kind, 0.6))

    def learned_prior(self, kind: Hashable, default: float) -> float:
        """Where a new sequence's estimate starts: how often this kind of guess was kept lately over every
        sequence, where that is above the default. A fixed prior that does not pay (a draft whose pass costs
        a third of the model's) would never be probed: every request after the first would go unspeculated.
        Below the default it stays there, so that a sequence is still tried where earlier ones missed
        (prompt lookup on an edit after open-ended chat); its own misses bring it down within a few steps."""
        pooled = self._pooled.get(kind)
        return max(default, pooled.rate) if pooled is not None and pooled.tried >= 4 else default

    def _kind(self, key: Hashable) -> Hashable:
        """What the sequence's guesses now have in common with other sequences' (None: all alike)."""
        return None

    def _estimate_key(self, key: Hashable) -> Hashable:
        return key

    def propose(self, items: List[Tuple[Hashable, List[int], int]]) -> Dict[Hashable, List[int]]:
        """items: (key, the sequence's tokens so far, at most k); returns key -> proposed tokens."""
        raise NotImplementedError

    def copy(self, items: List[Tuple[Hashable, List[int], int]], step_seconds: Optional[float] = None,
             row_seconds: Optional[float] = None) -> Dict[Hashable, List[int]]:
        """Proposals that cost no drafting pass (copied from the text), asked first every step; the
        sequences given none here are then asked `propose` (a draft model) for the lengths planned.
        step_seconds, row_seconds: this step's pass and what one more row adds to it, measured (None:
        not yet)."""
        return {}

    @property
    def copy_k_max(self) -> int:
        """The most tokens `copy` proposes."""
        return self.k_max

    def catch_up_seconds(self, key: Hashable, tokens: List[int]) -> float:
        """What drafting for the sequence now would cost before its first drafting pass (a draft model
        reading the tokens it has not seen), as charged to this step."""
        return 0.0

    def read_prompts(self, items: List[Tuple[Hashable, List[int]]]) -> None:
        """The model has just read these sequences' prompts (key, tokens): a draft reads them too."""

    def verified(self, key: Hashable, n_before: int, proposed: int, accepted: int,
                 predictions: Optional[np.ndarray] = None) -> None:
        """The sequence had n_before tokens, `proposed` were proposed and the first `accepted` taken.
        predictions (for a proposer that wants_predictions): the greedy argmax of each of the pass's
        proposed + 1 rows, row j's being the model's next token after the proposal's first j tokens."""
        self.acceptance(key).update(proposed, accepted)
        self._pooled.setdefault(self._kind(key), Acceptance(keep=0.95)).update(proposed, accepted)
        self.stats.proposed += proposed
        self.stats.accepted += accepted

    def forget(self, key: Hashable) -> None:
        """The sequence finished, was aborted or preempted (its state, if any, is dropped)."""
        for k in [k for k in self._acceptance if k == key or (isinstance(k, tuple) and k[:1] == (key,))]:
            del self._acceptance[k]


class PromptLookup(Proposer):
    """LLMA / prompt-lookup decoding: the longest recent n-gram (n_max down to n_min) ending the sequence
    that occurred before, and the tokens that followed it there. An index per sequence maps each n-gram to
    where its latest earlier occurrence ended, kept up to date as tokens arrive, so a lookup is O(n_max)."""
    name = "ngram"
    cheap = True

    def __init__(self, k_max: int = 8, n_max: int = 4, n_min: int = 2):
        super().__init__(k_max)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (n_min, n_max)) or not 1 <= n_min <= n_max <= 16:
            raise ValueError(f"prompt lookup n-gram sizes must satisfy 1 <= min <= max <= 16, got {n_min}, {n_max}.")
        self.n_max, self.n_min = n_max, n_min
        self._index: Dict[Hashable, Tuple[int, Dict[Tuple[int, ...], int]]] = {}
        self._matched: Dict[Hashable, int] = {}   # key -> the n-gram size of its latest match

    def _kind(self, key):
        # a longer match is a better guess: each sequence keeps an estimate per n-gram size
        return self._matched.get(key, 0)

    def _estimate_key(self, key):
        return (key, self._kind(key))

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

    def copy(self, items, step_seconds=None, row_seconds=None):
        return self.propose(items)

    def propose(self, items):
        out = {}
        for key, tokens, k in items:
            index = self._indexed(key, tokens)
            L = len(tokens)
            for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
                start = index.get(tuple(tokens[L - n:]))
                if start is not None:
                    out[key] = tokens[start:start + k]
                    self._matched[key] = n
                    break
        return out

    def forget(self, key):
        super().forget(key)
        self._index.pop(key, None)
        self._matched.pop(key, None)


class Lookahead(PromptLookup):
    """Lookahead decoding (Fu et al., "Break the sequential dependency of LLM inference using lookahead
    decoding"), on a chain-only check: the pass that checks a proposal also gives, at every row, the
    model's own next token (argmax), after the first miss too. Those are Jacobi iterates: the predictions
    after the kept tokens are the next guess for what follows them, and every rejected row's prediction,
    after the tokens it read, is an n-gram the model itself predicts. Each sequence keeps them in a pool
    (the last 1..n_max tokens -> continuations, a few per n-gram, counted) beside prompt lookup's index of
    the text so far, and is proposed, in order: the longest match of at least n_min tokens (the text's
    latest occurrence or the pool's most often predicted continuation, whichever is more recent); else the
    leftover Jacobi guess of the last pass (so open-ended text still gets one); else a shorter match.
    Acceptance is estimated per kind of match (text, guess, jacobi) and n-gram size."""
    name = "lookahead"
    wants_predictions = True

    def __init__(self, k_max: int = 8, n_max: int = 4, n_min: int = 2, per_key: int = 4, max_grams: int = 4096):
        super().__init__(k_max, n_max, n_min)
        self.n_first = n_min   # matches this long come before the Jacobi guess; the index holds sizes from 1
        self.n_min = 1
        self.per_key = per_key
        self.max_grams = max_grams   # a sequence's pool past this many n-grams drops its oldest quarter
        # key -> n-gram -> [[made at length, times predicted, continuation]], most recent first
        self._pool: Dict[Hashable, Dict[Tuple[int, ...], List[list]]] = {}
        self._jacobi: Dict[Hashable, Tuple[int, List[int]]] = {}   # key -> (the length it follows, guesses)
        self._last: Dict[Hashable, Tuple[List[int], List[int]]] = {}   # key -> (its tokens, the proposal)
        self.kinds: Dict[str, List[int]] = {}   # "text" / "guess" / "jacobi" -> [proposed, accepted] (tools)

    def _new_estimate(self, k, kind):
        # the fallbacks (the Jacobi guess, one-token matches) are rarely kept: probed with fewer rows, and
        # less often, so that what they cost does not pause speculation where the longer matches pay
        weak = kind == "jacobi" or (isinstance(kind, tuple) and kind[1] < self.n_first)
        return (Acceptance(prior=self.learned_prior(kind, 0.3), drift=0.99) if weak
                else Acceptance(prior=self.learned_prior(kind, 0.6)))

    def _match(self, key, tokens: List[int], n: int, k: int):
        """(label, continuation) of the sequence's last n tokens, or None."""
        gram = tuple(tokens[len(tokens) - n:])
        pos = self._index[key][1].get(gram)
        guesses = self._pool.get(key, {}).get(gram)
        if guesses:
            made, _, cont = max(guesses, key=lambda g: (g[1], g[0]))
            if pos is None or made > pos:
                return ("guess", n), list(cont[:k])
        return (("text", n), tokens[pos:pos + k]) if pos is not None else None

    def propose(self, items):
        out = {}
        for key, tokens, k in items:
            self._indexed(key, tokens)
            L = len(tokens)
            found = next(filter(None, (self._match(key, tokens, n, k)
                                       for n in range(min(self.n_max, L), self.n_first - 1, -1))), None)
            if found is None and key in self._jacobi:
                at, guess = self._jacobi[key]
                while at < L and guess and tokens[at] == guess[0]:   # steps without a check that kept its guesses
                    at, guess = at + 1, guess[1:]
                if at == L and guess:
                    found = "jacobi", guess[:k]
            if found is None:
                found = next(filter(None, (self._match(key, tokens, n, k)
                                           for n in range(min(self.n_first - 1, L), 0, -1))), None)
            if found is None:
                self._last.pop(key, None)
                continue
            self._matched[key], out[key] = found
            self._last[key] = (tokens, found[1])
        return out

    def _remember(self, pool, context: List[int], cont: List[int], made: int) -> None:
        """context's last 1..n_max tokens are followed by cont (the model's prediction)."""
        cont = tuple(cont[:self.k_max])
        for n in range(1, min(self.n_max, len(context)) + 1):
            entries = pool.setdefault(tuple(context[len(context) - n:]), [])
            same = next((e for e in entries if e[2] == cont), None)
            if same is not None:
                entries.remove(same)
            entries.insert(0, [made, 1 + (same[1] if same else 0), cont])
            del entries[self.per_key:]
        if len(pool) > self.max_grams:
            for gram in list(itertools.islice(pool, len(pool) // 4)):   # dicts keep insertion order
                del pool[gram]

    def verified(self, key, n_before, proposed, accepted, predictions=None):
        super().verified(key, n_before, proposed, accepted)
        label = self._matched.get(key)
        counts = self.kinds.setdefault(label[0] if isinstance(label, tuple) else str(label), [0, 0])
        counts[0] += proposed
        counts[1] += accepted
        last = self._last.pop(key, None)
        end = n_before + accepted + 1   # the kept tokens and the one sampled at the first miss
        if predictions is None or last is None or len(last[0]) < end:
            return
        tokens, d = last[0], last[1][:proposed]
        p = [int(t) for t in predictions[:proposed + 1]]
        leftover = p[accepted + 1:]   # predicted after rows the sequence did not keep: the next Jacobi guess
        if leftover:
            self._jacobi[key] = (end, leftover)
        else:
            self._jacobi.pop(key, None)
        pool = self._pool.setdefault(key, {})
        kept, before = tokens[max(0, end - self.n_max):end], tokens[max(0, n_before - self.n_max):n_before]
        for i in range(1, len(leftover)):            # the Jacobi trajectory: kept tokens, then the guesses
            self._remember(pool, kept + leftover[:i], leftover[i:], end)
        for j in range(accepted + 1, proposed + 1):  # what each rejected row read, then its prediction on
            self._remember(pool, before + d[:j], p[j:], end)

    def forget(self, key):
        super().forget(key)
        for state in (self._pool, self._jacobi, self._last):
            state.pop(key, None)


READ_CHUNK = 256   # the most prompt tokens a draft reads in one pass


class DraftModel(Proposer):
    """A smaller model over the same vocabulary proposes greedily (argmax), each step in one batched pass
    per proposed token over every speculating sequence. Its KV cache is its own paged pool; a sequence's
    draft entries past the last accepted token are simply overwritten next time, and tokens it has not
    seen (after copied proposals) are read in the next drafting pass. With `lookup`, a sequence whose
    last n-gram occurred before is proposed what followed it instead (see copy)."""
    name = "draft"

    def __init__(self, core, target_core, k_max: int = 4, vocab_limit: Optional[int] = None,
                 lookup: Optional[PromptLookup] = None):
        super().__init__(k_max)
        self.core = core
        self.target_core = target_core
        self.blocks = BlockManager(core.kv_blocks, core.kv_block_size)
        self.block_size = core.kv_block_size
        self.vocab_limit = vocab_limit   # the target's vocabulary size: draft ids past it are cut
        self._state: Dict[Hashable, List] = {}   # key -> [blocks, n_computed]
        # Prompt lookup first: where the text repeats (an edit, a summary, code that echoes its input) a
        # copied guess is kept as often as the draft's and costs no drafting pass; the draft drafts the rest.
        self.lookup = lookup
        self._copied: Dict[Hashable, int] = {}   # key -> n-gram size of this step's copied proposal
        self._copy_share: Dict[Hashable, float] = {}   # key -> how often its checks lately kept a copied token
        self._copies_kept: Dict[Hashable, Acceptance] = {}   # key -> its checked copies' acceptance, every n-gram size
        self.copied = SpecStats()   # of stats: the copied tokens
        self.read_seconds = 0.0     # a token the draft reads to catch up, measured

    @property
    def copy_k_max(self) -> int:
        return self.lookup.k_max if self.lookup is not None else self.k_max

    def _kind(self, key):
        # copied guesses are judged per n-gram size, apart from the draft's
        n = self._copied.get(key)
        return "draft" if n is None else ("copy", n)

    def _estimate_key(self, key):
        return (key, self._kind(key))

    def _new_estimate(self, k, kind):
        # A copy of an n-gram size the sequence has not copied before starts from how its other copies
        # fared, not from the prior again: on open-ended code a 2-gram's copies miss, and so do its 3-grams'.
        seen = self._copies_kept.get(k[0]) if kind != "draft" else None
        if seen is not None:
            return Acceptance(prior=seen.rate)
        return super()._new_estimate(k, kind)

    def copy(self, items, step_seconds=None, row_seconds=None):
        """The lookup's match for a sequence where copying gives more tokens per second than drafting
        would: each at its kind's measured acceptance and best length, a copy costing its rows, a draft
        its rows, its drafting passes and its catch-up (before the costs are measured: where copies are
        kept at least as often)."""
        self._copied = {}
        if self.lookup is None:
            return {}
        found = self.lookup.propose(items)
        tokens_of = {key: tokens for key, tokens, _ in items}

        def best(rate, k, per_token, once):   # the most tokens a second over lengths 1..k
            return max((1 - rate ** (j + 1)) / (1 - rate) / (step_seconds + j * (row_seconds + per_token) + once)
                       for j in range(1, k + 1))
        out = {}
        for key, proposal in found.items():
            drafted = self._acceptance.get((key, "draft"))
            draft_rate = drafted.rate if drafted is not None else self.learned_prior("draft", 0.6)
            self._copied[key] = self.lookup._matched[key]
            copy_rate = self.acceptance(key).rate
            if step_seconds is None or row_seconds is None:
                better = copy_rate >= draft_rate
            else:
                better = best(copy_rate, len(proposal), 0.0, 0.0) >= best(
                    draft_rate, self.k_max, self.pass_seconds, self.catch_up_seconds(key, tokens_of[key]))
            if better:
                out[key] = proposal
            else:
                del self._copied[key]
        return out

    def catch_up_seconds(self, key, tokens):
        """The tokens copied since the draft last ran, read in its first pass, charged to drafting now by how
        often the sequence's checks lately kept a copied token: on an edit, where nearly every check does,
        the draft would fall behind again at once and the reading costs more than its guesses give; where
        copies are rare the reading serves the drafting steps ahead. (Charged in full always, a few kept
        copies on code shut the draft out: 1 thread, code, 1.29x -> 1.01x.)"""
        st = self._state.get(key)
        behind = max(0, len(tokens) - 1 - (st[1] if st is not None else 0))
        seconds = behind * self.read_seconds
        return seconds * self._copy_share.get(key, 0.0)

    def _grow(self, st, n_tokens: int) -> bool:
        while len(st[0]) * self.block_size < n_tokens:
            b = self.blocks.allocate()
            if b is None:
                return False
            st[0].append(b)
        return True

    def read_prompts(self, items):
        """All but each prompt's last token (which the first proposal feeds, for its logits), in passes of
        at most READ_CHUNK tokens, so a long prompt costs the draft no more memory than the model's chunks."""
        feed = []
        for key, tokens in items:
            st = self._state.setdefault(key, [[], 0])
            if len(tokens) - 1 - st[1] >= 1 and self._grow(st, len(tokens)):
                feed.append((tokens, st))
        if not feed:
            return
        self.target_core.park_threads()
        for tokens, st in feed:
            while st[1] < len(tokens) - 1:
                toks = tokens[st[1]:min(len(tokens) - 1, st[1] + READ_CHUNK)]
                self.core.forward_batch(np.asarray(toks, dtype=np.int32),
                                        [(len(toks), st[1], np.asarray(st[0], dtype=np.int32), False)])
                st[1] += len(toks)
        self.core.park_threads()

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
        timed = []   # seconds of the passes of one or two tokens a sequence (not a first catch-up on a prompt)
        # first pass: every sequence's tokens the draft has not seen, logits of the last
        feed = live
        ids = np.asarray([t for e in feed for t in e[1][e[3][1]:]], dtype=np.int32)
        slices = [(len(e[1]) - e[3][1], e[3][1], np.asarray(e[3][0], dtype=np.int32), False) for e in feed]
        for e in feed:
            e[3][1] = len(e[1])
        while True:
            t0 = time.perf_counter()
            logits = self.core.forward_batch(ids, slices)
            if max(sl[0] for sl in slices) <= 2:
                timed.append(time.perf_counter() - t0)
            elif len(ids) >= 8:   # a catch-up: its seconds per token read
                per = (time.perf_counter() - t0) / len(ids)
                self.read_seconds = per if not self.read_seconds else 0.7 * self.read_seconds + 0.3 * per
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
        if timed:
            seconds = sum(timed) / len(timed)
            self.pass_seconds = seconds if not self.pass_seconds else 0.7 * self.pass_seconds + 0.3 * seconds
        limit = self.vocab_limit
        out = {}
        for key, _, _, _, prop in live:
            if limit is not None:
                cut = next((i for i, t in enumerate(prop) if t >= limit), len(prop))
                prop = prop[:cut]
            if prop:
                out[key] = prop
        return out

    def verified(self, key, n_before, proposed, accepted, predictions=None):
        super().verified(key, n_before, proposed, accepted)
        kept_copy = key in self._copied and accepted > 0
        self._copy_share[key] = 0.8 * self._copy_share.get(key, 0.0) + 0.2 * kept_copy
        if key in self._copied:
            self.copied.proposed += proposed
            self.copied.accepted += accepted
            self._copies_kept.setdefault(key, Acceptance()).update(proposed, accepted)
        st = self._state.get(key)
        if st is not None:   # entries past the accepted tokens hold rejected guesses
            st[1] = min(st[1], n_before + accepted)

    def forget(self, key):
        super().forget(key)
        self._copied.pop(key, None)
        self._copy_share.pop(key, None)
        self._copies_kept.pop(key, None)
        if self.lookup is not None:
            self.lookup.forget(key)
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


class StepCosts:
    """Seconds a pass takes by its rows (tokens), measured as passes run (moving averages). Rows never
    measured, or not for the last `max_age` passes (the host's speed drifts, and a count the planner stopped
    choosing would keep its old figure), are estimated from the nearest fresh count below at +10% a row:
    optimistic, so the planner tries them and from then on knows."""

    def __init__(self, max_rows: int = 64, extra_row: float = 0.1, alpha: float = 0.3, max_age: int = 256):
        self.max_rows, self.extra_row, self.alpha, self.max_age = max_rows, extra_row, alpha, max_age
        self.seconds: Dict[int, float] = {}
        self._when: Dict[int, int] = {}
        self._passes = 0

    def record(self, rows: int, seconds: float) -> None:
        self._passes += 1
        if rows <= self.max_rows:
            old = self.seconds.get(rows) if self._fresh(rows) else None
            self.seconds[rows] = seconds if old is None else old + self.alpha * (seconds - old)
            self._when[rows] = self._passes

    def _fresh(self, rows: int) -> bool:
        return rows in self.seconds and self._passes - self._when[rows] <= self.max_age

    def cost(self, rows: int) -> Optional[float]:
        if self._fresh(rows):
            return self.seconds[rows]
        below = [r for r in self.seconds if r < rows and self._fresh(r)]
        if not below:
            return None
        r = max(below)
        return self.seconds[r] * (1 + self.extra_row * (rows - r))


def plan_lengths(rates: List[float], limits: List[int], base_rows: int, costs: StepCosts,
                 pass_seconds: float = 0.0, drafted: Optional[List[bool]] = None,
                 catch_up: Optional[List[float]] = None) -> List[int]:
    """How many proposed tokens each decoding sequence gets: the lengths that maximise expected tokens per
    second. Sequence s's j-th proposed token adds rates[s] ** j expected tokens (it is kept only if the
    ones before it were); the pass costs costs.cost(base_rows + proposed), plus pass_seconds per drafting
    pass (a draft model drafts one token per pass for every sequence it drafts for, drafted[s], all by
    default: so max(lengths) passes over those), and catch_up[s] seconds once if s is drafted for at all.
    Zeros when nothing pays, or before the plain pass was ever measured."""
    n = len(rates)
    base = costs.cost(base_rows)
    if base is None or n == 0:
        return [0] * n
    drafted = [True] * n if drafted is None else drafted
    catch_up = [0.0] * n if catch_up is None else catch_up
    gains = sorted(((rates[s] ** j, s) for s in range(n) for j in range(1, limits[s] + 1)), reverse=True)

    def best_prefix(order):   # (rate, the tokens) of the best plan taking `order`'s guesses first to last
        best_x, best_rate = 0, n / base
        lengths = [0] * n
        passes, setup = 0, 0.0
        total = float(n)
        for x, (g, s) in enumerate(order, 1):
            lengths[s] += 1
            if drafted[s]:
                passes = max(passes, lengths[s])
                setup += catch_up[s] if lengths[s] == 1 else 0.0
            total += g
            c = costs.cost(base_rows + x)
            if c is None:
                break
            rate = total / (c + passes * pass_seconds + setup)
            if rate > best_rate * 1.01:   # 1%: a plan no better than plain within noise is not worth a row
                best_x, best_rate = x, rate
        return best_rate, order[:best_x]

    # the guesses by their gain, and the copied ones alone (where drafting at all would not pay)
    plans = [best_prefix(gains)]
    if (pass_seconds > 0 or any(catch_up)) and not all(drafted):
        plans.append(best_prefix([(g, s) for g, s in gains if not drafted[s]]))
    out = [0] * n
    for g, s in max(plans, key=lambda p: p[0])[1]:
        out[s] += 1
    return out


class SpecGuard:
    """What the plans give, measured: tokens per second of decode-only steps with proposals against
    those without, per batch size, each a ratio of moving sums (tokens over seconds of whole steps:
    proposing, the pass, sampling), so a step that gave 4 tokens weighs by its time, not as one rate of 4.
    Costs the plan does not model (a draft catching up after idle steps, waking thread pools, sampling the
    extra rows) show up here; when steps with proposals fall behind, both rates resting on at least
    min_steps steps, speculation pauses at that batch size for `pause` steps, then is tried again.
    (Per-step rates averaged, over about 9 steps, tripped on a few missed guesses in a row, and on a plain
    rate from a single step: the 1.5B with its 0.5B draft paused for whole answers it gained 1.3x on.)"""

    def __init__(self, alpha: float = 0.05, margin: float = 0.98, min_steps: int = 16, pause: int = 64):
        self.alpha, self.margin, self.min_steps, self.pause = alpha, margin, min_steps, pause
        self.sums: Dict[Tuple[int, bool], List[float]] = {}   # key -> [moving tokens, moving seconds]
        self.count: Dict[Tuple[int, bool], int] = {}
        self.paused: Dict[int, int] = {}   # batch size -> steps left

    def rate(self, batch: int, speculated: bool) -> Optional[float]:
        s = self.sums.get((batch, speculated))
        return s[0] / s[1] if s else None

    def allowed(self, batch: int) -> bool:
        """batch: decoding sequences of a decode-only step (0: a step that also reads prompts)."""
        left = self.paused.get(batch, 0)
        if left > 0:
            self.paused[batch] = left - 1
            if left == 1:   # try again from scratch
                self.sums.pop((batch, True), None)
                self.count.pop((batch, True), None)
            return False
        return True

    def resume(self) -> None:
        """A new sequence started: pauses end and speculation is judged afresh (the verdicts were about
        other sequences' guesses)."""
        for batch in list(self.paused):
            self.sums.pop((batch, True), None)
            self.count.pop((batch, True), None)
        self.paused.clear()

    def record(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        key = (batch, speculated)
        s = self.sums.setdefault(key, [0.0, 0.0])
        s[0] = s[0] * (1 - self.alpha) + tokens
        s[1] = s[1] * (1 - self.alpha) + seconds
        self.count[key] = self.count.get(key, 0) + 1
        plain = self.rate(batch, False)
        if (speculated and plain is not None and min(self.count[key], self.count[(batch, False)]) >= self.min_steps
                and self.rate(batch, True) < plain * self.margin):
            self.paused[batch] = self.pause
