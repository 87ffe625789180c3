"""Exceptions raised by mmreplay.

Every error names the offending value and what was expected, so a user can fix the call without
reading our source. Input errors are raised before anything is written.
"""


class MMReplayError(Exception):
    """Base class for mmreplay's own errors."""


class NotAStoreError(MMReplayError, FileNotFoundError):
    """The path is not an mmreplay store (no store metadata where one was expected)."""


class FormatError(MMReplayError):
    """Stored metadata is malformed, from a newer format version, or inconsistent."""


class UnsafeEntryError(FormatError, OSError):
    """An entry of a store is not what mmreplay makes there: a symbolic link, a FIFO, a device, or a directory
    where a regular file should be (or a file where a directory should be). Nothing was read from it or
    written through it. An ``OSError`` too, so that a writer meeting one stops writing as after any failed
    write (``StorageError``)."""


class CorruptDataError(MMReplayError):
    """A stored chunk failed its checksum or decoded to the wrong size."""


class StoreClosedError(MMReplayError):
    """The store was used after close()."""


class ReadOnlyError(MMReplayError):
    """A write was attempted on a store opened with mode='r'."""


class StorageError(MMReplayError, OSError):
    """Writing to disk failed (disk full, I/O error). What was committed before is intact on disk;
    the store refuses further writes until it is closed and reopened."""
