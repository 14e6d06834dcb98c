"""A history of clients' calls, and a checker that it is linearizable: each job's generations as one register.

Clients record each call they make about a job's generations with the time they invoked it and the
time it returned (``time.monotonic()``: one clock for every process of a machine):

- ``join``: the generation the answer names (the rank joined it, or opened it as the next one);
- ``grant``: a grant (or lease) asked for generation g: ``ok``, or ``fenced`` (ABORTED: a newer one
  exists);
- ``checkpoint``: a checkpoint reported for generation g: ``ok`` or ``fenced``.

A call that failed without an answer (UNAVAILABLE, a timeout, a killed coordinator) may or may not
have taken effect: it is recorded as ``unknown`` and may be placed anywhere after its invocation,
or nowhere. A join without an answer names no generation: placed, it opened the next one; not
placed, it did nothing or joined the current one (which changes nothing the model holds).

The model is the job's current generation, a number c (0 before any join). In the order the
calls take effect: a join that names g needs g == c (joined) or g == c + 1 (opened), and leaves
c = g; a grant or checkpoint for g that was answered ``ok`` needs g == c, and ``fenced`` needs g < c.
The history is linearizable if the calls can be put in one order that the model accepts and that
keeps real time: a call that returned before another was invoked comes first.

A replica on PostgreSQL may answer a grant from a state up to its staleness bound old
(``croupier serve --max-staleness-ms``): ``check(..., stale_s=)`` lets a grant take effect that much
before its invocation. Joins and checkpoints are writes and get no such slack.

The search is Wing and Gong's, with Lowe's memo of (calls placed, state) pairs; jobs are checked one
at a time (a register per job: the histories compose).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

KINDS = ("join", "grant", "checkpoint")
OUTCOMES = ("ok", "fenced", "unknown")


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded call: who made it, what it was, when it was invoked and when it returned (``inf``: never)."""

    process: str
    job: str
    kind: str
    generation: int
    outcome: str
    invoked: float
    returned: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS} (got {self.kind!r})")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES} (got {self.outcome!r})")
        if self.kind == "join" and self.outcome == "fenced":
            raise ValueError("a join is ok (with the generation it names) or unknown, not fenced")
        if not self.returned >= self.invoked:
            raise ValueError(f"returned {self.returned} before it was invoked at {self.invoked}")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether each job's calls are linearizable; for the first job that is not, its calls."""

    ok: bool
    jobs: int
    calls: int
    job: str | None = None
    why: str = ""


def check(calls: Iterable[Call], stale_s: float = 0.0, max_states: int = 2_000_000) -> Verdict:
    """Checks that the history is linearizable, job by job (see the module).

    Raises:
        RuntimeError: A job's search passed `max_states` explored (call, state) pairs: too concurrent
            a history to decide here (shorter runs, or fewer calls in flight).
    """
    by_job: dict[str, list[Call]] = {}
    for c in calls:
        by_job.setdefault(c.job, []).append(c)
    for job, cs in sorted(by_job.items()):
        if not _linearizable(cs, stale_s, max_states):
            return Verdict(False, len(by_job), sum(map(len, by_job.values())), job,
                           f"no order of job {job!r}'s {len(cs)} calls keeps real time and the generations: "
                           + "; ".join(_show(c) for c in sorted(cs, key=lambda c: c.invoked)))
    return Verdict(True, len(by_job), sum(map(len, by_job.values())))


def _show(c: Call) -> str:
    end = "never" if math.isinf(c.returned) else f"{c.returned:.6f}"
    return f"{c.process} {c.kind}(g={c.generation}) {c.outcome} [{c.invoked:.6f}, {end}]"


def _accepts(c: Call, state: int) -> int | None:
    """The state after `c` takes effect in `state`, or None if the model refuses it there."""
    g = c.generation
    if c.kind == "join":
        if c.outcome == "unknown":  # no answer, so no generation: it opened the next (or, skipped, joined the current)
            return state + 1
        return g if g in (state, state + 1) else None
    if c.outcome == "ok":
        return state if g == state else None
    if c.outcome == "fenced":
        return state if g < state else None
    return state  # a read without an answer constrains nothing


def _linearizable(calls: Sequence[Call], stale_s: float, max_states: int) -> bool:
    n = len(calls)
    # A grant may have been answered from a state up to stale_s old: it may take effect that much earlier.
    start = [c.invoked - (stale_s if c.kind == "grant" else 0.0) for c in calls]
    end = [c.returned for c in calls]
    optional = [c.outcome == "unknown" for c in calls]
    order = sorted(range(n), key=lambda i: start[i])
    required = sum(1 << i for i in range(n) if not optional[i])
    seen: set[tuple[int, int]] = set()

    # NOTE: iterative depth-first search; a frame is (placed set, state). A call may be placed next
    # if it was invoked before every unplaced required call returned.
    stack: list[tuple[int, int]] = [(0, 0)]
    while stack:
        placed, state = stack.pop()
        if placed & required == required:
            return True
        if (placed, state) in seen:
            continue
        seen.add((placed, state))
        if len(seen) > max_states:
            raise RuntimeError(f"linearizability search passed {max_states:,} states on {n} calls: too concurrent")
        horizon = min((end[i] for i in range(n) if not placed >> i & 1 and not optional[i]), default=math.inf)
        for i in order:
            if start[i] > horizon:
                break
            if placed >> i & 1:
                continue
            nxt = _accepts(calls[i], state)
            if nxt is not None:
                stack.append((placed | 1 << i, nxt))
            if optional[i]:  # or it never took effect
                stack.append((placed | 1 << i, state))
    return False


class Recorder:
    """Appends calls to a JSON-lines file as they return (one file per process; threads share one)."""

    def __init__(self, path: str, process: str) -> None:
        self.path, self.process = path, process
        self._lock = threading.Lock()

    @contextmanager
    def call(self, job: str, kind: str, generation: int = 0) -> Iterator[dict[str, Any]]:
        """Times the block as one call; the block sets ``out["generation"]`` (a join's answer) and
        ``out["outcome"]`` ("ok" unless set; an exception leaving the block records "unknown" unless it
        set "fenced")."""
        out: dict[str, Any] = {"generation": generation, "outcome": "ok"}
        t0 = time.monotonic()
        try:
            yield out
        except BaseException:
            if out["outcome"] == "ok":
                out["outcome"] = "unknown"
            raise
        finally:
            t1 = math.inf if out["outcome"] == "unknown" else time.monotonic()
            self._write(Call(self.process, job, kind, out["generation"], out["outcome"], t0, t1))

    def _write(self, c: Call) -> None:
        line = json.dumps({**dataclasses.asdict(c), "returned": None if math.isinf(c.returned) else c.returned})
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def load(paths: Iterable[str]) -> list[Call]:
    """The calls recorded in JSON-lines files (a last line cut short by a kill is skipped)."""
    out = []
    for path in paths:
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                d["returned"] = math.inf if d["returned"] is None else d["returned"]
                out.append(Call(**d))
    return out
