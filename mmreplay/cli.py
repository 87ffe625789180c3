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
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mmreplay.errors import MMReplayError


class Progress:
    """A one-line progress bar on stderr (quiet when stderr is not a terminal, except the last line)."""

    def __init__(self, label: str):
        self.label = label
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.tty and done != total:
            return
        width = 30
        filled = width * done // max(1, total)
        rate = done / max(1e-9, time.monotonic() - self.start)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                         f"({rate:.0f}/s)")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def cmd_info(args) -> int:
    from mmreplay.store import Store

    with Store.open(args.path, mode="r") as store:
        info = store.info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"store {info['path']} (format {info['format_version']})")
    cap = "unbounded" if info["capacity"] is None else f"{info['capacity']:,}"
    print(f"  capacity {cap}, frame_stack {info['frame_stack']}")
    print(f"  transitions {info['transitions']:,} valid, {info['added']:,} added, "
          f"{info['episodes_started']:,} episode starts kept, {info['frames']:,} frames")
    print(f"  disk {info['disk_bytes'] / 1e6:,.2f} MB, {info['bytes_per_transition']:.1f} bytes per transition; "
          f"index RAM {info['index_ram_bytes_per_transition']:.2f} bytes per transition")
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
        problems = store.verify(progress=Progress("verifying shards"))
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

    run(n=args.n, batch_sizes=(32, 256))
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
              "block_rows": args.block_rows, "progress": Progress(f"exporting to {args.format}"),
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

    kwargs = {"capacity": args.capacity, "frame_stack": args.frame_stack, "progress": Progress("importing")}
    if args.reward_values:
        kwargs["reward_values"] = [float(v) for v in args.reward_values.split(",")]
    if args.format != "minari":
        kwargs["block_rows"] = args.block_rows
    _print_summary(import_dataset(args.src, args.path, args.format, **kwargs))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mmreplay", description="RL replay stores on disk.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="schema, counts, disk use and compression per column")
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
    p = sub.add_parser("bench", help="quick add/sample rates of this machine (scripts/bench.py compares peers)")
    p.add_argument("--n", type=int, default=20_000, help="transitions of synthetic 84x84 frames")
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
        return args.func(args)
    except (MMReplayError, FileExistsError, FileNotFoundError, ValueError, ImportError) as exc:
        print(f"mmreplay {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
