"""Dopamine's replay checkpoints (the DQN Replay Dataset) to and from a store, streamed in bounded RAM.

A Dopamine ``OutOfGraphReplayBuffer`` checkpoint ``N`` is a directory of gzip'd ``.npy`` files:
``$store$_{observation,action,reward,terminal}_ckpt.N.gz`` (one row per *add*: frame ``(H, W)`` uint8,
action int32, reward float32, terminal uint8), ``add_count_ckpt.N.gz`` (adds so far, padding included) and
``invalid_range_ckpt.N.gz``. The buffer is circular: row ``g`` of the run (its ``g``-th add) lives at
``g % capacity``; the oldest held row is at the cursor ``add_count % capacity`` once the buffer wrapped.
Before each episode Dopamine adds ``stack_size - 1`` all-zero *padding* rows, and stacks of ``stack_size``
rows are rebuilt at sample time, so an episode's first stacks hold zeros: the store keeps each frame once
and is made with ``stack_padding="zeros"``, which gives the same stacks. A terminal step's final
observation is not in the format; Dopamine's next state for it ends in the zero padding row that follows,
so the store's next observation for it is the zero frame, and its next stack equals Dopamine's.

Invariants:
- Rows are consumed in the run's order (``g``), across checkpoints: a checkpoint overlapping rows already
  imported continues after them; one starting later (a gap) starts a new stream, and the row before the
  gap (no next observation) is kept only in the app metadata. The newest row of the last checkpoint
  read has no next observation yet either: it waits in the app metadata (``pending``) for the next
  checkpoint, and the export writes it back.
- A padding row must be all zeros (frame, action, reward, terminal), else the import stops naming the row:
  the buffer was saved with another ``stack_size`` (checked first against ``invalid_range``).
- Memory: the small columns of one checkpoint (~9 bytes a row) and one block of frames
  (``BLOCK_BYTES``). Every header is checked before any allocation (``npy_stream.py``).
- Resumable and atomic: the import writes through ``importing.EpisodeWriter`` into the sibling directory
  that ``outputs.staged`` renames onto ``OUT`` only when every asked checkpoint is in. The store commits
  only where this module says (``flush(app_meta=...)``, every ``commit_rows`` transitions and at each
  checkpoint's end), and every commit's app metadata (``dqn_replay``) names the checkpoint and row the
  next one starts at, so a killed import rerun with ``resume=True`` continues in that sibling exactly
  where its last commit ended and gives the same store as an uninterrupted run.
- Sampling a store made here draws every transition Dopamine's ``sample_transition_batch`` can draw from
  the same checkpoints, with equal stacks, action, reward, terminal and next stack; it also draws the
  ``stack_size`` rows after the cursor of a wrapped checkpoint that starts a run (Dopamine's
  ``invalid_range`` leaves them out; their stacks start at the oldest held row with zeros before it).
"""

from __future__ import annotations

import base64
import os
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mmreplay.datasets.npy_stream import (
    NpyFormatError,
    NpyReader,
    NpyWriter,
    save_small,
)

ProgressFn = Callable[[int, int], None]

STORE_PREFIX = "$store$_"
COLUMNS = ("observation", "action", "reward", "terminal")
_FILE = re.compile(r"^(\$store\$_(?:observation|action|reward|terminal)|add_count|invalid_range)_ckpt\.(\d+)\.gz$")
#: frames a block holds at most, in bytes (one block of frames is most of the import's memory)
BLOCK_BYTES = 32 << 20
#: transitions between two commits (each names where a resumed import starts)
COMMIT_ROWS = 100_000
#: distinct rewards at most for a packed reward column (the DQN Replay Dataset's are clipped to -1, 0, 1)
MAX_PACKED_REWARDS = 16
DEFAULT_STACK = 4
META_KEY = "dqn_replay"
META_VERSION = 1


# -- the directory --------------------------------------------------------------------------------
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
    return SmallColumns(cols["action"].astype(np.int64), cols["reward"].astype(np.float32), term.astype(bool))


