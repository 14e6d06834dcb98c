"""The chaos run's view of a launch: where its ranks are (their status files), the progress line, and a hang."""

from __future__ import annotations

import pathlib
import time
from typing import Any

from croupier.demos.cluster import statuses
from croupier.harness.history import ChaosError

STALL = 120.0  # seconds without a step: the run has hung
POLL = 0.02  # seconds: the watch loop's refresh interval
BAR = 20  # characters of the progress line's bar


def furthest(st: list[dict[str, Any]]) -> dict[str, Any]:
    """The status of the rank furthest on (by epoch, then step)."""
    return max(st, key=lambda s: (s["epoch"], s["step"]))


def progress_line(s: dict[str, Any], number: int, world: int, faults: str) -> str:
    """The launch's progress as one line: the epoch's bar, its steps, the loss and the faults so far."""
    frac = min(1.0, s["k"] / max(1, s["of"]))
    return (f"  [launch {number}, {world} workers] epoch {s['epoch']} "
            f"{'#' * int(frac * BAR):.<{BAR}} {s['k']:>3}/{s['of']:<3} step {s['step']:>4} "
            f"loss {s['loss']:.4f}  {faults}")


class LaunchView:
    """What one launch's ranks say of themselves, read as the run watches it.

    Args:
        folder: The launch's status files (one a rank, see ``croupier.demos.demo_train``).
        number: The launch's number in the run.
        world: Its workers.
        log: The launch's log file, named in a hang's error.
    """

    def __init__(self, folder: pathlib.Path, number: int, world: int, log: str) -> None:
        self.folder, self.number, self.world, self.log = folder, number, world, log
        self.last_step, self.last_change, self.last_line = -1, time.monotonic(), ""

    def read(self, pids: set[int]) -> list[dict[str, Any]]:
        """The statuses of the ranks still training; every rank's pid seen is added to `pids`."""
        st = statuses(self.folder)
        pids.update(s["pid"] for s in st)
        return [s for s in st if not s.get("done")]

    def show(self, s: dict[str, Any], now: float, faults: str) -> None:
        """Notes the furthest rank's status `s` (seen at `now`) and prints the progress line when it changed."""
        if s["step"] != self.last_step:
            self.last_step, self.last_change = s["step"], now
        line = progress_line(s, self.number, self.world, faults)
        if line != self.last_line:
            print("\r" + line.ljust(100), end="", flush=True)
            self.last_line = line

    def check_stall(self) -> None:
        """Raises ChaosError when no rank has made a step for STALL seconds."""
        if time.monotonic() - self.last_change > STALL:
            raise ChaosError(f"no training step for {STALL:.0f} s (launch {self.number}, {self.world} workers); "
                             f"see {self.log}")
