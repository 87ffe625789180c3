"""numba's on-disk kernel cache, kept true to the sources it was compiled from.

Invariant: after ``follow(module, *dependencies)`` returns, no cached kernel of ``module`` on disk is older
than the source of any dependency, so what numba loads from the cache calls the kernels the dependencies
define now.

Why: numba keys a module's cached kernels by that module's own file (its modification time and size),
not by the compiled functions they call from other modules. After an in-place change of a dependency (a
git checkout or merge, an editable install) the cached machine code still calls the old kernels: seen
here, a cached codec-helper kernel that predated a new codec reported every chunk of it as corrupt. A
``pip install`` rewrites every file and never meets this; a developer's tree does.
"""

from __future__ import annotations

import glob
import os
from types import ModuleType


def _cache_files(module_file: str) -> list[str]:
    folder = os.path.join(os.path.dirname(module_file), "__pycache__")
    stem = os.path.splitext(os.path.basename(module_file))[0]
    return glob.glob(os.path.join(folder, f"{glob.escape(stem)}.*.nb[ic]"))


def follow(module_file: str, *dependencies: ModuleType | str) -> None:
    """Drop ``module_file``'s cached kernels if a dependency's source is newer than the oldest of them."""
    cached = _cache_files(module_file)
    if not cached:
        return
    try:
        oldest = min(os.stat(f).st_mtime for f in cached)
        newest_source = max(os.stat(d if isinstance(d, str) else d.__file__).st_mtime for d in dependencies)
    except (OSError, TypeError):
        return  # a file went away meanwhile, or a dependency has no source file: numba decides as before
    if newest_source > oldest:
        for f in cached:
            try:
                os.remove(f)
            except OSError:
                pass  # another process removed it, or the folder is read-only: numba then recompiles or reuses
