"""What an import opens: only regular files and directories, and errors that name the dataset.

Invariants:
- Before a reader (h5py, Minari, gzip) opens a dataset file, the file is checked to be a regular file,
  links followed (``regular_file``): a FIFO would block the open forever (waiting for a writer), and
  ``/dev/zero`` or ``/dev/urandom`` (a device, or a link to one) never ends, so a JSON or HDF5 reader would
  fill memory. A link to a regular file elsewhere is read (reading changes nothing), never written.
- A dataset directory (Minari's) is walked first (``check_tree``), links followed and each directory
  visited once (a link loop ends): every entry must be a regular file or a directory, and the small files
  a reader loads whole (Minari's ``metadata.json``) must be at most ``MAX_METADATA_BYTES``.
- An import's error names its dataset (``naming``): an ``OSError``/``ValueError`` whose message names
  neither the source, nor the destination, nor a file (h5py's "Unable to synchronously open file (truncated file ...)", "a reward
  is not finite") is raised again as the same kind of error, prefixed "<format> dataset '<src>' cannot be
  read: ...", the original chained; so is a ``RuntimeError``/``KeyError``/``AssertionError``... raised
  while h5py or Minari ran (``READER_ERRORS``: damaged HDF5 metadata, a Minari ``metadata.json`` missing a
  key or holding a value of the wrong type), as a ``ValueError``. mmreplay's own errors and errors naming a
  file pass unchanged.
- The check runs just before the open; a tree changed between the two (a race) is not covered.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator

#: bytes a metadata file a reader loads whole may have (a real Minari ``metadata.json`` is a few KB)
MAX_METADATA_BYTES = 16 << 20
#: entries a dataset directory may hold (a Minari arrow dataset has a directory per episode)
MAX_TREE_ENTRIES = 10_000_000

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def regular_file(path: str | os.PathLike, what: str) -> os.stat_result:
    """``os.stat(path)`` (links followed) of a regular file; else ``ValueError`` naming ``path`` and what it
    is (``FileNotFoundError`` for a missing file or a dangling link)."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path!r}: no such file (or a dangling link)") from None
    if not stat.S_ISREG(st.st_mode):
        link = f" (a link to {os.path.realpath(path)!r})" if os.path.islink(path) else ""
        raise ValueError(f"{what} {path!r} is {_kind(st.st_mode)}{link}: expected a regular file")
    return st


def check_tree(root: str | os.PathLike, what: str, small_files: tuple[str, ...] = ()) -> None:
    """Every entry under the directory ``root`` (links followed, each directory once) is a regular file or
    a directory; files named in ``small_files`` hold at most ``MAX_METADATA_BYTES``."""
    root = os.fspath(root)
    seen: set[tuple[int, int]] = set()
    pending = [root]
    count = 0
    while pending:
        directory = pending.pop()
        st = os.stat(directory)
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        with os.scandir(directory) as it:
            for entry in it:
                count += 1
                if count > MAX_TREE_ENTRIES:
                    raise ValueError(f"{what} {root!r} holds more than {MAX_TREE_ENTRIES:,} entries")
                try:
                    est = os.stat(entry.path)
                except FileNotFoundError:
                    raise FileNotFoundError(f"{what} {root!r}: {entry.path!r} is a dangling link") from None
                if stat.S_ISDIR(est.st_mode):
                    pending.append(entry.path)
                elif not stat.S_ISREG(est.st_mode):
                    regular_file(entry.path, f"{what} {root!r}: entry")
                elif entry.name in small_files and est.st_size > MAX_METADATA_BYTES:
                    raise ValueError(f"{what} {root!r}: {entry.path!r} holds {est.st_size:,} bytes, more than the "
                                     f"{MAX_METADATA_BYTES:,} a metadata file may have")


#: errors a dataset reader (h5py, Minari) raises for a damaged file: h5py's RuntimeError ("incorrect metadata
#: checksum") and KeyError ("bad object header version number"); Minari's KeyError for a missing metadata key,
#: AssertionError for a value of the wrong type, MemoryError for a count flipped to 10^15 episodes
READER_ERRORS = (RuntimeError, LookupError, TypeError, AttributeError, AssertionError, ArithmeticError,
                 MemoryError)
_READERS = ("h5py", "minari")


def _raised_by_reader(exc: BaseException) -> bool:
    """Was ``exc`` raised while h5py or Minari ran (a frame of its traceback is theirs)?"""
    tb = exc.__traceback__
    while tb is not None:
        if any(p in _READERS for p in re.split(r"[\\/]", tb.tb_frame.f_code.co_filename)):
            return True
        tb = tb.tb_next
    return False


def _names_a_file(exc: BaseException, paths: list[str]) -> bool:
    return any(p in str(exc) for p in paths) or bool(getattr(exc, "filename", None))


@contextlib.contextmanager
def naming(src: str | os.PathLike, fmt: str, dest: str | os.PathLike | None = None) -> Iterator[None]:
    """Raise the block's ``OSError``/``ValueError`` again naming the dataset ``src`` when it names no file
    (neither ``src`` nor the import's destination ``dest``; see the module invariants)."""
    from mmreplay.errors import MMReplayError

    src = os.fspath(src)
    paths = [src] + ([os.fspath(dest), os.path.abspath(os.fspath(dest))] if dest is not None else [])
    try:
        yield
    except (OSError, ValueError, *READER_ERRORS) as exc:
        if isinstance(exc, READER_ERRORS) and not _raised_by_reader(exc):
            raise
        if isinstance(exc, MMReplayError) or _names_a_file(exc, paths):
            raise
        text = f"{fmt} dataset {src!r} cannot be read: {exc}"
        if isinstance(exc, READER_ERRORS) or (type(exc) is OSError and exc.errno is None):
            new: Exception = ValueError(text)  # the reader's: the file's content, not the system
        elif isinstance(exc, OSError) and exc.errno is not None:
            new = type(exc)(exc.errno, f"{exc.strerror} ({text})")
        else:
            try:
                new = type(exc)(text)
            except Exception:  # noqa: BLE001 - a subclass with another signature
                new = ValueError(text)
        for note in getattr(exc, "__notes__", ()):
            new.add_note(note)
        raise new from exc
