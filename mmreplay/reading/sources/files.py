"""The files as a source of frames: chunks the RAM tiers lack, read from their shard files many at once
(``reading/disk.py``), runs of frames read only in the bytes a batch needs (``reading/runs.py``), and partial
reads whose frame checksums fail read again whole. Every disk-path change of the reader lands here.

Invariant: what is decoded from here is what ``FileReads.read`` returned (the file the commit expects, each whole
chunk's checksum checked by its decode, each partial read's frames by theirs); a partial read that fails is never
returned as data: its run directory entry is forgotten and the run read whole. A run is recorded in the run
directory only after its whole chunk decoded (its checksum matched). The bytes read are released (their buffers
kept for the next batch) once no decode reads them, also when a decode fails; the file reads that run beside the
tier's decodes (one thread a reader, made again in a forked child) have ended before a batch returns or raises.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

import numpy as np

from mmreplay._native import decode as native
from mmreplay._native.bounds import address_of
from mmreplay.reading.decoding import SHARED_MIN_RUNS, Decoder
from mmreplay.reading.disk import ChunkBytes, FileReads

if TYPE_CHECKING:
    from mmreplay.reading.requests import RunRequests
    from mmreplay.reading.tiers import ColumnReader


class FileSource:
    """Chunks of each column read from their files (see the module invariant), ``io_depth`` reads in flight."""

    def __init__(self, io_depth: int, decoder: Decoder):
        self.reads = FileReads(io_depth)
        self.decoder = decoder
        self._thread: ThreadPoolExecutor | None = None  # see _read_runs_beside
        self._thread_pid = -1
        self._thread_lock = threading.Lock()

    def compressed_chunks(self, col: "ColumnReader", chunks: np.ndarray) -> ChunkBytes:
        """The stored bytes of ``chunks`` (unique), read whole and checked as ``FileReads.read`` does; the caller
        releases them (``ChunkBytes.release``) once it is done with them."""
        return self.reads.read(col.column.array, chunks, col.disk)

    def read_into_slots(self, col: "ColumnReader", chunks: np.ndarray, slots: np.ndarray) -> None:
        """Chunks into the decoded cache's ``slots``: read together, then checked and decoded by the compiled
        decoders; without them, one chunk at a time through the codec (numcodecs)."""
        col.tier.misses += int(chunks.size)
        cache = col.cache
        if col.codec is None:
            slab, read = cache.slab, col.column.array.read_chunk
            for chunk, slot in zip(chunks.tolist(), slots.tolist()):
                read(chunk, slab[slot])
            return
        got = self.reads.read(col.column.array, chunks, col.disk)
        if got.empty.any():  # allowed by check_empty_chunk: the writer's next lap (zarr's fill value)
            cache.slab[slots[got.empty]] = 0
        held = ~got.empty
        if held.any():
            dst = address_of(cache.slab) + slots[held].astype(np.int64) * cache.chunk_nbytes
            self.decoder.decode_chunks(col, chunks[held], got.addresses()[held], got.sizes[held], dst,
                                       np.zeros_like(dst), cache.chunk_nbytes, (cache.slab,))

    def read_runs_into_batch(self, col: "ColumnReader", req: "RunRequests", from_files: np.ndarray, src: np.ndarray,
                             sizes: np.ndarray, decode_tier: Callable[[], None]) -> None:
        """The frames ``req`` asks of runs ``from_files`` (groups of ``req``) read from their files and decoded
        into place, while this thread runs ``decode_tier()`` (the tier's runs). ``src`` / ``sizes`` get the read
        bytes of each group read (0 stays where a run is empty: the caller copies those through the cache)."""
        col.tier.misses += int(from_files.size)
        keep = []  # the bytes read from the files, alive until decoded, then their buffers kept
        try:
            got, first, last = self._read_runs_beside(col, req, from_files, decode_tier)
            keep.append(got)
            read = ~got.empty
            src[from_files[read]] = got.addresses()[read]
            sizes[from_files[read]] = got.sizes[read]
            whole = got.read_whole()
            decode = np.zeros(src.size, dtype=bool)  # runs read whole, decoded once the partial reads are
            decode[from_files[whole]] = True
            to_record = [(from_files[whole], got, whole)] if col.runs is not None else []
            part = read & ~whole
            if part.any():
                failed = self._decode_partial(col, req, src, from_files[part], first[part], last[part])
                if failed.size:  # stale entries or corrupt bytes: the whole runs, whose checksums decide
                    col.runs.forget_chunks(req.chunks[failed])
                    col.disk.partial_retries += int(failed.size)
                    again = self.reads.read(col.column.array, req.chunks[failed], col.disk)
                    keep.append(again)
                    src[failed] = np.where(again.empty, 0, again.addresses())
                    sizes[failed] = np.where(again.empty, 0, again.sizes)
                    decode[failed[~again.empty]] = True
                    to_record.append((failed[~again.empty], again, ~again.empty))
            groups = np.flatnonzero(decode)
            if groups.size:
                self.decoder.decode_run_groups(col, req, src, sizes, groups)
            for groups, got, which in to_record:  # decoded above: each whole chunk's checksum matched
                if groups.size:
                    col.runs.record(req.chunks[groups], got.buffer, got.pos[which], got.sizes[which],
                                    got.offsets[which])
        finally:
            for got in keep:
                got.release()

    def _read_runs_beside(self, col: "ColumnReader", req: "RunRequests", from_files, decode_tier):
        """``_read_runs`` on the file-reads thread while this thread runs ``decode_tier()``; both have ended when
        it returns (no read writes into the batch's buffers afterwards), and an error of either is raised.
        Why a thread: the read path's Python (opening files, planning partial reads, the page-cache pass,
        checking what came back) took ~2.5 of a 19.5 ms DMC batch-256 while one core sat idle; beside the
        tier's decodes it costs their thread little (they run compiled, without the GIL)."""
        try:
            pending = self._reads_thread().submit(self._read_runs, col, req, from_files, None)
        except RuntimeError:  # the interpreter is shutting down: no new thread work, read in this thread
            return self._read_runs(col, req, from_files, decode_tier)
        try:
            decode_tier()
        except BaseException:
            with contextlib.suppress(BaseException):
                pending.result()[0].release()
            raise
        return pending.result()

    def _reads_thread(self) -> ThreadPoolExecutor:
        """One thread for ``_read_runs_beside``, made on first use (and again in a forked child, which has none
        of its parent's threads)."""
        with self._thread_lock:
            if self._thread_pid != os.getpid():
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="mmreplay-file-reads")
                self._thread_pid = os.getpid()
            return self._thread

    def _read_runs(self, col: "ColumnReader", req: "RunRequests", from_files, while_waiting):
        """Runs ``req.chunks[from_files]`` read from their files: whole, or (a column with a run directory) only
        the bytes of the frames the batch needs and those their chains lead to; ``while_waiting()`` runs while
        the reads wait for the device. Returns the bytes and, per run read, the first and last frame read (-1:
        read whole)."""
        first = np.full(from_files.size, -1, dtype=np.int64)
        last = np.full(from_files.size, -1, dtype=np.int64)
        runs, chunks = col.runs, req.chunks
        if runs is None:
            return self.reads.read(col.column.array, chunks[from_files], col.disk,
                                   while_waiting=while_waiting), first, last

        def narrow(at, offsets, sizes, listed):
            groups = from_files[at]
            take, sub_starts = req.requests_of(groups)
            plan = runs.plan(chunks[groups], sub_starts, req.js[take], offsets, sizes, listed)
            first[at], last[at] = plan.first, plan.last
            return plan.lo, plan.hi

        return self.reads.read(col.column.array, chunks[from_files], col.disk, narrow, while_waiting), first, last

    def _decode_partial(self, col: "ColumnReader", req: "RunRequests", src, groups, firsts, lasts) -> np.ndarray:
        """Groups ``groups`` decoded from their partial reads (``RunDirectory.decode``); returns those that
        failed (nothing of theirs is returned as data: the caller reads them whole)."""
        take, sub_starts = req.requests_of(groups)
        status = np.empty(groups.size, dtype=np.int8)
        helpers = self.decoder.helpers(groups.size, SHARED_MIN_RUNS)
        bad = col.runs.decode(src[groups], firsts, lasts, req.chunks[groups], sub_starts, req.js[take],
                              req.dsts[take], req.nbytes, req.run_rows, status, req.into, helpers)
        return groups[status != native.OK] if bad else groups[:0]

    def close(self) -> None:
        with self._thread_lock:
            if self._thread is not None and self._thread_pid == os.getpid():
                self._thread.shutdown(wait=True)
            self._thread, self._thread_pid = None, -1
        self.reads.close()
