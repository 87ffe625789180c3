"""gzip'd ``.npy`` arrays read and written as streams, a block of rows at a time (Dopamine's checkpoint files).

Invariants:
- The header is parsed from the decompressed stream and checked before anything is allocated: a plain
  numeric dtype from the caller's allowed set (never an object dtype: nothing is unpickled), C order, at
  most ``MAX_ROWS`` rows of at most ``MAX_ROW_BYTES`` (``bounds.py``'s limit for any dataset row would let a
  hostile 46-byte header declare terabytes; these are the limits of a Dopamine checkpoint, with room).
- Rows are read into a caller's buffer of bounded size (``readinto``, ``READ_BYTES`` at a time), never the
  whole array: memory is the block, whatever the file declares. A stream that ends before its declared rows raises, naming the
  file and the row; a skip (``skip_rows``) decompresses and drops, in the same bounded blocks.
- A written file holds exactly what ``np.save`` of the whole array would hold (same header bytes), gzip'd
  as Dopamine's ``save`` does; it is written under a temporary name and renamed when complete.
- Reading inflates with ISA-L (``isal``, when installed: ``pip install 'mmreplay[dqn-replay]'``) or else the
  standard library; both check gzip's CRC-32 and length, and either's errors become ``NpyFormatError``.
"""

from __future__ import annotations

import gzip
import os
import secrets
import zlib
from collections.abc import Iterable

import numpy as np

try:  # ISA-L's inflate: the same streams, ~2.3x less CPU (84x84 frames: 5.3 against 12.4 us each here)
    from isal import igzip as _inflating
    from isal.isal_zlib import error as _IsalError
except ImportError:  # the standard library's zlib
    _inflating, _IsalError = gzip, zlib.error

#: bytes one ``readinto`` asks for at most: gzip's ``readinto`` (the standard library's and ISA-L's) inflates into a
#: temporary ``bytes`` of the size asked, then copies it: asked a whole 32 MiB block of frames at once, the
#: dqn-replay import held that block twice (its peak RSS 30 MB higher, a sawtooth at every block)
READ_BYTES = 1 << 20

#: rows a checkpoint file may declare (Dopamine's are 1M; 16M leaves room and bounds a full read of a
#: scalar column to 128 MB)
MAX_ROWS = 1 << 24
#: bytes one row may take (an 84x84 frame is 7,056; a 1024x1024 grey frame fits)
MAX_ROW_BYTES = 1 << 20
#: decompressed bytes a skip reads at a time
SKIP_BYTES = 16 << 20


class NpyFormatError(ValueError):
    """A gzip'd ``.npy`` file that is not what its reader expects (header, dtype, shape, length)."""


