"""A store's static metadata: validation of what ``zarr.json`` says, and the ring geometry.

Invariant: ``read_meta`` returns only metadata whose schema parses, whose format version this mmreplay
reads, whose ring sizes are sane multiples of their shard sizes, whose frame shards are of a size
mmreplay makes, and whose observation shapes are those of the frame arrays; anything else is
``FormatError`` (or ``NotAStoreError`` when the directory is no mmreplay store at all, saying so when it
holds only what an interrupted ``Store.create`` left), before any array is touched or allocated.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from mmreplay.columns.spec import Schema
from mmreplay.errors import FormatError, NotAStoreError, UnsafeEntryError
from mmreplay.storage.format.codecs import validate_codec
from mmreplay.storage.durability.commit import COMMIT_FILE, check_version
from mmreplay.storage.files import read_regular, remove_contents
from mmreplay.storage.format.layout import FRAMES_GROUP, MAX_ARRAY_META_BYTES, RingGeometry, StoreGeometry

FRAME_SHARD_TARGET_BYTES = 8 << 20
UNBOUNDED_TRANSITION_SHARD = 16384
MAX_ROW_BYTES = 1 << 30  # one observation of more than a GiB is no observation a replay store holds
MAX_FRAMES_PER_TRANSITION = 4  # frame_capacity accepted up to this many per transition (two are ever used)
MIN_CACHE_SLOTS = 64  # reading/cache.py's floor: an open allocates at least this many chunks per column
# plan_geometry makes a frame shard ~8 MiB (at least 8 or 64 rows, or one chunk): staging blocks far larger
# come from edited metadata, and are refused before the writer allocates them from the schema
MAX_STAGING_BYTES = 64 * FRAME_SHARD_TARGET_BYTES
MAX_META_BYTES = 1 << 24  # a store's zarr.json (the schema) is a few KB
ZARR_PARTIAL = re.compile(r"zarr\.[0-9a-f]{32}\.partial")  # zarr's temporary file of a zarr.json being written


def validate_capacity(value, name: str) -> int | None:
    if value is None and name in ("capacity", "frame_capacity"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if name == 'capacity' else ''}, "
                         f"got {value!r}")
    return int(value)


def plan_geometry(schema: Schema, capacity: int | None, frame_capacity: int | None) -> StoreGeometry:
    """Shard and ring sizes. Each ring has one shard more than it needs so that giving up the shard being
    overwritten never drops a transition within ``capacity``."""
    most = None if capacity is None else MAX_FRAMES_PER_TRANSITION * capacity + 64
    if most is not None and frame_capacity is not None and frame_capacity > most:
        raise ValueError(f"frame_capacity {frame_capacity} is far more than a store of capacity {capacity} can use "
                         f"(each transition adds at most two frames; at most {most} is accepted)")
    row_bytes = sum(max(1, s.row_nbytes) for s in schema.observations)
    if capacity is None:
        t_shard = UNBOUNDED_TRANSITION_SHARD
        f_shard = _pow2_clamp(FRAME_SHARD_TARGET_BYTES // row_bytes, 64, 65536)
        return StoreGeometry(None, RingGeometry(t_shard, t_shard, True), RingGeometry(f_shard, f_shard, True))
    t_shard = _pow2_clamp(capacity // 16, 64, 65536)
    frames = frame_capacity or capacity + capacity // 8 + 64
    f_shard = _pow2_clamp(min(FRAME_SHARD_TARGET_BYTES // row_bytes, frames // 8), 8, 65536)
    f_shard = max(f_shard, max(s.chunk_rows for s in schema.observations))
    return StoreGeometry(capacity, RingGeometry(_round_up(capacity, t_shard) + t_shard, t_shard),
                         RingGeometry(_round_up(frames, f_shard) + f_shard, f_shard))


def prepare_new_store_dir(path: str) -> None:
    """Make ``path`` an empty directory for ``Store.create``: it must not exist or be empty, or be what a
    create that died before its first commit left (nothing was ever stored there: it is emptied)."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        if not interrupted_creation(path) and not never_committed(path):
            raise FileExistsError(f"cannot create a store at {path!r}: it exists and is not an empty directory "
                                  "(use Store.open to continue an existing store)")
        remove_contents(path)
    os.makedirs(path, exist_ok=True)


def never_committed(path: str) -> bool:
    """Is ``path`` what a ``Store.create`` that died before its first commit leaves: the root group of an
    mmreplay store (and arrays), but no commit record? Such a directory holds no transition."""
    try:
        read_meta(path)
    except (NotAStoreError, FormatError):
        return False
    return not os.path.exists(os.path.join(path, COMMIT_FILE))


