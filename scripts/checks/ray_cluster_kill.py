"""A 3-node Ray cluster (``ray.cluster_utils.Cluster``: three raylets on this machine) runs a distributed replay:
two shards, each on its own worker node, take 84x84 frames from three env actors (one per node); each shard is
killed once (Ray restarts it on its node); afterwards every transition must be stored exactly once, every
episode whole, and a learner on the head node, reading both shards through their actors (another node each),
must rebuild every sampled row exactly, from the frames wire and from the stacks wire. Bytes on the wire per
batch and batches/s are measured for both.

Issue 38, item 3 ("a 3-node Cluster run survives a killed shard with every transition stored exactly once").
Too slow for the suite on a 2-core box (three raylets, five worker processes importing torch); run it by hand:

    python scripts/checks/ray_cluster_kill.py [--steps 150] [--batches 20] [--json out.json]

The frames are the Atari fixture's, cycled, each stamped with its transition's uid in its first 8 bytes, so a
row of a batch identifies itself: its stack must be the frames of the uids before it in its episode (padded with
the episode's first frame), the rest of each frame the fixture's. Prints a JSON summary; exit status 1 when any
check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

ENVS = 2  # envs (streams) per env actor
K = 4  # frame_stack
PREFIX = "cluster-kill"


def fixture_frames() -> np.ndarray:
    from mmreplay.cli.quickbench import atari_fixture

    return atari_fixture()["frames"]


def frames_of(uid: np.ndarray, frames: np.ndarray) -> np.ndarray:
    """The frame of each uid: the fixture's frame ``uid % len``, its first 8 bytes the uid itself."""
    uid = np.asarray(uid, dtype=np.int64).reshape(-1)
    out = frames[uid % len(frames)].copy()
    out.reshape(uid.size, -1)[:, :8] = uid.view(np.uint8).reshape(-1, 8)
    return out


class Envs:
    """``ENVS`` deterministic envs of one actor: episodes of 3..17 steps; uid = (client, env, step)."""

    def __init__(self, client_id: int, frames: np.ndarray):
        self.client_id, self.frames = client_id, frames
        self.rng = np.random.default_rng(client_id)
        self.t = np.zeros(ENVS, dtype=np.int64)
        self.ep_t = np.zeros(ENVS, dtype=np.int64)
        self.ep_len = self.rng.integers(3, 18, ENVS)

    def uid(self, env, t):
        return (self.client_id * 100 + env) * 1_000_000 + t

    def step(self) -> dict:
        envs = np.arange(ENVS)
        uid = self.uid(envs, self.t)
        end = self.ep_t + 1 >= self.ep_len
        truncated = end & (self.rng.random(ENVS) < 0.3)
        row = dict(obs=frames_of(uid, self.frames), action=self.rng.integers(0, 3, ENVS),
                   reward=self.rng.integers(-1, 2, ENVS), next_obs=frames_of(uid + 1, self.frames),
                   terminated=end & ~truncated, truncated=truncated,
                   extras={"uid": uid, "ep_t": self.ep_t.astype(np.int32)})
        self.t += 1
        self.ep_t = np.where(end, 0, self.ep_t + 1)
        self.ep_len = np.where(end, self.rng.integers(3, 18, ENVS), self.ep_len)
        return row


def env_actor_class(ray):
    @ray.remote(num_cpus=0)
    class EnvActor:
        def __init__(self, client_id, num_shards):
            from mmreplay.distributed import ReplayShards

            self.envs = Envs(client_id, fixture_frames())
            self.client = ReplayShards.connect(num_shards, prefix=PREFIX).client(client_id, batch_size=16,
                                                                                 retry_seconds=120.0)

        def node(self):
            return ray.get_runtime_context().get_node_id()

        def run(self, steps, flush=False):
            for _ in range(steps):
                r = self.envs.step()
                self.client.extend(r["obs"], r["action"], r["reward"], r["next_obs"], r["terminated"],
                                   r["truncated"], extras=r["extras"])
            return self.client.flush() if flush else self.client.stats()
    return EnvActor


def audit(ray, shards) -> np.ndarray:
    """Every stored uid, after checking that each shard's episodes are whole (starts unlinked, each step
    linked to its predecessor)."""
    found = []
    for handle in shards.handles:
        hi = ray.get(handle.info.remote())["num_added"]
        if hi == 0:
            continue
        d = ray.get(handle.read.remote(0, hi, ("uid", "ep_t")))
        uid, ep_t, prev = d["uid"], d["ep_t"], d["prev"]
        starts = ep_t == 0
        cont = np.flatnonzero(~starts)
        if not ((prev[starts] == -1).all() and (prev[cont] >= 0).all() and (uid[prev[cont]] == uid[cont] - 1).all()):
            raise AssertionError("an episode is broken on a shard")
        found.append(uid)
    return np.concatenate(found)


def expected_stacks(uid: np.ndarray, ep_t: np.ndarray, frames: np.ndarray, after: int = 0) -> np.ndarray:
    back = np.minimum(np.arange(K - 1, -1, -1)[None, :], ep_t[:, None].astype(np.int64) + after)
    return frames_of((uid[:, None] + after - back).reshape(-1), frames).reshape(uid.size, K, *frames.shape[1:])


