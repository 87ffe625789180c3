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

6. The device decode path (issue 38, ``mmreplay/device/``): for Atari frames with each frame codec (``lz4hc``,
   ``zstd``, ``delta-zstd``) and colour frames with the temporal codec's layout 3 (``delta-zstd`` on 84x84x3) and
   ``delta-lz4`` (one LZ4 block a run),
   uniform b32 / b256, n-step-3 b256 and sequences, every field of every batch of ``decode="device"`` equals the
   CPU path's for the same seed (rows compared on the host), then batches/s and the process's CPU ms a batch
   (``time.process_time`` over the batches) of ``decode="device"`` against ``decode="cpu"`` on the same device.
   ``--decode-only`` runs just this part (a few minutes on a GPU); ``--on cpu`` runs it on this machine's CPU
   with the CPU decoder standing in for nvCOMP (the logic and its CPU cost, not a speed target). Then n-step-3
   b256 again with the device-resident tier on (``Settings.device_cache_bytes``, ``--device-cache-mb``): its rows
   compared the same way, its rate and CPU ms, and the tier's figures (chunks held, hits, misses).

Prints a JSON summary and exits 1 when any row is wrong or a check fails (2 when it cannot run: no CUDA device, or
nvCOMP missing for 6.).

On a lent GPU machine, in one call of a few minutes (its image has torch for CUDA 13 and python3 3.12, and reaches
no package index, so the packages it lacks travel as wheels; ~43 MB)::

    # here, once, in the repository's root (.whl/ is ignored by .git/info/exclude):
    echo /.whl/ >> .git/info/exclude
    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        -d .whl nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12 zarr==3.1.6 numcodecs==0.16.6 \
        google-crc32c==1.9.0 gymnasium==1.4.0 farama-notifications donfig
    # there (the run carries .whl):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 scripts/cuda_check.py --json $OUT/cuda_check.json

(``mmreplay[gpu]`` names the CUDA 12 wheel, ``nvidia-nvcomp-cu12``; a CUDA 13 torch takes ``mmreplay[gpu-cu13]``, the same API.)
``--decode-only`` runs 6. alone. Here, ``--decode-only --on cpu`` is its dry run (8,960 rows compared in ~4 min before the
tier case; ``--n 2000 --decode-batches 2 --seconds 0.3``: 6,528 rows, 2,048 of them with the tier, ~30 s).
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
from mmreplay.device.decoders import nvcomp_available

NO_NVCOMP = ("nvCOMP's Python package does not import here: the device decode check (6.) needs it (pip install "
             "'mmreplay[gpu]', or carry the wheels: see this script's docstring)")


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