def iter_frame_blocks(ckpt: Checkpoint, start: int, out: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, frames)`` blocks of the checkpoint's frames in the run's order from row ``start``,
    read into ``out`` (reused: a block is valid until the next one). The gzip stream is decompressed once:
    a wrapped checkpoint's file holds its newest rows first, so on the way to the oldest (the cursor) they
    are kept LZ4-compressed in an unnamed temporary file (``_Stash``) and read back from there at the end."""
    segments = ckpt.segments
    if len(segments) == 2 and start < segments[0][1] - segments[0][0]:
        yield from _wrapped_blocks(ckpt, start, out)
        return
    pos = 0
    for lo, hi in segments:
        if pos + hi - lo <= start:
            pos += hi - lo
            continue
        skip = max(0, start - pos)
        with _open_column(ckpt.files, "observation", ckpt.number) as reader:
            reader.skip_rows(lo + skip)
            yield from _read_blocks(reader, lo + skip, hi, out, pos - lo)
        pos += hi - lo


def _read_blocks(reader: NpyReader, row: int, end: int, out: np.ndarray, shift: int):
    """Rows ``row .. end`` of the file, a block at a time, as ``(row + shift, frames)``."""
    while row < end:
        n = min(end - row, out.shape[0])
        yield row + shift, reader.read_rows(out[:n])
        row += n


def _wrapped_blocks(ckpt: Checkpoint, start: int, out: np.ndarray):
    (cursor, cap), _ = ckpt.segments
    with _Stash() as stash:
        with _open_column(ckpt.files, "observation", ckpt.number) as reader:
            for _, frames in _read_blocks(reader, 0, cursor, out, 0):  # the newest rows: last in run order
                stash.put(frames)
            reader.skip_rows(start)
            yield from _read_blocks(reader, cursor + start, cap, out, -cursor)
        row = cap - cursor  # the file was read to its end (its CRC checked); the newest rows follow
        for frames in stash.blocks(out):
            yield row, frames
            row += frames.shape[0]


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

    def blocks(self, out: np.ndarray) -> Iterator[np.ndarray]:
        self._file.seek(0)
        for rows, nbytes in self._blocks:
            self._codec.decode(self._file.read(nbytes), out=out[:rows])
            yield out[:rows]

    def __enter__(self) -> "_Stash":
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


# -- import ---------------------------------------------------------------------------------------
@dataclass
class Cursor:
    """Where the import stands (committed in the app metadata): the next run row ``global_next`` to
    consume, the padding rows still expected before it (None: unknown, a new stream starts and looks),
    the writer's stream, the held row waiting for its next observation."""

    global_next: int | None = None
    pads_left: int | None = None
    stream: int = 0
    pending: dict[str, Any] | None = None
    transitions: int = 0
    episodes: int = 0
    segments: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)


def _pack_frame(frame: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.ascontiguousarray(frame).tobytes(), 6)).decode()


def _unpack_frame(text: str, shape: tuple[int, ...]) -> np.ndarray:
    raw = zlib.decompress(base64.b64decode(text), bufsize=int(np.prod(shape)))
    return np.frombuffer(raw, np.uint8).reshape(shape).copy()