def learner_run(shards, wire: str, batch_size: int, batches: int, frames: np.ndarray) -> dict:
    """Batches drawn through the shard actors (each on another node than this driver): rows wrong, bytes."""
    smp = shards.sampler(batch_size, local=False, wire=None if wire == "frames" else wire, prefetch=1, seed=1,
                         name=f"learner-{wire}-{batch_size}")
    if smp.wires != [wire] * len(shards):  # frames: the default for stacks from shards on other nodes
        raise AssertionError(f"the sampler chose {smp.wires}, expected {wire} from every shard")
    wrong = 0
    smp.sample()  # the first reply waits for the shards' samplers to start: not timed
    bytes0, t0 = smp.stats["wire_bytes"], time.perf_counter()
    for _ in range(batches):
        b = smp.sample()
        uid, ep_t = b.extras["uid"].numpy(), b.extras["ep_t"].numpy()
        ok = (b.obs.numpy() == expected_stacks(uid, ep_t, frames)).reshape(batch_size, -1).all(axis=1)
        ok &= (b.next_obs.numpy() == expected_stacks(uid, ep_t, frames, 1)).reshape(batch_size, -1).all(axis=1)
        wrong += int((~ok).sum())
    seconds = time.perf_counter() - t0
    out = {"wire": wire, "batch_size": batch_size, "batches": batches, "wrong_rows": wrong,
           "wire_bytes_per_batch": (smp.stats["wire_bytes"] - bytes0) / batches,
           "batches_per_s": batches / seconds}
    smp.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="env steps per env actor (x2 envs each), in 3 rounds")
    ap.add_argument("--batches", type=int, default=20, help="timed learner batches per wire and batch size")
    ap.add_argument("--json", help="write the summary here too")
    args = ap.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from gymnasium import spaces
    from ray.cluster_utils import Cluster

    from mmreplay.columns.spec import ColumnSpec
    from mmreplay.distributed import ReplayShards

    frames = fixture_frames()
    root = tempfile.mkdtemp(prefix="mmreplay-cluster-kill-")
    t_start = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node0": 1}})
    for i in (1, 2):
        cluster.add_node(num_cpus=2, resources={f"node{i}": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="mmreplay-cluster-kill", log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    summary: dict = {"nodes": len([n for n in ray.nodes() if n["Alive"]])}
    try:
        extras = [ColumnSpec.numeric("uid", (), "int64"), ColumnSpec.numeric("ep_t", (), "int32")]
        shards = ReplayShards.create(
            root, 2, spaces.Box(0, 255, frames.shape[1:], np.uint8), spaces.Discrete(3), capacity=None,
            reward_values=(-1, 0, 1), extras=extras, frame_stack=K, durable=False, prefix=PREFIX,
            commit_every=100_000, commit_seconds=3600.0,
            actor_options=[{"num_cpus": 0, "resources": {f"node{i}": 0.01}} for i in (1, 2)])
        EnvActor = env_actor_class(ray)
        clients = [0, 1, 2]
        actors = [EnvActor.options(resources={f"node{c}": 0.01}).remote(c, 2) for c in clients]
        shard_nodes = {i["node_id"] for i in shards.info()}
        summary["shards_on_distinct_nodes"] = len(shard_nodes) == 2
        summary["learner_node_apart"] = ray.get_runtime_context().get_node_id() not in shard_nodes
        third = args.steps // 3
        ray.get([a.run.remote(third) for a in actors])
        shards.commit()
        ray.get([a.run.remote(third) for a in actors])
        before = shards.info()
        ray.kill(shards.handles[0], no_restart=False)  # an uncommitted tail is lost with it: clients resend
        running = [a.run.remote(args.steps - 2 * third, flush=True) for a in actors]
        time.sleep(1.0)
        ray.kill(shards.handles[1], no_restart=False)  # and the other one while the actors are sending
        stats = ray.get(running, timeout=600)
        after = shards.info()
        stored = np.sort(audit(ray, shards))
        want = np.sort(np.concatenate([[Envs(c, frames).uid(e, t) for e in range(ENVS) for t in range(args.steps)]
                                       for c in clients]))
        summary.update({
            "uncommitted_tail_killed": before[0]["num_added"] - before[0]["committed_head"],
            "restarted": [a["incarnation"] != b["incarnation"] and a["reopened"] for a, b in zip(after, before)],
            "restarted_on_same_node": [a["node_id"] == b["node_id"] for a, b in zip(after, before)],
            "resent": sum(s["resent"] for s in stats), "dropped": sum(s["dropped"] for s in stats),
            "transitions_expected": int(want.size), "transitions_stored": int(stored.size),
            "stored_exactly_once": bool(stored.size == want.size and (stored == want).all()),
        })
        summary["learner"] = [learner_run(shards, wire, b, args.batches, frames)
                              for b in (32, 256) for wire in ("stacks", "frames")]
        for b in (32, 256):
            runs = {r["wire"]: r for r in summary["learner"] if r["batch_size"] == b}
            summary[f"wire_ratio_b{b}"] = runs["stacks"]["wire_bytes_per_batch"] / runs["frames"]["wire_bytes_per_batch"]
        shards.close()
    finally:
        summary["seconds"] = time.monotonic() - t_start
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    ok = (summary.get("stored_exactly_once") and all(summary.get("restarted", [False]))
          and all(r["wrong_rows"] == 0 for r in summary.get("learner", [{"wrong_rows": 1}])) and summary["dropped"] == 0)
    summary["ok"] = bool(ok)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
