"""What crosses the network between an env actor and a shard: a batch of transitions as plain numpy arrays.

Invariant: ``decode_batch(encode_batch(rows))`` returns exactly the rows given (same values, dtypes and
shapes, bit for bit), and so does ``decode_batch`` of a ``BatchBuilder``'s payload for the rows added to it,
in order. Only numpy arrays, ints, strings and bytes are in a payload, so Ray's own serializer moves it
(arrays out of band, zero copy on one node) and no pickle of user objects is needed.

Two savings happen on the actor side, both lossless:
- an observation that equals, byte for byte, the previous next observation of its stream in the same batch
  (the normal case inside an episode) is not sent again: ``obs_src`` points at that row of ``next_obs``;
- with ``compress="lz4"`` each frame array travels LZ4-compressed (numcodecs, ~3 us per 84x84 frame).

``BatchBuilder`` is how a client fills a batch: each row is copied once, straight into the batch's arrays
(an observation only when it must be sent), and the continuation test runs vectorised as rows arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

CODECS = (None, "lz4")


def check_codec(codec) -> str | None:
    if codec not in CODECS:
        raise ValueError(f"compress must be one of {CODECS}, got {codec!r}")
    return codec


def _as_obs_dict(obs) -> tuple[dict[str, np.ndarray], bool]:
    if isinstance(obs, Mapping):
        return {k: np.asarray(v) for k, v in obs.items()}, True
    return {"obs": np.asarray(obs)}, False


@dataclass
class Rows:
    """``n`` transitions as given by an env actor (arrays, not copied): row ``i`` belongs to ``streams[i]``."""
    n: int
    streams: np.ndarray
    obs: dict[str, np.ndarray]
    next_obs: dict[str, np.ndarray]
    dict_obs: bool
    columns: dict[str, np.ndarray]  # action, reward, terminated, truncated, extras as "extras/<name>"


def rows_of(streams, obs, action, reward, next_obs, terminated, truncated, extras=None) -> Rows:
    """Check that every array holds one row per stream id and that obs and next_obs agree."""
    streams = np.asarray(streams, dtype=np.int64).reshape(-1)
    n = streams.size
    obs_d, is_dict = _as_obs_dict(obs)
    next_d, _ = _as_obs_dict(next_obs)
    columns = {"action": np.asarray(action), "reward": np.asarray(reward),
               "terminated": np.asarray(terminated, dtype=bool).reshape(-1),
               "truncated": np.asarray(truncated, dtype=bool).reshape(-1)}
    for k, v in (extras or {}).items():
        columns[f"extras/{k}"] = np.asarray(v)
    for what, arr in columns.items():
        if arr.shape[:1] != (n,):
            raise ValueError(f"encode_batch: {what} has {arr.shape[0] if arr.ndim else 'no'} rows, expected {n} "
                             "(one per stream id)")
    for k in obs_d:
        if obs_d[k].shape[:1] != (n,) or k not in next_d or next_d[k].shape != obs_d[k].shape:
            raise ValueError(f"encode_batch: obs[{k!r}] {obs_d[k].shape} and next_obs must both hold {n} rows of "
                             f"the same shape")
    if set(next_d) != set(obs_d):
        raise ValueError(f"encode_batch: next_obs keys {sorted(next_d)} differ from obs keys {sorted(obs_d)}")
    return Rows(n, streams, obs_d, next_d, is_dict, columns)


def _put(buf: np.ndarray, at: int, arr: np.ndarray, sel) -> None:
    """``buf[at:at+m] = arr[sel]`` with one copy (no temporary for an index array)."""
    if isinstance(sel, slice):
        buf[at:at + len(range(*sel.indices(arr.shape[0])))] = arr[sel]
    else:
        np.take(arr, sel, axis=0, out=buf[at:at + sel.size], mode="clip")  # 'clip' writes straight into out


def _rows(arr: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``arr[idx]``, as a view when ``idx`` is a run of consecutive rows (the usual case)."""
    if idx.size and idx[-1] - idx[0] == idx.size - 1 and (idx.size < 3 or bool(np.all(np.diff(idx) == 1))):
        return arr[idx[0]:idx[-1] + 1]
    return arr[idx]