class _CheckpointImport:
    """Turns one checkpoint's rows, from row ``first`` on, into the writer's episode pieces (see the module
    invariants). ``pads_left``: padding rows expected at ``first`` (None: a new stream, found by looking)."""

    def __init__(self, ckpt: Checkpoint, cols: SmallColumns, cursor: Cursor, writer, stack: int,
                 first: int, pads_left: int | None, base: int):
        self.ckpt, self.cols, self.cursor, self.writer, self.k = ckpt, cols, cursor, writer, stack
        self.first, self.pads_left, self.base = first, pads_left, base
        self.n = ckpt.rows
        self.mask: np.ndarray | None = None

    def pad_mask(self) -> np.ndarray:
        """Padding rows among rows ``first .. n + k - 1`` (those past ``n`` are the next checkpoint's)."""
        n, k = self.n, self.k
        mask = np.zeros(n + k - self.first, bool)
        mask[: self.pads_left] = True
        term = np.flatnonzero(self.cols.terminal[self.first:])
        if term.size and k > 1:
            idx = (term[:, None] + np.arange(1, k)).ravel()
            mask[idx[idx < mask.size]] = True
        rows = np.flatnonzero(mask[: n - self.first]) + self.first
        c = self.cols
        bad = rows[(c.action[rows] != 0) | (c.reward[rows] != 0) | c.terminal[rows]]
        if bad.size:
            raise NpyFormatError(self._not_padding(int(bad[0]), "action/reward/terminal"))
        return mask

    def _not_padding(self, row: int, what: str) -> str:
        return (f"checkpoint {self.ckpt.number} row {self._physical(row)}: expected Dopamine's all-zero padding "
                f"row (the {self.k - 1} rows before each episode) but its {what} is not zero: was the buffer saved "
                f"with another stack_size than {self.k}?")

    def _physical(self, row: int) -> int:
        for lo, hi in self.ckpt.segments:
            if row < hi - lo:
                return lo + row
            row -= hi - lo
        return row

    def detect_padding(self, frames: np.ndarray) -> int:
        """At a new stream: the leading all-zero rows (at most ``k - 1``) are the end of an episode's padding
        (its first padding rows were overwritten). Were one a real all-zero frame instead, its stacks and
        the export are the same: zeros either way."""
        c, j = self.cols, 0
        while j < min(self.k - 1, frames.shape[0]):
            r = self.first + j
            if frames[j].any() or c.action[r] or c.reward[r] or c.terminal[r]:
                break
            j += 1
        return j

    def blocks(self, buffer: np.ndarray, progress: Callable[[int], None]) -> Iterator[None]:
        """Read and write block by block; yields after each (the cursor then names a resume point).
        ``buffer``: ``(block + 2, H, W)`` uint8; its row 0 holds the carried row (read, not yet written), the
        rows after it the block, and one more row for a zero next frame."""
        carry = False
        for lo, frames in iter_frame_blocks(self.ckpt, self.first, buffer[1:-1]):
            if self.mask is None:
                if self.pads_left is None:
                    self.pads_left = self.detect_padding(frames)
                    self.cursor.segments[-1]["lead_pads"] = self.pads_left
                self.mask = self.pad_mask()
            if self.cursor.pending is not None:
                self._write_held(frames[0])
            hi = lo + frames.shape[0]
            pad = self.mask[lo - self.first: hi - self.first]
            self._check_pad_frames(frames, pad, lo)
            offset = 1 - lo  # buffer row of run row r (row 0: the carried row lo - 1)
            rows = np.flatnonzero(~pad) + lo
            if carry:
                rows = np.concatenate([[lo - 1], rows])
            carry = self._write_rows(rows, hi, buffer, offset)
            if carry:
                buffer[0] = buffer[int(rows[-1]) + offset]
            self._advance(int(rows[-1]) if carry else hi, carry)
            progress(hi)
            yield

    def _write_held(self, next_frame: np.ndarray) -> None:
        """The previous checkpoint's newest row (``pending``), now that its next frame, this checkpoint's row
        ``first``, is read (never a padding row: the held row is not terminal)."""
        held, cursor = self.cursor.pending, self.cursor
        if self.mask[0]:
            raise NpyFormatError(self._not_padding(self.first, "place (it follows a non-terminal row)"))
        frame = _unpack_frame(held["frame"], next_frame.shape)
        self.writer.write(frame[None], np.array([held["action"]]), np.array([held["reward"]], np.float32),
                          next_frame[None], np.zeros(1, bool), np.zeros(1, bool), end=False)
        cursor.transitions += 1
        cursor.pending = None

    def _check_pad_frames(self, frames: np.ndarray, pad: np.ndarray, lo: int) -> None:
        at = np.flatnonzero(pad)
        if at.size:
            dirty = frames[at].reshape(at.size, -1).any(axis=1)
            if dirty.any():
                raise NpyFormatError(self._not_padding(lo + int(at[np.argmax(dirty)]), "frame"))

    def _write_rows(self, rows: np.ndarray, hi: int, buffer: np.ndarray, offset: int) -> bool:
        """Write the real ``rows`` (ascending) whose next frame is known; returns whether the last one waits
        for its next frame (the next block's first row, or the next checkpoint's: then ``pending``)."""
        c = self.cols
        carry = bool(rows.size) and not c.terminal[rows[-1]] and rows[-1] == hi - 1
        if carry and hi == self.n:
            last = int(rows[-1])
            self.cursor.pending = {"action": int(c.action[last]), "reward": float(c.reward[last]),
                                   "frame": _pack_frame(buffer[last + offset]), "global": self.base + last}
        done = rows[:-1] if carry else rows
        if done.size == 0:
            return carry
        buffer[hi + offset] = 0  # the row after the block: a terminal last row's next state (zero padding)
        term = c.terminal[done]
        start = 0
        for end in [*(np.flatnonzero(term) + 1).tolist(), done.size]:
            if end > start:
                first, last = int(done[start]), int(done[end - 1])
                if last - first != end - start - 1:
                    raise AssertionError(f"checkpoint {self.ckpt.number}: rows {first}..{last} of one episode are "
                                         "not consecutive")
                finished = bool(term[end - 1])
                # Views of the buffer (the store copies what it keeps): row r's next frame is row r + 1, and
                # after a terminal row comes a padding row, all zero (checked), or the zeroed row above.
                obs, nxt = buffer[first + offset: last + 1 + offset], buffer[first + 1 + offset: last + 2 + offset]
                if finished and nxt[-1].any():  # frame_stack 1: no padding; the next episode's frame follows
                    nxt = nxt.copy()
                    nxt[-1] = 0
                part = slice(first, last + 1)
                self.writer.write(obs, c.action[part], c.reward[part], nxt, c.terminal[part],
                                  np.zeros(end - start, bool), end=finished)
                self.cursor.transitions += end - start
                self.cursor.episodes += int(finished)
            start = end
        return carry

    def _advance(self, row: int, carry: bool) -> None:
        """The cursor after a block: ``row`` is the first row not consumed (the carried one, if any)."""
        cur = self.cursor
        if carry and row == self.n - 1:  # the held row is in ``pending``
            cur.global_next, cur.pads_left = self.base + self.n, 0
            return
        cur.global_next = self.base + row
        rel, run = row - self.first, 0
        while not carry and rel + run < self.mask.size and self.mask[rel + run]:
            run += 1
        cur.pads_left = run


