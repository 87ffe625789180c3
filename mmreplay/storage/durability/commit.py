"""The commit record (plain JSON) and the commit protocol around it.

Invariant: the commit record describes a state whose data files were all durable before the record was
(atomically) replaced; reopening reads exactly that state. It is stored as the attributes of an empty
zarr group, ``<root>/commit/zarr.json`` (key ``mmreplay_commit``), so the whole directory stays a clean
zarr hierarchy. The record's crc32c (of its canonical JSON) is stored beside it (``mmreplay_commit_crc32c``)
and checked on every read, like a shard index's: an edited or damaged record raises ``CorruptDataError``
(records of stores written before the checksum existed have none and are read as they are). A record that
is missing fields, has wrong types or absurd values raises ``FormatError``.

The record says which file each shard it covers must be (``shard_ids``: per array path, the identity of
each sealed shard and the earliest write time of the partial one; see ``storage/format/sharded.py``): reading a
committed shard from another file is ``CorruptDataError``. Every record written (give-ups included)
states what the files are at that moment, after the files it covers were written. Records written before identities existed have none, and their
shards are read unchecked.

The protocol: ``CommitLog`` (the writer) fsyncs every data file written since the last commit, then
replaces the record; before a shard file of the previous lap is overwritten it first commits a record
that gives that shard up. ``CommitWatcher`` (a reader) bounds what it read by the ``oldest`` of every
record seen after the read: the writer commits a larger ``oldest`` before it replaces the files below it.
A rollback (``rollbacks``, the count of rollbacks ever committed, grows) lowers ``head``, and the rows past
it are rewritten: a reader trusts nothing read before it saw a record of another count.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

import google_crc32c

from mmreplay.errors import CorruptDataError, FormatError, NotAStoreError
from mmreplay.storage.files import atomic_write, fsync_dir, fsync_written, makedirs_inside, open_regular, read_fd_capped

COMMIT_GROUP = "commit"
COMMIT_FILE = os.path.join(COMMIT_GROUP, "zarr.json")
COMMIT_KEY = "mmreplay_commit"
CHECKSUM_KEY = "mmreplay_commit_crc32c"
MAX_RECORD_BYTES = 1 << 26
# Names of priority sets and samplers: they name directories, so nothing that could leave the store.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FORMAT_VERSION = 1
MAX_ROWS = 1 << 40
MAX_APP_META_BYTES = 1 << 20  # the record is re-read after every reader batch: keep it small
SHARD_IDS_KEY = "shard_ids"
MAX_SHARDS = 1 << 24

NOTHING_VALID = 1 << 62  # a reader's floor after a rollback: no row read before it is trusted
COMMIT_INT_FIELDS = ("sequence", "head", "oldest", "frame_head", "frame_oldest", "transition_rows", "frame_rows",
                     "max_prev_delta")


def check_app_meta(app_meta: Any) -> dict[str, Any]:
    """``app_meta`` as it will be stored in the commit record: a plain JSON object (a copy), small."""
    if not isinstance(app_meta, dict):
        raise TypeError(f"app_meta must be a dict (a JSON object), got {type(app_meta).__name__}")
    try:
        text = json.dumps(app_meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"app_meta must hold plain JSON values (str keys; no NaN): {exc}") from None
    if len(text) > MAX_APP_META_BYTES:
        raise ValueError(f"app_meta takes {len(text)} bytes of JSON, more than {MAX_APP_META_BYTES}")
    return json.loads(text)


def record_checksum(record: dict[str, Any]) -> int:
    """crc32c of the record's canonical JSON (sorted keys, no spaces)."""
    return google_crc32c.value(json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False).encode())


def write_commit(root: str, record: dict[str, Any], *, durable: bool = True) -> None:
    group = {"zarr_format": 3, "node_type": "group",
             "attributes": {COMMIT_KEY: record, CHECKSUM_KEY: record_checksum(record)}}
    data = json.dumps(group, separators=(",", ":"), allow_nan=False).encode()
    directory = os.path.join(root, COMMIT_GROUP)
    if not os.path.lexists(directory):
        makedirs_inside(root, directory)
        if durable:
            fsync_dir(root)
    atomic_write(os.path.join(root, COMMIT_FILE), data, root=root, fsync=durable)
    if durable:
        fsync_dir(directory)


