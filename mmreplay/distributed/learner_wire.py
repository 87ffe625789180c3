"""What crosses the network from a shard to a learner: a sampled batch as its distinct frames, compressed.

A batch of ``B`` transitions with ``frame_stack=k`` holds ``2 k B`` frames in its obs and next-obs stacks,
but far fewer distinct ones: next_obs shares ``k - 1`` frames with obs, and stacks of nearby transitions
overlap. So the shard sends (``encode_frames``):

- per observation key, a **frame table**: each distinct frame once, in frame-id order, LZ4-compressed in
  chunks of ``chunk_rows`` consecutive rows (a chunk finds the matches between the frames of one episode
  that lie next to each other; chunks are independent, so a batched decoder, e.g. nvCOMP on a GPU, can take
  them all in one call: each chunk is numcodecs' LZ4 frame, a 4-byte little-endian size, then a raw block);
- ``obs_index`` / ``next_index``: ``(B, k)`` int32 rows of that table, one per stack position (the same for
  every key: all keys of a transition share its frame ids);
- the small columns (action, reward, flags, ids, extras, weights) as they are.

With ``stack_padding="zeros"`` the positions before an episode's first frame are zeros in the batch: they
all point at one all-zero table row, so the learner's rebuild is a plain gather whatever the padding.

Invariants:
- ``rebuild`` of ``decode_frames(encode_frames(batch, obs_ids, next_ids, ...))`` equals the shard's batch
  bit for bit (every stack position is the table row of its own frame id, and that row was copied from a
  position of the batch that holds that frame).
- A learner trusts no payload: ``check_frames`` checks it whole before anything is allocated or decoded,
  and raises ``ValueError`` naming the field and its values: exactly the known fields, every column ``B``
  rows, each frame table of the shape and dtype the learner's store schema says, its declared row count
  bounded by the batch's stack positions, the chunks' sizes adding up to the data and each chunk's LZ4
  header the size of its rows (and possible for its length), every index inside its table.
- The rebuild is a gather over a decoded table (``rebuild_into`` for numpy, ``rebuild_torch`` for tensors on
  any device): a decoder on the learner's GPU only has to fill the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from mmreplay.device.assemble import gather_rows
from mmreplay.distributed.wire import LZ4_HEADER, LZ4_MAX_RATIO

WIRES = ("stacks", "frames")
# 8 Atari frames (7,056 B each) are 56 KB: a chunk stays inside LZ4's 64 KB match window, so each frame
# can reference the one before it. Measured on an Atari b32 batch (stacks 1.8 MB): chunks of 1, 4, 8 and
# 16 frames gave 31x, 62x, 75x and 84x fewer bytes; 8 keeps most of that and leaves a batched decoder
# (nvCOMP) ~20 chunks a batch to run in parallel.
DEFAULT_CHUNK_ROWS = 8
MAX_CHUNK_ROWS = 4096
FIELDS = frozenset(("n", "dict_obs", "frames", "obs_index", "next_index", "action", "reward", "terminated",
                    "truncated", "indices", "extras", "weights"))
TABLE_FIELDS = frozenset(("rows", "chunk_rows", "shape", "dtype", "sizes", "data"))
ROW_COLUMNS = ("action", "reward", "terminated", "truncated", "indices")


def check_wire(wire) -> str:
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")
    return wire


@dataclass(frozen=True)
class FrameLayout:
    """What the learner's store schema says a batch is: ``dict_obs``, ``frame_stack``, each key's frame shape
    and dtype (what a frame table must declare), the extra columns' names, and whether rows carry importance
    weights (prioritized draws)."""
    dict_obs: bool
    frame_stack: int
    frames: Mapping[str, tuple[tuple[int, ...], np.dtype]]
    extras: frozenset = frozenset()
    weights: bool = False

    @classmethod
    def of(cls, schema, weights: bool = False) -> "FrameLayout":
        return cls(bool(schema.dict_obs), int(schema.frame_stack),
                   {s.name: (tuple(s.shape), np.dtype(s.np_dtype)) for s in schema.observations},
                   frozenset(c.name for c in schema.extras), bool(weights))


def zero_padded(schema) -> bool:
    """Whether the batch's stacks hold zeros before an episode's first frame (``assemble``'s rule)."""
    return schema.stack_padding == "zeros" and schema.frame_stack > 1


# -- shard side ---------------------------------------------------------------------------------------------
def encode_frames(batch: Mapping[str, Any], obs_ids: np.ndarray, next_ids: np.ndarray, *, zero_pad: bool,
                  dict_obs: bool, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> dict:
    """The frame payload of ``batch`` (``shard.batch_to_numpy`` of a drawn batch) whose stacks were built
    from frame ids ``obs_ids`` / ``next_ids`` (``(B, k)``, what ``Sampler.draw_into`` returned)."""
    obs, nxt = batch["obs"], batch["next_obs"]
    if not isinstance(obs, Mapping):
        obs, nxt = {"obs": obs}, {"obs": nxt}
    n, k = obs_ids.shape
    ids = np.concatenate([obs_ids, next_ids], axis=1)  # (n, 2k): position j < k of obs, else of next_obs
    if zero_pad:
        # assemble zeroes a position whose frame id equals the next position's (padding before the start):
        # those positions become one id of their own, -1, whose first occurrence is a zero frame
        for part in (ids[:, :k], ids[:, k:]):
            pad = np.zeros(part.shape, dtype=bool)
            pad[:, :-1] = part[:, :-1] == part[:, 1:]
            part[pad] = -1
    distinct, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    index = inverse.reshape(n, 2 * k).astype(np.int32)
    row, pos = np.divmod(first, 2 * k)
    in_obs = pos < k
    frames = {}
    for name in obs:
        shape = obs[name].shape[2:] if k > 1 else obs[name].shape[1:]
        flat_obs, flat_next = obs[name].reshape(n * k, *shape), nxt[name].reshape(n * k, *shape)
        table = np.empty((distinct.size, *shape), dtype=obs[name].dtype)
        table[in_obs] = flat_obs[row[in_obs] * k + pos[in_obs]]
        table[~in_obs] = flat_next[row[~in_obs] * k + pos[~in_obs] - k]
        frames[name] = _pack_table(table, chunk_rows)
    out = {"n": int(n), "dict_obs": bool(dict_obs), "frames": frames,
           "obs_index": np.ascontiguousarray(index[:, :k]), "next_index": np.ascontiguousarray(index[:, k:])}
    out.update({c: batch[c] for c in ROW_COLUMNS})
    out["extras"] = dict(batch["extras"] or {})
    out["weights"] = batch["weights"]
    return out


def _pack_table(table: np.ndarray, chunk_rows: int) -> dict:
    """A frame table as LZ4 chunks of ``chunk_rows`` rows (the last one shorter), in one byte array."""
    from numcodecs import LZ4

    codec = LZ4()
    chunks = [codec.encode(table[lo:lo + chunk_rows]) for lo in range(0, table.shape[0], chunk_rows)]
    sizes = np.array([len(c) for c in chunks], dtype=np.int64)
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return {"rows": int(table.shape[0]), "chunk_rows": int(chunk_rows), "shape": list(table.shape[1:]),
            "dtype": table.dtype.str, "sizes": sizes, "data": data}


# -- learner side -------------------------------------------------------------------------------------------
def check_frames(payload: Any, layout: FrameLayout) -> None:
    """Raise ``ValueError`` naming the field and its values unless ``payload`` is a well-formed frame batch
    for a store laid out as ``layout`` (module docstring). Reads the index maps and the chunk headers only."""
    if not isinstance(payload, Mapping):
        raise ValueError(f"a sampled batch must be a dict of fields, got {type(payload).__name__}")
    if set(payload) != FIELDS:
        raise ValueError(f"sampled batch fields: missing {sorted(FIELDS - set(payload))}, unknown "
                         f"{sorted(map(str, set(payload) - FIELDS))}")
    n = payload["n"]
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"sampled batch field 'n': expected a row count >= 0, got {n!r}")
    n, k = int(n), layout.frame_stack
    if not isinstance(payload["dict_obs"], (bool, np.bool_)) or bool(payload["dict_obs"]) != layout.dict_obs:
        raise ValueError(f"sampled batch field 'dict_obs': got {payload['dict_obs']!r}, this store's is "
                         f"{layout.dict_obs}")
    for name in ROW_COLUMNS:
        _check_rows(name, payload[name], n)
    if (payload["weights"] is not None) != layout.weights:
        raise ValueError(f"sampled batch field 'weights': got {_head(payload['weights'])}, expected "
                         f"{'importance weights (a prioritized draw)' if layout.weights else 'None (a uniform draw)'}")
    if layout.weights:
        _check_rows("weights", payload["weights"], n)
    if not isinstance(payload["extras"], Mapping) or set(payload["extras"]) != layout.extras:
        got = sorted(map(str, payload["extras"])) if isinstance(payload["extras"], Mapping) else \
            type(payload["extras"]).__name__
        raise ValueError(f"sampled batch field 'extras': got {got}, this store's extra columns are "
                         f"{sorted(layout.extras)}")
    for name, arr in payload["extras"].items():
        _check_rows(f"extras[{name}]", arr, n)
    frames = payload["frames"]
    if not isinstance(frames, Mapping) or set(frames) != set(layout.frames):
        raise ValueError(f"sampled batch field 'frames': got keys "
                         f"{sorted(map(str, frames)) if isinstance(frames, Mapping) else type(frames).__name__}, "
                         f"this store's observations are {sorted(layout.frames)}")
    rows = {name: _check_table(f"frames[{name}]", table, layout.frames[name], 2 * k * n)
            for name, table in frames.items()}
    if len(set(rows.values())) > 1:
        raise ValueError(f"sampled batch field 'frames': the keys' tables hold {rows} rows; every key's frames "
                         "are indexed by the same maps, so they must hold the same number")
    table_rows = next(iter(rows.values()))
    for name in ("obs_index", "next_index"):
        _check_index(name, payload[name], n, k, table_rows)


def _check_rows(field: str, arr: Any, n: int) -> None:
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
        what = f"dtype {arr.dtype}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ValueError(f"sampled batch field {field!r}: expected a numpy array of numbers, got {what}")
    if arr.shape[:1] != (n,):
        raise ValueError(f"sampled batch field {field!r}: expected {n} rows (the batch's 'n'), got shape {arr.shape}")


def _check_table(field: str, table: Any, expected: tuple[tuple[int, ...], np.dtype], max_rows: int) -> int:
    """A frame table's declared rows, after checking every declared size against the data it comes with."""
    if not isinstance(table, Mapping) or set(table) != TABLE_FIELDS:
        got = sorted(map(str, table)) if isinstance(table, Mapping) else type(table).__name__
        raise ValueError(f"sampled batch field {field!r}: expected a dict with keys {sorted(TABLE_FIELDS)}, got {got}")
    shape, dtype = expected
    if not isinstance(table["shape"], (list, tuple)) or list(table["shape"]) != list(shape):
        raise ValueError(f"sampled batch field {field!r}: frames of shape {table['shape']!r}, this store's are "
                         f"{list(shape)}")
    if not isinstance(table["dtype"], str) or _dtype(table["dtype"]) != dtype:
        raise ValueError(f"sampled batch field {field!r}: frames of dtype {table['dtype']!r}, this store's are "
                         f"{dtype.str}")
    rows, chunk_rows = table["rows"], table["chunk_rows"]
    for what, value, hi in (("rows", rows, max_rows), ("chunk_rows", chunk_rows, MAX_CHUNK_ROWS)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or \
                not (0 if what == "rows" else 1) <= value <= hi:
            raise ValueError(f"sampled batch field {field!r}: '{what}' is {value!r}, expected an integer in "
                             f"[{0 if what == 'rows' else 1}, {hi}] (a batch's stack positions bound its frames)")
    rows, chunk_rows = int(rows), int(chunk_rows)
    sizes, data = table["sizes"], table["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise ValueError(f"sampled batch field {field!r}: 'data' must be a 1-D uint8 array, got "
                         f"{getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')}")
    n_chunks = math.ceil(rows / chunk_rows)
    if not isinstance(sizes, np.ndarray) or sizes.dtype.kind not in "iu" or sizes.shape != (n_chunks,) or \
            (sizes < LZ4_HEADER).any() or int(sizes.sum()) != data.size:
        raise ValueError(f"sampled batch field {field!r}: 'sizes' {_head(sizes)} must be {n_chunks} chunk sizes "
                         f">= {LZ4_HEADER} adding up to the {data.size} bytes of 'data' ({rows} rows in chunks of "
                         f"{chunk_rows})")
    row_nbytes = dtype.itemsize * math.prod(shape)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    for c, (at, size) in enumerate(zip(starts.tolist(), sizes.tolist())):
        held = int.from_bytes(data[at:at + LZ4_HEADER].tobytes(), "little")
        want = (min(rows, (c + 1) * chunk_rows) - c * chunk_rows) * row_nbytes
        if held != want or want > LZ4_MAX_RATIO * size:
            raise ValueError(f"sampled batch field {field!r}: chunk {c} of {size} bytes holds {held} bytes, "
                             f"expected {want} (its rows of {row_nbytes} bytes)")
    return rows


def _check_index(field: str, index: Any, n: int, k: int, rows: int) -> None:
    if not isinstance(index, np.ndarray) or index.dtype.kind not in "iu" or index.shape != (n, k):
        raise ValueError(f"sampled batch field {field!r}: expected an integer array of shape {(n, k)}, got "
                         f"{getattr(index, 'dtype', type(index).__name__)} {getattr(index, 'shape', '')}")
    if index.size and (int(index.min()) < 0 or int(index.max()) >= rows):
        raise ValueError(f"sampled batch field {field!r}: rows from {int(index.min())} to {int(index.max())}, "
                         f"expected rows of its frame table [0, {rows})")


def _dtype(value: str) -> np.dtype | None:
    try:
        return np.dtype(value)
    except (TypeError, ValueError):
        return None


def _head(arr: Any) -> Any:
    return arr[:8].tolist() if isinstance(arr, np.ndarray) else type(arr).__name__


def decode_frames(payload: dict, layout: FrameLayout, reuse: dict | None = None) -> dict:
    """``payload`` with each frame table decoded (``frames[name]`` an array of its rows), after
    ``check_frames``. With ``reuse`` (a dict the caller keeps) tables are decoded into the arrays of the
    previous call where they fit: valid until the next call."""
    check_frames(payload, layout)
    out = dict(payload)
    out["frames"] = {name: decode_table(f"frames[{name}]", table, reuse) for name, table in payload["frames"].items()}
    return out


def decode_table(field: str, table: dict, reuse: dict | None = None) -> np.ndarray:
    """The rows of a checked frame table, each chunk decoded by LZ4 on this CPU into its rows."""
    from numcodecs import LZ4

    rows, chunk_rows, dtype = int(table["rows"]), int(table["chunk_rows"]), np.dtype(table["dtype"])
    shape = (rows, *map(int, table["shape"]))
    out = _array(reuse, field, shape, dtype)
    codec, data, at = LZ4(), table["data"], 0
    for c, size in enumerate(table["sizes"].tolist()):
        lo = c * chunk_rows
        try:
            codec.decode(data[at:at + size], out=out[lo:lo + chunk_rows])
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"sampled batch field {field!r}: chunk {c} does not decode to its rows ({exc})") from None
        at += size
    return out


def _array(reuse: dict | None, key, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if reuse is None:
        return np.empty(shape, dtype)
    kept = reuse.get(key)
    if kept is None or kept.dtype != dtype or kept.shape[1:] != shape[1:] or kept.shape[0] < shape[0]:
        kept = reuse[key] = np.empty(shape, dtype)
    return kept[:shape[0]]


def rebuild_into(table: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    """``out[i, j] = table[index[i, j]]``: the stacks (``(n, k, *frame)``, or ``(n, *frame)`` when ``k`` is 1)
    rebuilt from a decoded frame table, one copy."""
    n, k = index.shape
    np.take(table, index.reshape(-1), axis=0, out=out.reshape(n * k, *table.shape[1:]))


def rebuild_torch(table, index):
    """The same gather over torch tensors, on whatever device ``table`` lives (a GPU decoder fills ``table``
    there; only ``index``, ``(n, k)`` int32 per batch, has to follow it). The device decode path assembles its
    batches with the same gather (``mmreplay/device/assemble.py``)."""
    n, k = index.shape
    return gather_rows(table, index if k > 1 else index.reshape(n))


def slice_rows(batch: dict, lo: int, hi: int) -> dict:
    """Rows ``[lo, hi)`` of a decoded frame batch (views; the frame tables are shared by every slice)."""
    out = {key: (v[lo:hi] if isinstance(v, np.ndarray) else v) for key, v in batch.items() if key != "extras"}
    out["extras"] = {c: a[lo:hi] for c, a in batch["extras"].items()}
    out["n"] = hi - lo
    return out


def payload_nbytes(payload: Mapping) -> int:
    """Bytes of array data in a sampled batch of either wire form (what the network carries, less a few
    hundred bytes of framing)."""
    total = 0
    for value in payload.values():
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, Mapping):
            total += payload_nbytes(value)
    return total
