"""Coded chunks reused by content while a benchmark store is built from a dataset that repeats itself.

The ``dreamer`` dataset (``dreamer_data``) cycles a pool of 2,000 real frames: its frame column repeats every
20,000 steps, 625 runs of 32 frames (or 1,250 of 16). Coding each run again (LZ4HC at level 9: ~0.6 ms of CPU
a 64x64 RGB frame on this VM) is what made a 5M-step build take ~3.6 h under load; the codec is deterministic,
so the bytes of a run already coded are the bytes it would write again.

Invariant: inside ``reuse_coded_runs(codec_cls)``, ``codec.encode_chunk(chunk)`` returns exactly what the codec's
own ``encode_chunk`` returns for ``chunk`` with the same settings: an entry is reused only when the chunk's
bytes, shape, dtype and the codec's configuration are equal to those it was coded from (a digest finds the
candidate, the bytes are then compared in full); a chunk never seen is coded by the codec. At most
``max_bytes`` of raw chunks are kept: past that, chunks are coded as usual. On exit the codec is restored.
The store must encode in the building process (``encoder="thread"``): the encoder child would not see this.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import threading

import numpy as np


class RunMemo:
    """Coded chunks by content (see the module invariant); ``hits``/``misses`` count reuses and codings."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self.held = 0
        self.hits = self.misses = 0
        self._entries: dict[bytes, tuple[np.ndarray, bytes]] = {}
        self._lock = threading.Lock()

    def encode(self, codec, chunk: np.ndarray, encode) -> bytes:
        chunk = np.ascontiguousarray(chunk)
        config = json.dumps(getattr(codec, "spec", None), sort_keys=True, default=str)
        h = hashlib.blake2b(chunk.view(np.uint8).reshape(-1), digest_size=32)
        h.update(f"{chunk.shape}|{chunk.dtype.str}|{type(codec).__name__}|{config}".encode())
        key = h.digest()
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None and entry[0].shape == chunk.shape and entry[0].dtype == chunk.dtype \
                and np.array_equal(entry[0], chunk):
            self.hits += 1
            return entry[1]
        coded = encode(codec, chunk)
        self.misses += 1
        with self._lock:
            if entry is None and self.held + chunk.nbytes <= self.max_bytes:
                self._entries[key] = (chunk.copy(), coded)
                self.held += chunk.nbytes
        return coded

    def stats(self) -> dict:
        return {"reused_runs": self.hits, "coded_runs": self.misses, "memo_bytes": self.held}


@contextlib.contextmanager
def reuse_coded_runs(codec_cls, max_bytes: int = 1 << 30):
    """While inside, ``codec_cls.encode_chunk`` goes through a ``RunMemo`` (yielded); restored on exit."""
    memo = RunMemo(max_bytes)
    original = codec_cls.__dict__.get("encode_chunk")
    plain = codec_cls.encode_chunk

    def encode_chunk(self, chunk):
        return memo.encode(self, chunk, plain)

    codec_cls.encode_chunk = encode_chunk
    try:
        yield memo
    finally:
        if original is None:
            del codec_cls.encode_chunk
        else:
            codec_cls.encode_chunk = original
