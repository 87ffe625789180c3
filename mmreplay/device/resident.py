"""A device-resident compressed tier (issue 38 item 2, ``device_cache_bytes``): checked chunks held in one pool of
device memory, so that a batch of them crosses PCIe as no bytes at all, only the pieces' offsets.

Invariant: an entry is a stored chunk of one observation key, named by the frame id of its first row (frame ids
are never reused: a chunk rewritten on the ring's next lap, or grown in a new shard, has another first id), held
only once all its ``c`` rows were readable when it was staged (``first + c <= head``: never a chunk still being
filled). Its bytes are the ones ``staging.gather_chunks`` copied and crc32c-checked, and its pieces the codec's
checked cut of every row (``FrameCodec.device_pieces_many``), both taken when it was staged; they reach the pool by
one device copy from the batch's staging buffer (``upload``, on the stream of the batch's decode) and the entry
is looked up only after that copy was queued (``commit``). Entries are never evicted: the pool fills up to its
capacity, then chunks that do not fit are staged batch by batch as before.

The pool is allocated whole when the tier is made (``Settings.device_cache_bytes``, when the sampler is made): device
memory the trainer would take later is claimed up front, and a size the device cannot hold is an error then, naming
the setting, not an out-of-memory error at some later batch.

Cost a batch, for the chunks held: one ``searchsorted`` per key and one compiled pass choosing the pieces of the
rows asked for and of the rows their references lead to (no crc32c, no header parsed, no byte copied on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmreplay._native.device_cut import select_held
from mmreplay.codecs.base import DevicePieces


def ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The indices ``starts[i]:ends[i]`` for every ``i``, concatenated (no Python per range)."""
    lens = ends - starts
    if not lens.size:
        return np.zeros(0, dtype=np.int64)
    shift = np.repeat(starts - np.r_[0, np.cumsum(lens)[:-1]], lens)
    return shift + np.arange(int(lens.sum()), dtype=np.int64)


class _Grow:
    """An int64 (or int8) array appended to in place, its room doubled when full."""

    def __init__(self, dtype, width: int = 0):
        self.width = width
        self.data = np.empty((64, width) if width else 64, dtype=dtype)
        self.n = 0

    def extend(self, values: np.ndarray) -> int:
        at = self.n
        need = at + len(values)
        if need > len(self.data):
            grown = np.empty((max(need, 2 * len(self.data)), *self.data.shape[1:]), dtype=self.data.dtype)
            grown[:at] = self.data[:at]
            self.data = grown
        self.data[at:need] = values
        self.n = need
        return at

    @property
    def view(self) -> np.ndarray:
        return self.data[:self.n]


@dataclass
class _Key:
    """One key's entries: ``keys`` (first frame ids, sorted) and ``entry`` (the entry of each), then per entry its
    pool offset and its ranges in the flat piece and row arrays (pieces: ``src`` relative to the chunk's body)."""
    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    entry: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    at: _Grow = field(default_factory=lambda: _Grow(np.int64))
    p0: _Grow = field(default_factory=lambda: _Grow(np.int64))
    r0: _Grow = field(default_factory=lambda: _Grow(np.int64))
    counts: _Grow = field(default_factory=lambda: _Grow(np.int64, 2))
    kinds: _Grow = field(default_factory=lambda: _Grow(np.int8))
    src: _Grow = field(default_factory=lambda: _Grow(np.int64, 2))
    dst: _Grow = field(default_factory=lambda: _Grow(np.int64, 2))
    rows: _Grow = field(default_factory=lambda: _Grow(np.int64))
    refs: _Grow = field(default_factory=lambda: _Grow(np.int64))


@dataclass
class Upload:
    """Chunks a batch staged that the pool will hold: staging-buffer ranges ``[src, src + length)`` go to pool
    offsets ``dst``; ``commit`` makes them visible once the copy is queued."""
    name: str
    first: np.ndarray
    src: np.ndarray
    length: np.ndarray
    dst: np.ndarray
    cut: DevicePieces
    counts: np.ndarray