def read_commit(root: str) -> dict[str, Any]:
    return parse_commit(read_commit_bytes(root), os.path.join(root, COMMIT_FILE))


def read_commit_bytes(root: str) -> bytes:
    """The commit file as it is now (readers compare these bytes to notice a new commit: the record's
    ``sequence`` grows with every commit, so equal bytes mean the same commit)."""
    fd, raw = open_commit(root)
    os.close(fd)
    return raw


def open_commit(root: str) -> tuple[int, bytes]:
    """The commit file opened (the caller closes the fd) and its bytes, read through that fd."""
    path = os.path.join(root, COMMIT_FILE)
    try:
        fd = open_regular(path)  # never a link, FIFO or device: /dev/zero says size 0 and never ends
    except FileNotFoundError:
        if os.path.exists(os.path.join(root, "zarr.json")):
            raise NotAStoreError(f"{root!r} has no commit record ({COMMIT_FILE} is missing): the store was never "
                                 "completely created (a crash during Store.create?) or the file was deleted; "
                                 "Store.create on this path starts it again when no commit record was ever "
                                 "written") from None
        raise NotAStoreError(f"{root!r} is not an mmreplay store: {COMMIT_FILE} is missing") from None
    try:  # readers call this after every batch: read what is there, not into a buffer of the maximum size
        raw = read_fd_capped(fd, path, MAX_RECORD_BYTES)
    except BaseException:
        os.close(fd)
        raise
    return fd, raw


def parse_commit(raw: bytes, path: str) -> dict[str, Any]:
    """The validated record in ``raw`` (the bytes of ``path``)."""
    try:
        group = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise FormatError(f"{path}: commit record is not valid JSON ({exc})") from None
    attributes = group.get("attributes") if isinstance(group, dict) else None
    record = attributes.get(COMMIT_KEY) if isinstance(attributes, dict) else None
    if not isinstance(record, dict):
        raise FormatError(f"{path}: no commit record (expected an object under attributes.{COMMIT_KEY})")
    stored = attributes.get(CHECKSUM_KEY)
    if stored is not None:
        try:
            actual = record_checksum(record)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"{path}: commit record holds values JSON cannot hold ({exc})") from None
        if stored != actual:
            raise CorruptDataError(f"{path}: commit record checksum mismatch (stored {stored!r}, computed "
                                   f"{actual}): the record was edited or damaged")
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
    if record["max_prev_delta"] >= 1 << 32:  # episode links are stored as uint32
        raise FormatError(f"{path}: max_prev_delta {record['max_prev_delta']} is not below 2**32")
    streams = record.get("streams")
    if not isinstance(streams, list) or not all(
            isinstance(s, list) and len(s) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
            for s in streams):
        raise FormatError(f"{path}: 'streams' must be a list of [stream, last_transition, ended] integer triples")
    rollbacks = record.get("rollbacks", 0)
    if not isinstance(rollbacks, int) or isinstance(rollbacks, bool) or not 0 <= rollbacks < 1 << 62:
        raise FormatError(f"{path}: field 'rollbacks' must be a non-negative integer, got {rollbacks!r}")
    if not isinstance(record.get("app", {}), dict):
        raise FormatError(f"{path}: 'app' (the application's metadata) must be a JSON object")
    if not valid_shard_ids(record.get(SHARD_IDS_KEY, {})):
        raise FormatError(f"{path}: {SHARD_IDS_KEY!r} must map array paths to {{'sealed': a list (at most "
                          f"{MAX_SHARDS}) of shard identities (integers in [0, 2**32) or null), 'partial': "
                          "[file shard, write time in ns] or null}")
    samplers = record.setdefault("samplers", {})
    if not isinstance(samplers, dict) or not all(valid_name(k) and valid_rng_state(v) for k, v in samplers.items()):
        raise FormatError(f"{path}: 'samplers' must map names (1-64 letters, digits, '_', '-') to PCG64 states "
                          "({'bit_generator': 'PCG64', 'state': {'state': int, 'inc': int}, ...})")
    priorities = record.setdefault("priorities", {})
    if not isinstance(priorities, dict) or not all(
            valid_name(name) and valid_priority_entry(entry, record["head"])
            for name, entry in priorities.items()):
        raise FormatError(f"{path}: 'priorities' must map names (1-64 letters, digits, '_', '-') to {{'buffer': 0 "
                          "or 1, 'max_priority': a number in (0, 3.4e38] whose (max_priority + eps) ** alpha does "
                          f"not overflow, 'head': an integer <= head}}, got {str(priorities)[:200]}")
    return record


