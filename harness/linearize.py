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

Because the generation only grows, one step at a time, the check needs no search: it is a question of
the instants T_1 <= T_2 <= ... at which each generation opens. A call answered for g needs a point in
its interval between T_g and T_g+1; a fenced call for g needs T_g+1 before it returned; each T_g needs
a cause, a join acknowledged as g whose interval holds T_g or a join without an answer invoked before
it (each used once). :func:`check` places each T_g as early as these allow, in order (see
:func:`_earliest_openings` for why that decides), in O(n log n): a soak's tens of thousands of calls
take a moment. ``_search`` is Wing and Gong's search with Lowe's memo of (calls placed, state) pairs,
the general method, kept to cross-check it (``tests/tools/test_linearize.py`` checks both against a
brute-force oracle). Jobs are checked one at a time (a register per job: the histories compose).
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

from croupier.core.checks import check_choice

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
        check_choice("kind", self.kind, KINDS)
        check_choice("outcome", self.outcome, OUTCOMES)
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


def check(calls: Iterable[Call], stale_s: float = 0.0) -> Verdict:
    """Checks that the history is linearizable, job by job (see the module); when it is not, `why` names the
    generation that cannot open and shows the calls answered for it and the one before (up to 20)."""
    by_job: dict[str, list[Call]] = {}
    for c in calls:
        by_job.setdefault(c.job, []).append(c)
    for job, cs in sorted(by_job.items()):
        failed = _earliest_openings(cs, stale_s)
        if failed is not None:
            g, why = failed
            near = sorted((c for c in cs if c.generation in (g - 1, g) and c.outcome != "unknown"), key=lambda c: c.invoked)
            return Verdict(False, len(by_job), sum(map(len, by_job.values())), job,
                           f"no order of job {job!r}'s {len(cs)} calls keeps real time and the generations: {why}; "
                           + "; ".join(_show(c) for c in near[:20]))
    return Verdict(True, len(by_job), sum(map(len, by_job.values())))


def _earliest_openings(calls: Sequence[Call], stale_s: float) -> tuple[int, str] | None:
    """None if `calls` (one job's) are linearizable, else the generation that cannot open and why.

    With c the generation, T_g the instant it becomes g (T_0 = -inf) and [s, e] a call's interval (s
    earlier by `stale_s` for a grant): a call answered for g (a join acknowledged as g, a grant or a
    checkpoint ``ok``) needs T_g <= e and T_g+1 >= s; a ``fenced`` one for g needs T_g+1 <= e; T_g needs
    a cause, a join acknowledged as g with s <= T_g <= e or a join without an answer with s <= T_g,
    each used once (equal instants may be ordered either way, as the real-time order only binds a
    call that returned strictly before another began). Calls without an answer other than joins
    constrain nothing. Each T_g is then placed as early as its lower bounds allow (T_g-1, and s of
    each call answered for g-1), by its earliest cause:

    * a join acknowledged as g if one fits below T_g's upper bound (e of each call answered for g and
      each fenced for g-1), though a join without an answer would fit earlier: that join's own s is
      a lower bound of T_g+1 already (it was answered for g), so the later T_g binds nothing more, and
      the join without an answer stays for later;
    * else the join without an answer invoked first (any still unused that fits now fits later too).

    Placing each as early as it can go leaves every later generation the most room, so if this fails
    at g, no placement succeeds.
    """
    top = 0
    lo: dict[int, float] = {}  # g -> the latest s of a call answered for g (a lower bound of T_g+1)
    hi: dict[int, float] = {}  # g -> the earliest e that bounds T_g from above
    causes: dict[int, list[tuple[float, float]]] = {}  # g -> (s, e) of each join acknowledged as g
    unknown: list[float] = []
    for c in calls:
        s = c.invoked - (stale_s if c.kind == "grant" else 0.0)
        if c.outcome == "unknown":
            if c.kind == "join":
                unknown.append(s)
            continue
        g = c.generation
        if c.outcome == "fenced":
            hi[g + 1] = min(hi.get(g + 1, math.inf), c.returned)
            top = max(top, g + 1)
            continue
        lo[g] = max(lo.get(g, -math.inf), s)
        hi[g] = min(hi.get(g, math.inf), c.returned)
        top = max(top, g)
        if c.kind == "join":
            causes.setdefault(g, []).append((s, c.returned))
    unknown.sort()
    used = 0
    t = -math.inf  # T_g-1
    for g in range(1, top + 1):
        low, high = max(t, lo.get(g - 1, -math.inf)), hi.get(g, math.inf)
        if low > high:
            return g, (f"generation {g} must open at or after {low:.6f} (generation {g - 1} was still current then) "
                    f"and at or before {high:.6f} (a call had seen it, or a later one, by then)")
        acked = min((max(low, s) for s, e in causes.get(g, ()) if max(low, s) <= e), default=math.inf)
        if acked <= high and not math.isinf(acked):
            t = acked
        elif used < len(unknown) and max(low, unknown[used]) <= high:
            t = max(low, unknown[used])
            used += 1
        else:
            return g, (f"no join can have opened generation {g} between {low:.6f} and {high:.6f} (none acknowledged as "
                    f"{g} then, and {len(unknown) - used} of the {len(unknown)} joins without an answer left, the "
                    f"first invoked at {unknown[used] if used < len(unknown) else math.inf:.6f})")
    return None


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


def _search(calls: Sequence[Call], stale_s: float, max_states: int = 2_000_000) -> bool:
    """Wing and Gong's search (see the module): the general method, to cross-check :func:`_earliest_openings`."""
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
    """The calls recorded in JSON-lines files (a last line cut short by a kill is skipped).

    A call written more than once (lines with the same ``"call"`` number from one process: a join on
    record from its invocation, then how it ended) counts as its last line; ``refused`` (it changed
    nothing) drops it.
    """
    out: dict[tuple[str, int] | int, Call | None] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                call = d.pop("call", None)
                d["returned"] = math.inf if d["returned"] is None else d["returned"]
                refused = d["outcome"] == "refused"
                c = None if refused else Call(**d)
                out[(d["process"], call) if call is not None else len(out)] = c
    return [c for c in out.values() if c is not None]
