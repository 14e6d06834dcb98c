"""croupier under torchft: each step's samples split by the step's quorum, trained when (and only when) it commits.

With torchft, replica groups leave when a machine fails and heal back a few steps later while the
others train on; a step whose ``manager.should_commit()`` is false is thrown away. torchft's own
``torchft.data.DistributedSampler`` shards the data over a maximum number of groups fixed up
front, so a down group's shard is never trained and a healing group's loader is where its own
loader was. Here the data side follows the quorum instead::

    from croupier.integrations.torchft import StepLoader

    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=..., state_dict=..., ...)
    optimizer = OptimizerWrapper(manager, torch.optim.AdamW(model.parameters()))
    loader = StepLoader(manager, dataset, global_batch=96, job="llm-ft", address="coordinator:50051")
    for batch in loader:            # starts the step's quorum, then deals the step
        optimizer.zero_grad()       # (torchft's start of the same step's quorum is not repeated)
        loss_fn(model(batch)).backward()
        optimizer.step()            # commits, or not

How a step is dealt (``croupier.core.ftsteps``): the job's epochs are one stream; the step run once
``s`` steps have committed (torchft's ``current_step()``, which its quorum agrees on and moves to a
healing group with the manager's state; the job's history numbers that step ``s + 1``, as trainers log
steps) takes stream positions ``[s * B, (s + 1) * B)``; the quorum's
participating groups split them in contiguous parts, a group's ranks split its part. A step that
does not commit leaves ``s`` where it was: its samples are dealt again, to whoever is in the next
attempt's quorum. No maximum group count; no loader state moves between groups; a group that
heals deals from the step it healed to.

``global_batch=B`` (recommended) keeps the global batch constant as groups leave and join (a
group's local batch is ``B / q`` for ``q`` participating groups): the optimizer sees the same batch
size, learning rate schedules stay right, and step ``s``'s samples do not depend on the history of
quorums. ``group_batch=b`` keeps each group's batch constant instead (step ``s`` takes ``q * b``
samples from where torchft's ``batches_committed()`` says the committed steps ended).

The record. Each committed step is reported once per group (by the group's rank 0, from a thread
of its own, off the training path) to the coordinator, which keeps, per *run*, the steps, their
spans and quorums: ``croupier provenance JOB --step S`` answers what step ``S`` trained and which
group trained which part. A run is one start of the whole job: a loader that loaded a checkpoint
state opens the run ``PARENT>STEP`` (``run=`` or ``CROUPIER_RUN`` names it instead: give each start
a name of its own if a job may be started twice from one checkpoint); a group that heals takes the
run of the group it healed from (the loader registers that name, never a position, with the
manager's state). A report the coordinator refuses is logged and training goes on.

Exactly once: every sample of every epoch is in exactly one committed step, provided every
committed step trained what its quorum was dealt (torchft averages the gradients of the quorum's
participants; a group that is not participating, healing under ``use_async_quorum=True``, is dealt
the step's first part again and its gradient is zeroed by torchft: not counted). A group that
commits while another of the same quorum does not has the other's samples in its update (the
allreduce ran): the step counts as trained, whole.
"""

from __future__ import annotations

import logging
import os
import pathlib
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sized
from typing import Any

import msgpack
import numpy as np
import torch
from torch.utils.data import default_collate

from croupier.client import CoordinatorClient
from croupier.core import settings
from croupier.core.checks import check_bool, check_int
from croupier.core.ftsteps import CommittedStep, StepDeal, rank_deal, stream_indices
from croupier.core.spec import Spec

__all__ = ["StepLoader"]

log = logging.getLogger("croupier.integrations.torchft")

#: The format of :meth:`StepLoader.state_dict`.
STATE_FORMAT = 1


def _group_topology(group_rank: int | None, group_world: int | None) -> tuple[int, int]:
    import torch.distributed as dist

    if group_world is None:
        group_world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(
            os.environ.get("WORLD_SIZE", "1"))
    if group_rank is None:
        group_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    check_int("group_world", group_world, 1)
    check_int("group_rank", group_rank, 0, group_world)
    return group_rank, group_world


