"""Durable file operations.

Invariant: a file written with ``atomic_write`` is seen by any reader either whole-old or whole-new
(temp file in the same directory, then ``os.replace``); it is durable once ``fsync_files`` and
``fsync_dir`` have run on it and its directory.
"""

from __future__ import annotations

import os


def atomic_write(path: str, data: bytes, *, fsync: bool = False) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def fsync_files(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_written(paths) -> None:
    """Make files just written durable: each file, then each directory they are in and its parent
    (a new shard file may sit in a new directory)."""
    fsync_files(paths)
    dirs = {os.path.dirname(p) for p in paths}
    for d in sorted(dirs | {os.path.dirname(d) for d in dirs}):
        fsync_dir(d)


def acquire_writer_lock(path: str) -> int:
    """An exclusive ``flock`` on directory ``path`` (no extra file in the zarr hierarchy; released if the
    process dies); returns the descriptor to close to release it."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"store {path!r} is already open for writing by another process or Store "
                           "object; open it with mode='r' to read, or close the writer first") from None
    return fd


def writer_active(path: str) -> bool:
    """Does a writer hold ``path``'s lock now (``acquire_writer_lock``)? Probed with a shared lock taken and
    released at once: only when something already looks wrong (a reader's view meeting a newer file)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the shared lock, if taken
    return False


def remove_contents(path: str) -> None:
    """Empty directory ``path`` (not following symlinks)."""
    import shutil

    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        else:
            os.unlink(full)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
