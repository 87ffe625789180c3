"""Gather: a batch's compressed frame bytes, from wherever they lie, checked and cut, in one staging buffer.

Invariant: every byte put in the staging buffer for a stored chunk passed the chunk's crc32c (and, for a shard
file, the crc its identity tag lists) here on the CPU, and its headers passed the codec's checks
(``FrameCodec.device_pieces``) before anything is decoded; a chunk that fails either is a ``CorruptDataError``
naming it, and nothing of that batch is staged. Bytes are taken from, in this order:

- the writer's RAM (the staging and sealed shards, ``reader.writer_ram.shards``): rows stored as they are (pieces
  to copy);
- the compressed tier (``reader.compressed.compressed_chunks``), copied out under its ``holding`` lock so that no
  buffer moves;
- the shard files (``reader.files.compressed_chunks``: a batch's chunks read together, whole, the tag's listed
  crc checked);

the stored bytes copied and crc32c-checked in one compiled call (``_native/staging_copy.py``); a chunk the index marks
empty is zeros where ``ShardedArray.check_empty_chunk`` allows it. The reader's sources are only read here (their
tiers are the reader's business); this runs under the store's lock, like the CPU path's gather, so that the
reader's overwrite check covers what was staged.

Every key of the batch shares the one buffer: a copy to the device is one transfer. The buffer is one of the
sampler's ``StagingArena`` (reused batch after batch; on CUDA handed out again only once its last copy ended),
and stored chunks are copied into it once, with their checksum, where the pieces are then cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmreplay._native.staging_copy import checked_copy
from mmreplay.codecs.base import PIECE_COPY, DevicePieces, concat_pieces
from mmreplay.device.resident import DeviceTier, Upload, ranges
from mmreplay.errors import CorruptDataError
from mmreplay.reading.resident import EMPTY_CHUNK

CRC_BYTES = 4
ROW_ZERO = np.zeros(1, dtype=np.int64)  # the row a one-frame chunk is asked for


@dataclass
class KeyPlan:
    """One observation key of a staged batch: its decoded frames form a table of ``n_rows`` rows of
    ``row_nbytes`` bytes at byte ``table_at`` of the batch's decode buffer, then one row of zeros (row
    ``n_rows``: what padding positions gather, ``device/assemble.py``); ``row_of`` maps each frame id
    asked for (``ids``, sorted) to its table row; ``refs`` / ``depth`` say, per table row, the row its bytes
    are a residual from (-1: none) and how many references lead to a row decoded as it is."""
    name: str
    shape: tuple
    dtype: np.dtype
    row_nbytes: int
    ids: np.ndarray
    row_of: np.ndarray
    n_rows: int
    table_at: int
    refs: np.ndarray
    depth: np.ndarray


@dataclass
class Staged:
    """A batch's compressed bytes in one buffer (``host``: numpy, pinned when asked) and what to do with them:
    piece ``i`` of kind ``kinds[i]`` is ``host[src[i, 0]:src[i, 1]]`` and decodes into bytes ``dst[i]`` of the
    decode buffer (``decoded_nbytes`` bytes: every key's table and zero row, one after the other)."""
    host: np.ndarray
    pinned: object  # the torch tensor ``host`` views when pinned (kept alive with it), or None
    kinds: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    decoded_nbytes: int
    keys: dict = field(default_factory=dict)
    chunks: int = 0  # chunks staged (for statistics)
    arena: object = None  # the ``StagingArena`` whose buffer ``slot`` holds the bytes (``release`` after a copy)
    slot: int = 0
    sources: np.ndarray | None = None  # per piece: 0 ``src`` is in the staging buffer, 1 in the device tier's pool
    uploads: list = field(default_factory=list)  # chunks the device tier takes from this batch (``resident.Upload``)

    @property
    def nbytes(self) -> int:
        return int(self.host.size)


class StagingArena:
    """The staging buffers of one sampler, reused from batch to batch (a fresh 20 MB buffer a batch cost more in
    page faults than its copy): ``slots`` host buffers (pinned when ``pin``) handed out in turn, each grown when a
    batch needs more. A buffer whose copy to the device may still be running (``release(slot, event)``, an event
    recorded after the copy) is waited for before it is handed out again."""

    def __init__(self, pin: bool, slots: int = 3):
        if slots < 1:
            raise ValueError(f"a staging arena needs at least one buffer, got slots={slots}")
        self.pin = pin
        self._host: list[np.ndarray] = [np.empty(0, dtype=np.uint8)] * slots
        self._pinned: list = [None] * slots
        self._events: list = [None] * slots
        self._next = 0

    def take(self) -> int:
        """The next buffer's slot, once its last copy to the device (if any) has ended."""
        slot = self._next
        self._next = (slot + 1) % len(self._host)
        event, self._events[slot] = self._events[slot], None
        if event is not None:
            event.synchronize()
        return slot

    def ensure(self, slot: int, nbytes: int, keep: int) -> np.ndarray:
        """Slot ``slot``'s buffer, at least ``nbytes`` long, its first ``keep`` bytes kept when it grows."""
        buf = self._host[slot]
        if buf.size >= nbytes:
            return buf
        size = max(int(nbytes), int(buf.size * 1.25))
        grown, pinned = _buffer(size, self.pin)
        grown[:keep] = buf[:keep]
        self._host[slot], self._pinned[slot] = grown, pinned
        return grown

    def views(self, slot: int, nbytes: int) -> tuple[np.ndarray, object]:
        """The first ``nbytes`` of slot ``slot``'s buffer: numpy, and the pinned tensor's view (or None)."""
        buf = self.ensure(slot, nbytes, 0)
        pinned = self._pinned[slot]
        return buf[:nbytes], (pinned[:nbytes] if pinned is not None else None)

    def release(self, slot: int, event) -> None:
        """``slot``'s buffer is read by a copy that ends when ``event`` (``torch.cuda.Event``) completes."""
        self._events[slot] = event


def stage(reader, wanted: dict[str, np.ndarray], *, pin: bool = False, arena: StagingArena | None = None,
          tier: DeviceTier | None = None) -> Staged:
    """Gather the compressed bytes of the frames ``wanted`` (observation key -> frame ids, any shape, each
    ``reader.ring.oldest <= id < head``) of ``reader`` (a ``FrameReader``) into one staging buffer, with the
    pieces each decodes to (module docstring). The buffer is ``arena``'s next one (a fresh one without);
    ``pin``: pinned host memory (a CUDA copy). ``tier``: chunks it holds are not staged (their pieces point into its
    pool), and complete chunks staged here are queued for it while it has room (``device/resident.py``)."""
    arena = arena if arena is not None else StagingArena(pin, slots=1)
    slot = arena.take()
    kinds, srcs, dsts, sources, uploads = [], [], [], [], []
    at, table_at, n_chunks = 0, 0, 0
    keys = {}
    for name, ids in wanted.items():
        col = reader.columns[name]
        spec = col.spec
        c, row_nbytes = int(spec.chunk_rows), int(spec.row_nbytes)
        codec = col.column.array.compressor
        ids = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
        chunks, inner = np.divmod(reader.ring.row_of(ids), c)
        uchunks, of_id = np.unique(chunks, return_inverse=True)  # a ring's rows wrap: group by chunk
        first = np.empty(uchunks.size, dtype=np.int64)
        first[of_id] = ids - inner  # each chunk's first frame id: its contents' name (resident.py)
        use_tier = tier is not None and (reader.ring.unbounded or reader.ring.rows % c == 0)
        entries = tier.lookup(name, first) if use_tier else np.full(uchunks.size, -1, dtype=np.int64)
        hit = np.flatnonzero(entries >= 0)
        miss = np.flatnonzero(entries < 0)
        host, at_m, len_m, end = gather_chunks(reader, col, uchunks[miss], arena, slot, at)
        body_at = np.zeros(uchunks.size, dtype=np.int64)
        body_len = np.full(uchunks.size, -1, dtype=np.int64)
        body_at[miss], body_len[miss] = at_m, len_m
        staged = miss[len_m >= 0]
        held = miss[len_m < 0]  # the writer's RAM or zeros: every row, copied as it is
        wants = wanted_rows(of_id, inner, np.isin(np.arange(uchunks.size), staged), c)
        up = np.zeros(staged.size, dtype=bool)
        if use_tier:  # complete chunks go to the tier, cut whole, while it has room
            up = first[staged] + c <= reader.ring.head
            up_at = tier.reserve(body_len[staged][up]) if up.any() else np.zeros(0, dtype=np.int64)
            up[np.flatnonzero(up)[up_at.size:]] = False  # those that do not fit stay staged
            if up_at.size and c > 1:
                every = np.arange(c, dtype=np.int64)
                wants = [every if u else w for u, w in zip(up.tolist(), wants)]
        try:  # offsets are into the whole buffer; it is cut at this key's end (no stale bytes past it)
            cut_m, counts_m = codec.device_pieces_many(host[:end], body_at[staged], body_len[staged], c, row_nbytes,
                                                       wants)
        except ValueError as exc:
            i = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], int) else 0
            shard, inner_no = divmod(int(uchunks[staged[i]]), col.column.layout.chunks_per_shard)
            raise CorruptDataError(f"{col.column.array.where(shard, inner_no)}: {exc.args[0]}") from None
        if up.any():
            uploads.append(_upload(name, first[staged][up], body_at[staged][up], body_len[staged][up], up_at,
                                   cut_m, counts_m, up))
        if hit.size:  # held pieces first, then the staged ones: "stored" is their chunks in that order
            wants_h = wanted_rows(of_id, inner, entries >= 0, c)
            cut_h, counts_h = tier.pieces(name, entries[hit], c, row_nbytes, wants_h)
            cut = concat_pieces([cut_h, cut_m])
            counts = np.concatenate([counts_h, counts_m])
        else:
            cut_h, cut, counts = None, cut_m, counts_m
        stored = np.r_[hit, staged].astype(np.int64)
        n_pool = 0 if cut_h is None else cut_h.kinds.size
        sources.append(np.r_[np.ones(n_pool, dtype=np.int8), np.zeros(cut_m.kinds.size + held.size, dtype=np.int8)])
        # slot of each chunk: the stored ones first, in order, then those held as they are
        slot_of = np.empty(uchunks.size, dtype=np.int64)
        slot_of[stored] = np.arange(stored.size)
        slot_of[held] = stored.size + np.arange(held.size)
        raw = c * row_nbytes
        n_held = held.size
        piece_slot = np.r_[np.repeat(np.arange(stored.size), counts[:, 0]), stored.size + np.arange(n_held)]
        row_slot = np.r_[np.repeat(np.arange(stored.size), counts[:, 1]), np.repeat(stored.size + np.arange(n_held), c)]
        rows = np.r_[cut.rows, np.tile(np.arange(c), n_held)]
        refs_chunk = np.r_[cut.refs, np.full(n_held * c, -1)]
        kinds.append(np.r_[cut.kinds, np.full(n_held, PIECE_COPY, dtype=np.int8)].astype(np.int8))
        srcs.append(np.concatenate([cut.src, np.stack([body_at[held], body_at[held] + raw], axis=1)]))
        dst_chunk = np.concatenate([cut.dst, np.tile(np.array([[0, raw]], dtype=np.int64), (n_held, 1))])
        row_keys = row_slot * c + rows  # ascending: slots ascend, rows ascend within a chunk
        piece_row = dst_chunk[:, 0] // row_nbytes
        table_row = np.searchsorted(row_keys, piece_slot * c + piece_row)
        dsts.append(table_at + (table_row * row_nbytes + dst_chunk[:, 0] - piece_row * row_nbytes)[:, None]
                    + (dst_chunk - dst_chunk[:, :1]))
        refs = np.where(refs_chunk >= 0, np.searchsorted(row_keys, row_slot * c + np.maximum(refs_chunk, 0)), -1)
        row_of = np.searchsorted(row_keys, slot_of[of_id] * c + inner)
        n_rows = rows.size
        n_chunks += uchunks.size
        keys[name] = KeyPlan(name, tuple(spec.shape), np.dtype(spec.np_dtype), row_nbytes, ids, row_of, n_rows,
                             table_at, refs.astype(np.int64), chain_depths(refs))
        table_at += (n_rows + 1) * row_nbytes  # the table, then its zero row
        at = end
    host, pinned = arena.views(slot, at)
    cat = (lambda xs, shape: np.concatenate(xs) if xs else np.zeros(shape, dtype=np.int64))
    return Staged(host, pinned, cat(kinds, (0,)).astype(np.int8), cat(srcs, (0, 2)), cat(dsts, (0, 2)), table_at,
                  keys, n_chunks, arena, slot, cat(sources, (0,)).astype(np.int8), uploads)


