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

A shard trusts no payload: ``decode_batch`` first checks it whole (``check_payload``: exactly the fields
above, every count consistent, each ``obs_src`` -1 or an earlier row, each LZ4 array's declared shape and
dtype the size its data decodes to, observations shaped as the shard's store expects) and raises
``ValueError`` naming the field and the values, before it allocates or decodes anything; a payload it
returns rows for describes each row exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

CODECS = (None, "lz4")
PAYLOAD_FIELDS = frozenset(("n", "dict_obs", "streams", "obs_src", "obs", "next_obs", "action", "reward",
                            "terminated", "truncated", "extras"))
PACKED_FIELDS = frozenset(("lz4", "shape", "dtype"))
# LZ4 spends at least one byte per 255 bytes of output (a match length byte), so data of m bytes cannot
# decode to more than ~255 * m: a larger declared size is a lie, refused before its buffer is allocated
LZ4_MAX_RATIO = 255
LZ4_HEADER = 4  # numcodecs' LZ4 frame: the decoded size as a little-endian uint32, then the LZ4 block


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


def _unpack(value: Any, reuse: dict | None = None, key=None, field: str = "") -> np.ndarray:
    """The array a payload field holds (``check_payload`` has checked its declared shape and size)."""
    if isinstance(value, np.ndarray):
        return value
    from numcodecs import LZ4

    out = _array(reuse, key, tuple(value["shape"]), value["dtype"])
    if out.size:  # (LZ4 refuses to decode into an empty buffer)
        try:
            LZ4().decode(value["lz4"], out=out)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"batch field {field!r}: its LZ4 data does not decode to the {out.nbytes} bytes of "
                             f"shape {list(out.shape)} {out.dtype} it declares ({exc})") from None
    return out


def encode_batch(streams, obs, action, reward, next_obs, terminated, truncated, extras=None, *,
                 compress: str | None = None) -> dict:
    """The payload for ``n`` transitions (row ``i`` of stream ``streams[i]``; a stream's rows in order)."""
    codec = check_codec(compress)
    rows = rows_of(streams, obs, action, reward, next_obs, terminated, truncated, extras)
    builder = BatchBuilder(max(1, rows.n), codec)
    builder.add(rows)
    return builder.payload()


@dataclass(frozen=True)
class ObsLayout:
    """What a shard's store takes as observations: a dict of them or one array, and each key's row shape."""
    dict_obs: bool
    shapes: Mapping[str, tuple[int, ...]]


def decode_batch(payload: dict, reuse: dict | None = None, expect: ObsLayout | None = None) -> dict:
    """The rows of a payload as ``Store.extend`` arguments (``streams`` are the sender's stream ids), after
    ``check_payload(payload, expect)``. With ``reuse`` (a dict the caller keeps), the observation arrays
    are filled in place of those returned by the previous call that fit (no fresh memory per batch): they
    are valid until the next call."""
    check_payload(payload, expect)
    src = np.asarray(payload["obs_src"], dtype=np.int64)
    cont = src >= 0
    obs, next_obs = {}, {}
    for k, packed in payload["next_obs"].items():
        nxt = _unpack(packed, reuse, ("next", k), f"next_obs[{k}]")
        sent = _unpack(payload["obs"][k], reuse, ("sent", k), f"obs[{k}]")
        out = _array(reuse, ("obs", k), nxt.shape, sent.dtype)
        if cont.any():
            # one gather straight into ``out`` (no temporary the size of the batch), then the sent rows;
            # every source is an earlier row (checked), so 'clip' (which lets numpy write into out) clips nothing
            np.take(nxt, np.where(cont, src, 0), axis=0, out=out, mode="clip")
        out[~cont] = sent  # exactly one sent row per row without a source (checked)
        obs[k], next_obs[k] = out, nxt
    if not payload["dict_obs"]:
        obs, next_obs = obs["obs"], next_obs["obs"]
    return {"streams": np.asarray(payload["streams"], dtype=np.int64), "obs": obs, "action": payload["action"],
            "reward": payload["reward"], "next_obs": next_obs, "terminated": payload["terminated"],
            "truncated": payload["truncated"], "extras": dict(payload["extras"])}


def check_payload(payload: Any, expect: ObsLayout | None = None) -> None:
    """Raise ``ValueError`` naming the field and its values unless ``payload`` is a well-formed batch
    (module docstring), observations laid out as ``expect`` says where given. Reads no array data but
    ``obs_src`` and the LZ4 headers."""
    if not isinstance(payload, Mapping):
        raise ValueError(f"a batch must be a dict of fields, got {type(payload).__name__}")
    if set(payload) != PAYLOAD_FIELDS:
        raise ValueError(f"batch fields: missing {sorted(PAYLOAD_FIELDS - set(payload))}, unknown "
                         f"{sorted(map(str, set(payload) - PAYLOAD_FIELDS))}")
    n = payload["n"]
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"batch field 'n': expected a row count >= 0, got {n!r}")
    n = int(n)
    if not isinstance(payload["dict_obs"], (bool, np.bool_)):
        raise ValueError(f"batch field 'dict_obs': expected a bool, got {payload['dict_obs']!r}")
    for name in ("streams", "obs_src"):
        _check_rows(name, payload[name], n, "iu", one_dim=True)
    for name in ("action", "reward", "terminated", "truncated"):
        _check_rows(name, payload[name], n, "biuf")
    extras = payload["extras"]
    if not isinstance(extras, Mapping):
        raise ValueError(f"batch field 'extras': expected a dict of arrays, got {type(extras).__name__}")
    for name, arr in extras.items():
        _check_rows(f"extras[{name}]", arr, n, "biuf")
    n_sent = _check_sources(np.asarray(payload["obs_src"]))
    _check_observations(payload, n, n_sent, expect)


