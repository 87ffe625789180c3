"""The interface every benchmark mode implements (see ``benchmarks.modes``).

Invariant: a mode touches only ``results[mode.key]`` and its own flags.
"""
from __future__ import annotations


class Mode:
    """The interface of a benchmark mode (see the module docstring); the defaults do nothing."""

    key: str = ""
    exclusive: bool = False
    tasks: dict = {}

    def add_arguments(self, parser) -> None:
        """Add this mode's flags to the ``bench.py`` parser."""

    def finish_args(self, args, quick: bool, argv: list[str]) -> None:
        """Fill defaults that depend on ``--quick`` (flags left at None); ``argv`` is the command line."""

    def requested(self, args) -> bool:
        return False

    def run(self, runner) -> dict:
        raise NotImplementedError

    def report(self, part: dict, results: dict, args) -> list[str]:
        """Report sections for ``results[self.key]`` (``part``)."""
        return []

    def targets(self, part: dict, args, add) -> None:
        """``add(name, value, threshold, unit="x", le=False)`` per pass/fail target."""

    def reaggregate(self, part: dict, args) -> None:
        """``--report-from``: recombine the saved rounds with the saved arguments."""
