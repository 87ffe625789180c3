"""``ReplayShards``: start (or find again) the shard actors of a distributed replay on a Ray cluster.

Invariant: shard ``i`` is the named Ray actor ``{prefix}-{i}`` in ``namespace``, owning the directory
``{root}/shard-{i}`` on the node it runs on; Ray restarts it after a crash (``max_restarts``) and the
restarted actor reopens the same directory at its last commit. Anything that knows the prefix and the
number of shards (an env actor, a restarted learner, another driver) can ``connect`` to the same shards.
"""

from __future__ import annotations

import os

from mmreplay.distributed.actors import call_all, ray_module
from mmreplay.distributed.client import ShardClient
from mmreplay.distributed.sampler import DistributedSampler

DEFAULT_PREFIX = "mmreplay-shard"


class ReplayShards:
    """Handles of a distributed replay's shard actors: ``create`` starts them, ``connect`` finds them again;
    give ``handles`` to ``ShardClient`` (env actors) and ``DistributedSampler`` (the learner)."""

    def __init__(self, handles: list, names: list[str], namespace: str | None):
        self.handles = list(handles)
        self.names = list(names)
        self.namespace = namespace

    def __len__(self) -> int:
        return len(self.handles)

    @classmethod
    def create(cls, root: str, num_shards: int, observation_space, action_space, *, prefix: str = DEFAULT_PREFIX,
               namespace: str | None = None, commit_every: int = 5000, commit_seconds: float = 5.0,
               durable: bool = True, cache_bytes: int = 256 << 20, max_restarts: int = -1, detached: bool = False,
               actor_options: dict | list[dict] | None = None, start_timeout: float = 300.0,
               **store_kwargs) -> "ReplayShards":
        """Start ``num_shards`` shard actors, shard ``i`` writing ``{root}/shard-{i}`` (created with
        ``Store.create(observation_space, action_space, **store_kwargs)``, or reopened when it exists).
        ``actor_options`` (one dict, or one per shard) go to Ray: ``num_cpus``, ``resources``,
        ``scheduling_strategy`` place shards on nodes. ``detached=True`` lets the shards outlive the driver
        that started them (a learner can then restart and ``connect``). ``create`` returns once every shard
        answers, waiting up to ``start_timeout`` seconds (a shard process imports torch and opens its store:
        on a busy node that takes minutes)."""
        ray = ray_module()
        from mmreplay.distributed.shard import ReplayShard

        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}")
        if isinstance(actor_options, list) and len(actor_options) != num_shards:
            raise ValueError(f"actor_options: got {len(actor_options)} dicts for {num_shards} shards")
        create = dict(observation_space=observation_space, action_space=action_space, **store_kwargs)
        actor_cls = ray.remote(ReplayShard)
        handles, names = [], []
        for i in range(num_shards):
            opts = {"num_cpus": 1, **(actor_options[i] if isinstance(actor_options, list) else actor_options or {})}
            name = f"{prefix}-{i}"
            if detached:
                opts["lifetime"] = "detached"
            try:
                handle = actor_cls.options(name=name, namespace=namespace, max_restarts=max_restarts,
                                           max_task_retries=0, max_concurrency=1, **opts).remote(
                    os.path.join(root, f"shard-{i}"), create, commit_every=commit_every,
                    commit_seconds=commit_seconds, durable=durable, cache_bytes=cache_bytes)
            except ValueError as exc:
                if "already" not in str(exc):
                    raise
                raise ValueError(f"a shard actor named {name!r} is already running in namespace {namespace!r}: "
                                 "use ReplayShards.connect to reach it, or another prefix") from None
            handles.append(handle)
            names.append(name)
        shards = cls(handles, names, namespace)
        shards.info(timeout=start_timeout)  # fail here, with the shard's own error, if a store cannot be made
        return shards

    @classmethod
    def connect(cls, num_shards: int, *, prefix: str = DEFAULT_PREFIX, namespace: str | None = None
                ) -> "ReplayShards":
        """The running shards ``{prefix}-0 .. {prefix}-{num_shards-1}`` (a restarted learner, an env actor)."""
        ray = ray_module()
        names = [f"{prefix}-{i}" for i in range(num_shards)]
        handles = []
        for name in names:
            try:
                handles.append(ray.get_actor(name, namespace=namespace))
            except ValueError:
                raise LookupError(f"no shard actor named {name!r} in namespace {namespace!r}; start the shards with "
                                  "ReplayShards.create first") from None
        return cls(handles, names, namespace)

    # -- using them -------------------------------------------------------------------------------
    def client(self, client_id: int, **kwargs):
        """A ``ShardClient`` for an env actor (see its arguments)."""
        return ShardClient(client_id, self.handles, **kwargs)

    def sampler(self, batch_size: int, **kwargs):
        """A learner-side ``DistributedSampler`` over all shards (see its arguments)."""
        return DistributedSampler(self.handles, batch_size, **kwargs)

    def info(self, timeout: float = 60.0) -> list[dict]:
        """Each shard's ``ReplayShard.info()``, waiting (up to ``timeout``) for shards that are restarting."""
        return call_all(self.handles, "info", timeout=timeout)

    def commit(self, timeout: float = 60.0) -> list[dict]:
        """Commit every shard now."""
        ray = ray_module()
        return ray.get([h.commit.remote() for h in self.handles], timeout=timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Commit and close every store, then end the actors (for good: no restart)."""
        ray = ray_module()
        try:
            ray.get([h.close.remote() for h in self.handles], timeout=timeout)
        finally:
            for h in self.handles:
                ray.kill(h, no_restart=True)
