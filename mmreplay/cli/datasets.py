"""``mmreplay export`` and ``mmreplay import``: a store's episodes to and from Minari, D4RL-style and d3rlpy
datasets (``mmreplay.datasets`` does the work; docs/datasets.md).

Invariant: options that only one format can hold are refused for the others with an error naming them,
never silently dropped; the summary (one JSON line) goes to stdout, notes to stderr.
"""

from __future__ import annotations

import json
import sys

from mmreplay.cli.progress import Progress

FORMATS = ("minari", "d4rl", "d3rlpy")

#: export options that only a Minari dataset can hold (CLI flag -> export_minari keyword)
MINARI_ONLY = {"dataset_id": "--dataset-id", "env_id": "--env-id", "author": "--author",
               "author_email": "--author-email", "code_permalink": "--code-permalink",
               "algorithm_name": "--algorithm-name", "description": "--description", "data_format": "--data-format"}


def register(sub) -> None:
    p = sub.add_parser("export", help="write a store's episodes as a Minari, D4RL-style or d3rlpy dataset",
                       description="Lossless: observations are the stored frames, bit for bit (see docs/datasets.md).")
    p.add_argument("path", help="the store")
    p.add_argument("out", help="minari: a new dataset directory (<minari root>/<id> for minari.load_dataset); "
                               "d4rl, d3rlpy: a new .hdf5 file")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--episodes", help="which episodes, by position among the exported ones: 0:100 or 3,5,7")
    p.add_argument("--include-partial", action="store_true",
                   help="also episodes whose start the ring overwrote (from their first readable step) and "
                        "unfinished ones")
    p.add_argument("--compression", choices=("gzip", "lzf", "none"),
                   help="HDF5 filter, lossless (default gzip; lzf is faster, larger; minari arrow: none)")
    m = p.add_argument_group("Minari metadata (--format minari)")
    m.add_argument("--dataset-id", help="the dataset id (default: from OUT)")
    m.add_argument("--env-id",
                   help="the env that made the data, stored as env_spec so that dataset.recover_environment() "
                        "works: a gymnasium env id (CartPole-v1; module:Id for a package that registers it, e.g. "
                        "ale_py:ALE/Pong-v5), or for a wrapped env (AtariPreprocessing...) its EnvSpec JSON "
                        "(env.spec.to_json(), with additional_wrappers), inline or as a .json file")
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
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--capacity", type=int, help="transitions kept (default: unbounded)")
    p.add_argument("--frame-stack", type=int, help="default: the exported store's, else 1")
    p.add_argument("--reward-values", help="comma-separated clipped reward values to bit-pack, e.g. -1,0,1")
    p.add_argument("--block-rows", type=int, default=4096, help="rows read per block (bounds memory)")
    p.set_defaults(func=cmd_import)


def _env_spec_arg(text: str | None) -> str | None:
    """``--env-id``: an env id or EnvSpec JSON as given, or the contents of a file holding the JSON."""
    if text is not None and not text.lstrip().startswith("{") and text.endswith(".json"):
        try:
            with open(text) as f:
                return f.read()
        except OSError as exc:
            raise ValueError(f"--env-id {text!r}: cannot read the env spec JSON file ({exc.strerror})") from None
    return text


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


def cmd_export(args) -> int:
    from mmreplay.datasets import export_dataset

    kwargs = {"include_partial": args.include_partial, "episodes": _episode_selection(args.episodes),
              "block_rows": args.block_rows, "progress": Progress(f"exporting to {args.format}", unit="transitions"),
              "compression": args.compression}
    if args.format == "minari":
        kwargs.update(dataset_id=args.dataset_id, env_spec=_env_spec_arg(args.env_id), author=args.author,
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

    kwargs = {"capacity": args.capacity, "frame_stack": args.frame_stack,
              "progress": Progress("importing", unit="transitions")}
    if args.reward_values:
        kwargs["reward_values"] = [float(v) for v in args.reward_values.split(",")]
    if args.format != "minari":
        kwargs["block_rows"] = args.block_rows
    _print_summary(import_dataset(args.src, args.path, args.format, **kwargs))
    return 0
