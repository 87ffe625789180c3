"""A brute-force model of replay semantics, written for clarity, to check the store against.

Each transition keeps its full observation stack and next-observation stack, built from the frames of
its episode (padded with the episode's first frame), exactly as gymnasium's FrameStackObservation does.
"""

from __future__ import annotations

import numpy as np


class ReferenceReplay:
    def __init__(self, frame_stack: int, capacity: int | None, dict_keys=None):
        self.k = frame_stack
        self.capacity = capacity
        self.dict_keys = dict_keys
        self.transitions: list[dict] = []
        self.episodes: dict[int, dict] = {}  # stream -> {"frames": [...], "ids": [...], "ended": bool}

    def _equal(self, a, b) -> bool:
        if self.dict_keys:
            return all(np.array_equal(a[k], b[k]) for k in self.dict_keys)
        return np.array_equal(a, b)

    def add(self, stream, obs, action, reward, next_obs, terminated, truncated, extras=None):
        ep = self.episodes.get(stream)
        if ep is None or ep["ended"] or not self._equal(obs, ep["frames"][-1]):
            ep = {"frames": [obs], "ids": [], "ended": False}
            self.episodes[stream] = ep
        g = len(self.transitions)
        j = len(ep["frames"]) - 1  # position of obs in the episode
        chain = ep["ids"][max(0, len(ep["ids"]) - (self.k - 1)):]  # predecessors the stack needs
        ep["frames"].append(next_obs)
        ep["ids"].append(g)
        self.transitions.append(dict(
            obs=self._stack(ep["frames"], j), next_obs=self._stack(ep["frames"], j + 1), action=action,
            reward=reward, terminated=bool(terminated), truncated=bool(truncated), needs=chain,
            extras=extras or {}, episode=ep["ids"], position=j))
        ep["ended"] = bool(terminated or truncated)

    def _stack(self, frames, j):
        idx = [max(0, i) for i in range(j - self.k + 1, j + 1)]
        if self.k == 1:
            return frames[j]
        if self.dict_keys:
            return {key: np.stack([frames[i][key] for i in idx]) for key in self.dict_keys}
        return np.stack([frames[i] for i in idx])

    def nstep(self, g: int, n: int, gamma: float) -> dict:
        """The n-step window of transition ``g``, walked one step at a time: stops after a terminated or
        truncated step, or where the episode has no later transition yet."""
        t = self.transitions[g]
        ids = t["episode"][t["position"]:]
        ret, m = 0.0, 0
        for m, h in enumerate(ids[:n], start=1):
            ret += gamma ** (m - 1) * self.transitions[h]["reward"]
            if self.transitions[h]["terminated"] or self.transitions[h]["truncated"]:
                break
        last = self.transitions[ids[m - 1]]
        return dict(reward=ret, discount=gamma ** m, last=ids[m - 1], next_obs=last["next_obs"],
                    terminated=last["terminated"], truncated=last["truncated"])

    @property
    def oldest(self) -> int:
        return 0 if self.capacity is None else max(0, len(self.transitions) - self.capacity)

    def valid_ids(self, oldest=None) -> list[int]:
        oldest = self.oldest if oldest is None else oldest
        return [g for g in range(oldest, len(self.transitions))
                if all(p >= oldest for p in self.transitions[g]["needs"])]


def assert_batch_matches(batch, ref: ReferenceReplay, ids, dict_keys=None):
    ids = list(ids)
    assert batch.indices.tolist() == ids
    for row, g in enumerate(ids):
        t = ref.transitions[g]
        if dict_keys:
            for key in dict_keys:
                np.testing.assert_array_equal(batch.obs[key][row].numpy(), t["obs"][key], err_msg=f"obs {g} {key}")
                np.testing.assert_array_equal(batch.next_obs[key][row].numpy(), t["next_obs"][key],
                                              err_msg=f"next_obs {g} {key}")
        else:
            np.testing.assert_array_equal(batch.obs[row].numpy(), t["obs"], err_msg=f"obs of transition {g}")
            np.testing.assert_array_equal(batch.next_obs[row].numpy(), t["next_obs"], err_msg=f"next_obs of {g}")
        np.testing.assert_array_equal(batch.action[row].numpy(), np.asarray(t["action"]), err_msg=f"action {g}")
        assert float(batch.reward[row]) == np.float32(t["reward"]), f"reward of {g}"
        assert bool(batch.terminated[row]) == t["terminated"], f"terminated of {g}"
        assert bool(batch.truncated[row]) == t["truncated"], f"truncated of {g}"
        for name, value in t["extras"].items():
            np.testing.assert_array_equal(batch.extras[name][row].numpy(), np.asarray(value))
