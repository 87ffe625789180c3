import json

import numpy as np
import pytest
from gymnasium import spaces

from mmreplay.columns.spec import ColumnSpec, Schema, schema_from_spaces, validate_name

IMG = spaces.Box(0, 255, (84, 84), np.uint8)


@pytest.mark.parametrize("n,bits", [(2, 1), (3, 2), (4, 2), (5, 4), (16, 4)])
def test_small_discrete_actions_are_packed(n, bits):
    schema = schema_from_spaces(IMG, spaces.Discrete(n))
    assert schema.action.kind == "packed" and schema.action.bits == bits


def test_large_discrete_uses_smallest_int():
    assert schema_from_spaces(IMG, spaces.Discrete(18)).action.dtype == "uint8"
    assert schema_from_spaces(IMG, spaces.Discrete(1000)).action.dtype == "uint16"
    assert schema_from_spaces(IMG, spaces.Discrete(18, start=-5)).action.dtype == "int8"


def test_rewards_packed_only_when_declared():
    assert schema_from_spaces(IMG, spaces.Discrete(4)).reward.kind == "numeric"
    reward = schema_from_spaces(IMG, spaces.Discrete(4), reward_values=(-1, 0, 1)).reward
    assert reward.kind == "packed" and reward.bits == 2 and reward.values == (-1.0, 0.0, 1.0)


def test_images_one_frame_per_chunk_low_dim_grouped():
    img = schema_from_spaces(IMG, spaces.Discrete(4)).observations[0]
    assert img.kind == "frame" and img.chunk_rows == 1
    vec = schema_from_spaces(spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(2)).observations[0]
    assert vec.chunk_rows == 256  # 4 KiB of float32[4]


def test_dict_observation_one_column_per_key():
    space = spaces.Dict({"pixels": spaces.Box(0, 255, (8, 8, 3), np.uint8), "state": spaces.Box(-1, 1, (3,))})
    schema = schema_from_spaces(space, spaces.Box(-1, 1, (2,)))
    assert [c.name for c in schema.observations] == ["pixels", "state"] and schema.dict_obs
    assert schema.action.kind == "numeric" and schema.action.shape == (2,)


def test_schema_json_round_trip():
    schema = schema_from_spaces(IMG, spaces.Discrete(4), reward_values=(-1, 0, 1), frame_stack=4,
                                extras=[ColumnSpec.numeric("lives", (), "int8")])
    again = Schema.from_json(json.loads(json.dumps(schema.to_json())))
    assert again == schema and again.spaces() == (IMG, spaces.Discrete(4))


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "a..b", "x" * 65, 3, "a\\b"])
def test_names_that_could_escape_the_store_are_rejected(name):
    with pytest.raises(ValueError, match="invalid"):
        validate_name(name)


def test_explicit_column_overrides_and_errors():
    schema = schema_from_spaces(IMG, spaces.Box(-1, 1, (1,)), columns={"reward": ColumnSpec.packed("reward", [0, 1])})
    assert schema.reward.bits == 1
    with pytest.raises(ValueError, match="override nothing"):
        schema_from_spaces(IMG, spaces.Discrete(2), columns={"bogus": ColumnSpec.numeric("bogus")})
    with pytest.raises(ValueError, match="do not fit|cannot be packed"):
        ColumnSpec.packed("r", range(17))
    with pytest.raises(ValueError, match="clash"):
        schema_from_spaces(IMG, spaces.Discrete(2), extras=[ColumnSpec.numeric("action")])
