"""Frame stacks copied out of the decoded-chunk cache into a batch, in one compiled pass.

Invariant: row ``i * k + j`` of the obs output holds frame ``index[i, j]`` of the cache slab, and the next
obs output the frame of column ``j + 1`` (``shifted``: a transition's next stack is its obs stack moved by
one frame) or ``k + j`` (n-step: the next stack is a later transition's). Outputs and slab are viewed as
rows of 8-byte words when frames allow, so the copy runs at memcpy speed; a frame shared by both stacks is
read once and written twice while it is in cache (Atari batch-32: 95 us, vs 223 us for two numpy takes).
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native import cache, kernel_cache
from mmreplay._native.bounds import check_array, check_indices
from mmreplay._native.cache import slab_row

kernel_cache.follow(__file__, cache)  # the kernels inline slab_row (see kernel_cache)


@numba.njit(cache=True, nogil=True)
def gather_stacks(slab, index, k, shifted, out_obs, out_next):  # pragma: no cover (compiled)
    """Rows ``slab[index[i, j]]`` into the flat (n * k, words) outputs (see the module invariant)."""
    width = slab.shape[1]
    for i in range(index.shape[0]):
        if shifted:
            for j in range(k + 1):
                src = index[i, j]
                if j < k:
                    row = i * k + j
                    for c in range(width):
                        out_obs[row, c] = slab[src, c]
                if j > 0:
                    row = i * k + j - 1
                    for c in range(width):
                        out_next[row, c] = slab[src, c]
        else:
            for j in range(k):
                src_obs, src_next, row = index[i, j], index[i, k + j], i * k + j
                for c in range(width):
                    out_obs[row, c] = slab[src_obs, c]
                    out_next[row, c] = slab[src_next, c]


@numba.njit(cache=True, nogil=True)
def index_cached(slot_of, last_used, tick, ring_rows, chunk_rows, obs_ids, next_ids, shifted,
                 index):  # pragma: no cover (compiled)
    """Slab rows of a batch's frames into ``index`` (n, k + 1 when ``shifted``, else n, 2k), every chunk
    marked used: returns the number of frames looked up (all hits), or -1 without marking anything if one
    is missing."""
    n, k = obs_ids.shape
    width = index.shape[1]
    for i in range(n):
        for j in range(width):
            if j < k:
                fid = obs_ids[i, j]
            elif shifted:
                fid = next_ids[i, k - 1]
            else:
                fid = next_ids[i, j - k]
            index[i, j] = slab_row(slot_of, ring_rows, chunk_rows, fid)
            if index[i, j] < 0:
                return -1
    for i in range(n):
        for j in range(width):
            last_used[index[i, j] // chunk_rows] = tick
    return n * width


@numba.njit(cache=True, nogil=True)
def gather_cached(slot_of, last_used, tick, ring_rows, chunk_rows, slab, obs_ids, next_ids, shifted, out_obs,
                  out_next):  # pragma: no cover (compiled)
    """``index_cached`` and ``gather_stacks`` in one call (a batch too small to share with helpers):
    returns the number of frames looked up, or -1 without touching anything if one is missing."""
    n, k = obs_ids.shape
    index = np.empty((n, k + 1 if shifted else 2 * k), dtype=np.int64)
    hits = index_cached(slot_of, last_used, tick, ring_rows, chunk_rows, obs_ids, next_ids, shifted, index)
    if hits >= 0:
        gather_stacks(slab, index, k, shifted, out_obs, out_next)
    return hits


# -- entry points: shapes and indices checked before a kernel writes ----------------------------------
def _check_outputs(width, dtype, n, k, out_obs, out_next) -> None:
    for name, out in (("out_obs", out_obs), ("out_next", out_next)):
        check_array(name, out, dtype, ndim=2, contiguous=False)
        if out.shape[0] < n * k or out.shape[1] != width:
            raise ValueError(f"{name} has shape {out.shape}, {n} stacks of {k} rows of {width} words need "
                             f"({n * k}, {width}); nothing was written")


def _check_index_shape(index, n, k, shifted) -> None:
    check_array("index", index, np.int64, shape=(n, k + 1 if shifted else 2 * k), contiguous=False)


def _check_lookup(slot_of, last_used, ring_rows, chunk_rows, obs_ids, next_ids) -> None:
    """Every frame id maps to an entry of ``slot_of`` (whose slots are entries of ``last_used``: the
    cache's invariant)."""
    if obs_ids.ndim != 2 or next_ids.shape != obs_ids.shape:
        raise ValueError(f"frame ids of shapes {obs_ids.shape} and {next_ids.shape} (expected the same (n, k))")
    check_array("last_used", last_used, np.int64, ndim=1)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    covered = slot_of.size * chunk_rows
    if ring_rows:
        if not 0 < ring_rows <= covered:
            raise ValueError(f"a ring of {ring_rows} rows, but the cache's chunk table covers {covered} rows")
    else:
        check_indices("obs_ids", obs_ids, 0, covered)
        check_indices("next_ids", next_ids, 0, covered)


@numba.njit(cache=True, nogil=True)
def _outputs_fit(width, n, k, out_obs, out_next):  # pragma: no cover (compiled)
    """What ``_check_outputs`` tests of the sizes: each output has ``n * k`` rows of ``width`` words."""
    return (out_obs.shape[0] >= n * k and out_obs.shape[1] == width and out_next.shape[0] >= n * k
            and out_next.shape[1] == width)


@numba.njit(cache=True, nogil=True)
def _gather_stacks_checked(slab, index, k, shifted, out_obs, out_next):  # pragma: no cover (compiled)
    """``gather_stacks`` (0) if ``index`` has a row a stack of rows of ``slab`` and the outputs hold the
    stacks, else -2 with nothing written."""
    n = index.shape[0]
    if not (k >= 1 and index.shape[1] == (k + 1 if shifted else 2 * k)
            and _outputs_fit(slab.shape[1], n, k, out_obs, out_next)):
        return -2
    for i in range(n):
        for j in range(index.shape[1]):
            if not 0 <= index[i, j] < slab.shape[0]:
                return -2
    gather_stacks(slab, index, k, shifted, out_obs, out_next)
    return 0


def _plain_gather(slab, out_obs, out_next, ids, ids2=None) -> bool:
    """The types the compiled checks take, in one expression (this runs every batch): 2-D numpy slab and
    outputs of one dtype, 2-D int64 ids (their sizes and values are tested in the compiled call)."""
    return (type(slab) is type(out_obs) is type(out_next) is type(ids) is np.ndarray
            and slab.ndim == out_obs.ndim == out_next.ndim == ids.ndim == 2 and out_obs.dtype == slab.dtype
            and out_next.dtype == slab.dtype and ids.dtype == _I64
            and (ids2 is None or (type(ids2) is np.ndarray and ids2.dtype == _I64 and ids2.ndim == 2)))


_I64 = np.dtype(np.int64)


def checked_gather_stacks(slab, index, k, shifted, out_obs, out_next) -> None:
    """``gather_stacks`` after checking every index is a row of ``slab`` and the outputs hold the stacks
    (types here, sizes and indices in the compiled call; the named checks on a fault)."""
    if _plain_gather(slab, out_obs, out_next, index) and \
            _gather_stacks_checked(slab, index, k, shifted, out_obs, out_next) == 0:
        return
    n = index.shape[0]
    _check_index_shape(index, n, k, shifted)
    _check_outputs(slab.shape[1], slab.dtype, n, k, out_obs, out_next)
    check_indices("index", index, 0, slab.shape[0])
    gather_stacks(slab, index, k, shifted, out_obs, out_next)


@numba.njit(cache=True, nogil=True)
def _lookup_fits(slot_of, last_used, ring_rows, chunk_rows, obs_ids, next_ids):  # pragma: no cover (compiled)
    """What ``_check_lookup`` tests, compiled: every frame id maps to an entry of ``slot_of``."""
    n, k = obs_ids.shape
    covered = slot_of.size * chunk_rows
    if not (chunk_rows >= 1 and last_used.flags.c_contiguous and next_ids.shape[0] == n
            and next_ids.shape[1] == k):
        return False
    if ring_rows:
        return 0 < ring_rows <= covered
    for i in range(n):
        for j in range(k):
            if not (0 <= obs_ids[i, j] < covered and 0 <= next_ids[i, j] < covered):
                return False
    return True


@numba.njit(cache=True, nogil=True)
def _index_cached_checked(slot_of, last_used, tick, ring_rows, chunk_rows, obs_ids, next_ids, shifted,
                          index):  # pragma: no cover (compiled)
    """``index_cached`` if ``_check_lookup`` and ``_check_index_shape`` would pass, else -2 with nothing
    written: their tests inside the one compiled call (a cached batch's lookup runs on every draw)."""
    n, k = obs_ids.shape
    if not (index.shape[0] == n and index.shape[1] == (k + 1 if shifted else 2 * k)
            and _lookup_fits(slot_of, last_used, ring_rows, chunk_rows, obs_ids, next_ids)):
        return -2
    return index_cached(slot_of, last_used, tick, ring_rows, chunk_rows, obs_ids, next_ids, shifted, index)


@numba.njit(cache=True, nogil=True)
def _gather_cached_checked(slot_of, last_used, tick, ring_rows, chunk_rows, slab, obs_ids, next_ids, shifted,
                           out_obs, out_next):  # pragma: no cover (compiled)
    """``gather_cached`` if the checks of ``checked_gather_cached`` pass, else -2 with nothing written."""
    n, k = obs_ids.shape
    if not (slab.shape[0] >= last_used.size * chunk_rows and _outputs_fit(slab.shape[1], n, k, out_obs, out_next)
            and _lookup_fits(slot_of, last_used, ring_rows, chunk_rows, obs_ids, next_ids)):
        return -2
    return gather_cached(slot_of, last_used, tick, ring_rows, chunk_rows, slab, obs_ids, next_ids, shifted, out_obs,
                         out_next)


def checked_index_cached(slot_of, last_used, tick, ring_rows, chunk_rows, obs_ids, next_ids, shifted, index) -> int:
    """``index_cached`` after checking ``index`` has a row a stack and every id maps into the cache's table
    (dtypes and dimensions here, sizes and ids inside the compiled call; the named checks on a fault)."""
    if (type(index) is type(last_used) is np.ndarray and index.dtype == np.int64 and last_used.dtype == np.int64
            and index.ndim == 2 and last_used.ndim == 1 and last_used.flags.c_contiguous and obs_ids.ndim == 2
            and next_ids.ndim == 2):
        got = _index_cached_checked(slot_of, last_used, tick, ring_rows, chunk_rows, obs_ids, next_ids, shifted,
                                    index)
        if got != -2:
            return got
    n, k = obs_ids.shape
    _check_lookup(slot_of, last_used, ring_rows, chunk_rows, obs_ids, next_ids)
    _check_index_shape(index, n, k, shifted)
    return index_cached(slot_of, last_used, tick, ring_rows, chunk_rows, obs_ids, next_ids, shifted, index)


def checked_gather_cached(slot_of, last_used, tick, ring_rows, chunk_rows, slab, obs_ids, next_ids, shifted,
                          out_obs, out_next) -> int:
    """``gather_cached`` after checking the ids map into the cache's table, the slab has the rows of every
    slot and the outputs hold the stacks (types here, sizes and ids in the compiled call; the named checks on
    a fault)."""
    if (_plain_gather(slab, out_obs, out_next, obs_ids, next_ids) and type(last_used) is np.ndarray
            and last_used.dtype == _I64 and last_used.ndim == 1):
        got = _gather_cached_checked(slot_of, last_used, tick, ring_rows, chunk_rows, slab, obs_ids, next_ids,
                                     shifted, out_obs, out_next)
        if got != -2:
            return got
    n, k = obs_ids.shape
    _check_lookup(slot_of, last_used, ring_rows, chunk_rows, obs_ids, next_ids)
    if slab.ndim != 2 or slab.shape[0] < last_used.size * chunk_rows:
        raise ValueError(f"a slab of shape {slab.shape} for {last_used.size} slots of {chunk_rows} rows")
    _check_outputs(slab.shape[1], slab.dtype, n, k, out_obs, out_next)
    return gather_cached(slot_of, last_used, tick, ring_rows, chunk_rows, slab, obs_ids, next_ids, shifted, out_obs,
                         out_next)
