"""Ape-X-style DQN on CartPole with mmreplay.distributed: several env actors, two shards, one learner.

Env actors (Ray actors) play CartPole with their own exploration rate (Ape-X: eps_i = 0.4 ** (1 + 7 i / (N-1)))
and add through a ``ShardClient``; two shard actors each own an on-disk store; the learner (this process)
draws prioritized batches over both shards, updates the priorities (routed back to the owning shard)
and sends fresh weights to the actors. Halfway the whole thing stops: the shards commit and close,
Ray shuts down, the learner saves its network and sampler state. A second phase starts Ray again,
reopens the same shard directories (every committed transition and priority is still there), loads
the learner and goes on training.

    python examples/apex_dqn.py [--actors 3] [--seconds 45] [--root /tmp/apex_cartpole]

Needs ``pip install 'mmreplay[ray]'``. About two minutes on a 2-core CPU box.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from mmreplay.sampling.strategy import Prioritized

GAMMA = 0.99


def q_network() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))


def make_actor_class(ray):
    @ray.remote(num_cpus=0)
    class EnvActor:
        """Plays CartPole with its own epsilon; adds every step through a ShardClient."""

        def __init__(self, index: int, n_actors: int, num_shards: int, seed: int):
            from mmreplay.distributed import ReplayShards

            torch.set_num_threads(1)
            self.eps = 0.4 ** (1 + 7 * index / max(1, n_actors - 1))
            self.env = gym.make("CartPole-v1")
            self.obs, _ = self.env.reset(seed=seed)
            self.rng = np.random.default_rng(seed)
            self.q = q_network()
            self.client = ReplayShards.connect(num_shards).client(index, batch_size=64)
            self.ret, self.returns = 0.0, []

        def set_weights(self, state):
            self.q.load_state_dict(state)

        def run(self, steps: int) -> dict:
            for _ in range(steps):
                if self.rng.random() < self.eps:
                    action = int(self.rng.integers(2))
                else:
                    with torch.no_grad():
                        action = int(self.q(torch.as_tensor(self.obs)).argmax())
                nxt, reward, terminated, truncated, _ = self.env.step(action)
                self.client.add(self.obs, action, float(reward), nxt, terminated, truncated)
                self.ret += reward
                self.obs = nxt
                if terminated or truncated:
                    self.returns.append(self.ret)
                    self.ret = 0.0
                    self.obs, _ = self.env.reset()
            returns, self.returns = self.returns, []
            return {"eps": self.eps, "returns": returns, **self.client.stats()}

        def flush(self):
            return self.client.flush()

    return EnvActor


def evaluate(q: nn.Module, episodes: int = 5) -> float:
    env = gym.make("CartPole-v1")
    total = 0.0
    for ep in range(episodes):
        obs, _ = env.reset(seed=1000 + ep)
        done = False
        while not done:
            with torch.no_grad():
                obs, r, term, trunc, _ = env.step(int(q(torch.as_tensor(obs)).argmax()))
            total += r
            done = term or trunc
    return total / episodes


def phase(args, number: int) -> dict:
    import ray
    from mmreplay.distributed import ReplayShards

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=max(4, args.actors + 2), include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    env = gym.make("CartPole-v1")
    shards = ReplayShards.create(args.root, 2, env.observation_space, env.action_space, capacity=100_000,
                                 commit_every=2000, commit_seconds=5.0, actor_options={"num_cpus": 0})
    held = sum(i["size"] for i in shards.info())
    q, target = q_network(), q_network()
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    ckpt = os.path.join(args.root, "learner.pt")
    sampler_state = None
    steps_done = 0
    if os.path.exists(ckpt):  # resume: network, optimiser, learner-side sampler state
        saved = torch.load(ckpt, weights_only=False)
        q.load_state_dict(saved["q"])
        opt.load_state_dict(saved["opt"])
        sampler_state = json.loads(saved["sampler"])
        steps_done = saved["steps"]
    target.load_state_dict(q.state_dict())
    print(f"phase {number}: shards hold {held} transitions at start; greedy return {evaluate(q):.0f}", flush=True)

    cls = make_actor_class(ray)
    actors = [cls.remote(i, args.actors, 2, seed=100 * number + i) for i in range(args.actors)]
    weights = ray.put({k: v.clone() for k, v in q.state_dict().items()})
    ray.get([a.set_weights.remote(weights) for a in actors])
    running = {a.run.remote(100): a for a in actors}
    idle: list = []
    sampler = None
    returns: list[float] = []
    added, learner_steps = 0, 0
    t_end = time.monotonic() + args.seconds
    while time.monotonic() < t_end:
        done = ray.wait(list(running), num_returns=1, timeout=0.0)[0] if running else []
        for ref in done:
            idle.append(running.pop(ref))
            returns += ray.get(ref)["returns"]
            added += 100
        # Ape-X runs actors flat out on their own cores; on a small box they would starve the learner, so
        # they get new work only while they are less than `--ratio` transitions per learner step ahead.
        while idle and added < 2000 + args.ratio * learner_steps:
            actor = idle.pop()
            running[actor.run.remote(100)] = actor
        if sampler is None:
            if sum(i["size"] for i in shards.info()) < 1000:
                time.sleep(0.5)
                continue
            sampler = shards.sampler(64, draw=Prioritized(), local=False, prefetch=2, name="apex")
            if sampler_state is not None:
                sampler.load_state_dict(sampler_state)
        b = sampler.sample()
        with torch.no_grad():
            best = q(b.next_obs).argmax(1, keepdim=True)  # double DQN
            y = b.reward + GAMMA * (~b.terminated).float() * target(b.next_obs).gather(1, best).squeeze(1)
        qa = q(b.obs).gather(1, b.action.long().unsqueeze(1)).squeeze(1)
        td = y - qa
        loss = (b.weights * td.pow(2)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sampler.update_priorities(b, td.detach().abs() + 1e-3)
        steps_done += 1
        learner_steps += 1
        if steps_done % 200 == 0:
            target.load_state_dict(q.state_dict())
            weights = ray.put({k: v.clone() for k, v in q.state_dict().items()})
            for a in actors:
                a.set_weights.remote(weights)
    stats = ray.get([a.flush.remote() for a in actors])  # everything the actors added is committed now
    if sampler is not None:
        sampler_state = sampler.state_dict()
        sampler.close()
    torch.save({"q": q.state_dict(), "opt": opt.state_dict(), "sampler": json.dumps(sampler_state),
                "steps": steps_done}, ckpt)
    info = shards.info()
    shards.close()  # the shards commit and close their stores
    ray.shutdown()
    result = {"phase": number, "learner_steps": steps_done, "stored": sum(i["size"] for i in info),
              "added": sum(s["added"] for s in stats), "dropped": sum(s["dropped"] for s in stats),
              "actor_return_last20": float(np.mean(returns[-20:])) if returns else 0.0, "greedy_return": evaluate(q)}
    print(f"phase {number}: {result}", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Ape-X-style DQN on CartPole over mmreplay.distributed")
    p.add_argument("--actors", type=int, default=3)
    p.add_argument("--seconds", type=float, default=45.0, help="training time per phase")
    p.add_argument("--ratio", type=float, default=16.0, help="env steps per learner step, at most")
    p.add_argument("--root", default="/tmp/apex_cartpole")
    p.add_argument("--keep", action="store_true", help="continue an existing root instead of starting afresh")
    args = p.parse_args(argv)
    if not args.keep:
        shutil.rmtree(args.root, ignore_errors=True)
    first = phase(args, 1)
    second = phase(args, 2)  # stop and resume: same shard directories, saved learner
    assert second["stored"] >= first["stored"], "the second phase must start from the first one's experience"
    return 0


if __name__ == "__main__":
    sys.exit(main())