# Priorities are stored as float32; a leaf (p + eps) ** alpha must stay so far below float64's maximum that
# the sum of every leaf of the largest ring (2**40 rows) cannot overflow the tree either.
MAX_PRIORITY = 3.4028234663852886e38  # float32's largest
MAX_LEAF = 1.7976931348623157e308 / 2.0**41  # float64's largest, over the most leaves a ring can have


def check_leaf_range(top: float, alpha: float, eps: float, what: str, error: type = ValueError) -> None:
    """Refuse (before anything changes) priorities or exponents whose largest leaf would overflow."""
    if top > MAX_PRIORITY:
        raise error(f"{what}: priority {top!r} is larger than float32 can hold ({MAX_PRIORITY:.4g}); "
                         "priorities are stored as float32")
    try:
        leaf = (top + eps) ** alpha
    except OverflowError:
        leaf = float("inf")
    if not leaf <= MAX_LEAF:
        raise error(f"{what}: (priority + eps) ** alpha = ({top!r} + {eps!r}) ** {alpha!r} overflows "
                         f"(must stay <= {MAX_LEAF:.3g}); use a smaller alpha or smaller priorities")


def valid_shard_ids(ids: Any) -> bool:
    """``{array path: {"sealed": [identity or None, ...], "partial": [file shard, written ns] or None}}``."""
    def integer(v, top):
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < top

    return isinstance(ids, dict) and all(
        isinstance(path, str) and isinstance(entry, dict) and isinstance(entry.get("sealed", []), list)
        and len(entry.get("sealed", [])) <= MAX_SHARDS
        and all(v is None or integer(v, 1 << 32) for v in entry.get("sealed", []))
        and (entry.get("partial") is None or (isinstance(entry["partial"], list) and len(entry["partial"]) == 2
                                              and integer(entry["partial"][0], MAX_SHARDS)
                                              and integer(entry["partial"][1], 1 << 63)))
        for path, entry in ids.items())


def valid_name(name: Any) -> bool:
    return isinstance(name, str) and NAME_PATTERN.match(name) is not None


def valid_priority_entry(entry: Any, head: int) -> bool:
    if not isinstance(entry, dict):
        return False
    buffer, max_p, seen = entry.get("buffer"), entry.get("max_priority"), entry.get("head")
    exponents_ok = all(isinstance(entry.get(k, 0.0), (int, float)) and not isinstance(entry.get(k, 0.0), bool)
                       and 0 <= entry.get(k, 0.0) < float("inf") for k in ("alpha", "eps"))
    if not (exponents_ok and buffer in (0, 1) and not isinstance(buffer, bool) and
            isinstance(max_p, (int, float)) and not isinstance(max_p, bool) and 0 < max_p < float("inf") and
            isinstance(seen, int) and not isinstance(seen, bool) and 0 <= seen <= head):
        return False
    try:
        # with eps 1 when the entry has none: at least as large as any default a sampler would use
        check_leaf_range(max_p, entry.get("alpha", 1.0), entry.get("eps", 1.0), "")
    except ValueError:
        return False
    return True


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


