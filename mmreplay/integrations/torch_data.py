"""A torch ``IterableDataset`` of uniform batches from a store, for ``DataLoader`` workers.

Invariant: each worker opens the store itself, read-only, inside the worker (after spawn: no file handles
or zarr state cross a process boundary) and draws from its own random stream
(``SeedSequence(seed).spawn(num_workers)[worker_id]``), so workers never hand out the same sequence of
batches. Batches are fresh tensors (they cross processes; reused buffers would be overwritten under the
reader). Use ``DataLoader(ds, batch_size=None, num_workers=k, multiprocessing_context="spawn")``.
"""

from __future__ import annotations

import numpy as np
import torch

from mmreplay.store import DEFAULT_CACHE_BYTES, Store


class StoreDataset(torch.utils.data.IterableDataset):
    def __init__(self, path: str, batch_size: int, *, num_batches: int | None = None, seed: int | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, refresh: bool = True):
        """``num_batches`` in all (split across workers; None: endless). ``refresh``: pick up the writer's
        newer commits before each batch (a store being written by a training process)."""
        super().__init__()
        self.path = path
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.seed = seed
        self.cache_bytes = cache_bytes
        self.refresh = refresh

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = np.random.default_rng(np.random.SeedSequence(self.seed).spawn(workers)[worker])
        count = None if self.num_batches is None else len(range(worker, self.num_batches, workers))
        with Store.open(self.path, mode="r", cache_bytes=self.cache_bytes) as store:
            produced = 0
            while count is None or produced < count:
                if self.refresh:
                    store.refresh()
                yield store.sample(self.batch_size, rng=rng)
                produced += 1
