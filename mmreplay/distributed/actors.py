"""Ray access shared by the distributed modules: the ``ray`` module itself, and one call on every shard actor.

Invariant: Ray is imported only when a distributed object is used (it is an optional dependency), and
``call_all`` returns only once every shard answered, asking again those that are restarting until its
timeout. This module imports no other ``mmreplay.distributed`` module, so the cluster (``ReplayShards``)
and the learner's ``DistributedSampler`` both use it without importing each other.
"""

from __future__ import annotations

import time


def ray_module():
    """The ``ray`` module, once ``ray.init()`` ran (an ``ImportError``/``RuntimeError`` saying what to do if not)."""
    try:
        import ray
    except ImportError as exc:  # pragma: no cover (ray is in the 'ray' extra)
        raise ImportError("mmreplay.distributed needs Ray: pip install 'mmreplay[ray]'") from exc
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised: call ray.init() (or ray.init(address=...)) first")
    return ray


def call_all(handles: list, method: str, *args, timeout: float = 60.0) -> list:
    """``method(*args)`` on every shard, asking again (until ``timeout``) those that are restarting."""
    ray = ray_module()
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get([getattr(h, method).remote(*args) for h in handles],
                           timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
