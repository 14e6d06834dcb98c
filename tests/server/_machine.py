"""A job of generations (``Elastic``) as the state machine (tests/server/_machine_jobs.py) drives it: through crashes,
restarts, resizes, zombies and amendments, audited after each step."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from _machine_steps import Steps, check_index, check_step
from _machine_world import (
    DEALT,
    JOB,
    TOTALS,
    ZOMBIE_GENERATIONS,
    Sampler,
    Setup,
    World,
    _decisions,
    _Handle,
    _plain,
)
from _sim import Checkpoint, audit_epoch, audit_partial
from hypothesis import strategies as st

from croupier.client._rpc import CoordinatorClient
from croupier.core.amend import Amendment, sizes_after
from croupier.core.spec import Spec
from croupier.server import Server, open_store


class Elastic:
    """Drives one job of generations through everything G1 (docs/guarantees.md) must survive and audits it after each
    step: each public method is a rule of the state machine (``Jobs``), with the arguments it draws."""

    setup: Setup

    # ------------------------------------------------------------------ life cycle

    def start(self, setup: Setup, world: int, start: int | None) -> None:
        self.busy = True
        self.setup = setup
        self.stats: collections.Counter[str] = collections.Counter(examples=1, **{f"{setup.kind}_sampler_examples": 1},
                                                                   mixture_examples=int(bool(setup.sources)))
        self.store = open_store("memory://")
        self.server = Server(_Handle(self.store)).start()
        self.port = self.server.port
        self.client = CoordinatorClient(self.server.address, retry_for=30.0)
        self.incarnation = 0
        self.zombies: list[World] = []  # replaced generations whose samplers still run
        self.old_incarnations: list[tuple[str, int]] = []  # (incarnation, world) of every replaced generation this store knows
        self.log: list[tuple[int, int, int, tuple[int, ...]]] = []  # (epoch, incarnation, world, batch) trained on
        self.end_worlds: dict[int, int] = {}  # epoch -> world of the generation that completed it
        self.finished: list[tuple[int, int]] = []  # (epoch, final world) of the epochs finished
        self.checkpoints: list[Checkpoint] = []
        self.model = Steps()  # the loop's steps (tests/server/_machine_steps.py)
        self.ck_steps: list[tuple[int, int, Any, int]] = []  # each checkpoint's step, store, timeline, missing_to
        self.stores = 0  # stores lost so far
        self.held: tuple[Amendment, ...] = ()  # a mixture's amendments held by the latest generation
        self.epoch = start or 0  # the training loop's epoch variable
        self.live: World | None = None

        def prepare(r: int, s: Sampler) -> None:
            if start is not None:
                s.set_epoch(start)

        self._start_world(world, self.epoch, start is not None, prepare)

    def teardown(self) -> None:
        if not hasattr(self, "live"):  # the example failed before its job started
            return
        try:
            # Finish the epoch in progress: every example ends with a complete audit (not after a failure).
            if self.live is not None and not self.busy:
                while not self.step():
                    pass
        finally:
            for w in [*self.zombies, *([self.live] if self.live else [])]:
                w.close()
            self.client.close()
            self.server.stop(grace=1.0)
            TOTALS.update(self.stats)
            # Idle gRPC threads of stopped servers linger until garbage collection; a leak would grow.
            TOTALS["max_threads_after_teardown"] = max(TOTALS["max_threads_after_teardown"], threading.active_count())

    def _start_world(self, world: int, start_epoch: int, hint: bool, prepare: Callable[[int, Sampler], None]) -> None:
        """A new generation joins and trains its first step.

        ``Ranks`` joins the ranks together by fetching each one's first item, which the samplers
        count as taken (and their state_dict too): the loop takes it at once.
        """
        self.incarnation += 1
        self.live = World(self.setup, self.server.address, world, self.incarnation, start_epoch, hint, prepare)
        if self.setup.sources:
            # What the generation deals with: the amendments it holds (each with its position). A rollback
            # keeps them; a lost store takes back those of the checkpoint resumed from, which are all that
            # the positions the log still holds were dealt with (the later ones went with the timeline).
            held = tuple(a for a in self.server.core.job(JOB).amendments if a.at is not None)
            # A grow it holds now renumbers the sources after the grown one: the log follows.
            self.log = _renumbered(self.log, sizes_after(self.setup.sources, self.held),
                                   sizes_after(self.setup.sources, held))
            self.held = held
        self.step()

    @property
    def spec(self) -> Spec:
        """The job's spec under the amendments held (what the audit checks against)."""
        return self.setup.spec.amended(self.held) if self.held else self.setup.spec

    # ------------------------------------------------------------------ the training loop

    def step(self) -> bool:
        """One training step of every rank still in the epoch; True when instead the epoch was over and the loop moved on."""
        live = self.live
        assert live is not None
        if all(live.ended):
            self._finish_epoch()
            return True
        trained = False
        batches: dict[int, tuple[int, ...]] = {}
        for r in range(live.world):
            if live.ended[r]:
                continue  # its part of the epoch is done; it waits for the others (e.g. torch's Join)
            b = live.take(r, self.setup.batch)
            if b:
                self.log.append((self.epoch, live.incarnation, live.world, tuple(b)))
                batches[r] = tuple(b)
                trained = True
        if trained:
            self.model.record(live.name, batches)
        self.stats["train_steps"] += trained
        audit_partial(self.spec, self.trained(self.epoch), self.allowance(self.epoch)[1], self.epoch)
        return False

    def _finish_epoch(self) -> None:
        live = self.live
        assert live is not None
        e = self.epoch
        if live.start_epoch <= e:
            self.end_worlds.setdefault(e, live.world)
        assert e in self.end_worlds, f"epoch {e} is over, but no generation completed it"
        audit_epoch(self.spec, self.trained(e), *self.allowance(e), e)
        self.stats["epochs_audited"] += 1
        self.finished.append((e, self.end_worlds[e]))
        self.epoch += 1
        live.next_epoch(self.epoch)

    def trained(self, epoch: int) -> list[int]:
        return [i for e, _, _, b in self.log if e == epoch for i in b]

    def allowance(self, epoch: int) -> tuple[int, int]:
        """(missing, repeats) G1 allows `epoch`; an epoch not completed yet is judged by the live world."""
        gens = {(g, w) for e, g, w, _ in self.log if e == epoch}
        if epoch in self.end_worlds:
            final = self.end_worlds[epoch]
        else:
            assert self.live is not None
            final = self.live.world
        return self.setup.allowance(final, [w for _, w in gens])

    # ------------------------------------------------------------------ rules

    def train(self, k: int) -> None:
        self.busy = True
        for _ in range(k):
            self.step()

    def checkpoint(self) -> None:
        """The trainer saves rank 0's state_dict(); every rank still in the epoch agrees with it."""
        self.busy = True
        live = self.live
        assert live is not None
        # NOTE: a rank that ran out (its loop waits, as under DDP's Join) counts fewer batches than the
        # step; with dynamic dealing the trainer saves the state of a rank still stepping (they agree),
        # else rank 0's. That one records it at the step (the others' states name no step).
        keep = max(range(live.world), key=lambda r: live.taken[r]) if self.setup.kind in DEALT else 0
        states = [s.state_dict(step=self.model.count) if r == keep else s.state_dict() for r, s in enumerate(live.samplers)]
        saved = states[keep]
        done = self._done()
        for r, state in enumerate(states):
            if self.setup.kind in DEALT and done[r]:
                continue
            if not done[r]:
                assert _plain(state) == _plain(saved), (f"rank {r}'s state {state} differs from rank 0's {saved} "
                                                        f"(taken {live.taken}, ended {live.ended}, done {done})")
            else:
                # A rank whose part of the epoch is over (an uneven tail) names the next epoch
                # until the others are done too; only rank 0's state is the job's. A rank with
                # nothing in this epoch that its loop has not begun yet names this epoch's start.
                first = self.epoch + 1 if state["epoch"] == self.epoch + 1 or live.taken[r] else self.epoch
                assert state["epoch"] == first and state["remaining"] == [[0, self.setup.n]], (r, state)
        if saved["epoch"] > self.epoch:  # every rank has had all its batches: this generation completed the epoch
            self.end_worlds.setdefault(self.epoch, live.world)
        self.checkpoints.append(
            Checkpoint(saved, tuple(self.log), tuple(self.end_worlds.items()), tuple(self.finished), self.epoch))
        self.ck_steps.append((self.model.count, self.stores, self.model.saved(), self.model.missing_to))
        self.model.known = self.model.count

    def restart_from_any_checkpoint(self, data: st.DataObject, world: int) -> None:
        """Every rank dies (maybe mid-step: only some got the next batch); a new world resumes from any earlier checkpoint."""
        self.busy = True
        live = self.live
        assert live is not None
        if data.draw(st.booleans(), label="crash mid-step"):
            got = data.draw(st.sets(st.integers(0, live.world - 1), max_size=live.world), label="ranks that got the batch")
            for r in sorted(got):
                if not live.ended[r]:
                    live.take(r, self.setup.batch)  # trained by a model that dies now: not in the log
            self.stats["crashes_mid_step"] += 1
        self._retire(live)
        self._restart(data, world, live.world)

    def zombie(self, data: st.DataObject) -> None:
        """A process of a replaced generation asks for batches or re-joins: refused, and nothing changes."""
        self.busy = True
        before = _decisions(self.server)
        if bool(self.zombies) and data.draw(st.booleans(), label="keeps iterating"):
            z = data.draw(st.sampled_from(self.zombies), label="zombie generation")
            r = data.draw(st.integers(0, z.world - 1), label="rank")
            err = self._drive_zombie(z, r)
        else:
            incarnation, world = data.draw(st.sampled_from(self.old_incarnations), label="old token")
            r = data.draw(st.integers(0, world - 1), label="rank")
            s = self.setup.sampler(self.server.address, incarnation, world, r)
            try:
                if bool(self.checkpoints) and data.draw(st.booleans(), label="loads a checkpoint"):
                    s.load_state_dict(data.draw(st.sampled_from(self.checkpoints)).state)
                with pytest.raises(RuntimeError) as e:
                    next(iter(s))
                err = str(e.value)
            finally:
                s.close()
        assert "fenced" in err or "zombie" in err, err
        assert _decisions(self.server) == before, "a zombie changed the coordinator's state"
        self.stats["zombies_refused"] += 1

    def _drive_zombie(self, z: World, rank: int) -> str:
        """Iterates a zombie rank on (epoch after epoch) until it is refused; returns the error's message.

        It may first get what its prefetch leased before it was replaced: at most the leases its
        queue holds, the one its thread holds and the one in its hands.
        """
        bound = (self.setup.prefetch + 2) * self.setup.lease_ahead + 2
        it: Iterator[Any] | None = None
        got = 0
        for _ in range(4 * bound):
            try:
                item = z.ranks.next(rank) if it is None else next(it, None)
            except RuntimeError as e:
                return str(e)
            if item is None:  # the end of an epoch: its loop goes on to the next
                it = iter(z.samplers[rank])
                continue
            got += 1
            if got >= bound:
                break
        if got == 0:
            # NOTE: a rank whose share of each epoch is empty never asks the coordinator for a
            # batch, so nothing refuses it; it trains nothing either, which is all G1 needs.
            return "zombie with an empty share: it got nothing"
        raise AssertionError(f"a zombie of generation {z.incarnation} got {got} items and was not refused")

    def restart_coordinator(self) -> None:
        """The coordinator dies and comes back on the same store and port; live samplers carry on with the same batches."""
        self.busy = True
        live = self.live
        assert live is not None
        if all(self._done()):
            self.step()  # the loop moves on to the next epoch
        probe = self._probe()
        self.server.stop(grace=1.0)
        self.server = Server(_Handle(self.store), port=self.port).start()
        assert self._probe() == probe, "the restarted coordinator leases other batches"
        got = self._step_batches()
        assert got == probe, f"after the coordinator's restart, ranks got {got}, not {probe}"
        self.stats["coordinator_restarts"] += 1

    def _probe(self) -> list[list[int] | None]:
        """What each rank still in the epoch gets at the next step, asked of the coordinator (a read)."""
        live = self.live
        assert live is not None
        generation = self.client.get_job(JOB)[1].generation
        count = self.setup.batch if self.setup.kind == "index" else 1
        out: list[list[int] | None] = []
        done = self._done()
        for r in range(live.world):
            if done[r]:
                out.append(None)
                continue
            assert live.samplers[r].epoch == self.epoch, (r, live.samplers[r].epoch, self.epoch)
            lease = self.client.lease(JOB, generation, r, self.epoch, live.taken[r], count)
            out.append(lease.indices.tolist())
        return out

    def _done(self) -> list[bool]:
        """Which ranks have had their whole part of the epoch, asked of the coordinator (a read).

        A rank's epoch is over once its last item was handed out, before its loop asks past it.
        """
        live = self.live
        assert live is not None
        generation = self.client.get_job(JOB)[1].generation
        return [live.ended[r] or not self.client.lease(JOB, generation, r, self.epoch, live.taken[r], 1).sizes
                for r in range(live.world)]

    def _step_batches(self) -> list[list[int] | None]:
        """One training step; what each rank got (None: a rank that was already done with the epoch)."""
        live = self.live
        assert live is not None
        active = [not d for d in self._done()]
        n = len(self.log)
        taken = list(live.taken)
        self.step()
        batches = iter(self.log[n:])
        got: list[list[int] | None] = []
        for r in range(live.world):
            if not active[r]:
                got.append(None)
            elif live.taken[r] == taken[r]:
                got.append([])
            else:
                got.append(list(next(batches)[3]))
        return got

    def lose_store(self, data: st.DataObject, world: int) -> None:
        """The coordinator's store is gone: a fresh one, and the job restarts from a checkpoint, which is enough (G6)."""
        self.busy = True
        live = self.live
        assert live is not None
        self.server.stop(grace=1.0)
        self._retire(live)
        for z in self.zombies:
            z.close()
        # NOTE: fencing by incarnation needs the coordinator's memory of old generations; with the
        # store gone, a zombie is recognised again only once the restarted job opens new ones.
        self.zombies, self.old_incarnations = [], []
        self.store = open_store("memory://")
        self.server = Server(_Handle(self.store), port=self.port).start()
        self.stats["stores_lost"] += 1
        self.stores += 1
        self._restart(data, world, live.world)
        self.model.abandoned.clear()  # what the lost store knew of them

    def amend(self, data: st.DataObject) -> None:
        """A change of the running mixture through rank 0's sampler: new weights, samples skipped, or a source
        grown; it holds from the next generation's first position on. A skip names indices as the sampler
        hands them out, whatever grows are pending: what it records is the (source, sample) they name."""
        self.busy = True
        live = self.live
        assert live is not None
        s = live.samplers[0]
        k = len(self.setup.sources)
        recorded = self.server.core.job(JOB).amendments
        sizes = sizes_after(self.setup.sources, recorded)
        # The numbering the running generation hands indices out in: its held amendments' (those with a position).
        numbering = sizes_after(self.setup.sources, [a for a in recorded if a.at is not None])
        kinds = ["weights", "skip", "skip"] + (["grow"] if self.setup.grows else [])
        kind = data.draw(st.sampled_from(kinds), label="amendment")
        try:
            if kind == "weights":
                s.set_weights(data.draw(st.lists(st.integers(0, 5), min_size=k, max_size=k).filter(any), label="weights"))
            elif kind == "skip":
                indices = data.draw(st.lists(st.integers(0, sum(numbering) - 1), min_size=1, max_size=2, unique=True),
                                    label="indices")
                got = s.skip(indices)
                meant = sorted(_pair(numbering, i) for i in indices)
                assert got.pairs == meant, f"skip({indices}) recorded {got.pairs}, not {meant} (sources {numbering})"
            else:
                g = data.draw(st.integers(0, k - 1), label="source grown")
                s.grow(g, sizes[g] + data.draw(st.integers(1, 6), label="grown by"))
        except ValueError:  # skipped already, a source left empty, nothing left to deal: refused, nothing changed
            self.stats["amendments_refused"] += 1
            return
        self.stats[f"amendments_{kind}"] += 1

    def provenance(self, data: st.DataObject) -> None:
        """The ledger says what the loop trained at a step up to the last checkpoint, and finds an index of it there.
        NOTE: who got which batch and how many steps the loop took can depend on timing (dynamic dealing,
        prefetchers): the draws are numbers modulo what is there, all three drawn every time, so replays agree."""
        self.busy = True
        ledger = self.client.ledger(JOB)
        step, r, i = (data.draw(st.integers(0, 1 << 16), label=label) for label in ("step", "rank", "index"))
        t = 1 + step % self.model.known
        self.stats[check_step(ledger, self.model, t)] += 1
        if t > self.model.missing_to:
            rank, b = sorted((batches := self.model.timeline[t][1]).items())[r % len(batches)]
            check_index(ledger, self.model, t, rank, b[i % len(b)])

    def no_duplicates_so_far(self) -> None:
        if hasattr(self, "setup"):
            self.stats["rule_steps"] += 1
            audit_partial(self.spec, self.trained(self.epoch), self.allowance(self.epoch)[1], self.epoch)
            self.busy = False

    # ------------------------------------------------------------------ restarts

    def _retire(self, old: World) -> None:
        """`old` is replaced: its samplers become zombies (the oldest are closed; their tokens stay)."""
        self.old_incarnations.append((old.name, old.world))
        self.zombies.append(old)
        while len(self.zombies) > ZOMBIE_GENERATIONS:
            self.zombies.pop(0).close()
        self.live = None

    def _restart(self, data: st.DataObject, world: int, old_world: int) -> None:
        """A new world of `world` ranks (`old_world` before) resumes from a checkpoint drawn from all of them."""
        assert self.live is None
        i = data.draw(st.integers(0, len(self.checkpoints) - 1), label="checkpoint")
        ck = self.checkpoints[i]
        step, store, timeline, missing_to = self.ck_steps[i]
        if store != self.stores:  # a checkpoint recorded in a store that is gone: the ledger starts at it
            self.model.resume_unknown(step, timeline)
        else:
            self.model.rollback(step, timeline, missing_to)
        hint = data.draw(st.booleans(), label="set_epoch loop")
        hint_first = hint and data.draw(st.booleans(), label="set_epoch before load_state_dict")
        # Ranks that existed before load the state; ranks added by a scale-up have none. Every
        # rank runs the same loop: with the usual one, every rank calls set_epoch(ck.epoch).
        holders = min(world, old_world)

        def prepare(r: int, s: Sampler) -> None:
            if hint_first:
                s.set_epoch(ck.epoch)
            if r < holders:
                s.load_state_dict(ck.state)
            if hint and not hint_first:
                s.set_epoch(ck.epoch)

        # The model rolls back to the checkpoint, and so does what it has trained on; a
        # checkpoint from a timeline that an earlier restart abandoned is valid too.
        self.log = list(ck.log)
        # The positions the log holds were dealt by the amendments the checkpoint carries (its timeline's).
        self.held = tuple(Amendment.from_list(a) for a in ck.state.get("amendments", []))
        self.end_worlds = dict(ck.end_worlds)
        self.finished = list(ck.finished)
        self.epoch = ck.epoch if hint else ck.state["epoch"]
        if not hint and ck.state["epoch"] > ck.epoch:
            # Saved once every rank had had all its batches: that epoch is complete, and a loop
            # without set_epoch goes straight on to the next.
            audit_epoch(self.spec, self.trained(ck.epoch), *self.allowance(ck.epoch), ck.epoch)
            self.stats["epochs_audited"] += 1
            self.finished.append((ck.epoch, self.end_worlds[ck.epoch]))
        self._start_world(world, ck.state["epoch"], hint, prepare)
        self.stats["restarts"] += 1
        self.stats["older_checkpoints"] += i < len(self.checkpoints) - 1
        self.stats["resizes"] += world != old_world


def _pair(sizes: Sequence[int], index: int) -> tuple[int, int]:
    """(source, sample) of `index` in a ConcatDataset of sources of `sizes`."""
    s = int(np.searchsorted(np.cumsum(sizes), index, side="right"))
    return s, index - sum(sizes[:s])


def _renumbered(log: list[tuple[int, int, int, tuple[int, ...]]], old: Sequence[int],
                new: Sequence[int]) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """The log's indices, numbered by sources of sizes `old`, renumbered by sources of sizes `new`."""
    if tuple(old) == tuple(new):
        return log
    offsets = np.concatenate([[0], np.cumsum(new)])

    def one(i: int) -> int:
        s, j = _pair(old, i)
        return int(offsets[s]) + j

    return [(e, g, w, tuple(one(i) for i in b)) for e, g, w, b in log]



