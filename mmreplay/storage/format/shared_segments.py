"""Named POSIX shared-memory segments (the shard encoder's staging buffers) that mmreplay removes itself.

Why not ``multiprocessing.shared_memory`` as is: it registers every segment with the resource tracker, a
helper process that outlives a SIGKILLed writer and then prints "resource_tracker: N leaked shared_memory
objects" (issue 41, item 8). The segments here are never registered; instead:

Invariant: every segment is named ``<prefix><n>`` with ``prefix = segment_prefix(store, pid)``, the store's
path and the pid of the process that made it. It is unlinked by that process's ``ShardEncoder.close``; if the
process died first (SIGKILL), by its encoder child as the child exits (its stdin closed: ``remove_all``),
and whatever is left then by the next process that makes segments for the same store
(``remove_orphans``: those of pids no longer alive). A live process's segments are never touched.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (listed only to find leftovers)
NAME_PREFIX = "mmr"


def segment_prefix(store: str, pid: int | None = None) -> str:
    """``mmr<8 hex of the store's real path>_<pid>_``: short (macOS allows 31 characters), one per store and
    process."""
    digest = hashlib.sha1(os.path.realpath(store).encode()).hexdigest()[:8]
    return f"{NAME_PREFIX}{digest}_{os.getpid() if pid is None else pid}_"


class Segment:
    """One mapped segment: ``buf`` is its memory; ``close`` unmaps, ``unlink`` removes the name."""

    def __init__(self, name: str, size: int, *, create: bool):
        import _posixshmem

        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                # Reserve the pages now: a tmpfs (/dev/shm) too small for them otherwise kills the process
                # with SIGBUS at the first write to a page it cannot back. This raises OSError (ENOSPC) instead.
                os.posix_fallocate(fd, 0, size)
            size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            if create:
                unlink(name)
            raise
        finally:
            os.close(fd)
        self.name = name
        self.size = size
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap (``BufferError`` while an array still views it)."""
        self.buf.release()
        self._mmap.close()

    def unlink(self) -> None:
        unlink(self.name)


def unlink(name: str) -> None:
    """Remove segment ``name``; one already gone is not an error."""
    import _posixshmem

    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def _names(prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []  # no /dev/shm to list (not Linux): nothing found, nothing removed


def remove_all(prefix: str) -> int:
    """Unlink every segment whose name starts with ``prefix`` (one dead process's); returns how many."""
    names = _names(prefix)
    for name in names:
        unlink(name)
    return len(names)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_orphans(store: str) -> int:
    """Unlink the segments made for ``store`` by processes that are no longer alive; returns how many."""
    head = segment_prefix(store, 0)[:-2]  # "mmr<hash>_"
    pattern = re.compile(re.escape(head) + r"(\d+)_")
    removed = 0
    for name in _names(head):
        match = pattern.match(name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            unlink(name)
            removed += 1
    return removed
