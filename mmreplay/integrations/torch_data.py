"""A torch ``IterableDataset`` of random transitions from a store, for ``DataLoader`` workers.

Two shapes, both usable with a plain ``DataLoader(ds, num_workers=k)``:

- ``StoreDataset(path, batch_size=B)`` yields whole ``Batch`` es of ``B`` (the fast path: one gather per
  batch). The DataLoader's default ``batch_size=1`` hands each one through unchanged (a collate rule for
  ``Batch`` is registered with torch's ``default_collate``); ``batch_size=None`` does the same.
- ``StoreDataset(path)`` yields single transitions (dicts of tensors) that the DataLoader batches with its
  own ``batch_size`` into a dict of stacked tensors — what a generic pipeline expects.

Invariants: each worker opens the store itself, read-only, inside the worker (no file handles or zarr
state cross a process boundary; fork and spawn both work) and draws from its own random stream, so
workers never hand out the same sequence. A fixed ``seed`` gives a different stream every epoch: keyed by
``set_epoch(epoch)`` when called (as with ``DistributedSampler``: the same seed and epoch repeat exactly),
else by the DataLoader's per-epoch base seed (from torch's RNG) in workers and by an iteration count in
the main process. Tensors handed out are fresh (they cross processes; reused buffers would be
overwritten under the reader).
"""

from __future__ import annotations

import numpy as np
import torch

from mmreplay.sampling.batch import Batch
from mmreplay.sampling.strategy import DrawStrategy, Transitions, check_strategy
from mmreplay.settings import DEFAULT_CACHE_BYTES
from mmreplay.store import Store

DEFAULT_BLOCK = 256  # transitions drawn per gather in per-transition mode


