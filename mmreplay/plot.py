"""``mmreplay plot``: the classic "what is in my buffer" figure — histograms of observation dimensions (or
pixel values), rewards, actions and episode lengths — as one PNG. Needs matplotlib (the ``plot`` extra)."""

from __future__ import annotations

import numpy as np

from mmreplay.store import Store

MAX_ROWS = 20_000


def episode_lengths(store: Store) -> np.ndarray:
    """Lengths of the episodes that both started and ended within the kept transitions (any streams)."""
    ring = store._ring
    oldest, head = store.valid_range()
    g = np.arange(oldest, head, dtype=np.int64)
    if g.size == 0:
        return np.zeros(0, dtype=np.int64)
    delta = ring.read("prev_delta", g).astype(np.int64)
    # Pointer jumping: start[i] ends as the first transition of i's episode, or one before ``oldest``.
    start = np.where(delta > 0, g - delta, g)
    while True:
        inside = start >= oldest
        jumped = start.copy()
        jumped[inside] = start[start[inside] - oldest]
        if np.array_equal(jumped, start):
            break
        start = jumped
    ended = (ring.read("terminated", g) | ring.read("truncated", g)).astype(bool)
    kept = start >= oldest
    complete = ended & kept
    sizes = np.bincount(start[kept] - oldest, minlength=g.size)  # transitions per episode start
    return sizes[start[complete] - oldest]


def plot_store(path: str, out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with Store.open(path, mode="r") as store:
        oldest, head = store.valid_range()
        rng = np.random.default_rng(0)
        g = np.unique(rng.integers(oldest, head, min(MAX_ROWS, head - oldest))) if head > oldest else np.zeros(0, int)
        g = g[store._ring.stack_frames(g, store.frame_stack, store._frames.head)[2]]
        batch = store.get(g) if g.size else None
        lengths = episode_lengths(store)
        spec = store.schema.observations[0]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0, 0]
    if batch is not None:
        obs = batch.obs if not isinstance(batch.obs, dict) else batch.obs[spec.name]
        obs = obs.numpy()
        if store.frame_stack > 1:
            obs = obs[:, -1]
        if obs.ndim == 2 and obs.shape[1] <= 16:
            for d in range(obs.shape[1]):
                ax.hist(obs[:, d], bins=50, histtype="step", label=f"dim {d}")
            ax.legend(fontsize=7)
            ax.set_title(f"observation '{spec.name}' by dimension")
        else:
            ax.hist(obs[:256].ravel(), bins=64)
            ax.set_title(f"observation '{spec.name}' values (256 frames)")
        axes[0, 1].hist(batch.reward.numpy(), bins=50)
        actions = batch.action.numpy()
        if actions.ndim == 1:
            values, counts = np.unique(actions, return_counts=True)
            axes[1, 0].bar(values, counts)
            axes[1, 0].set_xticks(values)
        else:
            for d in range(min(actions.shape[1], 8)):
                axes[1, 0].hist(actions[:, d], bins=50, histtype="step", label=f"dim {d}")
            axes[1, 0].legend(fontsize=7)
    axes[0, 1].set_title("rewards")
    axes[1, 0].set_title("actions")
    axes[1, 1].hist(lengths, bins=50)
    axes[1, 1].set_title(f"episode lengths ({lengths.size} complete episodes)")
    fig.suptitle(f"{path}: {head - oldest:,} transitions (histograms of a sample of {g.size:,})")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
