"""Column specs: what each stored column is, derived from gymnasium spaces.

Invariant: a ``Schema`` fully determines how every value is validated, encoded, stored and decoded;
it round-trips through JSON (``Schema.from_json(s.to_json()) == s``) and never needs pickle.

Kinds of column:
- ``frame``: an observation key. Observations live in the *frame ring*: each distinct observation is
  stored once, compressed per chunk (one frame per chunk for images), and transitions point at frames.
- ``packed``: a small set of values (Discrete actions with n <= 16, declared reward values, flags)
  stored as 1-, 2- or 4-bit codes; ``values[code]`` is the stored value.
- ``numeric``: any other per-transition array (float rewards, Box actions, larger Discrete).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from gymnasium import spaces

from mmreplay import codecs
from mmreplay.columns.spaces import space_from_json, space_to_json

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
FRAME_CHUNK_BYTES = 4096  # low-dim observations: rows per chunk so a chunk is ~4 KiB decoded

DEFAULT_NUMERIC_CODEC = {"name": "blosc", "cname": "lz4", "clevel": 5}
FRAME_CODECS = {
    "lz4": {"name": "blosc", "cname": "lz4", "clevel": 9},  # clevel 9: better ratio, same speed for lz4
    # clevel 3: measured on 60k real Atari transitions, 443 B/transition at 47-48k adds/s vs clevel 5's
    # 436 B at 38k adds/s (the encoder process is the bound on 2 cores)
    "lz4hc": {"name": "blosc", "cname": "lz4hc", "clevel": 3},
    "zstd": {"name": "zstd", "level": 1},
    # runs of frames, each coded alone or against an earlier frame of its run, then zstd (codecs/temporal.py),
    # for the stores that do not fit in RAM. Measured (scripts/bench_frame_codec.py, docs/performance.md):
    # real Atari 84x84 frames 99 B/transition (lz4hc: 474); real DMC 84x84 RGB frames 4.1 KB (lz4hc: 12.5 KB).
    "delta-zstd": {"name": "temporal", "level": 3, "run": 8, "search": 8},
    # runs of 32 frames coded against each other, one LZ4 block a run (codecs/delta_lz4.py): for sequences of
    # colour frames (DreamerV3's 64 steps of 64x64 RGB), ~5x faster to decode than zstd's residuals; real DMC
    # frames at 64x64 4.56x smaller than raw (delta-zstd: 4.20x)
    "delta-lz4": {"name": "delta-lz4", "level": 9, "run": 32, "search": 8},
}
# Frames this large (colour) change in more pixels per step: their key frames cost more, so "delta-zstd"
# gives them longer runs (a key frame every 16): on real DMC frames ~4.1 KB a frame instead of 4.7 KB with
# runs of 8 (5.1x smaller than raw instead of 4.5x). And layout 3 (one coded frame per frame, chains from the
# run's middle: ``codecs/temporal.py``), so that a sample's 6 frames decode with ~10 frame decodes instead of
# the ~21 of whole runs; its key frames are LZ4 (decoded by most samples: 3x faster than zstd, 23% larger),
# which level 12 pays for (residuals 2% smaller than level 6, as fast to decode, ~3x slower to encode).
# Measured on a 200k-transition DMC store in RAM, batch-256 n-step-3: 45.5-46.7 batches/s with layout 2 at
# level 6, 59.1-61.0 with this (61.5-63.3 with a zstd context kept per helper thread); 5.06x smaller than raw.
# ``lz4_depth: 3`` (issue #38, item 5): the frames up to 3 references from the key are LZ4 too, so a stack-3 +
# n-step-3 sample decodes ~4.4 zstd residuals and ~5.6 LZ4 blocks instead of ~8.7 and ~1.3; measured on real
# DMC frames, 4.65x smaller than raw instead of 5.07x (issue #38 accepts >= 4.5x) for ~20% less CPU a
# batch-256 (docs/performance.md, "DMC 1M"); depth 4 would come to ~4.55x.
LARGE_FRAME_BYTES = 16384
DELTA_ZSTD_LARGE = {"name": "temporal", "level": 12, "run": 16, "search": 8, "layout": 3, "lz4_depth": 3}
# ``frame_codec="auto"`` (the default): what ``choose_frame_codec`` assumes a grey frame shrinks to, coded
# alone with lz4hc. Real Atari frames measure ~15x (474 B of 7,056); 10x leaves room for busier games.
PER_FRAME_RATIO_ASSUMED = 10
# Colour frames smaller than this (test-sized thumbnails) are coded per frame: a run of them saves little.
AUTO_TEMPORAL_MIN_BYTES = 4096


def validate_name(name: Any, what: str = "column name") -> str:
    """Names become directory names on disk, so nothing that could escape the store is allowed."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name) or ".." in name:
        raise ValueError(
            f"invalid {what} {name!r}: expected 1-64 characters from letters, digits, '_', '.', '-', "
            "not starting with '.' or '-' and without '..'"
        )
    return name


