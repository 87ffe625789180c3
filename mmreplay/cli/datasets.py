"""``mmreplay export`` and ``mmreplay import``: a store's episodes to and from Minari, D4RL-style and d3rlpy
datasets and Dopamine's replay checkpoints (``mmreplay.datasets`` does the work; docs/datasets.md).

Invariant: options that only one format can hold are refused for the others with an error naming them,
never silently dropped; an ``--episodes`` selection that is malformed, empty or reaches past the store's
exportable episodes is refused before anything is written (never an empty or clipped dataset); a
D4RL-style or d3rlpy source that is not a readable HDF5 file is refused naming it. The summary (one JSON
line) goes to stdout, notes to stderr.
"""

from __future__ import annotations

import json
import os
import sys

from mmreplay.cli.progress import Progress

FORMATS = ("minari", "d4rl", "d3rlpy", "dqn-replay")

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
    p.add_argument("--checkpoint-rows", type=int, help="dqn-replay: rows a Dopamine checkpoint holds (default: the "
                                                       "imported checkpoints', else 1000000)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import", help="make a new store from a Minari, D4RL-style or d3rlpy dataset")
    p.add_argument("src", help="minari: dataset directory or id; d4rl, d3rlpy: an .hdf5 file")
    p.add_argument("path", help="the new store (must not exist)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--capacity", type=int, help="transitions kept (default: unbounded; dqn-replay: the checkpoints' "
                                                "rows, the index allocated once)")
    p.add_argument("--frame-stack", type=int, help="default: the exported store's, else 1")
    p.add_argument("--reward-values", help="comma-separated clipped reward values to bit-pack, e.g. -1,0,1")
    p.add_argument("--block-rows", type=int, default=4096, help="rows read per block (bounds memory)")
    q = p.add_argument_group("Dopamine replay checkpoints (--format dqn-replay; SRC: their directory)")
    q.add_argument("--checkpoints", help="which: 0,1,5-9 (default: all)")
    q.add_argument("--resume", action="store_true", help="continue an interrupted import of the same command "
                                                          "where its last commit ended (else it starts over)")
    q.add_argument("--num-actions", type=int, help="the action space's size (default: largest action + 1; 18 for "
                                                   "Atari's full set)")
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


EPISODES_FORMS = "a range like 0:100 (start < stop, either may be left out, an optional :step > 0) or " \
                 "positions like 3,5,7, all non-negative integers"


def _episode_selection(text: str | None):
    """``"0:100"`` / ``":10"`` / ``"5:"`` / ``"0:100:2"`` -> a slice; ``"3,5,7"`` -> positions; None -> all.
    Only the form is checked here (non-negative integers, start < stop, step > 0); whether the positions
    exist in the store is ``_check_selection``'s."""
    if text is None:
        return None
    try:
        if ":" in text:
            parts = [int(p) if p.strip() else None for p in text.split(":")]
            if len(parts) > 3 or any(p is not None and p < 0 for p in parts):
                raise ValueError
        else:
            positions = [int(p) for p in text.split(",")]
            if any(p < 0 for p in positions):
                raise ValueError
            return positions
    except ValueError:
        raise ValueError(f"--episodes {text!r}: expected {EPISODES_FORMS}") from None
    start, stop, *step = parts
    if start is not None and stop is not None and start >= stop:
        raise ValueError(f"--episodes {text!r} selects no episode: expected start < stop")
    if step and step[0] is not None and step[0] <= 0:
        raise ValueError(f"--episodes {text!r}: expected a step > 0")
    return slice(*parts)


def _check_selection(text: str, selection, exportable: int) -> None:
    """Refuse a selection that reaches past the store's ``exportable`` episodes or selects none (the
    library would clip a slice silently and write an empty dataset)."""
    if isinstance(selection, slice):
        reaches = selection.start or 0 if selection.stop is None else selection.stop - 1
        too_far = (selection.start or 0) >= exportable or (selection.stop is not None and selection.stop > exportable)
    else:
        reaches = max(selection)
        too_far = reaches >= exportable
    if too_far:
        have = f"positions 0 to {exportable - 1}" if exportable else "none"
        raise ValueError(f"--episodes {text!r} reaches episode position {reaches}, but the store has {exportable} "
                         f"exportable episode(s) ({have}; --include-partial also counts cut and unfinished ones)")


def _print_summary(summary: dict) -> None:
    for note in summary.pop("notes", []):
        print(f"note: {note}", file=sys.stderr)
    print(json.dumps(summary))


