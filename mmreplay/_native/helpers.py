"""Codec helpers: threads that share one batch's compiled work (frame decodes, slab copies) with its caller.

Invariant: a job is cut into pieces that are claimed one at a time through one atomic ticket word
(epoch, number of pieces, next piece). The caller claims pieces too and returns only once every claimed
piece is done, so a job completes even if no helper ever wakes, and the caller never waits for more than
the pieces helpers already hold. A helper reads a job's parameters only after it claimed one of its
pieces; the caller changes them only after every piece is done. Helpers spin (yielding the core to
anything runnable) for ``SPIN_SECONDS`` after their last piece, then sleep until a job wakes them.
One set of helpers per process, made on first use; a forked child (which has none of its parent's
threads) makes its own; ``MMREPLAY_CODEC_THREADS=0`` turns them off.

Why not a thread pool: handing a task to ``concurrent.futures`` costs ~20-50 us of Python and a wake-up,
more than half of what a batch-32 decode (160 frames, ~1 us each) takes, so batches were decoded on one
core. A claimed piece costs two atomic operations.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

import numba
import numpy as np
from numba import types

from mmreplay._native.intrinsics import address, atomic_add, atomic_cas, atomic_load, atomic_store
from mmreplay._native.gather import gather_stacks
from mmreplay._native.bounds import check_indices
from mmreplay._native.chunk_decode import decode_chunks
from mmreplay._native.decode import check_decodes, check_frame_decodes, check_plan
from mmreplay._native.linked import zstd_create_dctx, zstd_free_dctx
from mmreplay._native.run_decode import decode_frame_groups_with
from mmreplay._native.runs import decode_partial_groups_with
from mmreplay._native.selftest import ensure_linked
from mmreplay import settings
from mmreplay._native import (cache, chunk_decode, codec_kinds, gather, intrinsics, kernel_cache, linked, run_decode,
                              runs, temporal_header)

# these kernels call the compiled decode and copy kernels of other modules: see kernel_cache
kernel_cache.follow(__file__, intrinsics, gather, cache, linked, run_decode, chunk_decode, runs, temporal_header,
                    codec_kinds)

# Layout of the control words (int64).
TICKET, DONE, BAD, STOP, SLEEPING = 0, 8, 16, 24, 32   # SLEEPING + i: helper i is asleep (1) or not (0)
MAX_HELPERS = 24
PARAMS = 64
KIND, TOTAL, PER_PIECE = PARAMS, PARAMS + 1, PARAMS + 2
ARG = PARAMS + 3  # the kind's own arguments from here
CONTROL_WORDS = PARAMS + 24
DECODE, GATHER_WORDS, GATHER_BYTES, DECODE_FRAMES, DECODE_PARTIAL = 1, 2, 3, 4, 5
MAX_PIECES = 0xFFFF
# A piece: ~10-20 us of work, small enough that the last one held by a helper is a short wait.
DECODES_PER_PIECE = 16
STACKS_PER_PIECE = 4
# Runs of frames (``run_decode.decode_frame_groups``): a run's frames for a batch take ~5-10 frame decodes.
RUNS_PER_PIECE = 2
SPIN_SECONDS = 300e-6
OUTSIDE = -2  # _post_gather: an index is not a row of the slab (nothing posted)
ENV = settings.CODEC_THREADS_ENV


sched_yield = types.ExternalFunction("sched_yield", types.intc())
clock_gettime = types.ExternalFunction("clock_gettime", types.intc(types.intc, types.voidptr))
CLOCK_MONOTONIC = time.CLOCK_MONOTONIC


@numba.njit(cache=True, nogil=True)
def _now_ns(timespec):  # pragma: no cover (compiled)
    clock_gettime(CLOCK_MONOTONIC, timespec.ctypes.data)
    return timespec[0] * 1_000_000_000 + timespec[1]


# -- the work itself ---------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _run_piece(ctrl, piece, dctx):  # pragma: no cover (compiled)
    kind, total, per = ctrl[KIND], ctrl[TOTAL], ctrl[PER_PIECE]
    lo = piece * per
    hi = min(total, lo + per)
    if kind == DECODE_FRAMES:
        src = numba.carray(address(ctrl[ARG]), (total,), np.int64)
        sizes = numba.carray(address(ctrl[ARG + 1]), (total,), np.int64)
        starts = numba.carray(address(ctrl[ARG + 2]), (total + 1,), np.int64)
        n_requests = starts[total]
        js = numba.carray(address(ctrl[ARG + 3]), (n_requests,), np.int64)
        dsts = numba.carray(address(ctrl[ARG + 4]), (n_requests,), np.int64)
        status = numba.carray(address(ctrl[ARG + 5]), (total,), np.int8)
        bad = decode_frame_groups_with(dctx, src[lo:hi], sizes[lo:hi], starts[lo:hi + 1], js, dsts, ctrl[ARG + 6],
                                       ctrl[ARG + 7], status[lo:hi], ctrl[ARG + 8] != 0)
        if bad:
            atomic_add(ctrl, BAD, bad)
        return
    if kind == DECODE_PARTIAL:
        src = numba.carray(address(ctrl[ARG]), (total,), np.int64)
        firsts = numba.carray(address(ctrl[ARG + 1]), (total,), np.int64)
        lasts = numba.carray(address(ctrl[ARG + 2]), (total,), np.int64)
        rows = numba.carray(address(ctrl[ARG + 3]), (total,), np.int64)
        starts = numba.carray(address(ctrl[ARG + 4]), (total + 1,), np.int64)
        n_requests = starts[total]
        js = numba.carray(address(ctrl[ARG + 5]), (n_requests,), np.int64)
        dsts = numba.carray(address(ctrl[ARG + 6]), (n_requests,), np.int64)
        status = numba.carray(address(ctrl[ARG + 7]), (total,), np.int8)
        n_rows, width = ctrl[ARG + 14], ctrl[ARG + 15]
        dir_n = numba.carray(address(ctrl[ARG + 10]), (n_rows,), np.uint8)
        dir_refs = numba.carray(address(ctrl[ARG + 11]), (n_rows, width), np.int8)
        dir_bounds = numba.carray(address(ctrl[ARG + 12]), (n_rows, width + 1), np.uint32)
        dir_fcrc = numba.carray(address(ctrl[ARG + 13]), (n_rows, width), np.uint32)
        bad = decode_partial_groups_with(dctx, src[lo:hi], firsts[lo:hi], lasts[lo:hi], rows[lo:hi], starts[lo:hi + 1],
                                         js, dsts, ctrl[ARG + 8], ctrl[ARG + 9], dir_n, dir_refs, dir_bounds, dir_fcrc,
                                         status[lo:hi])
        if bad:
            atomic_add(ctrl, BAD, bad)
        return
    if kind == DECODE:
        src = numba.carray(address(ctrl[ARG]), (total,), np.int64)
        sizes = numba.carray(address(ctrl[ARG + 1]), (total,), np.int64)
        dst = numba.carray(address(ctrl[ARG + 2]), (total,), np.int64)
        copies = numba.carray(address(ctrl[ARG + 3]), (total,), np.int64)
        status = numba.carray(address(ctrl[ARG + 4]), (total,), np.int8)
        bad = decode_chunks(src[lo:hi], sizes[lo:hi], dst[lo:hi], copies[lo:hi], ctrl[ARG + 5], ctrl[ARG + 6],
                            status[lo:hi], ctrl[ARG + 7] != 0)
        if bad:
            atomic_add(ctrl, BAD, bad)
        return
    rows, width, index_width, k = ctrl[ARG + 1], ctrl[ARG + 2], ctrl[ARG + 4], ctrl[ARG + 5]
    shifted = ctrl[ARG + 6] != 0
    index = numba.carray(address(ctrl[ARG + 3]), (total, index_width), np.int64)
    if kind == GATHER_WORDS:
        slab = numba.carray(address(ctrl[ARG]), (rows, width), np.uint64)
        out_obs = numba.carray(address(ctrl[ARG + 7]), (total * k, width), np.uint64)
        out_next = numba.carray(address(ctrl[ARG + 8]), (total * k, width), np.uint64)
        gather_stacks(slab, index[lo:hi], k, shifted, out_obs[lo * k:hi * k], out_next[lo * k:hi * k])
    else:
        slab8 = numba.carray(address(ctrl[ARG]), (rows, width), np.uint8)
        out_obs8 = numba.carray(address(ctrl[ARG + 7]), (total * k, width), np.uint8)
        out_next8 = numba.carray(address(ctrl[ARG + 8]), (total * k, width), np.uint8)
        gather_stacks(slab8, index[lo:hi], k, shifted, out_obs8[lo * k:hi * k], out_next8[lo * k:hi * k])


@numba.njit(cache=True, nogil=True)
def _claim_and_run(ctrl, dctx):  # pragma: no cover (compiled)
    """Claim and run pieces of the current job until none is left; False if there was none to claim. ``dctx``:
    the thread's zstd context, kept across pieces (0: none, each decode then makes its own)."""
    ran = False
    while True:
        ticket = atomic_load(ctrl, TICKET)
        nxt, n = ticket & MAX_PIECES, (ticket >> 16) & MAX_PIECES
        if nxt >= n:
            return ran
        if atomic_cas(ctrl, TICKET, ticket, ticket + 1):
            _run_piece(ctrl, nxt, dctx)
            atomic_add(ctrl, DONE, 1)
            ran = True