# -- 6. the device decode path -------------------------------------------------------------------------------
def colour_frames(n: int = 64, shape=(84, 84, 3)) -> np.ndarray:
    """DMC-like colour frames: a noisy scene whose light drifts, a sprite that moves (coded as differences)."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 256, shape, dtype=np.uint8)
    out = np.empty((n, *shape), dtype=np.uint8)
    for i in range(n):
        frame = base + np.uint8(i % 256)
        y, x = (3 * i) % (shape[0] - 8), (5 * i) % (shape[1] - 8)
        frame[y:y + 8, x:x + 8] = 255
        out[i] = frame
    return out


def fill_colour(store: Store, frames: np.ndarray, n: int, episode: int = 100) -> None:
    f = 0
    for t in range(n):
        if t % episode == 0:
            f += 1
        store.add(frames[f % len(frames)], t % 6, float(t % 3 - 1), frames[(f + 1) % len(frames)],
                  t % episode == episode - 1, False)
        f += 1


def batch_fields(batch) -> dict:
    out = {}
    for name, value in vars(batch).items():
        if isinstance(value, dict):
            out.update({f"{name}.{k}": v.cpu().numpy().copy() for k, v in value.items()})
        elif isinstance(value, torch.Tensor):
            out[name] = value.cpu().numpy().copy()
    return out


def compare_paths(store: Store, draw, batch_size: int, batches: int, on: str, label: str) -> dict:
    """Rows of ``decode="device"`` on ``on`` that differ from the CPU path's for the same seed."""
    wrong, rows = [], 0
    name = label.replace("/", "-")
    with store.sampler(batch_size, draw, seed=4, decode="cpu", name=f"cmp-cpu-{name}") as cpu, \
            store.sampler(batch_size, draw, seed=4, decode="device", device=on, name=f"cmp-dev-{name}") as dev:
        assert dev.decode == "device"  # the path under test must be the one taken
        for i in range(batches):
            want, got = batch_fields(next(cpu)), batch_fields(next(dev))
            if want.keys() != got.keys():
                wrong.append(f"{label} batch {i}: fields {sorted(got)} != {sorted(want)}")
                continue
            bad = np.zeros(batch_size, dtype=bool)
            for key in want:
                if want[key].shape != got[key].shape or want[key].dtype != got[key].dtype:
                    wrong.append(f"{label} batch {i}: {key} {got[key].dtype}{got[key].shape} != "
                                 f"{want[key].dtype}{want[key].shape}")
                    bad[:] = True
                    continue
                differs = want[key] != got[key]
                bad |= differs.reshape(batch_size, -1).any(axis=1)
            wrong += [f"{label} batch {i}: row {r}" for r in np.flatnonzero(bad)[:3]]
            rows += batch_size
        tier = dev.device_tier
    return {"rows": rows, "wrong": wrong, "tier": tier}


def path_rate(store: Store, draw_factory, batch_size: int, on: str, decode: str, seconds: float) -> dict:
    """Batches/s and the process's CPU ms a batch (all threads: prefetch included) of one path."""
    device = on if on == "cuda" else None
    with store.sampler(batch_size, draw_factory(), seed=0, decode=decode, device=device,
                       name=f"rate-{decode}-{batch_size}-{time.perf_counter_ns()}") as s:
        for _ in range(5):
            b = next(s)
        if on == "cuda":
            torch.cuda.synchronize()
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            b = next(s)
            n += 1
        if on == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        del b
    return {"batches_per_s": round(n / wall, 2), "cpu_ms_per_batch": round(1e3 * cpu / n, 3), "batches": n}


