"""What a process forked from one that uses mmreplay inherits, made safe; and what it leaves open at exit.

Invariant: in a child made by ``os.fork`` (DataLoader workers and env workers with the ``fork`` start
method, ``multiprocessing`` pools), every object registered here has had its ``_after_fork_in_child()``
run before the child does anything else, so that
- process-wide thread pools are forgotten (their threads do not exist in the child; a task submitted to
  them would wait forever) and made anew on first use;
- a store opened before the fork is unusable in the child, with a clear error (its locks may be held by
  threads that the child does not have, and two processes must never write one store), and the child's
  copy of its writer-lock descriptor is closed, so a crashed writer never leaves the store locked for as
  long as the children it forked live on.
zarr-python resets its own event loop after a fork; a store opened *in* the child works normally.

At interpreter exit every object registered with ``close_at_exit`` and still open is closed (a writer
commits what was added: a script that never called ``close()`` loses nothing). This is an ``atexit``
hook, so it runs after every non-daemon thread ended (a training thread's last adds are committed too),
and therefore after ``concurrent.futures`` stopped taking work (its hook runs before threads are joined)
and after zarr closed its event loop. The exit commit must not need either: frame shards are then
written by the exiting thread (``FrameRing``), zarr metadata is grown without zarr (``resize_arrays``)
and a writer's priority arrays exist since its set was made (``PriorityFiles.make_files``). A store
inherited by a forked child is closed there without a commit (``_after_fork_in_child``), so the child's
exit never touches it.
"""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from typing import Callable

_objects: "weakref.WeakSet" = weakref.WeakSet()
_resetters: list[Callable[[], None]] = []
_open_at_exit: "weakref.WeakSet" = weakref.WeakSet()


def close_at_exit(obj) -> None:
    """Run ``obj.close()`` at interpreter exit unless ``forget_at_exit(obj)`` ran first."""
    _open_at_exit.add(obj)


def forget_at_exit(obj) -> None:
    _open_at_exit.discard(obj)


@atexit.register
def _close_at_exit() -> None:
    for obj in list(_open_at_exit):
        try:
            obj.close()
        except Exception as exc:  # nobody to raise to at exit: say it, at least
            warnings.warn(f"mmreplay: {obj!r} could not commit at exit: {exc}", RuntimeWarning, stacklevel=1)


def register(obj) -> None:
    """Run ``obj._after_fork_in_child()`` in every child forked while ``obj`` is alive."""
    _objects.add(obj)


def on_fork(reset: Callable[[], None]) -> None:
    """Run ``reset()`` in every forked child (module-level state: pools, caches of threads)."""
    _resetters.append(reset)


def _after_fork_in_child() -> None:
    for reset in _resetters:
        reset()
    for obj in list(_objects):
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
