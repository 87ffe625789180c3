"""mmreplay.distributed on a local Ray cluster started here (a few logical CPUs, loopback only).

The workload makes every transition identifiable: extra column ``uid`` (client, env, step) and ``ep_t``
(step within its episode); observations are the uid's bytes, so each episode's observations chain.
An audit then reads every shard back and checks each uid is stored exactly once and each episode is
whole (every step links to the previous one of its episode, starts have no link, ends are flagged).
"""

import os
import sys
import time
import warnings

import numpy as np
import torch
import pytest
from gymnasium import spaces

ray = pytest.importorskip("ray")

from mmreplay.columns.spec import ColumnSpec  # noqa: E402
from mmreplay.sampling.strategy import Prioritized

OBS = spaces.Box(0, 255, (8,), np.uint8)
EXTRAS = [ColumnSpec.numeric("uid", (), "int64"), ColumnSpec.numeric("ep_t", (), "int32")]
ENVS = 2  # envs (streams) per env actor


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 namespace="mmreplay-tests")
    except Exception as exc:  # noqa: BLE001 (no Ray here: skip, do not fail)
        pytest.skip(f"Ray cannot start here: {exc}")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # env actors run this file's code
    yield
    ray.shutdown()


def make_shards(root, n, prefix, **kw):
    from mmreplay.distributed import ReplayShards

    kw.setdefault("commit_every", 10_000)
    kw.setdefault("commit_seconds", 3600.0)
    return ReplayShards.create(str(root), n, OBS, spaces.Discrete(3), capacity=None, reward_values=(-1, 0, 1),
                               extras=EXTRAS, durable=False, prefix=prefix, actor_options={"num_cpus": 0},
                               start_timeout=RESTART_SECONDS, **kw)


def uid_obs(uid: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(uid, dtype=np.int64)).view(np.uint8).reshape(-1, 8)


class Envs:
    """``ENVS`` deterministic envs of one actor: episodes of 3..17 steps, one row per env per step."""

    def __init__(self, client_id: int):
        self.client_id = client_id
        self.rng = np.random.default_rng(client_id)
        self.t = np.zeros(ENVS, dtype=np.int64)  # steps so far per env (uid counter)
        self.ep_t = np.zeros(ENVS, dtype=np.int64)
        self.ep_len = self.rng.integers(3, 18, ENVS)

    def uid(self, env, t):
        return (self.client_id * 100 + env) * 1_000_000 + t

    def step(self):
        envs = np.arange(ENVS)
        uid = self.uid(envs, self.t)
        end = self.ep_t + 1 >= self.ep_len
        truncated = end & (self.rng.random(ENVS) < 0.3)
        row = dict(obs=uid_obs(uid), action=self.rng.integers(0, 3, ENVS), reward=self.rng.integers(-1, 2, ENVS),
                   next_obs=uid_obs(uid + 1), terminated=end & ~truncated, truncated=truncated,
                   extras={"uid": uid, "ep_t": self.ep_t.astype(np.int32)})
        self.t += 1
        self.ep_t = np.where(end, 0, self.ep_t + 1)
        self.ep_len = np.where(end, self.rng.integers(3, 18, ENVS), self.ep_len)
        return row


@ray.remote(num_cpus=0)
class EnvActor:
    def __init__(self, client_id, prefix, num_shards, **client_kw):
        from mmreplay.distributed import ReplayShards

        self.envs = Envs(client_id)
        self.client = ReplayShards.connect(num_shards, prefix=prefix).client(client_id, **client_kw)

    def run(self, steps, flush=False):
        for _ in range(steps):
            r = self.envs.step()
            self.client.extend(r["obs"], r["action"], r["reward"], r["next_obs"], r["terminated"], r["truncated"],
                               extras=r["extras"])
        return self.client.flush() if flush else self.client.stats()


