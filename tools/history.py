"""The chaos run's history checker: the journal read back, checked against itself and the joins acknowledged.

``croupier chaos`` with replicas (see :mod:`croupier.tools.chaos`) runs it at the end: no
generation accepted twice or out of order, and no acknowledged join lost.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from croupier.tools.audit import load

#: The chaos run's job.
JOB = "chaos"


class ChaosError(RuntimeError):
    """Something the chaos run did not inject went wrong: a crash, a hang, an audit violation."""


@dataclasses.dataclass(frozen=True)
class History:
    """What :func:`check_history` read and checked."""

    records: int  # journal records read
    generations: int  # GenerationOpened events of the job, numbered 1.. in journal order
    started: int  # GenerationStarted events of the job
    acknowledged: int  # distinct (token, generation) the ranks were acknowledged, all in the journal
    join_lines: int  # lines of WORKDIR/joins.jsonl
    incarnations: int  # incarnations in the audit log (each an acknowledged join too)
    first_seq: int  # the first journal record held (1 unless a snapshot pruned the ones before)
    unchecked: int  # acknowledged joins of generations before first_seq, which a snapshot pruned


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


def check_history(store_url: str, work: pathlib.Path, job: str = JOB) -> History:
    """Checks the journal in the shared store against itself and against the joins the ranks were acknowledged.

    The job's ``GenerationOpened`` events must number its generations 1, 2, 3, ... in journal
    order (none twice, none out of order), each with a token of its own; each
    ``GenerationStarted`` and ``RankJoined`` must come after the ``GenerationOpened`` of its
    generation, and no generation may start twice. Every acknowledged join, as the ranks
    recorded it (WORKDIR/joins.jsonl) and as the audit log names it (one incarnation per
    generation a rank joined), must be in the journal: that generation, opened with that token
    and that world, and started.

    NOTE: ``read_since(0)`` rather than ``load()``: a snapshot hides the records before it from
    ``load()``, while the journal keeps them (up to its prune margin). If a snapshot pruned some,
    the numbering is checked from the first generation still held, and the acknowledged joins of
    earlier generations are counted as unchecked.

    Args:
        store_url: The shared store (``postgresql://``).
        work: The run's workdir (joins.jsonl, audit/).
        job: The job.

    Returns:
        The figures of the check.

    Raises:
        ChaosError: The first violation, with the journal's seq and the values involved.
    """
    from croupier.server import GenerationOpened, GenerationStarted, RankJoined, open_store, read_journal

    store = open_store(store_url)
    try:
        rec = read_journal(store)
    finally:
        store.close()
    first_seq = rec.snapshot_seq + 1 if rec.snapshot is not None else 1
    opened: dict[int, tuple[str, int, int]] = {}  # generation -> (token, world, seq)
    by_token: dict[str, int] = {}
    started: dict[int, int] = {}  # generation -> seq
    last = 0
    for seq, ev in rec.events:
        if getattr(ev, "job", None) != job:
            continue
        if isinstance(ev, GenerationOpened):
            # After a pruned prefix, the first generation held may have any number; then each the next.
            if (opened or first_seq == 1) and ev.generation != last + 1:
                raise ChaosError(f"journal record {seq} opens generation {ev.generation} of job {job!r} after "
                                 f"generation {last}: a generation accepted twice or out of order")
            if ev.token in by_token:
                raise ChaosError(f"journal record {seq} opens generation {ev.generation} with token {ev.token!r}, "
                                 f"which already opened generation {by_token[ev.token]}")
            opened[ev.generation] = (ev.token, ev.world, seq)
            by_token[ev.token] = ev.generation
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
    first_gen = min(opened, default=last + 1)

    lines = _read_joins(work / "joins.jsonl")
    incs = load(work / "audit").get(job, []) if (work / "audit").exists() else []
    # (token, generation, world, where it was recorded) of every acknowledged join.
    acks: list[tuple[str, int | None, int | None, str]] = [
        (str(j["token"]), j.get("generation"), j.get("world"), f"joins.jsonl line {i}, rank {j.get('rank')}")
        for i, j in enumerate(lines, start=1)]
    acks += [(inc.token, inc.generation, inc.world, "the audit log") for inc in incs]
    checked: set[tuple[str, int]] = set()
    unchecked: set[tuple[str, int | None]] = set()
    for token, gen, world, where in acks:
        if gen is None:  # recorded without the generation (see demo_train): the token must be there
            gen = by_token.get(token)
            if gen is None and first_seq == 1:
                raise ChaosError(f"the join acknowledged with token {token!r} ({where}) is not in the journal: lost")
        if gen is None or gen < first_gen and gen not in opened:
            unchecked.add((token, gen))
            continue
        if gen not in opened:
            raise ChaosError(f"the join acknowledged as generation {gen} with token {token!r} ({where}) is not in the "
                             f"journal, which opened generations {first_gen}..{last}: an acknowledged join lost")
        jtoken, jworld, seq = opened[gen]
        if jtoken != token or (world is not None and jworld != world):
            raise ChaosError(f"the join acknowledged as generation {gen} with token {token!r}, world {world} ({where}) "
                             f"is not what journal record {seq} opened: token {jtoken!r}, world {jworld}")
        if gen not in started:
            raise ChaosError(f"generation {gen} was acknowledged as started ({where}) but the journal never started it")
        checked.add((token, gen))
    return History(records=len(rec.events), generations=len(opened), started=len(started),
                   acknowledged=len(checked), join_lines=len(lines), incarnations=len(incs),
                   first_seq=first_seq, unchecked=len(unchecked))


def history_line(h: History) -> str:
    """The line the chaos run prints for what :func:`check_history` checked."""
    if h.first_seq == 1:
        numbered, pruned = f"numbered 1..{h.generations}", ""
    else:
        numbered = "numbered one after another from the first the journal still holds"
        pruned = (f"; the journal was pruned before record {h.first_seq}: {h.unchecked} acknowledged joins of "
                  "earlier generations not checked")
    return (f"history: {h.generations} generations of job {JOB!r} opened in journal order, {numbered}: none twice, "
            f"none out of order, each with a token of its own, {h.started} started after they opened; "
            f"{h.acknowledged} acknowledged joins ({h.join_lines} rank records in joins.jsonl, {h.incarnations} "
            f"incarnations in the audit log) all in the journal: no acknowledged join lost ({h.records} journal "
            f"records read{pruned})")
