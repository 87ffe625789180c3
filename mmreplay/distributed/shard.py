"""``ReplayShard``: one shard of a distributed replay, the single writer of its store.

Invariants:
- Only this object writes its store; it commits on its own schedule (``commit_every`` transitions or
  ``commit_seconds``), never the store's automatic one, so that every store commit is preceded by the
  ledger entry naming each client's last batch in it (``ledger.py``). After a crash (a killed actor that
  Ray restarts) the constructor reopens the store at its last commit and the ledger says, per client,
  which batch was the last one kept: clients resend everything after it, so nothing is stored twice and
  nothing the clients still hold is lost.
- A client's batches are applied in sequence order exactly once: a batch whose sequence number was
  already applied is acknowledged and skipped; one that skips ahead is refused (``"gap"``) unless the
  client says it gave the missing ones up (``reset=True``). A batch that is malformed (``wire.check_payload``)
  or that the store refuses as bad input stores nothing, uses up its number and raises to the client.
- Client ``c``'s stream ``s`` is stream ``c * STREAMS_PER_CLIENT + s`` of the store, so each env of each
  actor keeps its own episodes.

The class is plain Python (tests drive it directly); ``mmreplay.distributed.cluster`` runs it as a Ray
actor. Payloads are ``wire.encode_batch`` dicts of numpy arrays.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import threading
import time

import numpy as np

from mmreplay.distributed.learner_wire import check_wire, encode_frames, zero_padded
from mmreplay.distributed.ledger import clients_at, make_entry, read_ledger, write_ledger
from mmreplay.distributed.wire import ObsLayout, decode_batch
from mmreplay.storage.public import COMMIT_FILE
from mmreplay.sampling.strategy import Prioritized, Uniform

STREAMS_PER_CLIENT = 1024
MAX_CLIENTS = (1 << 31) // STREAMS_PER_CLIENT
STORE_DIR = "store"
NEVER = 1 << 62  # the store's own commit triggers are switched off: the shard commits (after its ledger)


def global_streams(client: int, streams: np.ndarray) -> np.ndarray:
    """Store stream ids of a client's local stream ids (each env of each actor is its own stream)."""
    if not isinstance(client, (int, np.integer)) or not 0 <= client < MAX_CLIENTS:
        raise ValueError(f"client id must be an integer in [0, {MAX_CLIENTS}), got {client!r}")
    streams = np.asarray(streams, dtype=np.int64)
    if streams.size and (streams.min() < 0 or streams.max() >= STREAMS_PER_CLIENT):
        raise ValueError(f"stream ids must lie in [0, {STREAMS_PER_CLIENT}) per client, got "
                         f"{np.unique(streams)[:8].tolist()}")
    return int(client) * STREAMS_PER_CLIENT + streams


