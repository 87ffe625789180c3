"""gymnasium spaces <-> plain JSON, so a store can describe its spaces without pickle.

Invariant: ``space_from_json(space_to_json(s)) == s`` for every supported space (Box, Discrete,
MultiBinary, MultiDiscrete, Dict of those). Anything else raises TypeError naming the space.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces


def space_to_json(space: spaces.Space) -> dict[str, Any]:
    if isinstance(space, spaces.Box):
        return {
            "type": "Box",
            "dtype": np.dtype(space.dtype).name,
            "shape": list(space.shape),
            "low": _bound_to_json(space.low),
            "high": _bound_to_json(space.high),
        }
    if isinstance(space, spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.MultiBinary):
        return {"type": "MultiBinary", "n": np.asarray(space.n).tolist()}
    if isinstance(space, spaces.MultiDiscrete):
        out = {"type": "MultiDiscrete", "nvec": space.nvec.tolist(), "dtype": np.dtype(space.dtype).name}
        start = np.asarray(getattr(space, "start", 0))
        if start.any():  # (written only when set, so that stores of start-0 spaces read as they always did)
            out["start"] = start.tolist()
        return out
    if isinstance(space, spaces.Dict):
        return {"type": "Dict", "spaces": {k: space_to_json(v) for k, v in space.spaces.items()}}
    raise TypeError(f"unsupported space {space!r}: expected Box, Discrete, MultiBinary, MultiDiscrete or Dict")


def space_from_json(data: Any) -> spaces.Space:
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"space description must be an object with a 'type', got {data!r}")
    kind = data["type"]
    if kind == "Box":
        dtype = np.dtype(data["dtype"])
        shape = tuple(int(d) for d in data["shape"])
        return spaces.Box(_bound_from_json(data["low"], shape, dtype), _bound_from_json(data["high"], shape, dtype),
                          shape=shape, dtype=dtype)
    if kind == "Discrete":
        return spaces.Discrete(int(data["n"]), start=int(data.get("start", 0)))
    if kind == "MultiBinary":
        return spaces.MultiBinary(data["n"])
    if kind == "MultiDiscrete":
        start = data.get("start")
        return spaces.MultiDiscrete(np.asarray(data["nvec"]), dtype=np.dtype(data.get("dtype", "int64")),
                                    **({} if start is None else {"start": np.asarray(start)}))
    if kind == "Dict":
        return spaces.Dict({k: space_from_json(v) for k, v in data["spaces"].items()})
    raise ValueError(f"unknown space type {kind!r}: expected Box, Discrete, MultiBinary, MultiDiscrete or Dict")


def _bound_to_json(bound: np.ndarray) -> Any:
    # A uniform bound is stored once; JSON has no inf, so infinities are spelled as strings.
    flat = np.asarray(bound).ravel()
    if flat.size and np.all(flat == flat[0]):
        return _scalar_to_json(flat[0])
    return [_scalar_to_json(v) for v in flat]


def _scalar_to_json(v: Any) -> Any:
    v = v.item() if hasattr(v, "item") else v
    if isinstance(v, float) and not np.isfinite(v):
        return "inf" if v > 0 else ("-inf" if v < 0 else "nan")
    return v


def _bound_from_json(data: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    values = np.asarray(data if isinstance(data, list) else [data], dtype=np.float64 if dtype.kind == "f" else None)
    if values.dtype.kind in "US":
        values = values.astype(np.float64)
    if values.size == 1:
        return np.full(shape, values.reshape(()), dtype=dtype)
    return values.reshape(shape).astype(dtype)
