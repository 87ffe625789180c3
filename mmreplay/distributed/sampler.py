"""``DistributedSampler``: the learner's batches drawn over the union of all shards.

Invariants:
- Uniform: a batch of ``B`` is split over the shards by a multinomial draw with probabilities
  ``size_s / sum(size)``, then each shard draws its part uniformly; so every stored transition has the
  same chance ``1 / sum(size)`` per draw, as in one store holding them all. Sizes are those of the
  shards' last answers (a local shard's after its last ``refresh``), at most one batch old.
- Prioritized: the split is proportional to each shard's priority mass ``T_s`` and each shard draws its
  part proportionally to its priorities, so ``P(i) = p_i / sum(T)``; weights are rescaled from each
  shard's smallest priority to the smallest over all shards, ``w_i = (p_i / min p) ** -beta``, as a
  single store would compute them. The masses used are from each shard's previous answer (one batch
  stale: documented in docs/distributed.md).
- Every row of a ``ShardedBatch`` carries its shard (``batch.shard``) and its id in that shard's store
  (``batch.indices``); ``update_priorities`` sends each shard the rows that are its own, and the shard
  persists them with its next commit.
- Every part of a batch lands in its rows of one set of reused buffers (a batch is valid until the next
  one, as with ``Store.sampler``). Shards whose store directory is on this machine are read in place
  (``Store.open(path, "r")`` and ``refresh``), committed data only, drawn straight into their rows; the
  others are sampled through their actor, ``prefetch`` batches ahead, and copied into theirs.
  Prioritized draws always go through the actors (the writer holds the priorities).
- A remote shard's rows come as decoded stacks (``wire="stacks"``) or as the batch's distinct frames,
  compressed, with index maps (``wire="frames"``, the default for frame stacks and images from shards on
  other nodes: ``learner_wire``); the learner checks a frame reply whole before decoding it, and rebuilds
  exactly the shard's stacks by a gather over the decoded frames.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from mmreplay.columns.spec import Schema
from mmreplay.distributed.actors import call_all
from mmreplay.distributed.learner_wire import (FrameLayout, check_wire, decode_frames, payload_nbytes,
                                               rebuild_into, slice_rows)
from mmreplay.sampling.batch import Batch, BatchBuffers
from mmreplay.sampling.strategy import Prioritized, Uniform


@dataclass
class ShardedBatch(Batch):
    """A ``Batch`` drawn across shards: ``shard[i]`` is the shard row ``i`` came from, and ``indices[i]``
    its transition id in that shard's store (what ``DistributedSampler.update_priorities`` routes by)."""

    shard: torch.Tensor | None = None  # which shard each row came from (its ``indices`` are in that store)

    def to(self, device, non_blocking: bool = False) -> "ShardedBatch":
        moved = Batch.to(self, device, non_blocking)
        return ShardedBatch(**{f.name: getattr(moved, f.name) for f in dataclasses.fields(Batch)},
                            shard=self.shard.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "ShardedBatch":
        pinned = Batch.pin_memory(self)
        return ShardedBatch(**{f.name: getattr(pinned, f.name) for f in dataclasses.fields(Batch)},
                            shard=self.shard.pin_memory())


class DistributedSampler:
    """A learner's iterator of ``ShardedBatch`` es drawn across the shard actors (uniform or prioritized,
    see the module docstring); shards on this node are read directly from disk. A batch lives in reused
    buffers, valid until the next ``sample()`` (as with ``Store.sampler``): ``.clone()`` what you keep.
    Report priorities with ``update_priorities(batch, priorities)``; ``close()`` when done."""

    def __init__(self, shards: list, batch_size: int, draw: Uniform | Prioritized | None = None, *,
                 name: str = "learner", local: bool = True, prefetch: int = 2, seed: int | None = None,
                 refresh_seconds: float = 0.5, timeout: float = 60.0, batches_per_call: int | None = None,
                 wire: str | None = None):
        """``shards``: the shard actor handles. ``draw``: ``Uniform()`` (the default) or ``Prioritized(alpha, beta)``
        (``eps`` and ``name`` are the shards': their sets are the sampler ``name``'s). ``name`` names the shards'
        sampler (its RNG state and its priorities are committed with each shard's store: a learner restarted with the
        same name goes on with them). ``local=False`` samples every shard through its actor. ``batches_per_call``
        (default 4 with ``prefetch``, else 1): a remote shard is asked once for its rows of that many planned batches (a
        Ray call costs milliseconds; batch-32 from a remote shard here: 361/s one batch a call, 755/s eight). Those rows
        are drawn ahead, as prefetched ones are. ``wire``: how a shard read through its actor sends its rows,
        ``"frames"`` (each distinct frame of the rows' stacks once, LZ4-compressed, decoded here) or ``"stacks"``
        (the decoded stacks). Default: ``"frames"`` from shards on other nodes when observations are frame stacks
        or images (~74x fewer bytes on Atari), else ``"stacks"`` (on this node Ray hands them over without a
        copy through the network, and the encode and decode would only cost CPU)."""
        import ray

        self._ray = ray
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer, got {prefetch!r}")
        batches_per_call = (4 if prefetch else 1) if batches_per_call is None else batches_per_call
        if not isinstance(batches_per_call, int) or batches_per_call < 1:
            raise ValueError(f"batches_per_call must be a positive integer, got {batches_per_call!r}")
        self.batches_per_call = batches_per_call
        self.handles = list(shards)
        prioritized = _check_draw(draw)
        self.batch_size, self.prioritized = batch_size, prioritized is not None
        self.alpha = None if prioritized is None else prioritized.alpha
        self.beta = 0.4 if prioritized is None else prioritized.beta  # anneal it by assigning
        self.name, self.prefetch, self.timeout, self.refresh_seconds = name, prefetch, timeout, refresh_seconds
        self.rng = np.random.default_rng(seed)
        infos = call_all(self.handles, "info", timeout=timeout)
        self.stores: dict[int, object] = {}  # local shards' stores, opened read-only
        self.local: dict[int, object] = {}  # their samplers: draws straight into rows of the batch
        if local and not self.prioritized:
            here = ray.get_runtime_context().get_node_id()
            for i, info in enumerate(infos):
                if info["node_id"] == here and os.path.isdir(info["store_path"]):
                    self._open_local(i, info["store_path"])
        schema = Schema.from_json(infos[0]["schema"])
        here = ray.get_runtime_context().get_node_id()
        self.wires = [check_wire(wire) if wire is not None else "stacks" if info["node_id"] == here
                      else default_wire(schema) for info in infos]  # per shard
        self._layout = FrameLayout.of(schema, weights=self.prioritized)
        self._tables: dict[int, dict] = {}  # per shard: its decoded frame tables, reused from reply to reply
        self._out = BatchBuffers(schema, batch_size, weights=self.prioritized)
        self._views: dict[tuple[int, int], BatchBuffers] = {}
        self._shard = _alloc_shard_ids(batch_size)
        self._shard_ids = np.arange(len(self.handles), dtype=np.int64)
        self._sizes = np.array([info["size"] for info in infos], dtype=np.float64)
        self._noted_at = np.full(len(self.handles), time.monotonic())
        self._mass = np.ones(len(self.handles)) if self.prioritized else None
        self._min = np.ones(len(self.handles)) if self.prioritized else None
        if self.prioritized:  # the shards' current priority masses (a draw of 0 rows returns them)
            for i, reply in enumerate(call_all(self.handles, "sample", 0, name, True, self.beta, self.alpha,
                                               timeout=timeout)):
                self._note(i, reply)
        self._last_refresh = time.monotonic()
        self._planned: collections.deque = collections.deque()  # (counts, {shard: (_Call, offset)}) per batch
        self._last_counts: list[int] | None = None
        self._updates: list = []
        self.stats = collections.Counter()

    # -- drawing ----------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> ShardedBatch:
        return self.sample()

    def sample(self) -> ShardedBatch:
        """The next batch, in reused buffers: valid until the next ``sample()`` (as with ``Store.sampler``)."""
        self._refresh_local()
        while len(self._planned) < self.prefetch + 1:
            self._planned.extend(self._plan())
        counts, asks = self._planned.popleft()
        parts = {i: self._part(i, call, offset, counts[i]) for i, (call, offset) in asks.items()} if asks else asks
        while len(self._planned) < self.prefetch:
            self._planned.extend(self._plan())
        lo = 0
        for i, n in enumerate(counts):  # shard i's rows are [lo, lo + n) of the batch
            if n:
                rows = self._rows(lo, lo + n)
                if i in self.local:
                    self.local[i].draw_into(rows)
                else:
                    write_part(rows, parts[i])
                lo += n
        shard = self._shard[1]
        if counts != self._last_counts:  # the rows' shards (one shard: the same every batch)
            shard[...] = self._shard_ids.repeat(counts)
            self._last_counts = counts
        if self.prioritized:
            weights = self._out.weights[1]
            weights[...] = global_weights(weights, shard, self._min, self.beta)
        self.stats["batches"] += 1
        return ShardedBatch(**self._out.batch().__dict__, shard=self._shard[0])

    def _rows(self, lo: int, hi: int) -> BatchBuffers:
        """Rows ``[lo, hi)`` of the output buffers (views; the splits of recent batches are kept)."""
        view = self._views.get((lo, hi))
        if view is None:
            if len(self._views) > 256:  # the split varies from batch to batch: keep the cache bounded
                self._views.clear()
            view = self._views[(lo, hi)] = self._out.rows(lo, hi)
        return view

    def _open_local(self, i: int, path: str) -> None:
        """Read shard ``i`` in place: its store read-only, and a sampler of it (no prefetch: it draws into
        rows of this learner's batch) seeded from the learner's RNG, so ``seed`` fixes every draw."""
        from mmreplay.store import Store

        store = self.stores[i] = Store.open(path, "r")
        self.local[i] = store.sampler(1, name=f"{self.name}-local", prefetch=0,
                                      seed=int(self.rng.integers(2 ** 63)))

    def _weights_of(self) -> np.ndarray:
        return self._mass if self.prioritized else self._sizes

    def _plan(self) -> list[tuple[list[int], dict]]:
        """Split the next ``batches_per_call`` batches over the shards (rows per shard) and ask each remote
        shard now (prefetch), once for its rows of all of them. Returns per batch ``(counts, asks)``, where
        ``asks[i] = (call, offset)``: shard ``i``'s part is rows ``[offset, offset + counts[i])`` of
        ``call``'s reply."""
        if len(self.handles) == 1 and self.local and self._sizes[0] >= self.batch_size:
            return [([self.batch_size], {}) for _ in range(self.batches_per_call)]  # the shard on this node
        w = self._weights_of()
        total = w.sum()
        if total <= 0 or (not self.prioritized and self._sizes.sum() < self.batch_size):
            self._wait_for_data()
            w, total = self._weights_of(), self._weights_of().sum()
        p = w / total
        planned = [(self._split(p), {}) for _ in range(self.batches_per_call)]
        if len(self.local) == len(self.handles):
            return planned
        now = time.monotonic()
        for i in range(len(self.handles)):
            if i in self.local:
                continue
            rows = sum(counts[i] for counts, _ in planned)
            # shards given no rows this time are still asked for their size / mass now and then (0 rows),
            # or a shard that was empty once would never be drawn from again
            if not rows and now - self._noted_at[i] < self.refresh_seconds:
                continue
            if self.prioritized or rows <= self._sizes[i]:
                call, offset = _Call(self._ask(i, rows), rows), 0
                for counts, asks in planned:
                    asks[i] = (call, offset)
                    offset += counts[i]
            else:  # a uniform draw of more rows than the shard holds would be refused: one call a batch
                for counts, asks in planned:
                    asks[i] = (_Call(self._ask(i, counts[i]), counts[i]), 0)
        return planned

    def _split(self, p: np.ndarray) -> list[int]:
        """Rows per shard: a multinomial draw over ``p``; uniform draws never take more rows from a shard
        than it holds (drawn again). One shard takes the whole batch without a draw."""
        if p.size == 1:
            return [self.batch_size]
        for _ in range(100):
            counts = self.rng.multinomial(self.batch_size, p)
            if self.prioritized or (counts <= self._sizes).all():
                return counts.tolist()
        raise ValueError(f"cannot split a batch of {self.batch_size} over shards of sizes "
                         f"{self._sizes.astype(int).tolist()}")

    def _ask(self, i: int, n: int):
        return self.handles[i].sample.remote(n, self.name, self.prioritized, self.beta, self.alpha, self.wires[i])

    def _part(self, i: int, call: "_Call", offset: int, n: int) -> dict:
        """Rows ``[offset, offset + n)`` of the reply to ``call`` to shard ``i`` (waited for once)."""
        if not call.answered:
            call.batch, call.answered = self._get(i, call.ref, call.rows), True
            if call.batch is not None:
                self.stats["wire_bytes"] += payload_nbytes(call.batch)  # array bytes the shard sent us
                if self.wires[i] == "frames":
                    # checked whole, then decoded once for every planned batch it serves; a shard's calls
                    # are used in order, so its next reply may decode into the same tables
                    call.batch = decode_frames(call.batch, self._layout, self._tables.setdefault(i, {}))
        return slice_part(call.batch, offset, offset + n)

    def _get(self, i: int, ref, n: int) -> dict:
        """Shard ``i``'s part; a shard that died is asked again until it is back (bounded by ``timeout``)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                reply = self._ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                break
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.ActorUnavailableError) as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shard {i} did not come back within {self.timeout:g} s") from exc
                self.stats["retries"] += 1
                time.sleep(0.2)
                ref = self._ask(i, n)
        self._note(i, reply)
        return reply["batch"]

    def _note(self, i: int, reply: dict) -> None:
        self._noted_at[i] = time.monotonic()
        self._sizes[i] = reply["size"]
        if self.prioritized:
            self._mass[i], self._min[i] = reply["mass"]

    def _refresh_local(self, force: bool = False) -> None:
        if not self.local or (not force and time.monotonic() - self._last_refresh < self.refresh_seconds):
            return
        for i, store in self.stores.items():
            store.refresh()
            self._sizes[i] = len(store)
        self._last_refresh = time.monotonic()

    def _wait_for_data(self) -> None:
        """Until the shards hold a batch (committed, for the local ones), bounded by ``timeout``."""
        deadline = time.monotonic() + self.timeout
        while True:
            self._refresh_local(force=True)
            remote = [i for i in range(len(self.handles)) if i not in self.local]
            replies = call_all([self.handles[i] for i in remote], "sample", 0, self.name, self.prioritized, self.beta,
                               self.alpha, timeout=self.timeout)
            for i, reply in zip(remote, replies):
                self._note(i, reply)
            w = self._weights_of()
            if w.sum() > 0 and (self.prioritized or self._sizes.sum() >= self.batch_size):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the shards hold {int(self._sizes.sum())} transitions after {self.timeout:g} s; "
                                   f"a batch needs {self.batch_size}")
            time.sleep(0.2)

    # -- priorities -------------------------------------------------------------------------------
    def update_priorities(self, batch: ShardedBatch, priorities) -> None:
        """Send each shard the new priorities of its rows of ``batch`` (``|TD error|``). Asynchronous: an
        error a shard raised surfaces at a later call."""
        if not self.prioritized:
            raise RuntimeError("this sampler is uniform; make it with draw=Prioritized(...) to update priorities")
        p = priorities.detach().cpu().numpy() if hasattr(priorities, "detach") else np.asarray(priorities)
        p = p.reshape(-1)
        shard, idx = batch.shard.numpy(), batch.indices.numpy()
        if p.size != idx.size:
            raise ValueError(f"got {p.size} priorities for a batch of {idx.size}")
        self._check_updates()
        for i in np.unique(shard).tolist():
            rows = shard == i
            self._updates.append(self.handles[i].update_priorities.remote(idx[rows], p[rows], self.name, self.alpha))
        self.stats["priority_updates"] += idx.size

    def _check_updates(self) -> None:
        """Collect finished updates (raising the first error); at most a few hundred stay in flight."""
        if not self._updates:
            return
        done, self._updates = self._ray.wait(self._updates, num_returns=len(self._updates), timeout=0)
        for ref in done:
            try:
                self._ray.get(ref)
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.ActorUnavailableError):
                self.stats["updates_lost"] += 1  # the shard restarted before committing them: documented
        if len(self._updates) > 256:
            self._ray.wait(self._updates, num_returns=len(self._updates) - 256, timeout=self.timeout)

    def state_dict(self) -> dict:
        """The learner side's RNG state (JSON-able; the shards commit their own)."""
        return {"rng": self.rng.bit_generator.state, "beta": self.beta,
                "local": {str(i): smp.rng.bit_generator.state for i, smp in self.local.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.beta = state["beta"]
        for i, rng_state in state.get("local", {}).items():
            if int(i) in self.local:
                self.local[int(i)].rng.bit_generator.state = rng_state

    def close(self) -> None:
        """Wait for the priority updates in flight; close the local readers."""
        if self._updates:
            self._ray.wait(self._updates, num_returns=len(self._updates), timeout=self.timeout)
            self._check_updates()
        for smp in self.local.values():
            smp.close()
        for store in self.stores.values():
            store.close()
        self.local.clear()
        self.stores.clear()


def _check_draw(draw) -> Prioritized | None:
    """The prioritized draw of a distributed sampler (None: uniform); other strategies are refused."""
    if draw is None or type(draw) is Uniform:
        return None
    if type(draw) is Prioritized:
        return draw
    raise TypeError(f"a DistributedSampler draws Uniform() or Prioritized(alpha, beta) across its shards, got "
                    f"{draw!r}")


def global_weights(weights: np.ndarray, shard: np.ndarray, shard_min: np.ndarray, beta: float) -> np.ndarray:
    """Importance weights over all shards from each shard's own: a shard returns ``(p / min_s) ** -beta``
    with ``min_s`` its smallest priority; one store holding every shard would use the smallest over all,
    ``(p / min) ** -beta = (p / min_s) ** -beta * (min_s / min) ** -beta``."""
    finite = np.isfinite(shard_min)
    smallest = shard_min[finite].min() if finite.any() else 1.0
    scale = (shard_min[shard] / smallest) ** -beta
    return (np.asarray(weights, dtype=np.float64) * scale).astype(np.float32)


@dataclass
class _Call:
    """A request to a remote shard for ``rows`` rows (the parts of one or more planned batches)."""

    ref: object
    rows: int
    batch: dict | None = None  # the reply's rows, once waited for (None for 0 rows)
    answered: bool = False


def default_wire(schema: Schema) -> str:
    """``"frames"`` where the batch's frames repeat (stacks) or are large (images), else ``"stacks"``."""
    images = any(len(spec.shape) >= 2 for spec in schema.observations)
    return "frames" if schema.frame_stack > 1 or images else "stacks"


def slice_part(batch: dict | None, lo: int, hi: int) -> dict | None:
    """Rows ``[lo, hi)`` of a shard's reply (``shard.batch_to_numpy``, or a decoded frame batch), as views."""
    if batch is None:
        return None
    if "frames" in batch:
        return slice_rows(batch, lo, hi)
    return {k: None if v is None else {c: a[lo:hi] for c, a in v.items()} if isinstance(v, dict) else v[lo:hi]
            for k, v in batch.items()}


def write_part(rows: BatchBuffers, part: dict) -> None:
    """Copy a shard's reply (``shard.batch_to_numpy``) into ``rows`` of the learner's batch (the one copy
    out of Ray's object store, whose arrays are read-only); a decoded frame batch's stacks are gathered from
    its frame tables."""
    if "frames" in part:
        for name, (_, out) in rows.obs.items():
            rebuild_into(part["frames"][name], part["obs_index"], out)
            rebuild_into(part["frames"][name], part["next_index"], rows.next_obs[name][1])
    else:
        obs, next_obs = part["obs"], part["next_obs"]
        if not isinstance(obs, dict):
            obs, next_obs = {"obs": obs}, {"obs": next_obs}
        for name, (_, out) in rows.obs.items():
            out[...] = obs[name]
            rows.next_obs[name][1][...] = next_obs[name]
    for name, (_, out) in rows.columns.items():
        out[...] = part["extras"][name] if name in part["extras"] else part[name]
    for name in ("terminated", "truncated", "indices", "weights"):
        if getattr(rows, name) is not None:
            getattr(rows, name)[1][...] = part[name]


def _alloc_shard_ids(batch_size: int) -> tuple[torch.Tensor, np.ndarray]:
    t = torch.empty(batch_size, dtype=torch.int64)
    return t, t.numpy()
