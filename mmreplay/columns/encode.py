"""Validate user values and map them to what is stored (codes for packed columns).

Invariants:
- ``encode`` either returns arrays that can be stored as they are, or raises ValueError naming the column,
  the offending value and what was expected — before anything is written. What it accepts is the column's
  dtype narrowed by the declared space (``declared_bounds``: a ``Discrete(n, start)``, ``MultiDiscrete``
  or ``MultiBinary`` action holds only the integers of the space), never a rounded or wrapped value.
- ``scalar_code`` (the single-add fast path) is a screen in front of ``encode``, not a second validation:
  for a scalar it returns what ``encode`` would store, or None, and then ``encode`` decides (and raises).
  It accepts only value types whose stored value cannot differ from ``encode``'s.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from mmreplay.columns.spec import ColumnSpec, Schema

_INT_TYPES = frozenset((int, bool, np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                        np.uint64))
_FLOAT_TYPES = frozenset((float, np.float32, np.float64))
_NUMBER_TYPES = _INT_TYPES | _FLOAT_TYPES


def encoders_for(schema: Schema) -> dict[str, ColumnEncoder]:
    """The encoder of every per-transition column, each narrowed to what the store's spaces declare."""
    return {c.name: ColumnEncoder(c, declared_bounds(c, schema.action_space) if c is schema.action else None)
            for c in schema.transition_columns}


def declared_bounds(spec: ColumnSpec, space: Mapping[str, Any] | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Inclusive (low, high) of the integers an integer column made from ``space`` (its JSON form) may hold,
    broadcast to the column's shape; None where the space adds nothing to the dtype (Box, a float or
    packed column, a column overridden with another shape, no space recorded)."""
    if spec.kind != "numeric" or spec.np_dtype.kind not in "iu" or not isinstance(space, Mapping):
        return None
    kind = space.get("type")
    try:
        if kind == "Discrete":
            start = int(space.get("start", 0))
            low, high = np.int64(start), np.int64(start + int(space["n"]) - 1)
        elif kind == "MultiDiscrete":
            nvec = np.asarray(space["nvec"], dtype=np.int64)
            low = np.broadcast_to(np.asarray(space.get("start", 0), dtype=np.int64), nvec.shape)
            high = low + nvec - 1
        elif kind == "MultiBinary":
            low, high = np.int64(0), np.int64(1)
        else:
            return None
        return np.broadcast_to(low, spec.shape), np.broadcast_to(high, spec.shape)
    except (KeyError, TypeError, ValueError):  # a space that does not describe this column: the dtype decides
        return None


class ColumnEncoder:
    """Values of one column to what is stored (codes for packed columns, exact casts otherwise) and back."""

    def __init__(self, spec: ColumnSpec, bounds: tuple[np.ndarray, np.ndarray] | None = None):
        """``bounds``: inclusive (low, high) arrays of the column's shape that an integer column's values must
        lie in (``declared_bounds``); without them, the dtype's range."""
        self.spec = spec
        self.dtype = spec.np_dtype
        self.bounds = bounds
        if spec.kind == "packed":
            self.table = np.asarray(spec.values, dtype=np.float64)
            self._order = np.argsort(self.table, kind="stable")
            self._sorted = self.table[self._order]
            self.code_of = {v: c for c, v in enumerate(self.table.tolist())}  # 1 == 1.0 == np.int64(1)
            self.decode_table = np.asarray(spec.values, dtype=self.dtype)
            start = self.table[0]
            # Discrete actions: codes are value - start, no search needed
            self._offset = start if np.array_equal(self.table, start + np.arange(self.table.size)) else None

        self.scalar_code = self._scalar_screen()

    @property
    def int_range(self) -> tuple[int, int]:
        """The smallest and largest integer a scalar integer or bool column accepts."""
        if self.bounds is not None:
            return int(self.bounds[0].min()), int(self.bounds[1].max())
        info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        return (int(info.min), int(info.max)) if info else (0, 1)

    def _scalar_screen(self):
        """``scalar_code(value)``: what ``encode`` stores for one scalar ``value``, or None to let ``encode``
        decide. Python numbers and numpy scalars of the types below only; a few hundred nanoseconds."""
        spec = self.spec
        if spec.shape != ():
            return lambda value: None
        if spec.kind == "packed":
            code_of, types = self.code_of, _NUMBER_TYPES  # 1 == 1.0 == np.float32(1.0) hash alike
            return lambda value: code_of.get(value) if type(value) in types else None
        if self.dtype.kind in "biu":
            lo, hi = self.int_range  # floats, even integral ones, go to encode (it decides 3.0 and 3.5)
            return lambda value: value if type(value) in _INT_TYPES and lo <= value <= hi else None
        # floats: a float in range rounds once, as in encode; an integer only where the dtype holds it exactly
        # (a Python int beyond that rounds twice on assignment: int -> float64 -> float32)
        info = np.finfo(self.dtype)
        # (float64: no limit, and none that a float32 value would overflow to in the comparison)
        top, exact = math.inf if info.bits >= 64 else float(info.max), 1 << (info.nmant + 1)
        return lambda value: value if (type(value) in _FLOAT_TYPES and -top <= value <= top) or (
            type(value) in _INT_TYPES and -exact <= value <= exact) else None

    def encode(self, values: Any, n: int) -> np.ndarray:
        """``n`` rows of this column as stored (uint8 codes when packed)."""
        spec = self.spec
        arr = _as_array(values, spec.name)
        if arr.shape != (n, *spec.shape):
            raise ValueError(f"column {spec.name!r}: expected shape {(n, *spec.shape)} for {n} transition(s), "
                             f"got {arr.shape}")
        if spec.kind == "packed":
            return self._codes(arr)
        if self.bounds is None:
            return cast_exact(arr, self.dtype, spec.name)
        stored = cast_exact(arr, self.dtype, spec.name, self._declared(None))
        self._check_bounds(stored)
        return stored

    def _declared(self, element: tuple | None) -> str:
        """The integers the space declares for one element (None: for the column as a whole)."""
        low, high = self.bounds
        if element is None and low.ndim:
            if (low == low.flat[0]).all() and (high == high.flat[0]).all():
                element = (0,) * low.ndim
            else:
                return f"integers from {low.tolist()} to {high.tolist()} element-wise, as the action space declares"
        return f"integers in [{int(low[element or ()])}, {int(high[element or ()])}], as the action space declares"

    def _check_bounds(self, stored: np.ndarray) -> None:
        low, high = self.bounds
        bad = (stored < low) | (stored > high)
        if bad.any():
            at = np.argwhere(bad)[0]
            element = tuple(int(i) for i in at[1:])
            where = f" at element {element}" if element else ""
            raise ValueError(f"column {self.spec.name!r}: value {stored[tuple(at)].item()!r}{where} is out of range: "
                             f"expected {self._declared(element)}")

    def _codes(self, arr: np.ndarray) -> np.ndarray:
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"column {self.spec.name!r}: expected numbers, got dtype {arr.dtype}")
        flat = arr.astype(np.float64, copy=False).ravel()
        if flat.size == 1:
            code = self.code_of.get(float(flat[0]))
            if code is None:
                self._raise_bad(flat)
            return np.array([code], dtype=np.uint8)
        if self._offset is not None:
            codes = flat - self._offset
            ok = (codes >= 0) & (codes < self.table.size) & (codes == np.floor(codes))
            if not ok.all():
                self._raise_bad(flat[~ok])
            return codes.astype(np.uint8)
        pos = np.minimum(np.searchsorted(self._sorted, flat), self._sorted.size - 1)
        ok = self._sorted[pos] == flat
        if not ok.all():
            self._raise_bad(flat[~ok])
        return self._order[pos].astype(np.uint8)

    def _raise_bad(self, bad: np.ndarray) -> None:
        raise ValueError(f"column {self.spec.name!r}: value {bad[0].item()!r} is not one of the allowed values "
                         f"{list(self.spec.values)} (stored as {self.spec.bits}-bit codes)")

    def decode(self, stored: np.ndarray) -> np.ndarray:
        return self.decode_table[stored] if self.spec.kind == "packed" else stored


