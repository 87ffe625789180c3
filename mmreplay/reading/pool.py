"""The codec threads: one process-wide pool for decoding and copying frames off the GIL.

Invariant: at most one pool per process, made on first use; a forked child (which has none of the
parent's threads) makes its own. numcodecs' decoders and the compiled kernels release the GIL, so the
pool's threads run on all cores at once.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from mmreplay.storage import forking

_POOL: ThreadPoolExecutor | None = None


def decode_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="mmreplay-codec")
    return _POOL


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # a forked child has none of the pool's threads: make a new pool on first use


forking.on_fork(_forget_pool)
