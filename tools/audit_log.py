"""The audit logs read back, every kind of job alike: one reader (:func:`load`), one model (:class:`Incarnation`).

Every rank of a job appends msgpack records to a file of its own under ``LOGDIR/JOB/`` (``*.audit``;
the records are described in ``croupier.client._audit_log``). Its first record, ``start``, says who
wrote it: a sampler's rank of one generation (its incarnation, under ``token``), or a rank of a torchft
replica group (its ``group``: ``croupier.integrations.torchft``), whose runs change under it (a load
of a checkpoint, a heal), so each of its ``step`` records names its run. Either way the reader makes
one :class:`Incarnation` per run of the job's history (``croupier.core.history``): a generation's with
its ranks' batches, a step run's with its attempted steps (numbered from 1), each naming the run it
resumed from in ``resumed`` (``incarnation``, and ``step``, or ``epoch`` and ``items``).

G9: logs of torchft jobs written before they took this format (``*.ftaudit``: ``step`` records alone,
each numbering its step by the steps committed before it) are read into the same model
(:func:`_legacy_steps`).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import pathlib
from collections.abc import Iterable
from typing import Any

import msgpack
import numpy as np

__all__ = ["Incarnation", "load", "read_records", "stepped"]


@dataclasses.dataclass
class _Rank:
    start: dict[str, Any]
    batches: list[tuple[int, int, np.ndarray]]  # (epoch, at, indices)


@dataclasses.dataclass
class Incarnation:
    """One run of a job as its ranks logged it: a generation, or a torchft job's step run (`steps` not empty)."""

    name: str
    generation: int
    world: int
    ts: float
    origin: str | None
    n: int
    tail: str
    partition: str
    ranks: dict[int, _Rank]
    ends: dict[int, int] = dataclasses.field(default_factory=dict)  # epoch -> ranks that finished it
    checkpoints: set[str] = dataclasses.field(default_factory=set)  # origins of the states it made
    cuts: dict[int, int] = dataclasses.field(default_factory=dict)  # epoch -> items taken when the trainer moved on
    dealing: str = "static"
    mixture: dict[str, Any] | None = None  # a mixture's sources, weights, caps, seed and shuffle
    resumed: dict[str, Any] | None = None  # the start record's checkpoint resumed from, as fields (None: none named)
    #: (epoch, at, index, rank) filtered out
    filtered: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    #: a step run's attempted steps, each a ``step`` record with its writer's ``group``, ``rank`` and ``world``
    steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def stepped(incs: Iterable[Incarnation]) -> bool:
    """Whether a job's runs are torchft step runs (their ranks logged attempted steps, not a sampler's batches)."""
    return any(inc.steps for inc in incs)


def read_records(path: pathlib.Path) -> list[dict[str, Any]]:
    """Every record of one rank's audit log, in the order written; a last record cut short (its writer
    killed mid-write) ends the list, and whatever came before it counts."""
    out = []
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False)
        try:
            for rec in unpacker:
                out.append(rec)
        except (msgpack.OutOfData, ValueError):
            pass  # a record cut short by a kill -9: everything before it counts
    return out


def load(logdir: str | os.PathLike[str], job: str | None = None) -> dict[str, list[Incarnation]]:
    """Every job's runs (of `job` alone, when named), oldest first, from every rank's log under `logdir`
    (``*.audit``, and ``*.ftaudit`` of an earlier release)."""
    jobs: dict[str, dict[str, Incarnation]] = collections.defaultdict(dict)
    folder = "*" if job is None else glob.escape(job)
    for path in sorted(pathlib.Path(logdir).glob(f"{folder}/*.audit")):
        recs = read_records(path)
        if not recs or recs[0].get("t") != "start":
            continue
        s = recs[0]
        if job is not None and s.get("job") != job:
            continue
        if "group" in s:
            _steps(jobs[s["job"]], s, recs[1:])
        else:
            _generation(jobs[s["job"]], s, recs[1:])
    for path in sorted(pathlib.Path(logdir).glob(f"{folder}/*.ftaudit")):
        _legacy_steps(jobs[path.parent.name], read_records(path))
    return {job: sorted(incs.values(), key=lambda i: i.ts) for job, incs in jobs.items() if incs}


def _generation(incs: dict[str, Incarnation], s: dict[str, Any], recs: list[dict[str, Any]]) -> None:
    """A sampler's rank of one generation: its batches, ends, checkpoints, cuts and filtered samples."""
    inc = incs.get(s["token"])
    if inc is None:
        inc = incs[s["token"]] = Incarnation(s["token"], s["generation"], s["world"], s["ts"], s.get("origin"), s["n"],
                                             s["tail"], s["partition"], {}, dealing=s.get("dealing", "static"),
                                             mixture=s.get("mixture"))
    inc.ts = min(inc.ts, s["ts"])
    inc.origin = inc.origin or s.get("origin")
    inc.resumed = inc.resumed or s.get("resumed")
    rank = _Rank(s, [])
    for r in recs:
        if r["t"] == "batch":
            rank.batches.append((r["epoch"], r["at"], np.frombuffer(r["idx"], dtype="<i8")))
        elif r["t"] == "end":
            inc.ends[r["epoch"]] = inc.ends.get(r["epoch"], 0) + 1
        elif r["t"] == "ckpt":
            inc.checkpoints.add(r["origin"])
        elif r["t"] == "cut":
            inc.cuts[r["epoch"]] = max(inc.cuts.get(r["epoch"], 0), r["items"])
        elif r["t"] == "filtered":
            inc.filtered.append((r["epoch"], r["at"], r["index"], s["rank"]))
    inc.ranks[s["rank"]] = rank


def _step_run(incs: dict[str, Incarnation], r: dict[str, Any], n: int) -> Incarnation:
    """The run a ``step`` record names, made at its first record."""
    inc = incs.get(r["run"])
    if inc is None:
        resumed = {"incarnation": r["parent"] or None, "generation": None, "epoch": None, "items": None,
                   "step": int(r["resumed"])} if r["parent"] else None
        inc = incs[r["run"]] = Incarnation(r["run"], 0, 0, r["ts"], None, n, "uneven", "stream", {}, resumed=resumed)
    inc.ts = min(inc.ts, r["ts"])
    return inc


def _steps(incs: dict[str, Incarnation], s: dict[str, Any], recs: list[dict[str, Any]]) -> None:
    """A torchft replica group's rank: each attempted step to the run it names."""
    for r in recs:
        if r["t"] == "step":
            _step_run(incs, r, s["n"]).steps.append({**r, "group": s["group"], "rank": s["rank"], "world": s["world"],
                                                    "mode": s["mode"], "batch": s["batch"], "n": s["n"]})


def _legacy_steps(incs: dict[str, Incarnation], recs: list[dict[str, Any]]) -> None:
    """A torchft rank's log of the earlier format (``*.ftaudit``: every record a ``step`` carrying its rank's
    fields, its step the steps committed before it) into the same model."""
    for r in recs:
        if r.get("t") == "step":
            _step_run(incs, r, int(r["n"])).steps.append({**r, "step": int(r["step"]) + 1})