def _as_array(values: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"column {name!r}: cannot convert {type(values).__name__} to an array ({exc})") from None
    if arr.dtype == object:
        raise ValueError(f"column {name!r}: values of type {type(values).__name__} are not numeric")
    return arr


def cast_exact(arr: np.ndarray, dtype: np.dtype, name: str, expected: str | None = None) -> np.ndarray:
    """``arr`` as ``dtype``; integer and bool targets must hold every value exactly, float targets every
    finite value as a finite one (1e300 is not stored as inf). ``expected`` describes the values accepted
    in errors (default: the dtype's range)."""
    if arr.dtype == dtype:
        return arr
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"column {name!r}: expected numbers of dtype {dtype}, got dtype {arr.dtype}")
    if dtype.kind in "biu":
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            _raise_unfit(arr.ravel()[~np.isfinite(arr.ravel())][0], dtype, name, expected)
        with np.errstate(invalid="ignore", over="ignore"):
            cast = arr.astype(dtype)
        if not np.array_equal(cast, arr):
            _raise_unfit(arr.ravel()[(cast != arr).ravel()][0], dtype, name, expected)
        return cast
    with np.errstate(over="ignore"):
        cast = arr.astype(dtype)
    if arr.dtype.kind in "iu" or arr.dtype.itemsize > dtype.itemsize:
        overflow = np.isinf(cast) & ~np.isinf(arr)
        if overflow.any():
            bad = arr.ravel()[overflow.ravel()][0].item()
            raise ValueError(f"column {name!r}: value {bad!r} is out of range for dtype {dtype} (expected finite "
                             f"values within +-{float(np.finfo(dtype).max):.6g})")
    return cast


def _raise_unfit(bad: np.generic, dtype: np.dtype, name: str, expected: str | None) -> None:
    if expected is None:
        expected = f"integers in [{np.iinfo(dtype).min}, {np.iinfo(dtype).max}]" if dtype.kind in "iu" else \
            "0/1 or True/False"
    raise ValueError(f"column {name!r}: value {bad.item()!r} does not fit dtype {dtype} (expected {expected})")


def encode_flags(values: Any, n: int, name: str) -> np.ndarray:
    arr = _as_array(values, name)
    if arr.shape != (n,):
        raise ValueError(f"{name}: expected shape {(n,)} for {n} transition(s), got {arr.shape}")
    if arr.dtype != np.bool_:
        if arr.dtype.kind not in "biuf" or not np.all((arr == 0) | (arr == 1)):
            raise ValueError(f"{name}: expected booleans (or 0/1), got {arr.ravel()[:8].tolist()}")
    return arr.astype(np.uint8)
