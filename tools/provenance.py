"""`croupier provenance`: what a job's training steps trained, where a sample was trained, and the run as an order file.

The coordinator sends the job's history (a few bytes per run, ``GetLedger``); every question is
answered here by it (``croupier.core.history``: a job of generations or of torchft replica groups
answers alike, with the same answers). The formatting is pure (a history's answers in, lines out);
:func:`ledger` is the only part that calls the coordinator.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, TextIO, overload

import numpy as np

from croupier.core import settings
from croupier.core.errors import CroupierError, InvalidArgument, NotFound, Unavailable
from croupier.core.history import History
from croupier.core.kept import NO_KEPT
from croupier.core.ledger import Occurrence, StepRecord, Version
from croupier.core.shards import shard_of
from croupier.core.spec import Spec
from croupier.tools.status import table

#: How long the command retries a coordinator that does not answer, and how long one call may take.
RETRY_FOR_S = 3.0
CALL_TIMEOUT_S = 30.0
#: Samples a version shows without ``--full`` (a step of 1,024 ranks holds thousands).
SHOWN = 16


class Refused(Exception):
    """The run cannot answer as asked (an export of a run whose steps differ in size); the message says why."""


# --------------------------------------------------------------------------- asking


def ledger(address: str | None, job: str) -> History:
    """The job's history (its step ledger, for every kind of job), fetched once from its coordinator.

    Args:
        address: HOST:PORT of the coordinator; None for ``CROUPIER_ADDRESS``, else 127.0.0.1:50051.
        job: The job's name.

    Raises:
        NotFound: no such job (the message names the jobs the coordinator holds).
        Unavailable: the coordinator did not answer within a few seconds.
    """
    from croupier.client import CoordinatorClient

    address = settings.coordinator_address(address)
    with CoordinatorClient(address, retry_for=RETRY_FOR_S, call_timeout=CALL_TIMEOUT_S) as client:
        try:
            return client.history(job)[0]
        except NotFound:
            known = client.jobs()
            raise NotFound(f"no job {job!r} at {address} (jobs: {', '.join(known) or 'none'})") from None


@overload
def provenance(address: str | None, job: str, *, step: int) -> StepRecord: ...
@overload
def provenance(address: str | None, job: str, *, steps: tuple[int, int]) -> list[StepRecord]: ...
@overload
def provenance(address: str | None, job: str, *, index: int, source: int | None = None) -> list[Occurrence]: ...


def provenance(address: str | None, job: str, *, step: int | None = None, steps: tuple[int, int] | None = None,
               index: int | None = None, source: int | None = None) -> StepRecord | list[StepRecord] | list[Occurrence]:
    """What `croupier provenance` answers, for programs: one question of a job's step ledger.

    Give one of `step`, `steps` or `index`. Steps count from 1, as the trainers log them (a
    checkpoint saved after step s was given ``state_dict(step=s)``).

    Args:
        address: HOST:PORT of the coordinator; None for ``CROUPIER_ADDRESS``, else 127.0.0.1:50051.
        job: The job's name.
        step: The samples of step `step`: the version its timeline keeps and every abandoned one.
        steps: ``(a, b)``: steps `a` to `b`, both included.
        index: Every (epoch, step, rank, generation) at which dataset index `index` was trained.
        source: With `index`: the index is numbered within this source of a mixture.

    Returns:
        A :class:`~croupier.core.ledger.StepRecord`, a list of them, or a list of
        :class:`~croupier.core.ledger.Occurrence` (each has ``to_dict()`` for JSON).

    Raises:
        ValueError: not exactly one question, or `source` without `index`.
        InvalidArgument: a step below 1, an empty range, an index or source out of the dataset.
        OutOfRange: a step past the last the job trained.
        FailedPrecondition: the history that would place a step is missing (the message says which part).
        NotFound: no such job.
    """
    asked = [name for name, v in (("step", step), ("steps", steps), ("index", index)) if v is not None]
    if len(asked) != 1:
        raise ValueError(f"provenance asks one question: step=, steps= or index= (got {', '.join(asked) or 'none'})")
    if source is not None and index is None:
        raise ValueError(f"source={source} numbers an index within a source: it needs index=")
    return answer(ledger(address, job), step=step, steps=steps, index=index, source=source)


def answer(led: History, *, step: int | None = None, steps: tuple[int, int] | None = None, index: int | None = None,
           source: int | None = None) -> StepRecord | list[StepRecord] | list[Occurrence]:
    """:func:`provenance`'s question asked of a ledger at hand."""
    if step is not None:
        return led.step(step)
    if steps is not None:
        return led.steps(*steps)
    assert index is not None
    return led.index(index, source)