class DeviceTier:
    """Compressed chunks in ``capacity_bytes`` of device memory on ``device`` (module invariant)."""

    def __init__(self, device, capacity_bytes: int):
        import torch

        if int(capacity_bytes) < 1:
            raise ValueError(f"device_cache_bytes must be > 0 for a device tier, got {capacity_bytes}")
        self.device = device
        self.capacity = int(capacity_bytes)
        try:
            self.pool = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:
            raise RuntimeError(f"device_cache_bytes={self.capacity:,}: {self.device} cannot hold a device tier "
                               f"that large ({str(exc).splitlines()[0]}); pass a smaller device_cache_bytes, or "
                               "0 for none") from None
        self.used = 0  # bytes reserved (committed or queued)
        self._keys: dict[str, _Key] = {}
        self.hits = self.misses = 0

    # -- a batch's lookups (under the store's lock, in ``staging.stage``) ------------------------------
    def lookup(self, name: str, first: np.ndarray) -> np.ndarray:
        """The entry of each chunk whose first frame id is ``first`` (-1: not held)."""
        k = self._keys.get(name)
        if k is None or not k.keys.size:
            self.misses += first.size
            return np.full(first.size, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(k.keys, first), k.keys.size - 1)
        got = np.where(k.keys[pos] == first, k.entry[pos], -1)
        held = int((got >= 0).sum())
        self.hits += held
        self.misses += first.size - held
        return got

    def pieces(self, name: str, entries: np.ndarray, c: int = 1, row_nbytes: int = 1,
               wants: list | None = None) -> tuple[DevicePieces, np.ndarray]:
        """The held pieces of ``entries`` (their ``src`` now offsets into ``pool``) and their counts, in order: every
        piece, or (``wants``: the rows asked for of each, of chunks of ``c`` rows of ``row_nbytes``) only those of
        the rows asked for and of the rows their references lead to (``_native/device_cut.select_held``)."""
        k = self._keys[name]
        counts = k.counts.view[entries]
        p0, r0 = k.p0.view[entries], k.r0.view[entries]
        if wants is None or c == 1:
            p = ranges(p0, p0 + counts[:, 0])
            r = ranges(r0, r0 + counts[:, 1])
        else:
            p, r, counts = select_held(p0, p0 + counts[:, 0], r0, r0 + counts[:, 1], k.dst.view, k.rows.view,
                                       k.refs.view, c, row_nbytes, wants)
        src = k.src.view[p] + np.repeat(k.at.view[entries], counts[:, 0])[:, None]
        return DevicePieces(k.kinds.view[p], src, k.dst.view[p], k.rows.view[r], k.refs.view[r]), counts

    def reserve(self, nbytes: np.ndarray) -> np.ndarray:
        """Pool offsets for the first chunks of ``nbytes`` that fit (one after the other); as many as fit."""
        ends = self.used + np.cumsum(nbytes)
        k = int(np.searchsorted(ends, self.capacity, side="right"))
        at = self.used + np.r_[0, np.cumsum(nbytes[:k])[:-1]].astype(np.int64) if k else np.zeros(0, np.int64)
        self.used = int(ends[k - 1]) if k else self.used
        return at

    # -- after the batch's staging buffer reached the device (``pipeline.DevicePath.finish``) ----------
    def upload(self, data, uploads: list[Upload]) -> None:
        """Copy each upload's chunks from the batch's staging buffer ``data`` (on the device) into the pool, then
        make them visible to lookups."""
        if not uploads:
            return
        for up in uploads:
            copy_ranges(data, up.src, up.length, self.pool, up.dst)
            self.commit(up)

    def commit(self, up: Upload) -> None:
        k = self._keys.setdefault(up.name, _Key())
        cut, counts = up.cut, up.counts
        body = np.repeat(up.src, counts[:, 0])[:, None]  # the pieces' src relative to their chunk's body
        p0 = k.kinds.extend(cut.kinds)
        k.src.extend(cut.src - body)
        k.dst.extend(cut.dst)
        r0 = k.rows.extend(cut.rows)
        k.refs.extend(cut.refs)
        first_entry = k.at.extend(up.dst)
        k.p0.extend(p0 + np.r_[0, np.cumsum(counts[:, 0])[:-1]])
        k.r0.extend(r0 + np.r_[0, np.cumsum(counts[:, 1])[:-1]])
        k.counts.extend(counts)
        keys = np.concatenate([k.keys, up.first])
        entry = np.concatenate([k.entry, first_entry + np.arange(up.first.size)])
        order = np.argsort(keys, kind="stable")
        k.keys, k.entry = keys[order], entry[order]

    def stats(self) -> dict:
        return {"capacity_bytes": self.capacity, "bytes": self.used, "hits": self.hits, "misses": self.misses,
                "chunks": sum(k.keys.size for k in self._keys.values())}


def copy_ranges(data, src: np.ndarray, length: np.ndarray, out, dst: np.ndarray) -> None:
    """``out[dst[i]:dst[i] + length[i]] = data[src[i]:src[i] + length[i]]`` for every ``i``: on the CPU a slice copy
    each (the tests' stand-in), on a device one gather with indices made there."""
    if not src.size:
        return
    if out.device.type == "cpu" and data.device.type == "cpu":
        host_in, host_out = data.numpy(), out.numpy()
        for s, n, d in zip(src.tolist(), length.tolist(), dst.tolist()):
            host_out[d:d + n] = host_in[s:s + n]
        return
    copy_ranges_indexed(data, src, length, out, dst)


def copy_ranges_indexed(data, src: np.ndarray, length: np.ndarray, out, dst: np.ndarray) -> None:
    """``copy_ranges`` as one gather and one scatter, the byte indices made on ``out``'s device from the ranges."""
    import torch

    lens = torch.as_tensor(length, device=out.device)
    total = int(length.sum())
    within = torch.arange(total, device=out.device) - torch.repeat_interleave(
        torch.as_tensor(np.r_[0, np.cumsum(length)[:-1]], device=out.device), lens, output_size=total)
    at = torch.repeat_interleave(torch.as_tensor(src, device=out.device), lens, output_size=total) + within
    to = torch.repeat_interleave(torch.as_tensor(dst, device=out.device), lens, output_size=total) + within
    out[to] = data[at]