@numba.njit(cache=True, nogil=True)
def _post(ctrl, n_pieces, n_helpers):  # pragma: no cover (compiled)
    """Publish the job whose parameters were just written (as ``n_pieces`` pieces); True if a helper sleeps
    (then the caller wakes it)."""
    atomic_store(ctrl, DONE, 0)
    atomic_store(ctrl, BAD, 0)
    epoch = (atomic_load(ctrl, TICKET) >> 32) + 1
    atomic_store(ctrl, TICKET, ((epoch & 0xFFFFFFFF) << 32) | (n_pieces << 16))
    for i in range(n_helpers):
        if atomic_load(ctrl, SLEEPING + i) != 0:
            return True
    return False


@numba.njit(cache=True, nogil=True)
def _work(ctrl):  # pragma: no cover (compiled)
    """The caller's part: pieces until none is left, then wait for those helpers hold. Returns the
    number of failed decodes."""
    dctx = zstd_create_dctx()
    _claim_and_run(ctrl, dctx)
    if dctx != 0:
        zstd_free_dctx(dctx)
    n = (atomic_load(ctrl, TICKET) >> 16) & MAX_PIECES
    while atomic_load(ctrl, DONE) < n:
        sched_yield()
    return atomic_load(ctrl, BAD)


@numba.njit(cache=True, nogil=True)
def _serve(ctrl, me, spin_ns):  # pragma: no cover (compiled)
    """A helper's loop: claim pieces as jobs come; after ``spin_ns`` without one, mark itself asleep and
    return 0 (to sleep until woken); 1 when told to stop."""
    timespec = np.zeros(2, dtype=np.int64)
    atomic_store(ctrl, SLEEPING + me, 0)
    idle_since = _now_ns(timespec)
    dctx = zstd_create_dctx()  # one for this wake-up's pieces, freed before sleeping
    stop = 1
    while atomic_load(ctrl, STOP) == 0:
        if _claim_and_run(ctrl, dctx):
            idle_since = _now_ns(timespec)
            continue
        if _now_ns(timespec) - idle_since > spin_ns:
            atomic_store(ctrl, SLEEPING + me, 1)
            ticket = atomic_load(ctrl, TICKET)  # a job posted meanwhile saw us awake: take it first
            if ticket & MAX_PIECES < (ticket >> 16) & MAX_PIECES:
                atomic_store(ctrl, SLEEPING + me, 0)
                continue
            stop = 0
            break
        sched_yield()
    if dctx != 0:
        zstd_free_dctx(dctx)
    return stop


