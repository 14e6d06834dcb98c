"""A simulated training job over the coordinator's state machine, with the G1 audit the tests apply."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any

import msgpack
from croupier.core.api import JoinRequest
from croupier.core.checkpoint import from_state, to_state
from croupier.core.order import Plan, plan_epoch
from croupier.core.spec import Spec
from croupier.server._state import Event, State, decode_event, encode_event

JOB = "job"


def batches_of(p: Plan, rank: int) -> list[list[int]]:
    """Every batch of `rank` in the plan, fetched one at a time until the engine says None."""
    out: list[list[int]] = []
    j = 0
    while (b := p.batch_indices(rank, j)) is not None:
        out.append(b.tolist())
        j += 1
    return out
_tokens = itertools.count()


class G1Violation(AssertionError):
    """The indices a job trained on in an epoch break SPEC.md's G1 for its tail policy."""


def audit_epoch(spec: Spec, trained: list[int], max_missing: int, max_repeats: int) -> None:
    """Checks G1 for one finished epoch, given what its tail policy allows (see Job.allowance)."""
    n = spec.n
    seen = collections.Counter(trained)
    bad = [i for i in seen if not 0 <= i < n]
    if bad:
        raise G1Violation(f"indices out of range: {bad[:10]}")
    missing = n - len(seen)
    repeats = len(trained) - len(seen)
    if missing > max_missing or repeats > max_repeats:
        raise G1Violation(
            f"tail {spec.tail}, partition {spec.partition}: {missing} missing (at most {max_missing} allowed) "
            f"and {repeats} repeats (at most {max_repeats} allowed), N={n}"
        )


def audit_partial(spec: Spec, trained: list[int], max_repeats: int) -> None:
    """Checks an epoch in progress: no index twice, beyond what the tail policy's padding allows."""
    repeats = len(trained) - len(set(trained))
    if repeats > max_repeats:
        dup = [i for i, c in collections.Counter(trained).items() if c > 1][:10]
        raise G1Violation(f"{repeats} repeats in an unfinished epoch (at most {max_repeats} allowed); e.g. {dup}")


@dataclasses.dataclass
class Checkpoint:
    state: dict[str, Any]
    log: tuple[tuple[int, int, int, tuple[int, ...]], ...]  # what the model in this checkpoint trained on
    end_worlds: tuple[tuple[int, int], ...]  # (epoch, world of the generation that completed it)
    finished: tuple[tuple[int, int], ...]  # the epochs it had finished, with their final world
    epoch: int  # the training loop's epoch variable at the save


