"""Zero-filled tables that are written sparsely: a few entries a shard, anywhere in a large address space.

Invariant: an array from ``sparse_zeros`` reads as zeros until written, and costs RAM only for the 4 KiB pages
written. Why not ``np.zeros``: its pages are also made on first write, but where transparent huge pages are
``always`` (RHEL, many cloud images, this project's VMs), khugepaged collapses every 2 MiB range holding a
single written page into a whole huge page (its default ``max_ptes_none`` is 511). The compressed tier's
per-chunk address and size tables, touched at the frontier by each commit's partial shard, so grew 2 B a frame
with nothing held: ~95 MiB of a 50M-transition dqn-replay import (issue #42). ``MADV_NOHUGEPAGE`` on their own
mapping keeps them at what is written.
"""

from __future__ import annotations

import mmap

import numpy as np


def sparse_zeros(n: int, dtype) -> np.ndarray:
    """``n`` zeros of ``dtype`` in an anonymous mapping of their own, out of transparent huge pages."""
    dtype = np.dtype(dtype)
    n = int(n)
    # private: a forked child writes its own copy, as with any numpy array (mmap's default is MAP_SHARED)
    mapping = mmap.mmap(-1, max(1, n * dtype.itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:  # a kernel built without transparent huge pages refuses the advice: nothing to avoid
            pass
    return np.frombuffer(mapping, dtype=dtype, count=n)


def grown_sparse(old: np.ndarray, n: int) -> np.ndarray:
    """``old`` in a sparse table of ``n`` entries: only its nonzero entries are written, so growing keeps the
    pages untouched that were."""
    grown = sparse_zeros(n, old.dtype)
    held = np.flatnonzero(old)
    grown[held] = old[held]
    return grown
