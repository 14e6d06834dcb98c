"""The chaos run's record and its checks: what it injected, the audit and the resume point after every
launch, the journal's history at the end, and the lines that report them.

:mod:`croupier.harness.chaos` runs the job and injects the faults (counting them in a :class:`Tally`);
the checks here only read what the run left: the audit log, the checkpoints and, with replicas,
the journal in the shared store, read back to check that no generation was accepted twice or out
of order and that no acknowledged join was lost.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from croupier.tools.audit import EpochReport, audit, load, render

#: The chaos run's job.
JOB = "chaos"
DATABASE_MODES = ("fast", "immediate")  # PostgreSQL shutdown modes, in turn


class ChaosError(RuntimeError):
    """Something the chaos run did not inject went wrong: a crash, a hang, an audit violation."""


@dataclasses.dataclass
class Tally:
    """What the run injected."""

    rank_kills: int = 0
    coordinator_kills: int = 0
    preemptions: int = 0
    older_restarts: int = 0  # relaunches from a checkpoint older than the latest
    resizes: int = 0
    launches: int = 0
    rollback_steps: int = 0  # steps undone by restarts from older checkpoints
    replica_kills: int = 0
    first_endpoint_kills: int = 0  # replica kills of the first endpoint, the one every rank calls first
    busy_replica_kills: int = 0  # replica kills of a replica with client connections when it was killed
    database_restarts: dict[str, int] = dataclasses.field(default_factory=lambda: {m: 0 for m in DATABASE_MODES})
    coordinator_pauses: int = 0  # --datacenter: SIGSTOP of the coordinator, then SIGCONT
    rank_pauses: int = 0  # --datacenter: SIGSTOP of a worker, then SIGCONT
    clock_jumps: int = 0  # --datacenter: the coordinator's wall clock moved an hour
    disk_fulls: int = 0  # --datacenter: the store's file system full for a while
    partitions: int = 0  # --datacenter: the job's network cut from the coordinator's for a while
    slow_links: int = 0  # --datacenter: the link between them slow and lossy for a while
    replica_pauses: int = 0  # --datacenter with replicas: SIGSTOP of a replica, then SIGCONT
    db_partitions: int = 0  # --datacenter with replicas: a replica cut from the database for a while
    job_partitions: int = 0  # --datacenter with replicas: the job cut from a replica for a while
    db_slow_links: int = 0  # --datacenter with replicas: a replica's link to the database slow and lossy
    job_slow_links: int = 0  # --datacenter with replicas: the job's link to a replica slow and lossy

    @property
    def faults(self) -> int:
        return (self.rank_kills + self.coordinator_kills + self.preemptions + self.replica_kills
                + sum(self.database_restarts.values()) + self.coordinator_pauses + self.rank_pauses
                + self.clock_jumps + self.disk_fulls + self.partitions + self.slow_links + self.replicated_datacenter)

    @property
    def replicated_datacenter(self) -> int:
        """The faults of the replicated data-center mode beside its kills and restarts (a worker's pause is a
        rank pause)."""
        return (self.replica_pauses + self.db_partitions + self.job_partitions + self.db_slow_links
                + self.job_slow_links)


@dataclasses.dataclass(frozen=True)
class History:
    """What :func:`check_history` read and checked."""

    records: int  # journal records read
    generations: int  # GenerationOpened events of the job, numbered 1.. in journal order
    started: int  # GenerationStarted events of the job
    acknowledged: int  # distinct (incarnation, generation) the ranks were acknowledged, all in the journal
    join_lines: int  # lines of WORKDIR/joins.jsonl
    incarnations: int  # incarnations in the audit log (each an acknowledged join too)
    first_seq: int  # the first journal record held (1 unless a snapshot pruned the ones before)
    unchecked: int  # acknowledged joins of generations before first_seq, which a snapshot pruned


def check_audit(work: pathlib.Path, when: str) -> list[EpochReport]:
    """Audits what has been trained so far (WORKDIR/audit); raises ChaosError on a violation of G1."""
    if not any((work / "audit").glob("*/*.audit")):
        return []
    reports = audit(work / "audit")
    bad = [r for r in reports if not r.ok]
    if bad:
        print("\n" + render(reports), flush=True)
        raise ChaosError(f"the audit {when} found G1 violated in epochs {[r.epoch for r in bad]}: "
                         + "; ".join(f"epoch {r.epoch}: {r.why}" for r in bad))
    return reports


def _origin_of(ckpt: pathlib.Path | None) -> str | None:
    """The origin of the sampler state saved in a checkpoint (where the state was made); None: a fresh start."""
    if ckpt is None:
        return None
    import torch

    origin = torch.load(ckpt, weights_only=True)["sampler"].get("origin")
    return str(origin) if origin is not None else None


def check_resumed(work: pathlib.Path, number: int, since: float, ckpt: pathlib.Path | None) -> None:
    """Checks that launch `number` (started at `since`) resumed its data from `ckpt`, as its model did.

    The audit follows the chain the samplers logged; this ties that chain to the checkpoints the
    orchestrator handed out, so that a trainer that restores the model but not the sampler fails too.
    """
    incs = [i for i in load(work / "audit").get(JOB, []) if i.ts >= since] if (work / "audit").exists() else []
    if not incs:
        return  # no rank of this launch got as far as its first batch
    expected, got = _origin_of(ckpt), incs[0].origin
    if got != expected:
        raise ChaosError(f"launch {number} resumed from {ckpt.name if ckpt else 'scratch'}, whose sampler state is "
                         f"{expected or 'a fresh start'}, but its samplers logged {got or 'a fresh start'}: the data "
                         "did not roll back with the model")


def check_store(store: str) -> None:
    """Raises ValueError unless `store` is a ``postgresql://`` database that holds no journal yet."""
    from croupier.server import open_store, redact_url

    if not store.startswith(("postgresql://", "postgres://")):
        raise ValueError(f"store must be a postgresql:// URL: the replicas share it (got {redact_url(store)!r}); "
                         "without one, the run keeps a sqlite store in its workdir")
    opened = open_store(store)
    try:
        rec = opened.load()
    finally:
        opened.close()
    if rec.snapshot is not None or rec.records:
        raise ValueError(f"store {redact_url(store)} already holds a journal (up to record {rec.last_seq}): the "
                         "history check reads the whole journal as this run's; give the run an empty database")


