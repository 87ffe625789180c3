"""``ShardClient``: what an env actor uses to add transitions to the shards, in batches, never hanging.

Invariants:
- Each stream (env) of a client always goes to the same shard (``shard_of``), in order, so its episodes
  stay intact in that shard's store.
- Every batch carries a per-(client, shard) sequence number and stays in the client's log (as an object
  in Ray's object store that this client owns: put once, passed again on a resend) until the shard
  reports it *committed*; after a shard restart the client resends, in order, every logged batch
  after the shard's committed one (the shard skips any it already holds). So as long as the client
  lives and the shard comes back within ``retry_seconds``, every transition is stored exactly once.
- No call waits without a bound. A shard that does not come back within ``retry_seconds`` makes the
  client give its logged batches up: they are counted in ``stats()["dropped"]`` (and reported once with
  a warning), and the next batch tells the shard to accept the gap. The log holds at most
  ``max_unconfirmed`` transitions per shard; beyond that the client asks the shard to commit.
- Bad input (wrong shapes, values a column cannot hold) raises in the caller, as ``Store.extend`` would.
"""

from __future__ import annotations

import collections
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from mmreplay.distributed.shard import STREAMS_PER_CLIENT
from mmreplay.distributed.wire import BatchBuilder, check_codec, payload_nbytes, rows_of


SPARE_BATCHES = 2  # sent batches whose arrays are kept to fill again (fresh memory costs page faults)


@dataclass
class _Logged:
    seq: int
    ref: object  # the payload in Ray's object store (put once; a resend passes the same object again)
    n: int


@dataclass
class _Link:
    """The client's side of one shard: sequence numbers, the unconfirmed log, the calls in flight."""
    handle: object
    next_seq: int = 1
    committed: int = 0
    log: collections.deque = field(default_factory=collections.deque)
    inflight: collections.deque = field(default_factory=collections.deque)  # (seq, ObjectRef)
    reset: bool = False  # the batches before the next one were given up: the shard must accept the gap

    @property
    def unconfirmed(self) -> int:
        return sum(e.n for e in self.log)


