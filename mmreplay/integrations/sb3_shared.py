"""The one open store of each directory in this process, shared by every SB3 buffer made for it.

Invariant: at most one open ``Store`` per directory (keyed by its real path) in this process. A buffer made
for a path that is open here (``DQN.load``, ``load_replay_buffer``, a copy) adopts the handle, committed
first, instead of opening the store again (a second writer would hit the store's writer lock); the store
is committed and closed once no buffer holds the handle, or at interpreter exit.
"""

from __future__ import annotations

import os
import weakref

from mmreplay.errors import StoreClosedError
from mmreplay.store import Store


class SharedStore:
    """The one open store of a directory in this process; every buffer on that path holds this handle."""

    def __init__(self, store: Store):
        self.store = store
        self.buffers: weakref.WeakSet = weakref.WeakSet()  # buffers attached and not closed
        # Frame stacks: stream -> (its last next stack's bytes in SB3's layout, whether that step ended the
        # episode), as this process's buffers added them; a stream not here is asked of the store.
        self.tails: dict[int, tuple[bytes, bool]] = {}
        # A model checkpoint was saved before the transitions of its own step were added (SB3 runs callbacks,
        # CheckpointCallback's model.save among them, before it stores that step): commit again after them.
        self.commit_after_add = False
        # Commit and release the writer lock once no buffer holds the handle (or at interpreter exit).
        self._finalizer = weakref.finalize(self, _close_quietly, store)

    def replace(self, store: Store) -> None:
        self._finalizer.detach()
        self.store = store
        self.tails.clear()
        self._finalizer = weakref.finalize(self, _close_quietly, store)

    def close(self) -> None:
        self._finalizer()  # runs _close_quietly once; later calls do nothing


OPEN: weakref.WeakValueDictionary[str, SharedStore] = weakref.WeakValueDictionary()


def _close_quietly(store: Store) -> None:
    try:
        store.close()
    except StoreClosedError:
        pass


def store_key(path: str) -> str:
    return os.path.realpath(path)


def adopt(path: str) -> SharedStore | None:
    """The handle this process already has open for ``path`` (committed now), or None."""
    shared = OPEN.get(store_key(path))
    if shared is None:
        return None
    try:
        shared.store.flush()  # the buffer that takes over starts from a committed state
    except StoreClosedError:  # closed behind the buffers' back (store.close()): reopen
        OPEN.pop(store_key(path), None)
        return None
    return shared
