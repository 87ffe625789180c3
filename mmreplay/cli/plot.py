"""``mmreplay plot``: what users look at in a replay buffer, as one PNG — return per episode over time,
episode lengths, action and reward distributions (log counts, so rare actions and rare rewards show), a
strip of frame thumbnails for image stores, observation values for low-dim stores, and the priority
distribution of each prioritized sampler that committed priorities. Needs matplotlib (``plot`` extra).

Invariant: read-only, memory bounded by a chunk (``stats.CHUNK`` transitions) or a capped sample, never
by the store; counts of discrete actions and packed rewards are exact over every kept transition. Built
on the public ``Store`` API (``inspect.valid_range``, ``inspect.read_column``, ``inspect.get``, ``sample``,
``schema``) and ``mmreplay.stats``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

from mmreplay.stats import CHUNK, committed_priorities, episode_stats

if TYPE_CHECKING:
    from mmreplay.settings import Settings
    from mmreplay.store import Store

#: rows of a float column (continuous actions, float rewards) histogrammed: an evenly strided sample
MAX_SAMPLE = 1_000_000
#: transitions sampled (uniformly) for the observation histograms of a low-dim store
MAX_OBS_ROWS = 20_000
THUMBNAILS = 8


def register(sub) -> None:
    p = sub.add_parser("plot", help="PNG histograms of observations, rewards, actions and episode lengths")
    p.add_argument("path")
    p.add_argument("--out", default="mmreplay_plot.png")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args) -> int:
    try:
        out = plot_store(args.path, args.out)
    except ImportError as exc:
        print(f"mmreplay plot: needs matplotlib ({exc}); pip install 'mmreplay[plot]'", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def episode_lengths(store: Store) -> np.ndarray:
    """Lengths of the complete episodes (first step kept, ended), in the order they ended."""
    return episode_stats(store).lengths


def column_values(store: Store, name: str, exact: bool) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    """Over the kept transitions: ``(values, counts)`` when ``exact`` (a discrete column), else an evenly
    strided sample of at most ``MAX_SAMPLE`` rows. Read in chunks of ``CHUNK``."""
    oldest, head = store.inspect.valid_range()
    stride = max(1, -(-(head - oldest) // MAX_SAMPLE))
    counts: dict = {}
    sample = []
    for lo in range(oldest, head, CHUNK):
        x = store.inspect.read_column(name, lo, min(head, lo + CHUNK))
        if exact:
            values, n = np.unique(x, return_counts=True)
            for v, c in zip(values.tolist(), n.tolist()):
                counts[v] = counts.get(v, 0) + c
        else:
            sample.append(x[(oldest - lo) % stride::stride])
    if exact:
        keys = sorted(counts)
        return np.asarray(keys), np.asarray([counts[k] for k in keys], np.int64)
    return np.concatenate(sample) if sample else np.zeros(0)


def image_key(store: Store) -> str | None:
    """The first observation key holding images: uint8, 2-D (grey), or 3-D with its channels on the first or
    the last axis (``image_channel_axis``)."""
    for spec in store.schema.observations:
        if spec.np_dtype == np.uint8 and (len(spec.shape) == 2 or image_channel_axis(spec.shape) is not None):
            return spec.name
    return None


def image_channel_axis(shape: tuple[int, ...]) -> int | None:
    """The channel axis (0 or 2) of a 3-D frame shape, or None: the smaller of the first and last axes,
    as SB3 decides (``(3, 84, 84)`` channel-first from DrQ-v2 or ``VecTransposeImage``, ``(84, 84, 3)``
    channel-last), when it is smaller than both image sides (a ``(5, 40, 40)`` vector of images is not)."""
    if len(shape) != 3:
        return None
    axis = 0 if shape[0] < shape[-1] else 2
    sides = [d for i, d in enumerate(shape) if i != axis]
    return axis if shape[axis] < min(sides) else None


def displayable(frame: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(image, grey)`` that imshow draws: ``(H, W)`` grey or ``(H, W, 3)`` colour, channel-last. A frame
    whose channels are a stack (``VecFrameStack``: 4 grey or 3 RGB frames concatenated, oldest first)
    shows its newest frame: the last 3 channels when they are a multiple of 3, else the last one."""
    if frame.ndim == 2:
        return frame, True
    axis = image_channel_axis(frame.shape)
    hwc = np.moveaxis(frame, 0, -1) if axis == 0 else frame
    c = hwc.shape[-1]
    if c == 3 or (c > 3 and c % 3 == 0):
        return hwc[..., -3:], False
    return hwc[..., -1], True


