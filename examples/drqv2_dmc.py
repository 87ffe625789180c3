"""A DrQ-v2-style agent on a DeepMind Control task from pixels, its replay on disk in an mmreplay store.

    MUJOCO_GL=egl python examples/drqv2_dmc.py --steps 2000 --dir /tmp/drqv2     # a short CPU run
    MUJOCO_GL=egl python examples/drqv2_dmc.py --steps 4000 --dir /tmp/drqv2 --resume  # goes on from there

Measured with the defaults (walker-walk, 2,000 steps, 50 updates of batch 256) on a 2-core box shared with
other work: 204 s of CPU time (13 min of wall time at a load of 11; a minute or two on an idle 2-core
machine). Most of it is rendering: dm_control through a software EGL (Mesa llvmpipe) costs ~45 ms of CPU
per 84x84 frame, a GPU's EGL about 1 ms. ``--steps 500 --seed-steps 250`` checks the whole path (seed
steps, updates from the store, checkpoints) in a fraction of that (with the default ``--seed-steps 1000``,
500 steps are all random: no update runs); the tests run it with 60 steps and a fake renderer.

What it is (Yarats et al. 2021, "Mastering Visual Continuous Control", reduced to one file):
- observations: 84x84 RGB renders (camera 0), action repeat 2, the 3 newest frames concatenated on the
  channel axis, ``(9, 84, 84)``. The store keeps one ``(3, 84, 84)`` frame per step (``frame_stack=3``)
  and rebuilds stacks at sample time as ``(B, 3, 3, 84, 84)``; ``flatten(1, 2)`` is DrQ-v2's ``(B, 9, 84,
  84)`` (a view, no copy). Episode starts repeat the first frame, as DrQ-v2's frame stack does.
- replay: ``Store.create(capacity=1_000_000, frame_codec="delta-zstd")``; batches of 256 of 3-step returns
  (``store.sampler(256, NStep(3, 0.99))``: ``reward`` is the discounted 3-step sum, ``discount`` is
  ``gamma ** m``, ``next_obs`` the stack 3 steps on; DMC's time limit is a truncation, so it bootstraps).
- agent: random-shift augmentation (pad 4, bilinear shift, DrQ-v2's ``RandomShiftsAug``) of both
  stacks, a CNN encoder shared by actor and twin critics and trained by the critic loss only, a
  deterministic tanh actor with clipped Gaussian exploration noise (DDPG-style, std annealed
  ``--std-from`` -> ``--std-to``), soft target critics (tau 0.01), an update every ``--update-every``
  steps after ``--seed-steps`` random ones.
- checkpoint: every ``--checkpoint-every`` steps and at the end, the store is committed, then the networks,
  optimizers, step and the store's ``num_added`` replace ``DIR/agent.pt`` atomically (written beside it,
  fsynced, renamed): a kill at any moment leaves the previous checkpoint or the new one, and the store
  holds at least what the checkpoint counts. ``--resume`` reopens the store, rolls it back to the
  checkpoint's ``num_added`` (``Store.rollback``: transitions collected after the checkpoint, by a run that
  was killed, are dropped, so the replay matches the agent exactly) and trains on to ``--steps``. A first
  run killed before its first checkpoint left a store with no agent to go with it: a rerun (with or
  without ``--resume``) starts that run over.

The defaults are sized for a short run on a CPU (a 2-layer 16-channel encoder, an update every 20 steps,
``walker-walk``), not for learning. DrQ-v2's own settings are ``--encoder full`` (4 conv layers of 32
channels, 35x35 features), ``--update-every 2``, ``--seed-steps 2000`` (4000 frames), std 1.0 -> 0.1 over
250k steps, learning rate 1e-4 (8e-5 for humanoid), and 1M-3M frames.

What a full run needs (walker-walk, 1M frames = 500k agent steps at action repeat 2):
- frames: 500k transitions, each storing one new 84x84x3 frame (~21 KB raw): ~10.6 GB raw.
- disk: with ``delta-zstd`` the renders of DMC compress to ~4-5 KB per frame (4.6 KB measured here on
  walker-walk over 2,004 frames; the run prints ``disk per frame``), so ~2.3 GB for 500k frames and
  ~4.6 GB for the full 1M capacity.
- RAM: the index and small columns stay in RAM, ~40 bytes per transition (frame pointers, episode links,
  a 6-float action, the reward): ~40 MB for 1M, plus the decoded-frame cache (``cache_bytes``, default a
  share of RAM); DrQ-v2's own in-RAM buffer of 1M raw frames would need ~21 GB. The short CPU run peaks
  at 1.1 GB resident (torch, dm_control, the renderer and the store together).
- time: 250k gradient updates of batch 256 with the full encoder; on one GPU the update dominates (DrQ-v2
  reports hours, not days, for 1M frames); sampling 256 stacks of 3 frames from the store is far below an
  update's cost. On a CPU the full encoder takes seconds per update: use a GPU (``--device cuda``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import numpy as np
import torch
import torch.nn.functional as F
from gymnasium import spaces
from torch import nn

import mmreplay

FRAME_STACK, N_STEP, GAMMA, TAU = 3, 3, 0.99, 0.01


# -- environment --------------------------------------------------------------------------------------
class PixelDMC:
    """A dm_control task seen as ``(3, 84, 84)`` uint8 renders, each action repeated ``repeat`` times."""

    def __init__(self, domain: str, task: str, seed: int, repeat: int = 2, size: int = 84):
        from dm_control import suite

        self.env = suite.load(domain, task, task_kwargs={"random": seed})
        self.repeat, self.size = repeat, size
        spec = self.env.action_spec()
        self.action_dim = int(spec.shape[0])
        self.camera = 2 if domain == "quadruped" else 0

    def render(self) -> np.ndarray:
        return self.env.physics.render(self.size, self.size, camera_id=self.camera).transpose(2, 0, 1).copy()

    def reset(self) -> np.ndarray:
        self.env.reset()
        return self.render()

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool]:
        """``(frame, reward, terminated, truncated)``: DMC ends episodes by its time limit (a truncation;
        a discount of 0 would be a termination)."""
        reward, terminated, truncated = 0.0, False, False
        for _ in range(self.repeat):
            ts = self.env.step(action)
            reward += ts.reward or 0.0
            if ts.last():
                terminated, truncated = ts.discount == 0, ts.discount != 0
                break
        return self.render(), reward, terminated, truncated


# -- agent --------------------------------------------------------------------------------------------
class RandomShiftsAug(nn.Module):
    """DrQ-v2's augmentation: pad by ``pad`` (edge pixels repeated) and crop back at a random integer offset
    in ``[-pad, pad]`` per image. DrQ-v2 does it with a bilinear ``grid_sample`` whose grid falls exactly
    on pixels, so an integer crop is the same images; done here on the uint8 stacks, before the float
    conversion, it costs a gather instead of 16M bilinear samples per batch."""

    def __init__(self, pad: int = 4):
        super().__init__()
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        shift = torch.randint(-self.pad, self.pad + 1, (n, 2), device=x.device)
        rows = (torch.arange(h, device=x.device) + shift[:, :1]).clamp(0, h - 1)  # (n, h): edge repeated
        cols = (torch.arange(w, device=x.device) + shift[:, 1:]).clamp(0, w - 1)
        picked = x[torch.arange(n, device=x.device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
        return picked.permute(0, 3, 1, 2)  # advanced indices first: (n, h, w, c) -> (n, c, h, w)


def encoder(kind: str) -> tuple[nn.Module, int]:
    """The conv encoder of ``(9, 84, 84)`` stacks scaled to [-0.5, 0.5], and its output size."""
    if kind == "full":  # DrQ-v2's: 4 layers of 32 channels, the first with stride 2 -> 32 x 35 x 35
        convs = [nn.Conv2d(9, 32, 3, stride=2), nn.ReLU()] + [m for _ in range(3)
                                                              for m in (nn.Conv2d(32, 32, 3, stride=1), nn.ReLU())]
        return nn.Sequential(*convs, nn.Flatten()), 32 * 35 * 35
    return nn.Sequential(nn.Conv2d(9, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2), nn.ReLU(),
                         nn.Flatten()), 16 * 20 * 20


class Actor(nn.Module):
    def __init__(self, repr_dim: int, action_dim: int, feature_dim: int, hidden: int):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(repr_dim, feature_dim), nn.LayerNorm(feature_dim), nn.Tanh())
        self.policy = nn.Sequential(nn.Linear(feature_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                    nn.Linear(hidden, action_dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.policy(self.trunk(h)))


class Critic(nn.Module):
    def __init__(self, repr_dim: int, action_dim: int, feature_dim: int, hidden: int):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(repr_dim, feature_dim), nn.LayerNorm(feature_dim), nn.Tanh())
        self.qs = nn.ModuleList(nn.Sequential(nn.Linear(feature_dim + action_dim, hidden), nn.ReLU(),
                                              nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
                                for _ in range(2))

    def forward(self, h: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.trunk(h), a], dim=-1)
        return self.qs[0](x), self.qs[1](x)


class DrQV2:
    def __init__(self, action_dim: int, args, device: torch.device):
        self.device, self.action_dim = device, action_dim
        self.encoder, repr_dim = encoder(args.encoder)
        self.encoder.to(device)
        dims = (repr_dim, action_dim, args.feature_dim, args.hidden)
        self.actor, self.critic, self.critic_target = Actor(*dims).to(device), Critic(*dims).to(device), \
            Critic(*dims).to(device)
        self.critic_target.load_state_dict(self.critic.state_dict())
        self.opt = {"encoder": torch.optim.Adam(self.encoder.parameters(), lr=args.lr),
                    "actor": torch.optim.Adam(self.actor.parameters(), lr=args.lr),
                    "critic": torch.optim.Adam(self.critic.parameters(), lr=args.lr)}
        self.aug = RandomShiftsAug(4)

    def encode(self, stacks: torch.Tensor) -> torch.Tensor:
        """``(B, 9, 84, 84)`` stacks of 0-255 values -> features."""
        return self.encoder(stacks.float() / 255.0 - 0.5)

    @torch.no_grad()
    def act(self, stack: np.ndarray, std: float, rng: np.random.Generator, explore: bool) -> np.ndarray:
        mu = self.actor(self.encode(torch.as_tensor(stack, device=self.device)[None]))[0].cpu().numpy()
        if explore:
            mu = mu + np.clip(rng.normal(0.0, std, mu.shape), -0.3, 0.3)
        return np.clip(mu, -1.0, 1.0).astype(np.float32)

    def update(self, batch, std: float) -> dict[str, float]:
        b = batch  # already on self.device (the sampler copies it there)
        obs = self.aug(b.obs.flatten(1, 2))  # (B, 3, 3, 84, 84) -> DrQ-v2's (B, 9, 84, 84), shifted
        next_obs = self.aug(b.next_obs.flatten(1, 2))
        h = self.encode(obs)
        with torch.no_grad():
            h_next = self.encode(next_obs)
            mu = self.actor(h_next)
            noise = (torch.randn_like(mu) * std).clamp(-0.3, 0.3)
            q1, q2 = self.critic_target(h_next, (mu + noise).clamp(-1.0, 1.0))
            alive = 1.0 - b.terminated.float()  # DMC: time limits only, so every window bootstraps
            target = b.reward[:, None] + (b.discount * alive)[:, None] * torch.min(q1, q2)
        q1, q2 = self.critic(h, b.action)
        critic_loss = F.mse_loss(q1, target) + F.mse_loss(q2, target)
        self.opt["encoder"].zero_grad(set_to_none=True)
        self.opt["critic"].zero_grad(set_to_none=True)
        critic_loss.backward()
        self.opt["critic"].step()
        self.opt["encoder"].step()
        h = h.detach()  # the actor does not train the encoder (DrQ-v2)
        mu = self.actor(h)
        mu = (mu + (torch.randn_like(mu) * std).clamp(-0.3, 0.3)).clamp(-1.0, 1.0)
        actor_loss = -torch.min(*self.critic(h, mu)).mean()
        self.opt["actor"].zero_grad(set_to_none=True)
        actor_loss.backward()
        self.opt["actor"].step()
        with torch.no_grad():
            for p, t in zip(self.critic.parameters(), self.critic_target.parameters()):
                t.lerp_(p, TAU)
        return {"critic_loss": critic_loss.item(), "actor_loss": actor_loss.item(), "q": q1.mean().item()}

    def state_dict(self) -> dict:
        return {"encoder": self.encoder.state_dict(), "actor": self.actor.state_dict(),
                "critic": self.critic.state_dict(), "critic_target": self.critic_target.state_dict(),
                **{f"opt_{k}": o.state_dict() for k, o in self.opt.items()}}

    def load_state_dict(self, state: dict) -> None:
        for name in ("encoder", "actor", "critic", "critic_target"):
            getattr(self, name).load_state_dict(state[name])
        for k, o in self.opt.items():
            o.load_state_dict(state[f"opt_{k}"])


# -- the run ------------------------------------------------------------------------------------------
def open_store(args, env: PixelDMC, checkpoint: dict | None) -> mmreplay.Store:
    path = os.path.join(args.dir, "replay.mmr")
    if checkpoint is None:
        if os.path.exists(path):  # a first run killed before its first checkpoint: nothing to go on with
            print(f"{path} holds a run killed before its first checkpoint: starting it over")
            shutil.rmtree(path)
        obs_space = spaces.Box(0, 255, (3, args.size, args.size), np.uint8)
        act_space = spaces.Box(-1.0, 1.0, (env.action_dim,), np.float32)
        return mmreplay.Store.create(path, obs_space, act_space, capacity=args.capacity, frame_stack=FRAME_STACK,
                                     frame_codec="delta-zstd")
    store = mmreplay.Store.open(path)
    dropped = store.rollback(checkpoint["num_added"])  # a killed run may have added more since
    if dropped:
        print(f"rolled the store back by {dropped} transitions to the checkpoint's {checkpoint['num_added']}")
    return store


def previous_checkpoint(args) -> dict | None:
    """The checkpoint to go on from (``--resume``), or None for a new run. A directory holding a checkpoint
    is never started over without ``--resume``; one holding only a store (a first run killed before its
    first checkpoint) is, with or without it."""
    ckpt_path = os.path.join(args.dir, "agent.pt")
    if not os.path.exists(ckpt_path):
        if args.resume:
            print(f"no checkpoint in {args.dir} yet: starting a new run")
        return None
    if not args.resume:
        raise SystemExit(f"{args.dir} holds a run checkpointed in {ckpt_path}: pass --resume to go on with it, or "
                         "another --dir")
    return torch.load(ckpt_path, weights_only=True)


def save_checkpoint(ckpt_path: str, agent: DrQV2, step: int, store: mmreplay.Store) -> None:
    """Commit the store first, then replace ``ckpt_path`` atomically: a checkpoint never counts transitions
    that a crash could lose, and a kill mid-write leaves the previous checkpoint whole."""
    store.flush(app_meta={"step": step})
    tmp = ckpt_path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save({"agent": agent.state_dict(), "step": step, "num_added": store.num_added}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_path)
    fd = os.open(os.path.dirname(os.path.abspath(ckpt_path)), os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power cut
    finally:
        os.close(fd)


def schedule(step: int, args) -> float:
    frac = min(1.0, step / max(1, args.std_steps))
    return args.std_from + frac * (args.std_to - args.std_from)


def run(args) -> dict:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    os.makedirs(args.dir, exist_ok=True)
    ckpt_path = os.path.join(args.dir, "agent.pt")
    checkpoint = previous_checkpoint(args)
    env = PixelDMC(args.domain, args.task, args.seed + (checkpoint or {}).get("step", 0), args.repeat, args.size)
    agent = DrQV2(env.action_dim, args, device)
    step = 0
    rng = np.random.default_rng(args.seed)
    if checkpoint is not None:
        agent.load_state_dict(checkpoint["agent"])
        step = checkpoint["step"]
        rng = np.random.default_rng([args.seed, step])
    store = open_store(args, env, checkpoint)
    sampler = None
    frame = env.reset()
    stack = [frame] * FRAME_STACK  # what the policy sees: DrQ-v2 repeats the first frame
    episode_return, returns, losses, t0 = 0.0, [], {}, time.monotonic()
    while step < args.steps:
        std = schedule(step, args)
        if step < args.seed_steps:
            action = rng.uniform(-1.0, 1.0, env.action_dim).astype(np.float32)
        else:
            action = agent.act(np.concatenate(stack), std, rng, explore=True)
        next_frame, reward, terminated, truncated = env.step(action)
        store.add(frame, action, reward, next_frame, terminated, truncated)
        episode_return += reward
        step += 1
        frame, stack = next_frame, stack[1:] + [next_frame]
        if terminated or truncated:
            returns.append(episode_return)
            print(f"step {step}: episode return {episode_return:.1f}")
            frame, episode_return = env.reset(), 0.0
            stack = [frame] * FRAME_STACK
        if step >= args.seed_steps and step % args.update_every == 0 and len(store) >= args.batch:
            sampler = sampler or store.sampler(args.batch, mmreplay.NStep(N_STEP, GAMMA), device=device,
                                              seed=args.seed + step)
            losses = agent.update(next(sampler), std)
        if step % args.checkpoint_every == 0:
            save_checkpoint(ckpt_path, agent, step, store)
        if step % 500 == 0:
            print(f"step {step}: {step / (time.monotonic() - t0):.0f} steps/s (this session) "
                  + " ".join(f"{k} {v:.3f}" for k, v in losses.items()))
    if sampler is not None:
        sampler.close()
    save_checkpoint(ckpt_path, agent, step, store)
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(store.path, "frames"))
               for f in files)
    result = {"step": step, "num_added": store.num_added, "len": len(store), "num_frames": store.inspect.num_frames,
              "disk_per_frame": disk / max(1, store.inspect.num_frames), "returns": returns, "losses": losses,
              "seconds": time.monotonic() - t0}
    print(f"done: {step} steps, store {store.num_added} transitions, {store.inspect.num_frames} frames, disk per frame "
          f"{result['disk_per_frame'] / 1024:.1f} KB, {result['seconds']:.0f} s")
    store.close()
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="runs/drqv2", help="run directory: replay.mmr and agent.pt")
    p.add_argument("--resume", action="store_true", help="go on from DIR's checkpoint (the store is rolled back "
                   "to it)")
    p.add_argument("--domain", default="walker")
    p.add_argument("--task", default="walk")
    p.add_argument("--steps", type=int, default=2000, help="agent steps in all (frames = steps * repeat)")
    p.add_argument("--seed-steps", type=int, default=1000, help="random steps before the first update")
    p.add_argument("--update-every", type=int, default=20, help="DrQ-v2: 2")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (agent.pt)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--encoder", choices=("small", "full"), default="small", help="DrQ-v2: full")
    p.add_argument("--feature-dim", type=int, default=50)
    p.add_argument("--hidden", type=int, default=256, help="DrQ-v2: 1024")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--std-from", type=float, default=1.0)
    p.add_argument("--std-to", type=float, default=0.1)
    p.add_argument("--std-steps", type=int, default=250_000)
    p.add_argument("--repeat", type=int, default=2, help="action repeat")
    p.add_argument("--size", type=int, default=84, help="render size (the encoders expect 84)")
    p.add_argument("--capacity", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("MUJOCO_GL", "egl")
    run(parse_args())