def _upload(name, first, src, length, dst, cut, counts, up) -> Upload:
    """The chunks ``up`` (a mask over a key's staged chunks, ``cut``/``counts`` their pieces) for the tier."""
    starts = np.r_[0, np.cumsum(counts[:, 0])[:-1]]
    row_starts = np.r_[0, np.cumsum(counts[:, 1])[:-1]]
    p = ranges(starts[up], starts[up] + counts[up, 0])
    r = ranges(row_starts[up], row_starts[up] + counts[up, 1])
    return Upload(name, first, src, length, dst,
                  DevicePieces(cut.kinds[p], cut.src[p], cut.dst[p], cut.rows[r], cut.refs[r]), counts[up])


def wanted_rows(of_id: np.ndarray, inner: np.ndarray, stored: np.ndarray, c: int) -> list:
    """Per stored chunk (``stored``: a mask over the batch's chunks), the rows asked for (ascending), from each
    id's chunk (``of_id``) and row in it (``inner``): one sort and one split, no Python per chunk."""
    n_stored = int(stored.sum())
    if c == 1:
        return [ROW_ZERO] * n_stored
    keys = np.sort(of_id * c + inner)  # the ids are distinct: so are (chunk, row) pairs
    chunk = keys // c
    keys = keys[stored[chunk]]
    ends = np.searchsorted(keys // c, np.flatnonzero(stored), side="right")
    return np.split(keys % c, ends[:-1])


def gather_chunks(reader, col, chunks: np.ndarray, arena: StagingArena, slot: int,
                  base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The bytes of ``col``'s ``chunks`` (unique) into ``arena``'s buffer ``slot`` from byte ``base`` on:
    ``(buffer, at, length, end)``, ``at`` each chunk's offset in the buffer, ``length`` the stored body's
    (checksum checked and removed), or -1 for a chunk held as it is at ``at`` (``c`` rows of the writer's RAM, or
    zeros for a chunk the index marks empty where that is allowed), ``end`` the first byte after them. Stored
    chunks come from the compressed tier (``reader.compressed``) when it holds them, else from their files
    (``reader.files``, read together); their crc32c is checked as they are copied (``checked_copy``)."""
    c, row_nbytes = int(col.spec.chunk_rows), int(col.spec.row_nbytes)
    raw_nbytes = c * row_nbytes
    per_shard = col.column.layout.chunks_per_shard
    array = col.column.array
    ram = reader.writer_ram.shards(col)  # {file shard: its rows}, read from RAM, never from their files
    shard_of = chunks * c // reader.ring.shard_rows
    in_ram = np.isin(shard_of, list(ram)) if ram else np.zeros(chunks.size, dtype=bool)
    length = np.full(chunks.size, -1, dtype=np.int64)  # -1: held as it is (RAM rows, or zeros)
    addrs = np.zeros(chunks.size, dtype=np.int64)
    sizes = np.zeros(chunks.size, dtype=np.int64)
    stored = np.flatnonzero(~in_ram)
    got = None
    with reader.compressed.holding(col):  # no buffer of the tier moves until the bytes are copied out
        if stored.size:
            addrs[stored], sizes[stored] = reader.compressed.compressed_chunks(col, chunks[stored])
            empty = np.zeros(chunks.size, dtype=bool)
            empty[stored] = addrs[stored] == EMPTY_CHUNK
            missing = stored[addrs[stored] == 0]
            if missing.size:  # not in the tier: read from the files, together
                got = reader.files.compressed_chunks(col, chunks[missing])
                whole = got.read_whole() | got.empty
                if not whole.all():
                    where = array.where(*divmod(int(chunks[missing[~whole][0]]), per_shard))
                    raise CorruptDataError(f"{where}: read in part, expected whole")
                addrs[missing], sizes[missing], empty[missing] = got.addresses(), got.sizes, got.empty
            for i in np.flatnonzero(empty).tolist():  # allowed only where the CPU path allows it (zeros)
                array.check_empty_chunk(*divmod(int(chunks[i]), per_shard))
            body = stored[~empty[stored]]
            length[body] = sizes[body] - CRC_BYTES
        spans = np.where(length < 0, raw_nbytes, np.maximum(length, 0))
        at = base + np.r_[0, np.cumsum(spans)[:-1]].astype(np.int64)
        end = base + int(spans.sum())
        buf = arena.ensure(slot, end, base)
        copied = np.flatnonzero(length >= 0)
        try:
            if copied.size:
                status = checked_copy(addrs[copied], sizes[copied], buf, at[copied])
                if (status != 0).any():
                    bad = int(copied[np.flatnonzero(status != 0)[0]])
                    what = "checksum mismatch (stored data is corrupt)" if sizes[bad] >= CRC_BYTES else \
                        f"chunk is {int(sizes[bad])} bytes, shorter than its checksum"
                    raise CorruptDataError(f"{array.where(*divmod(int(chunks[bad]), per_shard))}: {what}")
        finally:
            if got is not None:
                got.release()
    for i in np.flatnonzero(length < 0).tolist():
        if in_ram[i]:
            shard = int(shard_of[i])
            offset = int(chunks[i]) * c - shard * reader.ring.shard_rows
            buf[at[i]:at[i] + raw_nbytes] = np.ascontiguousarray(ram[shard][offset:offset + c]).reshape(-1).view(
                np.uint8)
        else:
            buf[at[i]:at[i] + raw_nbytes] = 0
    return buf, at, length, end


def _buffer(nbytes: int, pin: bool):
    if not pin:
        return np.empty(nbytes, dtype=np.uint8), None
    import torch

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return pinned.numpy(), pinned


def chain_depths(refs: np.ndarray) -> np.ndarray:
    """Per table row, the references from it to a row decoded as it is (``refs``: each row's reference row or -1;
    the codecs' header checks guarantee the references end). Vectorised: one pass per chain step."""
    depth = np.where(refs < 0, 0, -1).astype(np.int64)
    for _ in range(refs.size):
        todo = np.flatnonzero(depth < 0)
        if not todo.size:
            return depth
        ready = todo[depth[refs[todo]] >= 0]
        if not ready.size:
            break
        depth[ready] = depth[refs[ready]] + 1
    if (depth < 0).any():
        raise CorruptDataError(f"frame references form a cycle (table rows {np.flatnonzero(depth < 0)[:8].tolist()})")
    return depth