def step_range(text: str) -> tuple[int, int | None]:
    """The argument of ``--steps``: ``A:B`` (both included), or ``A:`` for A to the last step.

    Raises:
        ValueError: not of that form (the message names the text).
    """
    a, sep, b = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(a), (int(b) if b.strip() else None)
    except ValueError:
        raise ValueError(f"--steps takes FIRST:LAST or FIRST: (steps count from 1; got {text!r})") from None


# --------------------------------------------------------------------------- text


def _version_lines(v: Version, mixture: bool, full: bool, spec: Spec | None = None) -> list[str]:
    mark = "kept" if v.kept else "ABANDONED (a later generation resumed from a checkpoint before it)"
    n = sum(b.indices.size for b in v.batches)
    # NOTE: a torchft step's version names its quorum and stream span; its "ranks" are its participating groups
    quorum = "" if v.quorum is None or v.span is None else f", quorum {v.quorum}, stream [{v.span[0]}, {v.span[1]})"
    lines = [f"  generation {v.generation} ({v.incarnation}), world {v.world}, epoch {v.epoch}{quorum}: {mark}; "
             f"{n} samples"]
    rows: list[list[str]] = []
    sharded = spec is not None and spec.shards is not None
    for b in v.batches:
        place = shard_of(spec, b.indices) if sharded and spec is not None else None
        for k in range(b.indices.size):
            if not full and len(rows) == SHOWN:
                break
            row = [str(b.rank), str(b.micro), str(int(b.indices[k]))]
            if place is not None:
                row += [str(int(place[0][k])), str(int(place[1][k]))]
            if mixture:
                row += [str(int(b.sources[k])), str(int(b.source_epochs[k]))]
            rows.append([*row, str(int(b.seeds[k]))])
    header = ["RANK", "MICRO", "INDEX", *(["SHARD", "ROW"] if sharded else []),
              *(["SOURCE", "SOURCE EPOCH"] if mixture else []), "SEED"]
    lines += [f"    {line}" for line in table(header, rows)]
    if len(rows) < n:
        lines.append(f"    ... {n - len(rows)} more samples (--full prints every one, --json all of it)")
    return lines


def step_lines(job: str, rec: StepRecord, mixture: bool, full: bool = False, spec: Spec | None = None) -> list[str]:
    """Step `rec.step` as text: each version (kept first) with its generation, world, epoch and samples.

    Args:
        mixture: Show each sample's source and source epoch (a job without a mixture has source 0
            and its epochs).
        full: Every sample; else the first :data:`SHOWN` of each version.
        spec: The job's spec: a dataset in shards shows each sample's shard and row too.
    """
    versions = ([rec.kept] if rec.kept is not None else []) + list(rec.abandoned)
    lines = [f"job {job!r}, step {rec.step}: {len(versions)} version{'s' if len(versions) != 1 else ''}"
             f"{'' if rec.kept is not None else ', none kept (every version was abandoned)'}"]
    for v in versions:
        lines += _version_lines(v, mixture, full, spec)
    return lines


def step_doc(rec: StepRecord, spec: Spec) -> dict[str, Any]:
    """Step `rec.step` as JSON: the ledger's answer, and for a dataset in shards each sample's shard and row."""
    doc = rec.to_dict()
    if spec.shards is not None:
        for version in [doc["kept"], *doc["abandoned"]]:
            for b in version["batches"] if version else ():
                shard, row = shard_of(spec, np.asarray(b["indices"], dtype=np.int64))
                b["shards"], b["rows"] = shard.tolist(), row.tolist()
    return doc


def index_lines(job: str, index: int, source: int | None, occurrences: Sequence[Occurrence]) -> list[str]:
    """Every place sample `index` was trained, as a table (oldest epoch first)."""
    what = f"index {index}" if source is None else f"sample {index} of source {source}"
    kept = sum(o.kept for o in occurrences)
    head = (f"job {job!r}, {what}: trained {len(occurrences)} time{'s' if len(occurrences) != 1 else ''} "
            f"({kept} kept, {len(occurrences) - kept} abandoned)")
    if not occurrences:
        return [f"job {job!r}, {what}: never trained (as far as the ranks reported)"]
    rows = [[str(o.epoch), str(o.step), str(o.rank), str(o.micro), str(o.generation), str(o.source),
             str(o.source_epoch), "kept" if o.kept else "ABANDONED"] for o in occurrences]
    return [head, *(f"  {line}" for line in
                    table(["EPOCH", "STEP", "RANK", "MICRO", "GENERATION", "SOURCE", "SOURCE EPOCH", ""], rows))]