def plan_of(state: State, generation: int, epoch: int, job: str = JOB) -> Plan | None:
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

    The coordinator side is journaled exactly as the service does it (msgpack events, snapshots),
    so ``restart_coordinator`` rebuilds it from snapshot + journal and ``lose_coordinator`` drops it.
    """

    def __init__(self, spec: Spec, world: int, start_epoch: int | None = None) -> None:
        self.spec = spec
        self.state = State()
        self.journal: list[bytes] = []
        self.snap: tuple[bytes | None, int] = (None, 0)  # (snapshot, journal length it covers)
        self.log: list[tuple[int, int, int, tuple[int, ...]]] = []  # (epoch, incarnation, world, batch) trained on
        self.end_worlds: dict[int, int] = {}  # epoch -> world of the generation in which it completed
        self.incarnation = 0
        self.checkpoints: list[Checkpoint] = []
        self.finished_epochs: list[tuple[int, int]] = []  # (epoch, final world)
        self.old_tokens: list[tuple[str, int, int]] = []  # (token, generation, world) of replaced generations
        self.generation = 0
        self.token = ""
        self.world = world
        self.epoch = 0
        self.j = 0
        self._start(world, resume=None, epoch_hint=start_epoch)

    # ------------------------------------------------------------ coordinator side

    def _commit(self, events: list[Event]) -> None:
        for ev in events:
            self.journal.append(msgpack.packb(encode_event(ev)))
            self.state.apply(ev)

    def take_snapshot(self) -> None:
        self.snap = (msgpack.packb(self.state.snapshot()), len(self.journal))

    def restart_coordinator(self) -> None:
        blob, upto = self.snap
        events = [decode_event(msgpack.unpackb(b)) for b in self.journal[upto:]]
        self.state = State.restore(None if blob is None else msgpack.unpackb(blob), events)

    def lose_coordinator(self) -> None:
        # NOTE: fencing by token needs the coordinator's memory of old generations; with the
        # store gone, zombies are recognised again only once the restarted job opens new ones.
        self.old_tokens = []
        self.token = ""
        self.state = State()
        self.journal = []
        self.snap = (None, 0)

    # ------------------------------------------------------------ trainer side

    def _start(self, world: int, resume: dict[str, Any] | None, epoch_hint: int | None,
               join_order: list[int] | None = None, with_state: set[int] | None = None) -> None:
        if self.token:
            self.old_tokens.append((self.token, self.generation, self.world))
        token = f"t{next(_tokens)}"
        self.incarnation += 1
        cursor = None if resume is None else from_state(JOB, self.spec, resume)
        order = join_order if join_order is not None else list(range(world))
        holders = with_state if with_state is not None else set(range(world))
        result = None
        for r in order:
            req = JoinRequest(JOB, self.spec, token, world, r,
                              resume=cursor if r in holders else None,
                              epoch=epoch_hint)
            self._commit(self.state.decide_join(req))
            # A repeated join changes nothing (idempotent).
            assert self.state.decide_join(req) == []
            result = self.state.join_result(JOB, r)
        assert result is not None and result.start is not None
        self.generation, self.token, self.world = result.generation, token, world
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

    def partial_step(self, ranks: set[int]) -> None:
        """Only `ranks` receive the next batch (a crash in the middle of a step)."""
        for r in sorted(ranks):
            b = serve(self.state, self.generation, r, self.epoch, self.j)
            if b is not None:
                self.log.append((self.epoch, self.incarnation, self.world, tuple(b.tolist())))
                again = serve(self.state, self.generation, r, self.epoch, self.j)
                assert again is not None and again.tolist() == b.tolist(), "serving is not idempotent"

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
        """(missing, repeats) that SPEC.md's G1 allows `epoch`, W being the world that completed it.

        NOTE: with a strided partition the padding is dealt in the epoch's last step, so only the
        final world pads: fewer than W repeats. Chunked and contiguous partitions (d9d) put the
        padding at the end of the last ranks' parts, which they reach before the epoch ends; a
        resize after some of it was trained keeps it trained, so each generation that trained
        padding may add fewer than its own W repeats.
        """
        final = self.end_worlds.get(epoch, self.world)
        missing = final - 1 if self.spec.tail == "drop" else 0
        if self.spec.tail not in ("pad", "pad_last"):
            return missing, 0
        if self.spec.partition == "strided":
            return missing, final - 1
        gens = {(g, w) for e, g, w, _ in self.log if e == epoch}
        return missing, sum(w - 1 for _, w in gens)

    def checkpoint(self) -> Checkpoint:
        state = checkpoint_of(self.state, self.generation, self.epoch, self.j)
        ck = Checkpoint(state, tuple(self.log), tuple(self.end_worlds.items()), tuple(self.finished_epochs), self.epoch)
        self.checkpoints.append(ck)
        return ck

    def restart(self, ck: Checkpoint | None, world: int, join_order: list[int] | None = None,
                with_state: set[int] | None = None, hint: bool = True) -> None:
        """Kills every rank and starts a new generation of `world` ranks from `ck` (None: scratch)."""
        if ck is None:
            self.log = []
            self.end_worlds = {}
            self.finished_epochs = []
            self._start(world, None, None, join_order, set())
            return
        # The model rolls back to the checkpoint, and so does what it has trained on; a
        # checkpoint from a timeline that an earlier restart abandoned is valid too.
        self.log = list(ck.log)
        self.end_worlds = dict(ck.end_worlds)
        self.finished_epochs = list(ck.finished)
        holders = with_state if with_state is not None else set(range(world))
        # A rank added by a scale-up has no state; every rank runs the same loop, so every rank
        # calls set_epoch(ck.epoch) when the trainer uses the usual epoch loop.
        self._start(world, ck.state, ck.epoch if hint else None, join_order, holders)
