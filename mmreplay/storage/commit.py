"""The commit record and the store's static metadata, both plain JSON.

Invariant: the commit record describes a state whose data files were all durable before the record was
(atomically) replaced; reopening reads exactly that state. It is stored as the attributes of an empty
zarr group, ``<root>/commit/zarr.json`` (key ``mmreplay_commit``), so the whole directory stays a clean
zarr hierarchy. A record that is missing fields, has wrong types or absurd values raises ``FormatError``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mmreplay.errors import FormatError, NotAStoreError
from mmreplay.storage.files import atomic_write, fsync_dir

COMMIT_GROUP = "commit"
COMMIT_FILE = os.path.join(COMMIT_GROUP, "zarr.json")
COMMIT_KEY = "mmreplay_commit"
FORMAT_VERSION = 1
MAX_ROWS = 1 << 40

COMMIT_INT_FIELDS = ("sequence", "head", "oldest", "frame_head", "frame_oldest", "transition_rows", "frame_rows",
                     "max_prev_delta")


def write_commit(root: str, record: dict[str, Any], *, durable: bool = True) -> None:
    group = {"zarr_format": 3, "node_type": "group", "attributes": {COMMIT_KEY: record}}
    data = json.dumps(group, separators=(",", ":"), allow_nan=False).encode()
    directory = os.path.join(root, COMMIT_GROUP)
    if not os.path.isdir(directory):
        os.makedirs(directory)
        if durable:
            fsync_dir(root)
    atomic_write(os.path.join(root, COMMIT_FILE), data, fsync=durable)
    if durable:
        fsync_dir(directory)


def read_commit(root: str) -> dict[str, Any]:
    path = os.path.join(root, COMMIT_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 26)
    except FileNotFoundError:
        raise NotAStoreError(f"{root!r} is not an mmreplay store: {COMMIT_FILE} is missing") from None
    try:
        group = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: commit record is not valid JSON ({exc})") from None
    record = group.get("attributes", {}).get(COMMIT_KEY) if isinstance(group, dict) else None
    if not isinstance(record, dict):
        raise FormatError(f"{path}: no commit record (expected an object under attributes.{COMMIT_KEY})")
    check_version(record.get("format_version"), path)
    for name in COMMIT_INT_FIELDS:
        value = record.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
            raise FormatError(f"{path}: field {name!r} must be a non-negative integer, got {value!r}")
    if not record["oldest"] <= record["head"] or not record["frame_oldest"] <= record["frame_head"]:
        raise FormatError(f"{path}: oldest ({record['oldest']}, frames {record['frame_oldest']}) lies after head "
                          f"({record['head']}, frames {record['frame_head']})")
    for name in ("transition_rows", "frame_rows"):
        if not 8 <= record[name] <= MAX_ROWS:
            raise FormatError(f"{path}: {name} {record[name]} outside [8, {MAX_ROWS}]")
    streams = record.get("streams")
    if not isinstance(streams, list) or not all(
            isinstance(s, list) and len(s) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
            for s in streams):
        raise FormatError(f"{path}: 'streams' must be a list of [stream, last_transition, ended] integer triples")
    samplers = record.setdefault("samplers", {})
    if not isinstance(samplers, dict) or not all(valid_rng_state(v) for v in samplers.values()):
        raise FormatError(f"{path}: 'samplers' must map names to PCG64 states "
                          "({'bit_generator': 'PCG64', 'state': {'state': int, 'inc': int}, ...})")
    priorities = record.setdefault("priorities", {})
    if not isinstance(priorities, dict) or not all(
            isinstance(name, str) and valid_priority_entry(entry, record["head"])
            for name, entry in priorities.items()):
        raise FormatError(f"{path}: 'priorities' must map names to {{'buffer': 0 or 1, 'max_priority': a finite "
                          f"number > 0, 'head': an integer <= head}}, got {str(priorities)[:200]}")
    return record


def valid_priority_entry(entry: Any, head: int) -> bool:
    if not isinstance(entry, dict):
        return False
    buffer, max_p, seen = entry.get("buffer"), entry.get("max_priority"), entry.get("head")
    exponents_ok = all(isinstance(entry.get(k, 0.0), (int, float)) and not isinstance(entry.get(k, 0.0), bool)
                       and 0 <= entry.get(k, 0.0) < float("inf") for k in ("alpha", "eps"))
    return exponents_ok and buffer in (0, 1) and not isinstance(buffer, bool) and \
        isinstance(max_p, (int, float)) and not isinstance(max_p, bool) and 0 < max_p < float("inf") and \
        isinstance(seen, int) and not isinstance(seen, bool) and 0 <= seen <= head


def valid_rng_state(state: Any) -> bool:
    """A numpy PCG64 bit-generator state, as ``bit_generator.state`` returns it (plain JSON)."""
    if not isinstance(state, dict) or state.get("bit_generator") != "PCG64":
        return False
    inner = state.get("state")
    return isinstance(inner, dict) and all(isinstance(inner.get(k), int) and inner[k] >= 0 for k in ("state", "inc")) \
        and isinstance(state.get("has_uint32", 0), int) and isinstance(state.get("uinteger", 0), int)


def check_version(version: Any, where: str) -> None:
    if not isinstance(version, int) or isinstance(version, bool):
        raise FormatError(f"{where}: format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise FormatError(f"{where}: format version {version} is newer than this mmreplay supports "
                          f"({FORMAT_VERSION}); upgrade mmreplay to open it")
    if version < 1:
        raise FormatError(f"{where}: format version {version} is invalid (expected 1..{FORMAT_VERSION})")
