"""A store's static metadata: validation of what ``zarr.json`` says, and the ring geometry.

Invariant: ``read_meta`` returns only metadata whose schema parses, whose format version this mmreplay
reads, and whose ring sizes are sane multiples of their shard sizes; anything else is ``FormatError``
(or ``NotAStoreError`` when the directory is no mmreplay store at all), before any array is touched.
"""

from __future__ import annotations

import json
import os

import numpy as np

from mmreplay.columns.spec import Schema
from mmreplay.errors import FormatError, NotAStoreError
from mmreplay.storage.commit import check_version

FRAME_SHARD_TARGET_BYTES = 8 << 20
UNBOUNDED_TRANSITION_SHARD = 16384


def validate_capacity(value, name: str) -> int | None:
    if value is None and name in ("capacity", "frame_capacity"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if name == 'capacity' else ''}, "
                         f"got {value!r}")
    return int(value)


def plan_geometry(schema: Schema, capacity: int | None, frame_capacity: int | None) -> dict:
    """Shard and ring sizes. Each ring has one shard more than it needs so that giving up the shard being
    overwritten never drops a transition within ``capacity``."""
    row_bytes = sum(max(1, s.row_nbytes) for s in schema.observations)
    if capacity is None:
        t_shard = UNBOUNDED_TRANSITION_SHARD
        f_shard = _pow2_clamp(FRAME_SHARD_TARGET_BYTES // row_bytes, 64, 65536)
        return {"capacity": None, "transition_rows": t_shard, "transition_shard_rows": t_shard,
                "frame_rows": f_shard, "frame_shard_rows": f_shard}
    t_shard = _pow2_clamp(capacity // 16, 64, 65536)
    frames = frame_capacity or capacity + capacity // 8 + 64
    f_shard = _pow2_clamp(min(FRAME_SHARD_TARGET_BYTES // row_bytes, frames // 8), 8, 65536)
    f_shard = max(f_shard, max(s.chunk_rows for s in schema.observations))
    return {"capacity": capacity, "transition_rows": _round_up(capacity, t_shard) + t_shard,
            "transition_shard_rows": t_shard, "frame_rows": _round_up(frames, f_shard) + f_shard,
            "frame_shard_rows": f_shard}


def read_meta(path: str) -> dict:
    zarr_json = os.path.join(path, "zarr.json")
    if not os.path.isdir(path):
        raise NotAStoreError(f"no store at {path!r}: not a directory")
    try:
        with open(zarr_json, "rb") as f:
            group = json.loads(f.read(1 << 24))
    except FileNotFoundError:
        raise NotAStoreError(f"{path!r} is not an mmreplay store (no zarr.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{zarr_json}: not valid JSON ({exc})") from None
    meta = group.get("attributes", {}).get("mmreplay") if isinstance(group, dict) else None
    if not isinstance(meta, dict):
        raise NotAStoreError(f"{path!r} is a zarr group but not an mmreplay store (no 'mmreplay' attributes)")
    check_version(meta.get("format_version"), zarr_json)
    try:
        Schema.from_json(meta.get("schema"))
    except (ValueError, TypeError) as exc:
        raise FormatError(f"{zarr_json}: invalid schema: {exc}") from None
    cap = meta.get("capacity")
    if cap is not None and (not isinstance(cap, int) or cap < 1):
        raise FormatError(f"{zarr_json}: capacity must be a positive integer or null, got {cap!r}")
    for name in ("transition_rows", "transition_shard_rows", "frame_rows", "frame_shard_rows"):
        v = meta.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or not 8 <= v <= 1 << 40:
            raise FormatError(f"{zarr_json}: {name} must be an integer in [8, 2**40], got {v!r}")
    if meta["transition_shard_rows"] % 8 or meta["transition_rows"] % meta["transition_shard_rows"] \
            or meta["frame_rows"] % meta["frame_shard_rows"]:
        raise FormatError(f"{zarr_json}: ring rows must be multiples of their shard rows (and of 8)")
    return meta


def _pow2_clamp(value: int, lo: int, hi: int) -> int:
    value = max(lo, min(hi, int(value)))
    return 1 << (value.bit_length() - 1)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