class ReplayShard:
    """One shard: a Ray actor owning one store on its node (run it with ``ReplayShards``, not directly).
    It applies each client's batches once, in sequence order, commits on a timer, and samples for
    learners; its store reopens at the last commit after a restart."""

    def __init__(self, shard_dir: str, create: dict | None = None, *, commit_every: int = 5000,
                 commit_seconds: float = 5.0, durable: bool = True, cache_bytes: int = 256 << 20):
        """Open the shard in ``shard_dir`` (its store is ``shard_dir/store``), creating the store with
        ``Store.create`` arguments ``create`` (``observation_space``, ``action_space``, ``capacity``, ...)
        when there is none yet."""
        from mmreplay.store import Store

        if not isinstance(commit_every, int) or commit_every < 1:
            raise ValueError(f"commit_every must be a positive integer, got {commit_every!r}")
        if not commit_seconds > 0:
            raise ValueError(f"commit_seconds must be > 0, got {commit_seconds!r}")
        self.shard_dir = os.path.abspath(shard_dir)
        self.store_path = os.path.join(self.shard_dir, STORE_DIR)
        self.commit_every, self.commit_seconds, self.durable = commit_every, float(commit_seconds), durable
        os.makedirs(self.shard_dir, exist_ok=True)
        settings = dict(cache_bytes=cache_bytes, commit_every=NEVER, commit_seconds=math.inf, durable=durable)
        if os.path.exists(os.path.join(self.store_path, COMMIT_FILE)):
            self.store = Store.open(self.store_path, "a", **settings)
            self.reopened = True
        else:
            if create is None:
                raise FileNotFoundError(f"no store in {self.store_path!r} and no create arguments to make one")
            if os.path.isdir(self.store_path):
                shutil.rmtree(self.store_path)  # a create that died before its first commit held nothing
            create = dict(create)
            self.store = Store.create(self.store_path, create.pop("observation_space"),
                                      create.pop("action_space"), **create, **settings)
            self.reopened = False
        head = self.store.num_added
        self._committed_entry = make_entry(head, clients_at(read_ledger(self.shard_dir), head, self.shard_dir))
        # drop a ledger entry written before a crash that never reached the store
        write_ledger(self.shard_dir, None, head, self._committed(), durable)
        self.applied: dict[int, int] = self._committed()  # last batch applied per client (committed or not)
        self.pending = 0
        self.commits = 0
        # CPU seconds of the calling thread per ingest step (info()["ingest_cpu_s"]): where a shard's time goes
        self.cpu = dict.fromkeys(("decode", "extend", "ledger", "store_commit"), 0.0)
        self.sample_cpu = {"draw": 0.0, "wire_encode": 0.0}  # CPU seconds of sample(): info()["sample_cpu_s"]
        self._decoded: dict = {}  # decode_batch's reused arrays (the store copies what it keeps)
        schema = self.store.schema  # what every batch's observations must look like (wire.check_payload)
        self._obs_layout = ObsLayout(schema.dict_obs, {s.name: s.shape for s in schema.observations})
        self.incarnation = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self._last_commit = time.monotonic()
        self._lock = threading.Lock()  # the commit timer and the actor's calls never interleave
        self._samplers: dict[str, object] = {}
        self._buffers: dict[tuple, object] = {}
        self._stop = threading.Event()
        self._closed = False
        self._timer = threading.Thread(target=self._commit_timer, name="mmreplay-shard-commit", daemon=True)
        self._timer.start()

    def _committed(self) -> dict[int, int]:
        return {int(c): int(s) for c, s in self._committed_entry["clients"].items()}

    # -- ingest -----------------------------------------------------------------------------------
    def extend(self, client: int, seq: int, payload: dict, reset: bool = False) -> dict:
        """Apply batch ``seq`` of ``client`` (once). Returns the reply the client acts on."""
        with self._lock:
            last = self.applied.get(client, 0)
            if seq <= last:
                return self._reply(client, "duplicate")
            if seq != last + 1 and not reset:
                return self._reply(client, "gap")
            try:
                t0 = time.thread_time()
                rows = decode_batch(payload, self._decoded, self._obs_layout)
                t1 = time.thread_time()
                self.store.extend(rows["obs"], rows["action"], rows["reward"], rows["next_obs"],
                                  rows["terminated"], rows["truncated"], streams=global_streams(client, rows["streams"]),
                                  extras=rows["extras"] or None)
                self.cpu["decode"] += t1 - t0
                self.cpu["extend"] += time.thread_time() - t1
            except (ValueError, TypeError, KeyError):
                # Bad input: the store validated it before storing anything. The batch still uses up its
                # sequence number, so the client's next batches follow without a gap; the error goes back.
                self.applied[client] = seq
                raise
            self.applied[client] = seq
            self.pending += int(payload["n"])
            if self.pending >= self.commit_every or time.monotonic() - self._last_commit >= self.commit_seconds:
                self._commit()
            return self._reply(client, "ok")

    def _reply(self, client: int, status: str) -> dict:
        return {"status": status, "applied": self.applied.get(client, 0),
                "committed": int(self._committed_entry["clients"].get(str(client), 0)),
                "incarnation": self.incarnation}

    def attach(self, client: int) -> dict:
        """What this shard holds of ``client`` (after a restart: what its last commit held)."""
        with self._lock:
            return self._reply(client, "ok")

    def commit(self) -> dict:
        """Commit now (ledger, then store); returns ``info()``."""
        with self._lock:
            self._commit()
        return self.info()

    def _commit(self) -> None:
        t0 = time.thread_time()
        head = self.store.num_added
        if head != self._committed_entry["head"]:
            write_ledger(self.shard_dir, self._committed_entry, head, self.applied, self.durable)
        t1 = time.thread_time()
        self.store.flush()
        self.cpu["ledger"] += t1 - t0
        self.cpu["store_commit"] += time.thread_time() - t1
        self._committed_entry = make_entry(head, self.applied)
        self.pending = 0
        self.commits += 1
        self._last_commit = time.monotonic()

    def _commit_timer(self) -> None:
        """Idle clients still get their tail committed (and local readers see it) within commit_seconds."""
        while not self._stop.wait(min(1.0, self.commit_seconds / 2)):
            with self._lock:
                if self._closed:
                    return
                if self.pending and time.monotonic() - self._last_commit >= self.commit_seconds:
                    self._commit()

    # -- reading ----------------------------------------------------------------------------------
    def info(self) -> dict:
        with self._lock:
            return {"shard_dir": self.shard_dir, "store_path": self.store_path, "node_id": _node_id(),
                    "hostname": socket.gethostname(), "pid": os.getpid(), "incarnation": self.incarnation,
                    "reopened": self.reopened, "size": len(self.store), "num_added": self.store.num_added,
                    "committed_head": self._committed_entry["head"], "commits": self.commits,
                    "ingest_cpu_s": dict(self.cpu), "sample_cpu_s": dict(self.sample_cpu),
                    "clients": {int(c): s for c, s in self._committed_entry["clients"].items()},
                    "applied": dict(self.applied), "schema": self.store.schema.to_json()}

    def _sampler(self, name: str, prioritized: bool, alpha: float | None):
        """The store's sampler ``name``: its RNG state and priorities are committed with the store, so a
        restarted shard or learner continues both."""
        smp = self._samplers.get(name)
        if smp is None or (prioritized and smp.priorities is None):
            if smp is not None:
                smp.close()  # one open sampler per name: the prioritized one takes over its RNG state
            smp = self.store.sampler(1, Prioritized(alpha) if prioritized else Uniform(), name=name)
            self._samplers[name] = smp
        return smp

    def sample(self, n: int, name: str = "learner", prioritized: bool = False, beta: float = 0.4,
               alpha: float | None = None, wire: str = "stacks") -> dict:
        """``n`` transitions (uniform, or by priority with weights relative to this shard's smallest
        priority) as numpy arrays, with this shard's size and priority mass after the draw. ``wire``:
        ``"stacks"``, the decoded obs / next-obs stacks (``batch_to_numpy``); ``"frames"``, each distinct
        frame once, LZ4-compressed, with index maps (``learner_wire.encode_frames``)."""
        from mmreplay.sampling.batch import BatchBuffers

        check_wire(wire)
        with self._lock:
            out = {"size": len(self.store), "batch": None}
            smp = self._sampler(name, prioritized, alpha)
            if n > 0:
                buf = self._buffers.get((n, prioritized))
                if buf is None:
                    buf = self._buffers[(n, prioritized)] = BatchBuffers(self.store.schema, n, weights=prioritized)
                if prioritized:
                    smp.beta = beta
                t0 = time.thread_time()
                picked = smp.draw_into(buf)  # its RNG state is committed with the store
                self.sample_cpu["draw"] += time.thread_time() - t0
                out["batch"] = batch_to_numpy(buf.batch())
                if wire == "frames":
                    t0 = time.thread_time()
                    out["batch"] = encode_frames(out["batch"], picked.obs_ids, picked.next_ids,
                                                 zero_pad=zero_padded(self.store.schema),
                                                 dict_obs=self.store.schema.dict_obs)
                    self.sample_cpu["wire_encode"] += time.thread_time() - t0
            if prioritized:
                out["mass"] = _mass(smp.priorities)
            return out

    def update_priorities(self, indices, priorities, name: str = "learner", alpha: float | None = None) -> int:
        """Route target of the learner's priority updates; persisted at the next commit."""
        with self._lock:
            return self._sampler(name, True, alpha).update_priorities(np.asarray(indices), np.asarray(priorities))

    def priorities(self, indices, name: str = "learner") -> np.ndarray:
        """The current priorities of transitions ``indices`` (for checks and tools)."""
        with self._lock:
            self._sampler(name, True, None)
            return self.store.inspect.priorities(name).of(np.asarray(indices, dtype=np.int64))

    def read(self, lo: int, hi: int, extras: tuple[str, ...] = ()) -> dict:
        """Episode links and extra columns of transitions ``[lo, hi)`` (for audits: what is stored)."""
        with self._lock:
            prev, term, trunc = self.store.inspect.episode_links(lo, hi)
            out = {"prev": prev, "terminated": term, "truncated": trunc}
            if extras and hi > lo:
                batch = self.store.inspect.get(np.arange(lo, hi))
                out.update({k: batch.extras[k].numpy() for k in extras})
            return out

    def close(self) -> dict:
        """Commit and close the store (the actor can then be killed without losing anything)."""
        self._stop.set()
        with self._lock:
            if not self._closed:
                self._commit()
                info = {"num_added": self.store.num_added, "committed_head": self._committed_entry["head"]}
                self.store.close()
                self._closed = True
                return info
        return {}


def batch_to_numpy(batch) -> dict:
    """A ``Batch`` as a dict of numpy arrays (what a shard sends to the learner)."""
    def arr(x):
        if x is None:
            return None
        if isinstance(x, dict):
            return {k: v.numpy() for k, v in x.items()}
        return x.numpy()

    return {"obs": arr(batch.obs), "action": arr(batch.action), "reward": arr(batch.reward),
            "next_obs": arr(batch.next_obs), "terminated": arr(batch.terminated), "truncated": arr(batch.truncated),
            "indices": arr(batch.indices), "extras": arr(batch.extras), "weights": arr(batch.weights)}


def _mass(prio) -> tuple[float, float]:
    """(total, smallest positive) priority leaf of a set, after bringing it up to the ring."""
    return prio.total, prio.smallest


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # not in a Ray worker
        return None
