"""Where every array lives in a store directory, how it is chunked, and how a ring maps ids to rows.

Invariant: the directory is a standard zarr v3 group; each array here is a sharded zarr array whose
metadata (``zarr.json``) is written by zarr itself (only its ``shape`` is grown here, for unbounded
rings), so ``zarr.open_group(path)`` reads everything.
Shard ``s`` of an array covers rows ``[s * shard_rows, (s + 1) * shard_rows)`` and is the file
``<array>/c/<s>/0/...`` (zarr's default chunk key encoding). Both rings (transitions, frames) follow
one ``RingGeometry``: global id ``g`` lives in row ``g % rows`` (bounded) or ``g`` (unbounded, the
arrays grow by doubling), in file shard ``row // shard_rows``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from mmreplay.columns.spec import ColumnSpec
from mmreplay.errors import FormatError
from mmreplay.storage.format.codecs import zarr_compressor
from mmreplay.storage.files import atomic_write, fsync_dir, read_regular

FRAMES_GROUP = "frames"
TRANSITIONS_GROUP = "transitions"
PRIORITIES_GROUP = "priorities"
MAX_ARRAY_META_BYTES = 1 << 20  # an array's zarr.json is under 2 KB
INDEX_CODEC = {"name": "blosc", "cname": "lz4", "clevel": 5}


@dataclass(frozen=True)
class RingGeometry:
    """How one ring lays global ids out in rows and file shards (the one place this is spelled out)."""

    rows: int  # ring size (for an unbounded ring: its current size, which doubles as it fills)
    shard_rows: int
    unbounded: bool = False

    def __post_init__(self) -> None:
        if self.shard_rows < 1 or self.rows < self.shard_rows or self.rows % self.shard_rows:
            raise ValueError(f"ring rows {self.rows} must be a positive multiple of its shard rows {self.shard_rows}")

    @property
    def n_shards(self) -> int:
        return self.rows // self.shard_rows

    def slot(self, g):
        """Row of global id(s) ``g``."""
        return g if self.unbounded else g % self.rows

    def file_shard(self, global_shard):
        """File shard of global shard number(s) ``global_shard`` (``g // shard_rows``)."""
        return global_shard if self.unbounded else global_shard % self.n_shards

    def shards_holding(self, lo: int, hi: int) -> list[int]:
        """File shards holding the rows of global ids ``[lo, hi)``."""
        if hi <= lo:
            return []
        return sorted({int(s) for s in self.file_shard(np.arange(lo // self.shard_rows,
                                                                 (hi - 1) // self.shard_rows + 1))})

    def with_rows(self, rows: int) -> "RingGeometry":
        return RingGeometry(rows, self.shard_rows, self.unbounded)


@dataclass(frozen=True)
class StoreGeometry:
    """What a store *is* in size: its capacity and its two rings. Stored in the root ``zarr.json``
    (``to_meta``); an unbounded store's commit record says how far its rings have grown."""

    capacity: int | None
    transitions: RingGeometry
    frames: RingGeometry

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], record: Mapping[str, Any] | None = None) -> "StoreGeometry":
        rec = record or {}
        unbounded = meta["capacity"] is None
        return cls(meta["capacity"],
                   RingGeometry(rec.get("transition_rows", meta["transition_rows"]), meta["transition_shard_rows"],
                                unbounded),
                   RingGeometry(rec.get("frame_rows", meta["frame_rows"]), meta["frame_shard_rows"], unbounded))

    def to_meta(self) -> dict:
        return {"capacity": self.capacity, "transition_rows": self.transitions.rows,
                "transition_shard_rows": self.transitions.shard_rows, "frame_rows": self.frames.rows,
                "frame_shard_rows": self.frames.shard_rows}


@dataclass(frozen=True)
class ArrayLayout:
    """Where one zarr array of a store lives and how it is chunked and sharded."""

    path: str  # relative to the store root, e.g. "frames/obs"
    rows: int  # length of axis 0 (zarr shape[0])
    row_shape: tuple[int, ...]
    dtype: str  # the stored dtype
    chunk_rows: int
    shard_rows: int
    codec: Mapping[str, Any]
    attributes: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.shard_rows % self.chunk_rows:
            raise ValueError(f"{self.path}: shard_rows {self.shard_rows} is not a multiple of chunk_rows "
                             f"{self.chunk_rows}")

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_rows // self.chunk_rows

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def shard_file(self, root: str, shard: int) -> str:
        key = "/".join(["c", str(shard)] + ["0"] * len(self.row_shape))
        return os.path.join(root, self.path, *key.split("/"))

    def metadata_problems(self, root: str) -> list[str]:
        """What is wrong with this array's ``zarr.json`` (empty: present, an array, sharded, shaped as
        this layout's rows); without it no zarr reader can open the array."""
        path = os.path.join(root, self.path, "zarr.json")
        try:
            meta = json.loads(read_regular(path, MAX_ARRAY_META_BYTES))
        except FileNotFoundError:
            return [f"array {self.path!r}: {path} is missing"]
        except (OSError, ValueError, FormatError) as exc:  # FormatError: a link, FIFO or device (UnsafeEntryError)
            return [f"array {self.path!r}: {path} is unreadable ({exc})"]
        shape = meta.get("shape") if isinstance(meta, dict) else None
        codecs = meta.get("codecs") if isinstance(meta, dict) else None
        if meta.get("node_type") != "array" or not isinstance(shape, list) or not shape or \
                list(shape[1:]) != list(self.row_shape) or \
                not (isinstance(codecs, list) and any(isinstance(c, dict) and c.get("name") == "sharding_indexed"
                                                      for c in codecs)):
            return [f"array {self.path!r}: {path} does not describe a sharded array of rows shaped "
                    f"{tuple(self.row_shape)}"]
        return []

    def create(self, root_group) -> None:
        from zarr.codecs import BytesCodec, Crc32cCodec

        group_name, name = self.path.rsplit("/", 1)
        root_group[group_name].create_array(
            name,
            shape=(self.rows, *self.row_shape),
            chunks=(self.chunk_rows, *self.row_shape),
            shards=(self.shard_rows, *self.row_shape),
            dtype=self.np_dtype,
            serializer=BytesCodec(endian="little") if self.np_dtype.itemsize > 1 else BytesCodec(),
            compressors=[zarr_compressor(self.codec, self.np_dtype), Crc32cCodec()],
            fill_value=0,
            attributes=dict(self.attributes or {}),
        )


def frame_layout(spec: ColumnSpec, rows: int, shard_rows: int) -> ArrayLayout:
    return ArrayLayout(f"{FRAMES_GROUP}/{spec.name}", rows, spec.shape, spec.dtype, spec.chunk_rows, shard_rows,
                       spec.codec)


def transition_layout(name: str, rows: int, shard_rows: int, dtype: str, row_shape=(), bits: int = 0,
                      values=None, codec=INDEX_CODEC) -> ArrayLayout:
    """Per-transition arrays: one inner chunk per shard. Packed columns store ``bits`` per row."""
    if bits:
        # row i of the column is bits [i*bits, (i+1)*bits) counted from each byte's least significant bit
        attrs = {"mmreplay": {"packed_bits": bits, "bit_order": "lsb-first", "values": list(values)}}
        byte_rows, byte_shard = rows * bits // 8, shard_rows * bits // 8
        return ArrayLayout(f"{TRANSITIONS_GROUP}/{name}", byte_rows, (), "uint8", byte_shard, byte_shard, codec, attrs)
    return ArrayLayout(f"{TRANSITIONS_GROUP}/{name}", rows, tuple(row_shape), dtype, shard_rows, shard_rows, codec)


def priority_layout(name: str, buffer: int, rows: int, shard_rows: int) -> ArrayLayout:
    """One of the two buffers of priority set ``name``: float32 per transition slot, one chunk a shard."""
    return ArrayLayout(f"{PRIORITIES_GROUP}/{name}/{buffer}", rows, (), "float32", shard_rows, shard_rows,
                       INDEX_CODEC)


def resize_arrays(root: str, layouts, rows: int) -> None:
    """Unbounded stores: make the zarr metadata of ``layouts`` cover ``rows`` ring rows (packed columns
    hold ``bits`` per row); never shrinks. Growing a zarr array changes only ``shape`` in its ``zarr.json``
    (no chunk moves), so this edits that field itself, atomically, rather than through zarr: zarr's I/O
    runs on its event loop and thread pools, which refuse work once the interpreter began to exit, and an
    unbounded ring may grow in the commit a store makes at exit (see ``storage/durability/forking.py``)."""
    for layout in layouts:
        path = os.path.join(root, layout.path, "zarr.json")
        try:
            meta = json.loads(read_regular(path, MAX_ARRAY_META_BYTES))
        except ValueError as exc:
            raise FormatError(f"{path}: not valid JSON ({exc}), cannot grow {layout.path!r}") from None
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if not isinstance(shape, list) or not shape or not isinstance(shape[0], int) or \
                meta.get("node_type") != "array":
            raise FormatError(f"{path}: not the metadata of a zarr array (expected a 'shape' list), cannot "
                              f"grow {layout.path!r} to {rows} rows")
        bits = (layout.attributes or {}).get("mmreplay", {}).get("packed_bits")
        new_len = rows * bits // 8 if bits else rows
        if new_len > shape[0]:
            meta["shape"] = [new_len, *shape[1:]]
            # durable before any commit names the grown ring (growth doubles: rare, so always fsynced)
            atomic_write(path, json.dumps(meta, indent=2).encode(), root=root, fsync=True)
            fsync_dir(os.path.dirname(path))
