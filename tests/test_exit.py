"""A script that ends without close() loses nothing: the store commits at interpreter exit and when the
object is garbage collected (a crash still loses the uncommitted tail, as documented)."""

import os
import subprocess
import sys
import textwrap

import mmreplay
import synthetic as syn

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    import mmreplay, synthetic as syn
    s = mmreplay.Store.create({path!r}, syn.OBS_SPACE, syn.ACTION_SPACE, capacity=30_000, frame_stack=3,
                              reward_values=(-1, 0, 1))
    for g in range({n}):
        s.add(*syn.transition(g))
    {ending}
""")


def run(path, n, ending):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(here=HERE, path=path, n=n, ending=ending)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stderr


def test_a_script_that_never_closes_loses_nothing(store_path):
    stderr = run(store_path, 2000, "pass  # no close(), no flush()")
    assert "leaked shared_memory" not in stderr and "Warning" not in stderr, stderr
    with mmreplay.Store.open(store_path, mode="r") as s:
        assert s.inspect.valid_range() == (0, 2000)
        ids = [g for g in range(2000)]
        for lo in range(0, 2000, 500):
            assert syn.wrong_rows(s.inspect.get(ids[lo:lo + 500])) == []


def test_a_dropped_store_commits_when_collected(store_path):
    run(store_path, 700, "del s; import gc; gc.collect(); import os; os._exit(0)  # no atexit either")
    with mmreplay.Store.open(store_path, mode="r") as s:
        assert s.inspect.valid_range() == (0, 700)
