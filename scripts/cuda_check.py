"""The CUDA path for real: pinned host buffers, ``non_blocking`` copies and prefetch, checked row by row.

Run on a machine with a CUDA device (CI has none; the unit tests cover the CPU fallback)::

    python scripts/cuda_check.py [--n 20000] [--batches 300] [--json OUT.json]

What it checks, on a store filled with the packaged real Atari fixture (stack 4, 84x84):

1. ``store.sampler(b, device="cuda")`` pins its host buffers, prefetches by default, and returns tensors on
   the device; a sampler asked for ``pin_memory=False`` does not pin.
2. Every row of every batch equals the fixture: the newest frame of ``obs`` and of ``next_obs``, the action
   and the clipped reward of the transition ``batch.indices`` names, and the whole stack equals the CPU
   path's read of the same indices (``store.inspect.get``). The GPU is kept busy with matrix products on the
   default stream and on a second stream meanwhile, and each batch is read only after the next ones were
   asked for, so a host buffer refilled before its copy ended would show as wrong rows.
3. The same seed gives the same indices on ``device="cuda"`` as on the CPU (the seeded stream does not depend
   on the device).
4. ``NStep(3, over=Prioritized())`` on the device, with ``update_priorities`` fed CUDA tensors;
   ``Sequences`` on the device.
5. Batches per second on the device and on the CPU, and a DQN-shaped learner (Nature CNN forward, backward
   and Adam step on each batch) in steps per second, with the seconds the learner's thread spends inside
   ``next()`` (information, not a target: timed targets live in scripts/bench*.py). ``--rates-only`` runs just
   these, so that two versions of the package can be compared in one session (``PYTHONPATH``).

Prints a JSON summary and exits 1 when any row is wrong or a check fails.
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
import torch
from gymnasium import spaces

from mmreplay import NStep, Prioritized, Sequences, Store
from mmreplay.cli.quickbench import atari_fixture, fill


def truth(fx: dict, ids: np.ndarray) -> dict[str, np.ndarray]:
    """What the fixture says transition ``ids`` (add order; ``fill`` replays the fixture) holds."""
    t = ids % len(fx["action"])
    return {"obs_last": fx["frames"][fx["obs_index"][t]], "next_last": fx["frames"][fx["next_obs_index"][t]],
            "action": fx["action"][t].astype(np.int64), "reward": np.sign(fx["reward"][t]).astype(np.float32)}


def busy_gpu(side: torch.cuda.Stream, a: torch.Tensor) -> None:
    """Queue matrix products on the default stream and on ``side``: copies then wait behind real work."""
    a @ a
    with torch.cuda.stream(side):
        a @ a


def check_rows(store: Store, fx: dict, batch, wrong: list, label: str) -> int:
    """Compare one device batch with the fixture and with the CPU read of its indices; returns rows checked."""
    ids = batch.indices.cpu().numpy()
    want = truth(fx, ids)
    obs, nxt = batch.obs.cpu().numpy(), batch.next_obs.cpu().numpy()
    cpu = store.inspect.get(ids)
    bad = ~(obs[:, -1] == want["obs_last"]).all(axis=(1, 2))
    bad |= ~(nxt[:, -1] == want["next_last"]).all(axis=(1, 2))
    bad |= batch.action.cpu().numpy().reshape(-1) != want["action"]
    bad |= batch.reward.cpu().numpy().reshape(-1) != want["reward"]
    bad |= ~(obs == cpu.obs.numpy()).all(axis=(1, 2, 3))
    bad |= ~(nxt == cpu.next_obs.numpy()).all(axis=(1, 2, 3))
    for row in np.flatnonzero(bad)[:5]:
        wrong.append(f"{label}: row {row} (transition {ids[row]})")
    return len(ids)


def check_uniform(store: Store, fx: dict, batches: int, batch_size: int, out: dict) -> None:
    side, a = torch.cuda.Stream(), torch.randn(2048, 2048, device="cuda")
    wrong: list[str] = []
    rows = 0
    with store.sampler(batch_size, device="cuda", seed=3) as s:
        host = s._slots[0].buffers.batch()  # noqa: SLF001 (this check is about the host buffers themselves)
        out["host_buffers_pinned"] = bool(host.obs.is_pinned())
        out["prefetch_default"] = s.prefetch
        held = []
        for i in range(batches):
            busy_gpu(side, a)
            b = next(s)
            assert b.obs.device.type == "cuda", b.obs.device
            held.append(b)
            if len(held) > 2:  # read two batches late: their host buffers have been refilled meanwhile
                rows += check_rows(store, fx, held.pop(0), wrong, f"uniform batch {i - 2}")
        for b in held:
            rows += check_rows(store, fx, b, wrong, "uniform tail")
    with store.sampler(batch_size, device="cuda", pin_memory=False, seed=3, name="unpinned") as s:
        out["unpinned_when_asked"] = not s._slots[0].buffers.batch().obs.is_pinned()  # noqa: SLF001
        rows += check_rows(store, fx, next(s), wrong, "unpinned")
    out["uniform_rows_checked"], out["uniform_wrong"] = rows, wrong


def check_same_stream(store: Store, out: dict) -> None:
    with store.sampler(64, device="cuda", seed=7, name="a") as g, store.sampler(64, seed=7, name="b") as c:
        out["seeded_stream_same_on_cuda"] = all(
            torch.equal(next(g).indices.cpu(), next(c).indices.clone()) for _ in range(20))


def check_per_and_sequences(store: Store, fx: dict, out: dict) -> None:
    wrong: list[str] = []
    rows = updated = 0
    with store.sampler(256, NStep(3, 0.99, over=Prioritized()), device="cuda", seed=1, name="per") as s:
        for i in range(30):
            b = next(s)
            assert b.weights.device.type == "cuda"
            td = torch.rand(len(b.indices), device="cuda") + 0.01
            updated += s.update_priorities(b.indices, td.abs())
            ids = b.indices.cpu().numpy()
            good = (b.obs.cpu().numpy()[:, -1] == truth(fx, ids)["obs_last"]).all(axis=(1, 2))
            wrong += [f"per batch {i}: transition {ids[r]}" for r in np.flatnonzero(~good)[:5]]
            rows += len(ids)
    with store.sampler(16, Sequences(32, burn_in=8), device="cuda", seed=2) as s:
        b = next(s)
        out["sequence_obs_shape"] = list(b.obs.shape)
        out["sequence_on_cuda"] = b.obs.device.type == "cuda" and b.mask.device.type == "cuda"
    out["per_rows_checked"], out["per_updated"], out["per_wrong"] = rows, updated, wrong


def rate(store: Store, device, batch_size: int, seconds: float = 3.0) -> float:
    with store.sampler(batch_size, device=device, seed=0, name=f"rate-{device}-{batch_size}") as s:
        for _ in range(20):
            next(s)
        if device == "cuda":
            torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            b = next(s)
            n += 1
        if device == "cuda":
            b.obs.sum().item()  # the last copy has landed
        return n / (time.perf_counter() - t0)


def learner_rate(store: Store, batch_size: int, seconds: float = 3.0) -> dict:
    """Steps/s of a Nature-CNN DQN-shaped update on each batch, and the share of the time spent in ``next()``."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(4, 32, 8, 4), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 4, 2), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 3, 1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(3136, 512),
        torch.nn.ReLU(), torch.nn.Linear(512, 6)).cuda()
    opt = torch.optim.Adam(net.parameters(), 1e-4)

    def step(b) -> None:
        q = net(b.obs.float() / 255).gather(1, b.action.view(-1, 1))
        with torch.no_grad():
            target = b.reward.view(-1, 1) + 0.99 * net(b.next_obs.float() / 255).amax(1, keepdim=True)
        loss = torch.nn.functional.smooth_l1_loss(q, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    with store.sampler(batch_size, device="cuda", seed=0, name=f"learner-{batch_size}") as s:
        for _ in range(30):
            step(next(s))
        torch.cuda.synchronize()
        n, in_next, t0 = 0, 0.0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            t1 = time.perf_counter()
            b = next(s)
            in_next += time.perf_counter() - t1
            step(b)
            n += 1
        torch.cuda.synchronize()
        el = time.perf_counter() - t0
    return {"steps_per_s": n / el, "next_us": 1e6 * in_next / n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--json", default=None)
    p.add_argument("--rates-only", action="store_true")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (the CPU fallback is covered by the unit tests)")
        return 2
    fx = atari_fixture()
    root = tempfile.mkdtemp(prefix="mmreplay-cuda-")
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        path = os.path.join(root, "store")
        with Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=a.n,
                          frame_stack=4, reward_values=(-1, 0, 1)) as store:
            fill(store, fx, a.n)
            store.flush()
            if a.rates_only:
                for b in (32, 256):
                    out[f"b{b}_per_s_cuda"] = rate(store, "cuda", b)
                    out[f"b{b}_learner"] = learner_rate(store, b)
                print(json.dumps(out))
                return 0
            check_uniform(store, fx, a.batches, 32, out)
            check_same_stream(store, out)
            check_per_and_sequences(store, fx, out)
            for b in (32, 256):
                out[f"b{b}_per_s_cuda"] = rate(store, "cuda", b)
                out[f"b{b}_per_s_cpu"] = rate(store, None, b)
                out[f"b{b}_learner"] = learner_rate(store, b)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = (out["host_buffers_pinned"] and out["unpinned_when_asked"] and out["seeded_stream_same_on_cuda"]
          and out["sequence_on_cuda"] and not out["uniform_wrong"] and not out["per_wrong"] and out["per_updated"])
    out["ok"] = bool(ok)
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
