"""A job of torchft-style replica-group steps (``FtSteps``) as the state machine (tests/server/_machine_jobs.py) drives it:
groups that join, die, heal, commit and abort, their reports delivered in any order."""

from __future__ import annotations

import collections
import dataclasses
import shutil
import tempfile
import uuid
from typing import Any

import numpy as np
from _machine_world import TOTALS
from hypothesis import strategies as st

from croupier.client._rpc import CoordinatorClient
from croupier.core.ftsteps import CommittedStep
from croupier.core.order import order
from croupier.core.spec import Spec
from croupier.integrations.torchft import StepLoader
from croupier.server import Server
from tests._ft_sim import FakeManager, FtSim

JOB = "ft"
MAX_GROUPS = 4

#: A report's identity in the record: its run and [step, start, stop, quorum, participants].
Key = tuple[str, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Rec:
    """A committed step as the model knows it: its run, its record's fields and the samples its quorum was dealt."""

    run: str
    step: int
    start: int
    stop: int
    quorum: int
    participants: int
    samples: tuple[int, ...]

    @property
    def key(self) -> Key:
        return self.run, (self.step, self.start, self.stop, self.quorum, self.participants)


@dataclasses.dataclass
class Group:
    """A replica group: one StepLoader per rank (over its manager), and the committed steps its model holds."""

    loaders: list[StepLoader]
    history: list[Rec]

    @property
    def managers(self) -> list[FakeManager]:
        return [lo._manager for lo in self.loaders]


@dataclasses.dataclass(frozen=True)
class Report:
    """What a group's rank 0 sends for a committed step: the arguments of ``StepLoader._report_loop``'s call."""

    group: int
    job: str
    spec: Spec
    run: str
    parent: str
    resumed: int
    mode: str
    batch: int
    step: CommittedStep

    @property
    def key(self) -> Key:
        return self.run, tuple(self.step.to_list())


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What the trainer saved from one group: its loader's and manager's states, and the steps its model holds."""

    loader: dict[str, Any]
    manager: dict[str, int]
    history: tuple[Rec, ...]
    run: str
    step: int


class FtSteps:
    """Drives one fault-tolerant job's replica groups through a real coordinator on SQLite, and checks its record: each
    public method is a rule of the state machine (``Jobs``), with the arguments it draws."""

    def start(self, dealing: str, mode: str, n: int, seed: int, data: st.DataObject, ranks: int, groups: int) -> None:
        """A job of `groups` groups of `ranks` ranks whose spec names the way of dealing `dealing` (its stepped variant
        orders each epoch's positions: tests/_reverse_kind.py has one)."""
        self.dealing, self.mode, self.n, self.seed = dealing, mode, n, seed
        self.ranks = ranks  # every group's (torchft's replica groups have one shape)
        self.batch = data.draw(st.integers(2, 8) if mode == "global" else st.integers(1, 4), label="batch")
        self.stats: collections.Counter[str] = collections.Counter(examples=1, **{f"{mode}_examples": 1,
                                                                                  f"{dealing}_examples": 1})
        self.tmp = tempfile.mkdtemp(prefix="croupier-ft-machine-")
        self.url = f"sqlite:///{self.tmp}/coordinator.db"
        self.server = Server(self.url).start()
        self.port = self.server.port
        self.client = CoordinatorClient(self.server.address, retry_for=30.0)
        self.run = "fresh"  # the loaders' own name for a job's first start
        self.runs: dict[str, tuple[str, int]] = {"fresh": ("", 0)}  # run -> (parent, resumed): what the model started
        self.named = False
        self.sim = FtSim()
        self.groups: dict[int, Group] = {}
        self.next_group = 0
        self.pending: list[Report] = []  # reports sent and not delivered yet (in flight, retried, or lost later)
        self.arrived: dict[Key, int] = {}  # every report the coordinator received -> when it first did
        self.opened: list[str] = []  # runs, in the order their first report was recorded
        self.checkpoints: list[Checkpoint] = []
        self.resumes: set[tuple[str, int]] = set()
        self.high: dict[str, int] = {}  # run -> the highest step it committed + 1
        for _ in range(groups):
            self._add_group()

    def teardown(self) -> None:
        if not hasattr(self, "groups"):
            return
        try:
            for g in self.groups.values():
                for lo in g.loaders:
                    lo.close()
            self.client.close()
            self.server.stop(grace=0.5)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.stats["epochs_finished"] += getattr(self, "epochs", 0)
            TOTALS.update({f"ft_{k}": v for k, v in self.stats.items()})

    # ------------------------------------------------------------------ groups

    def _add_group(self) -> int:
        """A fresh group (its managers at step 0: it heals at its next quorum); its reports are captured."""
        g = self.next_group
        self.next_group += 1
        kw = {"global_batch": self.batch} if self.mode == "global" else {"group_batch": self.batch}
        loaders = [StepLoader(m, self.n, job=JOB, address=self.server.address, seed=self.seed, group_rank=r,
                              group_world=self.ranks, run=self.run if self.named else None, dealing=self.dealing,
                              **kw)  # type: ignore[arg-type]
                   for r, m in enumerate(self.sim.add_group(g, self.ranks))]
        for lo in loaders:
            # NOTE: the hook's report is captured where the loader would queue it for its reporting thread;
            # the machine is that thread, delivering (or losing, or repeating) it in an order it draws.
            lo._send = (lambda c, lo=lo, g=g: self.pending.append(  # type: ignore[method-assign]
                Report(g, lo.job, lo.spec, lo.run, lo.parent, lo.resumed, lo.mode, lo.batch, c)))
        self.groups[g] = Group(loaders, [])
        return g

    def _step_of(self, g: int) -> int:
        steps = {m.current_step() for m in self.groups[g].managers}
        assert steps == {len(self.groups[g].history)}, f"group {g}: managers at {steps}, model at {len(self.groups[g].history)}"
        return len(self.groups[g].history)

    def _top(self) -> list[Rec]:
        """The job's timeline: the model of a group at the highest step (every live group's is a prefix of it)."""
        top = max(self.groups.values(), key=lambda g: len(g.history)).history
        for g in self.groups.values():
            assert g.history == top[:len(g.history)], "live groups' models diverged"
        return top

    # ------------------------------------------------------------------ rules

    def _holds(self, gone: set[int]) -> bool:
        """Whether a group other than `gone` holds the job's state (it loaded the checkpoint or healed since).

        NOTE: when every group holding it dies, the job's state is gone: what fresh groups train then is
        a fresh start of the job (a run of its own), not this run; the machine leaves one holder alive.
        """
        resumed = self.runs[self.run][1]
        return any(len(v.history) >= resumed for g, v in self.groups.items() if g not in gone)

    def membership(self, data: st.DataObject) -> None:
        """A replica group (re)joins, fresh, or a group is killed (one holding the job's state stays)."""
        dying = [g for g in sorted(self.groups) if len(self.groups) > 1 and self._holds({g})]
        if len(self.groups) < MAX_GROUPS and (not dying or data.draw(st.booleans(), label="join")):
            self._add_group()
            self.stats["joins"] += 1
        elif dying:
            self._kill(data.draw(st.sampled_from(dying), label="group killed"), data)

    def _ahead(self) -> set[int]:
        """The groups at the highest step, if a group behind them holds the job's state (else none)."""
        top = max(len(v.history) for v in self.groups.values())
        ahead = {g for g, v in self.groups.items() if len(v.history) == top}
        return ahead if len(ahead) < len(self.groups) and self._holds(ahead) else set()

    def ahead_die(self, data: st.DataObject) -> None:
        """The groups at the highest step die with the updates they committed alone (their reports in flight may still
        arrive); the others train the first of those steps again, and their reports may arrive first."""
        for g in sorted(self._ahead()):
            self._kill(g, None)
        self.stats["ahead_died"] += 1
        before = len(self.pending)
        self._attempt(data)
        if data.draw(st.booleans(), label="the survivors' reports overtake the dead groups'"):
            for rep in self.pending[before:]:
                self.pending.remove(rep)
                self._deliver(rep)

    def _kill(self, g: int, data: st.DataObject | None) -> None:
        """Group `g` is killed: its model is gone, and each of its reports not delivered yet may be lost
        (with `data`; without, they stay in flight: the ``lose`` rule may still lose them)."""
        for rep in [r for r in self.pending if r.group == g]:
            if data is not None and data.draw(st.booleans(), label="report lost with it"):
                self.pending.remove(rep)
                self.stats["reports_lost"] += 1
        for lo in self.groups.pop(g).loaders:
            lo.close()
        self.sim.remove_group(g)
        self.stats["leaves"] += 1

    def train(self, data: st.DataObject, k: int) -> None:
        """`k` steps attempted, one after the other."""
        for _ in range(k):
            self._attempt(data)

    def _attempt(self, data: st.DataObject) -> None:
        """A step attempted by a quorum of live groups (always one at the highest step), committed by all, some or none."""
        order_ = data.draw(st.permutations(sorted(self.groups)), label="quorum order")
        members = tuple(order_[:data.draw(st.integers(1, len(order_)), label="quorum size")])
        steps = {g: self._step_of(g) for g in self.groups}
        top = max(steps.values())
        if all(steps[g] < top for g in members):
            members += (min(g for g in steps if steps[g] == top),)
        kind = data.draw(st.sampled_from(["all", "some", "none"]), label="commits")
        commits = {g: kind == "all" or (kind == "some" and data.draw(st.booleans(), label=f"group {g} commits"))
                   for g in members}
        self.stats[f"attempts_{kind}"] += 1
        self.sim.open(members, commits)
        source = self.groups[next(g for g in members if steps[g] == top)].history
        for g in members:
            if steps[g] < top:  # it heals: the manager's state (and the loader's run) of a group at the top step
                self.groups[g].history = list(source)
                self.stats["heals"] += 1
        q = len(members)
        if self.mode == "global":
            first, last = top * self.batch, (top + 1) * self.batch
        else:
            done = sum(r.participants for r in source)
            first, last = done * self.batch, (done + q) * self.batch
        dealt: list[int] = []
        sizes = []
        for g in members:
            part: list[int] = []
            for lo in self.groups[g].loaders:
                part += next(lo).tolist()
                assert (lo.step, lo.quorum, lo.participants, lo.run) == (top, self.sim.quorum, q, self.run), (
                    f"group {g} dealt step {lo.step} of quorum {lo.quorum} ({lo.participants} participants, run "
                    f"{lo.run!r}); the quorum is {self.sim.quorum} at step {top} with {q}, run {self.run!r}")
            dealt += part
            sizes.append(len(part))
        want = self._stream(first, last)
        assert dealt == want, f"step {top}: the quorum {members} was dealt {dealt}, not stream [{first}, {last}): {want}"
        assert max(sizes) - min(sizes) <= 1, f"step {top}: the groups' parts are uneven: {sizes}"
        before = len(self.pending)
        for g in members:
            for m in self.groups[g].managers:
                m.should_commit()
        rec = Rec(self.run, top, first, last, self.sim.quorum, q, tuple(dealt))
        parent, resumed = self.runs[self.run]
        sent = self.pending[before:]
        want_sent = [Report(g, JOB, self.groups[g].loaders[0].spec, self.run, parent, resumed, self.mode, self.batch,
                            CommittedStep.from_list(rec.key[1])) for g in members if commits[g]]
        assert sent == want_sent, f"step {top}: the loaders reported {sent}, not {want_sent}"
        for g in members:
            if commits[g]:
                self.groups[g].history.append(rec)
        self.stats["steps_committed_again"] += any(commits.values()) and top < self.high.get(self.run, 0)
        self.high[self.run] = max(self.high.get(self.run, 0), top + any(commits.values()))

    def _stream(self, first: int, last: int) -> list[int]:
        """The dataset indices at stream positions [first, last): the job's epochs' orders end to end, each epoch's
        positions in order, or, for the toy way of dealing, its batches of the spec's from the back, the last one last."""
        spec = Spec(n=self.n, seed=self.seed, permutation="feistel", batch_size=self.batch)
        places = list(range(self.n))
        if self.dealing == "reverse":
            batches = [places[a:a + self.batch] for a in range(0, self.n, self.batch)]
            places = [p for b in batches[-2::-1] + batches[-1:] for p in b]
        out: list[int] = []
        for p in range(first, last):
            out += order(spec, p // self.n, np.array([places[p % self.n]], dtype=np.int64)).tolist()
        return out

    def deliver(self, data: st.DataObject, k: int) -> None:
        """Reports reach the coordinator (any of those in flight, one at a time); each may come again later (a retry)."""
        way = data.draw(st.sampled_from(["newest", "any", "oldest"]), label="which first")
        for _ in range(min(k, len(self.pending))):
            rep = (self.pending[-1] if way == "newest" else self.pending[0] if way == "oldest"
                   else data.draw(st.sampled_from(self.pending), label="report"))
            if not data.draw(st.booleans(), label="sent again later"):
                self.pending.remove(rep)
            self._deliver(rep)

    def _deliver(self, rep: Report) -> None:
        new = rep.key not in self.arrived and not self._stale(rep.key, len(self.arrived))
        got = self.client.commit_step(rep.job, rep.spec, rep.run, rep.parent, rep.resumed, rep.mode, rep.batch, rep.step)
        assert got == new, f"the coordinator answered recorded={got} for {rep.key} (new: {new})"
        self.stats["reports_recorded" if new else "reports_repeated" if rep.key in self.arrived else "reports_stale"] += 1
        self.arrived.setdefault(rep.key, len(self.arrived))
        if new and rep.run not in self.opened:
            self.opened.append(rep.run)

    def lose(self, data: st.DataObject) -> None:
        """A report never arrives (its group's thread died with it, or the coordinator was down for its retries)."""
        self.pending.remove(data.draw(st.sampled_from(self.pending), label="report lost"))
        self.stats["reports_lost"] += 1

    def restart_coordinator(self) -> None:
        """The coordinator dies and comes back on the same SQLite file and port: the record is the same."""
        before = [r.to_dict() for r in self.client.steps(JOB)[1].runs]
        self.server.stop(grace=0.0)
        self.server = Server(self.url, port=self.port).start()
        # NOTE: a new channel: an old one waits out gRPC's reconnect backoff (a second), which is not what is tested here.
        self.client.close()
        self.client = CoordinatorClient(self.server.address, retry_for=30.0)
        after = [r.to_dict() for r in self.client.steps(JOB)[1].runs]
        assert after == before, "the restarted coordinator's record differs"
        self.stats["coordinator_restarts"] += 1

    def checkpoint(self, data: st.DataObject) -> None:
        """The trainer saves one group's states (after its optimizer step): the loader's and the manager's."""
        g = data.draw(st.sampled_from(sorted(g for g, v in self.groups.items() if v.history)), label="group saved")
        lo = self.groups[g].loaders[0]
        state = lo.state_dict()
        step = self._step_of(g)
        assert (state["run"], state["step"]) == (self.run, step), (state, self.run, step)
        self.checkpoints.append(Checkpoint(state, lo._manager.state_dict(), tuple(self.groups[g].history), self.run, step))
        self.stats["checkpoints"] += 1

    def restart_job(self, data: st.DataObject, groups: int) -> None:
        """Every group dies (each report in flight arrives now or never) and the job starts again from any checkpoint."""
        for rep in list(self.pending):
            self.pending.remove(rep)
            if data.draw(st.booleans(), label="arrives before the restart"):
                self._deliver(rep)
            else:
                self.stats["reports_lost"] += 1
        for g in self.groups.values():
            for lo in g.loaders:
                lo.close()
        ck = data.draw(st.sampled_from(self.checkpoints), label="checkpoint")
        # A second start from one checkpoint names its run (CROUPIER_RUN); a first may take the derived name.
        self.named = (ck.run, ck.step) in self.resumes or data.draw(st.booleans(), label="named run")
        self.resumes.add((ck.run, ck.step))
        self.run = uuid.uuid4().hex[:16] if self.named else f"{ck.run}>{ck.step}"
        self.runs[self.run] = (ck.run, ck.step)
        self.sim, self.groups = FtSim(), {}
        for _ in range(groups):
            g = self._add_group()
            for lo in self.groups[g].loaders:
                lo._manager.load_state_dict(ck.manager)
                lo.load_state_dict(ck.loader)
                assert lo.run == self.run, (lo.run, self.run)
            self.groups[g].history = list(ck.history)
        self.stats["job_restarts"] += 1

    # ------------------------------------------------------------------ what the coordinator must say

    def _stale(self, x: Key, at: int) -> bool:
        """Whether report `x`, arriving at `at`, comes after one of its run from a later quorum at or before its
        step: that quorum trained the step again, so `x`'s update was lost with the groups that made it."""
        return any(y[0] == x[0] and y[1][0] <= x[1][0] and y[1][3] > x[1][3] and when < at
                   for y, when in self.arrived.items())

    def _surviving(self, run: str, step: int) -> Key | None:
        """The report of `run`'s `step` no report of a later quorum at or before it superseded."""
        out = {x for x in self.arrived if x[0] == run and x[1][0] == step and not any(
            y[0] == run and y[1][0] <= step and y[1][3] > x[1][3] for y in self.arrived)}
        assert len(out) <= 1, f"step {step} of run {run!r}: two reports survive: {out}"
        return next(iter(out), None)

    def _kept(self, step: int) -> Key | None:
        """The version the record must keep: the latest run the coordinator knows, then its ancestors it knows."""
        run: str | None = self.opened[-1] if self.opened else None
        while run is not None and run in self.opened:
            parent, resumed = self.runs[run]
            if step >= resumed:
                return self._surviving(run, step)
            run = parent
        return None

    def record_is_the_models(self) -> None:
        """The coordinator's record, read as Steps.kept / .abandoned, is what the model trained and kept."""
        if not hasattr(self, "groups"):
            return
        self.stats["rule_steps"] += 1
        if not self.opened:
            return
        spec, record = self.client.steps(JOB)
        assert spec.n == self.n
        assert [r.run for r in record.runs] == self.opened, ([r.run for r in record.runs], self.opened)
        for r in record.runs:
            assert (r.parent, r.resumed, r.mode, r.batch) == (*self.runs[r.run], self.mode, self.batch), r.to_dict()
        timeline = self._top()
        chain, run = set(), self.run  # the runs the timeline goes through, if the coordinator knows them all
        while run:
            chain.add(run)
            run = self.runs[run][0]
        known = self.opened[-1] == self.run and chain <= set(self.opened)
        for t in range(1 + max([len(timeline) - 1, *(x[1][0] for x in self.arrived)])):
            want = self._kept(t)
            got = record.kept(t + 1)  # the model counts the steps committed before a step; the record numbers from 1
            assert (got and (got[0].run, tuple(got[1].to_list()))) == (want or None), (
                f"step {t}: the coordinator keeps {got and (got[0].run, got[1].to_list())}, the model {want}")
            if t < len(timeline) and timeline[t].key in self.arrived and known:
                mine = timeline[t].key
                if mine[0] != self.run and any(y[0] == mine[0] and y[1][0] <= t and y[1][3] > mine[1][3]
                                               for y in self.arrived):
                    # NOTE: a known limit (docs/guarantees.md, G12): the job resumed from a checkpoint that holds
                    # a version of step t which its run's later quorum superseded (the groups that saved it died,
                    # the survivors trained step t or an earlier one again); a resume point names a run and a
                    # step, not the versions, so the record answers the survivors' version (or none).
                    self.stats["steps_kept_known_limit"] += 1
                else:
                    assert want == mine, f"step {t}: the model trained {mine}, the record keeps {want}"
                    self.stats["steps_kept_checked"] += 1
            versions = [x for x, when in self.arrived.items() if x[1][0] == t and x != want and not self._stale(x, when)]
            abandoned = [(r.run, tuple(c.to_list())) for r, c in record.abandoned(t + 1)]
            assert sorted(abandoned) == sorted(versions), f"step {t}: abandoned {abandoned}, the model {versions}"
            self.stats["steps_abandoned_checked"] += bool(versions)
        self._history_is_the_records(record, timeline)

    def _history_is_the_records(self, record: Any, timeline: list[Rec]) -> None:
        """The job's history (what croupier provenance answers, croupier.core.history) keeps the record's versions,
        each with the samples the model's groups trained in it."""
        led, _ = self.client.history(JOB)
        trained = {rec.key: rec.samples for rec in timeline}
        for t in range(1, led.last_step + 1):
            kept, v = record.kept(t), led.step(t).kept
            assert (kept and (kept[0].run, kept[1].quorum, (kept[1].start, kept[1].stop))) == (
                v and (v.incarnation, v.quorum, v.span)), f"step {t}: the history keeps {v}, the record {kept}"
            key = kept and (kept[0].run, tuple(kept[1].to_list()))
            if v is not None and key in trained:
                assert sorted(v.indices.tolist()) == sorted(trained[key]), f"step {t}: the history's samples"
                self.stats["history_steps_checked"] += 1

    def exactly_once_on_the_timeline(self) -> None:
        """Every sample of each finished epoch is in exactly one committed step of the timeline; each step's batch
        is what was promised (the global batch, or the group batch times its participants)."""
        if not hasattr(self, "groups"):
            return
        stream: list[int] = []
        for t, rec in enumerate(self._top()):
            assert rec.step == t and rec.start == len(stream), f"step {t} starts at {rec.start}, not {len(stream)}"
            want = self.batch * (1 if self.mode == "global" else rec.participants)
            assert len(rec.samples) == want, f"step {t} trained {len(rec.samples)} samples, not {want}"
            stream += rec.samples
        for e in range(len(stream) // self.n):
            assert sorted(stream[e * self.n:(e + 1) * self.n]) == list(range(self.n)), f"epoch {e}"
        tail = stream[len(stream) // self.n * self.n:]
        assert len(set(tail)) == len(tail), "a sample repeated in the epoch in progress"
        self.epochs = len(stream) // self.n


