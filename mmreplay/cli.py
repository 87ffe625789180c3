"""The ``mmreplay`` command: inspect, verify and demo stores from a shell.

    mmreplay info PATH [--json]
    mmreplay verify PATH
    mmreplay plot PATH [--out FILE.png]
    mmreplay bench [--n N]
    mmreplay demo [--out DIR]
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
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (MMReplayError, FileExistsError, ValueError) as exc:
        print(f"mmreplay {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