def thumbnails(store: Store, key: str, n: int = THUMBNAILS) -> tuple[np.ndarray, np.ndarray]:
    """``n`` frames (the newest of each stack) evenly spaced over the valid transitions, and their ids."""
    oldest, head = store.inspect.valid_range()
    ids = np.unique(np.linspace(oldest, head - 1, n).astype(np.int64)) if head > oldest else np.zeros(0, np.int64)
    ids = [_readable_from(store, int(g), head) for g in ids]  # a stack may reach overwritten steps
    ids = np.unique(np.asarray([g for g in ids if g is not None], np.int64))
    if ids.size == 0:
        return np.zeros((0,)), ids
    obs = store.inspect.get(ids).obs
    obs = obs[key] if isinstance(obs, dict) else obs
    obs = obs.numpy()
    return (obs[:, -1] if store.frame_stack > 1 else obs), ids


def _readable_from(store: Store, g: int, head: int, tries: int = 64) -> int | None:
    """The first transition id from ``g`` whose frame stack is still kept (None within ``tries``)."""
    for c in range(g, min(head, g + tries)):
        try:
            store.inspect.get([c])
        except IndexError:
            continue
        return c
    return None


def _log_bars(ax, values, counts, title: str, xlabel: str) -> None:
    ax.bar([str(v if not isinstance(v, float) else f"{v:g}") for v in values.tolist()], counts, color="tab:blue")
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.7)  # bars rise from below 1: a value seen once still shows
    ax.set_ylabel("count (log)")
    ax.set_xlabel(xlabel)
    total = counts.sum()
    ax.set_title(f"{title} ({total:,} transitions)")
    if len(values) > 12:
        ax.tick_params(axis="x", labelrotation=90, labelsize=7)


def _log_hist(ax, x, title: str, xlabel: str, logx: bool = False) -> None:
    x = np.asarray(x, np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        ax.set_title(f"{title}: nothing to show")
        return
    if logx:
        x = x[x > 0]
        bins = np.geomspace(x.min(), max(x.max(), x.min() * 1.0001), 60) if x.size else 10
        ax.set_xscale("log")
    else:
        bins = 60
    ax.hist(x, bins=bins, color="tab:blue")
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.7)
    ax.set_ylabel("count (log)")
    ax.set_xlabel(xlabel)
    ax.set_title(title)


def _returns_panel(ax, stats) -> None:
    if not stats.complete:
        ax.set_title("return per episode: no complete episode yet")
        return
    x = np.arange(1, stats.complete + 1)
    ax.plot(x, stats.returns, ".", ms=5, alpha=0.5, color="tab:blue", label="episode")
    w = max(1, min(100, stats.complete // 5))
    if w > 1:
        smooth = np.convolve(stats.returns, np.ones(w) / w, mode="valid")
        ax.plot(x[w - 1:], smooth, color="tab:red", lw=2, label=f"mean of last {w}")
    ax.legend(fontsize=8, loc="best")
    ax.set_xlabel("episode (in the order they ended)")
    ax.set_ylabel("return")
    s = stats.summary()["return"]
    ax.set_title(f"return per episode: mean {s['mean']:.3g}, min {s['min']:.3g}, max {s['max']:.3g}, "
                 f"last {s['last']} {s['last_100_mean']:.3g}")


def _lengths_panel(ax, stats) -> None:
    if not stats.complete:
        ax.set_title("episode lengths: no complete episode yet")
        return
    _log_hist(ax, stats.lengths, f"episode lengths ({stats.complete:,} complete, {stats.running} running, "
                                 f"{stats.cut} cut by the ring)", "steps")


def _actions_panel(ax, store) -> None:
    space = store.action_space
    if hasattr(space, "n"):
        values, counts = column_values(store, "action", exact=True)
        _log_bars(ax, values, counts, "actions", "action")
        return
    x = column_values(store, "action", exact=False)
    x = x.reshape(x.shape[0], -1)
    _dims_hist(ax, x, "action")
    ax.set_title(f"actions ({x.shape[0]:,} sampled transitions)")


def _dims_hist(ax, x: np.ndarray, xlabel: str) -> None:
    """One step histogram per dimension (the first 8), log counts."""
    for d in range(min(x.shape[1], 8)):
        ax.hist(x[:, d], bins=60, histtype="step", label=f"dim {d}")
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.7)
    ax.set_ylabel("count (log)")
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=7)


