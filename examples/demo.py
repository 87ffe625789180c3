"""The main job: train a DQN on CartPole while recording into an on-disk store, stop, resume in a new
process from the persisted experience, and report.

    python examples/demo.py [--out DIR] [--steps N] [--resume-steps N] [--atari [--updates N]]

(from the root of a clone, after ``pip install -e ".[demo]"``; ``mmreplay demo`` runs this file too).

Phase 1 trains for ``--steps`` env steps, recording every transition, then exits (weights saved as
``.npz``, no pickle). Phase 2 runs in a *fresh process*: it reopens the store — same transitions,
episodes, cursor and sampler RNG state — and keeps training on that experience plus new steps. The
report prints episodes, returns, store size and bytes per transition, and a PNG plot is written when
matplotlib is installed. ``--atari`` runs the Atari variant, ``examples/demo_atari.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn

import mmreplay

GAMMA = 0.99
BATCH = 64
LEARNING_STARTS = 1_000
TARGET_EVERY = 500


def q_network(obs_dim: int, n_actions: int) -> nn.Module:
    return nn.Sequential(nn.Linear(obs_dim, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, n_actions))


def save_weights(net: nn.Module, path: str) -> None:
    np.savez(path, **{k: v.detach().cpu().numpy() for k, v in net.state_dict().items()})


def load_weights(net: nn.Module, path: str) -> None:
    with np.load(path, allow_pickle=False) as data:
        net.load_state_dict({k: torch.from_numpy(data[k]) for k in data.files})


def epsilon(step: int) -> float:
    return max(0.05, 1.0 - step / 10_000)


def train(store: mmreplay.Store, env: gym.Env, steps: int, start_step: int, weights: str | None,
          seed: int) -> dict:
    """Epsilon-greedy DQN that records every transition into ``store`` and learns from its samples."""
    torch.manual_seed(seed)
    n_actions = env.action_space.n
    online = q_network(env.observation_space.shape[0], n_actions)
    if weights:
        load_weights(online, weights)
    target = q_network(env.observation_space.shape[0], n_actions)
    target.load_state_dict(online.state_dict())
    optim = torch.optim.Adam(online.parameters(), lr=5e-4)
    sampler = store.sampler(BATCH, seed=seed if start_step == 0 else None)  # resumes its RNG on reopen
    rng = np.random.default_rng(seed + start_step)
    obs, _ = env.reset(seed=seed + start_step)
    returns, episode_return = [], 0.0
    for step in range(start_step, start_step + steps):
        if rng.random() < epsilon(step):
            action = int(rng.integers(n_actions))
        else:
            with torch.no_grad():
                action = int(online(torch.as_tensor(obs)[None]).argmax())
        next_obs, reward, terminated, truncated, _ = env.step(action)
        store.add(obs, action, float(reward), next_obs, terminated, truncated)
        episode_return += reward
        obs = next_obs
        if terminated or truncated:
            returns.append(episode_return)
            episode_return = 0.0
            obs, _ = env.reset()
        if len(store) >= LEARNING_STARTS:
            batch = next(sampler)
            with torch.no_grad():  # bootstrap through truncations, not through terminations
                best_next = target(batch.next_obs).max(dim=1).values
                y = batch.reward + GAMMA * (~batch.terminated) * best_next
            q = online(batch.obs).gather(1, batch.action[:, None]).squeeze(1)
            loss = nn.functional.smooth_l1_loss(q, y)
            optim.zero_grad()
            loss.backward()
            optim.step()
        if step % TARGET_EVERY == 0:
            target.load_state_dict(online.state_dict())
    sampler.close()
    return {"returns": returns, "online": online}


def phase(args) -> None:
    """One training phase in this process (phase 1 creates the store, phase 2 reopens it)."""
    env = gym.make("CartPole-v1")
    store_path = os.path.join(args.out, "store")
    weights = os.path.join(args.out, "q_weights.npz")
    if args.phase == 1:
        store = mmreplay.Store.create(store_path, env.observation_space, env.action_space, capacity=args.capacity,
                                      reward_values=(0.0, 1.0))
        start, steps, load = 0, args.steps, None
    else:
        store = mmreplay.Store.open(store_path)
        print(f"[phase 2] reopened {store_path}: {len(store):,} transitions, "
              f"{store.num_added:,} added so far, resuming at step {store.num_added:,}")
        start, steps, load = store.num_added, args.resume_steps, weights
    t0 = time.perf_counter()
    result = train(store, env, steps, start, load, seed=args.seed)
    save_weights(result["online"], weights)
    store.close()
    with open(os.path.join(args.out, f"phase{args.phase}.json"), "w") as f:
        json.dump({"returns": result["returns"], "seconds": time.perf_counter() - t0, "steps": steps}, f)


def report(out: str) -> dict:
    phases = [json.load(open(os.path.join(out, f"phase{i}.json"))) for i in (1, 2)]
    store_path = os.path.join(out, "store")
    disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(store_path) for f in fs)
    with mmreplay.Store.open(store_path, mode="r") as store:
        n, added = len(store), store.num_added
    raw = added * (2 * 4 * 4 + 8 + 4 + 2)  # what a plain float32 obs/next_obs/int64 action/... buffer holds
    print("\n== mmreplay demo report ==")
    for i, p in enumerate(phases, 1):
        r = p["returns"]
        last = np.mean(r[-10:]) if r else float("nan")
        print(f"phase {i}: {p['steps']:,} steps in {p['seconds']:.1f}s, {len(r)} episodes, "
              f"mean return of last 10 episodes {last:.1f}")
    print(f"store: {store_path}\n  {n:,} transitions valid, {added:,} added; {disk / 1e6:.2f} MB on disk, "
          f"{disk / max(1, added):.1f} bytes per transition (a raw in-RAM buffer: ~{raw / max(1, added):.0f})")
    plot_path = plot_returns(phases, out)
    if plot_path:
        print(f"plot: {plot_path}")
    return {"transitions": n, "disk_bytes": disk, "phases": phases}


def plot_returns(phases: list[dict], out: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: skipped (pip install matplotlib, or the 'demo' extra, to get one)")
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    first = phases[0]["returns"]
    ax.plot(range(len(first)), first, label="phase 1 (fresh store)")
    second = phases[1]["returns"]
    ax.plot(range(len(first), len(first) + len(second)), second, label="phase 2 (reopened store, new process)")
    ax.axvline(len(first) - 0.5, color="gray", linestyle="--")
    ax.set_xlabel("episode")
    ax.set_ylabel("return")
    ax.set_title("DQN on CartPole-v1, replay on disk with mmreplay")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "returns.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python examples/demo.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_out", help="directory for the store, weights and report")
    parser.add_argument("--steps", type=int, default=15_000, help="env steps in phase 1")
    parser.add_argument("--resume-steps", type=int, default=15_000, help="env steps in phase 2 (new process)")
    parser.add_argument("--capacity", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--atari", action="store_true",
                        help="the Atari variant (needs ale-py): the memory story of a frame-stacked Pong buffer")
    parser.add_argument("--updates", type=int, default=300,
                        help="with --atari: CNN updates from the store in each phase")
    parser.add_argument("--phase", type=int, choices=(1, 2), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.atari:
        import demo_atari  # beside this file (the script's folder is on sys.path)

        steps = args.steps if "--steps" in (argv if argv is not None else sys.argv) else 10_000
        return demo_atari.main(os.path.join(args.out, "atari"), steps, args.updates)
    if args.phase:
        phase(args)
        return 0
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    base = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--steps", str(args.steps),
            "--resume-steps", str(args.resume_steps), "--capacity", str(args.capacity), "--seed", str(args.seed)]
    print(f"[phase 1] training {args.steps:,} steps, recording into {args.out}/store ...")
    subprocess.run(base + ["--phase", "1"], check=True)
    print("[phase 1] process exited; starting a new process to resume from the store on disk")
    subprocess.run(base + ["--phase", "2"], check=True)
    report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