def _reward_values(rewards: np.ndarray, given):
    if given is not None:
        return list(given)
    values = np.unique(rewards)
    if set(values.tolist()) <= {-1.0, 0.0, 1.0}:
        return [-1.0, 0.0, 1.0]  # the dataset's clipping: a later checkpoint (resume) fits too
    return values.tolist() if values.size <= MAX_PACKED_REWARDS else None


def import_dqn_replay(src, path, *, checkpoints: str | Sequence[int] | None = None, resume: bool = False,
                      frame_stack: int | None = None, num_actions: int | None = None,
                      reward_values: Sequence[float] | None = None, frame_codec: Any = "delta-zstd",
                      capacity: int | None = None, commit_rows: int = COMMIT_ROWS, block_bytes: int = BLOCK_BYTES,
                      progress: ProgressFn | None = None, **store_kwargs) -> dict[str, Any]:
    """A new store at ``path`` from the Dopamine replay directory ``src`` (see the module docstring).

    ``checkpoints``: ``"0,1,5-9"``, a list, or None (all). ``resume``: continue a killed import of the same
    command from its last commit (its sibling directory), else start over. ``frame_stack``: Dopamine's
    ``stack_size`` (default: inferred from ``invalid_range``, else 4). ``num_actions``: the action space's
    size (default: the largest action read + 1; 18 for Atari's full set). ``reward_values``: the packed
    reward column (default: -1, 0, 1 when the rewards are clipped). Other keyword arguments go to
    ``Store.create``."""
    from mmreplay.datasets.importing import EpisodeWriter

    plan = _plan(os.fspath(src), checkpoints, frame_stack, num_actions, reward_values)
    # durable=False: no fsync at each commit (a killed process still finds every commit whole); the whole
    # store is made durable once, before its rename (outputs.staged). A power loss mid-import may leave a
    # sibling that does not resume: the import then starts over.
    store_kwargs = {"capacity": capacity, "frame_stack": plan.stack, "stack_padding": "zeros",
                    "frame_codec": frame_codec, "reward_values": plan.reward_values, "durable": False, **store_kwargs,
                    "commit_every": 1 << 62, "commit_seconds": float("inf")}  # commits: only ours (resume points)
    with EpisodeWriter(path, plan.observation_space, plan.action_space, store_kwargs, resume=resume,
                       resumable=True) as writer:
        store = writer.open()
        cursor = _restore_cursor(store, plan) if writer.resumed else Cursor()
        writer.stream = cursor.stream
        _run(plan, writer, cursor, block_bytes, commit_rows, progress)
    if progress:
        progress(plan.rows, plan.rows)
    return {"format": "dqn-replay", "path": os.path.abspath(os.fspath(path)), "checkpoints": plan.numbers,
            "transitions": cursor.transitions, "episodes": cursor.episodes, "frame_stack": plan.stack,
            "pending_row": cursor.pending is not None, "resumed": writer.resumed, "notes": plan.notes + writer.notes}


@dataclass
class _Plan:
    """What an import reads and makes, decided from the headers and small columns before anything is written."""

    src: str
    numbers: list[int]
    checkpoints: list[Checkpoint]
    stack: int
    observation_space: Any
    action_space: Any
    reward_values: list[float] | None
    notes: list[str]

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.checkpoints)

    @property
    def frame_shape(self) -> tuple[int, ...]:
        return self.checkpoints[0].frame_shape


