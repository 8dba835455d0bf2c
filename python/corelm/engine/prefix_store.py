"""The prefix cache on disk (`prefix_cache_dir=`, `--prefix-cache-dir`): full KV blocks of cached prefixes
kept in files, so a restarted engine, or one whose memory cache evicted a prefix, reads them back instead
of recomputing them.

    DIR/<model key>/key.json                 what the key is made of (for people; never read back)
    DIR/<model key>/<ab>/<digest>.kvb        one block: header, the block's token ids, checksum, KV bytes

The model key is a blake2b of everything a block's bytes depend on: the model files' fingerprint
(model_fingerprint: sizes and sampled content, not mtimes, so a copied file keeps its cache), the weight
format, KV dtype and kept elements per row (kv_sparsity), block size and bytes, the kernel table and the
activations (each may change a KV bit, and a hit must give what a cold run gives). A block's digest chains
blake2b over the token ids of every block up to it, so it names the whole prefix; its file also holds
the block's own ids, checked on read along with the magic, version, model key, digest, lengths and a
blake2b of all of it. A file that fails any check is ignored with a warning (once per file) and
rewritten when the block is next computed.

Writes run on one thread per directory behind a bounded queue (a full queue drops the block), as a
temporary file renamed into place, so readers (other processes too) see whole files or none. The
directory's *.kvb files stay within a budget in GiB: past it the least recently used go first, down to
90% of it (a read sets a file's mtime, which serves as its access time: atime is often not kept). A
read-only or full disk only warns.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

log = logging.getLogger("corelm")

MAGIC = b"CORELMKV"
# bumped whenever a block's bytes change meaning (cpp/model/kv_cache.h's layout, int8 rotation, ...)
VERSION = 1
_HEADER = struct.Struct("<8sI32s16sIQ")   # magic, version, model key, digest, n_tokens, payload bytes
_CHECKSUM_BYTES = 32
DEFAULT_BUDGET_GB = 8.0
QUEUE_BYTES = 256 << 20                   # blocks waiting to be written, at most
EVICT_TO = 0.9                            # of the budget, once past it
STALE_TMP_S = 600                         # a temporary file this old was left by a crash


def model_fingerprint(path: str, sample: int = 1 << 16, samples: int = 16) -> str:
    """A hash of a model file (or every file of a folder, by relative name): its size, its first MiB (a
    GGUF's header and metadata) and `samples` pieces spread over the rest. Content, not mtimes: a copy
    keeps its cache, a re-quantized file at the same path does not."""
    h = hashlib.blake2b(digest_size=16)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(root, f) for root, dirs, names in os.walk(path) for f in names if not f.startswith("."))
    for f in files:
        size = os.path.getsize(f)
        h.update(os.path.relpath(f, path).encode() + b"\0" + str(size).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            for k in range(samples):
                fh.seek(size * k // samples)
                h.update(fh.read(sample))
    return h.hexdigest()


def chain_digest(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The digest of a block whose prefix before it has digest `prev` (b"" for the first block)."""
    return hashlib.blake2b(prev + np.asarray(tokens, dtype="<i4").tobytes(), digest_size=16).digest()


class _Directory:
    """One directory's files as this process knows them (size and last use), its budget, and the thread
    that writes and evicts. Engines of one process share it (open_directory)."""

    def __init__(self, path: str, budget_bytes: int, queue_slots: int):
        self.path = path
        self.budget = budget_bytes
        self.queue: "queue.Queue" = queue.Queue(maxsize=queue_slots)
        self.lock = threading.Lock()
        self.files: Dict[str, List[int]] = {}    # path -> [bytes, last use ns]
        self.total = 0
        self.known: set = set()                  # (model key, digest) on disk or queued
        self.warned: set = set()
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            self.warn_once(("mkdir", e.errno), "prefix cache directory %s cannot be created (%s): blocks are "
                           "neither read nor written", path, e.strerror)
        self.thread = threading.Thread(target=self._run, name="corelm-prefix-store", daemon=True)
        self.thread.start()

    def warn_once(self, key, msg: str, *args) -> None:
        with self.lock:
            if key in self.warned:
                return
            self.warned.add(key)
        log.warning(msg, *args)

    # -- the index and the budget ---------------------------------------------------------------
    def _scan(self) -> None:
        """Indexes the *.kvb files already there (DIR/<key>/<ab>/<digest>.kvb) and removes stale temporaries."""
        now = time.time()
        try:
            keys = [e for e in os.scandir(self.path) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for key in keys:
            for sub in _scandir(key.path):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                for f in _scandir(sub.path):
                    try:
                        st = f.stat(follow_symlinks=False)
                        if f.name.endswith(".kvb"):
                            with self.lock:
                                self._index(f.path, st.st_size, st.st_mtime_ns)
                                self.known.add((key.name, f.name[:-4]))
                        elif ".kvb.tmp" in f.name and now - st.st_mtime > STALE_TMP_S:
                            os.unlink(f.path)
                    except OSError:
                        continue

    def _index(self, path: str, size: int, used_ns: int) -> None:
        old = self.files.get(path)
        self.total += size - (old[0] if old else 0)
        self.files[path] = [size, used_ns]

    def touch(self, path: str) -> None:
        """A read: the file becomes the most recently used."""
        try:
            os.utime(path)
        except OSError:
            pass   # a read-only directory: its order stays the writes'
        with self.lock:
            if path in self.files:
                self.files[path][1] = time.time_ns()

    def forget(self, model_key: str, digest: str) -> None:
        with self.lock:
            self.known.discard((model_key, digest))

    def _evict(self) -> None:
        """Past the budget, deletes the least recently used files down to EVICT_TO of it (so the sort over
        every file runs once per tenth of the budget written, not once per block)."""
        with self.lock:
            if self.total <= self.budget:
                return
            order = sorted(self.files.items(), key=lambda kv: kv[1][1])
        for path, (size, _) in order:
            with self.lock:
                if self.total <= self.budget * EVICT_TO:
                    return
                if path not in self.files:
                    continue
                del self.files[path]
                self.total -= size
                parts = path.split(os.sep)
                self.known.discard((parts[-3], parts[-1][:-4]))
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                self.warn_once(("evict", e.errno), "prefix cache: cannot remove %s (%s)", path, e.strerror)

    # -- writing ---------------------------------------------------------------------------------
    def put(self, item) -> bool:
        try:
            self.queue.put_nowait(item)
            return True
        except queue.Full:
            self.warn_once(("dropped",), "prefix cache: writes to %s fall behind; some blocks are not saved", self.path)
            return False

    def _run(self) -> None:
        self._scan()
        self._evict()
        while True:
            store, digest, tokens, kv = self.queue.get()
            try:
                self._write(store.path(digest), store.encode(digest, tokens, kv), store.key, digest.hex())
            finally:
                self.queue.task_done()

    def _write(self, path: str, data: bytes, model_key: str, digest: str) -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            self.forget(model_key, digest)
            self.warn_once(("write", e.errno), "prefix cache: cannot write to %s (%s); blocks are not being saved",
                           self.path, e.strerror)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        with self.lock:
            self._index(path, len(data), time.time_ns())
        self._evict()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every queued block is written; False when timeout seconds pass first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self.queue.all_tasks_done:
            while self.queue.unfinished_tasks:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.queue.all_tasks_done.wait(left)
        return True


def _scandir(path: str):
    try:
        return list(os.scandir(path))
    except OSError:
        return []


_directories: Dict[str, _Directory] = {}
_directories_lock = threading.Lock()


def open_directory(path: str, budget_gb: float, block_bytes: int) -> _Directory:
    """The process's one _Directory for `path` (created on first use; the latest budget applies)."""
    real = os.path.realpath(os.path.expanduser(path))
    budget = int(budget_gb * (1 << 30))
    with _directories_lock:
        d = _directories.get(real)
        if d is None:
            d = _directories[real] = _Directory(real, budget, max(16, QUEUE_BYTES // max(block_bytes, 1)))
        d.budget = budget
        return d


@atexit.register
def _flush_all() -> None:
    for d in list(_directories.values()):
        d.flush(timeout=10)


class PrefixStore:
    """One model's blocks in a prefix cache directory: what the scheduler reads (load) and offers (save)."""

    def __init__(self, directory: str, budget_gb: Optional[float], model_path: str, block_size: int,
                 block_bytes: int, **fields):
        """`fields`: what else a block's bytes depend on (weight format, KV dtype, kept elements, kernel
        table, activations), as plain values."""
        budget_gb = DEFAULT_BUDGET_GB if budget_gb is None else budget_gb
        if not isinstance(budget_gb, (int, float)) or isinstance(budget_gb, bool) or not budget_gb > 0:
            raise ValueError(f"prefix_cache_gb must be a positive number of GiB, got {budget_gb!r}.")
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"prefix_cache_dir must be a directory path, got {directory!r}.")
        self.block_size, self.block_bytes = block_size, block_bytes
        key = dict(version=VERSION, model=model_fingerprint(model_path), block_size=block_size,
                   block_bytes=block_bytes, **fields)
        self.key_bytes = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=32).digest()
        self.key = self.key_bytes.hex()[:32]
        self.dir = open_directory(directory, budget_gb, block_bytes)
        self.root = os.path.join(self.dir.path, self.key)
        self._describe(key)

    def _describe(self, key: dict) -> None:
        path = os.path.join(self.root, "key.json")
        if os.path.exists(path):
            return
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(path + f".tmp{os.getpid()}", "w") as f:
                json.dump(key, f, indent=1, sort_keys=True)
            os.replace(path + f".tmp{os.getpid()}", path)
        except OSError:
            pass   # reads may still work; a write's failure warns once

    def path(self, digest: bytes) -> str:
        h = digest.hex()
        return os.path.join(self.root, h[:2], h + ".kvb")

    @property
    def budget_bytes(self) -> int:
        return self.dir.budget

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until the blocks offered so far are on disk (False when timeout seconds pass first)."""
        return self.dir.flush(timeout)

    # -- reading ---------------------------------------------------------------------------------
    def load(self, digest: bytes, tokens: Sequence[int]) -> Optional[np.ndarray]:
        """The block's KV bytes, or None: no file, or one that fails a check (a warning, once per file)."""
        path = self.path(digest)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            self.dir.warn_once(("read", path), "prefix cache: cannot read %s (%s); ignored", path, e.strerror)
            return None
        why = self._check(raw, digest, tokens)
        if why is not None:
            self.dir.forget(self.key, digest.hex())   # the block's next computation rewrites it
            self.dir.warn_once(("bad", path), "prefix cache: %s %s; ignored", path, why)
            return None
        self.dir.touch(path)
        with self.dir.lock:
            self.dir.known.add((self.key, digest.hex()))
        return np.frombuffer(raw, dtype=np.uint8, offset=len(raw) - self.block_bytes)

    def _check(self, raw: bytes, digest: bytes, tokens: Sequence[int]) -> Optional[str]:
        """Why the file's bytes are not this block's (None: they are)."""
        n_tok = self.block_size * 4
        if len(raw) < _HEADER.size:
            return "is truncated"
        magic, version, key, file_digest, n_tokens, payload = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            return "is not a corelm prefix cache file"
        if version != VERSION:
            return f"has format version {version} (this corelm writes {VERSION})"
        if key != self.key_bytes:
            return "belongs to another model or KV layout"
        if file_digest != digest or n_tokens != self.block_size or payload != self.block_bytes:
            return "holds another block"
        if len(raw) != _HEADER.size + n_tok + _CHECKSUM_BYTES + payload:
            return "is truncated" if len(raw) < _HEADER.size + n_tok + _CHECKSUM_BYTES + payload else "has extra bytes"
        if raw[_HEADER.size:_HEADER.size + n_tok] != np.asarray(tokens, dtype="<i4").tobytes():
            return "holds other token ids"
        at = _HEADER.size + n_tok
        if _checksum(raw[:at], memoryview(raw)[at + _CHECKSUM_BYTES:]) != raw[at:at + _CHECKSUM_BYTES]:
            return "fails its checksum (corrupt)"
        return None

    # -- writing ---------------------------------------------------------------------------------
    def wants(self, digest: bytes) -> bool:
        """Whether a block should be offered: not on disk or queued already, and room in the queue."""
        with self.dir.lock:
            return (self.key, digest.hex()) not in self.dir.known and not self.dir.queue.full()

    def save(self, digest: bytes, tokens: Sequence[int], kv: np.ndarray) -> None:
        """Queues a block for writing: kv is the block's bytes copied out of the pool (kv_block_read), since
        the block may be reused right after."""
        with self.dir.lock:
            self.dir.known.add((self.key, digest.hex()))
        if not self.dir.put((self, digest, tuple(tokens), kv)):
            self.dir.forget(self.key, digest.hex())

    def encode(self, digest: bytes, tokens: Sequence[int], kv: np.ndarray) -> bytes:
        """A block's file: header, token ids, checksum of both and of the KV bytes, the KV bytes."""
        head = _HEADER.pack(MAGIC, VERSION, self.key_bytes, digest, self.block_size, self.block_bytes) + \
            np.asarray(tokens, dtype="<i4").tobytes()
        return b"".join((head, _checksum(head, kv), memoryview(kv)))


def _checksum(head: bytes, payload) -> bytes:
    h = hashlib.blake2b(head, digest_size=_CHECKSUM_BYTES)
    h.update(payload)
    return h.digest()
