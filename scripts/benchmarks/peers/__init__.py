"""Peer replay buffers behind one interface, for mmreplay benchmarks.

    rb = make(kind, capacity, obs_shape, obs_dtype, n_envs, frame_stack)
    rb.add_batch(obs, action, reward, next_obs, terminated, truncated)
    out = rb.sample(batch_size)   # dict of CPU torch tensors

``kind`` is one of ``KINDS``:

``"numpy"``   plain numpy ring in RAM that stores every frame once and rebuilds
              stacks by fancy indexing: the "memcpy limit" a frame-deduplicating
              store can hope for.
``"sb3"``     ``stable_baselines3.common.buffers.ReplayBuffer(
              optimize_memory_usage=True, handle_timeout_termination=False)``
              (stores one full stack per transition; next_obs is the next slot).
``"cpprb"``   ``cpprb.ReplayBuffer(next_of=("obs",), stack_compress="obs")``,
              one buffer per env (its compression assumes consecutive adds come
              from one stream), ``on_episode_end()`` called at episode ends.
``"torchrl"`` ``torchrl.data.TensorDictReplayBuffer(LazyMemmapStorage(scratch
              dir under /tmp), sampler=RandomSampler())``, the usual TorchRL
              layout (obs and ("next","obs") full stacks, no deduplication).

Shapes.  ``obs_shape`` is the shape of ONE frame/observation (``(84, 84)`` for
Atari, ``(4,)`` for CartPole-like low-dim).  With ``frame_stack = S > 1`` the
``obs``/``next_obs`` passed to ``add_batch`` are stacks ``(n_envs, S,
*obs_shape)``, oldest frame first, as ``gymnasium.wrappers.FrameStackObservation``
gives (``next_obs[:, :-1] == obs[:, 1:]``); with ``S == 1`` they are ``(n_envs,
*obs_shape)``.  ``action`` (n_envs,) int64, ``reward`` (n_envs,) float32,
``terminated``/``truncated`` (n_envs,) bool.  On a truncation or termination
``next_obs`` is the real final observation (not the reset one), and the next
``add_batch`` for that env starts a new episode.

``sample(B)`` returns ``{"obs", "next_obs"}`` (B, S, *obs_shape) (or (B,
*obs_shape) when S == 1) contiguous tensors of ``obs_dtype``, ``"action"`` (B,)
int64, ``"reward"`` (B,) float32 and ``"done"`` (B,) float32.  ``done`` is
``terminated`` for every peer except SB3: SB3's memory-optimised buffer cannot
keep a truncated episode's final observation (the next slot is overwritten by
the next episode's first obs), so, as SB3's own algorithms do with
``handle_timeout_termination=False``, it is given ``done = terminated |
truncated`` and returns that.

``capacity`` counts transitions over all envs (each env gets ``capacity //
n_envs``).  ``rb.close()`` frees memory / scratch files.

``make_lowdim(kind, capacity, n_envs)`` is the low-dim variant (obs (4,)
float32, 2 actions, no stacking).

Prioritized (PER, proportional) peers, ``kind`` in ``PER_KINDS``, add the same
way and also have::

    out = rb.sample(batch_size, beta=0.4)  # + "weights" (B,) float32, "indices" (B,) int64
    rb.update_priorities(out["indices"], priorities)  # raw |TD|-like values

``"cpprb_per"``   ``cpprb.PrioritizedReplayBuffer(alpha=0.6)`` (see
                  ``CpprbPERPeer`` for the multi-env Atari case).
``"torchrl_per"`` ``TensorDictReplayBuffer(LazyMemmapStorage, PrioritizedSampler(
                  capacity, alpha=0.6, beta=0.4))``; needs a loadable
                  ``torchrl._torchrl`` (see ``TorchRLPERPeer``).

Both store ``(p + eps) ** alpha`` in sum/min segment trees, give new items the
largest priority seen so far, and return IS weights ``(p_i / p_min) ** -beta``
with ``p_min`` the minimum over the WHOLE stored buffer (so weights are in
(0, 1], 1 only for the globally least likely item, not batch-max normalised).
cpprb samples stratified (B equal slices of the priority mass, one draw each);
TorchRL draws B i.i.d. masses.  ``check_per_peer(rb)`` is a sanity check.

One module per peer (``numpy_ring``, ``sb3_buffer``, ``cpprb_buffer``, ``torchrl_buffer``, ``cpprb_per``,
``torchrl_per``); a new peer is one new module plus an entry in ``BUILDERS``.  Each peer library is
imported only when that peer is built.  ``python scripts/peers.py`` runs a self-test/benchmark table of
the peers (``benchmarks/selftest.py``, see ``--help``).
"""
from __future__ import annotations

import numpy as np
import torch

