"""Distributed experience on Ray: env actors add to sharded on-disk stores, one learner samples them all.

``ReplayShards.create(root, n, obs_space, action_space, ...)`` starts ``n`` shard actors (each the single
writer of its own store, restarted by Ray after a crash); env actors add through
``shards.client(client_id)`` (batched, per-env streams, resent after a shard restart); the learner draws
with ``shards.sampler(batch_size, draw=Prioritized(...))``. Guarantees and the multi-node recipe:
docs/distributed.md. Needs the ``ray`` extra (``pip install 'mmreplay[ray]'``); Ray is imported only here.
"""

from mmreplay.distributed.client import ShardClient
from mmreplay.distributed.cluster import ReplayShards
from mmreplay.distributed.sampler import DistributedSampler, ShardedBatch
from mmreplay.distributed.shard import ReplayShard

__all__ = ["ReplayShards", "ReplayShard", "ShardClient", "DistributedSampler", "ShardedBatch"]
