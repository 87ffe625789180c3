"""A store as Dopamine replay checkpoints (``mmreplay export --format dqn-replay``), streamed, atomic.

Invariants:
- A store made by ``dqn_replay.import_dqn_replay`` gives back the arrays of the checkpoints it was made
  from: each transition goes back to its run row (the import's app metadata records where each stream
  starts, its leading padding and its held rows), padding rows are zeros, and each checkpoint is the
  run's rows ``add_count - capacity .. add_count`` laid out circularly, as Dopamine saves them.
- Any other store is laid out as Dopamine would have added its episodes (``stack_size - 1`` padding rows
  before each), ``capacity`` rows a checkpoint; what the format cannot hold is said in the summary's
  notes (final observations, truncated ends).
- The output directory appears only when complete (``outputs.staged``); each file is written under a
  temporary name and renamed (``npy_stream.NpyWriter``); frames are read a bounded block at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmreplay.datasets.dopamine_files import STORE_PREFIX, invalid_range, unpack_frame
from mmreplay.datasets.dqn_replay import META_KEY, ProgressFn
from mmreplay.datasets.npy_stream import NpyWriter, save_small

#: stacks of frames an export block holds at most, in bytes (the import's blocks are smaller: see its ``BLOCK_BYTES``)
EXPORT_BLOCK_BYTES = 32 << 20


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
    block_rows = max(1, min(block_rows, EXPORT_BLOCK_BYTES // (2 * k * max(1, int(np.prod(space.shape))))))
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
                frames[r] = unpack_frame(row["frame"], shape)
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
