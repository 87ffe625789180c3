"""Dopamine's replay checkpoints (the DQN Replay Dataset) into a new store, streamed in bounded RAM, resumable.

A Dopamine checkpoint holds the last ``capacity`` rows of a run (one row per *add*), circularly
(``dopamine_files.py``). Before each episode Dopamine adds ``stack_size - 1`` all-zero *padding* rows,
and stacks of ``stack_size`` rows are rebuilt at sample time, so an episode's first stacks hold zeros: the
store keeps each frame once and is made with ``stack_padding="zeros"``, which gives the same stacks. A terminal step's final
observation is not in the format; Dopamine's next state for it ends in the zero padding row that follows,
so the store's next observation for it is the zero frame, and its next stack equals Dopamine's.

Invariants:
- Rows are consumed in the run's order (``g``), across checkpoints: a checkpoint overlapping rows already
  imported continues after them; one starting later (a gap) starts a new stream, and the row before the
  gap (no next observation) is kept only in the app metadata. The newest row of a checkpoint has no
  next observation yet either: it waits in the cursor (``pending``) for the next checkpoint's first row;
  after the last checkpoint it stays in the app metadata, where the export finds it.
- A padding row must be all zeros (frame, action, reward, terminal), else the import stops naming the row:
  the buffer was saved with another ``stack_size`` (checked first against ``invalid_range``).
- Memory: the small columns of one checkpoint (~9 bytes a row), ``READ_AHEAD_BUFFERS`` blocks of frames
  (``BLOCK_BYTES`` each: one being written, the next being decompressed by the reading thread) and the
  store's index (~13 bytes a transition; ``IMPORT_CACHE_BYTES`` for reading: the written shards are not
  held; shards encoded by a thread, ``IMPORT_ENCODER``). The store is made with ``capacity`` = the asked checkpoints' rows
  (its index is allocated once, its pages touched as they fill: never grown by doubling, which held the
  old and new index at once) and ``frame_capacity`` = rows + terminals + checkpoints + 64 (each episode
  adds one frame, its zero next frame, beyond its rows): neither ring can wrap, and the import checks at
  its end that nothing was dropped (``RuntimeError`` otherwise). Every header is checked before any
  allocation (``dopamine_files.py``).
- Frames are coded ``DQN_FRAME_CODEC`` by default: runs of 8 frames, one zstd frame a run, with no search
  for references (see its comment).
- Resumable and atomic: the import writes through ``importing.EpisodeWriter`` into the sibling directory
  that ``outputs.staged`` renames onto ``OUT`` only when every asked checkpoint is in. The store commits
  only where this module says (``flush(app_meta=...)``, every ``commit_rows`` transitions and at each
  checkpoint's end), and every commit's app metadata (``dqn_replay``) names the checkpoint and row the
  next one starts at, so a killed import rerun with ``resume=True`` continues in that sibling exactly
  where its last commit ended and gives the same store as an uninterrupted run.
- Sampling a store made here draws every transition Dopamine's ``sample_transition_batch`` can draw from
  the same checkpoints, with equal stacks, action, reward, terminal and next stack. It also draws the rows
  Dopamine's ``invalid_range`` leaves out around a cursor: the oldest ``stack_size`` rows of the first
  checkpoint read (zeros before them in their stacks) and, between consecutive checkpoints, the newest row
  of one and the oldest ``stack_size`` of the next (their stacks are the run's rows).

The files are read by ``dopamine_files.py``; ``dqn_replay_export.py`` writes a store back as checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mmreplay._native.heap import release_free_heap
from mmreplay.datasets.dopamine_files import (
    Checkpoint,
    SmallColumns,
    checkpoint_files,
    pack_frame,
    parse_checkpoints,
    read_ahead_blocks,
    read_checkpoint,
    read_small_columns,
    unpack_frame,
)
from mmreplay.datasets.npy_stream import (
    NpyFormatError,
)

ProgressFn = Callable[[int, int], None]

#: frames a block holds at most, in bytes (``READ_AHEAD_BUFFERS`` of them are held). 2 MiB (~297 Atari frames):
#: 32 MiB blocks cost 48 MB more of peak RSS than 8 MiB, and 8 MiB 12 MB more than 2 MiB, which a 50M-transition
#: import has no room for (its index alone takes ~0.7 GB, issue #42: <= 1 GB); larger blocks bought nothing
#: measurable (the work a block does is per row; an episode longer than a block is written in more pieces)
BLOCK_BYTES = 2 << 20
#: blocks of frames in turn: one being written while the reading thread decompresses the next
READ_AHEAD_BUFFERS = 2
#: transitions between two commits (each names where a resumed import starts)
COMMIT_ROWS = 100_000
#: distinct rewards at most for a packed reward column (the DQN Replay Dataset's are clipped to -1, 0, 1)
MAX_PACKED_REWARDS = 16
DEFAULT_STACK = 4
#: the default frame codec: ``"delta-zstd"``'s runs of 8 frames, one zstd frame a run, without its search for
#: reference frames (``search: 0``). On real Atari frames (40k of the atari10m pool, runs of 8) zstd over the
#: run's frames as they are beat their differences in 95% of the runs: the search and second zstd pass it pays
#: for (~70% of the encoder's CPU) saved 0.13% of the bytes (96.8 against 96.96 B a frame). The same chunk
#: format: any reader of "delta-zstd" stores reads it.
DQN_FRAME_CODEC = {"name": "temporal", "level": 3, "run": 8, "search": 0}
#: ``capacity="rows"`` (the default): the store holds exactly the asked checkpoints' rows (see the invariants)
ROWS = "rows"
#: the import's ``cache_bytes`` (the store's reading budget, default 1 GiB without a memory limit): the import
#: never samples, and a writer's budget holds the shards it wrote, ~100 bytes a transition, until it is full
IMPORT_CACHE_BYTES = 32 << 20
#: the import's shard encoder (``Settings.encoder``): a thread of this process. The encoder child of
#: ``"process"`` costs a second interpreter and up to 96 MiB of shared staging queued for it (counted in both
#: processes' RSS): on 2 x 100k rows 247 against 392-409 MB of RSS, 27-30 against 31-32 us of CPU a
#: transition; zstd and the inflate run outside the GIL either way.
IMPORT_ENCODER = "thread"
META_KEY = "dqn_replay"
META_VERSION = 1


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

    def blocks(self, buffers: Sequence[np.ndarray], progress: Callable[[int], None]) -> Iterator[None]:
        """Read and write block by block; yields after each (the cursor then names a resume point).
        ``buffers``: ``(block + 2, H, W)`` uint8 each, filled in turn by the reading thread
        (``read_ahead_blocks``); in the one a block is in, row 0 takes the carried row (read, not yet
        written), the rows after it the block, and one more row a zero next frame."""
        carry = False
        carried = np.empty(buffers[0].shape[1:], np.uint8)
        for lo, frames, buffer in read_ahead_blocks(self.ckpt, self.first, buffers, slice(1, -1)):
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
                buffer[0] = carried
                rows = np.concatenate([[lo - 1], rows])
            carry = self._write_rows(rows, hi, buffer, offset)
            if carry:
                carried[...] = buffer[int(rows[-1]) + offset]
            self._advance(int(rows[-1]) if carry else hi, carry)
            progress(hi)
            yield

    def _write_held(self, next_frame: np.ndarray) -> None:
        """The previous checkpoint's newest row (``pending``), now that its next frame, this checkpoint's row
        ``first``, is read (never a padding row: the held row is not terminal)."""
        held, cursor = self.cursor.pending, self.cursor
        if self.mask[0]:
            raise NpyFormatError(self._not_padding(self.first, "place (it follows a non-terminal row)"))
        frame = unpack_frame(held["frame"], next_frame.shape)
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
                                   "frame": pack_frame(buffer[last + offset]), "global": self.base + last}
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
                      reward_values: Sequence[float] | None = None, frame_codec: Any = None,
                      capacity: int | str | None = ROWS, commit_rows: int = COMMIT_ROWS, block_bytes: int = BLOCK_BYTES,
                      progress: ProgressFn | None = None, **store_kwargs) -> dict[str, Any]:
    """A new store at ``path`` from the Dopamine replay directory ``src`` (see the module docstring).

    ``checkpoints``: ``"0,1,5-9"``, a list, or None (all). ``resume``: continue a killed import of the same
    command from its last commit (its sibling directory), else start over. ``frame_stack``: Dopamine's
    ``stack_size`` (default: inferred from ``invalid_range``, else 4). ``num_actions``: the action space's
    size (default: the largest action read + 1; 18 for Atari's full set). ``reward_values``: the packed
    reward column (default: -1, 0, 1 when the rewards are clipped). ``capacity``: ``"rows"`` (default) the
    checkpoints' rows, so the index is allocated once and nothing is dropped; an int or None (unbounded, grown
    by doubling) as for ``Store.create``. ``frame_codec``: default ``DQN_FRAME_CODEC``. Other keyword arguments
    go to ``Store.create``."""
    from mmreplay.datasets.importing import EpisodeWriter

    plan = _plan(os.fspath(src), checkpoints, frame_stack, num_actions, reward_values)
    sized = capacity == ROWS
    if sized:
        capacity = max(1, plan.rows)
        store_kwargs.setdefault("frame_capacity", capacity + plan.terminals + len(plan.checkpoints) + 64)
    elif isinstance(capacity, str):
        raise ValueError(f"capacity {capacity!r}: expected {ROWS!r} (the checkpoints' rows), a positive integer "
                         "or None (unbounded)")
    # durable=False: no fsync at each commit (a killed process still finds every commit whole); the whole
    # store is made durable once, before its rename (outputs.staged). A power loss mid-import may leave a
    # sibling that does not resume: the import then starts over.
    store_kwargs = {"capacity": capacity, "frame_stack": plan.stack, "stack_padding": "zeros",
                    "frame_codec": DQN_FRAME_CODEC if frame_codec is None else frame_codec,
                    "reward_values": plan.reward_values, "durable": False, "cache_bytes": IMPORT_CACHE_BYTES,
                    "encoder": IMPORT_ENCODER, **store_kwargs,
                    "commit_every": 1 << 62, "commit_seconds": float("inf")}  # commits: only ours (resume points)
    with EpisodeWriter(path, plan.observation_space, plan.action_space, store_kwargs, resume=resume,
                       resumable=True) as writer:
        store = writer.open()
        cursor = _restore_cursor(store, plan) if writer.resumed else Cursor()
        writer.stream = cursor.stream
        _run(plan, writer, cursor, block_bytes, commit_rows, progress)
        if sized:
            _check_nothing_dropped(store, cursor)
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
    terminals: int  # terminal rows of the checkpoints (each ends an episode: one frame more than its rows)

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
    max_action, rewards, terminals = _scan_values(ckpts)
    if num_actions is not None and num_actions <= max_action:
        raise ValueError(f"num_actions {num_actions}: the checkpoints hold action {max_action}; expected "
                         f"num_actions >= {max_action + 1}")
    return _Plan(src, numbers, ckpts, _stack_size(ckpts, frame_stack), spaces.Box(0, 255, shape, np.uint8),
                 spaces.Discrete(int(num_actions or max_action + 1)), _reward_values(rewards, reward_values),
                 [note for c in ckpts for note in c.notes], terminals)


def _run(plan: _Plan, writer, cursor: Cursor, block_bytes: int, commit_rows: int, progress: ProgressFn | None) -> None:
    """Import the plan's checkpoints from ``cursor`` on, committing the cursor with the data (see the module
    invariants); a failure commits what is stored when the cursor names exactly that, so it resumes."""
    store = writer.store
    last_commit = [cursor.transitions]

    def commit(complete: bool = False) -> None:
        store.flush(app_meta={**store.app_meta, META_KEY: _meta(cursor, plan, complete)})
        last_commit[0] = cursor.transitions
        release_free_heap()

    if not writer.resumed:
        commit()  # a state from the start: an import killed before its first block still resumes
    block = max(1, block_bytes // max(1, int(np.prod(plan.frame_shape))))
    buffers = [np.empty((block + 2, *plan.frame_shape), np.uint8) for _ in range(READ_AHEAD_BUFFERS)]
    before = 0
    try:
        for ckpt in plan.checkpoints:
            report = lambda row, base=before: progress and progress(base + row, plan.rows)
            before += ckpt.rows
            if any(c["number"] == ckpt.number and c["done"] for c in cursor.checkpoints):
                continue
            for _ in _import_checkpoint(ckpt, cursor, writer, plan.stack, buffers, plan.notes, report):
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


def _scan_values(ckpts: Sequence[Checkpoint]) -> tuple[int, np.ndarray, int]:
    """The largest action, the distinct rewards and the terminal rows of the checkpoints (their small columns,
    read once)."""
    max_action, rewards, terminals = 0, np.zeros(0, np.float32), 0
    for c in ckpts:
        cols = read_small_columns(c)
        if cols.action.size:
            max_action = max(max_action, int(cols.action.max()))
        rewards = np.union1d(rewards, np.unique(cols.reward))[: 1 << 12]  # enough to tell "too many to pack"
        terminals += int(np.count_nonzero(cols.terminal))
    return max_action, rewards, terminals


def _check_nothing_dropped(store, cursor: Cursor) -> None:
    """A store sized from the checkpoints (``capacity="rows"``) never wraps: every transition imported is held."""
    oldest, head = store.inspect.valid_range()
    if oldest != 0 or head != cursor.transitions:
        raise RuntimeError(f"the store sized for the checkpoints' rows holds transitions {oldest}..{head}, the "
                             f"import wrote 0..{cursor.transitions}: its capacity {store.capacity} was too small")


def _import_checkpoint(ckpt: Checkpoint, cursor: Cursor, writer, k: int, buffers: Sequence[np.ndarray], notes: list[str],
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
    yield from job.blocks(buffers, progress)
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
