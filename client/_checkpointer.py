"""A sampler's checkpointing (`Checkpointer`): its state dict, loading one, resuming from the coordinator's records."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from croupier.client._audit_log import AuditLog
from croupier.client._epoch import EpochProgress
from croupier.client._rpc import CoordinatorClient, Unreachable
from croupier.core.amend import Amendment
from croupier.core.checkpoint import Taken, amendments_of, from_state, items_of, spec_of, state_of_record, taken_of, to_state
from croupier.core.checks import check_int
from croupier.core.cursor import Cursor, epoch_agrees, fresh, show
from croupier.core.errors import CroupierError, NotFound
from croupier.core.plan import EpochPlan
from croupier.core.registry import PlanKind
from croupier.core.spec import Spec

log = logging.getLogger("croupier")
#: How long state_dict waits for the coordinator to record a checkpoint before going on without it.
_REPORT_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Session:
    """The generation a sampler serves, once joined, and its channels to the coordinator and the audit log.

    Attributes:
        generation: The generation's number.
        start: The generation's resume point.
        incarnation: The incarnation the sampler joined as (the origins of its checkpoints name it).
        client: Its connection to the coordinator (None once closed, or in a copy not yet reconnected).
        audit: Its audit log, if it writes one.
    """

    generation: int
    start: Cursor
    incarnation: str
    client: CoordinatorClient | None
    audit: AuditLog | None


class Checkpointed(Protocol):
    """What the checkpointer asks of its sampler: the job, where it is, and its counts of an epoch.

    The counts are in items (indices, or batches for the batch sampler), as ``len()`` counts them.
    """

    job: str
    spec: Spec

    @property
    def rank(self) -> int:
        """This rank."""

    @property
    def items_done(self) -> int:
        """Items of the current epoch handed out so far, counted from the epoch's start."""

    @property
    def _progress(self) -> EpochProgress:
        """Where the sampler is in its epochs."""

    @property
    def _amendments(self) -> tuple[Amendment, ...]:
        """The mixture's amendments the sampler deals under."""

    def _session(self) -> Session | None:
        """The generation it serves; None before the join."""

    def _finished(self) -> bool:
        """The current epoch is over for this rank."""

    def _rest(self, epoch: int) -> int:
        """Items this rank gets in `epoch` from its generation."""

    def _items_before(self, epoch: int) -> int:
        """Items of `epoch` this rank took before its generation began."""

    def _epoch_plan(self, epoch: int) -> EpochPlan | None:
        """The plan of `epoch` (None: the epoch just before a fresh start)."""

    def _coordinator(self) -> CoordinatorClient:
        """A connection to the job's coordinator before the join, agreed with the other ranks."""

    def _loaded(self, job: str, spec: Spec, amendments: tuple[Amendment, ...], progress: EpochProgress) -> None:
        """Takes a loaded checkpoint state's job, spec, amendments and resume point."""


