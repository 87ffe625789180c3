"""Bounds on what an import reads: a dataset file is checked before anything of it is allocated.

Invariants:
- Every array an importer reads (an HDF5 dataset, a ``.npy`` header) is checked first: a numeric or bool
  dtype, at most ``MAX_ROWS`` rows, rows of at most ``MAX_ROW_BYTES``, and, where the format says how much
  of it is stored, that it is all there: a contiguous HDF5 dataset must fit inside the file, a chunked one
  must have every chunk written (HDF5 reads an unwritten chunk as its fill value, so a 46 KB file can
  declare 12 GB of frames). A ``.npy`` array must fit in its file (``check_array`` with ``stored_bytes``).
- Reads go in blocks of at most ``BLOCK_BYTES`` (``block_rows_for``; at least one row), whatever the rows'
  size, so an import's memory is bounded by the budget, not by the dataset.
- Errors name the file, the dataset, its shape and dtype, and the limit it breaks.
"""

from __future__ import annotations

import os

import numpy as np

#: bytes one import block holds at most (all the columns read together), unless a single row is larger
BLOCK_BYTES = 64 << 20
#: a row (one observation, one action...) larger than this is taken for a malformed file
MAX_ROW_BYTES = 256 << 20
#: one episode a reader must load whole (Minari's ``iterate_episodes``) may hold at most this many bytes
MAX_EPISODE_BYTES = 4 << 30
#: more rows than this is taken for a malformed file (2^40: a trillion steps)
MAX_ROWS = 1 << 40
#: kinds of dtypes a dataset column may have: bool, signed / unsigned integers, floats
NUMERIC_KINDS = "biuf"


def row_nbytes(shape: tuple[int, ...], dtype) -> int:
    """Bytes of one row (``shape`` without the leading row axis)."""
    return int(np.dtype(dtype).itemsize) * int(np.prod(shape, dtype=object))


def check_array(what: str, shape: tuple[int, ...], dtype, *, stored_bytes: int | None = None) -> int:
    """Check an array of ``shape`` (rows first) and ``dtype`` against the bounds; ``stored_bytes``: how many
    bytes of it the file really holds, when the format says (uncompressed data). Returns the row size."""
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    described = f"{what} of shape {shape} and dtype {dtype}"
    if dtype.kind not in NUMERIC_KINDS or dtype.fields is not None:
        raise ValueError(f"{described}: expected a bool, integer or float dtype")
    if not shape:
        return int(dtype.itemsize)
    if any(d < 0 for d in shape):
        raise ValueError(f"{described}: negative dimension")
    if shape[0] > MAX_ROWS:
        raise ValueError(f"{described}: {shape[0]:,} rows, more than the {MAX_ROWS:,} an import accepts")
    row = row_nbytes(shape[1:], dtype)
    if row > MAX_ROW_BYTES:
        raise ValueError(f"{described}: one row is {row:,} bytes, more than the {MAX_ROW_BYTES:,} an import "
                         "accepts (a malformed or hostile file?)")
    if stored_bytes is not None and shape[0] * row > stored_bytes:
        raise ValueError(f"{described}: declares {shape[0] * row:,} bytes but the file holds {stored_bytes:,} "
                         "of them (truncated, or never written)")
    return row


def check_hdf5_dataset(ds, what: str) -> int:
    """``check_array`` for an h5py dataset, with what HDF5 says is stored: a contiguous dataset's storage
    must lie inside the file; a chunked one must have all its chunks written. Returns the row size."""
    described = f"{what} ({ds.name!r} of shape {tuple(ds.shape)} and dtype {ds.dtype})"
    if ds.shape is None:
        raise ValueError(f"{described}: an empty (null) dataspace, expected an array")
    row = check_array(what, ds.shape, ds.dtype)
    declared = int(np.prod(ds.shape, dtype=object)) * int(ds.dtype.itemsize)
    if declared == 0:
        return row
    if ds.chunks is None:
        _check_contiguous(ds, described, declared)
    else:
        _check_chunks_written(ds, described)
    return row


def _check_contiguous(ds, described: str, declared: int) -> None:
    stored = int(ds.id.get_storage_size())
    offset = ds.id.get_offset()
    file_size = _file_size(ds)
    if stored < declared or offset is None:
        raise ValueError(f"{described}: declares {declared:,} bytes but the file holds {stored:,} of them "
                         "(never written, or truncated)")
    if file_size is not None and offset + declared > file_size:
        raise ValueError(f"{described}: its {declared:,} bytes at offset {offset:,} reach past the end of the "
                         f"file ({file_size:,} bytes): truncated")


def _file_size(ds) -> int | None:
    """The size of the file holding ``ds`` on disk (None for in-memory or multi-file drivers)."""
    try:
        return os.path.getsize(ds.file.filename) if ds.file.driver in ("sec2", "stdio") else None
    except OSError:
        return None


def _check_chunks_written(ds, described: str) -> None:
    expected = 1
    for size, chunk in zip(ds.shape, ds.chunks):
        expected *= -(-int(size) // int(chunk))
    written = int(ds.id.get_num_chunks())
    if written < expected:
        raise ValueError(f"{described}: only {written:,} of its {expected:,} chunks were ever written (HDF5 "
                         "would read the rest as fill values): a malformed or incomplete file")


def block_rows_for(row_bytes: int, block_rows: int | None = None, budget: int = BLOCK_BYTES) -> int:
    """Rows per read block for rows of ``row_bytes`` (every column read together): at most ``budget``
    bytes and at most ``block_rows`` (a caller's cap), at least one row."""
    rows = max(1, budget // max(1, int(row_bytes)))
    return int(max(1, min(rows, block_rows))) if block_rows else int(rows)