def _read_joins(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            out.append(json.loads(line))
        except ValueError:
            raise ChaosError(f"{path}:{i} is not a JSON line (got {line[:80]!r})") from None
    return out


@dataclasses.dataclass
class _Generations:
    """What a job's journal records say of its generations."""

    opened: dict[int, tuple[str, int, int]]  # generation -> (incarnation, world, seq)
    by_incarnation: dict[str, int]
    started: dict[int, int]  # generation -> seq
    last: int  # the last generation opened (0: none)


def _read_generations(events: Any, job: str, first_seq: int) -> _Generations:
    """The generations `job`'s records open and start, checked in journal order (see :func:`check_history`)."""
    from croupier.server import GenerationOpened, GenerationStarted, RankJoined

    opened: dict[int, tuple[str, int, int]] = {}  # generation -> (incarnation, world, seq)
    by_incarnation: dict[str, int] = {}
    started: dict[int, int] = {}  # generation -> seq
    last = 0
    for seq, ev in events:
        if getattr(ev, "job", None) != job:
            continue
        if isinstance(ev, GenerationOpened):
            # After a pruned prefix, the first generation held may have any number; then each the next.
            if (opened or first_seq == 1) and ev.generation != last + 1:
                raise ChaosError(f"journal record {seq} opens generation {ev.generation} of job {job!r} after "
                                 f"generation {last}: a generation accepted twice or out of order")
            if ev.incarnation in by_incarnation:
                raise ChaosError(f"journal record {seq} opens generation {ev.generation} with incarnation {ev.incarnation!r}, "
                                 f"which already opened generation {by_incarnation[ev.incarnation]}")
            opened[ev.generation] = (ev.incarnation, ev.world, seq)
            by_incarnation[ev.incarnation] = ev.generation
            last = ev.generation
        elif isinstance(ev, (GenerationStarted, RankJoined)):
            what = "starts" if isinstance(ev, GenerationStarted) else f"joins rank {ev.rank} to"
            if ev.generation not in opened:
                raise ChaosError(f"journal record {seq} {what} generation {ev.generation} of job {job!r}, which no "
                                 "earlier record opened")
            if isinstance(ev, GenerationStarted):
                if ev.generation in started:
                    raise ChaosError(f"journal record {seq} starts generation {ev.generation} again (first started "
                                     f"by record {started[ev.generation]})")
                started[ev.generation] = seq
    return _Generations(opened, by_incarnation, started, last)


def _check_acknowledged(acks: list[tuple[str, int | None, int | None, str]], journal: _Generations,
                        first_seq: int) -> tuple[int, int]:
    """Checks every acknowledged join against the journal; returns (joins checked, joins a pruned prefix hid)."""
    opened, by_incarnation, started, last = journal.opened, journal.by_incarnation, journal.started, journal.last
    first_gen = min(opened, default=last + 1)
    checked: set[tuple[str, int]] = set()
    unchecked: set[tuple[str, int | None]] = set()
    for incarnation, gen, world, where in acks:
        if gen is None:  # recorded without the generation (see demo_train): the incarnation must be there
            gen = by_incarnation.get(incarnation)
            if gen is None and first_seq == 1:
                raise ChaosError(f"the join acknowledged with incarnation {incarnation!r} ({where}) is not in the journal: lost")
        if gen is None or gen < first_gen and gen not in opened:
            unchecked.add((incarnation, gen))
            continue
        if gen not in opened:
            raise ChaosError(f"the join acknowledged as generation {gen} with incarnation {incarnation!r} ({where}) is not "
                             f"in the journal, which opened generations {first_gen}..{last}: an acknowledged join lost")
        jincarnation, jworld, seq = opened[gen]
        if jincarnation != incarnation or (world is not None and jworld != world):
            raise ChaosError(f"the join acknowledged as generation {gen} with incarnation {incarnation!r}, world {world} "
                             f"({where}) is not what journal record {seq} opened: incarnation {jincarnation!r}, world {jworld}")
        if gen not in started:
            raise ChaosError(f"generation {gen} was acknowledged as started ({where}) but the journal never started it")
        checked.add((incarnation, gen))
    return len(checked), len(unchecked)


def check_history(store_url: str, work: pathlib.Path, job: str = JOB) -> History:
    """Checks the run's journal against itself and against the joins the ranks were acknowledged.

    The job's ``GenerationOpened`` events must number its generations 1, 2, 3, ... in journal
    order (none twice, none out of order), each with an incarnation of its own; each
    ``GenerationStarted`` and ``RankJoined`` must come after the ``GenerationOpened`` of its
    generation, and no generation may start twice. Every acknowledged join, as the ranks
    recorded it (WORKDIR/joins.jsonl) and as the audit log names it (one incarnation per
    generation a rank joined), must be in the journal: that generation, opened with that incarnation
    and that world, and started.

    NOTE: ``read_since(0)`` rather than ``load()``: a snapshot hides the records before it from
    ``load()``, while the journal keeps them (up to its prune margin). If a snapshot pruned some,
    the numbering is checked from the first generation still held, and the acknowledged joins of
    earlier generations are counted as unchecked.

    Args:
        store_url: The run's store: the replicas' ``postgresql://`` database, or the single
            coordinator's ``sqlite:///`` file once the coordinator is stopped.
        work: The run's workdir (joins.jsonl, audit/).
        job: The job.

    Returns:
        The figures of the check.

    Raises:
        ChaosError: The first violation, with the journal's seq and the values involved.
    """
    from croupier.server import open_store, read_journal

    store = open_store(store_url)
    try:
        rec = read_journal(store)
    finally:
        store.close()
    first_seq = rec.snapshot_seq + 1 if rec.snapshot is not None else 1
    journal = _read_generations(rec.events, job, first_seq)
    lines = _read_joins(work / "joins.jsonl")
    incs = load(work / "audit").get(job, []) if (work / "audit").exists() else []
    # (incarnation, generation, world, where it was recorded) of every acknowledged join.
    acks: list[tuple[str, int | None, int | None, str]] = [
        (str(j["incarnation"]), j.get("generation"), j.get("world"), f"joins.jsonl line {i}, rank {j.get('rank')}")
        for i, j in enumerate(lines, start=1)]
    acks += [(inc.name, inc.generation, inc.world, "the audit log") for inc in incs]
    checked, unchecked = _check_acknowledged(acks, journal, first_seq)
    return History(records=len(rec.events), generations=len(journal.opened), started=len(journal.started),
                   acknowledged=checked, join_lines=len(lines), incarnations=len(incs),
                   first_seq=first_seq, unchecked=unchecked)


def history_line(h: History) -> str:
    """The line the chaos run prints for what :func:`check_history` checked."""
    if h.first_seq == 1:
        numbered, pruned = f"numbered 1..{h.generations}", ""
    else:
        numbered = "numbered one after another from the first the journal still holds"
        pruned = (f"; the journal was pruned before record {h.first_seq}: {h.unchecked} acknowledged joins of "
                  "earlier generations not checked")
    return (f"history: {h.generations} generations of job {JOB!r} opened in journal order, {numbered}: none twice, "
            f"none out of order, each with an incarnation of its own, {h.started} started after they opened; "
            f"{h.acknowledged} acknowledged joins ({h.join_lines} rank records in joins.jsonl, {h.incarnations} "
            f"incarnations in the audit log) all in the journal: no acknowledged join lost ({h.records} journal "
            f"records read{pruned})")


def summary(t: Tally, reports: list[EpochReport], seconds: float, replicated: bool) -> str:
    """The run's last line: the faults it injected, and what the audit of every epoch found."""
    if replicated:
        db = t.database_restarts
        kills = (f"{t.rank_kills} rank kills, {t.replica_kills} replica kills ({t.first_endpoint_kills} of the first "
                 f"endpoint, {t.busy_replica_kills} of a replica with active clients), {sum(db.values())} database "
                 f"restarts ({db['fast']} fast, {db['immediate']} immediate)")
    else:
        kills = f"{t.rank_kills} rank kills, {t.coordinator_kills} coordinator kills"
    if replicated and t.replicated_datacenter + t.rank_pauses:
        kills += (f", {t.replica_pauses} replica pauses, {t.rank_pauses} rank pauses, {t.db_partitions} replica-database "
                  f"partitions, {t.job_partitions} job-replica partitions, {t.db_slow_links} slow replica-database "
                  f"links, {t.job_slow_links} slow job-replica links")
    elif t.coordinator_pauses + t.rank_pauses + t.clock_jumps + t.disk_fulls + t.partitions + t.slow_links:
        kills += (f", {t.coordinator_pauses} coordinator pauses, {t.rank_pauses} rank pauses, {t.clock_jumps} clock "
                  f"jumps, {t.disk_fulls} full disks, {t.partitions} partitions, {t.slow_links} slow links")
    return (f"chaos: {t.faults} faults injected ({kills}, {t.preemptions} preemptions), {t.resizes} resizes, "
            f"{t.older_restarts} restarts from an older checkpoint ({t.rollback_steps} steps rolled back), "
            f"{t.launches} launches; {sum(r.trained for r in reports)} samples audited over {len(reports)} epochs: "
            f"{sum(r.duplicates for r in reports)} duplicates, {sum(r.missing for r in reports)} missing; G1 holds "
            f"({seconds:.0f} s)")


def by_source_table(reports: list[EpochReport]) -> str:
    """A mixture's audit by source and source epoch, after a blank line; "" for a job of one dataset."""
    from croupier.tools.audit import by_source, render_sources

    rows = by_source(reports)
    return "\n\nby source and source epoch:\n" + render_sources(rows) if rows else ""