def check_device_decode(fx: dict, root: str, n: int, batches: int, on: str, seconds: float, out: dict,
                        tier_bytes: int = 0) -> None:
    stores = {}
    for codec in ("lz4hc", "zstd", "delta-zstd"):
        path = os.path.join(root, f"atari-{codec}")
        with Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=n,
                          frame_stack=4, reward_values=(-1, 0, 1), frame_codec=codec, durable=False) as store:
            fill(store, fx, n)
        stores[f"atari-{codec}"] = path
    for codec in ("delta-zstd", "delta-lz4"):  # delta-lz4: DreamerV3's sequences (one LZ4 block a run of 32)
        path = os.path.join(root, f"colour-{codec}")
        with Store.create(path, spaces.Box(0, 255, (84, 84, 3), np.uint8), spaces.Discrete(6), capacity=n // 4,
                          frame_stack=3, reward_values=(-1, 0, 1), frame_codec=codec, durable=False) as store:
            fill_colour(store, colour_frames(), n // 4)
        stores[f"colour-{codec}"] = path
    result: dict = {"on": on}
    wrong_total = rows_total = 0
    for label, path in stores.items():
        entry: dict = {}
        with Store.open(path, "r") as store:
            cases = {"uniform-b32": (lambda: None, 32), "uniform-b256": (lambda: None, 256),
                     "nstep3-b256": (lambda: NStep(3, 0.99), 256), "sequences-16x32": (lambda: Sequences(32), 16)}
            for case, (make, b) in cases.items():
                got = compare_paths(store, make(), b, batches, on, f"{label}/{case}")
                entry[f"{case}_rows"], entry[f"{case}_wrong"] = got["rows"], got["wrong"]
                wrong_total += len(got["wrong"])
                rows_total += got["rows"]
            for case in ("uniform-b32", "uniform-b256", "nstep3-b256"):
                make, b = cases[case]
                entry[f"{case}_device"] = path_rate(store, make, b, on, "device", seconds)
                entry[f"{case}_cpu_path"] = path_rate(store, make, b, on, "cpu", seconds)
        if tier_bytes:  # the device-resident tier, sized by the store's settings when each sampler is made
            with Store.open(path, "r", device_cache_bytes=tier_bytes) as store:
                make, b = cases["nstep3-b256"]
                got = compare_paths(store, make(), b, batches, on, f"{label}/nstep3-b256-tier")
                if got["tier"] is None or not got["tier"]["hits"]:  # the tier was not used: a failed check
                    got["wrong"].append(f"{label}/nstep3-b256-tier: no chunk served by the tier ({got['tier']})")
                entry["nstep3-b256-tier_rows"], entry["nstep3-b256-tier_wrong"] = got["rows"], got["wrong"]
                entry["nstep3-b256-tier_stats"] = got["tier"]
                wrong_total += len(got["wrong"])
                rows_total += got["rows"]
                entry["nstep3-b256-tier_device"] = path_rate(store, make, b, on, "device", seconds)
        result[label] = entry
    result["rows_checked"], result["rows_wrong"] = rows_total, wrong_total
    out["device_decode"] = result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--json", default=None)
    p.add_argument("--rates-only", action="store_true")
    p.add_argument("--decode-only", action="store_true", help="only the device decode path's check (6.)")
    p.add_argument("--on", choices=("cuda", "cpu"), default="cuda",
                   help="where --decode-only decodes (cpu: the CPU stand-in for nvCOMP)")
    p.add_argument("--decode-batches", type=int, default=20, help="batches compared per case in 6.")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per timed rate in 6.")
    p.add_argument("--device-cache-mb", type=float, default=256.0, help="the device tier of 6.'s tier case "
                   "(Settings.device_cache_bytes; more than these stores' compressed frames); 0 skips the case")
    a = p.parse_args()
    if a.decode_only:
        if a.on == "cuda" and not torch.cuda.is_available():
            print("no CUDA device: run with --on cpu for the CPU stand-in")
            return 2
        if a.on == "cuda" and not nvcomp_available():
            print(NO_NVCOMP)
            return 2
        root = tempfile.mkdtemp(prefix="mmreplay-decode-")
        out = {"device": torch.cuda.get_device_name(0) if a.on == "cuda" else "cpu", "torch": torch.__version__}
        try:
            check_device_decode(atari_fixture(), root, a.n, a.decode_batches, a.on, a.seconds, out,
                                int(a.device_cache_mb * 1e6))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        out["ok"] = out["device_decode"]["rows_wrong"] == 0 and out["device_decode"]["rows_checked"] > 0
        text = json.dumps(out, indent=1, default=str)
        print(text)
        if a.json:
            with open(a.json, "w") as f:
                f.write(text)
        return 0 if out["ok"] else 1
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (the CPU fallback is covered by the unit tests; --decode-only "
              "--on cpu runs the device decode check on the CPU stand-in)")
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
        if nvcomp_available():
            check_device_decode(fx, root, a.n, a.decode_batches, "cuda", a.seconds, out, int(a.device_cache_mb * 1e6))
        else:  # the CUDA path's checks above still count; the device decode's cannot run
            out["device_decode"] = {"error": NO_NVCOMP, "rows_checked": 0, "rows_wrong": 0}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = (out["host_buffers_pinned"] and out["unpinned_when_asked"] and out["seeded_stream_same_on_cuda"]
          and out["sequence_on_cuda"] and not out["uniform_wrong"] and not out["per_wrong"] and out["per_updated"]
          and out["device_decode"]["rows_wrong"] == 0 and out["device_decode"]["rows_checked"] > 0)
    out["ok"] = bool(ok)
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
