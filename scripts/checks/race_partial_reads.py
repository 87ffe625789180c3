"""A reader race that reaches partial run reads (``mmreplay/reading/runs.py``), which ``torture.py
--reader-race`` does not (its synthetic 6x5 frames do not compress, so its readers decode whole runs through
the decoded cache): real Atari frames (the test fixture), the layout-2 temporal codec, one writer process on a
wrapping 256-row ring committing every 1..30 adds, two reader processes with a 4 KiB budget (every run read
from its file, in part once the reader has its directory entry) checking every row against the ground truth.

    PYTHONPATH=. python scripts/checks/race_partial_reads.py [seconds] [store path]

Prints each reader's rows checked and wrong, file reads, partial reads and partial reads read again whole.
"""
import os
import shutil
import subprocess
import sys
import textwrap
import time

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 60
PATH = sys.argv[2] if len(sys.argv) > 2 else "/tmp/mmreplay_race_partial"
FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "data",
                       "atari_fixture.npz")
COMMON = textwrap.dedent("""
    import numpy as np, mmreplay, time, json, sys
    from gymnasium import spaces
    FR = np.load({fixture!r})["frames"]
    def F(g): return FR[(g * 7) % len(FR)]
    def stack(g): return np.stack([F(max(0, x)) for x in (g - 2, g - 1, g)])
""".replace("{fixture!r}", repr(FIXTURE)))
WRITER = COMMON + textwrap.dedent(f"""
    rng = np.random.default_rng(1)
    s = mmreplay.Store.create({PATH!r}, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(4), capacity=256,
                              frame_stack=3, frame_codec={{"name": "temporal", "run": 8, "layout": 2}}, durable=False)
    g, end, left = 0, time.monotonic() + {SECONDS} + 5, 0
    while time.monotonic() < end:
        s.add(F(g), g % 4, 0.0, F(g + 1), False, False)
        g += 1
        left -= 1
        if left <= 0:
            s.flush(); left = int(rng.integers(1, 31))
    s.close()
""")
READER = COMMON + textwrap.dedent(f"""
    seed = int(sys.argv[1])
    while True:
        try:
            s = mmreplay.Store.open({PATH!r}, mode="r", cache_bytes=4096); break
        except Exception:
            time.sleep(0.05)
    rng = np.random.default_rng(seed)
    rows = wrong = refused = 0
    end = time.monotonic() + {SECONDS}
    while time.monotonic() < end:
        s.refresh()
        lo, hi = s.inspect.valid_range()
        if hi - lo < 64:
            continue
        ids = sorted(set(rng.integers(lo, hi, 48).tolist()))
        try:
            b = s.inspect.get(ids)
        except IndexError:  # the writer gave the rows up meanwhile: a clear refusal, not wrong data
            refused += 1; continue
        for i, g in enumerate(ids):
            ok = np.array_equal(b.obs[i].numpy(), stack(g)) and np.array_equal(b.next_obs[i].numpy(), stack(g + 1))
            rows += 1; wrong += not ok
    d = s.inspect.cache_stats()["obs"]["disk"]
    print(json.dumps(dict(rows=rows, wrong=wrong, refused=refused, file_reads=d["reads"],
                          partial_chunks=d["partial_chunks"], partial_retries=d["partial_retries"])))
""")
shutil.rmtree(PATH, ignore_errors=True)
w = subprocess.Popen([sys.executable, "-c", WRITER])
time.sleep(3)
rs = [subprocess.Popen([sys.executable, "-c", READER, str(i)], stdout=subprocess.PIPE, text=True) for i in range(2)]
failed = False
for r in rs:
    out = r.communicate()[0].strip()
    print("reader:", out or f"no result (exit code {r.returncode}: an error, see above)")
    failed |= r.returncode != 0 or '"wrong": 0,' not in out
w.wait()
print("writer exit code", w.returncode)
shutil.rmtree(PATH, ignore_errors=True)
sys.exit(1 if failed or w.returncode else 0)
