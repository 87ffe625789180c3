"""Dopamine's replay checkpoint files: their names, their circular layout, and checked, streamed reads.

A Dopamine ``OutOfGraphReplayBuffer`` checkpoint ``N`` is a directory of gzip'd ``.npy`` files:
``$store$_{observation,action,reward,terminal}_ckpt.N.gz`` (one row per *add*: frame ``(H, W)`` uint8,
action int32, reward float32, terminal uint8), ``add_count_ckpt.N.gz`` (adds so far, padding included) and
``invalid_range_ckpt.N.gz``. The buffer is circular: row ``g`` of the run (its ``g``-th add) lives at
``g % capacity``; the oldest held row is at the cursor ``add_count % capacity`` once the buffer wrapped.

Invariants:
- Only regular files are opened; every header is checked before anything is allocated (``npy_stream.py``),
  the four columns must have the same rows, frames must be 2-D uint8.
- Rows come in the run's order (``Checkpoint.segments``: oldest first), frames a bounded block at a time,
  and each observation file is decompressed once: a wrapped checkpoint's newest rows, first in its file,
  wait LZ4-compressed in an unnamed temporary file until its oldest rows were read.
"""

from __future__ import annotations

import base64
import os
import queue
import re
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from mmreplay.datasets.npy_stream import NpyFormatError, NpyReader

STORE_PREFIX = "$store$_"
COLUMNS = ("observation", "action", "reward", "terminal")
_FILE = re.compile(r"^(\$store\$_(?:observation|action|reward|terminal)|add_count|invalid_range)_ckpt\.(\d+)\.gz$")


def checkpoint_files(directory: str | os.PathLike) -> dict[int, dict[str, str]]:
    """``{N: {"observation": path, ..., "add_count": path, ...}}`` for every checkpoint file in ``directory``."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory!r} is not a directory (expected a Dopamine replay directory holding "
                                 "$store$_observation_ckpt.N.gz and its sibling files)")
    found: dict[int, dict[str, str]] = {}
    for name in os.listdir(directory):
        match = _FILE.match(name)
        if match:
            if not os.path.isfile(os.path.join(directory, name)):  # a FIFO or device would block or never end
                raise NpyFormatError(f"{os.path.join(directory, name)!r} is not a regular file (expected a gzip'd "
                                     ".npy checkpoint file)")
            key = match.group(1).removeprefix(STORE_PREFIX)
            found.setdefault(int(match.group(2)), {})[key] = os.path.join(directory, name)
    if not found:
        raise FileNotFoundError(f"{directory!r} holds no Dopamine checkpoint file ($store$_observation_ckpt.N.gz ...)")
    return found


def parse_checkpoints(text: str | Sequence[int] | None, available: Sequence[int]) -> list[int]:
    """``"0,1,5-9"`` (or a list of numbers, or None: all of ``available``) -> sorted checkpoint numbers, each
    of which must be in ``available``."""
    if text is None:
        return sorted(available)
    numbers: set[int] = set()
    if isinstance(text, str):
        for part in text.split(","):
            match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
            if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
                raise ValueError(f"checkpoints {text!r}: expected numbers and ranges like 0,1,5-9 (low-high, low <= high)")
            lo = int(match.group(1))
            numbers.update(range(lo, int(match.group(2) or lo) + 1))
    else:
        numbers.update(int(n) for n in text)
    missing = sorted(numbers - set(available))
    if missing:
        raise FileNotFoundError(f"checkpoint(s) {missing} not found: the directory holds {sorted(available)}")
    return sorted(numbers)


@dataclass
class Checkpoint:
    """One checkpoint's geometry: ``capacity`` rows in each file, ``add_count`` adds (None: no file; the rows
    are then read in file order as one unwrapped buffer)."""

    number: int
    files: dict[str, str]
    capacity: int
    frame_shape: tuple[int, ...]
    add_count: int | None
    stack_size: int | None  # from invalid_range (with the update horizon), when both files are there
    update_horizon: int | None
    notes: list[str] = field(default_factory=list)

    @property
    def segments(self) -> list[tuple[int, int]]:
        """Physical row ranges in the run's order (oldest first)."""
        a, cap = self.add_count, self.capacity
        if a is None:
            return [(0, cap)]
        if a <= cap:
            return [(0, a)] if a else []
        c = a % cap
        return [(c, cap), (0, c)] if c else [(0, cap)]

    @property
    def rows(self) -> int:
        return sum(hi - lo for lo, hi in self.segments)

    @property
    def first_global(self) -> int | None:
        return None if self.add_count is None else max(0, self.add_count - self.capacity)

    def in_order(self, array: np.ndarray) -> np.ndarray:
        return np.concatenate([array[lo:hi] for lo, hi in self.segments]) if self.segments else array[:0]


