"""Progress bars of the ``mmreplay`` command.

Invariant: bars go to stderr only (stdout holds results), and tqdm hides them when stderr is not a
terminal, so piped or logged output carries no bar residue.
"""

from __future__ import annotations

import sys


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
