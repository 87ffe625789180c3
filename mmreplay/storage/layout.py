"""Where every array lives in a store directory and how it is chunked.

Invariant: the directory is a standard zarr v3 group; each array here is a sharded zarr array whose
metadata (``zarr.json``) is written by zarr itself, so ``zarr.open_group(path)`` reads everything.
Shard ``s`` of an array covers rows ``[s * shard_rows, (s + 1) * shard_rows)`` and is the file
``<array>/c/<s>/0/...`` (zarr's default chunk key encoding).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from mmreplay.columns.spec import ColumnSpec
from mmreplay.storage.codecs import zarr_compressor

FRAMES_GROUP = "frames"
TRANSITIONS_GROUP = "transitions"
INDEX_CODEC = {"name": "blosc", "cname": "lz4", "clevel": 5}


@dataclass(frozen=True)
class ArrayLayout:
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
            with open(path, "rb") as f:
                meta = json.loads(f.read(1 << 20))
        except FileNotFoundError:
            return [f"array {self.path!r}: {path} is missing"]
        except (OSError, ValueError) as exc:
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