class StepLoader:
    """Deals each torchft step's batch to this rank from its quorum, and records the committed steps.

    Args:
        manager: The group's ``torchft.Manager``.
        dataset: A map-style dataset (or an int N: the loader then yields the indices).
        global_batch: Samples per step over all groups (mode ``global``); or
        group_batch: samples per step per group (mode ``group``). Exactly one of the two.
        job: The job's name on the coordinator (default ``CROUPIER_JOB``, else ``torchft.FINGERPRINT``).
        address: The coordinator's HOST:PORT (default ``CROUPIER_ADDRESS``); None and no variable: the
            steps are dealt as described but not recorded.
        seed: The order's seed (every group the same). shuffle: a shuffled order (feistel) or the
            dataset's own (``none``).
        collate_fn: Makes a batch of the samples (default torch's ``default_collate``).
        group_rank, group_world: This rank in its group (default torch.distributed, else RANK and WORLD_SIZE).
        run: The name of this start of the job (default ``CROUPIER_RUN``, else derived: see the module).
        audit_dir: Where to write this rank's audit log of every attempted step (default
            ``CROUPIER_AUDIT_DIR``; None: none): ``croupier audit LOGDIR`` checks the committed steps
            exactly once per epoch from the logs of every rank of every group.
        group: This replica group's name in the audit log (default ``REPLICA_GROUP_ID``, else the pid).
        dealing: The spec's way of dealing (``croupier.core.registry``): the steps take each epoch's positions
            in its stepped variant's order, the order's own (0, 1, 2, ...) for a kind without one (every
            registered kind: a way of dealing defined in a test may have one).

    Raises:
        ValueError: a setting out of range, or a `dealing` that names no registered way of dealing or that the
            spec refuses (the message names it and why).
    """

    def __init__(self, manager: Any, dataset: Any, *, global_batch: int | None = None, group_batch: int | None = None,
                 job: str | None = None, address: str | None = None, seed: int = 0, shuffle: bool = True,
                 collate_fn: Callable[[list[Any]], Any] | None = None, group_rank: int | None = None,
                 group_world: int | None = None, run: str | None = None, audit_dir: str | None = None,
                 group: str | None = None, dealing: str = "static") -> None:
        if (global_batch is None) == (group_batch is None):
            raise ValueError(f"give exactly one of global_batch and group_batch (got global_batch={global_batch!r}, "
                             f"group_batch={group_batch!r})")
        self.mode = "global" if global_batch is not None else "group"
        self.batch = int(global_batch if global_batch is not None else group_batch)  # type: ignore[arg-type]
        check_int("global_batch" if self.mode == "global" else "group_batch", self.batch, 1)
        check_bool("shuffle", shuffle)
        n = dataset if isinstance(dataset, int) else len(dataset) if isinstance(dataset, Sized) else None
        if n is None:
            raise TypeError(f"the dataset must be sized or an int (got {type(dataset).__name__})")
        check_int("len(dataset)", n, 1)
        self.dataset = None if isinstance(dataset, int) else dataset
        self.spec = Spec(n=n, seed=seed, permutation="feistel" if shuffle else "none", batch_size=self.batch,
                         dealing=dealing)
        self.job = job or settings.get("CROUPIER_JOB") or f"torchft.{self.spec.fingerprint[:12]}"
        self.group_rank, self.group_world = _group_topology(group_rank, group_world)
        self._collate = collate_fn or default_collate
        self._manager = manager
        self._named_run = run or settings.get("CROUPIER_RUN")
        self.run = self._named_run or "fresh"
        self.parent, self.resumed = "", 0
        self._expect_step: int | None = None  # a loaded state's step, checked against the manager's at the first deal
        #: the last batch handed out: its indices, step (torchft's ``current_step()`` while it ran: the steps
        #: committed before it; the job's history numbers it ``step + 1``, as ``deal.step``), quorum and
        #: participants; counted: whether the step counts it (False for a group that is not participating)
        self.indices: list[int] = []
        self.step = -1
        self.quorum = -1
        self.participants = 0
        self.counted = False
        self.deal: StepDeal | None = None
        self.reports = 0  # steps this loader reported (one per committed step, on a group's rank 0)
        self._quorum_open = False
        self._hook(manager)
        address = address or settings.get("CROUPIER_ADDRESS")
        self._client = CoordinatorClient(address, retry_for=30.0) if address and self.group_rank == 0 else None
        if not address and self.group_rank == 0:
            log.warning("no coordinator address (address= or CROUPIER_ADDRESS): job %r's steps are dealt but not "
                        "recorded (provenance and the audit need the record)", self.job)
        self._queue: queue.Queue[tuple[str, str, int, CommittedStep] | None] = queue.Queue()
        self._reporter: threading.Thread | None = None
        self._refused = False
        audit_dir = audit_dir or settings.get("CROUPIER_AUDIT_DIR")
        self._audit = _FtAudit(audit_dir, self, group or os.environ.get("REPLICA_GROUP_ID") or str(os.getpid())
                               ) if audit_dir else None

    # ------------------------------------------------------------------ torchft's calls

    def _hook(self, manager: Any) -> None:
        """Wraps the manager's ``start_quorum`` (one quorum per step, whoever starts it) and ``should_commit``
        (the step's outcome), and registers the run's name with its state (what a healing group takes).

        NOTE: the wrappers are attributes of this manager object only; torchft's code is not changed.
        """
        start, commit = manager.start_quorum, manager.should_commit

        def start_quorum(*args: Any, **kwargs: Any) -> None:
            if self._quorum_open:
                return  # this step's quorum was started already (by the loader's deal, or by the trainer)
            start(*args, **kwargs)
            self._quorum_open = True

        def should_commit(*args: Any, **kwargs: Any) -> bool:
            ok = bool(commit(*args, **kwargs))
            self._quorum_open = False
            if self._audit is not None and self.deal is not None:
                self._audit.step(self, ok)
            if ok and self.counted and self.deal is not None and self._client is not None:
                self._send(CommittedStep(self.deal.step, self.deal.first, self.deal.last, self.quorum, self.participants))
            return ok

        manager.start_quorum = start_quorum
        manager.should_commit = should_commit
        manager.register_state_dict_fn("croupier", self._healed, self._run_state)

    def _run_state(self) -> dict[str, Any]:
        return {"run": self.run, "parent": self.parent, "resumed": self.resumed}

    def _healed(self, state: dict[str, Any]) -> None:
        """A heal: this group takes the run of the group it healed from (never a position)."""
        self.run, self.parent, self.resumed = str(state["run"]), str(state["parent"]), int(state["resumed"])
        self._expect_step = None

    # ------------------------------------------------------------------ dealing

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        m = self._manager
        if not self._quorum_open:
            m.start_quorum()
        participant = m.participating_rank()
        participants = int(m.num_participants())
        step = int(m.current_step())
        if self._expect_step is not None:
            if step != self._expect_step:
                raise RuntimeError(f"the loaded state is of step {self._expect_step} but the manager is at step {step}: "
                                   "load the manager's state_dict from the same checkpoint")
            self._expect_step = None
        self.counted = participant is not None
        committed = int(m.batches_committed()) if self.mode == "group" else 0
        self.deal = rank_deal(self.mode, self.batch, step, committed, max(participants, 1),
                              0 if participant is None else int(participant), self.group_world, self.group_rank)
        self.step, self.participants = step, participants
        self.quorum = int(getattr(m, "_quorum_id", -1))
        idx = self._indices(self.deal.start, self.deal.stop)
        self.indices = idx.tolist()
        if self.dataset is None:
            return torch.from_numpy(idx)
        return self._collate([self.dataset[i] for i in self.indices])

    def _indices(self, start: int, stop: int) -> np.ndarray:
        return stream_indices(self.spec, start, stop)

    def epoch_of(self, step: int) -> int:
        """The epoch the first sample of `step` belongs to (``global`` mode)."""
        return step * self.batch // self.spec.n

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """What to checkpoint with the model: the run and the committed steps (the next step's number).

        Take it after ``optimizer.step()``, with the manager's ``state_dict()`` of the same moment.
        """
        m = self._manager
        return {"format": STATE_FORMAT, "job": self.job, "run": self.run, "step": int(m.current_step()),
                "batches_committed": int(m.batches_committed()), "mode": self.mode, "batch": self.batch,
                "spec": self.spec.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes a whole-job restart from a checkpoint: a new run, from the state's step.

        Raises:
            ValueError: a state of another format, job, spec or batch (named).
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a StepLoader state of format {STATE_FORMAT} (got {state!r:.200})")
        for key, mine in (("mode", self.mode), ("batch", self.batch), ("spec", self.spec.fingerprint)):
            if state[key] != mine:
                raise ValueError(f"the state's {key} is {state[key]!r}, this loader's {mine!r}")
        step = int(state["step"])
        check_int("state step", step, 0)
        self.parent, self.resumed = str(state["run"]), step
        self.run = self._named_run or f"{self.parent}>{step}"
        self._expect_step = step

    # ------------------------------------------------------------------ the record

    def _send(self, c: CommittedStep) -> None:
        if self._reporter is None:
            self._reporter = threading.Thread(target=self._report_loop, name="croupier-ft-report", daemon=True)
            self._reporter.start()
        self._queue.put((self.run, self.parent, self.resumed, c))

    def _report_loop(self) -> None:
        assert self._client is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                run, parent, resumed, c = item
                self._client.commit_step(self.job, self.spec, run, parent, resumed, self.mode, self.batch, c)
                self.reports += 1
            except Exception as e:  # the record is not on the training path: say so once, train on
                if not self._refused:
                    log.error("job %r: the coordinator did not record a step (%s); later refusals are not logged",
                              self.job, e)
                    self._refused = True
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Waits until every committed step so far was reported (or refused)."""
        if self._reporter is not None:
            self._queue.join()

    def close(self) -> None:
        """Reports what is left and closes the coordinator's channel."""
        if self._reporter is not None:
            self._queue.put(None)
            self._reporter.join()
            self._reporter = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._audit is not None:
            self._audit.close()
            self._audit = None


class _FtAudit:
    """One rank's audit log, in the format every job's ranks write (``croupier.client._audit_log``): msgpack
    records in ``LOGDIR/JOB/ft-GROUP-rRANK-PID.audit``, each flushed (a kill -9 loses at most the last). A
    ``start`` record names the job, the replica group and this rank in it, the dataset's size and how steps are
    sized; a ``step`` record each attempted step (numbered from 1, ``croupier.core.history``), naming its run.
    Read by ``croupier.tools.audit_log``, judged by ``croupier.tools.audit_ft``."""

    def __init__(self, root: str, lo: StepLoader, group: str) -> None:
        d = pathlib.Path(root) / lo.job
        d.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in group)
        self._f = open(d / f"ft-{safe}-r{lo.group_rank}-{os.getpid()}.audit", "ab")
        self._write({"t": "start", "ts": time.time(), "job": lo.job, "group": group, "rank": lo.group_rank,
                     "world": lo.group_world, "n": lo.spec.n, "mode": lo.mode, "batch": lo.batch})

    def _write(self, rec: dict[str, Any]) -> None:
        self._f.write(msgpack.packb(rec))
        self._f.flush()

    def step(self, lo: StepLoader, committed: bool) -> None:
        assert lo.deal is not None
        self._write({"t": "step", "ts": time.time(), "run": lo.run, "parent": lo.parent, "resumed": lo.resumed,
                     "step": lo.deal.step, "quorum": lo.quorum, "participants": lo.participants, "counted": lo.counted,
                     "committed": committed, "first": lo.deal.first, "last": lo.deal.last, "start": lo.deal.start,
                     "stop": lo.deal.stop, "idx": np.asarray(lo.indices, dtype="<i8").tobytes()})

    def close(self) -> None:
        self._f.close()


def new_run() -> str:
    """A fresh run name (for ``run=``): unique per start."""
    return uuid.uuid4().hex[:16]