def audit(shards):
    """Every stored transition's uid (per shard), checking that each episode is whole on its shard."""
    found = []
    for handle in shards.handles:
        info = ray.get(handle.info.remote())
        lo, hi = 0, info["num_added"]
        if hi == 0:
            continue
        d = ray.get(handle.read.remote(lo, hi, ("uid", "ep_t")))
        uid, ep_t, prev = d["uid"], d["ep_t"], d["prev"]
        starts = ep_t == 0
        assert (prev[starts] == -1).all(), "an episode start links to an earlier transition"
        cont = np.flatnonzero(~starts)
        assert (prev[cont] >= 0).all(), f"episode broken at uids {uid[cont[prev[cont] < 0]][:5]}"
        assert (uid[prev[cont] - lo] == uid[cont] - 1).all(), "a step links to the wrong predecessor"
        assert (ep_t[prev[cont] - lo] == ep_t[cont] - 1).all()
        found.append(uid)
    return np.concatenate(found)


def expected_uids(clients, steps):
    return np.sort(np.concatenate([[Envs(c).uid(e, t) for e in range(ENVS) for t in range(steps)] for c in clients]))


# How long a killed shard may take to come back before a client gives its log up, or a wait ends: bounds
# against a hang, not timings. Four suites side by side on 2 cores took Ray over 60 s to restart an actor,
# and the clients, told 60 s, then dropped what the shard had not confirmed (a loaded machine must only be slower).
RESTART_SECONDS = 300.0

@pytest.fixture(scope="module")
def deployment(cluster, tmp_path_factory):
    """3 env actors x 2 shards; shard 0 is killed (SIGKILL, Ray restarts it) with an uncommitted tail between
    two rounds of adds, then shard 1 while the actors are sending."""
    prefix, n_shards, clients = "kill", 2, [0, 1, 2]
    shards = make_shards(tmp_path_factory.mktemp("deploy"), n_shards, prefix)
    actors = [EnvActor.remote(c, prefix, n_shards, batch_size=8, retry_seconds=RESTART_SECONDS) for c in clients]
    ray.get([a.run.remote(40) for a in actors])
    shards.commit()  # a commit in the middle: the restart must keep it and lose only what followed
    ray.get([a.run.remote(30) for a in actors])
    before = shards.info()[0]
    ray.kill(shards.handles[0], no_restart=False)
    running = [a.run.remote(40, flush=True) for a in actors]
    time.sleep(1.0)  # and shard 1 dies while the actors are sending (calls in flight, whatever their state)
    ray.kill(shards.handles[1], no_restart=False)
    stats = ray.get(running, timeout=3 * RESTART_SECONDS)
    after = shards.info(timeout=RESTART_SECONDS)
    yield {"shards": shards, "stats": stats, "before": before, "after": after, "clients": clients, "steps": 110}
    shards.close()


def test_killed_shard_restarts_and_every_transition_is_stored_exactly_once(deployment):
    before, after, stats = deployment["before"], deployment["after"], deployment["stats"]
    assert before["num_added"] > before["committed_head"], "the test needs an uncommitted tail on shard 0"
    assert all(a["reopened"] for a in after) and after[0]["incarnation"] != before["incarnation"]
    lost_tail = before["num_added"] - before["committed_head"]
    assert sum(s["resent"] for s in stats) >= lost_tail  # the clients resent what the crash took
    assert sum(s["dropped"] for s in stats) == 0
    assert all(s["unconfirmed"] == 0 and s["committed"] == s["added"] for s in stats)
    stored = np.sort(audit(deployment["shards"]))
    expected = expected_uids(deployment["clients"], deployment["steps"])
    assert stored.size == expected.size, f"{stored.size - expected.size:+d} transitions vs what was added"
    assert (stored == expected).all()  # each exactly once


def test_uniform_sampler_draws_over_the_union_in_proportion_to_shard_sizes(deployment):
    shards = deployment["shards"]
    sizes = np.array([i["size"] for i in shards.info()], dtype=float)
    # 12 batches a call ask a shard for more rows than it holds: one call a batch then
    for local, per_call in ((True, None), (False, None), (False, 3), (False, 12)):
        smp = shards.sampler(64, local=local, seed=3, prefetch=1, batches_per_call=per_call)
        assert bool(smp.local) == local
        counts = np.zeros(2)
        for _ in range(40):
            b = smp.sample()
            assert b.obs.shape == (64, 8) and b.extras["uid"].shape == (64,)
            # every row is the transition its (shard, index) names
            assert (uid_obs(b.extras["uid"].numpy()) == b.obs.numpy()).all()
            counts += np.bincount(b.shard.numpy(), minlength=2)
        share = counts[0] / counts.sum()
        expected = sizes[0] / sizes.sum()
        assert abs(share - expected) < 0.04, (share, expected)
        smp.close()
    # a learner restored from state_dict draws what the saved one drew next, local shards included
    smp = shards.sampler(16, local=True, seed=9, prefetch=0)
    smp.sample()
    saved = smp.state_dict()
    want = smp.sample()
    want_shard, want_idx = want.shard.clone(), want.indices.clone()
    again = shards.sampler(16, local=True, seed=123, prefetch=0)
    again.load_state_dict(saved)
    got = again.sample()
    assert torch.equal(got.shard, want_shard) and torch.equal(got.indices, want_idx)
    smp.close()
    again.close()