class CommitLog:
    """The writer's side of the protocol: ``record`` is the last durable commit record."""

    def __init__(self, root: str, record: dict[str, Any], *, durable: bool = True):
        self.root = root
        self.durable = durable
        self.record = record
        # The identities of the shard files now (``sharded.shard_identities``), written into every record:
        # taken when a record is written, after the files it covers were (sealed writes are waited for).
        self.identities: Callable[[dict], dict[str, dict]] | None = None

    @property
    def sequence(self) -> int:
        return self.record["sequence"]

    def commit(self, state: dict[str, Any], written: list[str]) -> None:
        """Make ``written`` (data files of this state) durable, then atomically replace the record with
        ``state`` under the next sequence number. ``written`` is emptied."""
        self.sync(written)
        record = {**state, "format_version": FORMAT_VERSION, "sequence": self.record["sequence"] + 1}
        if self.identities is not None:
            record[SHARD_IDS_KEY] = self.identities(record)
        write_commit(self.root, record, durable=self.durable)
        self.record = record

    def give_up_below(self, oldest: int, frame_oldest: int, written: Callable[[], list[str]]) -> None:
        """A shard file of the previous lap is about to be replaced: the durable record must first stop
        covering transitions below ``oldest`` and frames below ``frame_oldest`` (clamped to what it
        holds), or a crash now would leave a record pointing at new data. ``written()`` hands over the
        data files written so far, taken only when a record is written."""
        rec = self.record
        oldest, frame_oldest = min(oldest, rec["head"]), min(frame_oldest, rec["frame_head"])
        if rec["oldest"] >= oldest and rec["frame_oldest"] >= frame_oldest:
            return
        # files written so far belong to neither commit, but flush them anyway
        self.commit({**rec, "oldest": max(rec["oldest"], oldest),
                     "frame_oldest": max(rec["frame_oldest"], frame_oldest)}, written())

    def sync(self, written: list[str]) -> None:
        if self.durable and written:
            fsync_written(written)
        written.clear()


class CommitWatcher:
    """A reader's side: which commit it last saw, and the floor below which rows may have been replaced.

    It keeps the commit file it last read open. Every commit replaces the file (a new file renamed over
    it, never an edit in place), and an inode held open cannot be reused, so while the path still names
    the held inode no commit happened since: the common check is one ``stat``, not an open and a read."""

    def __init__(self, root: str):
        self.root = root
        self.path = os.path.join(root, COMMIT_FILE)
        self.seen: bytes | None = None  # the commit file's bytes when last looked at
        self.floor = (0, 0)  # (oldest, frame_oldest) of the newest commit seen since the last ``newest``
        self.rollbacks = 0  # the rollback count of the record ``newest`` read
        self._held: int | None = None  # fd of the file whose bytes are ``seen``
        self._held_id: tuple[int, int] | None = None  # its (device, inode)

    def newest(self) -> dict[str, Any]:
        """Read the record now and restart the floor from it (right after loading a commit's files)."""
        raw = self._read()
        record = parse_commit(raw, self.path)
        self.seen = raw
        self.floor = (record["oldest"], record["frame_oldest"])
        self.rollbacks = record.get("rollbacks", 0)
        return record

    def still_valid(self, min_transition: int, min_frame: int) -> bool:
        """Were rows read before this call (transitions >= ``min_transition``, frames >= ``min_frame``)
        above the ``oldest`` of every commit seen so far, the newest read now? The floor only rises until
        the next ``newest``. Equal file bytes mean no new commit (the sequence grows with each)."""
        if not self._unchanged():
            raw = self._read()
            if raw != self.seen:
                record = parse_commit(raw, self.path)
                self.seen = raw
                self.floor = (max(self.floor[0], record["oldest"]), max(self.floor[1], record["frame_oldest"]))
                if record.get("rollbacks", 0) != self.rollbacks:  # rows past its head are being rewritten
                    self.floor = (NOTHING_VALID, NOTHING_VALID)
        return min_transition >= self.floor[0] and min_frame >= self.floor[1]

    def _unchanged(self) -> bool:
        """Does the path still name the file last read (so nothing was committed since)?"""
        if self._held_id is None:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            return False  # gone: _read says what is wrong
        return (st.st_dev, st.st_ino) == self._held_id

    def _read(self) -> bytes:
        fd, raw = open_commit(self.root)
        st = os.fstat(fd)
        self.close()
        self._held, self._held_id = fd, (st.st_dev, st.st_ino)
        return raw

    def close(self) -> None:
        if self._held is not None:
            os.close(self._held)
            self._held = self._held_id = None
