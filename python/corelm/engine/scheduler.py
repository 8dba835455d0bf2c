"""The continuous batcher: which sequences run at each step, over a paged KV cache with a prefix cache.

    scheduler = Scheduler(core_model, max_num_seqs=64, max_batch_tokens=256)
    scheduler.add("req-1", Sequence(...))                 # one Sequence per choice of a request
    for request_id, chunk in scheduler.step(): ...        # chunk.index says which choice

It knows the C++ model (`forward_batch`, the KV pool's size) and Sequences, nothing about prompts
or tokenizers: LLMEngine validates requests before they get here. One thread steps it; add and abort
may be called from other threads between steps.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Dict, List, Tuple

import numpy as np

from .kv_blocks import BlockManager
from .prefix_store import chain_digest
from .sequence import Sequence, StreamChunk
from .speculative import SpecGuard, StepCosts, plan_lengths

DECLINED_STEPS = 16   # steps in a row without drafting after which a draft stops reading new prompts at that load

log = logging.getLogger("corelm")


class _Running:
    """A sequence's place in the batcher: its tokens so far and its KV blocks."""

    def __init__(self, rid: str, seq: Sequence, adapter: int = -1):
        self.rid = rid
        self.key = (rid, seq.index)
        self.adapter = adapter              # the core's LoRA adapter id (-1: the base model)
        self.root = BlockManager.root_hash(adapter)   # its blocks' chain starts here
        self.tokens = list(seq.prompt_ids)  # prompt, then every sampled token
        self.seq = seq
        self.blocks: List[int] = []
        self.hashes: List[int] = []     # chain hash of each full block so far
        self.digests: List[bytes] = []  # with a prefix store: the same blocks' disk digests (prefix_store.py)
        self.n_computed = 0             # tokens whose keys/values are in the cache


