"""The compiled decoders' entry points: every address and size a decode kernel will write through is checked
here, in Python or in one compiled read-only pass, before the kernel runs.

Invariant: the package outside ``_native`` decodes frames only through the ``checked_*`` functions here; each
returns only after checking that every destination (and copy) address has room for what the kernel writes inside
the arrays the caller names (``into``), or that the addresses were computed from outputs checked to hold the
batch (``StackPlan``), and after the linked C symbols passed their self-test once a process
(``selftest.ensure_linked``); otherwise it raises ``ValueError`` naming the values and what was expected, and
nothing is written. A decode's result is its number of failed chunks, with ``status`` saying which: ``OK``, or a
status that ``STATUS_TEXT`` names. A decode checks each chunk's crc32c unless its caller says, with
``verified=True``, that ``checked_verify_chunks`` found it matching when the bytes came into this process and
they have been held since (the compressed tier, ``reading/resident.py``); bytes read from files (whole or in
part) or from shared memory are checked by every decode. If a build of numcodecs or google-crc32c does not
export the symbols, ``AVAILABLE`` is False and the reader keeps the Python path.

Where the kernels are (all compiled, the GIL released):
  ``chunk_decode.py``  checksum and decompress whole chunks (``decode_chunks``), copy rows (``copy_rows_to``),
                       checksums alone (``verify_chunks``)
  ``run_decode.py``    temporal runs: whole, or the frames a batch asks for (``decode_frame_groups``)
  ``stack_plan.py``    which held chunk fills which row of a batch's stacks (``plan_stack_decodes``)
  ``linked.py``        the C functions they call (c-blosc, zstd, LZ4, crc32c) and the statuses
  ``selftest.py``      known chunks decoded through the linked symbols before the first use
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from mmreplay._native import chunk_decode, codec_kinds, intrinsics, kernel_cache, linked, run_decode, stack_plan
from mmreplay._native import temporal_header as temporal
from mmreplay._native.bounds import check_addresses, check_array, check_indices, span
from mmreplay._native.chunk_decode import copy_rows_to, decode_chunks, verify_chunks
from mmreplay._native.codec_kinds import CODEC_BLOSC, CODEC_TEMPORAL, CODEC_ZSTD, CODECS
from mmreplay._native.linked import AVAILABLE, OK, STATUS_TEXT
from mmreplay._native.run_decode import decode_frame_groups, group_frame_requests, locate_chunks, stack_frame_requests
from mmreplay._native.selftest import ensure_linked
from mmreplay._native.stack_plan import plan_stack_decodes

# the compiled checks call the planning and decode kernels (see kernel_cache)
kernel_cache.follow(__file__, intrinsics, temporal, codec_kinds, linked, run_decode, chunk_decode, stack_plan)

# what a caller reads from a decode's result, beside the entry points
__all__ = ["AVAILABLE", "OK", "STATUS_TEXT", "StackPlan", "check_decodes", "check_frame_decodes", "check_plan",
           "checked_copy_rows_to", "checked_decode_chunks", "checked_decode_frame_groups", "checked_decode_plan",
           "checked_decode_stacks", "checked_group_frame_requests", "checked_locate_chunks",
           "checked_plan_stack_decodes", "checked_stack_frame_requests", "checked_verify_chunks"]


def check_decodes(src, sizes, dst, copies, nbytes, codec, status, into) -> None:
    """Raise ``ValueError`` unless ``decode_chunks`` with these arguments writes only inside ``into`` (the
    one or two arrays the destination addresses point into): one size, destination and copy address
    (0: none) and status entry a chunk, each destination and copy with ``nbytes`` bytes of room."""
    n = src.size
    if sizes.size != n or dst.size != n or copies.size != n:
        raise ValueError(f"decode arrays disagree in length: {n} sources, {sizes.size} sizes, {dst.size} "
                         f"destinations, {copies.size} copies")
    check_array("status", status, ndim=1, min_size=n, contiguous=False)
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is none of the compiled decoder's {CODECS}")
    if len(into) in (1, 2) and nbytes >= 0 and dst.dtype == copies.dtype == np.int64 and dst.ndim == copies.ndim == 1:
        (lo0, hi0), (lo1, hi1) = span(into[0], "the buffer dst points into"), span(into[-1], "the buffer dst points into")
        if _decodes_fit(dst, copies, nbytes, lo0, hi0, lo1, hi1):
            return  # one compiled pass (every batch's misses are checked); the checks below name a fault
    check_addresses("dst", dst, nbytes, into)
    check_addresses("copies", copies, nbytes, into, allow_zero=True)


@numba.njit(cache=True, nogil=True)
def _decodes_fit(dst, copies, nbytes, lo0, hi0, lo1, hi1):  # pragma: no cover (compiled)
    """Every ``dst[i]`` and every nonzero ``copies[i]`` has ``nbytes`` bytes inside ``[lo0, hi0)`` or
    ``[lo1, hi1)``: ``check_addresses`` for both in one pass."""
    for i in range(dst.size):
        a = dst[i]
        if not ((lo0 <= a and a + nbytes <= hi0) or (lo1 <= a and a + nbytes <= hi1)):
            return False
        c = copies[i]
        if c != 0 and not ((lo0 <= c and c + nbytes <= hi0) or (lo1 <= c and c + nbytes <= hi1)):
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _frame_requests_fit(starts, js, run_rows, dsts, nbytes, lo0, hi0, lo1, hi1):  # pragma: no cover (compiled)
    """``check_frame_decodes``'s per-entry tests in one pass: starts never decrease, every frame is in
    ``[0, run_rows)`` and every destination has ``nbytes`` bytes inside ``[lo0, hi0)`` or ``[lo1, hi1)``."""
    for i in range(starts.size - 1):
        if starts[i + 1] < starts[i]:
            return False
    for i in range(js.size):
        if not 0 <= js[i] < run_rows:
            return False
        a = dsts[i]
        if not ((lo0 <= a and a + nbytes <= hi0) or (lo1 <= a and a + nbytes <= hi1)):
            return False
    return True


def check_frame_decodes(src, sizes, starts, js, dsts, frame_nbytes, run_rows, status, into) -> None:
    """Raise ``ValueError`` unless ``decode_frame_groups`` with these arguments writes only inside ``into``:
    one size and status entry a group, group starts that tile the requests, every frame in ``[0, run_rows)``
    and every destination with ``frame_nbytes`` bytes of room. The entries are tested by one compiled pass
    (a batch's requests are checked on every draw); only when it finds a fault do the slower checks run,
    to name it."""
    n = src.size
    if sizes.size != n or starts.size != n + 1 or js.size != dsts.size:
        raise ValueError(f"frame-decode arrays disagree: {n} sources, {sizes.size} sizes, {starts.size} group starts, "
                         f"{js.size} frames, {dsts.size} destinations")
    if starts[0] != 0 or starts[-1] != js.size:
        raise ValueError(f"group starts {starts[:4]}...{starts[-2:]} do not tile the {js.size} requests")
    check_array("status", status, ndim=1, min_size=n, contiguous=False)
    plain = (len(into) in (1, 2) and frame_nbytes >= 0 and starts.dtype == js.dtype == dsts.dtype == np.int64
             and dsts.ndim == 1)
    if plain:
        (lo0, hi0), (lo1, hi1) = span(into[0], "the buffer dsts points into"), span(into[-1], "the buffer dsts points into")
        if _frame_requests_fit(starts, js, run_rows, dsts, frame_nbytes, lo0, hi0, lo1, hi1):
            return
    if (np.diff(starts) < 0).any():
        raise ValueError(f"group starts {starts[:4]}...{starts[-2:]} do not tile the {js.size} requests")
    check_indices("js", js, 0, run_rows)
    check_addresses("dsts", dsts, frame_nbytes, into)


def checked_decode_frame_groups(src, sizes, starts, js, dsts, frame_nbytes, run_rows, status, into,
                                verified: bool = False) -> int:
    """``decode_frame_groups`` after ``check_frame_decodes`` (and the linking self-test); ``verified``: the
    chunks' checksums matched when their bytes came in (see the module invariant)."""
    check_frame_decodes(src, sizes, starts, js, dsts, frame_nbytes, run_rows, status, into)
    ensure_linked()
    return decode_frame_groups(src, sizes, starts, js, dsts, frame_nbytes, run_rows, status, bool(verified))


def checked_group_frame_requests(ids, dsts, ring_rows, run_rows):
    """``group_frame_requests`` after checking its inputs (it writes only the arrays it returns)."""
    if ids.ndim != 1 or dsts.shape != ids.shape or ids.dtype != np.int64 or dsts.dtype != np.int64:
        raise ValueError(f"frame requests: ids {ids.dtype}{ids.shape} and dsts {dsts.dtype}{dsts.shape} must be "
                         "int64 vectors of one length")
    if run_rows < 1 or ring_rows < 0 or (ids.size and ids.min() < 0):
        raise ValueError(f"frame requests: run_rows {run_rows} (>= 1), ring_rows {ring_rows} (>= 0), ids >= 0")
    return group_frame_requests(ids, dsts, ring_rows, run_rows)


def checked_stack_frame_requests(obs_ids, next_ids, shifted: bool, obs_addr: int, next_addr: int, nbytes: int):
    """``stack_frame_requests`` after checking the two stacks are one ``(n, k)`` of integers (it reads them
    whole and writes only the arrays it returns; the addresses are checked where they are decoded to)."""
    if obs_ids.ndim != 2 or next_ids.shape != obs_ids.shape or obs_ids.dtype.kind not in "iu" \
            or next_ids.dtype.kind not in "iu":
        raise ValueError(f"stacks of frame ids: obs {obs_ids.dtype}{obs_ids.shape} and next "
                         f"{next_ids.dtype}{next_ids.shape} must be integers of one shape (n, k)")
    return stack_frame_requests(obs_ids, next_ids, bool(shifted), obs_addr, next_addr, nbytes)


def checked_locate_chunks(chunk_addr, chunk_size, chunks):
    """``locate_chunks`` after checking the tier's index is two int64 vectors of one length (it reads inside
    them only, and writes only the arrays it returns)."""
    if chunk_addr.ndim != 1 or chunk_size.shape != chunk_addr.shape or chunks.ndim != 1 \
            or not chunk_addr.dtype == chunk_size.dtype == chunks.dtype == np.int64:
        raise ValueError(f"tier index: addresses {chunk_addr.dtype}{chunk_addr.shape}, sizes "
                         f"{chunk_size.dtype}{chunk_size.shape} and chunks {chunks.dtype}{chunks.shape} must be "
                         "int64 vectors, the index's two of one length")
    return locate_chunks(chunk_addr, chunk_size, chunks)


def checked_copy_rows_to(source: np.ndarray, rows, row_nbytes, dsts, into) -> None:
    """``copy_rows_to`` from the rows of ``source`` (C-contiguous) after checking each row is inside it and
    each destination has ``row_nbytes`` of room in ``into``."""
    lo, hi = span(source, "source")
    check_indices("rows", rows, 0, (hi - lo) // max(1, row_nbytes))
    check_addresses("dsts", dsts, row_nbytes, into)
    copy_rows_to(lo, rows, row_nbytes, dsts)


def checked_decode_chunks(src, sizes, dst, copies, nbytes, codec, status, into, verified: bool = False) -> int:
    """``decode_chunks`` after ``check_decodes`` (and, at the first call, the linking self-test); the
    number of failed chunks. ``verified``: as ``checked_decode_frame_groups``'."""
    check_decodes(src, sizes, dst, copies, nbytes, codec, status, into)
    ensure_linked()
    return decode_chunks(src, sizes, dst, copies, nbytes, codec, status, bool(verified))


def checked_verify_chunks(buffer: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Which chunks (``sizes[i]`` bytes at ``offsets[i]`` of ``buffer``, checksum included) end with the crc32c
    of their other bytes, in one compiled pass (``chunk_decode.verify_chunks``), after checking each lies inside
    ``buffer``: the check the compressed tier makes once, as it installs a shard."""
    lo, hi = span(buffer, "buffer")
    offsets, sizes = np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    if offsets.shape != sizes.shape or offsets.ndim != 1:
        raise ValueError(f"chunk offsets {offsets.shape} and sizes {sizes.shape}: expected two vectors of one length")
    if offsets.size and ((offsets < 0).any() or (sizes < 0).any() or (sizes > (hi - lo) - offsets).any()):
        raise ValueError(f"chunks outside the {hi - lo}-byte buffer: offsets {offsets[:4]}..., sizes {sizes[:4]}...")
    ensure_linked()
    ok = np.zeros(offsets.size, dtype=np.bool_)
    verify_chunks(lo + offsets, sizes, ok)
    return ok


def _check_stack_outputs(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, chunk_addr, chunk_size) -> int:
    """The number of decodes of a batch's stacks, after checking the outputs have room for ``n * k``
    frames of ``nbytes`` each and the chunk table's sizes cover its addresses."""
    if obs_ids.ndim != 2 or next_ids.shape != obs_ids.shape:
        raise ValueError(f"frame ids of shapes {obs_ids.shape} and {next_ids.shape} (expected the same (n, k))")
    n, k = obs_ids.shape
    for name, out in (("obs_out", obs_out), ("next_out", next_out)):
        lo, hi = span(out, name)
        if hi - lo < n * k * nbytes:
            raise ValueError(f"{name} holds {hi - lo} bytes, {n} stacks of {k} frames of {nbytes} bytes need "
                             f"{n * k * nbytes}; nothing was written")
    if chunk_size.size < chunk_addr.size:
        raise ValueError(f"a chunk table of {chunk_addr.size} addresses but {chunk_size.size} sizes")
    return n * k + (n if shifted else n * k)


class StackPlan(NamedTuple):
    """A batch's stack decodes as ``checked_plan_stack_decodes`` made them (and only it makes them): outputs
    checked to hold the batch, every destination and copy computed by the compiled plan from their bases,
    so they lie inside them and decoding the plan needs no second address check (``checked_decode_plan``,
    ``CodecHelpers.decode_plan``). ``absent``: frames whose chunk is not held (then the plan is not run)."""
    rows: np.ndarray
    src: np.ndarray
    sizes: np.ndarray
    dst: np.ndarray
    copies: np.ndarray
    absent: int
    nbytes: int


def checked_plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                               chunk_size) -> StackPlan:
    """``plan_stack_decodes`` for outputs checked to hold the batch (its destinations then lie inside them):
    the types here, the sizes in the compiled call; a fault is named by ``_check_stack_outputs``."""
    if _plain_stacks(obs_ids, next_ids, obs_out, next_out):
        planned = _plan_stack_decodes_checked(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows,
                                              chunk_addr, chunk_size)
        if planned[-1] != -2:
            return StackPlan(*planned, nbytes)
    _check_stack_outputs(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, chunk_addr, chunk_size)
    return StackPlan(*plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows,
                                         chunk_addr, chunk_size), nbytes)


def check_plan(plan: StackPlan, codec, status) -> None:
    """A plan to decode: made by ``checked_plan_stack_decodes`` with every chunk held, a known codec, and a
    status entry a decode (its addresses need no check: see ``StackPlan``)."""
    if type(plan) is not StackPlan:
        raise TypeError(f"a StackPlan from checked_plan_stack_decodes expected, got {type(plan).__name__}")
    if plan.absent:
        raise ValueError(f"the plan has {plan.absent} frames whose chunk is not held: nothing to decode them from")
    check_array("status", status, ndim=1, min_size=plan.src.size, contiguous=False)
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is none of the compiled decoder's {CODECS}")


def checked_decode_plan(plan: StackPlan, codec, status, verified: bool = False) -> int:
    """``decode_chunks`` of a checked plan (``check_plan``); the number of failed chunks. ``verified``: as
    ``checked_decode_frame_groups``'."""
    check_plan(plan, codec, status)
    ensure_linked()
    return decode_chunks(plan.src, plan.sizes, plan.dst, plan.copies, plan.nbytes, codec, status, bool(verified))


@numba.njit(cache=True, nogil=True)
def _outputs_fit(obs_ids, next_ids, obs_out, next_out, nbytes, chunk_addr, chunk_size):  # pragma: no cover
    """What ``_check_stack_outputs`` checks, compiled: the outputs are C-contiguous and hold the batch."""
    n, k = obs_ids.shape
    return (next_ids.shape == obs_ids.shape and nbytes >= 0 and obs_out.flags.c_contiguous
            and next_out.flags.c_contiguous and obs_out.nbytes >= n * k * nbytes
            and next_out.nbytes >= n * k * nbytes and chunk_size.size >= chunk_addr.size)


@numba.njit(cache=True, nogil=True)
def _plan_stack_decodes_checked(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                                chunk_size):  # pragma: no cover (compiled)
    """``plan_stack_decodes`` if the outputs hold the batch (``_outputs_fit``), else ``absent == -2``."""
    if not _outputs_fit(obs_ids, next_ids, obs_out, next_out, nbytes, chunk_addr, chunk_size):
        none = np.empty(0, dtype=np.int64)
        return none, none, none, none, none, -2
    return plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                              chunk_size)


