"""What an export or import writes, removed again when it fails.

Invariant: a path entered with ``new_output`` either holds the whole result when the block ends, or is
back to what it was before (absent, or an empty directory): a failed export never leaves a partial
dataset, a failed import never leaves a partial store that a later run would open as data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator


def is_new(path: str) -> bool:
    """True when ``path`` is absent or an empty directory: the only places a dataset or store is made."""
    return not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path))


@contextlib.contextmanager
def new_output(path: str | os.PathLike) -> Iterator[str]:
    """``path`` (absent or an empty directory) to write into; removed (or emptied) if the block raises."""
    path = os.fspath(path)
    was_dir = os.path.isdir(path)
    try:
        yield path
    except BaseException:
        remove(path, keep_dir=was_dir)
        raise


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
