"""What ``mmreplay info`` and ``mmreplay verify`` report about a store.

Invariant: both only read; ``verify_store`` re-reads every shard the last commit covers (each index and
chunk checksum, each decoded size) and reports problems by array, shard and chunk instead of stopping at
the first one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from mmreplay.columns.spec import ColumnSpec
from mmreplay.index.ring import TransitionRing

if TYPE_CHECKING:  # pragma: no cover
    from mmreplay.store import Store


def verify_store(store: "Store", progress=None) -> list[str]:
    """Read back every committed shard: each index and chunk checksum, each decoded size. Returns the
    problems found (empty: the store is intact); ``progress(done, total)`` is called per shard."""
    with store._lock:
        store._check_open()
        record = store._durable_state
        work = []
        for arrays, lo, hi, rows, shard_rows, unbounded in (
                (store._ring.disk.values(), record["oldest"], record["head"], record["transition_rows"],
                 store._ring.shard_rows, store.capacity is None),
                ([c.array for c in store._frames.columns.values()], record["frame_oldest"], record["frame_head"],
                 record["frame_rows"], store._frames.shard_rows, store.capacity is None)):
            shards = committed_shards(lo, hi, rows, shard_rows, unbounded)
            work += [(array, shard) for array in arrays for shard in shards]
        work += committed_priority_shards(store, record)
    problems = []
    layouts = store._ring.layouts() + [c.layout for c in store._frames.columns.values()] + \
        [array.layout for array, _ in work]
    for layout in {lay.path: lay for lay in layouts}.values():
        problems += layout.metadata_problems(store.path)
    for i, (array, shard) in enumerate(work):
        problems += array.verify_shard(shard)
        if progress:
            progress(i + 1, len(work))
    return problems


def committed_priority_shards(store: "Store", record: dict) -> list:
    """(array, shard) for every shard of the priority buffers the record names that holds live rows."""
    from mmreplay.sampling.priorities import buffer_layout
    from mmreplay.storage.sharded import ShardedArray

    work = []
    rows, shard_rows = record["transition_rows"], store._ring.shard_rows
    for name, entry in record.get("priorities", {}).items():
        array = ShardedArray(store.path, buffer_layout(name, entry["buffer"], rows, shard_rows))
        hi = min(entry["head"], record["head"])
        shards = committed_shards(min(record["oldest"], hi), hi, rows, shard_rows, store.capacity is None)
        work += [(array, shard) for shard in shards]
    return work


def store_info(store: "Store") -> dict:
    """Schema, counts and disk use per column (what ``mmreplay info`` prints)."""
    with store._lock:
        store._drain()
        oldest, head = store._ring.oldest, store._ring.head
        g = np.arange(oldest, head, dtype=np.int64)
        starts = int(np.count_nonzero(store._ring.read("prev_delta", g) == 0)) if g.size else 0
        n_frames = store._frames.head - store._frames.oldest
        columns = []
        for spec in store.schema.observations:
            columns.append(_column_info(store.path, f"frames/{spec.name}", spec, n_frames, spec.row_nbytes))
        for spec in store.schema.transition_columns:
            columns.append(_column_info(store.path, f"transitions/{spec.name}", spec, head - oldest,
                                        spec.row_nbytes))
        for name in TransitionRing.INDEX_COLUMNS + TransitionRing.FLAG_COLUMNS:
            spec = ColumnSpec.numeric(name, (), "uint32") if name in TransitionRing.INDEX_COLUMNS else \
                ColumnSpec.packed(name, (False, True), dtype="bool")
            columns.append(_column_info(store.path, f"transitions/{name}", spec, head - oldest, spec.row_nbytes))
        disk = _dir_bytes(store.path)
        return {
            "path": store.path, "format_version": store._meta["format_version"], "capacity": store.capacity,
            "frame_stack": store.frame_stack, "transitions": store._ring.count_valid(store.frame_stack,
                                                                                 store._frames.head),
            "added": head, "oldest": oldest, "episodes_started": starts, "frames": n_frames,
            "disk_bytes": disk, "bytes_per_transition": disk / max(1, head - oldest),
            "index_ram_bytes_per_transition": store._ring.index_nbytes_per_row(),
            "observation_space": store.schema.observation_space, "action_space": store.schema.action_space,
            "columns": columns,
        }


def committed_shards(lo: int, hi: int, rows: int, shard_rows: int, unbounded: bool) -> list[int]:
    """File shards holding rows of global ids [lo, hi)."""
    if hi <= lo:
        return []
    first, last = lo // shard_rows, (hi - 1) // shard_rows
    n_files = rows // shard_rows
    shards = range(first, last + 1)
    return sorted({s if unbounded else s % n_files for s in shards})


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _column_info(root: str, rel: str, spec: ColumnSpec, n_rows: int, row_nbytes: int) -> dict:
    disk = _dir_bytes(os.path.join(root, rel))
    raw = n_rows * (spec.bits / 8 if spec.kind == "packed" else max(1, row_nbytes))
    logical = n_rows * max(1, spec.np_dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64)))
    return {"array": rel, "kind": spec.kind, "dtype": spec.dtype, "shape": list(spec.shape),
            "bits": spec.bits or None, "rows": n_rows, "disk_bytes": disk,
            "compression_ratio": (logical / disk) if disk else None, "stored_bytes_uncompressed": int(raw)}
