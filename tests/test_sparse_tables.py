"""Tables written sparsely cost RAM for the pages written, not for the 2 MiB huge pages around them
(``reading/sparse.py``; issue #42: the compressed tier's per-chunk tables grew 2 B a frame of a 50M import
with nothing held), read as zeros until written, and stay private to a forked child."""

import os
import re

import numpy as np
import pytest

from mmreplay.reading.resident import ResidentShards
from mmreplay.reading.sparse import grown_sparse, sparse_zeros


def _rss_kib_of(a: np.ndarray) -> int:
    """Resident KiB of the mappings that hold ``a`` (from /proc/self/smaps; the kernel may split one in two)."""
    addr = a.__array_interface__["data"][0]
    end = addr + a.nbytes
    inside, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                inside = lo < end and addr < hi
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")


def test_a_page_written_in_each_2_mib_costs_that_page_not_a_huge_page():
    a = sparse_zeros(64 << 20 >> 3, np.int64)  # 64 MiB
    assert a.dtype == np.int64 and a.size == 8 << 20 and not a.any()
    a[:: (2 << 20) >> 3] = 7  # one entry in each 2 MiB range: 32 pages written
    assert int(a.sum()) == 7 * 32
    # khugepaged's collapse would take ~64 MiB; the pages written are 128 KiB (slack for the kernel's own)
    assert _rss_kib_of(a) < 4096


def test_growth_keeps_the_entries_and_writes_nothing_else():
    a = sparse_zeros(1000, np.int64)
    a[[3, 999]] = [5, 6]
    g = grown_sparse(a, 5000)
    assert g.size == 5000 and g[3] == 5 and g[999] == 6 and np.count_nonzero(g) == 2


def test_a_forked_child_writes_its_own_copy():
    a = sparse_zeros(4096, np.int64)
    a[0] = 1
    pid = os.fork()
    if pid == 0:
        a[0] = 99
        a[1] = 98
        os._exit(0)
    os.waitpid(pid, 0)
    assert a[0] == 1 and a[1] == 0


def test_the_compressed_tiers_tables_are_sparse():
    class Layout:
        chunks_per_shard = 128
    res = ResidentShards("/nonexistent", Layout(), 6_975_744)  # the 50M import's chunk count
    assert _rss_kib_of(res.chunk_addr) < 1024 and _rss_kib_of(res.chunk_size) < 1024
    res.grow_address_space(7_000_000)
    assert res.chunk_addr.size == 7_000_000 and not res.chunk_size.any()
