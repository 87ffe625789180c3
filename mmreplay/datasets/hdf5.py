"""HDF5 settings every HDF5 exporter shares (Minari's HDF5 layout, D4RL-style, d3rlpy): compression and
chunk sizes.

Invariant: every choice here is lossless and readable by any h5py/HDF5 build without plugins. ``gzip``
(deflate) and ``lzf`` are HDF5's built-in filters (h5py ships lzf); the byte-shuffle filter in front of
them is lossless too and is what makes float columns compress. Readers (``minari.load_dataset``,
D4RL's ``qlearning_dataset``, d3rlpy's ``ReplayBuffer.load``) decode them transparently. Files use the
HDF5 1.10 object format (``LIBVER``; every h5py wheel since 2018 reads it): its chunk indexes cost
~0.4 KB per dataset instead of ~2.2 KB, which matters for datasets of many short episodes (a dataset
per column per episode).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: accepted ``compression`` values; ``gzip`` is the default (best ratio of the built-in filters)
COMPRESSIONS = ("gzip", "lzf", "none")
DEFAULT_COMPRESSION = "gzip"
#: gzip level: 4 is h5py's default; higher levels cost much more time for ~1-3% on frames
GZIP_LEVEL = 4
#: target bytes of one chunk: large enough for the compressor to see repetition across frames, small
#: enough that a reader decoding one row does not decode megabytes
CHUNK_BYTES = 256 << 10


#: HDF5 object format: 1.10's chunk indexes (fixed/extensible arrays) instead of 1.8's B-trees
LIBVER = ("v110", "latest")


def h5py_module():
    try:
        import h5py
    except ImportError:
        raise ImportError("HDF5 export/import needs h5py; pip install 'mmreplay[d4rl]'") from None
    return h5py


def check_compression(compression: str | None) -> str:
    """``None`` -> the default; anything else must be one of ``COMPRESSIONS``."""
    if compression is None:
        return DEFAULT_COMPRESSION
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown HDF5 compression {compression!r}: expected one of {list(COMPRESSIONS)}")
    return compression


def filters(compression: str | None) -> dict[str, Any]:
    """``create_dataset`` keyword arguments for ``compression`` (see ``COMPRESSIONS``)."""
    compression = check_compression(compression)
    if compression == "none":
        return {}
    if compression == "gzip":
        return {"compression": "gzip", "compression_opts": GZIP_LEVEL, "shuffle": True}
    return {"compression": "lzf", "shuffle": True}


def chunk_rows(shape: tuple[int, ...], dtype, cap: int) -> int:
    """Rows per chunk for rows of ``shape``/``dtype``: about ``CHUNK_BYTES``, at most ``cap`` (the block
    or the episode length: HDF5 stores partial chunks whole, so a chunk longer than the data wastes
    space when uncompressed)."""
    row = max(1, np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)))
    return int(max(1, min(cap, CHUNK_BYTES // row)))


def resizable(group, name: str, shape: tuple[int, ...], dtype, cap: int, compression: str | None):
    """An empty dataset of rows of ``shape`` that grows along axis 0, chunked and filtered."""
    shape = tuple(shape)
    return group.create_dataset(name, (0, *shape), dtype=dtype, maxshape=(None, *shape),
                                chunks=(chunk_rows(shape, dtype, cap), *shape), **filters(compression))


def fixed(group, name: str, rows: int, shape: tuple[int, ...], dtype, compression: str | None):
    """An empty dataset of exactly ``rows`` rows of ``shape`` (the size is known, e.g. an episode's):
    chunked and filtered when compressed, contiguous (no chunk index at all) when not."""
    shape = tuple(shape)
    kwargs = filters(compression)
    if kwargs and rows > 0:
        kwargs["chunks"] = (chunk_rows(shape, dtype, rows), *shape)
    return group.create_dataset(name, (rows, *shape), dtype=dtype, **kwargs)


def append(dataset, values: np.ndarray) -> None:
    n = dataset.shape[0]
    dataset.resize(n + values.shape[0], axis=0)
    dataset[n:] = np.ascontiguousarray(values)
