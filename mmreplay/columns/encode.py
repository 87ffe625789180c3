"""Validate user values and map them to what is stored (codes for packed columns).

Invariant: ``encode`` either returns arrays that can be stored as they are, or raises ValueError naming
the column, the offending value and what was expected — before anything is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmreplay.columns.spec import ColumnSpec


class ColumnEncoder:
    """Values of one column to what is stored (codes for packed columns, exact casts otherwise) and back."""

    def __init__(self, spec: ColumnSpec):
        self.spec = spec
        self.dtype = spec.np_dtype
        if spec.kind == "packed":
            self.table = np.asarray(spec.values, dtype=np.float64)
            self._order = np.argsort(self.table, kind="stable")
            self._sorted = self.table[self._order]
            self.code_of = {v: c for c, v in enumerate(self.table.tolist())}  # 1 == 1.0 == np.int64(1)
            self.decode_table = np.asarray(spec.values, dtype=self.dtype)
            start = self.table[0]
            # Discrete actions: codes are value - start, no search needed
            self._offset = start if np.array_equal(self.table, start + np.arange(self.table.size)) else None

    @property
    def int_range(self) -> tuple[int, int]:
        info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        return (int(info.min), int(info.max)) if info else (0, 1)

    def encode(self, values: Any, n: int) -> np.ndarray:
        """``n`` rows of this column as stored (uint8 codes when packed)."""
        spec = self.spec
        arr = _as_array(values, spec.name)
        if arr.shape != (n, *spec.shape):
            raise ValueError(f"column {spec.name!r}: expected shape {(n, *spec.shape)} for {n} transition(s), "
                             f"got {arr.shape}")
        if spec.kind == "packed":
            return self._codes(arr)
        return cast_exact(arr, self.dtype, spec.name)

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


def cast_exact(arr: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """``arr`` as ``dtype``; integer and bool targets must hold every value exactly."""
    if arr.dtype == dtype:
        return arr
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"column {name!r}: expected numbers of dtype {dtype}, got dtype {arr.dtype}")
    if dtype.kind in "biu":
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            raise ValueError(f"column {name!r}: non-finite value in data for integer dtype {dtype}")
        cast = arr.astype(dtype)
        if not np.array_equal(cast, arr):
            bad = arr.ravel()[(cast != arr).ravel()][0].item()
            info = np.iinfo(dtype) if dtype.kind != "b" else None
            expected = f"[{info.min}, {info.max}]" if info else "0/1 or True/False"
            raise ValueError(f"column {name!r}: value {bad!r} does not fit dtype {dtype} (expected integers in "
                             f"{expected})")
        return cast
    return arr.astype(dtype)


def encode_flags(values: Any, n: int, name: str) -> np.ndarray:
    arr = _as_array(values, name)
    if arr.shape != (n,):
        raise ValueError(f"{name}: expected shape {(n,)} for {n} transition(s), got {arr.shape}")
    if arr.dtype != np.bool_:
        if arr.dtype.kind not in "biuf" or not np.all((arr == 0) | (arr == 1)):
            raise ValueError(f"{name}: expected booleans (or 0/1), got {arr.ravel()[:8].tolist()}")
    return arr.astype(np.uint8)
