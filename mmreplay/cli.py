"""The ``mmreplay`` command: inspect, verify and demo stores from a shell.

    mmreplay info PATH [--json]
    mmreplay verify PATH
    mmreplay plot PATH [--out FILE.png]
    mmreplay bench [--n N]
    mmreplay demo [--out DIR]
    mmreplay export PATH OUT --format minari|d4rl|d3rlpy [--episodes 0:100] [--include-partial]
                    [--compression gzip|lzf|none] [--env-id ID --author NAME --author-email E
                    --code-permalink URL --algorithm-name A --description TEXT --data-format hdf5|arrow]
    mmreplay import SRC PATH --format minari|d4rl|d3rlpy [--capacity N] [--frame-stack K]

Invariant: results go to stdout, progress bars (tqdm) and errors to stderr; a usage or input error is one
line and exit status 2, never a traceback; a closed stdout (``| head``) ends the command quietly (141).
Every command except ``demo``, ``bench`` and ``import`` only reads the store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from mmreplay.errors import MMReplayError


class Progress:
    """``progress(done, total)`` callbacks drawn as a tqdm bar on stderr (tqdm hides it when stderr is not
    a terminal). The bar is made at the first call, when the total is known, and closed at the last,
    leaving its final line (count, time, rate)."""

    def __init__(self, label: str, unit: str = "it"):
        self.label, self.unit = label, unit
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.label, unit=self.unit, disable=None, file=sys.stderr)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def info_figures(store) -> dict:
    """``store.info()`` plus what a user asks first: episodes and returns, stack padding, cache fit."""
    from mmreplay.stats import committed_priorities, episode_stats

    info = store.info()
    frame_bytes = sum(int(np.prod(s.shape, dtype=np.int64)) * s.np_dtype.itemsize for s in store.schema.observations)
    cache = store.cache_stats()
    cache_capacity = sum(c["capacity_bytes"] for c in cache.values())
    decoded = info["frames"] * frame_bytes
    info["stack_padding"] = store.schema.stack_padding
    info["decoded_frame_bytes"] = decoded
    info["cache"] = {"capacity_bytes": cache_capacity,
                     "fraction_of_frames": min(1.0, cache_capacity / decoded) if decoded else 1.0}
    info["episodes"] = episode_stats(store).summary()
    info["prioritized_samplers"] = {name: {"transitions": int(p.size), "min": float(p.min()) if p.size else None,
                                           "max": float(p.max()) if p.size else None}
                                    for name, p in committed_priorities(store.path).items()}
    return info


def cmd_info(args) -> int:
    from mmreplay.store import Store

    with Store.open(args.path, mode="r") as store:
        if args.json:
            print(json.dumps(info_figures(store), indent=2))
            return 0
        print(f"store {store.path}", flush=True)  # at once: the figures below read the whole index
        info = info_figures(store)
    cap = "unbounded" if info["capacity"] is None else f"{info['capacity']:,}"
    print(f"  format {info['format_version']}, capacity {cap}, frame_stack {info['frame_stack']}, "
          f"stack_padding {info['stack_padding']}")
    print(f"  transitions {info['transitions']:,} valid, {info['added']:,} added, {info['frames']:,} frames")
    ep = info["episodes"]
    print(f"  episodes {ep['complete']:,} complete, {ep['running']:,} running, {ep['cut']:,} cut by the ring "
          "(start overwritten)")
    if ep["return"]:
        r, n = ep["return"], ep["length"]
        print(f"  return mean {r['mean']:,.3g}, min {r['min']:,.3g}, max {r['max']:,.3g}, "
              f"last {r['last']} mean {r['last_100_mean']:,.3g}")
        print(f"  length mean {n['mean']:,.1f}, min {n['min']:,}, max {n['max']:,}")
    print(f"  disk {_mb(info['disk_bytes'])}, {info['bytes_per_transition']:.1f} bytes per transition; "
          f"decoded frames {_mb(info['decoded_frame_bytes'])}; index RAM "
          f"{info['index_ram_bytes_per_transition']:.2f} bytes per transition")
    c = info["cache"]
    print(f"  cache {_mb(c['capacity_bytes'])} of decoded frames when opened with the default budget "
          f"(Store.open(cache_bytes=...)): holds {c['fraction_of_frames']:.0%} of the kept frames")
    for name, p in info["prioritized_samplers"].items():
        print(f"  prioritized sampler {name!r}: priorities for {p['transitions']:,} transitions, "
              f"min {p['min']:.3g}, max {p['max']:.3g}")
    print(f"\n  {'array':28s} {'kind':8s} {'dtype':8s} {'shape':12s} {'bits':>4s} {'rows':>12s} "
          f"{'disk MB':>10s} {'ratio':>7s}")
    for c in info["columns"]:
        ratio = f"{c['compression_ratio']:.1f}x" if c["compression_ratio"] else "-"
        print(f"  {c['array']:28s} {c['kind']:8s} {c['dtype']:8s} {str(tuple(c['shape'])):12s} "
              f"{c['bits'] or '':>4} {c['rows']:>12,} {c['disk_bytes'] / 1e6:>10.3f} {ratio:>7s}")
    return 0


def cmd_verify(args) -> int:
    from mmreplay.store import Store

    with Store.open(args.path, mode="r") as store:
        problems = store.verify(progress=Progress("verifying", unit="shards"))
    for p in problems:
        print(f"BAD: {p}")
    print("store is intact" if not problems else f"{len(problems)} problem(s) found")
    return 0 if not problems else 1


def cmd_plot(args) -> int:
    try:
        from mmreplay.plot import plot_store
        out = plot_store(args.path, args.out)
    except ImportError as exc:
        print(f"mmreplay plot: needs matplotlib ({exc}); pip install 'mmreplay[plot]'", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def cmd_bench(args) -> int:
    from mmreplay.quickbench import run

    progress = Progress("adding", unit="transitions")
    try:
        run(n=args.n, batch_sizes=(32, 256), progress=progress)
    finally:
        progress.close()
    return 0


def cmd_demo(args) -> int:
    from mmreplay import demo

    return demo.main(["--out", args.out])


def _episode_selection(text: str | None):
    """``"0:100"`` / ``":10"`` / ``"-5:"`` -> a slice; ``"3,5,7"`` -> positions; None -> everything."""
    if text is None:
        return None
    try:
        if ":" in text:
            parts = [int(p) if p.strip() else None for p in text.split(":")]
            if len(parts) > 3:
                raise ValueError
            return slice(*parts)
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"--episodes {text!r}: expected a slice like 0:100 or positions like 3,5,7") from None


def _print_summary(summary: dict) -> None:
    for note in summary.pop("notes", []):
        print(f"note: {note}", file=sys.stderr)
    print(json.dumps(summary))


#: export options that only a Minari dataset can hold (CLI flag -> export_minari keyword)
MINARI_ONLY = {"dataset_id": "--dataset-id", "env_id": "--env-id", "author": "--author",
               "author_email": "--author-email", "code_permalink": "--code-permalink",
               "algorithm_name": "--algorithm-name", "description": "--description", "data_format": "--data-format"}


def cmd_export(args) -> int:
    from mmreplay.datasets import export_dataset

    kwargs = {"include_partial": args.include_partial, "episodes": _episode_selection(args.episodes),
              "block_rows": args.block_rows, "progress": Progress(f"exporting to {args.format}", unit="transitions"),
              "compression": args.compression}
    if args.format == "minari":
        kwargs.update(dataset_id=args.dataset_id, env_spec=args.env_id, author=args.author,
                      author_email=args.author_email, code_permalink=args.code_permalink,
                      algorithm_name=args.algorithm_name, description=args.description,
                      data_format=args.data_format or "hdf5")
    else:
        given = [flag for key, flag in MINARI_ONLY.items() if getattr(args, key)]
        if given:
            raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --format minari only")
    _print_summary(export_dataset(args.path, args.out, args.format, **kwargs))
    return 0


def cmd_import(args) -> int:
    from mmreplay.datasets import import_dataset

    kwargs = {"capacity": args.capacity, "frame_stack": args.frame_stack, "progress": Progress("importing", unit="transitions")}
    if args.reward_values:
        kwargs["reward_values"] = [float(v) for v in args.reward_values.split(",")]
    if args.format != "minari":
        kwargs["block_rows"] = args.block_rows
    _print_summary(import_dataset(args.src, args.path, args.format, **kwargs))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mmreplay", description="RL replay stores on disk.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="episodes and returns, counts, stack padding, cache fit, disk use per column")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("verify", help="check every committed chunk's checksum and size")
    p.add_argument("path")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("plot", help="PNG histograms of observations, rewards, actions and episode lengths")
    p.add_argument("path")
    p.add_argument("--out", default="mmreplay_plot.png")
    p.set_defaults(func=cmd_plot)
    p = sub.add_parser("bench", help="add/sample rates on real Atari frames, next to the reference run of "
                                     "mmreplay and its peers (scripts/bench.py)")
    p.add_argument("--n", type=int, default=20_000, help="transitions (the packaged real Atari fixture, replayed)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("demo", help="train a DQN on CartPole into a store, stop, resume, report")
    p.add_argument("--out", default="demo_out")
    p.set_defaults(func=cmd_demo)
    formats = ("minari", "d4rl", "d3rlpy")
    p = sub.add_parser("export", help="write a store's episodes as a Minari, D4RL-style or d3rlpy dataset",
                       description="Lossless: observations are the stored frames, bit for bit (see docs/datasets.md).")
    p.add_argument("path", help="the store")
    p.add_argument("out", help="minari: a new dataset directory (<minari root>/<id> for minari.load_dataset); "
                               "d4rl, d3rlpy: a new .hdf5 file")
    p.add_argument("--format", required=True, choices=formats)
    p.add_argument("--episodes", help="which episodes, by position among the exported ones: 0:100 or 3,5,7")
    p.add_argument("--include-partial", action="store_true",
                   help="also episodes whose start the ring overwrote (from their first readable step) and "
                        "unfinished ones")
    p.add_argument("--compression", choices=("gzip", "lzf", "none"),
                   help="HDF5 filter, lossless (default gzip; lzf is faster, larger; minari arrow: none)")
    m = p.add_argument_group("Minari metadata (--format minari)")
    m.add_argument("--dataset-id", help="the dataset id (default: from OUT)")
    m.add_argument("--env-id", help="gymnasium env id of the env that made the data (CartPole-v1; "
                                    "module:Id for a package that registers it, e.g. ale_py:ALE/Pong-v5): "
                                    "stored as env_spec, so dataset.recover_environment() works")
    m.add_argument("--author", action="append", help="author name (repeat for several)")
    m.add_argument("--author-email", action="append", help="author contact (repeat for several)")
    m.add_argument("--code-permalink", help="link to the versioned code that made the data")
    m.add_argument("--algorithm-name", help="the policy or algorithm that made the data")
    m.add_argument("--description", help="free text (default: names the source store)")
    m.add_argument("--data-format", choices=("hdf5", "arrow"), help="Minari's storage (default hdf5; arrow needs "
                                                                     "pyarrow)")
    p.add_argument("--block-rows", type=int, default=4096, help="transitions read per block (bounds memory)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import", help="make a new store from a Minari, D4RL-style or d3rlpy dataset")
    p.add_argument("src", help="minari: dataset directory or id; d4rl, d3rlpy: an .hdf5 file")
    p.add_argument("path", help="the new store (must not exist)")
    p.add_argument("--format", required=True, choices=formats)
    p.add_argument("--capacity", type=int, help="transitions kept (default: unbounded)")
    p.add_argument("--frame-stack", type=int, help="default: the exported store's, else 1")
    p.add_argument("--reward-values", help="comma-separated clipped reward values to bit-pack, e.g. -1,0,1")
    p.add_argument("--block-rows", type=int, default=4096, help="rows read per block (bounds memory)")
    p.set_defaults(func=cmd_import)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, not at interpreter exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        # The reader went away (``mmreplay info STORE | head -1``): not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again, and exit as a SIGPIPE'd
        # process does (128 + 13), like ``yes | head``.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (MMReplayError, FileExistsError, FileNotFoundError, ValueError, ImportError) as exc:
        print(f"mmreplay {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