def read_checkpoint(number: int, files: dict[str, str]) -> Checkpoint:
    """Check one checkpoint's headers (before reading any data) and its ``add_count``/``invalid_range``."""
    missing = [c for c in COLUMNS if c not in files]
    if missing:
        raise FileNotFoundError(f"checkpoint {number}: missing {[f'{STORE_PREFIX}{c}_ckpt.{number}.gz' for c in missing]}")
    with _open_column(files, "observation", number) as obs:
        capacity, frame_shape = obs.rows, obs.row_shape
        if obs.dtype != np.uint8:
            raise NpyFormatError(f"checkpoint {number} observation ({files['observation']!r}): frames of dtype "
                                 f"{obs.dtype}; expected uint8 (Dopamine's Atari frames)")
    for name in ("action", "reward", "terminal"):
        with _open_column(files, name, number) as col:
            if col.rows != capacity:
                raise NpyFormatError(f"checkpoint {number}: {name} has {col.rows} rows, observation has {capacity}")
    add_count = None
    ckpt = Checkpoint(number, files, capacity, frame_shape, None, None, None)
    if "add_count" in files:
        with NpyReader(files["add_count"], what=f"checkpoint {number} add_count", kinds="iu", row_ndim=(-1, 0)) as r:
            value = r.read_all().reshape(-1)
        if value.size != 1 or int(value[0]) < 0:
            raise NpyFormatError(f"checkpoint {number}: add_count {value.tolist()}: expected one count >= 0")
        ckpt.add_count = add_count = int(value[0])
    else:
        ckpt.notes.append(f"checkpoint {number} has no add_count file: its rows are read in file order, as an "
                          "unwrapped buffer, and start a new stream")
    if os.path.exists(os.path.join(os.path.dirname(files["observation"]), f"episode_end_indices_ckpt.{number}.gz")):
        ckpt.notes.append(f"checkpoint {number}: episode_end_indices_ckpt.{number}.gz is a pickle and is not read: "
                          "episodes end at terminal rows only (an episode Dopamine ended without a terminal runs on "
                          "through the next episode's padding)")
    if "invalid_range" in files and add_count:
        with NpyReader(files["invalid_range"], what=f"checkpoint {number} invalid_range", kinds="iuf",
                       row_ndim=0, max_rows=1 << 10) as r:
            _infer_stack(ckpt, r.read_all())
    return ckpt


def _infer_stack(ckpt: Checkpoint, invalid: np.ndarray) -> None:
    """Dopamine's ``invalid_range(cursor, capacity, stack_size, update_horizon)`` is
    ``[(cursor - h + i) % capacity for i in range(stack_size + h)]``: its first value gives ``h``."""
    cap = ckpt.capacity
    cursor = ckpt.add_count % cap
    if invalid.size == 0:
        return
    h = int((cursor - int(invalid[0])) % cap)
    k = invalid.size - h
    expected = np.array([(cursor - h + i) % cap for i in range(invalid.size)])
    if k < 1 or not np.array_equal(invalid.astype(np.int64), expected):
        ckpt.notes.append(f"checkpoint {ckpt.number}: invalid_range {invalid.tolist()[:8]} does not match its "
                          f"add_count {ckpt.add_count} (cursor {cursor}); stack_size not inferred")
        return
    ckpt.stack_size, ckpt.update_horizon = k, h


def _open_column(files: dict[str, str], name: str, number: int) -> NpyReader:
    what = f"checkpoint {number} {name}"
    if name == "observation":
        return NpyReader(files[name], what=what, kinds="u", row_ndim=2)
    kinds = {"action": "iu", "reward": "f", "terminal": "biu"}[name]
    return NpyReader(files[name], what=what, kinds=kinds, row_ndim=0)


