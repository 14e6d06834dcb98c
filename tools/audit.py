"""`croupier audit`: reads the audit logs the ranks wrote and checks G1 (G12 for a torchft job) from them.

The log's records are described in :mod:`croupier.client` (``_audit_log``): ``start``, ``batch``,
``end``, ``cut``, ``ckpt``, ``filtered`` and a torchft rank's ``step``; :mod:`croupier.tools.audit_log`
reads every job's logs into one model (its runs as :class:`Incarnation`), and :func:`audit` judges
each job into the same epoch reports (a torchft job's by :mod:`croupier.tools.audit_ft`).

The audit follows the chain backwards from the last incarnation to start: each resumed from a
checkpoint that an earlier one made (its start record's ``resumed`` names it: the incarnation or
generation that made it, its epoch and items), so what counts of that earlier one is what it
received up to that checkpoint. Everything it received after was lost with the restart (G1's rule). It then
prints, per epoch, the indices expected, trained, duplicated and missing, and whether G1 holds; a
sample handed out and then filtered out (``filtered`` records) counts in a column of its own, not
as trained and not as missing.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from croupier.core.history import LineageCycle, lineage
from croupier.core.registry import kind_for
from croupier.tools.audit_ft import FtAudit, audit_ft
from croupier.tools.audit_log import Incarnation, load, stepped

__all__ = ["EpochReport", "Incarnation", "SourceRow", "audit", "audit_job", "by_source", "checkpoint_chain",
           "ft_reports", "load", "render", "render_sources", "verdict"]


@dataclasses.dataclass(frozen=True)
class SourceRow:
    """One source epoch's share of one epoch of a mixture: what it was to deal there and what was trained."""

    source: int
    source_epoch: int
    size: int  # the samples this source epoch deals, each once (its source's, less those skipped)
    expected: int  # samples of this source epoch the epoch was to deal
    trained: int  # of those, trained
    duplicates: int  # trained beyond what the epoch was to deal of them
    missing: int  # of those, not trained
    skipped: int = 0  # the source's samples taken out of this source epoch (croupier skip): not dealt, not missing
    filtered: int = 0  # of those expected, handed out and filtered out after loading: not trained, not missing


@dataclasses.dataclass(frozen=True)
class EpochReport:
    job: str
    epoch: int
    expected: int
    trained: int
    duplicates: int
    missing: int
    finished: bool
    ok: bool
    why: str
    cut: bool = False  # the trainer moved on before the epoch's end (set_epoch of the next epoch)
    sources: tuple[SourceRow, ...] = ()  # a mixture's epoch, by source epoch
    filtered: int = 0  # handed out, then filtered out after loading (not in `trained`, not missing)


def _cut(inc: Incarnation, epoch: int, items: int | None) -> dict[int, list[int]]:
    """What `inc` received up to (epoch, items) — everything when items is None — by epoch."""
    out: dict[int, list[int]] = collections.defaultdict(list)
    for rank in inc.ranks.values():
        # indices per item: the batch sampler's items are batches; 0: each record is one item of
        # its own size (token-budget batches)
        unit = int(rank.start.get("unit", 1))
        for e, at, idx in rank.batches:
            # A rank receives whole leases; what counts is what it handed out before a checkpoint
            # (epoch, items) ended it, or before the trainer cut the epoch.
            limit = inc.cuts.get(e)
            if items is not None and e == epoch:
                limit = items if limit is None else min(limit, items)
            elif items is not None and e > epoch:
                continue
            if limit is None:
                out[e] += idx.tolist()
            elif at < limit:
                out[e] += (idx if unit == 0 else idx[: (limit - at) * unit]).tolist()
    return out


