"""The C allocator's free pages handed back to the system: glibc's ``malloc_trim``, behind one entry point.

Invariant: ``release_free_heap()`` frees no live memory and changes no value: it only returns pages that malloc
already holds free (glibc's ``malloc_trim(0)``, over every arena); where the C library is not glibc it does nothing.
It lives here because every linked C symbol of the package does (``_native/``).
"""

from __future__ import annotations

from typing import Any

_malloc_trim: Any = None  # glibc's malloc_trim once looked up; False where there is none


def release_free_heap() -> None:
    """glibc's ``malloc_trim(0)`` (a no-op elsewhere). Why: a thread that allocates and frees large blocks in
    turn (a shard encoder) keeps freed, fragmented pages in its arena, which RSS counts (the DQN Replay import:
    ~30 B a transition over 700k rows without it, docs/datasets.md)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)
