"""The G1 audit the tests apply, and a simulated training job over the coordinator's pure state machine."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np

from croupier.core.api import JoinRequest
from croupier.core.checkpoint import from_state, to_state
from croupier.core.order import FixedPlan
from croupier.core.registry import plan_epoch
from croupier.core.spec import Spec
from croupier.server._decide import decide_join
from croupier.server._state import State

JOB = "job"


def batches_of(p: FixedPlan, rank: int) -> list[list[int]]:
    """Every batch of `rank` in the plan, fetched one at a time until the engine says None."""
    out: list[list[int]] = []
    j = 0
    while (b := p.batch_indices(rank, j)) is not None:
        out.append(b.tolist())
        j += 1
    return out
_tokens = itertools.count()


class G1Violation(AssertionError):
    """The indices a job trained on in an epoch break G1 (docs/guarantees.md) for its tail policy."""


def allowance(tail: str, partition: str, final: int, worlds: Iterable[int], batch_size: int = 1,
              drop_last_batch: bool = False, even_batches: bool = False) -> tuple[int, int]:
    """(missing, repeats) that G1 (docs/guarantees.md) allows an epoch that a world of `final` ranks completed.

    Args:
        tail, partition: The spec's.
        final: The world size of the generation that completed the epoch.
        worlds: The world size of every generation that trained in the epoch, one entry each.
        batch_size, drop_last_batch, even_batches: The spec's batching (a batch sampler's).

    NOTE: with a strided partition the padding is dealt in the epoch's last step, so only the
    final world pads: fewer than W repeats. Chunked and contiguous partitions (d9d) put the
    padding at the end of the last ranks' parts, which they reach before the epoch ends; a
    resize after some of it was trained keeps it trained, so each generation that trained
    padding may add fewer than its own W repeats.

    NOTE: G1 speaks of indices, not batches. A batch sampler's ``drop_last`` drops each rank's
    last incomplete batch (fewer than batch_size positions), and ``even_batches`` cuts the
    batches a rank has beyond the fewest any rank has: parts that differ by at most one
    position (strided, contiguous; chunked with a pad or drop tail) lose at most one position
    per rank that way, at most batch_size with both. Only the final generation loses any: a
    replaced generation's unconsumed positions stay in the checkpoint state. Chunked parts with
    an uneven tail can differ by more (a rank may get none), which this does not bound.
    """
    missing = final - 1 if tail == "drop" else 0
    if drop_last_batch:
        missing += final * (batch_size - 1)
    if even_batches:
        missing += final
    if tail not in ("pad", "pad_last"):
        return missing, 0
    if partition == "strided":
        return missing, final - 1
    return missing, sum(w - 1 for w in worlds)


def expected(spec: Spec, epoch: int | None) -> collections.Counter[int]:
    """The indices an epoch is to deal, with how often: each of [0, n) once, or a mixture's stream
    positions of the epoch (a small source may deal one sample in several of its epochs within one)."""
    if spec.sources is None:
        return collections.Counter(range(spec.n))
    if epoch is None:
        raise TypeError("a mixture's epochs each deal other samples: say which epoch is audited")
    from croupier.core.permute import mixture_order

    idx, _, _ = mixture_order(spec, epoch, np.arange(spec.n, dtype=np.int64))
    return collections.Counter(idx.tolist())


def audit_epoch(spec: Spec, trained: list[int], max_missing: int, max_repeats: int, epoch: int | None = None) -> None:
    """Checks G1 for one finished epoch, given what its tail policy allows (see `allowance`)."""
    want = expected(spec, epoch)
    seen = collections.Counter(trained)
    bad = [i for i in seen if i not in want]
    if bad:
        raise G1Violation(f"indices out of range: {bad[:10]}")
    missing = sum(max(0, c - seen[i]) for i, c in want.items())
    repeats = sum(max(0, c - want[i]) for i, c in seen.items())
    if missing > max_missing or repeats > max_repeats:
        raise G1Violation(
            f"tail {spec.tail}, partition {spec.partition}: {missing} missing (at most {max_missing} allowed) "
            f"and {repeats} repeats (at most {max_repeats} allowed), N={spec.n}"
        )


def audit_partial(spec: Spec, trained: list[int], max_repeats: int, epoch: int | None = None) -> None:
    """Checks an epoch in progress: no index more often than the epoch deals it, beyond what the tail's padding allows."""
    seen = collections.Counter(trained)
    want = expected(spec, epoch) if spec.sources is not None else None
    over = {i: c - (1 if want is None else want[i]) for i, c in seen.items()}
    repeats = sum(max(0, v) for v in over.values())
    if repeats > max_repeats:
        dup = [i for i, v in over.items() if v > 0][:10]
        raise G1Violation(f"{repeats} repeats in an unfinished epoch (at most {max_repeats} allowed); e.g. {dup}")


@dataclasses.dataclass
class Checkpoint:
    state: dict[str, Any]
    log: tuple[tuple[int, int, int, tuple[int, ...]], ...]  # what the model in this checkpoint trained on
    end_worlds: tuple[tuple[int, int], ...]  # (epoch, world of the generation that completed it)
    finished: tuple[tuple[int, int], ...]  # the epochs it had finished, with their final world
    epoch: int  # the training loop's epoch variable at the save


