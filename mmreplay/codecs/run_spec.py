"""What the codecs of runs of frames (``delta-lz4``; the same rules as ``temporal``'s) check the same way: a
spec's integer settings, a run length that tiles shards, and a run's header of one-byte backward references.

Invariant: ``check_settings`` returns only when every key of the spec is known and every setting checked is an
integer (not a bool) inside its range, and the run length is a power of two; ``parse_run_header`` returns a
run's (frames, frame bytes, references) only when the magic is the codec's, ``1 <= n <= max_run``, the run
decodes to exactly the bytes expected (and at most ``max_nbytes``), the references fit in the data and each
points to an earlier frame of the run (``refs[i] <= i``). Otherwise both raise ``ValueError`` naming the codec,
the value and what was expected. Nothing here imports a codec: a codec passes its name, header and limits.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


def check_settings(codec: str, spec: Mapping[str, Any], checks: Iterable[tuple[str, Any, int, int]],
                   known: Iterable[str] | None = None, run_key: str = "run") -> None:
    """``checks``: (key, value, lo, hi) each an integer in ``lo..hi``; ``known`` (with ``"name"``): the keys a
    spec may hold (None: not checked); the value of ``run_key`` among the checks a power of two."""
    checks = list(checks)
    if known is not None:
        unknown = set(spec) - {"name", *known}
        if unknown:
            raise ValueError(f"{codec} codec {dict(spec)} invalid: unknown keys {sorted(unknown)} (expected "
                             f"{', '.join(sorted(known))})")
    for key, value, lo, hi in checks:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"{codec} codec {dict(spec)} invalid: {key} must be an integer in {lo}..{hi}, "
                             f"got {value!r}")
    run = next((value for key, value, _, _ in checks if key == run_key), None)
    if run is not None and run & (run - 1):
        raise ValueError(f"{codec} codec {dict(spec)} invalid: {run_key} must be a power of two (chunks tile "
                         f"shards), got {run}")


def parse_run_header(data, expected_nbytes: int, header: struct.Struct, magic: bytes, max_run: int, codec: str,
                     max_nbytes: int | None = None) -> tuple[int, int, np.ndarray]:
    """(n_frames, frame_nbytes, references) of a run whose ``header`` (magic, frames, frame bytes) is followed
    by one uint8 reference a frame, and which must decode to ``expected_nbytes``."""
    if len(data) < header.size:
        raise ValueError(f"{codec} chunk is {len(data)} bytes, shorter than its {header.size}-byte header")
    got, n, frame_nbytes = header.unpack_from(data, 0)
    if got != magic:
        raise ValueError(f"{codec} chunk starts with {got!r}, expected {magic!r}")
    if not 1 <= n <= max_run or n * frame_nbytes != expected_nbytes or \
            (max_nbytes is not None and expected_nbytes > max_nbytes):
        raise ValueError(f"{codec} chunk announces {n} frames of {frame_nbytes} bytes, expected "
                         f"{expected_nbytes} bytes in all" + (f" (at most {max_nbytes})" if max_nbytes else ""))
    if len(data) < header.size + n:
        raise ValueError(f"{codec} chunk is {len(data)} bytes, shorter than its header of {n} references")
    refs = np.frombuffer(data, dtype=np.uint8, count=n, offset=header.size)
    if (refs > np.arange(n)).any():
        bad = int(np.argmax(refs > np.arange(n)))
        raise ValueError(f"{codec} chunk: frame {bad} refers {int(refs[bad])} frames back, before the run starts")
    return n, frame_nbytes, refs
