"""`croupier audit` of a fault-tolerant (torchft) job: every sample once per epoch in the committed steps its ranks logged.

``StepLoader(audit_dir=...)`` makes every rank of every replica group log each attempted step
(``*.ftaudit``): its run, step, quorum, this rank's part of the step and its indices, and whether
its group committed. The audit needs nothing else (no coordinator, no dealing rule):

* an attempt is (run, step, quorum); it trained if any group of it committed (torchft averaged
  every participant's gradient into that update), and then its samples are every part its ranks
  logged, which must cover the step whole (a part missing is reported, not guessed);
* within a run, a step trained again by a later quorum supersedes the earlier attempt (the groups
  that committed it alone died with their update);
* the kept timeline is the latest run's lineage: the run from the step it resumed at, its parent
  run up to that step, and so on; what other runs trained is abandoned;
* the kept steps' samples, in step order, are the job's stream: each whole epoch of it (``n``
  samples) must hold every index once; the epoch in progress no index twice. Each kept step's size
  is checked against the loaders' promise (``global``: the batch; ``group``: batch x participants).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
from typing import Any

import msgpack
import numpy as np

__all__ = ["FtAudit", "audit_ft", "load_ft", "render_ft"]


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

    @property
    def ok(self) -> bool:
        whole = self.epochs[:-1] if self.epochs and self.epochs[-1][1] < self.n else self.epochs
        return (not self.wrong_batch and not self.incomplete and not self.gaps
                and all(d == 0 and m == 0 for _, _, d, m in whole)
                and all(d == 0 for _, _, d, _ in self.epochs))


def _read(path: pathlib.Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        try:
            out.extend(msgpack.Unpacker(f, raw=False))
        except (msgpack.OutOfData, ValueError):
            pass  # a record cut short by a kill -9: everything before it counts
    return out


def load_ft(logdir: str | os.PathLike[str]) -> dict[str, list[dict[str, Any]]]:
    """Every job's step records, from every rank's ``*.ftaudit`` under ``LOGDIR/JOB/``."""
    jobs: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for path in sorted(pathlib.Path(logdir).glob("*/*.ftaudit")):
        jobs[path.parent.name] += [r for r in _read(path) if r.get("t") == "step"]
    return dict(jobs)


def _kept_timeline(records: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    """The latest run's lineage as (run, first step, stop step or -1 for open), newest first."""
    runs = {r["run"]: (r["parent"], r["resumed"]) for r in records}
    first_seen: dict[str, float] = {}
    for r in records:
        first_seen[r["run"]] = min(first_seen.get(r["run"], r["ts"]), r["ts"])
    leaf = max(first_seen, key=lambda k: first_seen[k])
    out, stop, seen = [], -1, set()
    run: str | None = leaf
    while run is not None and run in runs and run not in seen:
        seen.add(run)
        parent, resumed = runs[run]
        out.append((run, resumed, stop))
        stop, run = resumed, (parent or None)
    return out


def audit_ft(job: str, records: list[dict[str, Any]]) -> FtAudit:
    """The audit of one job's step records (see the module)."""
    n = int(records[0]["n"])
    attempts: dict[tuple[str, int, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in records:
        attempts[(r["run"], r["step"], r["quorum"])].append(r)
    trained: dict[tuple[str, int], tuple[int, list[dict[str, Any]]]] = {}
    abandoned = 0
    for (run, step, quorum), recs in sorted(attempts.items(), key=lambda kv: kv[0][2]):
        if not any(r["committed"] for r in recs):
            continue
        if (run, step) in trained:
            abandoned += 1  # a later quorum trained the step again: the earlier update is gone
        trained[(run, step)] = (quorum, recs)
    steps: list[tuple[int, list[dict[str, Any]]]] = []
    gaps: list[int] = []
    for run, first, stop in reversed(_kept_timeline(records)):
        have = sorted(s for (rn, s) in trained if rn == run and s >= first and (stop < 0 or s < stop))
        end = (have[-1] + 1 if have else first) if stop < 0 else stop
        for s in range(first, end):
            if (run, s) in trained:
                steps.append((s, trained[(run, s)][1]))
            else:
                gaps.append(s)
    abandoned += len(trained) - len(steps)
    stream: list[int] = []
    wrong, incomplete = [], []
    for s, recs in steps:
        parts = {}
        for r in recs:
            if r["counted"]:
                parts[(r["start"], r["stop"])] = np.frombuffer(r["idx"], dtype="<i8")
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
    epochs = []
    for e in range((len(stream) + n - 1) // n):
        chunk = stream[e * n:(e + 1) * n]
        counts = collections.Counter(chunk)
        dup = sum(c - 1 for c in counts.values())
        missing = n - len(counts) if len(chunk) == n else 0
        epochs.append((e, len(chunk), dup, missing))
    return FtAudit(job, n, len(steps), epochs, wrong, incomplete, gaps, abandoned)


def render_ft(a: FtAudit) -> str:
    """The audit as a table and a verdict line."""
    rows = [f"job {a.job!r} (fault-tolerant): {a.steps} committed steps kept, {a.abandoned} committed attempts "
            "abandoned (rollbacks, lost updates)",
            "  epoch  samples  duplicates  missing"]
    rows += [f"  {e:>5}  {s:>7}  {d:>10}  {m:>7}{'  (in progress)' if s < a.n else ''}" for e, s, d, m in a.epochs]
    for what, items in (("steps with a part no rank logged", a.incomplete), ("steps never committed", a.gaps),
                        ("steps of another size than promised", a.wrong_batch)):
        if items:
            rows.append(f"  {what}: {items[:10]}{' ...' if len(items) > 10 else ''}")
    rows.append(f"  {'OK: every sample once per epoch in the committed steps' if a.ok else 'FAILED'}")
    return "\n".join(rows)
