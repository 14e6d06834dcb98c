"""`croupier audit --by-step`: each kept step checked along a job's timeline, and the first step where the run diverged."""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, TextIO

import numpy as np

from croupier.core import settings
from croupier.core.amend import sizes_after
from croupier.core.errors import CroupierError
from croupier.core.registry import plan_epoch
from croupier.tools._log_streams import Streams
from croupier.tools.audit import Incarnation, load

if TYPE_CHECKING:
    from croupier.core.ledger import Ledger, Segment, Version
    from croupier.core.plan import EpochPlan
    from croupier.core.spec import Spec

__all__ = ["Divergence", "EpochSteps", "StepAudit", "audit_by_step", "audit_steps", "main", "render_steps"]

#: How long the command retries a coordinator that does not answer, and how long one call may take.
RETRY_FOR_S = 5.0
CALL_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first step at which the run diverged.

    Attributes:
        step: The step (counted from 1, as the trainers log them).
        epoch: Its epoch.
        generation: The generation that trained it on the timeline.
        kind: ``repeat`` (a sample trained twice in its epoch), ``missing`` (an epoch the timeline
            moved past left samples untrained; named at its last step), ``log`` (the ranks' logs
            differ from the ledger), ``history`` (the ledger cannot say what the step trained).
        why: What was found, with the values.
    """

    step: int
    epoch: int
    generation: int
    kind: str
    why: str


@dataclasses.dataclass(frozen=True)
class EpochSteps:
    """One epoch along the timeline: its kept steps and what they trained.

    Attributes:
        epoch: The epoch.
        first: Its first kept step.
        last: Its last kept step audited.
        samples: Samples its kept steps trained.
        repeats: Of those, samples trained before in the epoch (the padding of a ``pad`` tail).
        missing: Samples of the epoch not trained, when judged (None: the epoch is open, part of it
            is before the history the coordinator holds, or its plan leaves batches out on purpose;
            a mixture's source epochs are counted by the per-epoch audit).
        finished: The timeline moved past it, trained every sample of it, or ended at its last step (the
            ranks had taken every batch the plan of their generation deals them in it).
    """

    epoch: int
    first: int
    last: int
    samples: int
    repeats: int
    missing: int | None
    finished: bool


@dataclasses.dataclass(frozen=True)
class StepAudit:
    """One job's audit by step.

    Attributes:
        job: The job's name.
        first: The first step audited (1, unless the coordinator's history starts later).
        last: The last kept step (the timeline's, as far as its ranks reported).
        compared: Whether the ranks' audit logs were compared with the ledger.
        epochs: Each epoch the kept steps trained.
        divergence: The first step where the run diverged, or None.
        error: Why the job could not be audited by step at all (None: it was).
    """

    job: str
    first: int
    last: int
    compared: bool
    epochs: tuple[EpochSteps, ...] = ()
    divergence: Divergence | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Audited, and nothing diverged."""
        return self.error is None and self.divergence is None


# --------------------------------------------------------------------------- the walk along the timeline


@dataclasses.dataclass
class _Epoch:
    """What the kept steps of one epoch trained so far."""

    epoch: int
    first: int
    last: int
    # which samples were dealt (not as padding): one array of an index's, one per (source, source epoch) of a mixture
    seen: dict[Hashable, np.ndarray] = dataclasses.field(default_factory=dict)
    trained: int = 0  # distinct samples dealt, not as padding
    samples: int = 0
    repeats: int = 0  # samples dealt again: the padding, or any repeat
    again: int = 0  # samples dealt again, not as padding
    worlds: set[int] = dataclasses.field(default_factory=set)
    last_world: int = 0
    last_generation: int = 0
    partial: bool = False  # part of the epoch precedes the history the coordinator holds


def _mark(seen: dict[Hashable, np.ndarray], group: Hashable, local: np.ndarray) -> np.ndarray:
    """Marks samples `local` of `group` dealt; returns which of them were dealt before (in the epoch, or earlier
    in `local`)."""
    arr = seen.get(group, np.zeros(0, dtype=bool))
    need = int(local.max()) + 1 if local.size else 0
    if arr.size < need:
        arr = np.concatenate([arr, np.zeros(max(need, 2 * arr.size) - arr.size, dtype=bool)])
    seen[group] = arr
    order = np.argsort(local, kind="stable")
    dup = np.zeros(local.size, dtype=bool)
    dup[order[1:]] = local[order[1:]] == local[order[:-1]]
    again: np.ndarray = arr[local] | dup
    arr[local] = True
    return again


class _Walk:
    """Goes along the kept steps in order and keeps the first divergence."""

    def __init__(self, ledger: Ledger, logs: Streams | None, start: int) -> None:
        self.ledger, self.logs, self.spec, self.start = ledger, logs, ledger.spec, start
        self.segments = {s.generation: s for s in ledger.segments}
        self.epochs: list[EpochSteps] = []
        self.cur: _Epoch | None = None
        self.first: Divergence | None = None
        self.micro: dict[tuple[int, int, int], int] = collections.Counter()  # (generation, rank, epoch) -> batches
        self.plans: dict[tuple[int, int], EpochPlan | None] = {}
        self.pads = self.spec.tail in ("pad", "pad_last")

    def diverged(self, step: int, epoch: int, generation: int, kind: str, why: str) -> None:
        if self.first is None or step < self.first.step:
            self.first = Divergence(step, epoch, generation, kind, why)

    def _seg_spec(self, generation: int) -> tuple[Spec, Segment | None]:
        seg = self.segments.get(generation)
        return (self.spec.amended(seg.amendments) if seg is not None and seg.amendments else self.spec), seg

    def samples(self, v: Version) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's samples as the epoch counts them: (source, source epoch, sample within its source), a
        mixture's numbered alike whatever sources grew in between; an index is source 0, source epoch 0."""
        idx = v.indices
        if self.spec.sources is None:
            zero = np.zeros(idx.size, dtype=np.int64)
            return zero, zero, idx
        sp, _ = self._seg_spec(v.generation)
        assert sp.sources is not None
        offsets = np.concatenate([[0], np.cumsum(sizes_after(sp.sources, sp.amendments or ()))])
        src = np.concatenate([b.sources for b in v.batches])
        return src, np.concatenate([b.source_epochs for b in v.batches]), idx - offsets[src]

    def padding(self, v: Version) -> np.ndarray | None:
        """Which of the step's samples its plan dealt as the tail's padding (None: a plan without a fixed layout,
        whose padding is not known here)."""
        key = (v.generation, v.epoch)
        if key not in self.plans:
            sp, seg = self._seg_spec(v.generation)
            self.plans[key] = plan_epoch(sp, seg.start, seg.world, v.epoch) if seg is not None else None
        plan = self.plans[key]
        out = []
        known = plan is not None
        for b in v.batches:
            k = (v.generation, b.rank, v.epoch)
            first, self.micro[k] = self.micro[k], self.micro[k] + 1
            pad = None if plan is None else plan.padding(b.rank, first, b.indices.size)
            if pad is None:
                known = False
            else:
                out.append(pad)
        if not known:
            return None
        return np.concatenate(out) if out else np.zeros(0, dtype=bool)

    def step(self, t: int, v: Version) -> None:
        cur = self.cur
        if cur is not None and v.epoch < cur.epoch:
            self.diverged(t, v.epoch, v.generation, "history",
                          f"step {t} (generation {v.generation}) is of epoch {v.epoch}, after step {cur.last} of epoch "
                          f"{cur.epoch}: the timeline goes back an epoch")
        if cur is None or v.epoch != cur.epoch:
            if cur is not None:
                self.close(cur, finished=True)
            # the history the coordinator holds may begin inside the epoch: its start is not judged
            cur = self.cur = _Epoch(v.epoch, t, t, partial=t == self.start > 1)
        cur.last, cur.last_world, cur.last_generation = t, v.world, v.generation
        cur.worlds.add(v.world)
        src, sep, local = self.samples(v)
        pad = self.padding(v)
        real = np.ones(local.size, dtype=bool) if pad is None else ~pad
        again = np.zeros(local.size, dtype=bool)
        pairs = np.unique(np.stack([src, sep]), axis=1).T.tolist() if self.spec.sources is not None else [[0, 0]]
        for s, e in pairs:
            sel = np.flatnonzero(real if self.spec.sources is None else (src == s) & (sep == e) & real)
            again[sel] = _mark(cur.seen, (s, e), local[sel])
        n_again = int(again.sum())
        cur.samples += local.size
        cur.trained += int(real.sum()) - n_again
        cur.repeats += n_again + local.size - int(real.sum())
        cur.again += n_again
        # NOTE: a fixed plan says which of its samples are padding: every other sample is dealt once per epoch
        # along the timeline. A plan without a fixed layout (token budgets) is held to the per-epoch audit's
        # bound of the pad tail, W - 1 repeats for each world that trained the epoch.
        budget = sum(w - 1 for w in cur.worlds) if self.pads and pad is None else 0
        if n_again and (pad is not None or cur.again > budget):
            j = int(np.flatnonzero(again)[0])
            rule = (f"tail={self.spec.tail} repeats at most {budget} (W - 1 for each world {sorted(cur.worlds)})"
                    if budget else "not as the tail's padding")
            what = (f"sample {local[j]}" if self.spec.sources is None
                    else f"sample {local[j]} of source {src[j]} (its source epoch {sep[j]})")
            self.diverged(t, cur.epoch, v.generation, "repeat",
                          f"step {t} trains {what} again, {self.before(cur, t, int(local[j]), int(src[j]), int(sep[j]))} "
                          f"({rule})")
        if self.logs is not None:
            self.compare(t, v)

    def before(self, cur: _Epoch, t: int, sample: int, source: int, source_epoch: int) -> str:
        """Where the kept timeline dealt `sample` before step `t` in the epoch (the ledger's answer)."""
        occ = self.ledger.index(sample, None if self.spec.sources is None else source)
        steps = sorted(o.step for o in occ if o.kept and o.epoch == cur.epoch and o.step < t
                       and (self.spec.sources is None or o.source_epoch == source_epoch))
        return f"first trained at step {steps[0]} of epoch {cur.epoch}" if steps else "twice in this step"

    def close(self, cur: _Epoch, finished: bool) -> None:
        """The epoch's end along the timeline (`finished`: a later epoch follows, or the timeline's last step ends
        it; else the timeline ends inside it)."""
        judged = not cur.partial and self.spec.sources is None and not (self.spec.drop_last_batch or self.spec.even_batches)
        missing = self.spec.n - cur.trained if judged else None
        may_miss = cur.last_world - 1 if self.spec.tail == "drop" else 0
        if missing is not None and not finished and missing > may_miss:
            missing = None  # open: the timeline ends inside the epoch
        elif missing is not None and missing > may_miss:
            rule = "none" if not may_miss else f"fewer than W = {cur.last_world}"
            self.diverged(cur.last, cur.epoch, cur.last_generation, "missing",
                          f"epoch {cur.epoch} ended at step {cur.last} with {missing} of its {self.spec.n} samples never "
                          f"trained on the timeline (tail={self.spec.tail} leaves out {rule})")
        self.epochs.append(EpochSteps(cur.epoch, cur.first, cur.last, cur.samples, cur.repeats, missing,
                                      finished or missing is not None))

    def compare(self, t: int, v: Version) -> None:
        """The step's samples against what the ranks of its generation were handed at that point of the epoch."""
        assert self.logs is not None
        why = self.logs.mismatch(t, v)
        if why is not None:
            self.diverged(t, v.epoch, v.generation, "log", why)


def audit_steps(ledger: Ledger, logs: Sequence[Incarnation] | None = None) -> StepAudit:
    """Audits one job's kept steps from its ledger, and against its ranks' audit logs when given.

    The ledger (``CoordinatorClient.ledger``) says which generation trained each step of the timeline the job's
    latest checkpoint descends from, and recomputes the step's samples from the order. Each kept step's samples
    are checked against those its epoch's kept steps trained before: each sample at most once per epoch (the
    tail's padding aside) and, once the timeline moved past an epoch, every sample of it once (the tail's drop
    aside). With the logs, each is also compared with what the ranks of its generation were handed at that
    point of their share of the epoch. The first step that fails either is named.

    Args:
        ledger: The job's step ledger (``CoordinatorClient.ledger(job)``).
        logs: The job's incarnations as its audit logs hold them (``croupier.tools.audit.load``), or
            None to check the ledger alone.

    Returns:
        The job's :class:`StepAudit`; its `error` says why nothing could be audited (a history that
        cannot place its steps), its `divergence` the first step that failed.
    """
    job, compared = ledger.job, logs is not None
    kept = [row for row in ledger.timeline() if row["kept_to"] is not None]
    first, last = (kept[0]["from_step"] + 1 if kept else 1), ledger.last_step
    if last < first:  # nothing to audit: the ledger says why (no step trained, or none it can place)
        try:
            ledger.step(first)
        except CroupierError as e:
            return StepAudit(job, first, last, compared, error=str(e))
        return StepAudit(job, first, last, compared, error=f"job {job!r} has no kept step to audit")
    walk = _Walk(ledger, None if logs is None else Streams(logs), first)
    for t in range(first, last + 1):
        try:
            v = ledger.step(t).kept
        except CroupierError as e:
            return StepAudit(job, first, last, compared, tuple(walk.epochs), walk.first, error=str(e))
        if v is None:
            walk.diverged(t, -1, -1, "history", f"the ledger keeps no version of step {t}: the generation the "
                                                "timeline names for it did not report training it")
            break
        walk.step(t, v)
        if walk.first is not None and walk.first.step < t:
            break  # nothing later can come first
    if walk.cur is not None:
        # the timeline ends in this epoch: finished when its last step was the epoch's last (a job run to the
        # epoch's end, checkpointed there: no step of the next epoch follows it)
        walk.close(walk.cur, finished=walk.cur.last == last and ledger.ends_epoch(last))
    return StepAudit(job, first, last, compared, tuple(walk.epochs), walk.first)


# --------------------------------------------------------------------------- the command


def audit_by_step(address: str | None, logdir: str | None = None, jobs: Sequence[str] = ()) -> list[StepAudit]:
    """Every job's audit by step, from the coordinator's ledgers, and the audit logs under `logdir` when given.

    Args:
        address: HOST:PORT of the coordinator; None for ``CROUPIER_ADDRESS``, else 127.0.0.1:50051.
        logdir: The samplers' audit directory, or None to check the ledgers alone.
        jobs: The jobs to audit; empty for every job of `logdir`, or without one every job the
            coordinator holds.

    Raises:
        FileNotFoundError: `logdir` holds no audit log.
        CroupierError: the coordinator could not be asked (its message says why).
    """
    from croupier.client import CoordinatorClient

    logs = None
    if logdir is not None:
        logs = load(logdir)
        if not logs:
            raise FileNotFoundError(f"no audit logs (*/*.audit) under {logdir}")
    out = []
    with CoordinatorClient(settings.coordinator_address(address), retry_for=RETRY_FOR_S,
                           call_timeout=CALL_TIMEOUT_S) as client:
        names = list(jobs) or (sorted(logs) if logs is not None else sorted(client.jobs()))
        for job in names:
            if logs is not None and job not in logs:
                out.append(StepAudit(job, 1, 0, True, error=f"job {job!r} has no audit log under {logdir}"))
                continue
            try:
                ledger = client.ledger(job)
            except CroupierError as e:
                out.append(StepAudit(job, 1, 0, logs is not None, error=str(e)))
                continue
            out.append(audit_steps(ledger, None if logs is None else logs[job]))
    return out


def render_steps(audits: Iterable[StepAudit]) -> str:
    """The table by epoch of each job's kept steps, and each job's verdict."""
    lines = [f"{'job':<16} {'epoch':>5} {'steps':>13} {'samples':>9} {'repeats':>8} {'missing':>8}  along the timeline"]
    verdicts = []
    for a in audits:
        for e in a.epochs:
            missing = "-" if e.missing is None else str(e.missing)
            state = ("finished" if e.finished else "stopped at the divergence" if a.divergence is not None
                     and a.divergence.step <= e.last + 1 else "open")
            lines.append(f"{a.job:<16} {e.epoch:>5} {f'{e.first}-{e.last}':>13} {e.samples:>9} {e.repeats:>8} "
                         f"{missing:>8}  {state}")
        against = "the order and the ranks' audit logs" if a.compared else "the order (the ledger alone)"
        if a.error is not None:
            verdicts.append(f"{a.job}: NOT AUDITED by step: {a.error}")
        elif a.divergence is not None:
            d = a.divergence
            verdicts.append(f"{a.job}: DIVERGED at step {d.step} (epoch {d.epoch}, generation {d.generation}): {d.why}")
        else:
            verdicts.append(f"{a.job}: steps {a.first}-{a.last} agree with {against}: each sample at most once per "
                            "epoch along the timeline")
    return "\n".join(lines + [""] + verdicts)


def main(address: str | None, logdir: str | None, jobs: Sequence[str] = (), allow_unfinished: bool = False,
         out: TextIO | None = None) -> bool:
    """`croupier audit --by-step`: prints the table and each job's verdict.

    Returns:
        Whether every job passed: audited, nothing diverged, and (unless `allow_unfinished`) its
        timeline's last epoch finished.
    """
    out = sys.stdout if out is None else out
    try:
        audits = audit_by_step(address, logdir, jobs)
    except CroupierError as e:  # the coordinator did not answer, or refused the list of its jobs
        print(f"croupier audit --by-step: {e}", file=sys.stderr)
        return False
    out.write(render_steps(audits) + "\n")
    open_ = [f"{a.job} epoch {e.epoch}" for a in audits if a.ok for e in a.epochs if not e.finished]
    if open_ and not allow_unfinished:
        out.write(f"open along the timeline: {', '.join(open_)}: nothing diverged so far, but their steps do not yet "
                  "cover them (pass --allow-unfinished for a job still running)\n")
    return all(a.ok for a in audits) and (allow_unfinished or not open_)
