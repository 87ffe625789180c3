"""Priority sets on disk: two buffers per set, written by the commit, read back at open.

Layout (``docs/format.md``): set ``name`` is two sharded float32 zarr arrays, ``priorities/<name>/0`` and
``/1``, indexed by ring slot like ``transitions/*`` (row ``slot(g)`` holds the raw priority of transition
``g``; one inner chunk per transition shard; a shard never written reads as zarr's fill value, 0). The
commit record names one buffer per set (``entry``): ``{"buffer", "max_priority", "head", "alpha", "eps"}``.

Invariants (what is durable when):
- The buffer the last durable commit record names is never written. A commit writes the *other* buffer
  (every file shard changed since that buffer was last written: ``flush``), the commit log fsyncs those
  files, and only then does the new record name that buffer. A crash at any point before the record is
  replaced reopens the named buffer: exactly the priorities of the last commit; an update not committed
  yet lives only in RAM and is gone. Each shard file is replaced atomically (temp file + rename), so no
  crash leaves a torn file under a shard's name; a damaged file of the named buffer (truncated, edited)
  is refused with ``CorruptDataError`` by ``load``, never read as priorities.
- ``shard_tick[s] > written_tick[b][s]`` iff file shard ``s`` changed since buffer ``b`` was last written
  (each change takes a new tick: ``mark``, or the update kernel writing ``new_tick()`` into ``shard_tick``
  itself), so a commit writes exactly what its buffer lacks, and after ``load`` only the loaded buffer is
  complete (the other is rewritten whole by the next commit).
- Reading back: the rows of transitions ``[oldest, min(entry head, head))`` come from the named buffer;
  transitions past the entry's ``head`` have ``max_priority``. ``load`` (a set about to be sampled) also
  requires the shards holding them to exist and every stored value to be finite and ``>= 0``;
  ``read_committed`` (tools: ``mmreplay info``) reports the values as stored.
- The buffers' zarr metadata is made once, when a writer makes the set (``make_files``): the commit at
  interpreter exit, when zarr's I/O threads refuse work, never needs zarr; growing an unbounded ring only
  edits the metadata's shape (``resize_arrays``).

What priorities *mean* (the sum tree, the leaves ``(p + eps) ** alpha``, drawing) is ``sampling/priorities.py``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mmreplay.errors import CorruptDataError, FormatError
from mmreplay.storage.files import check_regular_or_absent, makedirs_inside
from mmreplay.storage.format.layout import PRIORITIES_GROUP, RingGeometry, priority_layout, resize_arrays
from mmreplay.storage.format.sharded import ShardedArray

BUFFERS = (0, 1)


def make_entry(buffer: int, max_priority: float, head: int, alpha: float, eps: float) -> dict[str, Any]:
    """A set's entry in the commit record (checked on read by ``commit.valid_priority_entry``)."""
    return {"buffer": buffer, "max_priority": max_priority, "head": head, "alpha": alpha, "eps": eps}


def rolled_back(entries: dict[str, dict], head: int) -> dict[str, dict]:
    """The entries of a record whose ``head`` went back to ``head`` (a rollback): no set covers transitions
    past it any more, so those that come again enter at ``max_priority``; the buffers stay as they are."""
    return {name: {**entry, "head": min(entry["head"], head)} for name, entry in entries.items()}


def ensure_arrays(root: str, name: str, rows: int, shard_rows: int) -> list[str]:
    """Zarr metadata for set ``name``'s two buffers (created once, grown with an unbounded ring); returns
    the metadata files it created (to fsync before a commit names them)."""
    layouts = [priority_layout(name, b, rows, shard_rows) for b in BUFFERS]
    # zarr follows links and opens FIFOs: the directories it writes into are made here first (never through a
    # link), and the group metadata it reads must be regular files (else UnsafeEntryError, nothing written)
    for layout in layouts:
        makedirs_inside(root, os.path.join(root, layout.path))
    for group in ("", PRIORITIES_GROUP, f"{PRIORITIES_GROUP}/{name}"):
        check_regular_or_absent(os.path.join(root, group, "zarr.json"))
    missing = [lay for lay in layouts if not os.path.exists(os.path.join(root, lay.path, "zarr.json"))]
    created = []
    if missing:
        import zarr

        group = zarr.open_group(root, mode="r+", zarr_format=3)
        group.require_group(PRIORITIES_GROUP).require_group(name)
        for layout in missing:
            layout.create(group)
            created.append(os.path.join(root, layout.path, "zarr.json"))
    resize_arrays(root, layouts, rows)
    return created


