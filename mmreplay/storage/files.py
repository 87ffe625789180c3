"""Durable, confined file operations: every file a store reads or writes goes through here.

Invariants:
- A file written with ``atomic_write`` is seen by any reader either whole-old or whole-new (a temp file in
  the same directory, then ``os.replace``); it is durable once ``fsync_files`` and ``fsync_dir`` have run on
  it and its directory.
- Nothing is written outside the store: the temp file is made with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a
  random name (a link planted at a guessable name cannot redirect it), in a directory reached from the
  store's root one component at a time without following a symbolic link (``open_dir_inside``: a
  ``frames/obs/c/1`` linked to elsewhere is refused, not written through), and it replaces only a regular
  file or nothing (never a link, whose replacement would make the store point elsewhere again).
- Nothing read can hang or exhaust memory: ``open_regular`` opens with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO
  opens at once instead of waiting for a writer), and refuses anything ``fstat`` does not call a regular
  file; ``read_regular`` stops at a cap on the bytes actually read (``/dev/zero`` says ``st_size`` 0 and
  never ends).
A refused entry raises ``UnsafeEntryError`` naming the path and what it is instead of what was expected.
Why here, in one place: stores are downloaded, untarred and shared; whoever opens one must not be hurt by
it, and one forgotten ``open`` is enough to be.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

from mmreplay.errors import FormatError, UnsafeEntryError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
READ_FLAGS = os.O_RDONLY | NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | CLOEXEC
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC
TEMP_TRIES = 16


def describe(mode: int) -> str:
    """What an ``st_mode`` is, in words (for errors)."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return words
    return f"a file of type {stat.S_IFMT(mode):o}"


def _refuse(path: str, mode: int | None, expected: str) -> UnsafeEntryError:
    what = "a symbolic link or a path that loops" if mode is None else describe(mode)
    return UnsafeEntryError(f"{path} is {what}, expected {expected} (a store holds no links or special files; "
                            "nothing was read from or written through it)")


def _lstat_mode(path: str, dir_fd: int | None = None) -> int | None:
    try:
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return None


# -- reading ----------------------------------------------------------------------------------------
def open_regular(path: str) -> int:
    """A read-only descriptor of regular file ``path`` (the caller closes it). A link, FIFO, device, socket or
    directory at ``path`` is ``UnsafeEntryError``; it is checked before the open (opening a device may act)
    and on the descriptor after it (the path may have changed between). Other ``OSError``s (a missing file)
    pass through."""
    mode = _lstat_mode(path)
    if mode is not None and not stat.S_ISREG(mode):
        raise _refuse(path, mode, "a regular file")
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link (EMLINK on some BSDs)
            raise _refuse(path, _lstat_mode(path), "a regular file") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode, "a regular file")
        _clear_nonblock(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _clear_nonblock(fd: int) -> None:
    """O_NONBLOCK was only there so that opening a FIFO cannot wait; a regular file's reads ignore it on Linux,
    but not every file system promises that."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_NONBLOCK:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)


def read_fd_capped(fd: int, path: str, cap: int) -> bytes:
    """Everything ``fd`` holds from its position, at most ``cap`` bytes actually read (``FormatError`` past it):
    ``st_size`` is only a hint."""
    parts, total = [], 0
    ask = os.fstat(fd).st_size + 1  # the common case: one read of what the size says, and one that ends
    while True:
        part = os.read(fd, max(1, min(cap + 1 - total, ask, 1 << 20)))
        ask = 1 << 16
        if not part:
            return b"".join(parts)
        parts.append(part)
        total += len(part)
        if total > cap:
            raise FormatError(f"{path} holds more than {cap:,} bytes, more than such a file can be; refused")


def read_regular(path: str, cap: int) -> bytes:
    """The bytes of regular file ``path`` (``open_regular``), at most ``cap`` (``FormatError`` past it)."""
    fd = open_regular(path)
    try:
        return read_fd_capped(fd, path, cap)
    finally:
        os.close(fd)


def check_regular_or_absent(path: str) -> None:
    """``UnsafeEntryError`` unless ``path`` is a regular file or nothing (before a library reads it)."""
    mode = _lstat_mode(path)
    if mode is not None and not stat.S_ISREG(mode):
        raise _refuse(path, mode, "a regular file")


# -- directories inside a store ---------------------------------------------------------------------
def _components(root: str, directory: str) -> list[str]:
    rel = os.path.relpath(directory, root)
    if rel == os.curdir:
        return []
    parts = rel.split(os.sep)
    if os.path.isabs(rel) or any(p in ("", os.curdir, os.pardir) for p in parts):
        raise ValueError(f"{directory!r} is not inside the store {root!r}")
    return parts


def open_dir_inside(root: str, directory: str, *, create: bool = False) -> int:
    """A descriptor of ``directory``, reached from ``root`` (the store's path, as its user gave it) one
    component at a time without following a symbolic link; missing ones are made when ``create``. A link or a
    file where a directory should be is ``UnsafeEntryError``. The caller closes the descriptor."""
    names = _components(root, directory)
    fd = os.open(root, DIR_FLAGS)
    for name in names:
        fd = _step(fd, name, root, create)  # closes the parent's descriptor, whatever happens
    return fd


def _step(parent: int, name: str, root: str, create: bool) -> int:
    """The descriptor of directory ``name`` in ``parent`` (closed here, whatever happens)."""
    try:
        for _ in range(2):
            try:
                return os.open(name, DIR_FLAGS | NOFOLLOW, dir_fd=parent)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=parent)
                except FileExistsError:
                    pass  # made by another writer meanwhile: open what is there
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise
                raise _refuse(_where(parent, name, root), _lstat_mode(name, parent), "a directory") from None
        return os.open(name, DIR_FLAGS | NOFOLLOW, dir_fd=parent)
    finally:
        os.close(parent)


def _where(parent: int, name: str, root: str) -> str:
    try:
        return os.path.join(os.readlink(f"/proc/self/fd/{parent}"), name)
    except OSError:
        return os.path.join(root, "...", name)


def makedirs_inside(root: str, directory: str) -> None:
    """``os.makedirs(directory, exist_ok=True)`` for a directory of the store at ``root``, never through a link."""
    os.close(open_dir_inside(root, directory, create=True))


# -- writing ----------------------------------------------------------------------------------------
def atomic_write(path: str, data: bytes, *, root: str, fsync: bool = False) -> None:
    """Replace file ``path`` of the store at ``root`` by ``data``, atomically (module invariants); its
    directories are made if missing, never through a link. A link, FIFO, device or directory at ``path``
    is ``UnsafeEntryError`` (nothing written)."""
    directory, name = os.path.split(path)
    dir_fd = open_dir_inside(root, directory, create=True)
    try:
        tmp, fd = _create_temp(dir_fd, name)
        try:
            try:
                _write_all(fd, data)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            mode = _lstat_mode(name, dir_fd)
            if mode is not None and not stat.S_ISREG(mode):
                raise _refuse(path, mode, "a regular file")
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            _unlink_quietly(tmp, dir_fd)
            raise
    finally:
        os.close(dir_fd)


def _create_temp(dir_fd: int, name: str) -> tuple[str, int]:
    """A new file beside ``name`` under a random name, made by this call (``O_EXCL``: never an existing
    file or the target of a planted link)."""
    for _ in range(TEMP_TRIES):
        tmp = f"{name}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o644,
                                dir_fd=dir_fd)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {name!r} after {TEMP_TRIES} tries")


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_files(paths) -> None:
    for path in paths:
        fd = os.open(path, READ_FLAGS)  # a FIFO put there since it was written must not block the commit
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


def _unlink_quietly(path: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass
