"""Compiled episode walks over the index ring (``sampling/sequences.py`` holds the policy).

Invariant: ring rows are read only at ``id % ring_rows`` (or ``id`` when unbounded) of ids in
``[oldest, head)``; ``_walk_forward`` writes ``out[i, :seq_len]`` and ``lengths[i]``, ``_walk_back``
``out[i, :burn_in]``, ``_label_episodes`` ``episode[:n]`` and ``first[:episodes]``, ``_group_by_episode``
``members[:episode.size]``, for ``i < starts.size``. Their entry points (the names without the underscore)
check those shapes, and that the ring columns cover ``ring_rows``, before the call.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native.bounds import check_array, check_indices


@numba.njit(cache=True, nogil=True)
def _successor(cur, prev_delta, ring_rows, head, max_delta):  # pragma: no cover (compiled)
    """The next step of ``cur``'s episode, or -1 if it has not been added. Vector envs usually keep one
    distance between a stream's steps, so the step at ``cur``'s own link distance is tried first."""
    slot = cur % ring_rows if ring_rows else cur
    own = np.int64(prev_delta[slot])
    guess = cur + (own if own > 0 else 1)
    if guess < head:
        s = guess % ring_rows if ring_rows else guess
        if np.int64(prev_delta[s]) > 0 and guess - np.int64(prev_delta[s]) == cur:
            return guess
    last = min(head - 1, cur + max_delta)
    for cand in range(cur + 1, last + 1):
        s = cand % ring_rows if ring_rows else cand
        d = np.int64(prev_delta[s])
        if d > 0 and cand - d == cur:
            return cand
    return -1


@numba.njit(cache=True, nogil=True)
def _walk_forward(starts, seq_len, prev_delta, term, trunc, ring_rows, head, max_delta, out,
                  lengths):  # pragma: no cover (compiled)
    for i in range(starts.size):
        cur = starts[i]
        n = 0
        while True:
            out[i, n] = cur
            n += 1
            if n == seq_len:
                break
            slot = cur % ring_rows if ring_rows else cur
            if (term[slot >> 3] >> (slot & 7)) & 1 or (trunc[slot >> 3] >> (slot & 7)) & 1:
                break  # the episode ended here (flags are 1-bit packed, least significant bit first)
            cur = _successor(cur, prev_delta, ring_rows, head, max_delta)
            if cur < 0:
                break
        lengths[i] = n
        for j in range(n, seq_len):
            out[i, j] = -1


@numba.njit(cache=True, nogil=True)
def _walk_back(starts, burn_in, prev_delta, ring_rows, oldest, out):  # pragma: no cover (compiled)
    for i in range(starts.size):
        cur = starts[i]
        for j in range(burn_in - 1, -1, -1):
            if cur >= 0:
                d = np.int64(prev_delta[cur % ring_rows if ring_rows else cur])
                cur = cur - d if d > 0 and cur - d >= oldest else -1
            out[i, j] = cur


@numba.njit(cache=True, nogil=True)
def _group_by_episode(episode, offsets, oldest, members):  # pragma: no cover (compiled)
    """A counting sort: each episode's steps, in order, at ``members[offsets[e]:offsets[e+1]]`` (O(n), where
    an argsort of a million steps took ~40 ms here, on every batch while the store grows)."""
    fill = offsets[:-1].copy()
    for i in range(episode.size):
        e = episode[i]
        members[fill[e]] = oldest + i
        fill[e] += 1


@numba.njit(cache=True, nogil=True)
def _label_episodes(oldest, n, prev_delta, ring_rows, k, episode, first):  # pragma: no cover (compiled)
    """``episode[g - oldest]``: the episode number of each step (numbered by their first step)."""
    n_eps = 0
    for i in range(n):
        g = oldest + i
        d = np.int64(prev_delta[g % ring_rows if ring_rows else g])
        if d > 0 and g - d >= oldest:
            episode[i] = episode[i - d]
        else:
            episode[i] = n_eps
            first[n_eps] = 0 if d == 0 or k == 1 else k - 1  # a cut episode's first stacks reach below oldest
            n_eps += 1
    return n_eps


def _check_ring(ring_rows, *columns) -> None:
    for name, column, per_byte in columns:
        if ring_rows and column.size * per_byte < ring_rows:
            raise ValueError(f"{name} covers {column.size * per_byte} rows of a ring of {ring_rows}")


@numba.njit(cache=True, nogil=True)
def _walk_forward_checked(starts, seq_len, prev_delta, term, trunc, ring_rows, head, max_delta, out,
                          lengths):  # pragma: no cover (compiled)
    """``_walk_forward`` if the outputs and columns have the sizes ``walk_forward`` checks (True), else
    nothing written (False)."""
    if not (seq_len >= 1 and out.shape[0] == starts.size and out.shape[1] == seq_len and lengths.size >= starts.size
            and (ring_rows == 0 or (prev_delta.size >= ring_rows and term.size * 8 >= ring_rows
                                    and trunc.size * 8 >= ring_rows))):
        return False
    _walk_forward(starts, seq_len, prev_delta, term, trunc, ring_rows, head, max_delta, out, lengths)
    return True


def walk_forward(starts, seq_len, prev_delta, term, trunc, ring_rows, head, max_delta, out, lengths) -> None:
    """``_walk_forward`` after checking ``out`` is ``(starts.size, seq_len)`` and ``lengths`` has an entry
    a start (dtypes and dimensions here, sizes inside the compiled call: the sequence draws call this many
    times a batch; a fault is then named by the checks below)."""
    if (type(out) is type(lengths) is np.ndarray and out.dtype == np.int64 and lengths.dtype == np.int64
            and out.ndim == 2 and lengths.ndim == 1 and lengths.flags.c_contiguous
            and _walk_forward_checked(starts, seq_len, prev_delta, term, trunc, ring_rows, head, max_delta, out,
                                      lengths)):
        return
    check_array("out", out, np.int64, shape=(starts.size, seq_len), contiguous=False)
    check_array("lengths", lengths, np.int64, ndim=1, min_size=starts.size)
    _check_ring(ring_rows, ("prev_delta", prev_delta, 1), ("terminated", term, 8), ("truncated", trunc, 8))
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    _walk_forward(starts, seq_len, prev_delta, term, trunc, ring_rows, head, max_delta, out, lengths)


def walk_back(starts, burn_in, prev_delta, ring_rows, oldest, out) -> None:
    """``_walk_back`` after checking ``out`` is ``(starts.size, burn_in)``."""
    check_array("out", out, np.int64, shape=(starts.size, burn_in), contiguous=False)
    _check_ring(ring_rows, ("prev_delta", prev_delta, 1))
    _walk_back(starts, burn_in, prev_delta, ring_rows, oldest, out)


def label_episodes(oldest, n, prev_delta, ring_rows, k, episode, first) -> int:
    """``_label_episodes`` after checking ``episode`` and ``first`` hold ``n`` entries; the episode count."""
    check_array("episode", episode, np.int64, ndim=1, min_size=n)
    check_array("first", first, np.int64, ndim=1, min_size=n)
    _check_ring(ring_rows, ("prev_delta", prev_delta, 1))
    return _label_episodes(oldest, n, prev_delta, ring_rows, k, episode, first)


def group_by_episode(episode, offsets, oldest, members) -> None:
    """``_group_by_episode`` after checking ``members`` holds every step, ``offsets`` ends at their count
    and every episode number has its offsets."""
    check_array("members", members, np.int64, ndim=1, min_size=episode.size)
    if offsets.size < 1 or offsets[-1] > members.size:
        raise ValueError(f"episode offsets end at {int(offsets[-1]) if offsets.size else None}, past the "
                         f"{members.size} members")
    check_indices("episode", episode, 0, offsets.size - 1)
    _group_by_episode(episode, offsets, oldest, members)