def test_priorities_are_routed_persisted_and_a_restarted_learner_continues(deployment):
    from mmreplay.distributed import ReplayShards

    shards = deployment["shards"]
    smp = shards.sampler(32, draw=Prioritized(), local=False, prefetch=0, seed=5, name="L")
    b = smp.sample()
    assert b.weights is not None and float(b.weights.max()) <= 1.0
    new = np.arange(1, 33, dtype=np.float32) * 10
    smp.update_priorities(b, new)
    smp.close()  # waits for the updates
    smp = shards.sampler(16, draw=Prioritized(), local=False, prefetch=0, seed=7, name="L")
    smp.sample()
    saved = smp.state_dict()  # what a learner checkpoints with its model
    shards.commit()  # the shards commit priorities and their side of the sampler state
    expected = smp.sample()
    del smp
    for handle in shards.handles:
        ray.kill(handle, no_restart=False)  # both shards restart from their commit; the learner too
    shards = ReplayShards.connect(2, prefix="kill")
    shards.info(timeout=RESTART_SECONDS)  # waits until both are back
    shard, idx = b.shard.numpy(), b.indices.numpy()
    for i in (0, 1):
        rows = shard == i
        if rows.any():  # the last value given to an id wins (a batch may hold an id twice)
            want = {int(g): p for g, p in zip(idx[rows], new[rows])}
            got = ray.get(shards.handles[i].priorities.remote(np.array(list(want)), "L"))
            assert np.allclose(got, list(want.values()))
    learner = shards.sampler(16, draw=Prioritized(), local=False, prefetch=0, name="L")
    learner.load_state_dict(saved)
    got = learner.sample()
    assert got.shard.tolist() == expected.shard.tolist()  # the same split (learner state) ...
    assert got.indices.tolist() == expected.indices.tolist()  # ... and the same draws (committed shard state)
    assert np.allclose(got.weights.numpy(), expected.weights.numpy())
    # a new learner draws in proportion to (p + eps) ** alpha over both shards: the updated rows carry the
    # mass computed here (all others kept the initial priority 1), far above their uniform share
    final = {(int(s_), int(g)): float(p) for s_, g, p in zip(shard, idx, new)}  # last value wins
    total_rows = sum(i["size"] for i in shards.info())
    leaf = {k: (p + 1e-6) ** 0.6 for k, p in final.items()}
    hot = {k for k, p in final.items() if p >= 200}
    expected_share = sum(leaf[k] for k in hot) / (sum(leaf.values()) + (total_rows - len(final)) * 1.0)
    assert expected_share > 10 * len(hot) / total_rows
    learner = shards.sampler(512, draw=Prioritized(), local=False, prefetch=0, seed=6, name="L")
    drawn = learner.sample()
    share = np.mean([(int(s_), int(g)) in hot for s_, g in zip(drawn.shard, drawn.indices)])
    assert abs(share - expected_share) < 0.07, (share, expected_share)
    assert float(drawn.weights.max()) <= 1.0 + 1e-6
    learner.close()