class ShardClient:
    """An env actor's writer to the shards: ``add``/``extend`` route each stream to one shard, batch the
    rows and send them with sequence numbers, resending after a shard restart so that every transition
    is stored exactly once. ``flush()`` waits until everything sent is committed."""

    def __init__(self, client_id: int, shards, *, batch_size: int = 1024, max_inflight: int = 2,
                 max_unconfirmed: int = 50_000, retry_seconds: float = 60.0, call_timeout: float = 30.0,
                 compress: str | None = "lz4"):
        """``shards``: the shard actor handles (``ReplayShards.handles``). ``client_id`` must be unique
        among the clients of these shards (it names the client's streams and sequence numbers).
        ``batch_size``: rows per Ray call to a shard. Each call costs about a millisecond of CPU across the
        actor, the shard and Ray's raylet whatever its size; at 1024 Atari rows that is ~2 us a transition
        (at 256, ~6-8: more than the shard's own decode). ``compress``: ``"lz4"`` (the default) sends frames
        LZ4-compressed, ~55x fewer bytes on Atari frames for ~1 us more CPU a transition in the env actor and
        none measurable in the shard (docs/distributed.md); ``None`` sends them raw (on one node Ray moves
        them zero-copy, at ~7 KB a transition across nodes)."""
        import ray

        self._ray = ray
        if not isinstance(client_id, int) or client_id < 0:
            raise ValueError(f"client_id must be a non-negative integer, got {client_id!r}")
        if not shards:
            raise ValueError("a ShardClient needs at least one shard handle")
        for name, value in (("batch_size", batch_size), ("max_inflight", max_inflight),
                            ("max_unconfirmed", max_unconfirmed)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.client_id = client_id
        self.batch_size, self.max_inflight, self.max_unconfirmed = batch_size, max_inflight, max_unconfirmed
        self.retry_seconds, self.call_timeout = float(retry_seconds), float(call_timeout)
        self.compress = check_codec(compress)
        self._links = [_Link(h) for h in shards]
        self._pending: list[BatchBuilder | None] = [None] * len(shards)  # the batch being filled, per shard
        self._spare: list[BatchBuilder] = []  # arrays of batches nothing reads any more, to fill again
        self._stats = collections.Counter()
        self._cpu = {"encode": 0.0, "ray_calls": 0.0}  # CPU seconds of the calling thread (stats()["cpu_s"])
        for i in range(len(shards)):
            if self._attach(i, time.monotonic() + self.retry_seconds) is None:
                # Without the shard's answer the client cannot know where its sequence continues.
                raise TimeoutError(f"shard {i} did not answer within retry_seconds={self.retry_seconds:g}")

    def shard_of(self, stream: int) -> int:
        """The shard that stores stream ``stream`` of this client (fixed for the client's lifetime)."""
        if not 0 <= stream < STREAMS_PER_CLIENT:
            raise ValueError(f"stream must lie in [0, {STREAMS_PER_CLIENT}), got {stream}")
        return (self.client_id + stream) % len(self._links)

    # -- adding -----------------------------------------------------------------------------------
    def add(self, obs, action, reward, next_obs, terminated, truncated, *, stream: int = 0, extras=None) -> None:
        """One transition of env ``stream``."""
        self.extend(_one(obs), np.asarray(action)[None], np.asarray(reward)[None], _one(next_obs),
                    np.asarray(terminated)[None], np.asarray(truncated)[None], streams=[stream],
                    extras={k: np.asarray(v)[None] for k, v in (extras or {}).items()} or None)

    def extend(self, obs, action, reward, next_obs, terminated, truncated, *, streams=None, extras=None) -> None:
        """Row ``i`` is one transition of env ``streams[i]`` (default ``range(n)``: a vector env)."""
        action = np.asarray(action)
        if action.ndim == 0:
            raise ValueError(f"extend: action must have a leading batch axis, got shape {action.shape}")
        n = action.shape[0]
        streams = np.arange(n) if streams is None else np.asarray(streams, dtype=np.int64)
        if streams.shape != (n,):
            raise ValueError(f"streams: expected {n} stream ids, got shape {streams.shape}")
        if n and (streams.min() < 0 or streams.max() >= STREAMS_PER_CLIENT):
            raise ValueError(f"stream must lie in [0, {STREAMS_PER_CLIENT}), got {np.unique(streams)[:8].tolist()}")
        rows = rows_of(streams, obs, action, reward, next_obs, terminated, truncated, extras)
        target = (self.client_id + streams) % len(self._links)
        if len(self._links) == 1 or not n or (target == target[0]).all():
            self._add(int(target[0]) if n else 0, rows, None)
        else:
            for shard in np.unique(target).tolist():
                self._add(shard, rows, np.flatnonzero(target == shard))

    def _add(self, shard: int, rows, sel) -> None:
        """Copy rows ``sel`` (all when None) into the shard's batch, sending each batch as it fills."""
        idx = np.arange(rows.n) if sel is None else sel
        done = 0
        while done < idx.size:
            builder = self._pending[shard]
            if builder is not None and not builder.accepts(rows):
                self._send(shard)  # other dtypes or shapes than the batch's: they go in a batch of their own
                builder = None
            if builder is None:
                builder = self._spare.pop() if self._spare else None
                if builder is None or not builder.accepts(rows):
                    builder = BatchBuilder(self.batch_size, self.compress)
                self._pending[shard] = builder
            take = min(builder.room, idx.size - done)
            part = slice(done, done + take) if sel is None else idx[done:done + take]
            t0 = time.thread_time()
            builder.add(rows, part)
            self._cpu["encode"] += time.thread_time() - t0
            done += take
            if builder.room == 0:
                self._send(shard)

    def flush(self, commit: bool = True) -> dict:
        """Send every pending row and wait for the replies; with ``commit`` also have each shard commit, so
        that everything added so far is durable. Returns ``stats()``."""
        for shard in range(len(self._links)):
            if self._pending[shard] is not None:
                self._send(shard)
            self._drain(shard, 0)
            if commit:
                self._confirm(shard)
        return self.stats()

    def stats(self) -> dict:
        """Counts: transitions ``added`` (handed to the client), ``sent``, ``committed`` (confirmed durable),
        ``resent`` (after a shard restart), ``dropped`` (given up: the reported loss), ``rejected`` (batches
        the shard refused as bad input; the error was raised), ``retries``,
        ``bytes_sent`` (array bytes of the payloads), ``unconfirmed`` (in the log now) and ``cpu_s``: CPU seconds
        of the calling thread spent building batches (``encode``) and in Ray calls (``ray_calls``: submitting
        a batch, which copies it into Ray's object store, and waiting for replies)."""
        out = {k: int(self._stats[k]) for k in ("added", "sent", "committed", "resent", "dropped", "rejected",
                                                  "retries", "bytes_sent", "batches")}
        out["unconfirmed"] = sum(link.unconfirmed for link in self._links)
        out["cpu_s"] = dict(self._cpu)
        return out

    # -- sending and confirming -------------------------------------------------------------------
    def _send(self, shard: int) -> None:
        t0 = time.thread_time()
        builder, self._pending[shard] = self._pending[shard], None
        n = builder.n
        payload = builder.payload()
        nbytes = payload_nbytes(payload)
        t1 = time.thread_time()
        self._cpu["encode"] += t1 - t0
        try:
            # Ray copies the payload into its object store here, once: the log keeps that object (owned by
            # this process, alive while referenced) for resends, and the batch's arrays are refilled at once.
            ref = self._ray.put(payload)
            del payload
            self._recycle(builder)
            self._submit_logged(shard, ref, n, nbytes)
        finally:
            self._cpu["ray_calls"] += time.thread_time() - t1

    def _submit_logged(self, shard: int, ref, n: int, nbytes: int) -> None:
        link = self._links[shard]
        entry = _Logged(link.next_seq, ref, n)
        link.next_seq += 1
        link.log.append(entry)
        self._stats.update(added=n, batches=1, bytes_sent=nbytes)
        self._submit(shard, entry)
        self._drain(shard, self.max_inflight)
        if link.unconfirmed > self.max_unconfirmed:
            self._confirm(shard)

    def _submit(self, shard: int, entry: _Logged, resend: bool = False) -> None:
        link = self._links[shard]
        ref = link.handle.extend.remote(self.client_id, entry.seq, entry.ref, link.reset)
        link.reset = False
        link.inflight.append((entry.seq, ref))
        self._stats["resent" if resend else "sent"] += entry.n

    def _drain(self, shard: int, keep: int) -> None:
        """Wait for replies until at most ``keep`` calls are in flight."""
        link = self._links[shard]
        failing_since = None  # a shard that keeps failing (or answering too slowly) is given up in the end
        while len(link.inflight) > keep:
            seq, ref = link.inflight[0]
            try:
                reply = self._ray.get(ref, timeout=self.call_timeout)
            except Exception as exc:  # noqa: BLE001
                if not _is_fault(exc, self._ray):
                    if not isinstance(exc, self._ray.exceptions.RayTaskError):
                        raise  # not from the shard's code: leave the log as it is
                    # The shard refused the batch itself (bad input): the caller's bug, not a fault. It
                    # stored nothing and used up its sequence number; it leaves the log, counted.
                    link.inflight.popleft()
                    self._stats["rejected"] += sum(e.n for e in link.log if e.seq == seq)
                    link.log = collections.deque(e for e in link.log if e.seq != seq)
                    raise
                reply = None
            if reply is not None and reply["status"] != "gap":
                link.inflight.popleft()
                self._confirmed(shard, reply["committed"])
                failing_since = None
                continue
            # the shard died, restarted (a gap: it lost batches before this one) or is too slow
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > self.retry_seconds:
                self._give_up(shard)
                return
            self._recover(shard)

    def _confirm(self, shard: int) -> None:
        """Have the shard commit, then drop what it confirmed from the log."""
        self._drain(shard, 0)
        deadline = time.monotonic() + self.retry_seconds
        while self._links[shard].log:
            if time.monotonic() > deadline:
                self._give_up(shard)
                return
            try:
                self._ray.get(self._links[shard].handle.commit.remote(), timeout=self.call_timeout)
                reply = self._ray.get(self._links[shard].handle.attach.remote(self.client_id),
                                      timeout=self.call_timeout)
            except Exception as exc:  # noqa: BLE001 (any failure of the shard: retry until the deadline)
                if not _is_fault(exc, self._ray):
                    raise
                self._recover(shard)
                continue
            if reply["applied"] < self._links[shard].log[-1].seq:  # restarted in between: resend first
                self._recover(shard)
                self._drain(shard, 0)
            else:
                self._confirmed(shard, reply["committed"])

    def _confirmed(self, shard: int, committed: int) -> None:
        link = self._links[shard]
        link.committed = max(link.committed, committed)
        while link.log and link.log[0].seq <= link.committed:
            self._stats["committed"] += link.log.popleft().n

    def _recycle(self, builder: BatchBuilder) -> None:
        if len(self._spare) < SPARE_BATCHES:
            self._spare.append(builder.recycled())

    def _attach(self, shard: int, deadline: float) -> dict | None:
        """Ask the shard what it holds of this client, retrying until ``deadline``; None if it never answers."""
        link = self._links[shard]
        while True:
            try:
                reply = self._ray.get(link.handle.attach.remote(self.client_id),
                                      timeout=max(0.1, min(self.call_timeout, deadline - time.monotonic())))
            except Exception as exc:  # noqa: BLE001
                if not _is_fault(exc, self._ray):
                    raise
                self._stats["retries"] += 1
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.2)
                continue
            if link.next_seq == 1:  # a new client object for an id the shard knows: continue its sequence
                link.next_seq = reply["applied"] + 1
                link.committed = reply["committed"]
            return reply

    def _recover(self, shard: int) -> None:
        """The shard failed or restarted: reattach, then resend, in order, every batch it does not hold."""
        link = self._links[shard]
        link.inflight.clear()  # their outcome is read from the shard itself; duplicates are skipped there
        deadline = time.monotonic() + self.retry_seconds
        reply = self._attach(shard, deadline)
        if reply is None:
            self._give_up(shard)
            return
        self._confirmed(shard, reply["committed"])
        first = True
        for entry in link.log:
            if entry.seq > reply["applied"]:
                if first:  # batches before it were given up earlier: the shard must accept the gap
                    link.reset = link.reset or entry.seq != reply["applied"] + 1
                    first = False
                self._submit(shard, entry, resend=True)

    def _give_up(self, shard: int) -> None:
        link = self._links[shard]
        lost = link.unconfirmed
        self._stats["dropped"] += lost
        link.log.clear()
        link.inflight.clear()
        link.reset = True
        warnings.warn(f"mmreplay: shard {shard} did not come back within {self.retry_seconds:g} s; client "
                      f"{self.client_id} dropped {lost} unconfirmed transitions (stats()['dropped'] counts them)",
                      RuntimeWarning, stacklevel=3)


def _is_unavailable(exc, ray) -> bool:
    cause = getattr(exc, "cause", None)
    return isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


def _is_fault(exc, ray) -> bool:
    """A failure of the shard (dead, restarting, slow), as opposed to an error the call itself raised."""
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                        ray.exceptions.ActorUnavailableError)):
        return True
    return isinstance(exc, ray.exceptions.RayTaskError) and _is_unavailable(exc, ray)


def _one(obs):
    if isinstance(obs, dict):
        return {k: np.asarray(v)[None] for k, v in obs.items()}
    return np.asarray(obs)[None]