def cmd_export(args) -> int:
    from mmreplay.datasets import export_dataset
    from mmreplay.datasets.episodes import list_episodes
    from mmreplay.store import Store

    selection = _episode_selection(args.episodes)
    kwargs = {"include_partial": args.include_partial, "episodes": selection,
              "block_rows": args.block_rows, "progress": Progress(f"exporting to {args.format}", unit="transitions"),
              "compression": args.compression}
    if args.format == "dqn-replay":
        _refuse_for_dqn_replay(args, ("--episodes", args.episodes), ("--include-partial", args.include_partial),
                               ("--compression", args.compression))
        kwargs = {"block_rows": args.block_rows, "progress": kwargs["progress"], "capacity": args.checkpoint_rows}
    elif args.checkpoint_rows is not None:
        raise ValueError("--checkpoint-rows applies to --format dqn-replay only")
    if args.format == "minari":
        kwargs.update(dataset_id=args.dataset_id, env_spec=_env_spec_arg(args.env_id), author=args.author,
                      author_email=args.author_email, code_permalink=args.code_permalink,
                      algorithm_name=args.algorithm_name, description=args.description,
                      data_format=args.data_format or "hdf5")
    else:
        given = [flag for key, flag in MINARI_ONLY.items() if getattr(args, key)]
        if given:
            raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --format minari only")
    _check_positive("--block-rows", args.block_rows)
    # absolute: a relative Minari dataset directory came out as OUT/data/OUT/data/main_data.hdf5
    out = os.path.abspath(args.out) if args.format == "minari" else args.out
    with Store.open(args.path, mode="r") as store:
        if selection is not None:
            exportable = len(list_episodes(store, include_partial=args.include_partial).episodes)
            _check_selection(args.episodes, selection, exportable)
        summary = export_dataset(store, out, args.format, **kwargs)
    _print_summary(summary)
    return 0


def _refuse_for_dqn_replay(args, *flags) -> None:
    given = [flag for flag, value in flags if value]
    if given:
        raise ValueError(f"{', '.join(given)}: not for --format dqn-replay (it exports every transition, as "
                         "Dopamine's checkpoints hold them)")


def _check_positive(flag: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{flag} {value}: expected a positive integer")


def _check_hdf5_source(src: str, fmt: str) -> None:
    """A D4RL-style or d3rlpy source must be a readable HDF5 file: said here in one line naming it, where
    h5py would say "file signature not found" without naming the file."""
    expected = f"expected a {fmt} dataset, an .hdf5 file"
    if not os.path.exists(src):
        raise FileNotFoundError(f"{src!r}: no such file ({expected})")
    if os.path.isdir(src):
        raise ValueError(f"{src!r} is a directory ({expected})")
    from mmreplay.datasets.sources import regular_file

    regular_file(src, f"{fmt} dataset")  # before the open: a FIFO would block it
    with open(src, "rb"):  # an unreadable file: PermissionError naming it
        pass
    try:
        import h5py
    except ImportError:
        raise ImportError(f"--format {fmt} needs h5py; pip install 'mmreplay[d4rl]'") from None
    if not h5py.is_hdf5(src):
        raise ValueError(f"{src!r} is not an HDF5 file ({expected})")


def cmd_import(args) -> int:
    from mmreplay.datasets import import_dataset

    kwargs = {"capacity": args.capacity, "frame_stack": args.frame_stack,
              "progress": Progress("importing", unit="transitions")}
    for flag, value in (("--capacity", args.capacity), ("--frame-stack", args.frame_stack),
                        ("--block-rows", args.block_rows)):
        _check_positive(flag, value)
    if args.reward_values:
        kwargs["reward_values"] = _reward_values(args.reward_values)
    dqn_flags = (("--checkpoints", args.checkpoints), ("--resume", args.resume), ("--num-actions", args.num_actions))
    if args.format == "dqn-replay":
        _check_positive("--num-actions", args.num_actions)
        kwargs.update(checkpoints=args.checkpoints, resume=args.resume, num_actions=args.num_actions,
                      progress=Progress("importing", unit="rows"))
        if args.capacity is None:
            del kwargs["capacity"]  # the import's default: the checkpoints' rows
    elif any(value for _, value in dqn_flags):
        raise ValueError(f"{', '.join(f for f, v in dqn_flags if v)}: for --format dqn-replay only")
    elif args.format != "minari":
        _check_hdf5_source(args.src, args.format)
        kwargs["block_rows"] = args.block_rows
    try:
        summary = import_dataset(args.src, args.path, args.format, **kwargs)
    except (json.JSONDecodeError, OSError) as exc:
        if not _is_unreadable_data(exc):
            raise
        raise ValueError(f"{args.format} dataset {args.src!r} cannot be read: {exc}") from exc
    _print_summary(summary)
    return 0


def _is_unreadable_data(exc: Exception) -> bool:
    """A malformed JSON file, or h5py's plain OSError for a file that is not HDF5 ("file signature not
    found"): messages that name no file. An operating-system error (errno set: missing file, disk full),
    a subclass that says what it is (``FileExistsError``: the destination exists, ``PermissionError``...)
    or one of ours is reported as it is."""
    from mmreplay.errors import MMReplayError

    if isinstance(exc, json.JSONDecodeError):
        return True
    return type(exc) is OSError and not isinstance(exc, MMReplayError) and exc.errno is None and \
        exc.filename is None


def _reward_values(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--reward-values {text!r}: expected comma-separated numbers, e.g. -1,0,1") from None