class StoreDataset(torch.utils.data.IterableDataset):
    """Random transitions of the store at ``path`` for a ``DataLoader`` (see the module docstring).

    What users must know: each worker opens the store read-only by itself (pass a path, never an open
    ``Store``); tensors are fresh (unlike ``Store.sampler``'s reused buffers); draws are made by the
    ``draw`` strategy (uniform by default), with replacement, so an "epoch" is ``num_batches`` /
    ``num_samples`` draws, not a pass over the store; with ``refresh=True`` each draw first picks up the
    writer's newer commits.
    """

    def __init__(self, path: str, batch_size: int | None = None, *, num_batches: int | None = None,
                 num_samples: int | None = None, seed: int | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 refresh: bool = True, draw: DrawStrategy | None = None):
        """``batch_size=B``: yield batches of ``B``, ``num_batches`` in all (None: endless); ``batch_size=None``:
        yield single transitions, ``num_samples`` in all. Totals are split across workers. ``refresh``: pick
        up the writer's newer commits before each draw (a store being written by a training process).
        ``draw``: the strategy of each draw (default ``Uniform()``; ``NStep``, a committed ``Prioritized``
        set, or your own; ``Sequences`` only with ``batch_size``)."""
        super().__init__()
        draw = check_strategy(draw)
        if batch_size is None and not isinstance(draw, Transitions):
            raise ValueError(f"draw={draw!r} does not draw single transitions: give batch_size= to get whole "
                             "batches of it, or draw=Uniform() (or another transition draw)")
        self.draw = draw
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None (single transitions), got {batch_size!r}")
        if batch_size is None and num_batches is not None:
            raise ValueError(f"num_batches={num_batches} counts batches of StoreDataset(batch_size=B); without "
                             "batch_size the dataset yields single transitions: give num_samples instead")
        if batch_size is not None and num_samples is not None:
            raise ValueError(f"num_samples={num_samples} counts single transitions (StoreDataset without "
                             f"batch_size); with batch_size={batch_size} give num_batches instead")
        for name, value in (("num_batches", num_batches), ("num_samples", num_samples)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None (endless), got {value!r}")
        self.path = path
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.num_samples = num_samples
        self.seed = seed
        self.cache_bytes = cache_bytes
        self.refresh = refresh
        self.epoch: int | None = None
        self._iterations = 0  # iterations of this copy since set_epoch (main process, persistent workers)

    def set_epoch(self, epoch: int) -> None:
        """Key the next iterations' random streams by ``epoch`` (call it before each epoch, like
        ``DistributedSampler.set_epoch``): with a fixed ``seed``, the same epoch gives the same batches."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = int(epoch)
        self._iterations = 0  # counts iterations within this epoch (persistent workers never see set_epoch)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = np.random.default_rng(self._seed_sequence(info, worker))
        total = self.num_batches if self.batch_size is not None else self.num_samples
        count = None if total is None else len(range(worker, total, workers))
        with Store.open(self.path, mode="r", cache_bytes=self.cache_bytes) as store:
            if self.batch_size is not None:
                yield from self._batches(store, rng, count)
            else:
                yield from self._transitions(store, rng, count)

    def _seed_sequence(self, info, worker: int) -> np.random.SeedSequence:
        """This iteration's stream: differs per worker and per epoch, repeatable for a fixed seed."""
        iteration = self._iterations
        self._iterations += 1
        if self.seed is None:
            return np.random.SeedSequence()  # fresh entropy in every worker and epoch
        if self.epoch is not None:
            epoch_key = self.epoch
        elif info is not None:
            # A non-persistent DataLoader makes new workers (each with a fresh copy of this dataset) every
            # epoch and draws them a new base seed from torch's RNG: that base seed tells the epochs apart.
            epoch_key = (info.seed - info.id) % 2**63
        else:
            epoch_key = 0
        return np.random.SeedSequence(self.seed, spawn_key=(epoch_key, iteration, worker))

    def _batches(self, store: Store, rng: np.random.Generator, count: int | None):
        produced = 0
        while count is None or produced < count:
            if self.refresh:
                store.refresh()
            yield store.sample(self.batch_size, self.draw, seed=rng)
            produced += 1

    def _transitions(self, store: Store, rng: np.random.Generator, count: int | None):
        produced = 0
        while count is None or produced < count:
            if self.refresh:
                store.refresh()
            want = DEFAULT_BLOCK if count is None else min(DEFAULT_BLOCK, count - produced)
            block = store.sample(max(1, min(want, len(store))), self.draw, seed=rng)  # draws with replacement
            rows = _rows(block)
            for i in range(block.indices.shape[0]):
                yield {name: value[i] for name, value in rows.items()}
            produced += block.indices.shape[0]


def _rows(b: Batch) -> dict[str, torch.Tensor]:
    """A batch as flat named columns (the names of ``Batch``'s fields; Dict observations as ``obs.KEY``),
    each row one transition."""
    out = {}
    for prefix, value in (("obs", b.obs), ("next_obs", b.next_obs)):
        if isinstance(value, dict):
            out.update({f"{prefix}.{k}": v for k, v in value.items()})
        else:
            out[prefix] = value
    out.update(action=b.action, reward=b.reward, terminated=b.terminated, truncated=b.truncated, indices=b.indices)
    out.update({name: value for name, value in (("weights", b.weights), ("discount", b.discount)) if value is not None})
    for name, value in b.extras.items():
        out[name if name not in out else f"extras.{name}"] = value
    return out


def _collate_batches(batch: list, *, collate_fn_map=None) -> Batch:
    """``default_collate`` of ``Batch`` objects: a DataLoader with ``batch_size=1`` passes a store batch
    through; grouping several would stack batches into a new leading axis, which no training step wants."""
    if len(batch) == 1:
        return batch[0]
    raise TypeError(f"DataLoader(batch_size={len(batch)}) over StoreDataset(batch_size=B) would group "
                    f"{len(batch)} whole batches: leave the DataLoader's batch_size at 1 or None, or make the "
                    "dataset without batch_size (StoreDataset(path)) so the DataLoader batches single transitions")


def _register_collate() -> None:
    # torch's documented extension point for default_collate (torch.utils.data._utils.collate.collate).
    try:
        from torch.utils.data._utils.collate import default_collate_fn_map
    except ImportError:  # pragma: no cover (torch < 1.13); batch_size=None still works
        return
    default_collate_fn_map.setdefault(Batch, _collate_batches)


_register_collate()