def test_shard_gone_for_good_is_a_counted_loss_not_a_hang(cluster, tmp_path):
    prefix = "gone"
    shards = make_shards(tmp_path, 1, prefix)
    client = shards.client(7, batch_size=4, retry_seconds=2.0, call_timeout=2.0)
    # bad input is the caller's error, raised (not retried, not a hang); the client goes on afterwards
    with pytest.raises(ValueError, match="expected shape|this store takes"):
        client.extend(np.zeros((4, 9), np.uint8), [0] * 4, [0] * 4, np.zeros((4, 9), np.uint8), [False] * 4,
                      [False] * 4, streams=[0, 0, 0, 0], extras={"uid": np.arange(4), "ep_t": np.zeros(4, np.int32)})
        client.flush()
    assert client.stats()["rejected"] == 4
    envs = Envs(7)
    for _ in range(10):
        r = envs.step()
        client.extend(r["obs"], r["action"], r["reward"], r["next_obs"], r["terminated"], r["truncated"],
                      extras=r["extras"])
    client.flush(commit=False)
    unconfirmed = client.stats()["unconfirmed"]
    assert unconfirmed == 20
    ray.kill(shards.handles[0], no_restart=True)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = client.flush()
    assert time.monotonic() - t0 < 30
    assert stats["dropped"] == unconfirmed and stats["unconfirmed"] == 0
    assert any("dropped 20 unconfirmed" in str(w.message) for w in caught)


def test_rows_of_other_dtypes_go_in_a_batch_of_their_own_and_every_row_is_stored(cluster, tmp_path):
    """A client fills each batch's arrays from its first rows: rows with another dtype (here the reward)
    start the next batch, none is cast on the actor side, and every one is stored, in order, once."""
    shards = make_shards(tmp_path, 1, "dtypes")
    client = shards.client(3, batch_size=6)
    envs = Envs(3)
    for t in range(7):
        r = envs.step()
        reward = r["reward"].astype(np.float64 if t % 3 == 1 else np.int64)
        client.extend(r["obs"], r["action"], reward, r["next_obs"], r["terminated"], r["truncated"], extras=r["extras"])
    stats = client.flush()
    assert stats["added"] == stats["committed"] == 7 * ENVS and stats["dropped"] == 0
    assert stats["batches"] >= 5  # 3 switches of dtype, and 14 rows in batches of 6
    assert stats["cpu_s"]["encode"] > 0 and stats["cpu_s"]["ray_calls"] > 0
    stored = np.sort(audit(shards))
    assert (stored == expected_uids([3], 7)).all()
    info = shards.info()[0]
    assert info["ingest_cpu_s"]["extend"] > 0 and set(info["ingest_cpu_s"]) == {"decode", "extend", "ledger",
                                                                                "store_commit"}
    shards.close()


def expected_stacks(uid: np.ndarray, ep_t: np.ndarray, k: int, after: int = 0) -> np.ndarray:
    """The frame stacks of transitions ``uid`` at step ``ep_t`` of their episodes (``after=1``: of their
    next observations): frame ``j`` is ``k - 1 - j`` steps back, padded with the episode's first frame."""
    back = np.minimum(np.arange(k - 1, -1, -1)[None, :], ep_t[:, None].astype(np.int64) + after)
    return uid_obs((uid[:, None] + after - back).reshape(-1)).reshape(uid.size, k, -1)


def test_learner_rebuilds_remote_stacks_exactly_from_either_wire(cluster, tmp_path):
    """Through the shard actors (``local=False``), batches served from replies of several planned batches,
    sent as distinct compressed frames or as decoded stacks: every stack (padded at episode starts) is the
    one the stored transition's episode says."""
    prefix = "wire"
    shards = make_shards(tmp_path, 2, prefix, frame_stack=4)
    actors = [EnvActor.remote(c, prefix, 2, batch_size=8) for c in (0, 1)]
    ray.get([a.run.remote(40, flush=True) for a in actors])
    for wire in ("frames", "stacks"):
        smp = shards.sampler(32, local=False, wire=wire, prefetch=1, batches_per_call=3, seed=0,
                             name=f"learner-{wire}")
        assert smp.wires == [wire, wire]
        starts = 0
        for _ in range(4):
            batch = smp.sample()
            uid, ep_t = batch.extras["uid"].numpy(), batch.extras["ep_t"].numpy()
            assert np.array_equal(batch.obs.numpy(), expected_stacks(uid, ep_t, 4)), wire
            assert np.array_equal(batch.next_obs.numpy(), expected_stacks(uid, ep_t, 4, after=1)), wire
            starts += int((ep_t < 3).sum())
        assert starts > 0 and smp.stats["wire_bytes"] > 0
        smp.close()
    # by default a shard on the learner's node sends stacks (Ray moves them without the network)
    default = shards.sampler(32, local=False, name="learner-default")
    assert default.wires == ["stacks", "stacks"]
    default.close()
    shards.close()