def interrupted_creation(path: str) -> list[str]:
    """The files of a ``Store.create`` killed while zarr wrote the store's first ``zarr.json``: a directory
    holding only zarr's ``zarr.<hex>.partial`` temporary files (no metadata, so nothing was ever stored).
    Empty for anything else."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    ok = names and all(ZARR_PARTIAL.fullmatch(n) and os.path.isfile(os.path.join(path, n)) for n in names)
    return names if ok else []


def read_meta(path: str) -> dict:
    zarr_json = os.path.join(path, "zarr.json")
    if not os.path.isdir(path):
        raise NotAStoreError(f"no store at {path!r}: not a directory")
    try:
        group = json.loads(read_regular(zarr_json, MAX_META_BYTES))
    except FileNotFoundError:
        if not os.listdir(path):
            raise NotAStoreError(f"{path!r} is an empty directory, not an mmreplay store (no zarr.json): nothing "
                                 "was stored there (a "
                                 "Store.create interrupted before it wrote anything leaves this); Store.create on "
                                 "this path starts over, or delete the directory") from None
        leftovers = interrupted_creation(path)
        if leftovers:
            raise NotAStoreError(f"{path!r}: the creation of a store there was interrupted before its metadata was "
                                 f"written (it holds only zarr's temporary files {leftovers}); nothing was stored: "
                                 "Store.create on this path starts over, or delete the directory") from None
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
    if isinstance(cap, bool) or (cap is not None and cap > meta["transition_rows"] - meta["transition_shard_rows"]):
        raise FormatError(f"{zarr_json}: capacity {cap!r} does not fit transition_rows {meta['transition_rows']} "
                          f"(at most transition_rows - transition_shard_rows = "
                          f"{meta['transition_rows'] - meta['transition_shard_rows']})")
    if cap is not None and meta["frame_rows"] > max_frame_rows(cap, meta["frame_shard_rows"]):
        raise FormatError(f"{zarr_json}: frame_rows {meta['frame_rows']} is more than a store of capacity {cap} can "
                          f"use (at most {max_frame_rows(cap, meta['frame_shard_rows'])})")
    schema = Schema.from_json(meta["schema"])
    _check_columns(schema, meta, zarr_json)
    _check_frame_arrays(schema, path, zarr_json)
    return meta


def max_frame_rows(capacity: int, frame_shard_rows: int) -> int:
    """The largest frame ring a store of ``capacity`` transitions may have: each transition adds at most
    two frames, and ``frame_capacity`` is accepted up to twice that (room to spare, but bounded, so that
    metadata cannot make an open allocate without limit), in whole shards plus the spare shard."""
    return _round_up(MAX_FRAMES_PER_TRANSITION * capacity + 64, frame_shard_rows) + frame_shard_rows


def _check_columns(schema: Schema, meta: dict, where: str) -> None:
    """What the schema says must be something this code can read with bounded memory."""
    if not 1 <= schema.frame_stack <= 1024:
        raise FormatError(f"{where}: frame_stack {schema.frame_stack} outside [1, 1024]")
    if not schema.observations:
        raise FormatError(f"{where}: the schema has no observation column")
    for spec in (*schema.observations, *schema.transition_columns):
        try:
            validate_codec(spec.codec)
        except ValueError as exc:
            raise FormatError(f"{where}: column {spec.name!r}: {exc}") from None
    for spec in schema.observations:
        if spec.row_nbytes > MAX_ROW_BYTES:
            raise FormatError(f"{where}: observation {spec.name!r} of shape {spec.shape} ({spec.dtype}) takes "
                              f"{spec.row_nbytes:,} bytes, more than {MAX_ROW_BYTES:,}")
        if meta["frame_shard_rows"] % spec.chunk_rows:
            raise FormatError(f"{where}: observation {spec.name!r}: chunk_rows {spec.chunk_rows} does not divide "
                              f"frame_shard_rows {meta['frame_shard_rows']}")
    row_bytes = sum(max(1, s.row_nbytes) for s in schema.observations)
    staging = meta["frame_shard_rows"] * row_bytes
    most = max(MAX_STAGING_BYTES, row_bytes * max(64, *(s.chunk_rows for s in schema.observations)))
    if staging > most:
        raise FormatError(f"{where}: a frame shard of {meta['frame_shard_rows']} rows of {row_bytes:,} bytes "
                          f"(observations {[list(s.shape) for s in schema.observations]}) takes {staging:,} bytes; "
                          f"a store made by mmreplay has at most {most:,}: its metadata is damaged")


def _check_frame_arrays(schema: Schema, path: str, where: str) -> None:
    """Each observation's array (its own ``zarr.json``, written by zarr at create) holds rows of the shape
    and dtype the schema says: staging blocks and caches are sized from the schema, so an edited shape
    must be refused here, not by a decode after gigabytes were allocated. An array whose ``zarr.json`` is
    missing or unreadable is left to the reads and to ``verify``, which report it."""
    for spec in schema.observations:
        array_json = os.path.join(path, FRAMES_GROUP, spec.name, "zarr.json")
        try:
            array = json.loads(read_regular(array_json, MAX_ARRAY_META_BYTES))  # a link or FIFO: UnsafeEntryError
            shape, dtype = tuple(array["shape"][1:]), np.dtype(array["data_type"])
        except UnsafeEntryError:
            raise
        except (OSError, ValueError, TypeError, KeyError, IndexError):
            continue
        if (shape, dtype) != (spec.shape, spec.np_dtype):
            raise FormatError(f"{where}: observation {spec.name!r} has rows of shape {list(spec.shape)} "
                              f"({spec.dtype}), but its array {array_json} holds rows of shape {list(shape)} "
                              f"({dtype}): the metadata is damaged")


def check_record(record: dict, meta: dict, path: str) -> None:
    """The commit record must fit the store it belongs to: ring sizes, ranges within them, stream links
    within the transitions added. Anything else (an edited record, one from another store) is
    ``FormatError`` before any array is allocated."""
    where = os.path.join(path, COMMIT_FILE)
    bounded = meta["capacity"] is not None
    for rows, shard, head, oldest, what in (
            ("transition_rows", "transition_shard_rows", "head", "oldest", "transitions"),
            ("frame_rows", "frame_shard_rows", "frame_head", "frame_oldest", "frames")):
        n, n0, shard_rows = record[rows], meta[rows], meta[shard]
        if bounded and n != n0:
            raise FormatError(f"{where}: {rows} {n} differs from the store's {n0} (zarr.json)")
        if not bounded and (n % shard_rows or n < n0 or n > max(n0, 4 * (record[head] + shard_rows))):
            raise FormatError(f"{where}: {rows} {n} does not fit an unbounded ring holding {record[head]} {what} "
                              f"in shards of {shard_rows}")
        span = record[head] - record[oldest]
        if what == "transitions" and bounded and span > meta["capacity"]:
            raise FormatError(f"{where}: {span} transitions [{record[oldest]}, {record[head]}) are more than the "
                              f"store's capacity {meta['capacity']}")
        if span > n or (not bounded and record[head] > n):
            raise FormatError(f"{where}: {what} [{record[oldest]}, {record[head]}) do not fit a ring of {n} rows")
    for entry in record["streams"]:
        stream, last, ended = entry
        if not (0 <= stream < 1 << 31 and -1 <= last < record["head"] and ended in (0, 1)):
            raise FormatError(f"{where}: stream entry {entry} is not [stream in [0, 2**31), last transition in "
                              f"[-1, head={record['head']}), ended 0 or 1]")


def check_open_memory(meta: dict, record: dict, path: str, writable: bool) -> None:
    """Refuse to open a store whose geometry needs more RAM than this machine has, before allocating it:
    damaged or hostile metadata must not take the machine down."""
    schema = Schema.from_json(meta["schema"])
    t_rows, f_rows, f_shard = record["transition_rows"], record["frame_rows"], meta["frame_shard_rows"]
    per_transition = 13 + sum(max(1, c.row_nbytes) for c in schema.transition_columns)
    staging = sum(c.row_nbytes for c in schema.observations) * f_shard * (2 if writable else 1)
    cache_floor = sum(c.row_nbytes * c.chunk_rows * MIN_CACHE_SLOTS + 4 * (f_rows // c.chunk_rows)
                      for c in schema.observations)
    need = t_rows * per_transition + staging + cache_floor
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise FormatError(f"{path}: opening this store needs at least {need / 2**30:.1f} GiB of RAM (index of "
                          f"{t_rows:,} transitions, frame staging and cache of {f_rows:,} frames), more than this "
                          f"machine has ({have / 2**30:.1f} GiB): its metadata is damaged, or it was made for a "
                          "much larger machine")


def _pow2_clamp(value: int, lo: int, hi: int) -> int:
    value = max(lo, min(hi, int(value)))
    return 1 << (value.bit_length() - 1)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
