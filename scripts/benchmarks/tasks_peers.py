"""Child tasks that fill and sample a peer buffer (``benchmarks.peers``) with the workload's inputs.

Invariant: the peer library and the inputs are loaded before the RSS baseline, so the reported growth is
the buffer's; only the ``add_batch`` calls are timed, input preparation is not.
"""
from __future__ import annotations

import shutil
import tempfile

import numpy as np

from . import peers
from .measure import child_setup, cur_rss_bytes, peak_rss_bytes, rate_windows, time_adds
from .sources import ATARI_ACTIONS, AtariSource, atari_chunks


def task_peer(spec: dict) -> dict:
    """Fill one peer buffer and sample from it (all in this process)."""
    rb, res, scratch, S = peer_fill(spec)
    for B in spec["batch_sizes"]:
        rates = rate_windows(lambda B=B: rb.sample(B), spec["windows"], spec["window_s"], spec["warmup_s"])
        res[f"b{B}_per_s"] = float(np.median(rates))
        res[f"b{B}_windows"] = rates
    res["stack_err"] = peers.check_peer(rb, S) if S > 1 else 0.0
    res["peak_rss"] = peak_rss_bytes()
    rb.close()
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return res


def peer_fill(spec: dict):
    """Build peer ``spec["system"]`` and add the workload's transitions: (buffer, figures, scratch dir,
    frame stack)."""
    tuned, threads = child_setup(spec.get("tune_malloc", True))
    import logging

    kind, n, E, wl = spec["system"], spec["n"], spec["n_envs"], spec["workload"]
    torchrl_kind = kind in ("torchrl", "torchrl_per")
    scratch = None
    if torchrl_kind:
        import torchrl  # noqa: F401
        logging.getLogger("torchrl").setLevel(logging.WARNING)
        scratch = tempfile.mkdtemp(prefix="torchrl_", dir=spec["workdir"])
    # import the peer's library and load the inputs first: RSS growth from here on is the buffer
    __import__({"sb3": "stable_baselines3.common.buffers", "cpprb": "cpprb", "numpy": "numpy",
                "torchrl": "torchrl.data", "cpprb_per": "cpprb", "torchrl_per": "torchrl.data"}[kind])
    if wl == "lowdim":
        data = np.load(spec["data"])
        steps = data["action"].shape[0]
        chunks = ((steps, {k: data[k] for k in data.files}),)
        S = 1
    else:
        src = AtariSource()
        chunks = atari_chunks(src, n, E, stacks=True)
        S = 4
    rss0 = cur_rss_bytes()
    if wl == "lowdim":
        rb = peers.make_lowdim(kind, n, n_envs=E, scratch_dir=scratch)
    else:
        rb = peers.make(kind, n, (84, 84), np.uint8, E, 4, n_actions=ATARI_ACTIONS, scratch_dir=scratch)
    rss_made = cur_rss_bytes()
    t_add = 0.0
    added = 0
    for steps, d in chunks:
        o, a, r, no, te, tr = (d[k] for k in ("obs", "action", "reward", "next_obs", "terminated", "truncated"))
        t_add += time_adds(rb.add_batch, (o, a, r, no, te, tr), steps)
        added += steps * E
        del d, o, no
    rss_filled = cur_rss_bytes()
    res = {"stored": len(rb), "added": added, "add_per_s": added / t_add, "add_s": t_add,
           "malloc_tuned": tuned, "torch_threads": threads}
    if torchrl_kind:
        res["disk_bytes"] = rb.disk_bytes()
        res["store_bytes"] = res["disk_bytes"]
    else:
        res["store_bytes"] = max(0, rss_filled - rss0)
    res["rss_fill_growth"] = max(0, rss_filled - rss0)
    res["rss_create_growth"] = max(0, rss_made - rss0)
    return rb, res, scratch, S
