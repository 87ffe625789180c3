"""``mmreplay plot`` draws frame thumbnails for every image layout users store (issue 41 item 7): grey or
colour, channel-first (DrQ-v2, SB3's ``VecTransposeImage``) or channel-last, single frames or whole
``VecFrameStack`` stacks (the newest frame is shown), with or without the store's own ``frame_stack``."""

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay

pytest.importorskip("matplotlib")

H, W = 12, 10


def frame_of(t: int, c: int) -> np.ndarray:
    """The (H, W, c) channel-last frame of step ``t``: channel j of pixel (y, x) = (t*7 + y*3 + x + j*50) % 256."""
    y, x, j = np.arange(H)[:, None, None], np.arange(W)[None, :, None], np.arange(c)[None, None, :]
    return ((t * 7 + y * 3 + x + j * 50) % 256).astype(np.uint8)


# (stored shape, how a step's frame is laid out from its (H, W, c) frame, what the thumbnail must show)
LAYOUTS = {
    "grey": ((H, W), lambda f: f[..., 0], lambda f: f[..., 0]),
    "grey channel-last": ((H, W, 1), lambda f: f[..., :1], lambda f: f[..., 0]),
    "grey channel-first": ((1, H, W), lambda f: f[..., :1].transpose(2, 0, 1), lambda f: f[..., 0]),
    "rgb channel-last": ((H, W, 3), lambda f: f[..., :3], lambda f: f[..., :3]),
    "rgb channel-first": ((3, H, W), lambda f: f[..., :3].transpose(2, 0, 1), lambda f: f[..., :3]),
    # whole VecFrameStack stacks stored as frames: the newest frame (the last channels) is shown
    "4 grey stacked channel-first": ((4, H, W), lambda f: f[..., :4].transpose(2, 0, 1), lambda f: f[..., 3]),
    "3 rgb stacked channel-last": ((H, W, 9), lambda f: f[..., :9], lambda f: f[..., 6:9]),
}


@pytest.mark.parametrize("frame_stack", [1, 3])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_plot_draws_thumbnails_for_every_image_layout(tmp_path, layout, frame_stack):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmreplay.cli.plot import store_figure

    shape, stored, shown = LAYOUTS[layout]
    c = 9 if shape[-1] == 9 else 4
    path = str(tmp_path / "s.mmr")
    with mmreplay.Store.create(path, spaces.Box(0, 255, shape, np.uint8), spaces.Discrete(2), capacity=100,
                               frame_stack=frame_stack, durable=False) as store:
        for t in range(40):
            store.add(stored(frame_of(t, c)), 0, 0.0, stored(frame_of(t + 1, c)), False, False)
    with mmreplay.Store.open(path, mode="r") as store:
        fig = store_figure(store, layout)
    thumbs = [ax for ax in fig.axes if ax.get_title().startswith("t=")]
    plt.close(fig)
    assert len(thumbs) == 8, [ax.get_title() for ax in fig.axes]
    assert not any("dims" in ax.get_title() for ax in fig.axes)  # not drawn as a low-dim histogram
    for ax in thumbs:
        t = int(ax.get_title()[2:].replace(",", ""))  # transition t: its observation is step t's frame
        np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), shown(frame_of(t, c)), err_msg=layout)