def plan_of(state: State, generation: int, epoch: int, job: str = JOB) -> FixedPlan | None:
    """The plan the coordinator leases `epoch` of a started `generation` from (None: already complete)."""
    gen = state.generation(job, generation)
    assert gen.start is not None
    return plan_epoch(state.jobs[job].spec, gen.start, gen.world, epoch)


def serve(state: State, generation: int, rank: int, epoch: int, batch: int, job: str = JOB) -> Any:
    """Batch `batch` of `rank` (None past its last), as the coordinator's lease computes it."""
    p = plan_of(state, generation, epoch, job)
    return None if p is None else p.batch_indices(rank, batch)


def checkpoint_of(state: State, generation: int, epoch: int, batches: int, job: str = JOB) -> dict[str, Any]:
    """The checkpoint state once every rank has consumed `batches` batches of `epoch`."""
    p = plan_of(state, generation, epoch, job)
    start = state.generation(job, generation).start
    assert start is not None
    return to_state(job, state.jobs[job].spec, start if p is None else p.advance(batches))


class Job:
    """A lockstep data-parallel training loop of `world` ranks fed by a State, with restarts.

    It computes every batch with the pure plan (``serve``); ``tests/server/test_state_machine.py``
    drives the production path (server, samplers) instead.
    """

    def __init__(self, spec: Spec, world: int) -> None:
        self.spec = spec
        self.state = State()
        self.log: list[tuple[int, int, int, tuple[int, ...]]] = []  # (epoch, incarnation, world, batch) trained on
        self.end_worlds: dict[int, int] = {}  # epoch -> world of the generation in which it completed
        self.incarnation = 0
        self.checkpoints: list[Checkpoint] = []
        self.finished_epochs: list[tuple[int, int]] = []  # (epoch, final world)
        self.generation = 0
        self.world = world
        self.epoch = 0
        self.j = 0
        self._start(world, resume=None, epoch_hint=None)

    def _start(self, world: int, resume: dict[str, Any] | None, epoch_hint: int | None) -> None:
        incarnation = f"t{next(_tokens)}"
        self.incarnation += 1
        cursor = None if resume is None else from_state(JOB, self.spec, resume)
        result = None
        for r in range(world):
            req = JoinRequest(JOB, self.spec, incarnation, world, r, resume=cursor, epoch=epoch_hint)
            for ev in decide_join(self.state, req, 0):
                self.state.apply(ev)
            # A repeated join changes nothing (idempotent).
            assert decide_join(self.state, req, 0) == []
            result = self.state.join_result(JOB, r)
        assert result is not None and result.start is not None
        self.generation, self.world = result.generation, world
        self.epoch, self.j = result.start.epoch, 0
        if epoch_hint is not None and epoch_hint < self.epoch:
            self.epoch = epoch_hint  # that epoch is complete: the loop's next step moves on

    def step(self) -> bool:
        """One training step on every rank; returns True when it finished an epoch."""
        batches = [serve(self.state, self.generation, r, self.epoch, self.j) for r in range(self.world)]
        if all(b is None for b in batches):
            self._finish_epoch()
            return True
        for b in batches:
            if b is not None:
                self.log.append((self.epoch, self.incarnation, self.world, tuple(b.tolist())))
        self.j += 1
        p = plan_of(self.state, self.generation, self.epoch)
        if p is not None and p.done(self.j):
            self.end_worlds[self.epoch] = self.world
        audit_partial(self.spec, self.trained(self.epoch), self.allowance(self.epoch)[1])
        return False

    def _finish_epoch(self) -> None:
        audit_epoch(self.spec, self.trained(self.epoch), *self.allowance(self.epoch))
        self.finished_epochs.append((self.epoch, self.end_worlds.get(self.epoch, self.world)))
        self.epoch += 1
        self.j = 0

    def run_epoch(self) -> None:
        while not self.step():
            pass

    def trained(self, epoch: int) -> list[int]:
        return [i for e, _, _, b in self.log if e == epoch for i in b]

    def allowance(self, epoch: int) -> tuple[int, int]:
        """(missing, repeats) that G1 allows `epoch` (see `allowance`)."""
        gens = {(g, w) for e, g, w, _ in self.log if e == epoch}
        return allowance(self.spec.tail, self.spec.partition, self.end_worlds.get(epoch, self.world),
                         [w for _, w in gens], self.spec.batch_size, self.spec.drop_last_batch, self.spec.even_batches)

    def checkpoint(self) -> Checkpoint:
        state = checkpoint_of(self.state, self.generation, self.epoch, self.j)
        ck = Checkpoint(state, tuple(self.log), tuple(self.end_worlds.items()), tuple(self.finished_epochs), self.epoch)
        self.checkpoints.append(ck)
        return ck

    def restart(self, ck: Checkpoint | None, world: int) -> None:
        """Kills every rank and starts a new generation of `world` ranks from `ck` (None: scratch)."""
        if ck is None:
            self.log = []
            self.end_worlds = {}
            self.finished_epochs = []
            self._start(world, None, None)
            return
        # The model rolls back to the checkpoint, and so does what it has trained on; a
        # checkpoint from a timeline that an earlier restart abandoned is valid too.
        self.log = list(ck.log)
        self.end_worlds = dict(ck.end_worlds)
        self.finished_epochs = list(ck.finished)
        # Every rank runs the usual epoch loop: set_epoch(ck.epoch).
        self._start(world, ck.state, ck.epoch)