@numba.njit(cache=True, nogil=True)
def _decode_stacks_checked(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                           chunk_size, codec, status, verified):  # pragma: no cover (compiled)
    """``stack_plan.decode_stacks`` if the checks of ``checked_decode_stacks`` pass (they are tested here, in the one
    compiled call a batch makes), else ``(-2, rows)`` and nothing written: the entry point then names the
    fault."""
    n, k = obs_ids.shape
    total = n * k + (n if shifted else n * k)
    if not (_outputs_fit(obs_ids, next_ids, obs_out, next_out, nbytes, chunk_addr, chunk_size)
            and status.size >= total and (codec == CODEC_BLOSC or codec == CODEC_ZSTD or codec == CODEC_TEMPORAL)):
        return -2, np.empty(0, dtype=np.int64)
    return stack_plan.decode_stacks(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                                    chunk_size, codec, status, verified)


_I64 = np.dtype(np.int64)


def _plain_stacks(obs_ids, next_ids, obs_out, next_out) -> bool:
    """The types the compiled checks take, in one expression (this runs every batch): 2-D int64 frame ids
    and numpy outputs (their layout and sizes are tested in the compiled call)."""
    return (type(obs_ids) is type(next_ids) is type(obs_out) is type(next_out) is np.ndarray
            and obs_ids.dtype == _I64 and next_ids.dtype == _I64 and obs_ids.ndim == 2 and next_ids.ndim == 2)


def checked_decode_stacks(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                          chunk_size, codec, status, verified: bool = False):
    """``decode_stacks`` after checking the outputs hold the batch and ``status`` has an entry a decode.
    The types are tested here, the sizes inside the compiled call; a fault is then named by the checks
    below. ``verified``: as ``checked_decode_frame_groups``'."""
    verified = bool(verified)
    if (_plain_stacks(obs_ids, next_ids, obs_out, next_out) and type(status) is np.ndarray and status.ndim == 1
            and type(codec) is int):
        ensure_linked()
        bad, rows = _decode_stacks_checked(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows,
                                           chunk_addr, chunk_size, codec, status, verified)
        if bad != -2:
            return bad, rows
    total = _check_stack_outputs(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, chunk_addr, chunk_size)
    check_array("status", status, ndim=1, min_size=total, contiguous=False)
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is none of the compiled decoder's {CODECS}")
    ensure_linked()
    return stack_plan.decode_stacks(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                                    chunk_size, codec, status, verified)

