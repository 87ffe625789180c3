"""Which client batches a shard's store holds: the ledger beside the store, committed with it.

Invariant: for the store's committed head ``H`` the ledger has an entry ``{"head": H, "clients": {c: s}}``
where ``s`` is the sequence number of client ``c``'s last batch inside the commit. The shard writes the
entry for the head it is about to commit (atomically: temp file, fsync, rename, fsync dir) *before* it
commits the store, and keeps the previous entry too; a crash between the two leaves the store at the
previous head, whose entry is still there. So after any crash the shard knows exactly which batches it
holds, and a client resending everything after ``s`` makes every transition present exactly once.

The ledger is JSON (no pickle); its name keeps it outside the zarr hierarchy of the store.
"""

from __future__ import annotations

import json
import os

from mmreplay.storage.public import atomic_write, fsync_dir, read_regular

LEDGER_FILE = "ledger.json"
LEDGER_VERSION = 1
MAX_LEDGER_BYTES = 1 << 24  # two entries of client sequence numbers: kilobytes


def ledger_path(shard_dir: str) -> str:
    return os.path.join(shard_dir, LEDGER_FILE)


def read_ledger(shard_dir: str) -> list[dict]:
    """The ledger's entries (oldest first); none for a shard that never committed a batch."""
    path = ledger_path(shard_dir)
    if not os.path.lexists(path):
        return []
    try:  # a link, FIFO or device there is refused (UnsafeEntryError), never read through
        doc = json.loads(read_regular(path, MAX_LEDGER_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: the ledger is not valid JSON ({exc})") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if version != LEDGER_VERSION:
        raise ValueError(f"{path}: ledger version {version!r}, this mmreplay reads {LEDGER_VERSION}")
    return doc["entries"]


def clients_at(entries: list[dict], head: int, shard_dir: str) -> dict[int, int]:
    """Each client's last committed sequence number for a store committed at ``head``."""
    if head == 0 and not any(e["head"] == 0 for e in entries):
        return {}
    for entry in reversed(entries):
        if entry["head"] == head:
            return {int(c): int(s) for c, s in entry["clients"].items()}
    raise ValueError(f"{ledger_path(shard_dir)}: no entry for the store's committed head {head} (entries at "
                     f"{[e['head'] for e in entries]}); the store was written by something other than its shard")


def make_entry(head: int, clients: dict[int, int]) -> dict:
    return {"head": int(head), "clients": {str(c): int(s) for c, s in sorted(clients.items())}}


def write_ledger(shard_dir: str, committed: dict | None, head: int, clients: dict[int, int], durable: bool = True
                 ) -> list[dict]:
    """Write the entry for ``head`` beside ``committed`` (the entry of the store's current commit; an entry
    written before a crash that never reached the store is dropped) and replace the file atomically."""
    new = ([committed] if committed is not None and committed["head"] != head else []) + [make_entry(head, clients)]
    data = json.dumps({"version": LEDGER_VERSION, "entries": new}).encode()
    atomic_write(ledger_path(shard_dir), data, root=shard_dir, fsync=durable)  # never through a planted link
    if durable:
        fsync_dir(shard_dir)
    return new
