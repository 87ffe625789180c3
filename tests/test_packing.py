import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmreplay.columns import packing


@settings(max_examples=200, deadline=None)
@given(bits=st.sampled_from([1, 2, 4]), n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_pack_unpack_round_trip(bits, n, seed):
    codes = np.random.default_rng(seed).integers(0, 1 << bits, n).astype(np.uint8)
    buf = packing.pack(codes, bits)
    assert buf.size == packing.packed_nbytes(n, bits) == (n * bits + 7) // 8
    np.testing.assert_array_equal(packing.unpack(buf, bits, n), codes)
    if n:
        pos = np.random.default_rng(seed + 1).integers(0, n, 50)
        np.testing.assert_array_equal(packing.read_codes(buf, bits, pos), codes[pos])


@settings(max_examples=200, deadline=None)
@given(bits=st.sampled_from([1, 2, 4]), n=st.integers(1, 200), seed=st.integers(0, 2**32 - 1))
def test_write_codes_at_random_positions_matches_plain_array(bits, n, seed):
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, 1 << bits, n).astype(np.uint8)
    buf = packing.pack(truth, bits)
    for _ in range(5):
        pos = rng.choice(n, size=rng.integers(1, n + 1), replace=False)  # neighbours share bytes
        new = rng.integers(0, 1 << bits, pos.size).astype(np.uint8)
        packing.write_codes(buf, bits, pos, new)
        truth[pos] = new
        np.testing.assert_array_equal(packing.unpack(buf, bits, n), truth)


def test_layout_is_lsb_first():
    assert packing.pack(np.array([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    assert packing.pack(np.array([1, 0, 0, 0, 0, 0, 0, 1, 1]), 1).tolist() == [0b10000001, 1]


def test_bad_bits_rejected():
    with pytest.raises(ValueError, match="bits must be one of"):
        packing.pack(np.zeros(3), 3)


@pytest.mark.parametrize("n", [1, 7, 64, 1000])
def test_two_flag_columns_read_together_match_reading_each(n):
    rng = np.random.default_rng(n)
    first, second = rng.integers(0, 2, n), rng.integers(0, 2, n)
    a, b = packing.pack(first, 1), packing.pack(second, 1)
    pos = rng.integers(0, n, 3 * n)
    out_a, out_b = np.empty(pos.size, bool), np.empty(pos.size, bool)
    packing.bits_into(a, b, pos, out_a, out_b)
    assert (out_a == first[pos].astype(bool)).all() and (out_b == second[pos].astype(bool)).all()