class CodecHelpers:
    """``n`` helper threads and their control words; jobs are run one at a time (a caller that finds a
    job running does its own work alone)."""

    def __init__(self, n: int):
        self.n = max(0, min(int(n), MAX_HELPERS))
        self.ctrl = np.zeros(CONTROL_WORDS, dtype=np.int64)
        self._busy = threading.Lock()
        self._wake = [threading.Event() for _ in range(self.n)]
        self._threads = [threading.Thread(target=self._helper, args=(i,), name=f"mmreplay-codec-{i}", daemon=True)
                         for i in range(self.n)]
        for t in self._threads:
            t.start()

    def _helper(self, me: int) -> None:
        spin_ns = int(SPIN_SECONDS * 1e9)
        while _serve(self.ctrl, me, spin_ns) == 0:
            self._wake[me].wait()
            self._wake[me].clear()  # then _serve looks for a job before it would sleep again

    def stop(self) -> None:
        self.ctrl[STOP] = 1
        for event in self._wake:
            event.set()

    def decode(self, src, sizes, dst, copies, nbytes: int, codec: int, status, into,
               verified: bool = False) -> int | None:
        """``chunk_decode.decode_chunks`` shared with the helpers; the number of failures, or None if the
        helpers are busy with another caller's job or the arrays are not plain (then decode alone).
        Every destination and copy address is first checked to have ``nbytes`` of room in ``into`` (the
        arrays they point into; ``decode.check_decodes``): a ``ValueError`` then, and nothing written.
        ``verified``: the chunks' checksums matched when their bytes came in (``decode.checked_verify_chunks``)."""
        check_decodes(src, sizes, dst, copies, nbytes, codec, status, into)
        ensure_linked()
        return self._decode(src, sizes, dst, copies, nbytes, codec, status, verified)

    def decode_plan(self, plan, codec: int, status, verified: bool = False) -> int | None:
        """``decode`` of a batch's ``decode.StackPlan``, whose addresses its checked planning put inside the
        outputs (``decode.check_plan``)."""
        check_plan(plan, codec, status)
        ensure_linked()
        return self._decode(plan.src, plan.sizes, plan.dst, plan.copies, plan.nbytes, codec, status, verified)

    def _decode(self, src, sizes, dst, copies, nbytes: int, codec: int, status, verified: bool) -> int | None:
        if not self._busy.acquire(blocking=False):
            return None
        try:
            try:
                posted = _post_decode(self.ctrl, src, sizes, dst, copies, status, nbytes, codec, int(verified), self.n)
            except TypeError:  # not C-contiguous int64 (int8 status) arrays: a helper could not rebuild them
                return None
            return self._finish(posted)
        finally:
            self._busy.release()

    def decode_frames(self, src, sizes, starts, js, dsts, frame_nbytes: int, run_rows: int, status,
                      into, verified: bool = False) -> int | None:
        """``run_decode.decode_frame_groups`` shared with the helpers (as ``decode``; the requests first checked by
        ``decode.check_frame_decodes``)."""
        check_frame_decodes(src, sizes, starts, js, dsts, frame_nbytes, run_rows, status, into)
        ensure_linked()
        if not self._busy.acquire(blocking=False):
            return None
        try:
            try:
                posted = _post_decode_frames(self.ctrl, src, sizes, starts, js, dsts, status, frame_nbytes, run_rows,
                                             int(verified), self.n)
            except TypeError:
                return None
            return self._finish(posted)
        finally:
            self._busy.release()

    def decode_partial(self, src, firsts, lasts, rows, starts, js, dsts, frame_nbytes: int, run_rows: int, directory,
                       status) -> int | None:
        """``runs.decode_partial_groups`` shared with the helpers, for requests its caller checked
        (``RunDirectory.decode``); None if the helpers are busy or the arrays are not plain."""
        if not self._busy.acquire(blocking=False):
            return None
        try:
            try:
                posted = _post_decode_partial(self.ctrl, src, firsts, lasts, rows, starts, js, dsts, status,
                                              frame_nbytes, run_rows, *directory, self.n)
            except TypeError:
                return None
            return self._finish(posted)
        finally:
            self._busy.release()

    def gather(self, slab, index, k: int, shifted: bool, out_obs, out_next) -> bool:
        """``gather.gather_stacks`` shared with the helpers; False if they are busy or the arrays are not
        plain (then copy alone). Every index is first checked to be a row of ``slab`` and the shapes to agree
        (``_post_gather``, compiled): an index outside is a ``ValueError``, and nothing is written."""
        if not self._busy.acquire(blocking=False):
            return False
        try:
            try:
                posted = _post_gather(self.ctrl, slab, index, k, shifted, out_obs, out_next, self.n)
            except TypeError:  # not C-contiguous uint64 / uint8 rows and int64 index
                return False
            if posted == OUTSIDE:
                check_indices("index", index, 0, slab.shape[0])  # raises, naming the index
            return self._finish(posted) is not None
        finally:
            self._busy.release()

    def _finish(self, posted: int) -> int | None:
        """After a post: wake sleeping helpers, do the caller's part, wait. None if nothing was posted."""
        if posted < 0:
            return None
        if posted:
            for me, event in enumerate(self._wake):
                if self.ctrl[SLEEPING + me]:
                    event.set()
        return int(_work(self.ctrl))


