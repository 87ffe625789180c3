"""``Settings``: what one session of a store chooses, as opposed to what the store *is*.

Invariant: a ``Settings`` is validated when made, is never stored on disk, and the same value may be
passed to ``Store.create`` and ``Store.open``; the schema and ring geometry (what the store is) live in
the store's metadata instead.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
DEFAULT_CACHE_BYTES = 1024 * MIB
DEFAULT_COMMIT_EVERY = 25_000
DEFAULT_COMMIT_SECONDS = 30.0
DEFAULT_IO_DEPTH = 32
MAX_IO_DEPTH = 1024


@dataclass(frozen=True)
class Settings:
    """Per-session settings of a ``Store`` (``Store.create(..., settings=)`` / ``Store.open(..., settings=)``).

    - ``cache_bytes``: RAM for frames, per process: the compressed shards held whole when they fit, and
      decoded frames (an LRU cache of chunks); split between the two by ``reading.tiers.plan_tiers``.
    - ``commit_every`` / ``commit_seconds``: a writer commits on its own after this many transitions or
      seconds since the last commit. A crash loses at most what was added since the last commit (call
      ``flush()`` to commit now; ``close()`` always commits).
    - ``durable``: fsync data and commit record on every commit. ``False`` is faster and still atomic
      against a process crash, but a power loss may lose or tear recent commits.
    - ``io_depth``: frames that RAM does not hold are read from their files with up to this many reads in
      flight (one thread each; ``reading/disk.py``). An SSD or a virtio disk serves several times more
      random reads per second at depth 32 than at depth 1; 1 reads one chunk after another.
    """

    cache_bytes: int = DEFAULT_CACHE_BYTES
    commit_every: int = DEFAULT_COMMIT_EVERY
    commit_seconds: float = DEFAULT_COMMIT_SECONDS
    durable: bool = True
    io_depth: int = DEFAULT_IO_DEPTH

    def __post_init__(self) -> None:
        for name in ("cache_bytes", "commit_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        seconds = self.commit_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or math.isnan(seconds):
            raise ValueError(f"commit_seconds must be a number of seconds, got {seconds!r}")
        object.__setattr__(self, "commit_seconds", float(seconds))
        if self.durable not in (True, False):
            raise ValueError(f"durable must be True or False, got {self.durable!r}")
        object.__setattr__(self, "durable", bool(self.durable))
        depth = self.io_depth
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or not 1 <= depth <= MAX_IO_DEPTH:
            raise ValueError(f"io_depth must be an integer from 1 to {MAX_IO_DEPTH} (reads in flight), got {depth!r}")
        object.__setattr__(self, "io_depth", int(depth))

    @classmethod
    def resolve(cls, settings: "Settings | None", overrides: dict[str, Any]) -> "Settings":
        """``settings`` (default: the defaults) with the keyword arguments ``overrides`` (the old spelling,
        ``Store.open(path, cache_bytes=...)``) applied; an unknown keyword is a ``TypeError``."""
        base = settings if settings is not None else cls()
        if not isinstance(base, cls):
            raise TypeError(f"settings must be an mmreplay.Settings, got {type(base).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; session settings are {sorted(known)}")
        return dataclasses.replace(base, **overrides) if overrides else base
