"""n-step returns, computed at sample time from the index ring (nothing extra is stored).

Invariant: for a sampled transition ``t`` the result covers the ``m <= n`` transitions ``t, t+1, ...,
t+m-1`` of the same episode (same stream), where ``m < n`` only when the episode ends within the window
(``terminated`` or ``truncated``) or the next transition of the episode has not been added yet:
- ``reward`` = sum over ``j < m`` of ``gamma**j * r[t+j]`` (accumulated in float64);
- ``last`` = ``t+m-1``, whose next observation (stack) is the bootstrap observation;
- ``terminated`` / ``truncated`` are those of ``last``: a target is
  ``reward + discount * (1 - terminated) * V(next_obs)``, so truncation still bootstraps, from the
  final observation the store keeps for a truncated episode;
- ``discount`` = ``gamma**m``.

Episode links in the ring point backwards (``prev_delta``); the successor of ``t`` is the transition
``h > t`` with ``h - prev_delta[h] == t``. With vector envs it usually sits at the same distance as
``t``'s own predecessor, so that guess is checked first and a bounded scan (``max_prev_delta``) finds the
rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmreplay.index.ring import TransitionRing


@dataclass
class NStepResult:
    """The n-step windows of sampled transitions (see the module invariant)."""

    last: np.ndarray  # int64 global id of the last transition in each window
    reward: np.ndarray  # float64 discounted sum
    terminated: np.ndarray  # bool
    truncated: np.ndarray  # bool
    discount: np.ndarray  # float64 gamma ** m


def check_nstep(n_step, gamma, name: str = "n_step") -> tuple[int, float]:
    """``(n_step, gamma)`` checked; ``name`` is what the caller's users call n (SB3 says ``n_steps``)."""
    if isinstance(n_step, bool) or not isinstance(n_step, (int, np.integer)) or n_step < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {n_step!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")
    return int(n_step), float(gamma)


def nstep_returns(ring: "TransitionRing", decode_reward, g: np.ndarray, n: int, gamma: float) -> NStepResult:
    """n-step windows of transitions ``g`` (valid global ids); ``decode_reward(codes)`` maps stored reward
    codes to values."""
    last = g.astype(np.int64, copy=True)
    reward = decode_reward(ring.read("reward", last)).astype(np.float64).reshape(g.size)
    terminated = ring.read("terminated", last).astype(bool)
    truncated = ring.read("truncated", last).astype(bool)
    steps = np.ones(g.size, dtype=np.int64)
    active = ~(terminated | truncated)
    for j in range(1, n):
        rows = np.flatnonzero(active)
        if rows.size == 0:
            break
        succ = successors(ring, last[rows])
        found = succ >= 0
        active[rows[~found]] = False
        rows, succ = rows[found], succ[found]
        if rows.size == 0:
            break
        last[rows] = succ
        reward[rows] += gamma ** j * decode_reward(ring.read("reward", succ)).astype(np.float64).reshape(succ.size)
        terminated[rows] = ring.read("terminated", succ).astype(bool)
        truncated[rows] = ring.read("truncated", succ).astype(bool)
        steps[rows] += 1
        active[rows] = ~(terminated[rows] | truncated[rows])
    return NStepResult(last, reward, terminated, truncated, gamma ** steps.astype(np.float64))


def successors(ring: "TransitionRing", g: np.ndarray) -> np.ndarray:
    """The next transition of each ``g``'s episode, or -1 where it has not been added (yet)."""
    out = np.full(g.size, -1, dtype=np.int64)
    prev_delta = ring.arrays["prev_delta"]
    own = prev_delta[ring.slot(g)].astype(np.int64)
    guess = g + np.where(own > 0, own, 1)
    out = np.where(_is_successor(ring, g, guess), guess, out)
    todo = np.flatnonzero(out < 0)
    # a successor lies within max_prev_delta after g, and before head
    width = max(1, min(ring.max_prev_delta, ring.head - 1 - int(g.min(initial=ring.head))))
    step = max(1, 4096 // max(1, todo.size))  # bound the (todo, step) scan block
    for lo in range(1, width + 1, step):
        if todo.size == 0:
            break
        cand = g[todo, None] + np.arange(lo, min(width, lo + step - 1) + 1, dtype=np.int64)
        hit = _is_successor(ring, g[todo, None], cand)
        got = hit.any(axis=1)
        out[todo[got]] = cand[got, hit[got].argmax(axis=1)]
        todo = todo[~got]
    return out


def _is_successor(ring: "TransitionRing", g: np.ndarray, cand: np.ndarray) -> np.ndarray:
    inside = cand < ring.head
    safe = np.where(inside, cand, g)  # any readable slot; masked out below
    delta = ring.arrays["prev_delta"][ring.slot(safe)].astype(np.int64)
    return inside & (delta > 0) & (safe - delta == g)