def _rewards_panel(ax, store) -> None:
    if store.schema.reward.kind == "packed":
        values, counts = column_values(store, "reward", exact=True)
        _log_bars(ax, values, counts, "rewards", "reward")
    else:
        x = column_values(store, "reward", exact=False)
        _log_hist(ax, x, f"rewards ({x.size:,} sampled transitions)", "reward")


def _observations_panel(ax, store) -> None:
    spec = store.schema.observations[0]
    n = min(MAX_OBS_ROWS, len(store))
    if n == 0:
        ax.set_title("observations: none readable")
        return
    obs = store.sample(n, seed=0).obs  # uniform over the valid transitions (with replacement)
    obs = (obs[spec.name] if isinstance(obs, dict) else obs).numpy()
    obs = obs[:, -1] if store.frame_stack > 1 else obs
    obs = obs.reshape(obs.shape[0], -1)
    _dims_hist(ax, obs, "value")
    more = f", first 8 of {obs.shape[1]} dims" if obs.shape[1] > 8 else ""
    ax.set_title(f"observation '{spec.name}' values ({n:,} sampled transitions{more})")


def plot_store(path: str, out: str) -> str:
    """Draw the store at ``path`` into the PNG file ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmreplay.settings import Settings
    from mmreplay.store import Store

    with Store.open(path, mode="r", settings=Settings(preload=False)) as store:
        fig = store_figure(store, title=str(path))
    try:
        fig.savefig(out, dpi=90)
    finally:
        plt.close(fig)
    return out


def store_figure(store: Store, title: str):
    """The figure (see the module docstring): a thumbnail strip on top for image stores, then two panels
    a row."""
    import matplotlib.pyplot as plt

    stats = episode_stats(store)
    key = image_key(store)
    frames, frame_ids = thumbnails(store, key) if key else (None, None)
    priorities = committed_priorities(store)
    panels = [lambda ax: _returns_panel(ax, stats), lambda ax: _lengths_panel(ax, stats),
              lambda ax: _actions_panel(ax, store), lambda ax: _rewards_panel(ax, store)]
    if key is None:
        panels.append(lambda ax: _observations_panel(ax, store))
    for name, p in priorities.items():
        panels.append(lambda ax, name=name, p=p: _log_hist(
            ax, p, f"priorities of sampler '{name}' ({p.size:,} transitions)", "priority (log)", logx=True))
    strip = frames is not None and len(frames) > 0
    rows = (len(panels) + 1) // 2
    fig = plt.figure(figsize=(13, 3.6 * rows + (1.8 if strip else 0)))
    grid = fig.add_gridspec(rows + (1 if strip else 0), 2, height_ratios=([0.5] if strip else []) + [1] * rows)
    if strip:
        sub = grid[0, :].subgridspec(1, len(frames))
        for i, (frame, g) in enumerate(zip(frames, frame_ids)):
            ax = fig.add_subplot(sub[0, i])
            image, grey = displayable(frame)
            ax.imshow(image, cmap="gray" if grey else None, vmin=0, vmax=255)
            ax.set_title(f"t={g:,}", fontsize=8)
            ax.axis("off")
    for i, draw in enumerate(panels):
        draw(fig.add_subplot(grid[(1 if strip else 0) + i // 2, i % 2]))
    oldest, head = store.inspect.valid_range()
    fig.suptitle(f"{title}: {head - oldest:,} transitions kept of {head:,} added, frame_stack {store.frame_stack}")
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title above the thumbnails
    return fig