_I64, _ROWS = "int64[::1]", "{0}[:, ::1]"


def _typed(signatures):
    """``numba.njit`` with typed ``signatures`` (a call with other types is a ``TypeError``), compiled or
    loaded from numba's cache at the first call rather than at import (~0.3 s a process otherwise)."""
    def wrap(fn):
        compiled = None

        def call(*args):
            nonlocal compiled
            if compiled is None:
                compiled = numba.njit(signatures, cache=True, nogil=True)(fn)
            return compiled(*args)
        call.__doc__ = fn.__doc__
        return call
    return wrap


@_typed(f"int64(int64[::1], {_I64}, {_I64}, {_I64}, {_I64}, int8[::1], int64, int64, int64, int64)")
def _post_decode(ctrl, src, sizes, dst, copies, status, nbytes, codec, verified, n_helpers):  # pragma: no cover
    """Parameters of a ``decode_chunks`` job, then post it: 1 if a helper sleeps, 0 if not, -1 (nothing
    posted) if the arrays disagree in length."""
    total = src.size
    if sizes.size != total or dst.size != total or copies.size != total or status.size < total:
        return -1
    per = max(DECODES_PER_PIECE, (total + MAX_PIECES - 1) // MAX_PIECES)
    ctrl[KIND], ctrl[TOTAL], ctrl[PER_PIECE] = DECODE, total, per
    ctrl[ARG], ctrl[ARG + 1], ctrl[ARG + 2] = src.ctypes.data, sizes.ctypes.data, dst.ctypes.data
    ctrl[ARG + 3], ctrl[ARG + 4], ctrl[ARG + 5], ctrl[ARG + 6] = copies.ctypes.data, status.ctypes.data, nbytes, codec
    ctrl[ARG + 7] = verified
    return 1 if _post(ctrl, (total + per - 1) // per, n_helpers) else 0


@_typed(f"int64(int64[::1], {_I64}, {_I64}, {_I64}, {_I64}, {_I64}, int8[::1], int64, int64, int64, int64)")
def _post_decode_frames(ctrl, src, sizes, starts, js, dsts, status, frame_nbytes, run_rows, verified,
                        n_helpers):  # pragma: no cover
    """Parameters of a ``decode_frame_groups`` job, then post it (as ``_post_decode``)."""
    total = src.size
    if sizes.size != total or starts.size != total + 1 or status.size < total or js.size != dsts.size or \
            starts[total] != js.size:
        return -1
    per = max(RUNS_PER_PIECE, (total + MAX_PIECES - 1) // MAX_PIECES)
    ctrl[KIND], ctrl[TOTAL], ctrl[PER_PIECE] = DECODE_FRAMES, total, per
    ctrl[ARG], ctrl[ARG + 1], ctrl[ARG + 2] = src.ctypes.data, sizes.ctypes.data, starts.ctypes.data
    ctrl[ARG + 3], ctrl[ARG + 4], ctrl[ARG + 5] = js.ctypes.data, dsts.ctypes.data, status.ctypes.data
    ctrl[ARG + 6], ctrl[ARG + 7], ctrl[ARG + 8] = frame_nbytes, run_rows, verified
    return 1 if _post(ctrl, (total + per - 1) // per, n_helpers) else 0


@_typed(f"int64(int64[::1], {_I64}, {_I64}, {_I64}, {_I64}, {_I64}, {_I64}, {_I64}, int8[::1], int64, int64, "
        "uint8[::1], int8[:, ::1], uint32[:, ::1], uint32[:, ::1], int64)")
def _post_decode_partial(ctrl, src, firsts, lasts, rows, starts, js, dsts, status, frame_nbytes, run_rows, dir_n,
                         dir_refs, dir_bounds, dir_fcrc, n_helpers):  # pragma: no cover
    """Parameters of a ``decode_partial_groups`` job, then post it (as ``_post_decode``)."""
    total = src.size
    if firsts.size != total or lasts.size != total or rows.size != total or starts.size != total + 1 or \
            status.size < total or js.size != dsts.size or starts[total] != js.size or \
            dir_refs.shape[0] != dir_n.size or dir_bounds.shape[0] != dir_n.size or dir_fcrc.shape != dir_refs.shape \
            or dir_bounds.shape[1] != dir_refs.shape[1] + 1:
        return -1
    per = max(RUNS_PER_PIECE, (total + MAX_PIECES - 1) // MAX_PIECES)
    ctrl[KIND], ctrl[TOTAL], ctrl[PER_PIECE] = DECODE_PARTIAL, total, per
    ctrl[ARG], ctrl[ARG + 1], ctrl[ARG + 2], ctrl[ARG + 3] = src.ctypes.data, firsts.ctypes.data, lasts.ctypes.data, \
        rows.ctypes.data
    ctrl[ARG + 4], ctrl[ARG + 5], ctrl[ARG + 6] = starts.ctypes.data, js.ctypes.data, dsts.ctypes.data
    ctrl[ARG + 7], ctrl[ARG + 8], ctrl[ARG + 9] = status.ctypes.data, frame_nbytes, run_rows
    ctrl[ARG + 10], ctrl[ARG + 11] = dir_n.ctypes.data, dir_refs.ctypes.data
    ctrl[ARG + 12], ctrl[ARG + 13] = dir_bounds.ctypes.data, dir_fcrc.ctypes.data
    ctrl[ARG + 14], ctrl[ARG + 15] = dir_n.size, dir_refs.shape[1]
    return 1 if _post(ctrl, (total + per - 1) // per, n_helpers) else 0


@_typed([f"int64(int64[::1], {_ROWS.format(t)}, int64[:, ::1], int64, boolean, {_ROWS.format(t)}, "
         f"{_ROWS.format(t)}, int64)" for t in ("uint64", "uint8")])
def _post_gather(ctrl, slab, index, k, shifted, out_obs, out_next, n_helpers):  # pragma: no cover
    """Parameters of a ``gather_stacks`` job, then post it (as ``_post_decode``; -1 if shapes disagree,
    ``OUTSIDE`` if an index is not a row of ``slab``: nothing posted either way)."""
    n, width = index.shape[0], slab.shape[1]
    if index.shape[1] != (k + 1 if shifted else 2 * k) or out_obs.shape[0] != n * k or \
            out_next.shape[0] != n * k or out_obs.shape[1] != width or out_next.shape[1] != width:
        return -1
    rows, flat = slab.shape[0], index.reshape(-1)
    for i in range(flat.size):
        if not 0 <= flat[i] < rows:
            return OUTSIDE
    per = max(STACKS_PER_PIECE, (n + MAX_PIECES - 1) // MAX_PIECES)
    ctrl[KIND] = GATHER_WORDS if slab.itemsize == 8 else GATHER_BYTES
    ctrl[TOTAL], ctrl[PER_PIECE] = n, per
    ctrl[ARG], ctrl[ARG + 1], ctrl[ARG + 2], ctrl[ARG + 3] = slab.ctypes.data, slab.shape[0], width, index.ctypes.data
    ctrl[ARG + 4], ctrl[ARG + 5], ctrl[ARG + 6] = index.shape[1], k, 1 if shifted else 0
    ctrl[ARG + 7], ctrl[ARG + 8] = out_obs.ctypes.data, out_next.ctypes.data
    return 1 if _post(ctrl, (n + per - 1) // per, n_helpers) else 0


def helper_count(configured: int | None = None) -> int:
    """Helper threads for this process: ``configured`` (the session's ``Settings.codec_threads``, which
    ``MMREPLAY_CODEC_THREADS`` overrides) if set, else none in a DataLoader worker and one fewer than the
    cores this process may run on (the caller is the other one) elsewhere."""
    from_environment = settings.codec_threads_override()  # also applied by Settings.resolve; read here for
    configured = configured if from_environment is None else from_environment  # callers with no session
    if configured is not None:
        return min(configured, MAX_HELPERS)
    if _in_dataloader_worker():
        return 0  # one of several worker processes that share the cores already
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return min(cores - 1, 7)


def _in_dataloader_worker() -> bool:
    # A DataLoader worker runs inside torch.utils.data, so it is loaded there; where it is not, this is no
    # worker, and torch is not imported for the answer (``mmreplay export`` reads frames without torch).
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


_HELPERS: CodecHelpers | None = None
_MADE = threading.Lock()


def codec_helpers(configured: int | None = None) -> CodecHelpers | None:
    """This process's helpers, or None when there are none (one core, or turned off). The first call makes
    them, ``helper_count(configured)`` of them (the caller's session ``codec_threads``); later calls share them."""
    global _HELPERS
    if _HELPERS is None:
        with _MADE:
            if _HELPERS is None:
                _HELPERS = CodecHelpers(helper_count(configured))
    return _HELPERS if _HELPERS.n else None


def _forget_helpers() -> None:
    global _HELPERS, _MADE
    _HELPERS, _MADE = None, threading.Lock()  # a forked child has none of the threads (nor a held lock)


@atexit.register
def _stop_helpers() -> None:
    if _HELPERS is not None:
        _HELPERS.stop()


if hasattr(os, "register_at_fork"):  # the child's own helpers are made on its first use
    os.register_at_fork(after_in_child=_forget_helpers)