def rows_equal(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row ``i`` of ``x`` equals row ``i`` of ``y`` byte for byte (so a NaN equals itself, -0.0 differs
    from 0.0: whatever is sent in place of the other is then bit for bit the same)."""
    x = np.ascontiguousarray(x).reshape(x.shape[0], -1).view(np.uint8)
    y = np.ascontiguousarray(y).reshape(y.shape[0], -1).view(np.uint8)
    if x.shape[1] % 8 == 0 and x.shape[1]:
        x, y = x.view(np.uint64), y.view(np.uint64)
    return (x == y).all(axis=1)


class BatchBuilder:
    """Up to ``capacity`` rows for one payload, added in order (``add``) and copied once into arrays made
    from the first rows added; ``payload()`` then hands them out (the builder is used up). Rows whose
    dtypes or row shapes differ from the first ones are not ``accepts``-ed: they start another batch."""

    def __init__(self, capacity: int, compress: str | None = None):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity, self.codec = capacity, check_codec(compress)
        self.n = 0  # rows added
        self.n_sent = 0  # of which observations sent
        self._cols: dict[str, np.ndarray] | None = None
        self._obs: dict[str, np.ndarray] = {}
        self._next: dict[str, np.ndarray] = {}
        self._dict_obs = False
        self._last_row: dict[int, int] = {}  # stream -> its newest row in this batch
        self._done = False

    @property
    def room(self) -> int:
        return self.capacity - self.n

    def recycled(self) -> "BatchBuilder":
        """An empty builder over this one's arrays (no page faults for fresh memory), for when nothing
        reads this builder's payload any more (its batch was committed, or it was compressed)."""
        out = BatchBuilder(self.capacity, self.codec)
        out._cols, out._obs, out._next, out._dict_obs = self._cols, self._obs, self._next, self._dict_obs
        self._cols, self._done = None, True
        return out

    def accepts(self, rows: Rows) -> bool:
        if self._cols is None:
            return True
        same = lambda bufs, arrs: bufs.keys() == arrs.keys() and all(  # noqa: E731
            bufs[k].dtype == arrs[k].dtype and bufs[k].shape[1:] == arrs[k].shape[1:] for k in bufs)
        return rows.dict_obs == self._dict_obs and same(self._next, rows.next_obs) and same(
            self._obs, rows.obs) and same({k: v for k, v in self._cols.items() if k not in _OWN}, rows.columns)

    def add(self, rows: Rows, sel=None) -> None:
        """Append rows ``sel`` of ``rows`` (a slice or increasing row numbers; default all), at most ``room``."""
        if self._done:
            raise RuntimeError("this BatchBuilder's payload was taken; start a new one")
        idx = np.arange(rows.n) if sel is None else np.arange(rows.n)[sel] if isinstance(sel, slice) else \
            np.asarray(sel, dtype=np.int64)
        sel = slice(None) if sel is None else sel
        m = idx.size
        if m > self.room:
            raise ValueError(f"BatchBuilder: {m} rows do not fit, {self.room} of {self.capacity} left")
        if not self.accepts(rows):
            raise ValueError("BatchBuilder: these rows' dtypes or shapes differ from the batch's first rows")
        if self._cols is None:
            self._allocate(rows)
        if m == 0:
            return
        b = self.n
        for k, buf in self._next.items():
            _put(buf, b, rows.next_obs[k], sel)
        for k, arr in rows.columns.items():
            _put(self._cols[k], b, arr, sel)
        _put(self._cols["streams"], b, rows.streams, sel)
        src = self._sources(rows, idx, b)
        self._cols["src"][b:b + m] = src
        need = idx[src < 0]  # observations that must travel
        for k, buf in self._obs.items():
            _put(buf, self.n_sent, rows.obs[k], need)
        self.n_sent += need.size
        self.n += m

    def _allocate(self, rows: Rows) -> None:
        cap = self.capacity
        self._dict_obs = rows.dict_obs
        self._next = {k: np.empty((cap, *v.shape[1:]), v.dtype) for k, v in rows.next_obs.items()}
        self._obs = {k: np.empty((cap, *v.shape[1:]), v.dtype) for k, v in rows.obs.items()}
        self._cols = {k: np.empty((cap, *v.shape[1:]), v.dtype) for k, v in rows.columns.items()}
        self._cols["streams"] = np.empty(cap, np.int64)
        self._cols["src"] = np.empty(cap, np.int32)

    def _sources(self, rows: Rows, idx: np.ndarray, b: int) -> np.ndarray:
        """For new rows ``b..b+m``: the earlier row of the batch whose next observation is this row's
        observation (same stream, episode going on, equal bytes), else -1."""
        m = idx.size
        streams = self._cols["streams"][b:b + m]
        prev = np.full(m, -1, dtype=np.int64)
        order = np.argsort(streams, kind="stable")
        ordered = streams[order]
        same = ordered[1:] == ordered[:-1]
        prev[order[1:][same]] = order[:-1][same] + b  # the row before, within these rows
        for t in order[np.r_[True, ~same]].tolist():  # each stream's first row here: its last row before
            prev[t] = self._last_row.get(int(streams[t]), -1)
        for t in order[np.r_[~same, True]].tolist():
            self._last_row[int(streams[t])] = b + t
        src = np.full(m, -1, dtype=np.int32)
        cand = np.flatnonzero(prev >= 0)
        if cand.size:
            # compare every row that has a predecessor (one run of rows in the usual layouts: views, no
            # copies), then drop those whose predecessor ended its episode
            p = prev[cand]
            ok = ~(self._cols["terminated"][p] | self._cols["truncated"][p])
            for k in self._next:
                if self._obs[k].dtype != self._next[k].dtype:  # sent as given: decode keeps each dtype
                    ok[:] = False
                    break
                ok &= rows_equal(_rows(rows.obs[k], idx[cand]), _rows(self._next[k], p))
            src[cand[ok]] = p[ok]
        return src

    def payload(self) -> dict:
        """The wire dict of the rows added (views of this builder's arrays; the builder is used up)."""
        self._done = True
        n, cols = self.n, self._cols
        if cols is None:
            raise ValueError("BatchBuilder: no rows were added")
        return {
            "n": n, "dict_obs": self._dict_obs, "streams": cols["streams"][:n].astype(np.int32),
            "obs_src": cols["src"][:n],
            "obs": {k: _pack(v[:self.n_sent], self.codec) for k, v in self._obs.items()},
            "next_obs": {k: _pack(v[:n], self.codec) for k, v in self._next.items()},
            "action": cols["action"][:n], "reward": cols["reward"][:n],
            "terminated": cols["terminated"][:n], "truncated": cols["truncated"][:n],
            "extras": {k[len("extras/"):]: v[:n] for k, v in cols.items() if k.startswith("extras/")},
        }


_OWN = ("streams", "src")  # builder columns that are not taken from the rows


def _pack(arr: np.ndarray, codec: str | None) -> Any:
    if codec is None:
        return arr
    from numcodecs import LZ4

    return {"lz4": LZ4().encode(np.ascontiguousarray(arr)), "shape": list(arr.shape), "dtype": arr.dtype.str}


def _unpack(value: Any, reuse: dict | None = None, key=None) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    from numcodecs import LZ4

    out = _array(reuse, key, tuple(value["shape"]), value["dtype"])
    if out.size:  # (LZ4 refuses to decode into an empty buffer)
        LZ4().decode(value["lz4"], out=out)
    return out


def encode_batch(streams, obs, action, reward, next_obs, terminated, truncated, extras=None, *,
                 compress: str | None = None) -> dict:
    """The payload for ``n`` transitions (row ``i`` of stream ``streams[i]``; a stream's rows in order)."""
    codec = check_codec(compress)
    rows = rows_of(streams, obs, action, reward, next_obs, terminated, truncated, extras)
    builder = BatchBuilder(max(1, rows.n), codec)
    builder.add(rows)
    return builder.payload()


def decode_batch(payload: dict, reuse: dict | None = None) -> dict:
    """The rows of a payload as ``Store.extend`` arguments (``streams`` are the sender's stream ids).
    With ``reuse`` (a dict the caller keeps), the observation arrays are filled in place of those returned by
    the previous call that fit (no fresh memory per batch): they are valid until the next call."""
    src = np.asarray(payload["obs_src"])
    cont = src >= 0
    obs, next_obs = {}, {}
    for k, packed in payload["next_obs"].items():
        nxt = _unpack(packed, reuse, ("next", k))
        sent = _unpack(payload["obs"][k], reuse, ("sent", k))
        out = _array(reuse, ("obs", k), nxt.shape, sent.dtype)
        if sent.dtype == nxt.dtype:
            # one gather straight into ``out`` (no temporary the size of the batch), then the sent rows
            np.take(nxt, np.where(cont, src, 0), axis=0, out=out, mode="clip")
        else:  # (a builder only points at next_obs rows of the same dtype)
            out[cont] = nxt[src[cont]]
        out[~cont] = sent
        obs[k], next_obs[k] = out, nxt
    if not payload["dict_obs"]:
        obs, next_obs = obs["obs"], next_obs["obs"]
    return {"streams": np.asarray(payload["streams"], dtype=np.int64), "obs": obs, "action": payload["action"],
            "reward": payload["reward"], "next_obs": next_obs, "terminated": payload["terminated"],
            "truncated": payload["truncated"], "extras": dict(payload["extras"])}


def _array(reuse: dict | None, key, shape, dtype) -> np.ndarray:
    """An uninitialised array of ``shape``: a view of the one kept under ``key`` when it is large enough."""
    dtype = np.dtype(dtype)
    if reuse is None:
        return np.empty(shape, dtype)
    kept = reuse.get(key)
    if kept is None or kept.dtype != dtype or kept.shape[1:] != tuple(shape[1:]) or kept.shape[0] < shape[0]:
        kept = reuse[key] = np.empty(shape, dtype)
    return kept[:shape[0]]


def payload_nbytes(payload: dict) -> int:
    """Bytes of array data in a payload (what the network carries, less a few hundred bytes of framing)."""
    total = 0
    for value in payload.values():
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, dict):
            for v in value.values():
                total += v.nbytes if isinstance(v, np.ndarray) else len(v["lz4"]) if isinstance(v, dict) else 0
    return total
