"""`croupier audit` of a torchft job: every sample once per epoch in the committed steps its ranks logged.

``StepLoader(audit_dir=...)`` makes every rank of every replica group log each attempted step in the
audit log every job writes (``croupier.tools.audit_log`` reads it into one :class:`Incarnation` per
run, steps numbered from 1): its run, step, quorum, this rank's part of the step and its indices, and
whether its group committed. The audit needs nothing else (no coordinator, no dealing rule):

* an attempt is (run, step, quorum); it trained if any group of it committed (torchft averaged
  every participant's gradient into that update), and then its samples are every part its ranks
  logged, which must cover the step whole (a part missing is reported, not guessed);
* within a run, a step trained again by a later quorum supersedes the earlier attempt (the groups
  that committed it alone died with their update);
* the kept steps are the latest run's lineage (``croupier.core.history.lineage``): the run after the
  step it resumed at, its parent run up to that step, and so on; what other runs trained is abandoned;
* the kept steps' samples, in step order, are the job's stream: each whole epoch of it (``n``
  samples) must hold every index once; the epoch in progress no index twice. Each kept step's size
  is checked against the loaders' promise (``global``: the batch; ``group``: batch x participants).

``croupier audit`` reports the verdict per epoch as it reports a job of generations
(``croupier.tools.audit``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from croupier.core.history import lineage
from croupier.tools.audit_log import Incarnation

__all__ = ["FtAudit", "audit_ft"]


@dataclasses.dataclass
class FtAudit:
    """One job's verdict: per epoch (samples, duplicates, missing), and what stopped the audit short."""

    job: str
    n: int
    steps: int  # kept committed steps
    epochs: list[tuple[int, int, int, int]]  # (epoch, samples, duplicates, missing); the last may be in progress
    wrong_batch: list[tuple[int, int, int]]  # (step, samples, promised)
    incomplete: list[int]  # kept steps some of whose parts no rank logged
    gaps: list[int]  # steps the kept timeline has no committed attempt of
    abandoned: int  # committed attempts the timeline does not keep
    epoch_of: dict[int, int] = dataclasses.field(default_factory=dict)  # kept step -> the epoch it begins in

    @property
    def ok(self) -> bool:
        whole = self.epochs[:-1] if self.epochs and self.epochs[-1][1] < self.n else self.epochs
        return (not self.wrong_batch and not self.incomplete and not self.gaps
                and all(d == 0 and m == 0 for _, _, d, m in whole)
                and all(d == 0 for _, _, d, _ in self.epochs))

    def problems(self, epoch: int) -> list[str]:
        """What is wrong with the kept steps that begin in `epoch`, in words."""
        out = []
        for what, steps in (("a part no rank logged", self.incomplete), ("no committed attempt", self.gaps),
                            ("another size than promised", [s for s, _, _ in self.wrong_batch])):
            mine = [s for s in steps if self.epoch_of.get(s, 0) == epoch]
            if mine:
                out.append(f"steps with {what}: {mine[:10]}{' ...' if len(mine) > 10 else ''}")
        return out


def _kept_runs(incs: list[Incarnation]) -> list[tuple[Incarnation, int | None]]:
    """The latest run's lineage: each run (oldest first) with the last step of it that is kept (None: open)."""
    by_name = {inc.name: inc for inc in incs}

    def parent(inc: Incarnation) -> tuple[Incarnation, int] | None:
        p = by_name.get(inc.resumed["incarnation"]) if inc.resumed else None
        return None if p is None or inc.resumed is None else (p, int(inc.resumed["step"]))

    return lineage(incs[-1], parent)


def _trained(incs: list[Incarnation]) -> tuple[dict[tuple[str, int], list[dict[str, Any]]], int]:
    """Each (run, step)'s committed attempt (a later quorum's supersedes), and how many were superseded."""
    attempts: dict[tuple[str, int, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for inc in incs:
        for r in inc.steps:
            attempts[(r["run"], r["step"], r["quorum"])].append(r)
    trained: dict[tuple[str, int], list[dict[str, Any]]] = {}
    superseded = 0
    for (run, step, _), recs in sorted(attempts.items(), key=lambda kv: kv[0][2]):
        if not any(r["committed"] for r in recs):
            continue
        superseded += (run, step) in trained  # a later quorum trained the step again: the earlier update is gone
        trained[(run, step)] = recs
    return trained, superseded


def audit_ft(job: str, incs: list[Incarnation]) -> FtAudit:
    """The audit of one job's step runs (see the module)."""
    n = int(next(r["n"] for inc in incs for r in inc.steps))
    trained, abandoned = _trained(incs)
    steps: list[tuple[int, list[dict[str, Any]]]] = []
    gaps: list[int] = []
    for inc, until in _kept_runs(incs):
        first = int(inc.resumed["step"]) + 1 if inc.resumed else 1
        have = sorted(s for (rn, s) in trained if rn == inc.name and s >= first and (until is None or s <= until))
        last = (have[-1] if have else first - 1) if until is None else until
        for s in range(first, last + 1):
            if (inc.name, s) in trained:
                steps.append((s, trained[(inc.name, s)]))
            else:
                gaps.append(s)
    abandoned += len(trained) - len(steps)
    stream: list[int] = []
    wrong, incomplete, epoch_of = [], [], {}
    for s, recs in steps:
        epoch_of[s] = len(stream) // n
        parts = {(r["start"], r["stop"]): np.frombuffer(r["idx"], dtype="<i8") for r in recs if r["counted"]}
        first, last = recs[0]["first"], recs[0]["last"]
        at, samples = first, []
        for (a, b), idx in sorted(parts.items()):
            if a != at:
                break
            samples.append(idx)
            at = b
        if at != last:
            incomplete.append(s)
        got = int(sum(len(x) for x in samples))
        promised = recs[0]["batch"] * (recs[0]["participants"] if recs[0]["mode"] == "group" else 1)
        if got != promised and at == last:
            wrong.append((s, got, promised))
        stream += [int(i) for x in samples for i in x]
    for s in gaps:
        epoch_of[s] = len(stream) // n
    epochs = []
    for e in range((len(stream) + n - 1) // n):
        chunk = stream[e * n:(e + 1) * n]
        counts = collections.Counter(chunk)
        missing = n - len(counts) if len(chunk) == n else 0
        epochs.append((e, len(chunk), sum(c - 1 for c in counts.values()), missing))
    return FtAudit(job, n, len(steps), epochs, wrong, incomplete, gaps, abandoned, epoch_of)