class Checkpointer:
    """A sampler's checkpoints: the state dict it makes, the one it loads, the coordinator's records.

    Args:
        sampler: The sampler it checkpoints (it asks only what :class:`Checkpointed` names).
        empty: The dataset is empty: the state is ``{}``.
        unit: Positions per item: 1 for indices, the batch size for batches.
        kind: The job's way of dealing: whether this rank computes its checkpoints' cursors from its
            plan, or the coordinator from its deals (a plan it deals).
        lockstep: With a coordinator that deals, every rank steps with this one (its count is theirs);
            ``False``: each rank commits its own progress.

    Attributes:
        origin: The origin of the state loaded (its name), for the audit log.
        taken: Where the state loaded was taken (the trainer's step, the generation and its incarnation,
            as far as it names them): the join sends them, the audit log names them.
        resumed: ``(epoch, items)`` of the state loaded (None: none was loaded, or an empty one).
        read_ahead: A known wrapper that reads the sampler ahead of the loop, if any (``consumed=`` needed).
    """

    def __init__(self, sampler: Checkpointed, *, empty: bool, unit: int, kind: PlanKind, lockstep: bool) -> None:
        self._s = sampler
        self._empty, self._unit, self._lockstep = empty, unit, kind.lockstep(lockstep)
        # NOTE: the checkpointer's two ways, picked once: a checkpoint's cursor is this rank's plan's (its
        # advance), and an epoch over is the rank's share of it; or, for a plan the coordinator deals, the
        # cursor is the coordinator's (from its deals), and an epoch over is what the rank took of it.
        self._epoch_state = kind.either(computed=self._planned_state, dealt=self._dealt_state)
        self._taken_over = kind.either(computed=self._share, dealt=EpochProgress.taken)
        self.origin: str | None = None
        self.taken = Taken()
        self.resumed: tuple[int, int | None] | None = None
        self.read_ahead: str | None = None

    def state_dict(self, consumed: int | None = None, *, step: int | None = None) -> dict[str, Any]:
        """The checkpoint state (see the sampler's ``state_dict``)."""
        if step is not None:
            check_int("step", step, 0, None, ValueError)
        if self._empty:
            return {}
        s, p, at = self._s, self._s._progress, self._s._session()
        if consumed is None and self.read_ahead is not None and at is not None:
            raise ValueError(
                f"{self.read_ahead} reads this sampler one batch ahead of the training loop, so what the sampler "
                "handed out is not what was trained: pass consumed= (the items the loop took in this epoch), or "
                "prepare the loader with croupier.integrations.ray.prepare_data_loader and save with its report()"
            )
        if at is None:
            # NOTE: the items key is there before the first batch too: a loader that fills a new
            # sampler's state template (DCP) then carries the saved count. Nothing was trained since
            # the state loaded, so this is that state, taken where it was (at another step: not by
            # the generation that took the state loaded).
            items = p.resume_items if p.resume is not None else 0
            where = self.taken if step is None or step == self.taken.step else Taken(step)
            return to_state(s.job, s.spec, p.resume or fresh(s.spec, p.hint or 0), items, self.origin or None,
                            s._amendments, where)
        # NOTE: an independent worker's (lockstep=False) state is the union of every worker's
        # commits, which only the coordinator knows: its epoch being over for this worker says
        # nothing of the others' batches in flight.
        own = not self._lockstep
        if p.over or consumed is None and s._finished() and not own:  # the epoch is over
            taken = self._taken_over(p)
            return self._stamp(at, fresh(s.spec, p.epoch + 1), p.epoch + 1, 0, step,
                               (p.epoch, taken * self._unit // s.spec.batch_size))
        return self._epoch_state(at, consumed, step)

    def _share(self, p: EpochProgress) -> int:
        """This rank's items of `p`'s epoch: its whole share of the plan."""
        return self._s._rest(p.epoch)

    def _planned_state(self, at: Session, consumed: int | None, step: int | None) -> dict[str, Any]:
        """The checkpoint state of a plan this rank computes: its cursor is the plan's advance by the
        batches every rank took."""
        s, p = self._s, self._s._progress
        items = s.items_done if consumed is None else check_int("consumed", consumed, 0, None, ValueError)
        before = s._items_before(p.epoch)
        if items < before:
            raise ValueError(f"consumed={items} items is before this generation's resume point in epoch {p.epoch} "
                             f"({before} items were taken before the checkpoint it resumed from)")
        plan = s._epoch_plan(p.epoch)
        if plan is None:
            return self._stamp(at, at.start, at.start.epoch, 0, step, None)
        positions = (items - before) * self._unit
        if positions % s.spec.batch_size:
            raise ValueError(f"consumed={items} items is not a whole number of lease batches of {s.spec.batch_size}")
        progress = (p.epoch, positions // s.spec.batch_size)
        cursor = plan.advance(positions // s.spec.batch_size)
        if cursor.epoch != p.epoch:  # the epoch is complete
            return self._stamp(at, cursor, cursor.epoch, 0, step, progress)
        return self._stamp(at, cursor, p.epoch, items, step, progress)

    def _stamp(self, at: Session, cursor: Cursor, epoch: int, items: int, step: int | None,
               progress: tuple[int, int] | None) -> dict[str, Any]:
        """The state of `cursor`, named after where this incarnation made it, with the trainer's `step`
        and this generation; logs it for the audit and records it at the coordinator with its items
        (and how far the loop got, `progress`)."""
        s = self._s
        state = to_state(s.job, s.spec, cursor, items, f"{at.incarnation}/{epoch}/{items}", s._amendments,
                         Taken(step, at.generation, at.incarnation))
        if at.audit is not None:
            at.audit.ckpt(state["origin"], epoch, items, step)
        if at.client is not None and not at.client.closed:
            try:
                at.client.report(s.job, at.generation, s.rank, progress or (max(s._progress.epoch, at.start.epoch), 0),
                                 (step, cursor, state["origin"]), timeout=_REPORT_TIMEOUT_S, items=items)
            except (CroupierError, Unreachable) as e:
                log.warning("croupier: rank %d of job %r could not record its checkpoint%s at the coordinator (%s); "
                            "the state dict alone resumes it", s.rank, s.job,
                            "" if step is None else f" of step {step}", e)
        return state

    def _dealt_state(self, at: Session, consumed: int | None, step: int | None) -> dict[str, Any]:
        """Dynamic dealing's checkpoint state: the coordinator computes it from what it dealt.

        NOTE: only the coordinator knows which batches the other ranks were dealt, so this call
        needs it (a static job's state is computed here). Lockstep (the default): every rank is
        credited with as many batches as this rank's loop took, capped by what it was dealt; so
        take it on a rank still iterating the epoch (all of those give the same state), or, on a
        rank that ran out while the others step on (DDP's ``Join``), pass ``consumed=`` the
        loop's step in the epoch. ``lockstep=False``: this rank's own progress and the other
        ranks' last commits.

        NOTE: the report names no items: the coordinator computes the cursor, which may be the next
        epoch's start, so the rank cannot say which epoch its count is of before the answer (a
        dealt plan counts a rank's items from its generation's start and reads none on resume).
        """
        s = self._s
        epoch = s._progress.epoch
        items = s.items_done if consumed is None else check_int("consumed", consumed, 0, None, ValueError)
        positions = items * self._unit
        if positions % s.spec.batch_size:
            raise ValueError(f"consumed={items} items is not a whole number of batches of {s.spec.batch_size}")
        assert at.client is not None
        origin = f"{at.incarnation}/{epoch}/{items}"
        try:
            # NOTE: no timeout: like a join, this waits (retrying) for a coordinator that restarts
            cursor = at.client.report(s.job, at.generation, s.rank, (epoch, positions // s.spec.batch_size),
                                      (step, None, origin), own=not self._lockstep)
        except Unreachable as e:
            raise RuntimeError(
                f"rank {s.rank} of job {s.job!r} deals dynamically: its checkpoint state is computed by the "
                f"coordinator, which did not answer in time ({e}); try again once it is back"
            ) from None
        assert cursor is not None
        same = cursor.epoch == epoch
        state = to_state(s.job, s.spec, cursor, items if same else 0, origin if same else f"{at.incarnation}/{cursor.epoch}/0",
                         s._amendments, Taken(step, at.generation, at.incarnation))
        if at.audit is not None:
            at.audit.ckpt(state["origin"], epoch, items, step)
        return state

    def resume(self, step: int | None, what: str) -> bool:
        """Loads the coordinator's record of `step` (the latest for None) as :meth:`load` loads a
        saved state; False when there is no latest record (`what` names the caller in errors)."""
        if step is not None:
            check_int("step", step, 0, None, ValueError)
        self._unjoined(what)
        if self._empty:
            return False
        s = self._s
        with s._coordinator() as c:
            try:
                spec, record = c.checkpoint(s.job, step)
            except NotFound as e:
                if step is None:
                    return False
                raise LookupError(
                    f"{e}. A relaunch finds its job's records under the same job name: pass job= or set CROUPIER_JOB "
                    f"(this sampler's job is {s.job!r})"
                ) from None
        self.load(state_of_record(s.job, spec, record))
        return True

    def load(self, state_dict: dict[str, Any], job_named: bool = True) -> None:
        """Resumes from a checkpoint state (see the sampler's ``load_state_dict``); with `job_named`
        False, a job named in the state is taken."""
        self._unjoined("load_state_dict")
        if self._empty:
            if state_dict:
                raise ValueError(f"this sampler's dataset is empty (N = 0), so it has no state to load (got {state_dict!r})")
            return
        s = self._s
        job = s.job
        if not job_named and isinstance(state_dict, Mapping) and isinstance(state_dict.get("job"), str):
            job = state_dict["job"]
        spec = spec_of(s.spec, state_dict) if isinstance(state_dict, Mapping) else s.spec  # made on grown sources?
        resume = from_state(job, spec, state_dict)  # the format first: another format is refused as such
        amendments = amendments_of(state_dict) if resume is not None else ()
        hint = s._progress.hint
        if resume is not None and hint is not None and not epoch_agrees(spec, resume, hint):
            raise ValueError(
                f"set_epoch({hint}) was called before load_state_dict, but the checkpoint state resumes "
                f"{show(resume)}: call set_epoch with the checkpoint's epoch, or after load_state_dict"
            )
        items = items_of(state_dict, resume)
        s._loaded(job, spec, amendments, s._progress.load(resume, items))
        self.origin = state_dict.get("origin") if resume is not None else None
        self.taken = taken_of(state_dict) if resume is not None else Taken()
        self.resumed = (resume.epoch, items) if resume is not None else None

    def _unjoined(self, what: str) -> None:
        at = self._s._session()
        if at is not None:
            raise RuntimeError(
                f"{what} must come before the first batch: this sampler already serves generation "
                f"{at.generation} of job {self._s.job!r}; make a new sampler in the restarted process"
            )


class Checkpointing:
    """The samplers' checkpointing methods, each handed to their :class:`Checkpointer`."""

    _checkpointer: Checkpointer
    _job_named: bool  # the job was named (job= or CROUPIER_JOB): a loaded state's job is not taken

    def state_dict(self, consumed: int | None = None, *, step: int | None = None) -> dict[str, Any]:
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
                The state carries it, with the generation that took it (a state that names either
                is format 5): a job resumed from it counts its steps on from there, and the
                coordinator's step ledger (``CoordinatorClient.ledger``) places every step after it.
        """
        return self._checkpointer.state_dict(consumed, step=step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes from a checkpoint state (any world size); an empty dict means "from the start".

        A sampler whose job was not named (no ``job=``, no ``CROUPIER_JOB``) takes the job named
        in the state: resuming a checkpoint continues its job, whatever the new launch is called.

        Raises:
            ValueError: the state is malformed, or from another job or spec (both are shown).
            RuntimeError: this sampler has already started serving a generation.
        """
        self._checkpointer.load(state_dict, self._job_named)

    def resume_latest(self) -> bool:
        """Resumes from the latest checkpoint the job recorded at the coordinator, if any.

        For workers that keep no state of their own (dynamic dealing's ``lockstep=False``: the
        latest record is the union of every rank's commits). Call it on every rank of the new
        launch, before the first batch, once the previous launch's processes are gone (a record
        made between two ranks' calls would make them disagree, and the join refuses that).

        Returns:
            True when a record was loaded; False when the job has none (it starts from the beginning).
        """
        return self._checkpointer.resume(None, "resume_latest")

    def resume_from_step(self, step: int) -> None:
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
        self._checkpointer.resume(step, "resume_from_step")

    def commit(self, consumed: int | None = None) -> dict[str, Any]:
        """Dynamic dealing with independent workers: records this rank's progress as done and returns
        the job's state (``state_dict()`` with ``lockstep=False``; the same call for lockstep ranks)."""
        return self.state_dict(consumed)