@dataclass
class SmallColumns:
    """A checkpoint's action, reward and terminal columns in the run's order."""

    action: np.ndarray
    reward: np.ndarray
    terminal: np.ndarray


def read_small_columns(ckpt: Checkpoint) -> SmallColumns:
    cols = {}
    for name in ("action", "reward", "terminal"):
        with _open_column(ckpt.files, name, ckpt.number) as r:
            cols[name] = ckpt.in_order(r.read_all())
    term = cols["terminal"]
    bad = np.flatnonzero((term != 0) & (term != 1))
    if bad.size:
        raise NpyFormatError(f"checkpoint {ckpt.number}: terminal holds {term[bad[0]]!r}; expected 0 or 1")
    if cols["action"].size and cols["action"].min() < 0:
        raise NpyFormatError(f"checkpoint {ckpt.number}: action {int(cols['action'].min())}; expected actions >= 0")
    if not np.isfinite(cols["reward"]).all():
        raise NpyFormatError(f"checkpoint {ckpt.number}: a reward is not finite")
    # Held for a whole checkpoint (1M rows) beside the store's index, and read again at each checkpoint while
    # the previous one's may still be alive: actions in the narrowest unsigned type that holds them (Atari's
    # 18: 1 B a row, not int64's 8), the reward and terminal columns as read when they already fit (float32;
    # 0/1 bytes viewed as bool), so no int64/float32/bool copy beside the read one (issue #42: ~12 -> ~6 MiB
    # held a 1M-row checkpoint, ~24 -> ~10 MiB at its read).
    return SmallColumns(_narrow_actions(cols["action"]), cols["reward"].astype(np.float32, copy=False),
                        term.view(bool) if term.dtype.itemsize == 1 else term.astype(bool))


def _narrow_actions(action: np.ndarray) -> np.ndarray:
    """``action`` (integers >= 0, checked) in uint8 / uint16 / uint32 when its largest value fits, else int64."""
    top = int(action.max()) if action.size else 0
    for dtype in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dtype).max:
            return action.astype(dtype, copy=False)
    return action.astype(np.int64, copy=False)


