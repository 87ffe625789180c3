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

from mmreplay.storage.files import fsync_dir

LEDGER_FILE = "ledger.json"
LEDGER_VERSION = 1


def ledger_path(shard_dir: str) -> str:
    return os.path.join(shard_dir, LEDGER_FILE)


def read_ledger(shard_dir: str) -> list[dict]:
    """The ledger's entries (oldest first); none for a shard that never committed a batch."""
    path = ledger_path(shard_dir)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("version") != LEDGER_VERSION:
        raise ValueError(f"{path}: ledger version {doc.get('version')!r}, this mmreplay reads {LEDGER_VERSION}")
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
    path = ledger_path(shard_dir)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": LEDGER_VERSION, "entries": new}, f)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(shard_dir)
    return new
