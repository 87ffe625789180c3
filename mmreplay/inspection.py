"""What ``mmreplay info`` and ``mmreplay verify`` report about a store, and which ids it can read.

Invariant: both only read; ``verify`` re-reads every shard the last commit covers (each file's identity,
each index and chunk checksum, and decodes every chunk holding committed rows: a chunk it reports clean
decoded to exactly its size) and reports problems by array, shard and chunk instead of stopping at the
first one.
"""

from __future__ import annotations

import os

import numpy as np

from mmreplay.columns.spec import ColumnSpec, Schema
from mmreplay.index.ring import TransitionRing
from mmreplay.index.frame_ring import FrameRing
from mmreplay.storage.durability import priority_files
from mmreplay.storage.format.layout import RingGeometry
from mmreplay.storage.format.sharded import verify_shard


def first_readable(ring: TransitionRing, frame_stack: int, frame_head: int) -> int:
    """The smallest id ``lo`` such that every transition in ``[lo, ring.head)`` is readable by
    ``inspect.get`` (its frame stack is held). It is ``ring.oldest`` unless the ring cut an episode: then
    the first ``frame_stack - 1`` kept steps of that episode (and, with interleaved streams, the ids
    among them) need frames the ring overwrote. Only the first ``(k - 1) * max_prev_delta`` ids can be."""
    oldest, head = ring.oldest, ring.head
    if frame_stack <= 1 or head == oldest:
        return oldest
    window = min(head - oldest, (frame_stack - 1) * max(1, ring.max_prev_delta))
    g = np.arange(oldest, oldest + window, dtype=np.int64)
    unreadable = np.flatnonzero(~ring.stack_frames(g, frame_stack, frame_head)[2])
    return oldest if unreadable.size == 0 else int(g[unreadable[-1]]) + 1


def committed_work(root: str, record: dict, ring: TransitionRing, frames: FrameRing) -> tuple[list, list]:
    """What ``verify`` reads for commit ``record`` of a store with these rings: ``(layouts, work)``, every
    array's layout (to check its ``zarr.json``) and ``(array, shard, committed chunks or None: all)`` for
    every shard holding committed rows. Take it under the store's lock; ``verify`` can then run without it."""
    unbounded = ring.capacity is None
    t_geo = RingGeometry(record["transition_rows"], ring.shard_rows, unbounded)
    f_geo = RingGeometry(record["frame_rows"], frames.shard_rows, unbounded)
    work = [(array, shard, None) for array in ring.disk.values()
            for shard in t_geo.shards_holding(record["oldest"], record["head"])]
    frame_head = record["frame_head"]
    partial = f_geo.file_shard(frame_head // f_geo.shard_rows) if frame_head % f_geo.shard_rows else None
    for col in frames.columns.values():
        in_partial = -(-(frame_head % f_geo.shard_rows) // col.spec.chunk_rows)  # chunks of the partial shard
        work += [(col.array, shard, in_partial if shard == partial else None)
                 for shard in f_geo.shards_holding(record["frame_oldest"], frame_head)]
    work += [(array, shard, None) for array, shard in priority_files.committed_shards(root, record, t_geo)]
    layouts = ring.layouts() + [c.layout for c in frames.columns.values()] + [array.layout for array, _, _ in work]
    return list({lay.path: lay for lay in layouts}.values()), work


def verify(root: str, layouts: list, work: list, progress=None) -> list[str]:
    """Read back every shard in ``work`` (each index and chunk checksum, each decoded size) and check
    every layout's metadata. Returns the problems found (empty: intact); ``progress(done, total)`` is
    called per shard."""
    problems = []
    for layout in layouts:
        problems += layout.metadata_problems(root)
    for i, (array, shard, committed_chunks) in enumerate(work):
        problems += verify_shard(array, shard, committed_chunks)
        if progress:
            progress(i + 1, len(work))
    return problems


def store_info(root: str, meta: dict, schema: Schema, ring: TransitionRing, frames: FrameRing) -> dict:
    """Schema, counts and disk use per column (what ``mmreplay info`` prints). Call it under the store's
    lock with nothing pending."""
    oldest, head = ring.oldest, ring.head
    g = np.arange(oldest, head, dtype=np.int64)
    starts = int(np.count_nonzero(ring.read("prev_delta", g) == 0)) if g.size else 0
    n_frames = frames.head - frames.oldest
    disk_of = _dir_bytes(root)
    columns = []
    for spec in schema.observations:
        columns.append(_column_info(disk_of, f"frames/{spec.name}", spec, n_frames, spec.row_nbytes))
    for spec in schema.transition_columns:
        columns.append(_column_info(disk_of, f"transitions/{spec.name}", spec, head - oldest, spec.row_nbytes))
    for name in TransitionRing.INDEX_COLUMNS + TransitionRing.FLAG_COLUMNS:
        spec = ColumnSpec.numeric(name, (), "uint32") if name in TransitionRing.INDEX_COLUMNS else \
            ColumnSpec.packed(name, (False, True), dtype="bool")
        columns.append(_column_info(disk_of, f"transitions/{name}", spec, head - oldest, spec.row_nbytes))
    # counted in numpy (compiled=False): a report never needs numba's compiler, ~0.5 s of a tool's start
    valid = ring.count_valid(schema.frame_stack, frames.head, compiled=False)
    disk = disk_of("")
    return {
        "path": root, "format_version": meta["format_version"], "capacity": meta["capacity"],
        "frame_stack": schema.frame_stack, "transitions": valid,
        "added": head, "oldest": oldest, "episodes_started": starts, "frames": n_frames,
        "disk_bytes": disk, "bytes_per_transition": disk / max(1, head - oldest),
        "index_ram_bytes_per_transition": ring.index_nbytes_per_row(),
        "observation_space": schema.observation_space, "action_space": schema.action_space,
        "columns": columns,
    }


def _dir_bytes(root: str):
    """``disk(rel)``: the bytes of the files under ``root/rel`` (``""``: the whole store; ``rel`` at most two
    levels deep: a group or an array), from one ``scandir`` walk of the store (a 1M-transition store has
    ~2,000 directories: one walk, not one per column)."""
    totals: dict[str, int] = {}

    def walk(path: str, rel: str, depth: int) -> int:
        total = 0
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    total += walk(entry.path, f"{rel}/{entry.name}" if rel else entry.name, depth + 1)
                elif entry.is_file():
                    total += entry.stat().st_size
        if depth <= 2:
            totals[rel] = total
        return total

    walk(root, "", 0)
    return lambda rel: totals.get(rel, 0)


def _column_info(disk_of, rel: str, spec: ColumnSpec, n_rows: int, row_nbytes: int) -> dict:
    disk = disk_of(rel)
    raw = n_rows * (spec.bits / 8 if spec.kind == "packed" else max(1, row_nbytes))
    logical = n_rows * max(1, spec.np_dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64)))
    return {"array": rel, "kind": spec.kind, "dtype": spec.dtype, "shape": list(spec.shape),
            "bits": spec.bits or None, "rows": n_rows, "disk_bytes": disk,
            "compression_ratio": (logical / disk) if disk else None, "stored_bytes_uncompressed": int(raw)}