class Scheduler:
    """Continuous batching: every step runs one forward pass over all running sequences (one token
    each) plus chunks of prompts being read, so requests join and leave at every step and a long
    prompt never stalls the streams already running. When the KV budget runs out, the newest running
    sequence is preempted (its blocks freed) and recomputed later."""

    def __init__(self, core, max_num_seqs: int = 64, max_batch_tokens: int = 256, speculator=None,
                 spec_rows: int = 24, enable_prefix_caching: bool = True, prefix_store=None):
        self.core = core
        # False: every prompt is read whole (no block is offered to or taken from the prefix cache)
        self.prefix_caching = enable_prefix_caching
        # a PrefixStore (prefix_store.py): full blocks also kept on disk, read where the memory cache misses
        self.prefix_store = prefix_store if enable_prefix_caching else None
        # speculation (engine/speculative.py): proposed tokens ride along in a step of at most spec_rows
        # tokens, as many as the measured costs say pay off; a batch already that wide runs plain.
        self.speculator = speculator
        self.spec_rows = spec_rows
        self.step_costs = StepCosts()
        # a paused draft falls behind and reads the skipped tokens when resumed: pause it for longer
        self.spec_guard = SpecGuard(pause=256 if speculator is not None and not speculator.cheap else 64)
        self.block_size = self.core.kv_block_size
        self.blocks = BlockManager(self.core.kv_blocks, self.block_size)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max(max_batch_tokens, 1)
        self._lock = threading.Lock()
        self._waiting: "collections.deque[_Running]" = collections.deque()
        self._running: List[_Running] = []
        self._aborted: List[str] = []
        self._ids: Dict[str, int] = {}              # request id -> its sequences not yet finished
        self.num_preemptions = 0
        self.last_step_tokens = 0
        self._cached_prompt: Dict[str, int] = {}   # request id -> prompt tokens found in the prefix cache
        # A draft model reads each prompt when the model has, unless the planner has lately declined to draft
        # at this many decoding sequences or fewer (many streams: a check's rows cost more than the guesses
        # give), where the reading would be wasted: 16 streams of the 1.5B with a 0.5B draft spent 9% of
        # their time reading prompts for a draft that never ran. Such a prompt is read when its sequence is
        # first drafted for.
        self._declined: Dict[int, int] = {}        # decoding sequences -> steps in a row the planner drafted nothing
        self._unread: set = set()                  # keys of sequences whose prompt the draft has not read

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def check_fits(self, n_prompt_tokens: int) -> None:
        """ValueError when a prompt could not fit in the KV pool even alone."""
        if self._blocks_needed(n_prompt_tokens + 1) > self.core.kv_blocks:
            raise ValueError(f"the prompt needs more KV-cache blocks than the cache holds ({self.core.kv_blocks}); "
                             f"raise kv_cache_gb.")

    def add(self, request_id: str, seqs: List[Sequence], adapter: int = -1) -> None:
        """Queues a request's sequences (one per choice; validated by the caller), through the core's LoRA
        adapter `adapter` (-1: the base model)."""
        self.check_fits(len(seqs[0].prompt_ids))
        with self._lock:
            if request_id in self._ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._ids[request_id] = len(seqs)
            self._waiting.extend(_Running(request_id, s, adapter) for s in seqs)

    def adapters_in_use(self) -> set:
        """The LoRA adapters of the queued and running sequences."""
        with self._lock:
            return {r.adapter for r in list(self._waiting) + self._running}

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running or self._aborted)

    def clear_prefix_cache(self) -> None:
        self.blocks.clear_cache()

    def cached_prompt_tokens(self, request_id: str) -> int:
        """How many of a running request's prompt tokens came from the prefix cache (its last chunk says it
        too: the count is forgotten when the request ends)."""
        return self._cached_prompt.get(request_id, 0)

    def is_active(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._ids

    # -- one step -------------------------------------------------------------------------------------
    def _blocks_needed(self, n_tokens: int) -> int:
        return (n_tokens + self.block_size - 1) // self.block_size

    def _finish(self, r: _Running) -> None:
        if self.speculator is not None:
            self.speculator.forget(r.key)
            self._unread.discard(r.key)
        self.blocks.release(r.blocks)
        r.blocks = []
        left = self._ids.get(r.rid, 0) - 1
        if left > 0:
            self._ids[r.rid] = left
        else:
            self._ids.pop(r.rid, None)
            self._cached_prompt.pop(r.rid, None)

    def _preempt(self, r: _Running) -> None:
        """Frees a running request's blocks; it goes back to the front of the queue and is recomputed."""
        self.num_preemptions += 1
        log.warning("KV cache full: a sequence of request %s preempted, it will be recomputed (raise kv_cache_gb to avoid this)",
                    r.rid)
        self._running.remove(r)
        if self.speculator is not None:
            self.speculator.forget(r.key)
            self._unread.discard(r.key)
        self.blocks.release(r.blocks)
        r.blocks, r.hashes, r.digests, r.n_computed = [], [], [], 0
        self._waiting.appendleft(r)

    def _grow(self, r: _Running, n_tokens: int) -> bool:
        """Gives r enough blocks for n_tokens; False if the pool is exhausted."""
        while len(r.blocks) < self._blocks_needed(n_tokens):
            b = self.blocks.allocate()
            if b is None:
                return False
            r.blocks.append(b)
        return True

    def _admit(self, r: _Running) -> None:
        # reuse cached full blocks of the prompt, except that the last prompt token is always run
        r.blocks = self.blocks.match_prefix(r.tokens[:-1], r.root) if self.prefix_caching else []
        h = r.root
        for i in range(len(r.blocks)):
            h = BlockManager.chain_hash(h, tuple(r.tokens[i * self.block_size:(i + 1) * self.block_size]))
            r.hashes.append(h)
        if self.prefix_store is not None and r.adapter < 0:   # the disk's blocks are the base model's
            self._load_stored(r)
        r.n_computed = len(r.blocks) * self.block_size
        self._cached_prompt[r.rid] = max(self._cached_prompt.get(r.rid, 0), r.n_computed)

    def _load_stored(self, r: _Running) -> None:
        """Past the blocks the memory cache matched, the prompt's next full blocks from the disk store, each
        into a fresh block registered in the memory cache, until one is missing (or the pool is full)."""
        store, bs = self.prefix_store, self.block_size
        d = b""
        for i in range((len(r.tokens) - 1) // bs):   # the last prompt token is always run
            block_tokens = r.tokens[i * bs:(i + 1) * bs]
            d = chain_digest(d, block_tokens)
            if i < len(r.blocks):
                r.digests.append(d)
                continue
            kv = store.load(d, block_tokens)
            b = self.blocks.allocate() if kv is not None else None
            if b is None:
                return
            self.core.kv_block_write(b, kv)
            h = BlockManager.chain_hash(r.hashes[-1] if r.hashes else r.root, tuple(block_tokens))
            self.blocks.register(b, h)
            r.blocks.append(b)
            r.hashes.append(h)
            r.digests.append(d)

    def _schedule(self) -> List[Tuple[_Running, int]]:
        """Which requests run this step and how many of their tokens."""
        plan: List[Tuple[_Running, int]] = []
        budget = self.max_batch_tokens
        # running requests first, oldest first; preempt the newest when blocks run out
        for r in list(self._running):
            if r not in self._running:
                continue  # preempted below
            n = min(len(r.tokens) - r.n_computed, budget)
            if n <= 0:
                continue
            while not self._grow(r, r.n_computed + n):
                victim = next((v for v in reversed(self._running) if v is not r and all(v is not p for p, _ in plan)),
                              None)
                if victim is None:
                    break
                self._preempt(victim)
            if len(r.blocks) < self._blocks_needed(r.n_computed + n):
                self._preempt(r)
                continue
            plan.append((r, n))
            budget -= n
            if budget == 0:
                return plan
        # then new requests while there is room
        while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            r = self._waiting[0]
            if not r.blocks and r.n_computed == 0:
                self._admit(r)
            n = min(len(r.tokens) - r.n_computed, budget)
            if not self._grow(r, r.n_computed + n):
                self.blocks.release(r.blocks)
                r.blocks, r.hashes, r.digests, r.n_computed = [], [], [], 0
                break  # wait for blocks to free up
            self._waiting.popleft()
            self._running.append(r)
            self.spec_guard.resume()
            plan.append((r, n))
            budget -= n
        return plan

    def step(self) -> List[Tuple[str, StreamChunk]]:
        out: List[Tuple[str, StreamChunk]] = []
        with self._lock:
            aborted, self._aborted = self._aborted, []
            for rid in aborted:
                for r in [x for x in list(self._waiting) + self._running if x.rid == rid]:
                    (self._waiting if r in self._waiting else self._running).remove(r)
                    r.seq.abort()
                    self._finish(r)
                    out.append((rid, StreamChunk("", None, "abort", index=r.seq.index)))
            plan = self._schedule()
            if not plan and self._waiting and not self._running:
                r = self._waiting.popleft()  # cannot fit even in an empty cache: fail it rather than spin
                r.seq.abort()
                self._finish(r)
                out.append((r.rid, StreamChunk("", None, "abort", index=r.seq.index)))
        if not plan:
            return out
        t_step = time.perf_counter()
        drafts = self._speculate(plan) if self.speculator is not None else {}
        t_drafted = time.perf_counter()
        tokens, slices = [], []
        for r, n in plan:
            d = drafts.get(r.key, ())
            tokens.extend(r.tokens[r.n_computed:r.n_computed + n])
            tokens.extend(d)
            s = (n + len(d), r.n_computed, np.asarray(r.blocks, dtype=np.int32), bool(d))
            slices.append(s + (r.adapter,) if r.adapter >= 0 else s)
        self.last_step_tokens = len(tokens)
        logits = self.core.forward_batch(np.asarray(tokens, dtype=np.int32), slices)
        pure_decode = all(n == 1 for _, n in plan)
        t_read = 0.0
        if self.speculator is not None:
            # a draft model reads a prompt when the model has (prompt time, not the first proposal's)
            done = [(r.key, r.tokens) for r, n in plan if n > 1 and r.n_computed + n == len(r.tokens)]
            if done and self._drafting_declined(len(self._running) + len(self._waiting)):
                self._unread.update(key for key, _ in done)
            elif done:
                t_read = time.perf_counter()
                self.speculator.read_prompts(done)
                t_read = time.perf_counter() - t_read
        emitted = 0
        row = 0
        for r, n in plan:
            d = drafts.get(r.key, ())
            first, row = row, row + (1 + len(d) if d else 1)
            r.n_computed += n
            self._register_full_blocks(r)
            if r.n_computed < len(r.tokens):
                continue  # still reading its prompt
            n_before = len(r.tokens)
            accepted = 0
            for j in range(len(d) + 1):
                chunk = r.seq.step(logits[first + j])
                if chunk.token_id is not None:      # None: no token (finish_reason "error")
                    r.tokens.append(chunk.token_id)
                if chunk.finish_reason is not None:  # the server's usage.prompt_tokens_details
                    chunk.cached_tokens = self._cached_prompt.get(r.rid, 0)
                out.append((r.rid, chunk))
                emitted += 1
                if r.seq.finished or j == len(d) or chunk.token_id != d[j]:
                    break
                accepted += 1   # the draft's token was sampled: its keys and values are already cached
            if d:
                # the model's own next token at every checked row (Jacobi guesses, for a proposer that learns
                # from them): an argmax over the rows already in hand, no copy
                preds = (logits[first:first + len(d) + 1].argmax(axis=1) if self.speculator.wants_predictions
                         else None)
                self.speculator.verified(r.key, n_before, len(d), accepted, preds)
                r.n_computed += accepted
                self._register_full_blocks(r)
                self._trim(r)
            if r.seq.finished:
                with self._lock:  # add (another thread) reads the id set
                    self._running.remove(r)
                    self._finish(r)
        if self.speculator is not None:
            now = time.perf_counter()
            # the pass and the sampling of its rows, by rows; and, for steps of decoding only, what the
            # step gave per second with and without proposals (SpecGuard)
            self.step_costs.record(len(tokens), now - t_drafted - t_read)   # the pass's rows: not the draft's reading
            if pure_decode:
                self.spec_guard.record(len(plan), bool(drafts), emitted, now - t_step)
        return out

    def _speculate(self, plan: List[Tuple[_Running, int]]) -> Dict[Tuple[str, int], List[int]]:
        """Proposals for the decoding sequences of this step (their one pending token plus k guesses), as
        many as pay off by the measured acceptance and pass costs (speculative.plan_lengths)."""
        spec = self.speculator
        decoding = [r for r, n in plan if n == 1 and r.n_computed + 1 == len(r.tokens)]
        if spec.adaptive and not self.spec_guard.allowed(len(plan) if all(n == 1 for _, n in plan) else 0):
            return {}
        base_rows = sum(n for _, n in plan)
        room = min(self.spec_rows, self.max_batch_tokens) - base_rows
        if not decoding or room <= 0:
            return {}
        # no guesses past max_tokens (the last token of a pass is free) or the context
        def limits_of(k_max):
            return [max(0, min(k_max, r.seq.max_new - len(r.seq.output_ids) - 1,
                               self.core.max_seq_len - len(r.tokens), room)) for r in decoding]
        # copies from the text first (prompt lookup, alone or before a draft model): what there is to copy
        # decides their lengths; a draft model drafts for the others
        copy_limits = limits_of(spec.copy_k_max)
        now, more = self.step_costs.cost(base_rows), self.step_costs.cost(base_rows + 1)
        row_seconds = max(more - now, 0.0) if now is not None and more is not None else None
        found = spec.copy([(r.key, r.tokens, k) for r, k in zip(decoding, copy_limits) if k > 0], now, row_seconds)
        drafted = [not spec.cheap and r.key not in found for r in decoding]
        limits = [len(found.get(r.key, ())) if not d else k for r, d, k in zip(decoding, drafted, limits_of(spec.k_max))]
        accept = [spec.acceptance(r.key) for r in decoding]
        catch_up = [spec.catch_up_seconds(r.key, r.tokens) if d else 0.0 for r, d in zip(decoding, drafted)]
        lengths = plan_lengths([a.rate for a in accept], limits, base_rows, self.step_costs,
                               spec.pass_seconds, drafted, catch_up) if spec.adaptive else limits
        for a, k, lim in zip(accept, lengths, limits):
            if k == 0 and lim > 0:
                a.idle()
        drafts = {r.key: found[r.key][:k] for r, k in zip(decoding, lengths) if k > 0 and r.key in found}
        items = [(r.key, r.tokens, k) for r, k, d in zip(decoding, lengths, drafted) if k > 0 and d]
        if any(d and lim > 0 for d, lim in zip(drafted, limits)):
            if items:   # drafting pays at this many sequences, so at fewer too
                self._declined = {b: c for b, c in self._declined.items() if b > len(decoding)}
            else:
                self._declined[len(decoding)] = self._declined.get(len(decoding), 0) + 1
        unread = [(key, tokens) for key, tokens, _ in items if key in self._unread]
        if unread:
            spec.read_prompts(unread)
            self._unread.difference_update(key for key, _ in unread)
        if items:
            drafts.update(spec.propose(items))
        by_key = {r.key: r for r in decoding}
        for key, d in list(drafts.items()):
            r = by_key[key]
            if not d or not self._grow(r, r.n_computed + 1 + len(d)):
                del drafts[key]
                self._trim(r)
        return drafts

    def _drafting_declined(self, sequences: int) -> bool:
        """The planner drafted nothing for DECLINED_STEPS steps in a row at this many decoding sequences or fewer."""
        return any(c >= DECLINED_STEPS for b, c in self._declined.items() if b <= sequences)

    def _trim(self, r: _Running) -> None:
        """Frees blocks that only held rejected guesses."""
        keep = self._blocks_needed(len(r.tokens))
        if len(r.blocks) > keep:
            self.blocks.release(r.blocks[keep:])
            del r.blocks[keep:]

    def _register_full_blocks(self, r: _Running) -> None:
        while len(r.hashes) < r.n_computed // self.block_size:
            i = len(r.hashes)
            prev = r.hashes[-1] if r.hashes else r.root
            h = BlockManager.chain_hash(prev, tuple(r.tokens[i * self.block_size:(i + 1) * self.block_size]))
            r.hashes.append(h)
            if self.prefix_caching:
                self.blocks.register(r.blocks[i], h)
            if self.prefix_store is not None and r.adapter < 0:
                tokens = r.tokens[i * self.block_size:(i + 1) * self.block_size]
                r.digests.append(chain_digest(r.digests[-1] if r.digests else b"", tokens))
                if self.prefix_store.wants(r.digests[-1]):
                    self.prefix_store.save(r.digests[-1], tokens, self.core.kv_block_read(r.blocks[i]))
