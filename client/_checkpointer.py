"""Checkpointing a sampler: its state dict, loading one, and resuming from the coordinator's records."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from croupier.client._resolve import agree
from croupier.client._rpc import CoordinatorClient, Unreachable
from croupier.core.checkpoint import amendments_of, from_state, items_of, spec_of, state_of_record, to_state
from croupier.core.checks import check_int
from croupier.core.cursor import Cursor, epoch_agrees, fresh, show
from croupier.core.errors import CroupierError, NotFound

if TYPE_CHECKING:
    from croupier.client._base import _Base

log = logging.getLogger("croupier")
#: How long state_dict waits for the coordinator to record a checkpoint before going on without it.
_REPORT_TIMEOUT_S = 5.0


def state_dict(s: _Base, consumed: int | None = None, *, step: int | None = None) -> dict[str, Any]:
    """The checkpoint state: a small, topology-free dict naming where the job is in its data.

    Save it with the model; loading it into a sampler of any world size resumes there. Once
    the sampler has joined, the state is also recorded at the coordinator (durably, before
    this returns), with `step` if given: :meth:`resume_from_step` finds it there, for a
    trainer that keeps only its step. When the coordinator does not answer, a warning says
    so and the state is returned all the same (it alone suffices to resume).

    Args:
        consumed: With a loader that reads the sampler ahead (a plain ``DataLoader`` with
            ``num_workers > 0``, Accelerate's), pass how many items (indices, or batches for
            the batch sampler) this rank's loop has taken in the current epoch, counted from
            the epoch's start as ``len()`` counts them (a trainer's batch index + 1, times the
            batch size for the index sampler). ``StatefulDataLoader`` and ``num_workers=0``
            need nothing: the sampler has handed out exactly what the loop took.
            With dynamic dealing, count from this generation's start (its resume) instead:
            a rank's batches there are its own, not a share of the epoch.
        step: The trainer's global step at this checkpoint (the number of optimizer steps
            taken since the job's start, as the HF Trainer's ``global_step``, Lightning's
            ``global_step`` or torchtitan's ``step`` count it), naming the coordinator's record.
    """
    if step is not None:
        check_int("step", step, 0, None, ValueError)
    if s._empty:
        return {}
    if consumed is None and s._read_ahead is not None and s._start is not None:
        raise ValueError(
            f"{s._read_ahead} reads this sampler one batch ahead of the training loop, so what the sampler "
            "handed out is not what was trained: pass consumed= (the items the loop took in this epoch), or "
            "prepare the loader with croupier.integrations.ray.prepare_data_loader and save with its report()"
        )
    if s._start is None:
        # NOTE: the items key is there before the first batch too: a loader that fills a new
        # sampler's state template (DCP) then carries the saved count.
        items = s._resume_items if s._resume is not None else 0
        return to_state(s.job, s.spec, s._resume or fresh(s.spec, s._hint or 0), items, s._origin or None,
                        s._amendments)
    # NOTE: an independent worker's (lockstep=False) state is the union of every worker's
    # commits, which only the coordinator knows: its epoch being over for this worker says
    # nothing of the others' batches in flight.
    deals = s._kind.coordinator_deals
    own = deals and not s._lockstep
    if s._complete or consumed is None and s._finished() and not own:  # the epoch is over
        taken = s._taken() if deals else s._rest(s._epoch)
        return _stamp(s, fresh(s.spec, s._epoch + 1), s._epoch + 1, 0, step,
                           (s._epoch, taken * s._unit // s.spec.batch_size))
    if deals:
        return _dealt_state(s, consumed, step)
    items = s.items_done if consumed is None else check_int("consumed", consumed, 0, None, ValueError)
    before = s._items_before(s._epoch)
    if items < before:
        raise ValueError(f"consumed={items} items is before this generation's resume point in epoch {s._epoch} "
                         f"({before} items were taken before the checkpoint it resumed from)")
    p = s._plan(s._epoch)
    if p is None:
        return _stamp(s, s._start, s._start.epoch, 0, step, None)
    positions = (items - before) * s._unit
    if positions % s.spec.batch_size:
        raise ValueError(f"consumed={items} items is not a whole number of lease batches of {s.spec.batch_size}")
    progress = (s._epoch, positions // s.spec.batch_size)
    cursor = p.advance(positions // s.spec.batch_size)
    if cursor.epoch != s._epoch:  # the epoch is complete
        return _stamp(s, cursor, cursor.epoch, 0, step, progress)
    return _stamp(s, cursor, s._epoch, items, step, progress)


def _stamp(s: _Base, cursor: Cursor, epoch: int, items: int, step: int | None,
           progress: tuple[int, int] | None) -> dict[str, Any]:
    """The state of `cursor`, named after where this incarnation made it; logs it for the
    audit and records it at the coordinator (with how far the loop got, `progress`)."""
    state = to_state(s.job, s.spec, cursor, items, f"{s._token_used}/{epoch}/{items}", s._amendments)
    if s._audit is not None:
        s._audit.ckpt(state["origin"], epoch, items)
    if s._client is not None and not s._client.closed:
        try:
            s._client.report(s.job, s._generation, s.rank, progress or (s._epoch, 0),
                                (step, cursor, state["origin"]), timeout=_REPORT_TIMEOUT_S)
        except (CroupierError, Unreachable) as e:
            log.warning("croupier: rank %d of job %r could not record its checkpoint%s at the coordinator (%s); "
                        "the state dict alone resumes it", s.rank, s.job,
                        "" if step is None else f" of step {step}", e)
    return state


def _dealt_state(s: _Base, consumed: int | None, step: int | None) -> dict[str, Any]:
    """Dynamic dealing's checkpoint state: the coordinator computes it from what it dealt.

    NOTE: only the coordinator knows which batches the other ranks were dealt, so this call
    needs it (a static job's state is computed here). Lockstep (the default): every rank is
    credited with as many batches as this rank's loop took, capped by what it was dealt; so
    take it on a rank still iterating the epoch (all of those give the same state), or, on a
    rank that ran out while the others step on (DDP's ``Join``), pass ``consumed=`` the
    loop's step in the epoch. ``lockstep=False``: this rank's own progress and the other
    ranks' last commits.
    """
    items = s.items_done if consumed is None else check_int("consumed", consumed, 0, None, ValueError)
    positions = items * s._unit
    if positions % s.spec.batch_size:
        raise ValueError(f"consumed={items} items is not a whole number of batches of {s.spec.batch_size}")
    assert s._client is not None
    origin = f"{s._token_used}/{s._epoch}/{items}"
    try:
        # NOTE: no timeout: like a join, this waits (retrying) for a coordinator that restarts
        cursor = s._client.report(s.job, s._generation, s.rank,
                                     (s._epoch, positions // s.spec.batch_size), (step, None, origin),
                                     own=not s._lockstep)
    except Unreachable as e:
        raise RuntimeError(
            f"rank {s.rank} of job {s.job!r} deals dynamically: its checkpoint state is computed by the "
            f"coordinator, which did not answer in time ({e}); try again once it is back"
        ) from None
    assert cursor is not None
    same = cursor.epoch == s._epoch
    state = to_state(s.job, s.spec, cursor, items if same else 0, origin if same else f"{s._token_used}/{cursor.epoch}/0",
                     s._amendments)
    if s._audit is not None:
        s._audit.ckpt(state["origin"], s._epoch, items)
    return state


def commit(s: _Base, consumed: int | None = None) -> dict[str, Any]:
    """Dynamic dealing with independent workers: records this rank's progress as done and returns
    the job's state (``state_dict()`` with ``lockstep=False``; the same call for lockstep ranks)."""
    return s.state_dict(consumed)


def resume_latest(s: _Base) -> bool:
    """Resumes from the latest checkpoint the job recorded at the coordinator, if any.

    For workers that keep no state of their own (dynamic dealing's ``lockstep=False``: the
    latest record is the union of every rank's commits). Call it on every rank of the new
    launch, before the first batch, once the previous launch's processes are gone (a record
    made between two ranks' calls would make them disagree, and the join refuses that).

    Returns:
        True when a record was loaded; False when the job has none (it starts from the beginning).
    """
    return _resume_from_record(s, None, "resume_latest")


def resume_from_step(s: _Base, step: int) -> None:
    """Resumes from the checkpoint the job recorded at training step `step` (any world size).

    For a trainer that keeps its global step but not the sampler's state: every rank's
    ``state_dict(step=s)`` recorded the state at the coordinator, and this loads it, exactly
    as ``load_state_dict`` would load the saved dict. Call it on every rank, where
    ``load_state_dict`` would go: after ``init_process_group`` and before the first batch.

    The job must be found again: name it (``job=`` or ``CROUPIER_JOB``) or keep the launch's
    run id (torchrun ``--rdzv-id``, the same Slurm job), and keep the coordinator (an address,
    or the embedded one's store under ``CROUPIER_STATE_DIR`` on global rank 0's host; a job of
    one process keeps no records across restarts).

    Rolling back past several checkpoints is allowed: the records of later steps stay until
    the job records a checkpoint at or before their step again, which replaces them.

    Raises:
        LookupError: the coordinator has no record of `step` for this job (the message lists
            the steps it has).
        ValueError: the record is of another spec; a malformed step.
        RuntimeError: this sampler has already started serving a generation.
    """
    check_int("step", step, 0, None, ValueError)
    _resume_from_record(s, step, "resume_from_step")


def _resume_from_record(s: _Base, step: int | None, what: str) -> bool:
    """Loads the coordinator's record of `step` (the latest for None) as ``load_state_dict`` would
    load the saved state; False when there is no latest record."""
    if s._start is not None:
        raise RuntimeError(
            f"{what} must come before the first batch: this sampler already serves generation "
            f"{s._generation} of job {s.job!r}; make a new sampler in the restarted process"
        )
    if s._empty:
        return False
    num_replicas, _ = s._resolve_world()
    s._agreed = agree(s._token, s._address, s.job, num_replicas)
    with CoordinatorClient(s._agreed[1], security=s._with_secret(s._agreed[2])) as c:
        try:
            spec, record = c.checkpoint(s.job, step)
        except NotFound as e:
            if step is None:
                return False
            raise LookupError(
                f"{e}. A relaunch finds its job's records under the same job name: pass job= or set CROUPIER_JOB "
                f"(this sampler's job is {s.job!r})"
            ) from None
    s.load_state_dict(state_of_record(s.job, spec, record.cursor, record.origin, record.amendments))
    return True


def load_state_dict(s: _Base, state_dict: dict[str, Any]) -> None:
    """Resumes from a checkpoint state (any world size); an empty dict means "from the start".

    A sampler whose job was not named (no ``job=``, no ``CROUPIER_JOB``) takes the job named
    in the state: resuming a checkpoint continues its job, whatever the new launch is called.

    Raises:
        ValueError: the state is malformed, or from another job or spec (both are shown).
        RuntimeError: this sampler has already started serving a generation.
    """
    if s._start is not None:
        raise RuntimeError(
            "load_state_dict must come before the first batch: this sampler already serves generation "
            f"{s._generation} of job {s.job!r}; make a new sampler in the restarted process"
        )
    if s._empty:
        if state_dict:
            raise ValueError(f"this sampler's dataset is empty (N = 0), so it has no state to load (got {state_dict!r})")
        return
    job = s.job
    if not s._job_named and isinstance(state_dict, Mapping) and isinstance(state_dict.get("job"), str):
        job = state_dict["job"]
    spec = spec_of(s.spec, state_dict) if isinstance(state_dict, Mapping) else s.spec  # made on grown sources?
    resume = from_state(job, spec, state_dict)  # the format first: another format is refused as such
    amendments = amendments_of(state_dict) if resume is not None else ()
    if resume is not None and s._hint is not None and not epoch_agrees(spec, resume, s._hint):
        raise ValueError(
            f"set_epoch({s._hint}) was called before load_state_dict, but the checkpoint state resumes "
            f"{show(resume)}: call set_epoch with the checkpoint's epoch, or after load_state_dict"
        )
    s.job = job
    s.spec = spec
    s._amendments = amendments
    s._resume = resume
    s._origin = state_dict.get("origin") if resume is not None else None
    s._resume_items = items_of(state_dict, resume)
    s._cut_on_join = None

