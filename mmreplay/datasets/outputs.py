"""Where an export or import writes: built beside its destination, renamed into place when complete.

Invariant: the destination path only ever appears holding a whole result. A job (``staged``) writes
into a sibling named ``<name>.<job>-<pid>-<token>`` (``job``: ``importing`` or ``exporting``), makes it
durable, and renames it onto the destination at the end (``rename(2)`` is atomic: a reader sees nothing
or everything). A job that fails removes its sibling; a job that is killed leaves it behind, and the
next job writing the same destination removes every such sibling whose process is gone and says so
(one whose process still runs is left alone and named). So a killed import or export never leaves a
store, Minari directory or HDF5 file that opens as data, and rerunning the same command starts over.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Iterator

JOBS = ("importing", "exporting")
#: ``<name>.<job>-<pid>-<token>``: what a job writes into before its rename (the pid: whether it still runs)
_SIBLING = re.compile(r"\.(importing|exporting)-(\d+)-[0-9a-f]+$")


def is_new(path: str) -> bool:
    """True when ``path`` is absent or an empty directory: the only places a dataset or store is made."""
    return not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path))


@dataclass
class Staging:
    """A job in progress: ``path`` is where to write (the sibling), ``destination`` where it will appear;
    ``notes`` say what leftovers of earlier jobs were removed or left."""

    destination: str
    path: str
    notes: list[str] = field(default_factory=list)
    resumed: str | None = None  # the killed job's sibling this one continues in (``resume=True``), renamed to ``path``


@contextlib.contextmanager
def staged(destination: str | os.PathLike, job: str, *, resume: bool = False,
           keep_on_failure: bool = False) -> Iterator[Staging]:
    """Write into a sibling of ``destination`` (absent, or an empty directory) and rename it into place
    when the block ends; removed if the block raises. The block creates ``staging.path`` itself (a file or
    a directory, as the format needs). A resumable job (``dqn_replay.py``) passes ``keep_on_failure``, so
    that a failed run leaves its sibling too, and on its rerun ``resume``: the newest sibling a gone job of
    the same kind left is renamed to this job's name and continued (``staging.resumed``) instead of removed."""
    if job not in JOBS:
        raise ValueError(f"job {job!r}: expected one of {list(JOBS)}")
    destination = os.path.abspath(os.fspath(destination))
    if not is_new(destination):
        raise FileExistsError(f"cannot write {destination!r}: it exists and is not an empty directory "
                              f"({job} always makes a new one)")
    parent = os.path.dirname(destination)
    os.makedirs(parent, exist_ok=True)  # like `mmreplay export` into a new folder
    path = f"{destination}.{job}-{os.getpid()}-{secrets.token_hex(4)}"
    resumed = _adopt_leftover(destination, job, path) if resume else None
    staging = Staging(destination, path, clean_leftovers(destination, keep=path), resumed)
    if resumed:
        staging.notes.append(f"continued the interrupted job left in {resumed!r}")
    try:
        yield staging
        _publish(staging.path, destination)
    except BaseException:
        if not keep_on_failure:
            remove(staging.path)
        raise


def _adopt_leftover(destination: str, job: str, path: str) -> str | None:
    """Rename the newest sibling of a gone ``job`` to ``path`` (so no other job takes it for a leftover of
    a gone process); its old name, or None when there is none."""
    gone = [p for p, pid in leftovers(destination)
            if _SIBLING.search(p).group(1) == job and (pid == os.getpid() or not _runs(pid))]
    if not gone:
        return None
    newest = max(gone, key=os.path.getmtime)
    os.rename(newest, path)
    return newest


def _publish(path: str, destination: str) -> None:
    """Make ``path`` durable, then rename it onto ``destination`` (never over a file or a non-empty
    directory that appeared meanwhile), then make the rename durable."""
    if not os.path.lexists(path):
        raise RuntimeError(f"nothing was written at {path!r}: no result to rename to {destination!r}")
    fsync_tree(path)
    if os.path.isdir(path):
        if os.path.isdir(destination) and not os.listdir(destination):
            os.rmdir(destination)  # a given empty directory: replaced by the result
        os.rename(path, destination)  # ENOTEMPTY / EEXIST if something else appeared there meanwhile
    else:
        _move_file(path, destination)
    fsync_dir(os.path.dirname(destination))


def _move_file(path: str, destination: str) -> None:
    """Move a file onto ``destination`` without replacing one made meanwhile: link then unlink (EEXIST),
    or, on a file system without hard links, rename after checking nothing is there."""
    try:
        os.link(path, destination)
    except FileExistsError:
        raise
    except OSError:
        if os.path.lexists(destination):
            raise FileExistsError(f"cannot write {destination!r}: it appeared while this job ran") from None
        os.rename(path, destination)
        return
    os.unlink(path)


def leftovers(destination: str) -> list[tuple[str, int]]:
    """``(path, pid)`` of the siblings that jobs writing ``destination`` left (killed, or still running)."""
    found = []
    for path in glob.glob(glob.escape(destination) + ".*-*-*"):
        match = _SIBLING.search(path[len(destination):])
        if match and path[len(destination):] == match.group(0):
            found.append((path, int(match.group(2))))
    return sorted(found)


def clean_leftovers(destination: str | os.PathLike, keep: str | None = None) -> list[str]:
    """Remove what killed jobs writing ``destination`` left beside it (but ``keep``: the one this job
    continues); one note per leftover (removed, or left alone because its process still runs)."""
    notes = []
    for path, pid in leftovers(os.path.abspath(os.fspath(destination))):
        if path == keep:
            continue
        if pid != os.getpid() and _runs(pid):
            notes.append(f"left {path!r} alone: process {pid}, which writes it, still runs")
            continue
        remove(path)
        notes.append(f"removed {path!r}, left by an interrupted job (process {pid} is gone); this run "
                     "starts over from the beginning")
    return notes


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` (or ``path`` itself), then the directories, bottom up."""
    if not os.path.isdir(path):
        _fsync(path, os.O_RDONLY)
        return
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            _fsync(os.path.join(root, name), os.O_RDONLY)
        fsync_dir(root)


def fsync_dir(path: str) -> None:
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str, *, keep_dir: bool = False) -> None:
    """Remove what was written at ``path``; ``keep_dir``: leave the (now empty) directory itself."""
    if os.path.isdir(path) and not os.path.islink(path):
        if keep_dir:
            for name in os.listdir(path):
                remove(os.path.join(path, name))
        else:
            shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
