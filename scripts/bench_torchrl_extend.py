"""``ReplayBuffer.extend`` time: TorchRL over ``MMReplayStorage`` against ``LazyMemmapStorage`` (disk) and
``LazyTensorStorage`` (RAM), same collector-shaped TensorDicts, same run (issue 24, item 7).

Each storage receives ``--rows`` transitions in batches of ``--batch`` rows (a collector's
``frames_per_batch``), as TorchRL's collectors give them: ``observation``, one-hot ``action``,
``("collector", "traj_ids")`` and the ``next`` sub-TensorDict with observation, reward and flags.
Episodes of 50-300 steps. ``--obs pixels`` is one 84x84 uint8 Atari frame (``mmreplay/data/
atari_fixture.npz``, tiled), ``--obs lowdim`` 17 float32. One untimed warm-up run of each storage first
(imports, compiled kernels loaded).
The time includes creating the storage (on the first write) and every ``extend`` call; mmreplay's
commit (``flush()``: fsync, durable) is printed apart, as ``LazyMemmapStorage`` leaves its memmaps to
the page cache (mmreplay commits on its own every 25k transitions / 30 s, not within 5k rows). Prints each time,
the ratio mmreplay / LazyMemmapStorage and the median over ``--repeats`` runs.

    python scripts/bench_torchrl_extend.py --rows 5000 --obs pixels --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer

from mmreplay.integrations.torchrl import MMReplayStorage

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "mmreplay", "data", "atari_fixture.npz")


def collector_batches(rows: int, batch: int, obs: str, seed: int = 0) -> list[TensorDict]:
    rng = np.random.default_rng(seed)
    shape, dtype = ((84, 84), torch.uint8) if obs == "pixels" else ((17,), torch.float32)
    if obs == "pixels":  # real Atari frames (random bytes would make every compressor look slow)
        fixture = np.load(FIXTURE)["frames"]
        frames = torch.as_tensor(fixture[np.arange(rows + 1) % len(fixture)])
    else:
        frames = torch.randn(rows + 1, *shape).to(dtype)
    lengths = []
    while sum(lengths) < rows:
        lengths.append(int(rng.integers(50, 301)))
    traj = torch.as_tensor(np.repeat(np.arange(len(lengths)), lengths)[:rows])
    end = torch.zeros(rows, 1, dtype=torch.bool)
    end[torch.as_tensor(np.cumsum(lengths)[:-1] - 1)] = True
    trunc = end & torch.as_tensor(rng.random((rows, 1)) < 0.3)
    act = torch.nn.functional.one_hot(torch.as_tensor(rng.integers(0, 6, rows)), 6)
    td = TensorDict({"observation": frames[:-1], "action": act, "done": torch.zeros(rows, 1, dtype=torch.bool),
                     "collector": TensorDict({"traj_ids": traj}, [rows]),
                     "next": TensorDict({"observation": frames[1:], "reward": torch.randn(rows, 1),
                                         "done": end, "terminated": end & ~trunc, "truncated": trunc}, [rows])},
                    [rows])
    return [td[i:i + batch].clone() for i in range(0, rows, batch)]


def time_extend(make_storage, batches: list[TensorDict]) -> tuple[float, float, float]:
    """Seconds to make the storage and extend it with every batch, of which the first batch (storage
    creation included), then seconds of one commit (mmreplay)."""
    t0 = time.perf_counter()
    storage = make_storage()
    rb = ReplayBuffer(storage=storage, batch_size=32)
    for i, b in enumerate(batches):
        rb.extend(b)
        if i == 0:
            first = time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    commit = 0.0
    if isinstance(storage, MMReplayStorage):
        t0 = time.perf_counter()
        storage.flush()
        commit = time.perf_counter() - t0
        storage.close()
    return elapsed, first, commit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--obs", choices=("pixels", "lowdim"), default="pixels")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--frame-codec", default="lz4hc", help="the store's frame_codec (Store.create)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = collector_batches(args.rows, args.batch, args.obs)
    ratios, rest = [], []
    for r in range(-1, args.repeats):  # run -1: warm-up, not counted
        tmp = tempfile.mkdtemp(prefix="bench_torchrl_extend_")
        try:
            t_ram, _, _ = time_extend(lambda: LazyTensorStorage(args.rows), batches)
            t_mm, first_mm, _ = time_extend(lambda: LazyMemmapStorage(args.rows, scratch_dir=f"{tmp}/memmap"),
                                            batches)
            t_mmr, first_mmr, t_commit = time_extend(lambda: MMReplayStorage(f"{tmp}/rb.mmr", args.rows,
                                                                        frame_codec=args.frame_codec), batches)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if r < 0:
            continue
        ratios.append(t_mmr / t_mm)
        rest.append((t_mmr - first_mmr) / (t_mm - first_mm))
        print(f"run {r}: {args.rows} rows ({args.obs}, batches of {args.batch}): LazyTensorStorage {t_ram:.3f} s, "
              f"LazyMemmapStorage {t_mm:.3f} s, MMReplayStorage {t_mmr:.3f} s, "
              f"ratio MMReplay/LazyMemmap {t_mmr / t_mm:.2f}x (then mmreplay's commit, fsync included: "
              f"{t_commit:.3f} s); after the first batch (storage creation, mmreplay's encoder process start): "
              f"LazyMemmapStorage {t_mm - first_mm:.3f} s, MMReplayStorage {t_mmr - first_mmr:.3f} s, ratio "
              f"{rest[-1]:.2f}x", flush=True)
    print(f"median ratio MMReplay/LazyMemmap over {args.repeats} runs: {statistics.median(ratios):.2f}x; "
          f"after the first batch: {statistics.median(rest):.2f}x")


if __name__ == "__main__":
    main()