def timeline_lines(led: History) -> list[str]:
    """The job's generations: the steps each trained, up to which the timeline keeps them, its world and batch."""
    segs = led.timeline()
    if not segs:
        return [f"job {led.job!r}: no generation started yet"]
    batch = led.constant_batch()
    lines = [f"job {led.job!r}: {led.last_step} steps on its timeline"
             + (f", {batch} samples each" if batch else ", of different sizes (a resize, a ramp-up or token budgets)")]
    rows = []
    for s in segs:
        first = "?" if s["from_step"] is None else str(s["from_step"] + 1)
        last = "?" if s["to_step"] is None else str(s["to_step"])
        kept = "abandoned" if s["kept_to"] is None else f"to step {s['kept_to']}"
        kinds = [a[0] for a in s["amendments"]]
        amended = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)) or "-"
        rows.append([str(s["generation"]), s["incarnation"], str(s["world"]), str(s["epoch"]),
                     f"{first}..{last}", kept, str(s["global_batch"] or "-"), amended])
    return lines + [f"  {line}" for line in table(
        ["GENERATION", "INCARNATION", "WORLD", "EPOCH", "STEPS", "KEPT", "GLOBAL BATCH", "AMENDMENTS"], rows)]


# --------------------------------------------------------------------------- export


@dataclasses.dataclass(frozen=True)
class Exported:
    """An order file written: `steps` batches of `batch` indices of `dtype`, batch N (from 0) being step N + 1."""

    path: str
    steps: int
    batch: int
    dtype: str


def export(led: History, path: str | os.PathLike[str]) -> Exported:
    """Writes the kept timeline's steps 1 .. last as an OLMo-style order file (``global_indices.npy``).

    Entry ``N * B + k`` is sample k of step N + 1 (B samples a step, in rank then micro-batch order);
    ``np.load(path, mmap_mode="r")`` reads it as OLMo's tools do. The indices are ``uint32`` when the
    dataset's indices fit (OLMo's type), else ``uint64``. The steps come from the history in pieces of
    many steps (``History.kept_order``: their positions laid out and mapped to indices at once), each
    written out and dropped before the next, so the memory it takes does not grow with the run (a few
    arrays of ``croupier.core.kept.PIECE`` samples); it writes a temporary file beside `path`, renamed
    over it at the end: a refusal half-way leaves no file.

    Raises:
        Refused: the run's global batch is not constant (a ramp-up, a resize that changed it, token
            budgets), a step is short (an epoch's last) or none of its versions is kept, or it has no step.
        FailedPrecondition: the history before some step is missing (the message says which).
    """
    batch = led.constant_batch()
    if batch is None:
        raise Refused(f"job {led.job!r} cannot be written as an order file of one global batch a step: "
                      f"{led.why_batch_varies()}")
    last = led.last_step
    if last < 1:
        raise Refused(f"job {led.job!r} has trained no step yet: there is nothing to write")
    space = led.spec.space
    dtype = np.dtype(np.uint32 if space <= 2**32 else np.uint64)
    target = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (last * batch,)}
            np.lib.format.write_array_header_1_0(f, header)  # (steps * batch,): what open_memmap writes
            for piece in led.kept_order(1, last):
                _check_full(led.job, piece.first, piece.sizes, batch)
                f.write(piece.indices.astype(dtype).data)
        os.replace(tmp, target)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return Exported(str(target), last, batch, dtype.name)


def _check_full(job: str, first: int, sizes: np.ndarray, batch: int) -> None:
    """Refuses the first of steps `first` .. that is not a full global batch (`sizes`: each one's samples)."""
    bad = np.flatnonzero(sizes != batch)
    if bad.size:
        step, size = first + int(bad[0]), int(sizes[bad[0]])
        if size == NO_KEPT:
            raise Refused(f"step {step} of job {job!r} has no kept version: every one was abandoned")
        raise Refused(f"step {step} of job {job!r} trained {size} samples, not {batch} (an "
                      "epoch's short last step): an order file needs every step full")


# --------------------------------------------------------------------------- the command