def _cut_filtered(inc: Incarnation, epoch: int, items: int | None) -> dict[int, list[int]]:
    """The indices `inc` filtered out, by epoch, up to (epoch, items) as :func:`_cut` counts what it received."""
    out: dict[int, list[int]] = collections.defaultdict(list)
    for e, at, index, _ in inc.filtered:
        limit = inc.cuts.get(e)
        if items is not None and e == epoch:
            limit = items if limit is None else min(limit, items)
        elif items is not None and e > epoch:
            continue
        if limit is None or at < limit:
            out[e].append(index)
    return out


@dataclasses.dataclass
class _Handed:
    """What the chain's incarnations handed out, epoch by epoch, as the audit gathers it."""

    #: epoch -> the indices handed out (filtered ones included), renumbered to the latest incarnation's
    trained: dict[int, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    filtered: dict[int, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    worlds: dict[int, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    finished: dict[int, int] = dataclasses.field(default_factory=dict)  # epoch -> world of the run that finished it
    cut: dict[int, int] = dataclasses.field(default_factory=dict)  # epoch -> items taken when the trainer cut it


def audit_job(job: str, incs: list[Incarnation]) -> list[EpochReport]:
    """Follows the checkpoint chain of one job and judges every epoch it covers."""
    chain = [(inc, *(until or (None, None))) for inc, until in checkpoint_chain(job, incs)]
    handed = _handed(chain)
    last = chain[-1][0]
    reports = [_judge(job, e, handed, last) for e in sorted(handed.trained)]
    in_chain = {inc.name for inc, _, _ in chain}
    # NOTE: an incarnation that made checkpoints before the chain began, when no later one
    # resumed from any of them, means a restart that did not load the sampler's state (the model
    # may well have been restored): the audit cannot vouch for those epochs, so it fails. A job
    # started over on purpose should be given a fresh audit directory.
    orphans = [i for i in incs if i.name not in in_chain and i.ts < chain[0][0].ts and i.checkpoints]
    if orphans:
        first = min(chain[0][0].ranks[r].start.get("epoch", 0) for r in chain[0][0].ranks)
        reports.insert(0, EpochReport(
            job, first, last.n, 0, 0, 0, False, False,
            f"UNVERIFIED: {len(orphans)} earlier incarnation(s) trained, but the chain starts afresh at "
            f"{chain[0][0].name}: a restart that did not load the sampler's checkpoint state?"))
    return reports


def _handed(chain: list[tuple[Incarnation, int | None, int | None]]) -> _Handed:
    """What each incarnation of the chain handed out up to the checkpoint its successor resumed from (epoch,
    items; None for the latest), and which epochs it cut or finished."""
    h = _Handed()
    for inc, ce, ci in chain:
        for e, items in inc.cuts.items():
            if ce is None or e < ce:
                h.cut[e] = items
                h.trained.setdefault(e, [])
        for e, idx in _cut(inc, ce or 0, ci).items():
            h.trained[e] += _renumber(inc, chain[-1][0], idx)
            if idx:
                h.worlds[e].append(inc.world)
        for e, idx in _cut_filtered(inc, ce or 0, ci).items():
            h.filtered[e] += _renumber(inc, chain[-1][0], idx)
        for e, count in inc.ends.items():
            # NOTE: with static dealing, one rank at its epoch's end means the epoch was iterated to
            # its end (the ranks step together); with dynamic dealing a rank ends when nothing is left
            # to deal while others may still hold batches: every rank must have ended.
            need = kind_for(inc.dealing).ends_needed(inc.world)
            if count >= need and (ce is None or e < ce):
                h.finished[e] = inc.world
        if ce is not None and ci == 0:
            # A checkpoint at the start of epoch ce: the epochs before it were finished.
            for e in list(h.trained):
                if e < ce:
                    h.finished.setdefault(e, inc.world)
    return h


def _judge(job: str, e: int, h: _Handed, last: Incarnation) -> EpochReport:
    """Epoch `e`'s report: its duplicates and missing indices against what G1 allows for how it ended (cut by
    the trainer, unfinished, or finished by a world of W ranks under the spec's tail)."""
    idx, n, nf = h.trained[e], last.n, len(h.filtered[e])
    rows: tuple[SourceRow, ...] = ()
    if last.mixture is not None:
        dups, missing, rows = _mixture_epoch(last.mixture, n, e, idx, h.filtered[e])
    else:
        c = collections.Counter(idx)
        missing = n - len([i for i in c if 0 <= i < n])
        dups = len(idx) - len(c)
    done = e in h.finished
    if not done:
        w = max(h.worlds[e], default=1) if e in h.cut else max(h.worlds[e])
        ok = dups <= (w - 1 if last.tail in ("pad", "pad_last") else 0)
        if e in h.cut:
            why = (f"CUT: the trainer moved on to epoch {e + 1} after {h.cut[e]} items of a rank; {missing} indices "
                   "not trained" if ok else f"G1 VIOLATED: {dups} duplicates before the trainer cut the epoch")
            return EpochReport(job, e, n, len(idx) - nf, dups, missing, False, False, why, cut=True, sources=rows,
                               filtered=nf)
        why = ("UNFINISHED: no rank reached this epoch's end (with dynamic dealing: not every rank), so G1 "
               "cannot be established for it"
               if ok else f"G1 VIOLATED: {dups} duplicates before the epoch ended")
        return EpochReport(job, e, n, len(idx) - nf, dups, missing, False, ok, why, sources=rows, filtered=nf)
    w = h.finished[e]
    if last.tail == "uneven":
        ok, rule = dups == 0 and missing == 0, "every index exactly once"
    elif last.tail == "drop":
        ok, rule = dups == 0 and missing < w, f"each at most once, fewer than W={w} missing"
    else:
        allowed = w - 1 if last.partition == "strided" else sum(x - 1 for x in set(h.worlds[e]))
        ok, rule = missing == 0 and dups <= allowed, f"each at least once, at most {allowed} repeats"
    why = ("ok: " if ok else "G1 VIOLATED: ") + rule
    return EpochReport(job, e, n, len(idx) - nf, dups, missing, True, ok, why, sources=rows, filtered=nf)


def checkpoint_chain(job: str, incs: list[Incarnation]) -> list[tuple[Incarnation, tuple[int, int] | None]]:
    """The job's lineage in its logs (``croupier.core.history.lineage``): from its latest incarnation back along the
    checkpoints each resumed from, oldest first, each with the (epoch, items) of the checkpoint its successor
    resumed from (None for the latest).

    Raises:
        ValueError: the chain comes back to an incarnation, or names one that left no audit log here.
    """
    def parent(inc: Incarnation) -> tuple[Incarnation, tuple[int, int]] | None:
        prev, epoch, items = _resumed_from(job, inc, incs)
        return None if prev is None or epoch is None or items is None else (prev, (epoch, items))

    try:
        return lineage(incs[-1], parent)
    except LineageCycle as e:
        name = e.run.name if isinstance(e.run, Incarnation) else "?"
        raise ValueError(f"job {job!r}: the checkpoints' chain comes back to incarnation {name}") from None


def _resumed_from(job: str, inc: Incarnation,
                  incs: list[Incarnation]) -> tuple[Incarnation | None, int | None, int | None]:
    """The incarnation that made the checkpoint `inc` resumed from, with that checkpoint's epoch and
    items; (None, None, None) for a fresh start.

    The start record's ``resumed`` names it by its incarnation, or by its generation alone (a state a
    coordinator's record gave back): then it is the latest incarnation of that generation before `inc`.

    Raises:
        ValueError: the checkpoint was made by an incarnation that left no audit log here.
    """
    r = inc.resumed or {}
    if r.get("items") is not None and (r.get("incarnation") is not None or r.get("generation") is not None):
        epoch, items = int(r["epoch"]), int(r["items"])
        if r.get("incarnation") is not None:
            made = f"incarnation {r['incarnation']}"
            prev = next((i for i in incs if i.name == r["incarnation"]), None)
        else:
            made = f"generation {r['generation']}"
            prev = next((i for i in reversed(incs) if i.generation == r["generation"] and i.ts < inc.ts), None)
    elif inc.origin:  # a log written before the fields, or a state of an earlier format loaded
        name, epoch, items = _legacy_origin(inc.origin)
        made, prev = f"incarnation {name}", next((i for i in incs if i.name == name), None)
    else:
        return None, None, None
    if prev is None:
        raise ValueError(f"job {job!r}: incarnation {inc.name} resumed from a checkpoint at epoch {epoch}, item {items} "
                         f"({inc.origin or 'no origin'}), made by {made}, which has no audit log")
    return prev, epoch, items


def _legacy_origin(origin: str) -> tuple[str, int, int]:
    """(incarnation, epoch, items) an origin ``incarnation/epoch/items`` names.

    NOTE: legacy only. Audit logs written before the start record named its checkpoint as fields
    (``resumed``), and states of formats before 5, which name who made them only in their origin.
    """
    parts = origin.rsplit("/", 2)
    try:
        return parts[0], int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        raise ValueError(f"the checkpoint's origin {origin!r} is not incarnation/epoch/items") from None


def _amendments(mixture: dict[str, Any]) -> tuple[Any, ...]:
    from croupier.core.amend import Amendment

    return tuple(Amendment.from_list(a) for a in mixture.get("amendments") or ())


def _renumber(inc: Incarnation, last: Incarnation, idx: list[int]) -> list[int]:
    """`inc`'s indices of a mixture numbered as `last` numbers them: a grown source moves the indices of the
    sources after it (each generation numbers them by the sizes it deals with)."""
    if inc.mixture is None or last.mixture is None or not idx:
        return idx
    from croupier.core.amend import sizes_after

    base = tuple(inc.mixture["sources"])
    mine, theirs = sizes_after(base, _amendments(inc.mixture)), sizes_after(base, _amendments(last.mixture))
    if mine == theirs:
        return idx
    a = np.asarray(idx, dtype=np.int64)
    off_mine = np.concatenate([[0], np.cumsum(mine)])
    off_theirs = np.concatenate([[0], np.cumsum(theirs)])
    src = np.searchsorted(off_mine, a, side="right") - 1
    out: list[int] = (a - off_mine[src] + off_theirs[src]).tolist()
    return out


def _mixture_epoch(mixture: dict[str, Any], n: int, epoch: int, trained: list[int],
                   filtered: Sequence[int] = ()) -> tuple[int, int, tuple[SourceRow, ...]]:
    """Duplicates, missing and the rows by source epoch of one epoch of a mixture.

    The epoch was to deal stream positions ``epoch * n`` to ``(epoch + 1) * n``: their samples,
    each tagged with its source and source epoch, are what is expected, as a multiset (a small
    source may deal one sample in several of its epochs within one epoch of the job). A trained
    index counts against its expected occurrences in the order of their source epochs; what is
    trained beyond them is a duplicate (of its last source epoch there), what is not trained of
    them is missing.
    """
    from croupier.core.stream import stream

    st = stream(tuple(mixture["sources"]), tuple((int(a), tuple(p)) for a, p in mixture["weights"]),
                tuple(mixture.get("max_epochs") or ()), int(mixture["seed"]), bool(mixture.get("shuffle", True)),
                _amendments(mixture))
    idx, src, sep = st.indices(np.arange(epoch * n, (epoch + 1) * n, dtype=np.int64))
    order = np.lexsort((sep, idx))  # by index, then source epoch
    idx, src, sep = idx[order], src[order], sep[order]
    first = np.searchsorted(idx, idx, side="left")
    nth = np.arange(idx.size) - first  # which occurrence of its index each expected sample is
    got_idx, got = np.unique(np.asarray(trained, dtype=np.int64), return_counts=True)
    at = np.searchsorted(got_idx, idx)
    t = np.where((at < got_idx.size) & (got_idx[np.minimum(at, got_idx.size - 1)] == idx),
                 got[np.minimum(at, got_idx.size - 1)], 0)
    done = nth < t
    f = np.zeros(idx.size, dtype=np.int64)  # times each expected sample's index was filtered out
    if len(filtered):
        f_idx, f_n = np.unique(np.asarray(filtered, dtype=np.int64), return_counts=True)
        fat = np.minimum(np.searchsorted(f_idx, idx), f_idx.size - 1)
        f = np.where(f_idx[fat] == idx, f_n[fat], 0)
    was_filtered = nth < np.minimum(t, f)  # the trained occurrences the loader filtered out, first source epochs first
    last_of = np.r_[idx[1:] != idx[:-1], True] if idx.size else np.zeros(0, dtype=bool)
    expected_here = np.bincount(np.searchsorted(np.unique(idx), idx)) if idx.size else np.zeros(0, dtype=np.int64)
    extra = np.zeros(idx.size, dtype=np.int64)
    extra[last_of] = np.maximum(t[last_of] - expected_here, 0)
    unexpected = int(got[~np.isin(got_idx, idx)].sum())  # indices this epoch was not to deal at all
    rows = []
    keys = np.stack([src, sep])
    pairs, which = np.unique(keys, axis=1, return_inverse=True)
    which = which.reshape(-1)
    for j, (s, se) in enumerate(pairs.T.tolist()):
        sel = which == j
        exp = int(sel.sum())
        tr = int(done[sel].sum())
        nf = int(was_filtered[sel].sum())
        dealt, domain = st.timeline(int(s)).epoch_sizes(int(se))
        rows.append(SourceRow(int(s), int(se), dealt, exp, tr - nf, int(extra[sel].sum()), exp - tr, domain - dealt, nf))
    dups = int(extra.sum()) + unexpected
    missing = int((~done).sum())
    return dups, missing, tuple(rows)


def by_source(reports: Iterable[EpochReport]) -> list[SourceRow]:
    """A mixture's rows added up over the epochs audited, one per (source, source epoch)."""
    total: dict[tuple[int, int], list[int]] = {}
    for r in reports:
        for row in r.sources:
            t = total.setdefault((row.source, row.source_epoch), [row.size, 0, 0, 0, 0, row.skipped, 0])
            for i, v in enumerate((row.expected, row.trained, row.duplicates, row.missing)):
                t[i + 1] += v
            t[6] += row.filtered
    return [SourceRow(s, e, *v) for (s, e), v in sorted(total.items())]


def render_sources(rows: Iterable[SourceRow]) -> str:
    """The per-source table: each source epoch's samples expected, trained, duplicated and missing."""
    rows = list(rows)
    skips = any(r.skipped for r in rows)
    filters = any(r.filtered for r in rows)
    lines = [f"{'source':>6} {'epoch':>5} {'size':>9} {'expected':>9} {'trained':>9} {'duplicates':>10} "
             f"{'missing':>8}{'  skipped' if skips else ''}{'  filtered' if filters else ''}  verdict"]
    for r in rows:
        size, whole = r.size, r.expected == r.size
        if r.duplicates or r.missing:
            # NOTE: a pad tail repeats and a drop tail leaves out a few samples of an epoch's end:
            # whether these are those, or a violation, is the epoch's verdict above.
            why = f"{r.duplicates} repeated, {r.missing} missing (the epoch's tail? see its verdict)"
        else:
            why = "ok: every sample exactly once" if whole else "ok: each once (part of this source epoch audited)"
        lines.append(f"{r.source:>6} {r.source_epoch:>5} {size:>9} {r.expected:>9} {r.trained:>9} {r.duplicates:>10} "
                     f"{r.missing:>8}{f' {r.skipped:>8}' if skips else ''}{f' {r.filtered:>9}' if filters else ''}  {why}")
    return "\n".join(lines)


def audit(logdir: str | os.PathLike[str]) -> list[EpochReport]:
    """Every job's epoch reports: a job of generations judged by :func:`audit_job`, a job of torchft replica
    groups (its runs logged attempted steps) by :func:`croupier.tools.audit_ft.audit_ft`, alike in the reports."""
    jobs = load(logdir)
    if not jobs:
        raise FileNotFoundError(f"no audit logs (*/*.audit) under {logdir}")
    return [r for job, incs in sorted(jobs.items())
            for r in (ft_reports(audit_ft(job, incs)) if stepped(incs) else audit_job(job, incs))]


def ft_reports(a: FtAudit) -> list[EpochReport]:
    """A torchft job's audit as epoch reports: an epoch is finished when its kept steps trained ``n`` samples."""
    out = []
    epochs = a.epochs + [(e, 0, 0, 0) for e in sorted(set(a.epoch_of.values())) if e >= len(a.epochs)]
    for e, samples, dups, missing in epochs:
        finished, problems = samples == a.n, a.problems(e)
        ok = dups == 0 and missing == 0 and not problems
        if not ok:
            why = "G12 VIOLATED: " + "; ".join([f"{dups} duplicates, {missing} missing in the kept committed steps",
                                                 *problems])
        elif finished:
            why = "ok: every index exactly once in the kept committed steps"
        else:
            why = (f"UNFINISHED: the kept committed steps reach {samples} of its {a.n} samples (none twice), so G12 "
                   "cannot be established for it")
        out.append(EpochReport(a.job, e, a.n, samples, dups, missing, finished, ok, why))
    return out


def verdict(reports: list[EpochReport], allow_unfinished: bool = False, allow_cut: bool = False) -> tuple[bool, str]:
    """Whether the audit passes, and a one-line summary.

    An epoch that did not end fails it too (G1 speaks of finished epochs), unless
    `allow_unfinished` (for an audit of a job still running); so does an epoch the trainer cut
    (it moved on before the epoch's end: a batch limit, a debug run), unless `allow_cut`.
    """
    cuts = [r for r in reports if r.cut and "VIOLATED" not in r.why]
    bad = [r for r in reports if not r.ok and r not in cuts]
    open_ = [r for r in reports if not r.finished and r.ok]
    finished = [r for r in reports if r.finished]
    head = f"{len(finished)} finished epochs audited, {sum(r.trained for r in reports)} indices"
    if bad:
        return False, f"{head}; G1 VIOLATED in {len(bad)} epochs"
    if cuts and not allow_cut:
        return False, (f"{head}; the trainer cut {len(cuts)} epochs short ({', '.join(str(r.epoch) for r in cuts)}): "
                       "nothing trained twice, but not every index was trained")
    if open_ and not allow_unfinished:
        return False, (f"{head}; {len(open_)} epochs did not finish ({', '.join(str(r.epoch) for r in open_)}): "
                       "nothing violated so far, but G1 is not established for them")
    if cuts:
        return True, f"{head}; G1 holds for the finished epochs; {len(cuts)} epochs cut short by the trainer"
    return True, f"{head}; G1 holds"


def render(reports: Iterable[EpochReport]) -> str:
    """The audit table (with a ``filtered`` column when a sample was filtered out)."""
    reports = list(reports)
    filters = any(r.filtered for r in reports)
    lines = [f"{'job':<16} {'epoch':>5} {'expected':>9} {'trained':>9} {'duplicates':>10} {'missing':>8}"
             f"{'  filtered' if filters else ''}  verdict"]
    for r in reports:
        lines.append(f"{r.job:<16} {r.epoch:>5} {r.expected:>9} {r.trained:>9} {r.duplicates:>10} {r.missing:>8}"
                     f"{f' {r.filtered:>9}' if filters else ''}  {r.why}")
    return "\n".join(lines)