def iter_frame_blocks(ckpt: Checkpoint, start: int, out) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, frames)`` blocks of the checkpoint's frames in the run's order from row ``start``,
    read into ``out`` (reused: a block is valid until the next one), or, when ``out`` is a callable, into
    the buffer it returns for each block. The gzip stream is decompressed once: a wrapped checkpoint's file
    holds its newest rows first, so on the way to the oldest (the cursor) they are kept LZ4-compressed in
    an unnamed temporary file (``_Stash``) and read back from there at the end."""
    take = out if callable(out) else (lambda: out)
    segments = ckpt.segments
    if len(segments) == 2 and start < segments[0][1] - segments[0][0]:
        yield from _wrapped_blocks(ckpt, start, take)
        return
    pos = 0
    for lo, hi in segments:
        if pos + hi - lo <= start:
            pos += hi - lo
            continue
        skip = max(0, start - pos)
        with _open_column(ckpt.files, "observation", ckpt.number) as reader:
            reader.skip_rows(lo + skip)
            yield from _read_blocks(reader, lo + skip, hi, take, pos - lo)
        pos += hi - lo


def _read_blocks(reader: NpyReader, row: int, end: int, take: Callable[[], np.ndarray], shift: int):
    """Rows ``row .. end`` of the file, a block at a time (each into ``take()``), as ``(row + shift, frames)``."""
    while row < end:
        out = take()
        n = min(end - row, out.shape[0])
        yield row + shift, reader.read_rows(out[:n])
        row += n


def _wrapped_blocks(ckpt: Checkpoint, start: int, take: Callable[[], np.ndarray]):
    (cursor, cap), _ = ckpt.segments
    with _Stash() as stash:
        with _open_column(ckpt.files, "observation", ckpt.number) as reader:
            scratch = take()
            for _, frames in _read_blocks(reader, 0, cursor, lambda: scratch, 0):  # the newest rows: last in run order
                stash.put(frames)
            reader.skip_rows(start)
            yield from _read_blocks(reader, cursor + start, cap, take, -cursor)
        row = cap - cursor  # the file was read to its end (its CRC checked); the newest rows follow
        for frames in stash.blocks(take):
            yield row, frames
            row += frames.shape[0]


class _Stopped(Exception):
    """The consumer of ``read_ahead_blocks`` stopped: the reading thread ends."""


def read_ahead_blocks(ckpt: Checkpoint, start: int, buffers: Sequence[np.ndarray],
                      inner: slice = slice(None)) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``iter_frame_blocks`` read by a thread one block ahead: ``(first row, frames, buffer)``, the frames read
    into ``buffer[inner]``, one of ``buffers`` in turn. A yielded buffer is the caller's until it asks for the
    next block; the thread fills the others meanwhile (gzip's inflate and the stash's LZ4 release the GIL, so
    the decompression runs beside the caller's work). Memory: the buffers, whatever the file holds. An error
    of the reader is raised here; a caller that stops early ends the thread (and its open files) first."""
    free: queue.Queue = queue.Queue()
    full: queue.Queue = queue.Queue()
    for b in buffers:
        free.put(b)
    taken: list = [None, True]  # the buffer the reader last took, and whether it went to the caller
    stop = threading.Event()

    def take() -> np.ndarray:
        if stop.is_set():
            raise _Stopped
        if not taken[1]:  # a buffer used and not handed over (the stash's scratch) is free again
            free.put(taken[0])
        buffer = free.get()
        if buffer is None:
            raise _Stopped
        taken[:] = [buffer, False]
        return buffer[inner]

    def read() -> None:
        try:
            for lo, frames in iter_frame_blocks(ckpt, start, take):
                taken[1] = True  # every block is read into the buffer taken last
                full.put((lo, frames, taken[0]))
        except _Stopped:
            return
        except BaseException as exc:  # noqa: BLE001  (raised in the consumer)
            full.put((None, None, exc))
            return
        full.put((None, None, None))

    thread = threading.Thread(target=read, name=f"mmreplay-dqn-read-{ckpt.number}", daemon=True)
    thread.start()
    try:
        while True:
            lo, frames, buffer_or_error = full.get()
            if frames is None:
                if buffer_or_error is not None:
                    raise buffer_or_error
                return
            yield lo, frames, buffer_or_error
            free.put(buffer_or_error)
    finally:
        stop.set()
        free.put(None)
        thread.join()


class _Stash:
    """Blocks of frames kept LZ4-compressed in an unnamed temporary file (gone with the process)."""

    def __init__(self):
        import tempfile

        from numcodecs import LZ4

        self._codec = LZ4(acceleration=1)
        self._file = tempfile.TemporaryFile(prefix="mmreplay-dqn-")
        self._blocks: list[tuple[int, int]] = []  # (rows, compressed bytes)

    def put(self, frames: np.ndarray) -> None:
        data = self._codec.encode(np.ascontiguousarray(frames))
        self._file.write(data)
        self._blocks.append((frames.shape[0], len(data)))

    def blocks(self, take: Callable[[], np.ndarray]) -> Iterator[np.ndarray]:
        self._file.seek(0)
        for rows, nbytes in self._blocks:
            out = take()[:rows]
            self._codec.decode(self._file.read(nbytes), out=out)
            yield out

    def __enter__(self) -> "_Stash":
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


def pack_frame(frame: np.ndarray) -> str:
    """A frame as short JSON text (zlib, base64): a held row in a store's app metadata."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(frame).tobytes(), 6)).decode()


def unpack_frame(text: str, shape: tuple[int, ...]) -> np.ndarray:
    raw = zlib.decompress(base64.b64decode(text), bufsize=int(np.prod(shape)))
    return np.frombuffer(raw, np.uint8).reshape(shape).copy()


def invalid_range(cursor: int, capacity: int, stack_size: int, update_horizon: int) -> np.ndarray:
    """Dopamine's ``invalid_range`` (as its checkpoint stores it)."""
    return np.array([(cursor - update_horizon + i) % capacity for i in range(stack_size + update_horizon)])