def _check_rows(field: str, arr: Any, n: int, kinds: str, one_dim: bool = False) -> None:
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in kinds:
        what = f"dtype {arr.dtype}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ValueError(f"batch field {field!r}: expected a numpy array of kind {kinds!r}, got {what}")
    if arr.shape[:1] != (n,) or (one_dim and arr.ndim != 1):
        raise ValueError(f"batch field {field!r}: expected {n} rows (the batch's 'n'), got shape {arr.shape}")


def _check_sources(src: np.ndarray) -> int:
    """Row ``i``'s observation is sent (-1) or row ``src[i] < i``'s next observation; the count sent."""
    bad = (src < -1) | (src >= np.arange(src.size))
    if bad.any():
        rows = np.flatnonzero(bad)[:8]
        raise ValueError(f"batch field 'obs_src': rows {rows.tolist()} take their observation from rows "
                         f"{src[rows].tolist()}; expected -1 (sent) or an earlier row of the batch")
    return int(np.count_nonzero(src < 0))


def _check_observations(payload: Mapping, n: int, n_sent: int, expect: ObsLayout | None) -> None:
    obs, nxt = payload["obs"], payload["next_obs"]
    if not isinstance(obs, Mapping) or not isinstance(nxt, Mapping) or not nxt or set(obs) != set(nxt):
        raise ValueError(f"batch fields 'obs' and 'next_obs': expected dicts with the same keys, got "
                         f"{_keys(obs)} and {_keys(nxt)}")
    if expect is not None and (bool(payload["dict_obs"]) != expect.dict_obs or set(nxt) != set(expect.shapes)):
        raise ValueError(f"batch observations: got keys {sorted(nxt)} (dict_obs={bool(payload['dict_obs'])}), this "
                         f"store takes {sorted(expect.shapes)} (dict_obs={expect.dict_obs})")
    if not payload["dict_obs"] and set(nxt) != {"obs"}:
        raise ValueError(f"batch observations: dict_obs is false, so the one key must be 'obs', got {sorted(nxt)}")
    sources = payload["obs_src"]
    for k in nxt:
        next_shape, next_dtype = _declared(f"next_obs[{k}]", nxt[k])
        sent_shape, sent_dtype = _declared(f"obs[{k}]", obs[k])
        row = next_shape[1:]
        if next_shape[:1] != (n,) or sent_shape != (n_sent, *row):
            raise ValueError(f"batch observations {k!r}: next_obs has shape {next_shape} and obs {sent_shape}; "
                             f"expected ({n}, ...) rows for the batch's n={n} and ({n_sent}, ...) of the same row "
                             f"shape for the {n_sent} rows whose obs_src is -1")
        if expect is not None and row != tuple(expect.shapes[k]):
            raise ValueError(f"batch observations {k!r}: rows of shape {row}, this store takes "
                             f"{tuple(expect.shapes[k])}")
        if sent_dtype != next_dtype and bool((sources >= 0).any()):
            raise ValueError(f"batch observations {k!r}: obs ({sent_dtype}) taken from next_obs ({next_dtype}) "
                             "would change their dtype; a builder sends every row when the dtypes differ")


def _declared(field: str, value: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of a payload array, plain or LZ4-packed (whose header must match what it declares)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf" or value.ndim < 1:
            raise ValueError(f"batch field {field!r}: expected rows of numbers, got {value.dtype} {value.shape}")
        return value.shape, value.dtype
    if not isinstance(value, Mapping) or set(value) != PACKED_FIELDS:
        raise ValueError(f"batch field {field!r}: expected an array or a dict with keys {sorted(PACKED_FIELDS)}, "
                         f"got {_keys(value) if isinstance(value, Mapping) else type(value).__name__}")
    shape = value["shape"]
    if not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= 8 or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) and d >= 0 for d in shape):
        raise ValueError(f"batch field {field!r}: declared shape {shape!r} is not a list of 1 to 8 sizes >= 0")
    try:
        dtype = np.dtype(value["dtype"])
    except (TypeError, ValueError):
        raise ValueError(f"batch field {field!r}: declared dtype {value['dtype']!r} is no numpy dtype") from None
    if dtype.kind not in "biuf":
        raise ValueError(f"batch field {field!r}: declared dtype {dtype} is not a bool, integer or float type")
    try:
        data = memoryview(value["lz4"]).cast("B")
    except TypeError:
        raise ValueError(f"batch field {field!r}: its 'lz4' data is {type(value['lz4']).__name__}, not bytes") from None
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= int(d)
    held = int.from_bytes(data[:LZ4_HEADER], "little") if len(data) >= LZ4_HEADER else None
    if held != nbytes or nbytes > LZ4_MAX_RATIO * len(data):
        raise ValueError(f"batch field {field!r}: declares shape {list(shape)} {dtype} ({nbytes} bytes), but its "
                         f"{len(data)} bytes of LZ4 data hold {'no header' if held is None else f'{held} bytes'}")
    return tuple(int(d) for d in shape), dtype


def _keys(value: Any) -> Any:
    return sorted(map(str, value)) if isinstance(value, Mapping) else type(value).__name__


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