def _plan(src: str, checkpoints, frame_stack: int | None, num_actions: int | None, reward_values) -> _Plan:
    from gymnasium import spaces

    files = checkpoint_files(src)
    numbers = parse_checkpoints(checkpoints, list(files))
    ckpts = [read_checkpoint(n, files[n]) for n in numbers]
    shape = ckpts[0].frame_shape
    for c in ckpts:
        if c.frame_shape != shape:
            raise NpyFormatError(f"checkpoint {c.number}: frames of shape {c.frame_shape}, checkpoint "
                                 f"{ckpts[0].number} has {shape}")
    max_action, rewards = _scan_values(ckpts)
    if num_actions is not None and num_actions <= max_action:
        raise ValueError(f"num_actions {num_actions}: the checkpoints hold action {max_action}; expected "
                         f"num_actions >= {max_action + 1}")
    return _Plan(src, numbers, ckpts, _stack_size(ckpts, frame_stack), spaces.Box(0, 255, shape, np.uint8),
                 spaces.Discrete(int(num_actions or max_action + 1)), _reward_values(rewards, reward_values),
                 [note for c in ckpts for note in c.notes])


def _run(plan: _Plan, writer, cursor: Cursor, block_bytes: int, commit_rows: int, progress: ProgressFn | None) -> None:
    """Import the plan's checkpoints from ``cursor`` on, committing the cursor with the data (see the module
    invariants); a failure commits what is stored when the cursor names exactly that, so it resumes."""
    store = writer.store
    last_commit = [cursor.transitions]

    def commit(complete: bool = False) -> None:
        store.flush(app_meta={**store.app_meta, META_KEY: _meta(cursor, plan, complete)})
        last_commit[0] = cursor.transitions

    if not writer.resumed:
        commit()  # a state from the start: an import killed before its first block still resumes
    block = max(1, block_bytes // max(1, int(np.prod(plan.frame_shape))))
    buffer = np.empty((block + 2, *plan.frame_shape), np.uint8)
    before = 0
    try:
        for ckpt in plan.checkpoints:
            report = lambda row, base=before: progress and progress(base + row, plan.rows)  # noqa: E731
            before += ckpt.rows
            if any(c["number"] == ckpt.number and c["done"] for c in cursor.checkpoints):
                continue
            for _ in _import_checkpoint(ckpt, cursor, writer, plan.stack, buffer, plan.notes, report):
                if cursor.transitions - last_commit[0] >= commit_rows:
                    commit()
            commit()
        commit(complete=True)
    except BaseException as exc:
        if store.num_added == cursor.transitions:  # a commit naming exactly what is stored: resumable
            commit()
            exc.add_note(f"the import committed up to run row {cursor.global_next} in {store.path!r}: rerun it "
                         "with resume (--resume) to continue there, or without to start over")
        raise


def _stack_size(ckpts: Sequence[Checkpoint], frame_stack: int | None) -> int:
    seen = {c.stack_size for c in ckpts if c.stack_size is not None}
    if len(seen) > 1:
        raise NpyFormatError(f"checkpoints were saved with different stack sizes {sorted(seen)} (their invalid_range)")
    if frame_stack is not None and seen and frame_stack not in seen:
        raise ValueError(f"frame_stack {frame_stack}: the checkpoints were saved with stack_size {seen.pop()} (their "
                         "invalid_range); their padding rows would be misread")
    k = frame_stack or (seen.pop() if seen else DEFAULT_STACK)
    if k < 1:
        raise ValueError(f"frame_stack {k}: expected >= 1")
    return k


def _scan_values(ckpts: Sequence[Checkpoint]) -> tuple[int, np.ndarray]:
    """The largest action and the distinct rewards of the checkpoints (their small columns, read once)."""
    max_action, rewards = 0, np.zeros(0, np.float32)
    for c in ckpts:
        cols = read_small_columns(c)
        if cols.action.size:
            max_action = max(max_action, int(cols.action.max()))
        rewards = np.union1d(rewards, np.unique(cols.reward))[: 1 << 12]  # enough to tell "too many to pack"
    return max_action, rewards


def _import_checkpoint(ckpt: Checkpoint, cursor: Cursor, writer, k: int, buffer: np.ndarray, notes: list[str],
                       progress: Callable[[int], None]) -> Iterator[None]:
    """Consume one checkpoint's rows; yields after each block (a place where a commit may go)."""
    entry = next((c for c in cursor.checkpoints if c["number"] == ckpt.number), None)
    if entry is None:
        entry = {"number": ckpt.number, "add_count": ckpt.add_count, "capacity": ckpt.capacity, "done": False}
        cursor.checkpoints.append(entry)
    if ckpt.rows == 0:
        entry["done"] = True
        return
    gs = ckpt.first_global
    ge = None if gs is None else gs + ckpt.rows
    fresh = gs is None or cursor.global_next is None or gs > cursor.global_next
    if not fresh and ge <= cursor.global_next:
        notes.append(f"checkpoint {ckpt.number}: every row was already imported from an earlier checkpoint")
        entry["done"] = True
        return
    cols = read_small_columns(ckpt)
    if fresh:
        _end_stream(cursor, writer, notes, ckpt)
        start = gs if gs is not None else (cursor.global_next or 0)
        cursor.segments.append({"global": start, "first_row": 0, "first_id": cursor.transitions,
                                "lead_pads": None, "pending": None})
        first, pads_left = 0, None
    else:
        first, pads_left = cursor.global_next - gs, cursor.pads_left
    base = gs if gs is not None else cursor.segments[-1]["global"]
    entry["first_global"] = base
    job = _CheckpointImport(ckpt, cols, cursor, writer, k, first, pads_left, base)
    yield from job.blocks(buffer, progress)
    entry["done"] = True


def _end_stream(cursor: Cursor, writer, notes: list[str], ckpt: Checkpoint) -> None:
    """Before a new stream (a gap, or no add_count): the episode in progress ends unfinished; its held row
    stays in its segment's metadata (the export writes it back)."""
    if not cursor.segments:
        return
    if cursor.pending is not None:
        cursor.segments[-1]["pending"] = cursor.pending
        notes.append(f"checkpoint {ckpt.number} starts after a gap in the run's rows: the row before the gap "
                     "(global row {}) has no next observation and is not a transition".format(cursor.pending["global"]))
        cursor.pending = None
    writer.write(*_empty_piece(writer), end=True)  # the next rows never continue this episode
    cursor.stream = writer.stream


def _empty_piece(writer):
    store = writer.store
    shape = store.observation_space.shape
    empty = np.zeros((0, *shape), np.uint8)
    return empty, np.zeros(0, np.int64), np.zeros(0, np.float32), empty, np.zeros(0, bool), np.zeros(0, bool)


def _meta(cursor: Cursor, plan: _Plan, complete: bool) -> dict[str, Any]:
    return {"version": META_VERSION, "source": os.path.abspath(plan.src), "asked": list(plan.numbers),
            "stack_size": plan.stack, "complete": complete, **asdict(cursor)}


def _restore_cursor(store, plan: _Plan) -> Cursor:
    meta = store.app_meta.get(META_KEY)
    if not meta or meta.get("version") != META_VERSION:
        raise ValueError(f"cannot resume into {store.path!r}: its last commit holds no dqn-replay import state: "
                         "rerun without resume")
    if meta["asked"] != list(plan.numbers) or meta["stack_size"] != plan.stack:
        raise ValueError(f"cannot resume: the interrupted import asked for checkpoints {meta['asked']} with stack "
                         f"{meta['stack_size']}, this one for {list(plan.numbers)} with stack {plan.stack}: rerun it "
                         "as it was, or without resume")
    if store.num_added != meta["transitions"]:
        raise ValueError(f"cannot resume into {store.path!r}: it holds {store.num_added} transitions, its import "
                         f"state says {meta['transitions']}: rerun without resume")
    return Cursor(**{f: meta[f] for f in Cursor.__dataclass_fields__})


# -- export ---------------------------------------------------------------------------------------
def invalid_range(cursor: int, capacity: int, stack_size: int, update_horizon: int) -> np.ndarray:
    """Dopamine's ``invalid_range`` (as its checkpoint stores it)."""
    return np.array([(cursor - update_horizon + i) % capacity for i in range(stack_size + update_horizon)])


def export_dqn_replay(store, out, *, capacity: int | None = None, update_horizon: int = 1, block_rows: int = 1024,
                      progress: ProgressFn | None = None) -> dict[str, Any]:
    """Write the store as Dopamine checkpoints into the new directory ``out`` (see the module docstring).
    A store made by ``import_dqn_replay`` gives back its checkpoints' arrays exactly; any other store is
    laid out as Dopamine would have added its episodes, ``capacity`` (default 1,000,000) rows a checkpoint."""
    from mmreplay.datasets.episodes import list_episodes
    from mmreplay.datasets.outputs import staged

    space = store.observation_space
    if store.schema.dict_obs or len(space.shape) != 2 or np.dtype(space.dtype) != np.uint8:
        raise ValueError(f"Dopamine checkpoints hold 2-D uint8 frames; this store's observations are {space}")
    if not hasattr(store.action_space, "n"):
        raise ValueError(f"Dopamine checkpoints hold integer actions; this store's action space is {store.action_space}")
    k = store.frame_stack
    # a block reads each transition's two stacks: bound it by bytes, whatever block_rows says
    block_rows = max(1, min(block_rows, BLOCK_BYTES // (2 * k * max(1, int(np.prod(space.shape))))))
    meta = store.app_meta.get(META_KEY)
    notes: list[str] = []
    if meta and store.inspect.valid_range()[0] > 0:  # a bounded store dropped imported rows: no exact layout
        notes.append("the store no longer holds every imported transition (its capacity wrapped): laid out anew, "
                     "not as the imported checkpoints")
        meta = None
    listing = list_episodes(store, include_partial=True)
    layout = _layout(listing, meta, k, capacity, _truncated_ends(store, listing))
    notes += list(listing.notes) + layout.notes
    steps, episodes = listing.steps, len(listing.episodes)
    del listing  # its per-episode id arrays: the layout holds them concatenated (8 bytes a transition)
    with staged(out, "exporting") as staging:
        os.mkdir(staging.path)
        total = sum(c["capacity"] for c in layout.checkpoints)
        done = 0
        for entry in layout.checkpoints:
            _write_checkpoint(store, staging.path, entry, layout, k, update_horizon, block_rows,
                              lambda n, base=done: progress and progress(base + n, total))
            done += entry["capacity"]
        notes += staging.notes
    return {"format": "dqn-replay", "path": os.path.abspath(os.fspath(out)),
            "checkpoints": [c["number"] for c in layout.checkpoints], "transitions": steps, "episodes": episodes,
            "notes": notes}


@dataclass
class _Layout:
    """Where each transition lies in the run: episode ``e``'s step ``j`` is row ``starts[e] + j``."""

    starts: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray  # every episode's ids, concatenated
    offsets: np.ndarray
    pending: dict[int, dict[str, Any]]  # run row -> the held row (action, reward, frame)
    checkpoints: list[dict[str, Any]]
    notes: list[str]


def _truncated_ends(store, listing) -> np.ndarray:
    """Per listed episode: it ends truncated, not terminated."""
    ends = np.array([int(e.ids[-1]) for e in listing.episodes], np.int64)
    if not ends.size:
        return np.zeros(0, bool)
    lo = int(ends.min())
    _, term, trunc = store.inspect.episode_links(lo, int(ends.max()) + 1)
    return trunc[ends - lo] & ~term[ends - lo]


def _layout(listing, meta, k: int, capacity: int | None, truncated_ends: np.ndarray) -> _Layout:
    eps = listing.episodes
    lengths = np.array([len(e) for e in eps], np.int64)
    ids = np.concatenate([e.ids for e in eps]) if eps else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if eps else np.zeros(0, np.int64)
    segments = meta["segments"] if meta else [{"global": 0, "first_id": None, "lead_pads": k - 1, "pending": None}]
    if meta and meta.get("pending"):
        segments = [*segments[:-1], {**segments[-1], "pending": meta["pending"]}]
    first_ids = [int(e.ids[0]) for e in eps]
    starts = np.zeros(len(eps), np.int64)
    pending: dict[int, dict[str, Any]] = {}
    notes: list[str] = []
    end = 0
    e = 0
    for s, seg in enumerate(segments):
        nxt_first = segments[s + 1]["first_id"] if s + 1 < len(segments) else None
        pos = seg["global"] + int(seg.get("lead_pads") or 0)
        while e < len(eps) and (nxt_first is None or first_ids[e] < nxt_first):
            starts[e] = pos
            pos += lengths[e]
            end = pos  # the run ends at the last real row (padding comes only before a next episode)
            if eps[e].ended:
                pos += k - 1  # the next episode's padding (Dopamine adds it before each episode)
            e += 1
        if seg.get("pending"):
            pending[pos] = seg["pending"]
            pos += 1
            end = pos
    truncated = int(truncated_ends.sum())
    if truncated:
        notes.append(f"{truncated} episode(s) end truncated: Dopamine's checkpoints mark terminals only, so "
                     "their last step's next state is the next episode's zero padding")
    if meta:
        checkpoints = [dict(c) for c in meta["checkpoints"]]
        if capacity is not None and any(c["capacity"] != capacity for c in checkpoints):
            raise ValueError(f"capacity {capacity}: this store was imported from checkpoints of "
                             f"{sorted({c['capacity'] for c in checkpoints})} rows; leave capacity out")
    else:
        cap = int(capacity or 1_000_000)
        rows = int(end)
        if rows == 0:
            raise ValueError("the store holds no transition to export")
        checkpoints = [{"number": i, "capacity": cap, "add_count": min((i + 1) * cap, rows)}
                       for i in range(-(-rows // cap))]
        notes.append("final observations are not in Dopamine's format: each episode's last next observation is "
                     "left out (a terminal step's next state is the zero padding)")
    return _Layout(starts, lengths, ids, offsets, pending, checkpoints, notes)


def _write_checkpoint(store, directory: str, entry: dict[str, Any], layout: _Layout, k: int, update_horizon: int,
                      block_rows: int, progress: Callable[[int], None]) -> None:
    from mmreplay.sampling.batch import BatchBuffers

    cap, add_count, number = int(entry["capacity"]), entry["add_count"], entry["number"]
    shape = tuple(store.observation_space.shape)
    held = cap if add_count is None else min(add_count, cap)
    first = int(entry.get("first_global") or 0) if add_count is None else max(0, add_count - cap)
    run_rows = np.arange(first, first + held, dtype=np.int64)
    physical = run_rows % cap if add_count is not None else run_rows - first  # no add_count: file order
    source = _sources(layout, run_rows)  # transition id, or -1 padding / unfilled, or -2 - i a held row
    plan = np.full(cap, -1, np.int64)
    plan[physical] = source
    action = np.zeros(cap, np.int32)
    reward = np.zeros(cap, np.float32)
    terminal = np.zeros(cap, np.uint8)
    held_rows = {-2 - i: v for i, v in enumerate(layout.pending.values())}
    path = lambda name: os.path.join(directory, f"{name}_ckpt.{number}.gz")
    with NpyWriter(path(STORE_PREFIX + "observation"), (cap, *shape), np.uint8) as obs_file:
        for lo in range(0, cap, block_rows):
            hi = min(cap, lo + block_rows)
            part = plan[lo:hi]
            frames = np.zeros((hi - lo, *shape), np.uint8)
            rows = np.flatnonzero(part >= 0)
            if rows.size:
                batch = store.inspect.get(part[rows], out=BatchBuffers(store.schema, rows.size, numpy=True))
                obs = batch.obs["obs"] if isinstance(batch.obs, dict) else batch.obs
                frames[rows] = obs[:, -1] if k > 1 else obs
                action[lo + rows] = np.asarray(batch.action)
                reward[lo + rows] = np.asarray(batch.reward)
                terminal[lo + rows] = np.asarray(batch.terminated)
            for r in np.flatnonzero(part <= -2):
                row = held_rows[int(part[r])]
                frames[r] = _unpack_frame(row["frame"], shape)
                action[lo + r], reward[lo + r] = row["action"], row["reward"]
            obs_file.write_rows(frames)
            progress(hi)
    save_small(path(STORE_PREFIX + "action"), action)
    save_small(path(STORE_PREFIX + "reward"), reward)
    save_small(path(STORE_PREFIX + "terminal"), terminal)
    count = held if add_count is None else add_count
    save_small(path("add_count"), np.array(count, np.int64))
    save_small(path("invalid_range"), invalid_range(count % cap, cap, k, update_horizon) if count
               else np.zeros(k, np.float64))


def _sources(layout: _Layout, run_rows: np.ndarray) -> np.ndarray:
    out = np.full(run_rows.size, -1, np.int64)
    if layout.starts.size:
        e = np.searchsorted(layout.starts, run_rows, side="right") - 1
        ok = e >= 0
        off = run_rows - layout.starts[np.maximum(e, 0)]
        ok &= off < layout.lengths[np.maximum(e, 0)]
        out[ok] = layout.ids[layout.offsets[e[ok]] + off[ok]]
    for i, row in enumerate(layout.pending):
        out[run_rows == row] = -2 - i
    return out
