"""The Atari variant of the demo: the memory story.

    python examples/demo_atari.py [--out DIR] [--steps 10000]   (needs the 'atari' extra: ale-py, opencv)
    python examples/demo.py --atari [--steps 10000]             (the same)

Records random play of Pong (84x84 grayscale, AtariPreprocessing) into a store with ``frame_stack=4``,
trains a small CNN Q-network on batches sampled from the store for a while, closes it, reopens it in a
new process and trains on, then reports what the same buffer costs in SB3's RAM layout and what it costs
here: bytes on disk, index RAM, and the frame cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
from torch import nn

import mmreplay

STACK = 4


def make_env():
    try:
        import ale_py
        import gymnasium as gym
    except ImportError as exc:
        raise SystemExit(f"the Atari demo needs ale-py and opencv: pip install 'mmreplay[atari]' ({exc})")
    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1)
    return gym.wrappers.AtariPreprocessing(env, screen_size=84, grayscale_obs=True, frame_skip=4)


def q_network(n_actions: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(STACK, 16, 8, 4), nn.ReLU(), nn.Conv2d(16, 32, 4, 2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 9 * 9, 256), nn.ReLU(), nn.Linear(256, n_actions))


def record_and_train(path: str, steps: int, updates: int, create: bool, seed: int) -> dict:
    env = make_env()
    if create:
        store = mmreplay.Store.create(path, env.observation_space, env.action_space, capacity=1_000_000,
                                      frame_stack=STACK, reward_values=(-1, 0, 1))
    else:
        store = mmreplay.Store.open(path)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    obs, _ = env.reset(seed=seed)
    for _ in range(steps):
        action = int(rng.integers(env.action_space.n))
        nxt, reward, term, trunc, _ = env.step(action)
        store.add(obs, action, float(np.sign(reward)), nxt, term, trunc)
        obs = nxt if not (term or trunc) else env.reset()[0]
    record_s = time.perf_counter() - t0
    net, target = q_network(env.action_space.n), q_network(env.action_space.n)
    target.load_state_dict(net.state_dict())
    optim = torch.optim.Adam(net.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    with store.sampler(32, seed=None if not create else seed) as sampler:
        for _ in range(updates):
            b = next(sampler)
            with torch.no_grad():
                y = b.reward + 0.99 * (~b.terminated) * target(b.next_obs.float() / 255).max(1).values
            loss = nn.functional.smooth_l1_loss(net(b.obs.float() / 255).gather(1, b.action[:, None])[:, 0], y)
            optim.zero_grad()
            loss.backward()
            optim.step()
    train_s = time.perf_counter() - t0
    info = store.info()
    store.close()
    return {"record_s": record_s, "train_s": train_s, "updates": updates, "info": info}


def main(out: str, steps: int, updates: int = 300) -> int:
    os.makedirs(out, exist_ok=True)
    results = []
    for phase, create in ((1, True), (2, False)):
        cmd = [sys.executable, os.path.abspath(__file__), "--out", out, "--steps", str(steps), "--updates",
               str(updates), "--phase", str(phase)]
        print(f"[atari phase {phase}] {'recording' if create else 'reopened the store in a new process; recording'}"
              f" {steps:,} steps of Pong, then {updates} CNN updates from the store ...")
        out_text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out_text.strip().splitlines()[-1]))
    info = results[-1]["info"]
    n = info["transitions"]
    sb3_optimized = n * STACK * 84 * 84  # SB3 optimize_memory_usage: one stacked obs per transition
    sb3_plain = 2 * sb3_optimized
    per_million = 1_000_000 / max(1, n)
    print("\n== mmreplay Atari demo: the memory story ==")
    for i, r in enumerate(results, 1):
        print(f"phase {i}: recorded at {steps / r['record_s']:,.0f} env steps/s (ALE-bound), "
              f"{r['updates']} updates in {r['train_s']:.1f}s")
    print(f"transitions kept: {n:,} (frame_stack {STACK}: each 84x84 frame stored once)")
    print(f"  SB3 ReplayBuffer would hold them in {sb3_plain / 1e9:.2f} GB of RAM "
          f"({sb3_optimized / 1e9:.2f} GB with optimize_memory_usage)")
    print(f"  mmreplay: {info['disk_bytes'] / 1e6:.1f} MB on disk ({info['bytes_per_transition']:.0f} bytes per "
          f"transition), index {info['index_ram_bytes_per_transition'] * n / 1e6:.2f} MB of RAM + the frame cache "
          "you allow (cache_bytes, default 512 MiB)")
    print(f"  at 1M transitions: SB3 {sb3_optimized * per_million / 1e9:.0f}-{sb3_plain * per_million / 1e9:.0f} GB "
          f"of RAM; mmreplay ~{info['disk_bytes'] * per_million / 1e9:.2f} GB on disk and "
          f"{info['index_ram_bytes_per_transition']:.0f} MB of index")
    return 0


def cli(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python examples/demo_atari.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("demo_out", "atari"), help="directory for the store")
    parser.add_argument("--steps", type=int, default=10_000, help="env steps recorded in each phase")
    parser.add_argument("--updates", type=int, default=300, help="CNN updates from the store in each phase")
    parser.add_argument("--phase", type=int, choices=(1, 2), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:  # one phase in this (fresh) process: phase 1 creates the store, phase 2 reopens it
        result = record_and_train(os.path.join(args.out, "pong_store"), args.steps, args.updates,
                                  create=args.phase == 1, seed=args.phase)
        print(json.dumps(result))
        return 0
    return main(args.out, args.steps, args.updates)


if __name__ == "__main__":
    sys.exit(cli())