def main(address: str | None, job: str, *, step: int | None = None, steps: str | None = None,
         index: int | None = None, source: int | None = None, as_json: bool = False, full: bool = False,
         export_to: str | None = None, logdir: str | None = None, out: TextIO | None = None) -> int:
    """`croupier provenance`: prints the answer (text or JSON), or writes the order file.

    Without a question it prints the job's timeline (its generations and the steps each trained).
    With `logdir` (else ``CROUPIER_AUDIT_DIR`` when set), `index` also lists the epochs in which the
    sample was filtered out, from the job's audit logs (:mod:`croupier.tools.provenance_filtered`).

    Returns:
        0; 2 for a bad argument (a step below 1, an empty range, an index out of the dataset, a
        malformed ``--steps``, ``--source`` without ``--index``); 1 when the run cannot answer (a
        step past it, an unknown job, missing history, an export refused, a coordinator that does
        not answer). The message goes to stderr, never a traceback.
    """
    out = sys.stdout if out is None else out
    address = settings.coordinator_address(address)
    try:
        span = _one_question(step, steps, index, source, export_to, logdir)
        named = logdir is not None  # NOTE: CROUPIER_AUDIT_DIR is read when set; a job it holds no log of is no error
        logdir = logdir if named else settings.get("CROUPIER_AUDIT_DIR")
    except ValueError as e:
        print(f"croupier provenance: error: {e}", file=sys.stderr)
        return 2
    try:
        led = ledger(address, job)
        if export_to is not None:
            done = export(led, export_to)
            out.write(f"job {job!r}: wrote {done.path}: {done.steps} steps of {done.batch} samples "
                      f"({done.dtype}; batch N is step N + 1)\n")
            return 0
        if index is not None:
            doc, lines = _index_answer(led, job, index, source, logdir, named)
        else:
            doc, lines = _step_answer(led, job, step, span, full)
    except InvalidArgument as e:
        print(f"croupier provenance: error: {e}", file=sys.stderr)
        return 2
    except Unavailable as e:
        detail = str(e).removeprefix(f"coordinator at {address}: ")
        print(f"croupier provenance: the coordinator at {address} is unavailable (retried for {RETRY_FOR_S:g} s): "
              f"{detail}", file=sys.stderr)
        return 1
    except (CroupierError, Refused, OSError, RuntimeError) as e:
        print(f"croupier provenance: {e}", file=sys.stderr)
        return 1
    out.write(json.dumps(doc) + "\n" if as_json else "\n".join(lines) + "\n")
    return 0


def _one_question(step: int | None, steps: str | None, index: int | None, source: int | None,
                  export_to: str | None, logdir: str | None) -> tuple[int, int | None] | None:
    """Checks that the arguments ask one question; returns the range of steps asked (``--steps``), if one is.

    Raises:
        ValueError: two questions at once, ``--source`` or ``--logdir`` without ``--index``, a malformed range.
    """
    asked = [a for a, v in (("--step", step), ("--steps", steps), ("--index", index), ("--export", export_to))
             if v is not None]
    if len(asked) > 1:
        raise ValueError(f"{' and '.join(asked)}: give one question at a time")
    if source is not None and index is None:
        raise ValueError(f"--source {source} numbers an index within a source: it needs --index")
    if logdir is not None and index is None:
        raise ValueError(f"--logdir {logdir} reads the filtered samples of an index: it needs --index")
    return step_range(steps) if steps is not None else None


def _step_answer(led: History, job: str, step: int | None, span: tuple[int, int | None] | None,
                 full: bool) -> tuple[Any, list[str]]:
    """The answer (its JSON document and its lines) of a step, a range of steps, or, with neither, the timeline."""
    doc: Any
    if span is not None:
        recs = led.steps(span[0], max(led.last_step, span[0]) if span[1] is None else span[1])
        doc = [step_doc(r, led.spec) for r in recs]
        lines = [line for k, r in enumerate(recs)
                 for line in ([""] if k else []) + step_lines(job, r, led.spec.sources is not None, full, led.spec)]
    elif step is not None:
        rec = led.step(step)
        doc, lines = step_doc(rec, led.spec), step_lines(job, rec, led.spec.sources is not None, full, led.spec)
    else:
        doc = {"job": job, "last_step": led.last_step, "global_batch": led.constant_batch(),
               "timeline": led.timeline()}
        lines = timeline_lines(led)
    return doc, lines


def _index_answer(led: History, job: str, index: int, source: int | None, logdir: str | None,
                  named: bool) -> tuple[Any, list[str]]:
    """The answer (its JSON document and its lines) of a sample: the steps that trained it, and with the audit
    logs under `logdir` the epochs in which it was filtered out (`named`: the logdir was asked for, so a job
    it holds no log of is an error).

    Raises:
        Refused: the audit logs could not be read.
        NotFound: `named`, and no audit log of the job there.
    """
    occ = led.index(index, source)
    doc: list[dict[str, Any]] = [o.to_dict() for o in occ]
    lines = index_lines(job, index, source, occ)
    if logdir is None:
        return doc, lines
    from croupier.tools import provenance_filtered as pf

    try:
        fl = pf.filtered_at(logdir, job, index, source)
    except NotFound:
        if named:
            raise
        return doc, lines
    except ValueError as e:
        raise Refused(f"the audit logs under {logdir}: {e}") from None
    return [{**d, "filtered": False} for d in doc] + [f.to_dict() for f in fl], pf.index_lines(job, index, source, occ, fl, lines)
