"""``torchrl_rows`` on its own: ``Trajectories`` (streams per live trajectory, given back when it ends; ids for
rows written without them, one per episode of their stream) and the one-hot action test."""

import numpy as np
import pytest
import torch

pytest.importorskip("torchrl", reason="torchrl is not installed (pip install 'mmreplay[torchrl]')")
from gymnasium import spaces  # noqa: E402

from mmreplay.integrations.torchrl_rows import Trajectories, is_one_hot  # noqa: E402


def test_a_trajectory_keeps_its_stream_and_an_ended_one_gives_it_back():
    t = Trajectories()
    first = t.streams(np.array([5, 5, 7, 7, 5]), np.array([False, False, False, True, True]))
    assert first.tolist() == [0, 0, 1, 1, 0]  # one stream per trajectory, in order of their ids
    again = t.streams(np.array([9, 9, 11]), np.array([False, False, False]))
    assert set(again.tolist()) == {0, 1} and again[0] == again[1] != again[2]  # both ended: streams reused
    assert t.streams(np.array([12]), np.array([False])).tolist() == [2]  # none free: a new one
    assert t.streams(np.array([9, 11]), np.array([False, False])).tolist() == again[[0, 2]].tolist()


def test_rows_without_ids_get_one_per_episode_of_their_stream_and_a_running_episode_keeps_its_id():
    t = Trajectories()
    t.next_id = 10  # as counted on from the store's largest id (no store needed once known)
    ids = t.new_ids(np.array([0, 0, 0, 1, 1]), np.array([False, True, False, False, False]), store=None)
    assert ids.tolist() == [10, 10, 11, 12, 12] and t.next_id == 13
    ids = t.new_ids(np.array([0, 1, 1]), np.array([True, False, True]), store=None)
    assert ids.tolist() == [11, 12, 12] and t.next_id == 13  # both episodes went on, then ended
    ids = t.new_ids(np.array([1, 0]), np.array([False, False]), store=None)
    assert ids.tolist() == [14, 13] and t.next_id == 15  # new episodes: new ids, by stream
    t.written(np.array([40, 3]), store=None)
    assert t.next_id == 41  # ids a collector wrote are never given again


def test_one_hot_actions_are_rows_of_a_discrete_width():
    one_hot = torch.tensor([[0, 1, 0], [1, 0, 0]])
    assert is_one_hot(one_hot, None) and is_one_hot(one_hot, spaces.Discrete(3))
    assert not is_one_hot(one_hot, spaces.Discrete(4))  # another width: not this space's one-hot
    assert not is_one_hot(one_hot.float(), spaces.Box(0, 1, (3,)))  # a Box action space: vectors are vectors
    assert not is_one_hot(torch.tensor([[1, 1, 0]]), None) and not is_one_hot(torch.tensor([1, 0]), None)