@dataclass(frozen=True)
class ColumnSpec:
    """One column of a store: ``ColumnSpec.packed(name, values)`` stores one of a few declared values in
    1, 2 or 4 bits; ``ColumnSpec.numeric(name, shape, dtype)`` stores numbers as they are. Give extra
    columns to ``Store.create(extras=[...])``; their values then go to ``add(..., extras={name: v})``."""

    name: str
    kind: str  # "frame" | "packed" | "numeric"
    shape: tuple[int, ...] = ()
    dtype: str = "float32"  # dtype of the decoded values the user sees
    bits: int = 0  # packed only
    values: tuple = ()  # packed only: values[code]
    chunk_rows: int = 1  # frame only: rows per compressed chunk
    codec: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_NUMERIC_CODEC))

    def __post_init__(self) -> None:
        validate_name(self.name)
        if self.kind not in ("frame", "packed", "numeric"):
            raise ValueError(f"column {self.name!r}: kind must be 'frame', 'packed' or 'numeric', got {self.kind!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d < 1 or d > 1 << 20 for d in self.shape) or len(self.shape) > 4:
            raise ValueError(f"column {self.name!r}: shape {self.shape} must have <= 4 dims, each 1..{1 << 20}")
        dtype = np.dtype(self.dtype)
        if dtype.kind not in "biuf":
            raise ValueError(f"column {self.name!r}: dtype {dtype} is not a bool, integer or float type")
        object.__setattr__(self, "dtype", dtype.name)
        if self.kind == "packed":
            if self.bits not in (1, 2, 4):
                raise ValueError(f"column {self.name!r}: packed bits must be 1, 2 or 4, got {self.bits!r}")
            if not 1 <= len(self.values) <= 1 << self.bits:
                raise ValueError(
                    f"column {self.name!r}: {len(self.values)} values do not fit {self.bits} bits "
                    f"(at most {1 << self.bits})")
            if self.shape != ():
                raise ValueError(f"column {self.name!r}: packed columns hold scalars, got shape {self.shape}")
            object.__setattr__(self, "values", tuple(np.asarray(self.values, dtype=dtype).tolist()))
            if len(set(self.values)) != len(self.values):
                raise ValueError(f"column {self.name!r}: packed values {self.values} contain duplicates")
        if self.chunk_rows < 1:
            raise ValueError(f"column {self.name!r}: chunk_rows must be >= 1, got {self.chunk_rows}")

    # -- factories -------------------------------------------------------------------------------
    @classmethod
    def packed(cls, name: str, values: Sequence, dtype: str | None = None) -> "ColumnSpec":
        """A column holding one of a few declared values, stored in the fewest bits (1, 2 or 4)."""
        values = tuple(values)
        bits = bits_for(len(values))
        if bits is None:
            raise ValueError(f"column {name!r}: {len(values)} values cannot be packed (at most 16)")
        if dtype is None:
            dtype = "int64" if all(float(v).is_integer() for v in values) else "float32"
        return cls(name, "packed", (), dtype, bits=bits, values=values)

    @classmethod
    def numeric(cls, name: str, shape: Sequence[int] = (), dtype: str = "float32") -> "ColumnSpec":
        return cls(name, "numeric", tuple(shape), dtype)

    # -- derived ---------------------------------------------------------------------------------
    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def row_nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.np_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "shape": list(self.shape), "dtype": self.dtype}
        if self.kind == "packed":
            out.update(bits=self.bits, values=list(self.values))
        if self.kind == "frame":
            out.update(chunk_rows=self.chunk_rows)
        out["codec"] = dict(self.codec)
        return out

    @classmethod
    def from_json(cls, data: Any) -> "ColumnSpec":
        if not isinstance(data, dict):
            raise ValueError(f"column description must be an object, got {data!r}")
        try:
            return cls(name=data["name"], kind=data["kind"], shape=tuple(data.get("shape", ())),
                       dtype=data.get("dtype", "float32"), bits=int(data.get("bits", 0)),
                       values=tuple(data.get("values", ())), chunk_rows=int(data.get("chunk_rows", 1)),
                       codec=dict(data.get("codec", DEFAULT_NUMERIC_CODEC)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed column description {data!r}: {exc}") from None


def bits_for(n_values: int) -> int | None:
    for bits in (1, 2, 4):
        if n_values <= 1 << bits:
            return bits
    return None


@dataclass(frozen=True)
class Schema:
    """Every column of a store plus the spaces it was made from."""

    observations: tuple[ColumnSpec, ...]  # kind "frame", one per observation key
    action: ColumnSpec
    reward: ColumnSpec
    extras: tuple[ColumnSpec, ...] = ()
    dict_obs: bool = False  # observations come as a dict (Dict space) rather than one array
    frame_stack: int = 1
    observation_space: Mapping[str, Any] | None = None  # JSON form
    action_space: Mapping[str, Any] | None = None
    stack_padding: str = "first"  # before an episode's first frame: repeat it ("first") or zeros ("zeros")

    def __post_init__(self) -> None:
        if self.stack_padding not in ("first", "zeros"):
            raise ValueError("stack_padding must be 'first' (repeat the episode's first frame, like gymnasium's "
                             "FrameStackObservation) or 'zeros' (like SB3's VecFrameStack), "
                             f"got {self.stack_padding!r}")
        names = [c.name for c in self.observations]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate observation keys {names}")
        extra_names = [c.name for c in self.extras]
        reserved = {"action", "reward", "terminated", "truncated", "obs_frame", "next_frame", "prev_delta"}
        clash = sorted((set(extra_names) & reserved) | {n for n in extra_names if extra_names.count(n) > 1})
        if clash:
            raise ValueError(f"extra column names {clash} clash with built-in or other extra columns")
        if not 1 <= self.frame_stack <= 64:
            raise ValueError(f"frame_stack must be between 1 and 64, got {self.frame_stack}")
        if not self.observations:
            raise ValueError("a store needs at least one observation column")

    @property
    def transition_columns(self) -> tuple[ColumnSpec, ...]:
        return (self.action, self.reward, *self.extras)

    def to_json(self) -> dict[str, Any]:
        return {
            "observations": [c.to_json() for c in self.observations],
            "action": self.action.to_json(),
            "reward": self.reward.to_json(),
            "extras": [c.to_json() for c in self.extras],
            "dict_obs": self.dict_obs,
            "frame_stack": self.frame_stack,
            "observation_space": self.observation_space,
            "action_space": self.action_space,
            "stack_padding": self.stack_padding,
        }

    @classmethod
    def from_json(cls, data: Any) -> "Schema":
        if not isinstance(data, dict):
            raise ValueError(f"schema must be an object, got {type(data).__name__}")
        try:
            return cls(
                observations=tuple(ColumnSpec.from_json(c) for c in data["observations"]),
                action=ColumnSpec.from_json(data["action"]),
                reward=ColumnSpec.from_json(data["reward"]),
                extras=tuple(ColumnSpec.from_json(c) for c in data.get("extras", [])),
                dict_obs=bool(data.get("dict_obs", False)),
                frame_stack=int(data.get("frame_stack", 1)),
                observation_space=data.get("observation_space"),
                action_space=data.get("action_space"),
                stack_padding=data.get("stack_padding", "first"),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed schema: missing or wrong field {exc}") from None

    def spaces(self) -> tuple[spaces.Space | None, spaces.Space | None]:
        obs = space_from_json(self.observation_space) if self.observation_space else None
        act = space_from_json(self.action_space) if self.action_space else None
        return obs, act


# -- from gymnasium spaces -------------------------------------------------------------------------

def schema_from_spaces(
    observation_space: spaces.Space,
    action_space: spaces.Space,
    *,
    reward_values: Sequence[float] | None = None,
    frame_stack: int = 1,
    frame_codec: str | Mapping[str, Any] = "lz4hc",
    extras: Sequence[ColumnSpec] = (),
    columns: Mapping[str, ColumnSpec] | None = None,
    stack_padding: str = "first",
) -> Schema:
    """Derive every column from the spaces; ``columns`` overrides any derived column by name."""
    overrides = dict(columns or {})
    codec = _frame_codec(frame_codec)
    if isinstance(observation_space, spaces.Dict):
        obs_cols = tuple(_observation_column(validate_name(k, "observation key"), s, codec)
                         for k, s in observation_space.spaces.items())
        dict_obs = True
    else:
        obs_cols = (_observation_column("obs", observation_space, codec),)
        dict_obs = False
    obs_cols = tuple(overrides.pop(c.name, c) for c in obs_cols)
    action = overrides.pop("action", None) or action_column(action_space)
    if reward_values is not None:
        reward = ColumnSpec.packed("reward", reward_values, dtype="float32")
    else:
        reward = ColumnSpec.numeric("reward", (), "float32")
    reward = overrides.pop("reward", reward)
    if overrides:
        raise ValueError(f"columns {sorted(overrides)} override nothing: known columns are "
                         f"{[c.name for c in obs_cols] + ['action', 'reward']}")
    return Schema(obs_cols, action, reward, tuple(extras), dict_obs, int(frame_stack),
                  space_to_json(observation_space), space_to_json(action_space), stack_padding)


def action_column(space: spaces.Space) -> ColumnSpec:
    if isinstance(space, spaces.Discrete):
        n, start = int(space.n), int(space.start)
        if bits_for(n) is not None:
            return ColumnSpec.packed("action", range(start, start + n), dtype="int64")
        return ColumnSpec.numeric("action", (), _smallest_int(start, start + n - 1))
    if isinstance(space, spaces.MultiBinary):
        return ColumnSpec.numeric("action", np.atleast_1d(space.shape), "uint8")
    if isinstance(space, spaces.MultiDiscrete):
        start = np.broadcast_to(np.asarray(getattr(space, "start", 0), dtype=np.int64), space.nvec.shape)
        return ColumnSpec.numeric("action", space.shape, _smallest_int(int(start.min()),
                                                                      int((start + space.nvec).max()) - 1))
    if isinstance(space, spaces.Box):
        return ColumnSpec.numeric("action", space.shape, np.dtype(space.dtype).name)
    raise TypeError(f"unsupported action space {space!r}: expected Discrete, MultiBinary, MultiDiscrete or Box")


def _observation_column(name: str, space: spaces.Space, codec: Mapping[str, Any] | str) -> ColumnSpec:
    if isinstance(space, spaces.Box):
        shape, dtype = tuple(space.shape), np.dtype(space.dtype)
    elif isinstance(space, spaces.Discrete):
        shape, dtype = (), np.dtype(_smallest_int(int(space.start), int(space.start + space.n - 1)))
    elif isinstance(space, (spaces.MultiBinary, spaces.MultiDiscrete)):
        shape, dtype = tuple(space.shape), np.dtype("int64" if isinstance(space, spaces.MultiDiscrete) else "uint8")
    else:
        raise TypeError(f"unsupported observation space {space!r} for key {name!r}: expected Box, Discrete, "
                        "MultiBinary, MultiDiscrete (or a Dict of them)")
    is_image = dtype == np.uint8 and len(shape) in (2, 3)
    row_nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    if codec is FRAME_CODECS["delta-zstd"] and row_nbytes >= LARGE_FRAME_BYTES:
        codec = DELTA_ZSTD_LARGE  # the named codec, sized for colour frames (see LARGE_FRAME_BYTES)
    if is_image:  # one frame a chunk, or a run of frames where the codec asks for one (the temporal codec's run)
        chunk_rows = codecs.get(codec.get("name")).chunk_rows(codec) or 1
    else:
        chunk_rows = max(1, min(4096, FRAME_CHUNK_BYTES // row_nbytes))
    chunk_rows = 1 << (chunk_rows.bit_length() - 1)  # a power of two, so chunks tile shards exactly
    return ColumnSpec(name, "frame", shape, dtype.name, chunk_rows=chunk_rows,
                      codec=dict(codec) if is_image else dict(DEFAULT_NUMERIC_CODEC))


def is_colour_frame(shape: Sequence[int], dtype) -> bool:
    """A uint8 image with a colour axis (3 or 4 channels) first or last: (3, H, W) or (H, W, 3)."""
    return (np.dtype(dtype) == np.uint8 and len(shape) == 3
            and (shape[0] in (3, 4) or shape[-1] in (3, 4)) and min(shape[0], shape[-1]) <= 4)


def choose_frame_codec(observation_space: spaces.Space, frames_kept: int | None, budget_bytes: int) -> str:
    """The frame codec ``frame_codec="auto"`` picks for a new store (existing stores keep theirs).

    - ``"delta-zstd"`` (runs of frames coded against each other) for colour frames of at least
      ``AUTO_TEMPORAL_MIN_BYTES``: per frame they shrink ~1.6x (lz4hc), in runs ~5x (real DMC frames), and
      every decode costs less from RAM than from disk;
    - ``"delta-zstd"`` as well when the store's grey frames, coded one by one, would not fit ``budget_bytes``
      (the session's ``cache_bytes``) at the store's frame capacity: ``frames_kept`` frames of
      ``raw / PER_FRAME_RATIO_ASSUMED`` bytes each (10M Atari: ~7 GB against a 1 GiB budget);
    - ``"lz4hc"`` otherwise (1M Atari: ~0.8 GB, held in RAM whole and decoded in ~1 us a frame), and for an
      unbounded store (``capacity=None``), whose size is not known at creation.
    """
    columns = observation_space.spaces.values() if isinstance(observation_space, spaces.Dict) else [observation_space]
    grey_bytes = 0
    for space in columns:
        if not isinstance(space, spaces.Box) or np.dtype(space.dtype) != np.uint8 or len(space.shape) not in (2, 3):
            continue
        raw = int(np.prod(space.shape, dtype=np.int64))
        if is_colour_frame(space.shape, space.dtype) and raw >= AUTO_TEMPORAL_MIN_BYTES:
            return "delta-zstd"
        grey_bytes += raw
    if frames_kept is not None and grey_bytes and frames_kept * grey_bytes // PER_FRAME_RATIO_ASSUMED > budget_bytes:
        return "delta-zstd"
    return "lz4hc"


def _frame_codec(codec: str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(codec, str):
        if codec not in FRAME_CODECS:
            raise ValueError(f"frame_codec {codec!r} unknown: expected one of {sorted(FRAME_CODECS)} or a codec dict")
        return FRAME_CODECS[codec]
    return dict(codec)


def _smallest_int(lo: int, hi: int) -> str:
    for dt in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64"):
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return dt
    raise ValueError(f"integer range [{lo}, {hi}] does not fit int64")
