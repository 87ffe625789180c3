"""Checks that run before a kernel writes through raw addresses or into a caller's arrays.

Invariant: each ``check_*`` returns only if every write the guarded kernel will make lands inside the
buffers it names (or the array entries it writes exist); otherwise it raises ``ValueError`` naming the
values and what was expected, before anything is written. numba does not check indices and a raw address
is not checked by anything, so a wrong size computed in Python would otherwise overwrite memory that
belongs to something else.

Cost: O(1) shape and dtype tests per call, and one compiled read-only pass over an address or index
array (about a nanosecond an entry) where an entry can be anything, so the checks stay off the profile
of a batch (a batch-32 Atari draw decodes 160 chunks).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _first_outside(addrs, nbytes, skip_zero, lo0, hi0, lo1, hi1):  # pragma: no cover (compiled)
    """The first ``i`` whose ``[addrs[i], addrs[i] + nbytes)`` lies in neither ``[lo0, hi0)`` nor
    ``[lo1, hi1)`` (an address 0 passes when ``skip_zero``), or -1."""
    for i in range(addrs.size):
        a = addrs[i]
        if skip_zero and a == 0:
            continue
        if lo0 <= a and a + nbytes <= hi0:
            continue
        if lo1 <= a and a + nbytes <= hi1:
            continue
        return i
    return -1


@numba.njit(cache=True, nogil=True)
def _first_out_of_range(values, lo, hi):  # pragma: no cover (compiled)
    """The first ``i`` (in C order) with ``values.flat[i]`` outside ``[lo, hi)``, or -1."""
    flat = values.reshape(-1)
    for i in range(flat.size):
        if not lo <= flat[i] < hi:
            return i
    return -1


@numba.njit(cache=True, nogil=True)
def _data_address(buffer):  # pragma: no cover (compiled)
    return buffer.ctypes.data


def address_of(buffer: np.ndarray) -> int:
    """The address of ``buffer``'s first byte: ``buffer.ctypes.data`` in ~0.3 us instead of ~1.5 us (that
    attribute builds a helper object each time, and a batch asks for several)."""
    if buffer.dtype in _UNTYPED:
        return buffer.ctypes.data
    try:
        return _data_address(buffer)
    except Exception:  # noqa: BLE001 - numba fails a dtype it cannot compile in several ways (typing, lowering)
        _UNTYPED.add(buffer.dtype)  # (float16, structured, non-native byte order): asked once
        return buffer.ctypes.data


_UNTYPED: set = set()  # dtypes ``_data_address`` could not be compiled for


def span(buffer: np.ndarray, name: str) -> tuple[int, int]:
    """``[start, end)`` of a C-contiguous array's memory (a strided view's gaps belong to other data)."""
    if not isinstance(buffer, np.ndarray) or not buffer.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous numpy array (its memory is written through raw "
                         f"addresses), got {type(buffer).__name__}"
                         f"{'' if not isinstance(buffer, np.ndarray) else ' with strides ' + str(buffer.strides)}")
    start = address_of(buffer)
    return start, start + buffer.nbytes


def check_addresses(name: str, addrs: np.ndarray, nbytes: int, buffers, allow_zero: bool = False) -> None:
    """Every ``addrs[i]`` (int64 addresses; 0 skipped when ``allow_zero``) has ``nbytes`` bytes inside one
    of ``buffers`` (one or two C-contiguous arrays)."""
    check_array(name, addrs, np.int64, ndim=1, contiguous=False)
    if nbytes < 0:
        raise ValueError(f"{name}: a write of {nbytes} bytes (expected >= 0)")
    spans = [span(b, f"the buffer {name} points into") for b in buffers]
    if not 1 <= len(spans) <= 2:
        raise ValueError(f"{name}: addresses are checked against one or two buffers, got {len(spans)}")
    lo1, hi1 = spans[-1]
    i = _first_outside(addrs, np.int64(nbytes), allow_zero, spans[0][0], spans[0][1], lo1, hi1)
    if i >= 0:
        where = ", ".join(f"[{lo:#x}, {hi:#x})" for lo, hi in spans)
        raise ValueError(f"{name}[{i}] = {int(addrs[i]):#x}: its {nbytes} bytes fall outside the destination "
                         f"buffer{'s' if len(spans) > 1 else ''} {where}; nothing was written")


def check_indices(name: str, values: np.ndarray, lo: int, hi: int) -> None:
    """Every entry of ``values`` (an integer array) is in ``[lo, hi)``."""
    if values.size == 0:
        return
    i = _first_out_of_range(np.ascontiguousarray(values), lo, hi)
    if i >= 0:
        bad = values.reshape(-1)[i].item()
        raise ValueError(f"{name} holds {bad!r} at flat position {i}, outside [{lo}, {hi}); nothing was written")


def check_array(name: str, arr, dtype=None, ndim: int | None = None, min_size: int | None = None,
                shape: tuple | None = None, contiguous: bool = True) -> None:
    """``arr`` is a numpy array of ``dtype`` (when given), ``ndim`` dimensions, at least ``min_size``
    entries / exactly ``shape`` (``None`` in it: any), C-contiguous unless ``contiguous`` is False."""
    if (type(arr) is np.ndarray and (dtype is None or arr.dtype == dtype) and (ndim is None or arr.ndim == ndim)
            and (min_size is None or arr.size >= min_size) and (not contiguous or arr.flags.c_contiguous)
            and (shape is None or _shape_matches(arr.shape, shape))):
        return  # the common case in a few attribute reads (this runs several times a batch); else name the fault
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)}, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    if shape is not None and (len(shape) != arr.ndim or
                              any(s is not None and s != a for s, a in zip(shape, arr.shape))):
        raise ValueError(f"{name} must have shape {tuple('any' if s is None else s for s in shape)}, got {arr.shape}")
    if min_size is not None and arr.size < min_size:
        raise ValueError(f"{name} has {arr.size} entries, the kernel writes {min_size}")
    if contiguous and not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got strides {arr.strides} for shape {arr.shape}")


def _shape_matches(actual: tuple, wanted: tuple) -> bool:
    if len(actual) != len(wanted):
        return False
    for w, a in zip(wanted, actual):
        if w is not None and w != a:
            return False
    return True