class NpyReader:
    """One gzip'd ``.npy`` file, its rows read in order. ``shape``/``dtype`` come from the checked header:
    a dtype of one of the numpy ``kinds`` (e.g. ``"iu"``), and rows of ``row_ndim`` dimensions (0: one
    value a row; a set of them; -1: a 0-d array, e.g. Dopamine's ``add_count``)."""

    def __init__(self, path: str, *, what: str, kinds: str, row_ndim: int | Iterable[int],
                 max_rows: int = MAX_ROWS, max_row_bytes: int = MAX_ROW_BYTES):
        self.path, self.what = path, what
        self._file = _inflating.open(path, "rb")
        try:
            self.shape, self.dtype = _read_header(self._file, f"{what} ({path!r})", kinds, row_ndim, max_rows,
                                                  max_row_bytes)
        except BaseException:
            self._file.close()
            raise
        self.rows = self.shape[0] if self.shape else 1
        self.row_shape = self.shape[1:]
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.position = 0

    def read_rows(self, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (rows of this file's row shape and dtype) with the next ``len(out)`` rows."""
        n = out.shape[0]
        if self.position + n > self.rows:
            raise ValueError(f"{self.what}: asked for rows {self.position}..{self.position + n} of {self.rows}")
        view = memoryview(out.reshape(-1).view(np.uint8))
        got = 0
        while got < view.nbytes:
            k = self._read(view[got:])
            if not k:
                raise NpyFormatError(f"{self.what} ({self.path!r}) ends inside row "
                                     f"{self.position + got // max(1, self.row_bytes)} of the {self.rows} its header "
                                     "declares: truncated")
            got += k
        self.position += n
        if self.position == self.rows:
            self._check_end()
        return out

    def _read(self, view) -> int:
        try:
            return self._file.readinto(view[:READ_BYTES])
        except (OSError, EOFError, zlib.error, _IsalError) as exc:  # BadGzipFile is an OSError
            raise NpyFormatError(f"{self.what} ({self.path!r}): corrupt gzip data near row {self.position} "
                                 f"({exc})") from None

    def _check_end(self) -> None:
        """After the last row: the stream must end there, and reading its end checks gzip's CRC-32 and
        length (a file read only up to its declared rows would never check them)."""
        if self._read(memoryview(bytearray(1))):
            raise NpyFormatError(f"{self.what} ({self.path!r}) holds more data than the {self.rows} rows its "
                                 "header declares")

    def read_all(self) -> np.ndarray:
        """The whole array (for the small columns: action, reward, terminal, add_count)."""
        out = np.empty(self.shape, self.dtype)
        if out.ndim == 0:
            self.read_rows(out.reshape(1))
            return out
        return self.read_rows(out)

    def skip_rows(self, n: int) -> None:
        if n <= 0:
            return
        step = max(1, SKIP_BYTES // max(1, self.row_bytes))
        scratch = np.empty((min(step, n), *self.row_shape), self.dtype)
        while n:
            k = min(n, scratch.shape[0])
            self.read_rows(scratch[:k])
            n -= k

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> NpyReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_header(fp, what: str, kinds: str, row_ndim, max_rows: int, max_row_bytes: int):
    fmt = np.lib.format
    try:
        major, _minor = fmt.read_magic(fp)
        read = fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0
        shape, fortran, dtype = read(fp)
    except (OSError, EOFError, zlib.error, _IsalError) as exc:  # the gzip stream (ISA-L inflates ahead: a small
        # file's CRC-32 is checked here already)
        raise NpyFormatError(f"{what}: not a gzip'd .npy array (corrupt gzip data: {type(exc).__name__}: {exc})") \
            from None
    except Exception as exc:  # noqa: BLE001 - a damaged header or stream: BadGzipFile, zlib.error, numpy's
        # ValueError/SyntaxError, tokenize.TokenError (a flipped quote in the header dict)...
        raise NpyFormatError(f"{what}: not a gzip'd .npy array ({type(exc).__name__}: {exc})") from None
    described = f"{what}: an array of shape {shape} and dtype {dtype}"
    if dtype.kind not in kinds or dtype.fields is not None or dtype.hasobject:
        raise NpyFormatError(f"{described}; expected dtype kind(s) {kinds!r} (Dopamine's checkpoint dtype)")
    if fortran:
        raise NpyFormatError(f"{described} in Fortran order; expected C order (as np.save writes Dopamine's arrays)")
    ndims = {row_ndim} if isinstance(row_ndim, int) else set(row_ndim)
    if len(shape) - 1 not in ndims:
        raise NpyFormatError(f"{described}; expected {sorted(d + 1 for d in ndims)} dimension(s)")
    if shape and shape[0] > max_rows:
        raise NpyFormatError(f"{described}: {shape[0]:,} rows, more than the {max_rows:,} a checkpoint may hold")
    row = int(np.prod(shape[1:], dtype=object)) * dtype.itemsize if shape else dtype.itemsize
    if row > max_row_bytes:
        raise NpyFormatError(f"{described}: a row of {row:,} bytes, more than the {max_row_bytes:,} accepted")
    return tuple(int(d) for d in shape), dtype


class NpyWriter:
    """Writes one gzip'd ``.npy`` array of a known ``shape`` row block by row block, as ``np.save`` into
    ``gzip.GzipFile`` (Dopamine's ``save``) would; the file appears at ``path`` only when complete."""

    def __init__(self, path: str, shape: tuple[int, ...], dtype, *, compresslevel: int = 6):
        self.path, self.shape, self.dtype = path, tuple(shape), np.dtype(dtype)
        self.rows = self.shape[0] if self.shape else 1
        self.written = 0
        self._tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self._raw = open(self._tmp, "xb")
        self._file = gzip.GzipFile(fileobj=self._raw, mode="wb", compresslevel=compresslevel)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": self.shape}
        np.lib.format.write_array_header_1_0(self._file, header)

    def write_rows(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        n = rows.shape[0] if rows.ndim else 1
        if self.written + n > self.rows:
            raise ValueError(f"{self.path!r}: {self.written + n} rows written, the header declares {self.rows}")
        self._file.write(rows.tobytes())
        self.written += n

    def close(self) -> None:
        """Finish the file and rename it into place (all rows must have been written)."""
        if self.written != self.rows:
            self.abort()
            raise ValueError(f"{self.path!r}: {self.written} rows written, the header declares {self.rows}")
        self._file.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        for f in (self._file, self._raw):
            try:
                f.close()
            except (OSError, ValueError):
                pass
        if os.path.lexists(self._tmp):
            os.unlink(self._tmp)

    def __enter__(self) -> NpyWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_small(path: str, array: np.ndarray) -> None:
    """A whole small array (add_count, invalid_range, the scalar columns) as one gzip'd ``.npy``."""
    array = np.asarray(array)
    with NpyWriter(path, array.shape, array.dtype) as w:
        w.write_rows(array.reshape(-1) if array.ndim == 0 else array)
