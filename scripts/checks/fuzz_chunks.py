"""Hostile-chunk fuzzing of both read paths (issue 23, case 3): real chunks and shard files, mutated.

    python scripts/checks/fuzz_chunks.py [--chunks 600000] [--shards 4000] [--seed 0] [--batch 4000]

Two levels, each through both read paths, every case in a child process (a crash is caught and counted,
with the seed and batch that reproduce it):

- **codec** (``--chunks`` per path): an encoded chunk (Atari frames with blosc lz4hc, incompressible
  frames, float32 rows with blosc lz4 + shuffle, frames with zstd) mutated: bit flips, truncations (with
  the header left claiming the full size, or edited to match), blosc header fields (version, flags,
  typesize, nbytes, blocksize, cbytes, block starts), zstd frame header fields, bytes inserted or
  appended, ranges overwritten; the crc32c recomputed (the hostile case) for 90%. Each goes through the
  file path (``shardfile.decode_chunk`` -> ``codecs.Compressor`` -> numcodecs) and the compiled path
  (``native.decode_chunks``, as ``reading/frames.py`` calls it), reading from a buffer that ends at a
  page followed by an unreadable one (an over-read crashes) into a destination followed by sentinel
  bytes (an over-write is counted). Outcomes: refused (``CorruptDataError`` / a failed status), the
  original bytes, or a *forgery*: a valid stream of other bytes, which no format check can tell from the
  original (its checksum was recomputed) and which only the shard's identity tag can refuse (next level).
  Failures: a crash, another exception, a write past the destination, or a success where the payload is
  shorter than its header claims (what numcodecs used to decode as garbage).
- **store** (``--shards`` per path): a committed shard file of a real store mutated (a chunk as above,
  an index entry: offsets and sizes, ones that wrap around 2**64, with the index crc recomputed; the
  identity tag) and read as a store reads it: ``ShardedArray.read_chunk`` with the commit's identities
  (file path), and ``ResidentShards.load`` with ``ShardedArray.check_file`` then ``native.decode_chunks``
  (compiled path). Every chunk must read as the original bytes or raise ``CorruptDataError``: any other
  bytes is a wrong row.

Prints one JSON line of counts; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the checkout's root (this file is scripts/checks/)
sys.path.insert(0, ROOT)

PAGE = mmap.PAGESIZE
SENTINEL = 0xA5
GUARD = 64

# -- originals ------------------------------------------------------------------------------------


def originals(seed: int) -> list[dict]:
    """Real encoded chunks: (spec, dtype, decoded bytes, encoded chunk with its crc)."""
    from mmreplay.storage.format.codecs import Compressor
    from mmreplay.storage.format.shardfile import encode_chunk

    rng = np.random.default_rng(seed)
    frames = np.load(os.path.join(ROOT, "mmreplay", "data", "atari_fixture.npz"))["frames"]
    cases = []
    for i in range(0, 640, 80):
        cases.append(({"name": "blosc", "cname": "lz4hc", "clevel": 3}, frames[i:i + 1]))
        cases.append(({"name": "zstd", "level": 1}, frames[i:i + 1]))
    cases.append(({"name": "blosc", "cname": "lz4hc", "clevel": 3}, rng.integers(0, 256, (1, 84, 84), np.uint8)))
    cases.append(({"name": "blosc", "cname": "lz4", "clevel": 9}, frames[5:6]))
    cases.append(({"name": "blosc", "cname": "zstd", "clevel": 5}, frames[7:8]))
    rows = np.cumsum(rng.normal(size=(128, 8)), axis=0).astype(np.float32)
    cases.append(({"name": "blosc", "cname": "lz4", "clevel": 5}, rows))
    cases.append(({"name": "blosc", "cname": "lz4", "clevel": 5}, rng.normal(size=(128, 8)).astype(np.float32)))
    out = []
    for spec, data in cases:
        data = np.ascontiguousarray(data)
        comp = Compressor(spec, data.dtype)
        out.append({"spec": spec, "dtype": data.dtype.str, "shape": data.shape, "decoded": data.tobytes(),
                    "chunk": encode_chunk(comp, data)})
    return out


# -- mutations ------------------------------------------------------------------------------------

def _put_u32(body: bytearray, at: int, value: int) -> None:
    if at + 4 <= len(body):
        body[at:at + 4] = (value & 0xFFFFFFFF).to_bytes(4, "little")


def _interesting(rng, old: int) -> int:
    return int(rng.choice([0, 1, 2, 15, 16, 17, 255, 256, old - 1, old + 1, old * 2, old // 2, 1 << 31,
                           (1 << 32) - 1, (1 << 31) - 1, int(rng.integers(0, 1 << 32))]))


def mutate(rng, body: bytes, is_blosc: bool) -> tuple[bytes, str, bool]:
    """(mutated body, kind, shorter than its header claims)."""
    b = bytearray(body)
    kind = int(rng.integers(0, 9))
    lying = False
    if kind == 0:  # bit flips
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, len(b)))
            b[i] ^= 1 << int(rng.integers(0, 8))
        name = "bitflip"
    elif kind == 1:  # truncation, header unchanged
        b = b[:int(rng.integers(0, len(b)))]
        lying, name = True, "truncate"
    elif kind == 2:  # truncation with the header's cbytes edited to match
        b = b[:int(rng.integers(min(16, len(b)), len(b) + 1))]
        if is_blosc:
            _put_u32(b, 12, len(b))
        name = "truncate+cbytes"
    elif kind == 3 and is_blosc:  # one header field
        field = int(rng.integers(0, 7))
        if field < 4:
            b[field] = int(rng.integers(0, 256))
        else:
            at = 4 * (field - 3)
            _put_u32(b, at, _interesting(rng, int.from_bytes(b[at:at + 4], "little")))
        name = f"blosc-header-{['version', 'versionlz', 'flags', 'typesize', 'nbytes', 'blocksize', 'cbytes'][field]}"
    elif kind == 3:  # zstd frame header byte (descriptor, window, content size)
        i = int(rng.integers(4, min(len(b), 14)))
        b[i] = int(rng.integers(0, 256))
        name = "zstd-header"
    elif kind == 4 and is_blosc and len(b) >= 20:  # block starts
        n = max(1, (len(b) - 16) // 4)
        at = 16 + 4 * int(rng.integers(0, min(n, 8)))
        _put_u32(b, at, _interesting(rng, int.from_bytes(b[at:at + 4], "little")))
        name = "blosc-bstarts"
    elif kind == 4:  # zstd block header (first block after the frame header)
        i = int(rng.integers(5, min(len(b), 20)))
        b[i] ^= int(rng.integers(1, 256))
        name = "zstd-block"
    elif kind == 5:  # bytes appended (header still claims the old size)
        b += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
        name = "append"
    elif kind == 6:  # a range overwritten with random bytes
        i = int(rng.integers(0, len(b)))
        n = int(rng.integers(1, 32))
        b[i:i + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        name = "overwrite"
    elif kind == 7:  # bytes inserted in the middle
        i = int(rng.integers(0, len(b)))
        b[i:i] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
        name = "insert"
    else:  # nbytes and cbytes both edited consistently with a truncation (a header that tells a coherent lie)
        b = b[:int(rng.integers(min(16, len(b)), len(b) + 1))]
        if is_blosc:
            _put_u32(b, 12, len(b))
            _put_u32(b, 4, _interesting(rng, int.from_bytes(b[4:8], "little")))
        name = "coherent-lie"
    return bytes(b), name, lying


# -- guarded buffers ------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class GuardedSource:
    """A slot whose bytes end exactly where an unreadable page begins: reading one byte past them crashes."""

    def __init__(self, max_bytes: int):
        self.pages = -(-max_bytes // PAGE) + 1
        self.map = mmap.mmap(-1, (self.pages + 1) * PAGE)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        if _libc.mprotect(self.base + self.pages * PAGE, PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        self.view = memoryview(self.map)

    def place(self, data: bytes) -> tuple[memoryview, int]:
        """``data`` placed to end at the guard page: (a view of it, its address)."""
        end = self.pages * PAGE
        start = end - len(data)
        self.view[start:end] = data
        return self.view[start:end].toreadonly(), self.base + start


# -- the codec level ------------------------------------------------------------------------------

def _crc_of_views() -> None:
    """google_crc32c takes bytes, not views: the file path's checksum is given a copy of the guarded bytes
    (the decoder, what the guard page is for, still reads the guarded memory)."""
    import google_crc32c

    from mmreplay.storage.format import shardfile

    class Crc:
        @staticmethod
        def value(data):
            return google_crc32c.value(bytes(data))

    shardfile.google_crc32c = Crc


def codec_batch(path: str, seed: int, n: int, recompute: float = 0.9) -> dict:
    """``n`` mutated chunks through one read path (``file`` or ``compiled``): counts by outcome."""
    from mmreplay.errors import CorruptDataError
    from mmreplay import codecs
    from mmreplay._native import chunk_decode as native
    from mmreplay.storage.format.codecs import Compressor
    from mmreplay.storage.format.shardfile import crc32c, decode_chunk

    rng = np.random.default_rng([seed, 1 if path == "file" else 2])
    _crc_of_views()
    base = originals(0)
    src = GuardedSource(max(len(o["chunk"]) for o in base) + 256)
    counts = {"cases": 0, "refused": 0, "original": 0, "forgery": 0, "failed": 0}
    kinds: dict[str, int] = {}
    failures = []
    status = np.empty(1, dtype=np.int8)
    for i in range(n):
        o = base[int(rng.integers(0, len(base)))]
        is_blosc = o["spec"]["name"] == "blosc"
        body, kind, lying = mutate(rng, o["chunk"][:-4], is_blosc)
        kinds[kind] = kinds.get(kind, 0) + 1
        raw = body + (crc32c(body) if rng.random() < recompute else o["chunk"][-4:])
        view, addr = src.place(raw)
        nbytes = len(o["decoded"])
        dst = np.full(nbytes + GUARD, SENTINEL, dtype=np.uint8)
        ok = True
        if path == "file":
            out = dst[:nbytes].view(np.dtype(o["dtype"])).reshape(o["shape"])
            try:
                decode_chunk(Compressor(o["spec"], np.dtype(o["dtype"])), view, out, lambda: "fuzz")
            except CorruptDataError:
                ok = False
            except Exception as exc:  # noqa: BLE001 (any other exception is a finding)
                counts["failed"] += 1
                failures.append(f"{kind}: {type(exc).__name__}: {exc}")
                continue
        else:
            codec = codecs.for_config(o["spec"]).kernel_kind
            bad = native.decode_chunks(np.array([addr], np.int64), np.array([len(raw)], np.int64),
                                       np.array([dst.ctypes.data], np.int64), np.zeros(1, np.int64), nbytes, codec,
                                       status)
            ok = bad == 0
        counts["cases"] += 1
        if not (dst[nbytes:] == SENTINEL).all():
            counts["failed"] += 1
            failures.append(f"{kind}: wrote past the destination")
        elif not ok:
            counts["refused"] += 1
        elif dst[:nbytes].tobytes() == o["decoded"]:
            counts["original"] += 1
        elif lying:
            counts["failed"] += 1
            failures.append(f"{kind}: a payload shorter than its header decoded")
        else:
            counts["forgery"] += 1
    return {"counts": counts, "kinds": kinds, "failures": failures[:20]}


# -- the store level ------------------------------------------------------------------------------

def make_store(path: str) -> dict:
    """A small store of real frames, closed; returns {shard: file bytes} of its sealed frame shards."""
    import mmreplay
    from gymnasium import spaces

    frames = np.load(os.path.join(ROOT, "mmreplay", "data", "atari_fixture.npz"))["frames"]
    with mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(4), capacity=600,
                               durable=False) as s:
        for g in range(300):
            s.add(frames[g], 0, 0.0, frames[g + 1], False, False)
    return {}


def store_batch(path: str, seed: int, n: int, store: str) -> dict:
    """``n`` mutated committed shard files read the way the store reads them, through one path."""
    import mmreplay
    from mmreplay.errors import CorruptDataError
    from mmreplay import codecs
    from mmreplay._native import chunk_decode as native
    from mmreplay.reading.resident import ResidentShards
    from mmreplay.storage.format.shardfile import CRC_BYTES, crc32c, index_nbytes, tag_nbytes

    rng = np.random.default_rng([seed, 3 if path == "file" else 4])
    from mmreplay.storage.durability.commit import read_commit
    from mmreplay.storage.format.layout import frame_layout
    from mmreplay.storage.format.sharded import ShardedArray, expect_identities

    with mmreplay.Store.open(store, mode="r") as s:  # the store's own geometry and schema
        geometry, spec = s.geometry, s.schema.observations[0]
    # the frame array as the store opens it: its layout, and the identities its commit record expects
    layout = frame_layout(spec, geometry.frames.rows, geometry.frames.shard_rows)
    array = ShardedArray(store, layout)
    expect_identities([array], read_commit(store))
    per = layout.chunks_per_shard
    files = {}
    for shard in range(2):  # sealed shards
        with open(layout.shard_file(store, shard), "rb") as f:
            files[shard] = f.read()
    truth = {}
    for shard in files:
        out = np.empty((per, 84, 84), np.uint8)
        for inner in range(per):
            array.read_chunk(shard * per + inner, out[inner:inner + 1])
        truth[shard] = out
    counts = {"cases": 0, "refused": 0, "original": 0, "wrong": 0}
    kinds: dict[str, int] = {}
    failures = []
    for _ in range(n):
        shard = int(rng.integers(0, len(files)))
        raw = bytearray(files[shard])
        index_at = len(raw) - index_nbytes(per)
        index = np.frombuffer(bytes(raw[index_at:len(raw) - CRC_BYTES]), dtype="<u8").reshape(per, 2).copy()
        what = int(rng.integers(0, 4))
        if what <= 1:  # a chunk, mutated as at the codec level, its crc recomputed, the index following it
            inner = int(rng.integers(0, per))
            off, size = (int(v) for v in index[inner])
            body, kind, _ = mutate(rng, bytes(raw[off:off + size - CRC_BYTES]), True)
            chunk = body + crc32c(body)
            raw[off:off + size] = chunk
            delta = len(chunk) - size
            index[inner, 1] = len(chunk)
            later = index[:, 0] > off
            index[later, 0] = (index[later, 0].astype(np.int64) + delta).astype(np.uint64)
            index_at += delta
            kind = "chunk-" + kind
        elif what == 2:  # an index entry: offsets and sizes, wrapping ones included
            inner = int(rng.integers(0, per))
            col_ = int(rng.integers(0, 2))
            choice = int(rng.integers(0, 5))
            old = int(index[inner, col_])
            value = [(1 << 64) - 1 - int(rng.integers(0, 1 << 32)), (1 << 64) - old, old + int(rng.integers(-64, 64)),
                     int(rng.integers(0, len(raw))), (1 << 64) - (1 << 30)][choice] % (1 << 64)
            index[inner, col_] = np.uint64(value)
            kind = f"index-{'offset' if col_ == 0 else 'nbytes'}-{choice}"
        else:  # the identity tag
            tag_at = index_at - tag_nbytes(per)
            i = tag_at + int(rng.integers(0, tag_nbytes(per)))
            raw[i] ^= 1 << int(rng.integers(0, 8))
            kind = "tag"
        kinds[kind] = kinds.get(kind, 0) + 1
        index_bytes = index.astype("<u8").tobytes()
        raw[index_at:] = index_bytes + crc32c(index_bytes)  # the index crc recomputed: hostile
        with open(layout.shard_file(store, shard), "wb") as f:
            f.write(raw)
        got = np.zeros((per, 84, 84), np.uint8)
        refused = np.zeros(per, dtype=bool)
        array.forget([shard])
        if path == "file":
            for inner in range(per):
                try:
                    array.read_chunk(shard * per + inner, got[inner:inner + 1])
                except CorruptDataError:
                    refused[inner] = True
        else:
            res = ResidentShards(store, layout, layout.rows)
            res.check_file = array.check_file
            if not res.load(shard, 1 << 30):
                refused[:] = True  # not held: the file path reads it (and is fuzzed above)
            else:
                lo = shard * per
                addr, sizes = res.chunk_addr[lo:lo + per], res.chunk_size[lo:lo + per]
                status = np.zeros(per, dtype=np.int8)
                held = addr > 0
                refused[~held] = True
                if held.any():
                    dst = got.ctypes.data + np.flatnonzero(held).astype(np.int64) * 7056
                    native.decode_chunks(addr[held], sizes[held], dst, np.zeros(int(held.sum()), np.int64), 7056,
                                         codecs.for_config(layout.codec).kernel_kind, status[:int(held.sum())])
                    refused[np.flatnonzero(held)[status[:int(held.sum())] != 0]] = True
                res.drop()
        counts["cases"] += 1
        wrong = ~refused & (got != truth[shard]).reshape(per, -1).any(axis=1)
        if wrong.any():
            counts["wrong"] += 1
            failures.append(f"{kind}: chunks {np.flatnonzero(wrong)[:5].tolist()} read other bytes")
        elif refused.any():
            counts["refused"] += 1
        else:
            counts["original"] += 1
    for shard, raw in files.items():
        with open(layout.shard_file(store, shard), "wb") as f:
            f.write(raw)
    return {"counts": counts, "kinds": kinds, "failures": failures[:20]}


# -- driver ---------------------------------------------------------------------------------------

def run_child(args: list[str], timeout: float) -> tuple[dict | None, str]:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        return None, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


def fuzz(chunks: int, shards: int, seed: int, batch: int, quiet: bool = False) -> dict:
    report = {}
    crashes = []
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        make_store(store)
        for level, total, per_batch in (("codec", chunks, batch), ("store", shards, max(1, batch // 20))):
            for path in ("file", "compiled"):
                agg: dict = {}
                kinds: dict = {}
                failures: list = []
                t0 = time.perf_counter()
                done, b = 0, 0
                while done < total:
                    n = min(per_batch, total - done)
                    args = ["--child", level, path, str(seed * 1_000_003 + b), str(n), store]
                    result, error = run_child(args, timeout=600)
                    if result is None:
                        crashes.append({"level": level, "path": path, "args": args, "error": error})
                        agg["crashed_batches"] = agg.get("crashed_batches", 0) + 1
                    else:
                        for k, v in result["counts"].items():
                            agg[k] = agg.get(k, 0) + v
                        for k, v in result["kinds"].items():
                            kinds[k] = kinds.get(k, 0) + v
                        failures += result["failures"][:5]
                    done += n
                    b += 1
                report[f"{level}/{path}"] = {**agg, "seconds": round(time.perf_counter() - t0, 1),
                                             "kinds": kinds, "failures": failures[:20]}
                if not quiet:
                    print(json.dumps({f"{level}/{path}": {k: v for k, v in report[f"{level}/{path}"].items()
                                                          if k != "kinds"}}), flush=True)
    report["crashes"] = crashes
    return report


def failed(report: dict) -> bool:
    return bool(report["crashes"]) or any(r.get("failed", 0) or r.get("wrong", 0) or r.get("crashed_batches", 0)
                                          for k, r in report.items() if k != "crashes")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        level, path, seed, n, store = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
        result = codec_batch(path, seed, n) if level == "codec" else store_batch(path, seed, n, store)
        print(json.dumps(result))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=600_000, help="mutated chunks per read path (codec level)")
    ap.add_argument("--shards", type=int, default=4_000, help="mutated shard files per read path (store level)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=20_000, help="cases per child process")
    args = ap.parse_args()
    report = fuzz(args.chunks, args.shards, args.seed, args.batch)
    print(json.dumps(report))
    return 1 if failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