class PriorityFiles:
    """The two on-disk buffers of one priority set and which of their shards are stale (see the module
    invariants). The caller owns the values (``raw``: one float32 per ring slot) and hands them to
    ``flush``; this object decides which buffer and which shards a commit writes, and reads them back."""

    def __init__(self, root: str, name: str, geometry: RingGeometry):
        """Set ``name`` of the store at ``root`` whose transition ring is laid out as ``geometry``; nothing
        is read or written until ``load`` / ``flush``."""
        self.root, self.name = root, name
        self.rows, self.shard_rows = geometry.rows, geometry.shard_rows
        self.buffer = 1  # the committed buffer; the next commit writes the other one
        self.tick = 0
        n_shards = geometry.n_shards
        self.shard_tick = np.zeros(n_shards, dtype=np.int64)  # tick of each file shard's last change
        self.written_tick = [np.full(n_shards, -1, dtype=np.int64) for _ in BUFFERS]  # -1: never written
        self._arrays: dict[int, ShardedArray] = {}
        self._metadata_rows = 0  # rows the buffers' zarr metadata covers, as far as this object made sure
        self._created: list[str] = []  # metadata files made before a commit: fsynced before one names them

    # -- what changed ---------------------------------------------------------------------------------
    def new_tick(self) -> int:
        """A tick for a change about to be marked (the update kernel writes it into ``shard_tick``)."""
        self.tick += 1
        return self.tick

    def mark(self, slots: np.ndarray) -> None:
        """Rows ``slots`` changed: their file shards are stale in both buffers."""
        self.shard_tick[slots // self.shard_rows] = self.new_tick()

    def stale(self) -> bool:
        """Does the committed buffer lack a change?"""
        return bool((self.shard_tick > self.written_tick[self.buffer]).any())

    def grow(self, rows: int) -> None:
        """An unbounded ring doubled to ``rows``: shard ticks carry over, both buffers are rewritten whole
        (their layout's shape changed)."""
        n_shards = rows // self.shard_rows
        grown = np.zeros(n_shards, dtype=np.int64)
        grown[: self.shard_tick.size] = self.shard_tick
        self.shard_tick, self.rows = grown, rows
        self.written_tick = [np.full(n_shards, -1, dtype=np.int64) for _ in BUFFERS]

    # -- writing (driven by the commit) ---------------------------------------------------------------
    def entry(self, max_priority: float, head: int, alpha: float, eps: float) -> dict[str, Any]:
        """The set's entry in the commit record, naming the committed ``buffer`` (``make_entry``)."""
        return make_entry(self.buffer, max_priority, head, alpha, eps)

    def make_files(self) -> None:
        """The buffers' zarr metadata: created once and grown with an unbounded ring (module invariants)."""
        if self._metadata_rows != self.rows:
            self._created += ensure_arrays(self.root, self.name, self.rows, self.shard_rows)
            self._metadata_rows = self.rows

    def flush(self, raw: np.ndarray) -> list[str]:
        """Write ``raw`` (one value per ring slot) into the shards the other buffer lacks, which becomes
        ``buffer`` (what the next record names); returns the files written, to be made durable before that
        record is written."""
        if raw.shape != (self.rows,) or raw.dtype != np.float32:
            raise ValueError(f"priorities {self.name!r}: expected {self.rows} float32 values (one per ring slot), "
                             f"got {raw.dtype} {raw.shape}")
        target = 1 - self.buffer
        arr = self._array(target)
        self.make_files()
        created, self._created = self._created, []
        n = self.shard_rows
        written = [arr.write_shard(int(s), raw[s * n:(s + 1) * n], n)
                   for s in np.flatnonzero(self.shard_tick > self.written_tick[target])]
        self.written_tick[target][:] = self.tick
        self.buffer = target
        return created + written

    # -- reading back ---------------------------------------------------------------------------------
    def load(self, buffer: int, live: np.ndarray) -> np.ndarray:
        """Every row of committed buffer ``buffer`` (float32, one per ring slot), whose rows ``live`` (ring
        slots) hold priorities of stored transitions; ``buffer`` is then the complete one (module
        invariants). A missing shard file holding live rows is ``CorruptDataError``; a damaged file too;
        values not finite and ``>= 0`` are ``FormatError``."""
        array = self._array(buffer)
        for shard in np.unique(np.asarray(live, dtype=np.int64) // self.shard_rows).tolist():
            path = array.layout.shard_file(self.root, shard)
            if not os.path.lexists(path):  # a link or FIFO there: the read below refuses it
                raise CorruptDataError(f"priorities {self.name!r}: {path} is missing, but the last commit says it "
                                       "holds priorities of stored transitions")
        raw = array.read_rows(0, self.rows)  # a shard never written reads as zeros (zarr's fill value)
        check_values(raw, self.name, buffer)
        self.buffer = buffer
        self.tick = 0
        self.shard_tick[:] = 0
        self.written_tick[buffer][:] = 0  # that buffer holds exactly raw
        self.written_tick[1 - buffer][:] = -1
        return raw

    def _array(self, buffer: int) -> ShardedArray:
        arr = self._arrays.get(buffer)
        if arr is None or arr.layout.rows != self.rows:
            if arr is not None:
                arr.close()  # an unbounded ring grew: the layout's shape changed
            arr = ShardedArray(self.root, priority_layout(self.name, buffer, self.rows, self.shard_rows),
                               missing_ok=True)  # a shard never written holds no priorities yet
            self._arrays[buffer] = arr
        return arr

    def close(self) -> None:
        for arr in self._arrays.values():
            arr.close()


def check_values(raw: np.ndarray, name: str, buffer: int) -> None:
    """Stored priorities must be finite and ``>= 0`` (``FormatError`` naming the set and buffer)."""
    bad = ~np.isfinite(raw) | (raw < 0)
    if bad.any():
        raise FormatError(f"priorities {name!r}: {int(bad.sum())} stored priorities are not finite and >= 0 "
                          f"(e.g. {raw[bad][:4].tolist()}); the buffer {buffer} is damaged")


def read_committed(root: str, record: dict, geometry: RingGeometry) -> dict[str, np.ndarray]:
    """The raw priorities of every set commit ``record`` (as ``commit.read_commit`` returns it) names, by
    name, for its transitions ``[oldest, head)`` in id order: rows of the named buffer, and ``max_priority``
    for transitions past the set's entry ``head`` (what sampling gives them). ``geometry``: the store's
    transition ring (its rows as ``record`` has them are taken from the record: an unbounded ring grows).
    Values as stored (``load`` is what refuses damaged ones); a shard never written reads as 0."""
    oldest, head = record["oldest"], record["head"]
    geometry = geometry.with_rows(record["transition_rows"])
    out = {}
    for name, entry in record.get("priorities", {}).items():
        array = ShardedArray(root, priority_layout(name, entry["buffer"], geometry.rows, geometry.shard_rows),
                             missing_ok=True)
        try:
            covered = max(oldest, min(entry["head"], head))
            parts = [array.read_rows(a, b) for a, b in slot_ranges(geometry, oldest, covered)]
        finally:
            array.close()
        parts.append(np.full(head - covered, entry["max_priority"], np.float32))
        out[name] = np.concatenate(parts)
    return out


def committed_shards(root: str, record: dict, geometry: RingGeometry) -> list[tuple[ShardedArray, int]]:
    """``(array, file shard)`` for every shard of the buffers commit ``record`` names that holds live rows
    (what ``verify`` reads back)."""
    work = []
    for name, entry in record.get("priorities", {}).items():
        array = ShardedArray(root, priority_layout(name, entry["buffer"], geometry.rows, geometry.shard_rows))
        hi = min(entry["head"], record["head"])
        work += [(array, shard) for shard in geometry.shards_holding(min(record["oldest"], hi), hi)]
    return work


def slot_ranges(geometry: RingGeometry, lo: int, hi: int) -> list[tuple[int, int]]:
    """Contiguous row ranges holding transitions ``[lo, hi)``, in id order (a ring wraps at most once a lap)."""
    if geometry.unbounded:
        return [(lo, hi)] if hi > lo else []
    out, g = [], lo
    while g < hi:
        a = g % geometry.rows
        n = min(hi - g, geometry.rows - a)
        out.append((a, a + n))
        g += n
    return out