from .cpprb_buffer import CpprbPeer
from .cpprb_per import CpprbPERPeer
from .numpy_ring import NumpyFrameRing
from .sb3_buffer import SB3Peer
from .torchrl_buffer import TorchRLPeer
from .torchrl_per import TorchRLPERPeer

KINDS = ("numpy", "sb3", "cpprb", "torchrl")
PER_KINDS = ("cpprb_per", "torchrl_per")

#: kind -> builder(capacity, obs_shape, obs_dtype, n_envs, frame_stack, n_actions, seed, scratch_dir)
BUILDERS = {
    "numpy": lambda c, shape, dt, E, S, nA, seed, scratch: NumpyFrameRing(c, shape, dt, E, S, seed=seed),
    "sb3": lambda c, shape, dt, E, S, nA, seed, scratch: SB3Peer(c, shape, dt, E, S, n_actions=nA, seed=seed),
    "cpprb": lambda c, shape, dt, E, S, nA, seed, scratch: CpprbPeer(c, shape, dt, E, S, seed=seed),
    "torchrl": lambda c, shape, dt, E, S, nA, seed, scratch: TorchRLPeer(c, shape, dt, E, S, scratch_dir=scratch,
                                                                         seed=seed),
    "cpprb_per": lambda c, shape, dt, E, S, nA, seed, scratch: CpprbPERPeer(c, shape, dt, E, S, seed=seed),
    "torchrl_per": lambda c, shape, dt, E, S, nA, seed, scratch: TorchRLPERPeer(c, shape, dt, E, S,
                                                                                scratch_dir=scratch, seed=seed),
}


def make(kind, capacity, obs_shape=(84, 84), obs_dtype=np.uint8, n_envs=1,
         frame_stack=4, *, n_actions=6, seed=0, scratch_dir=None):
    """Build a peer replay buffer with the uniform interface (see module doc)."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown peer kind {kind!r}; expected one of "
                         f"{KINDS + PER_KINDS}")
    return BUILDERS[kind](capacity, obs_shape, obs_dtype, n_envs, frame_stack, n_actions, seed, scratch_dir)


def make_lowdim(kind, capacity, n_envs=1, *, seed=0, scratch_dir=None):
    """Low-dim variant: obs (4,) float32, 2 discrete actions, no stacking."""
    return make(kind, capacity, (4,), np.float32, n_envs, 1, n_actions=2,
                seed=seed, scratch_dir=scratch_dir)


def check_peer(rb, frame_stack, batch_size=256):
    """Sampled stacks must overlap: next_obs[:, :-1] == obs[:, 1:].  Returns
    the fraction of sampled transitions where that fails (SB3 is expected to
    fail at episode ends: its next obs slot is overwritten by the reset)."""
    if frame_stack < 2:
        return 0.0
    s = rb.sample(batch_size)
    ok = (s["next_obs"][:, :-1] == s["obs"][:, 1:]).flatten(1).all(1)
    return 1.0 - ok.float().mean().item()



def check_per_peer(rb, batch_size=256, beta=0.4, n_draws=4):
    """Sanity check of a PER peer (``kind`` in ``PER_KINDS``).  Returns a dict
    of checks (``"ok"`` = all passed):

    ``weights_ok``  sampled IS weights finite and in (0, 1];
    ``indices_ok``  indices int64 in [0, rb.n_slots), one per sampled row;
    ``update_ok``   after raising ONE sampled index's priority so that its
                    ``p ** alpha`` is ~3x the rest of the buffer's mass, it makes
                    up > 50% of the next samples and has the smallest weight.

    Destructive: leaves that large priority (and the libraries' running max
    priority, given to new items) behind, so call it last."""
    s = rb.sample(batch_size, beta)
    w, idx = s["weights"], s["indices"]
    res = {"weights_ok": bool(torch.isfinite(w).all() and (w > 0).all()
                              and (w <= 1 + 1e-6).all()),
           "indices_ok": bool(idx.dtype == torch.int64 and idx.numel() == batch_size
                              and (idx >= 0).all() and (idx < rb.n_slots).all()
                              and w.numel() == batch_size)}
    target = int(idx[0])
    alpha = getattr(rb, "alpha", 0.6)
    big = (3.0 * max(len(rb), 1)) ** (1.0 / alpha) * float(w.min()) ** (-1.0 / beta)
    rb.update_priorities(torch.tensor([target]), torch.tensor([big]))
    hits, lowest = 0, True
    for _ in range(n_draws):
        t = rb.sample(batch_size, beta)
        m = t["indices"] == target
        hits += int(m.sum())
        if m.any() and (~m).any():
            lowest &= bool(t["weights"][m].max() <= t["weights"][~m].min())
    res["hit_frac"] = hits / (n_draws * batch_size)
    res["update_ok"] = res["hit_frac"] > 0.5 and lowest
    res["ok"] = res["weights_ok"] and res["indices_ok"] and res["update_ok"]
    return res
