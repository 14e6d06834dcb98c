"""The state machine (``Jobs``): one model of a job's history, whose job is drawn of either kind.

A job of generations (``Elastic``, tests/server/_machine.py: samplers that join generations through crashes,
restarts from any checkpoint, resizes, zombies, coordinator and store loss, amendments; its steps are the
loop's) or a job of torchft-style replica-group steps (``FtSteps``, tests/server/_machine_ft.py: groups that
join, die, heal, commit and abort, their reports delivered in any order, whole-job restarts; its steps are
the quorums' committed ones). Every rule of both is a rule here, open while the example's job is of its
kind; after each rule the invariants of both are checked, each on the job of its kind. Which kinds are drawn
is ``_machine_world.KINDS`` (a planted-bug test narrows it): half the examples are of each kind when both
are in it.
"""

from __future__ import annotations

from collections.abc import Callable

import _machine_world
from _machine import Elastic
from _machine_ft import FtSteps
from _machine_world import EXAMPLES, MAX_WORLD, STEPPED, STEPS, setups
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

Rule = Callable[..., None]


def _gen(f: Callable[[Elastic], bool]) -> Callable[[Rule], Rule]:
    """A rule of a job of generations, open while the example's job is one (and `f` says it may run)."""
    return precondition(lambda self: self.gen is not None and f(self.gen))


def _ft(f: Callable[[FtSteps], bool]) -> Callable[[Rule], Rule]:
    """A rule of a job of replica-group steps, open while the example's job is one (and `f` says it may run)."""
    return precondition(lambda self: self.ft is not None and f(self.ft))


def _always(job: object) -> bool:
    return True


class Jobs(RuleBasedStateMachine):
    """Drives one job, drawn of either kind, through the faults of its kind, checking both kinds' invariants."""

    gen: Elastic | None = None
    ft: FtSteps | None = None

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        every = _machine_world.KINDS  # read here: a planted-bug test narrows it
        stepped = [k for k in every if k in STEPPED]
        kinds = (["generations"] if len(stepped) < len(every) else []) + (["steps"] if stepped else [])
        if data.draw(st.sampled_from(kinds), label="job of") == "generations":
            self.gen = Elastic()
            self.gen.start(data.draw(setups(), label="setup"), data.draw(st.integers(1, MAX_WORLD), label="world"),
                           data.draw(st.one_of(st.none(), st.integers(0, 3)), label="set_epoch(start)"))
            return
        kind = data.draw(st.sampled_from(stepped), label="stepped kind")
        self.ft = FtSteps()
        self.ft.start(STEPPED[kind], data.draw(st.sampled_from(["global", "group"]), label="mode"),
                      data.draw(st.integers(4, 24), label="n"), data.draw(st.integers(0, 3), label="seed"), data,
                      data.draw(st.integers(1, 2), label="ranks a group"), data.draw(st.integers(1, 3), label="groups"))

    def teardown(self) -> None:
        for job in (self.gen, self.ft):
            if job is not None:
                job.teardown()

    # ------------------------------------------------------------------ a job of generations

    @_gen(_always)
    @rule(k=st.integers(1, 6))
    def train(self, k: int) -> None:
        self.gen.train(k)  # type: ignore[union-attr]

    @_gen(_always)
    @rule()
    def checkpoint(self) -> None:
        self.gen.checkpoint()  # type: ignore[union-attr]

    @_gen(lambda j: bool(j.checkpoints))
    @rule(data=st.data(), world=st.integers(1, MAX_WORLD))
    def restart_from_any_checkpoint(self, data: st.DataObject, world: int) -> None:
        self.gen.restart_from_any_checkpoint(data, world)  # type: ignore[union-attr]

    @_gen(lambda j: bool(j.zombies or j.old_incarnations))
    @rule(data=st.data())
    def zombie(self, data: st.DataObject) -> None:
        self.gen.zombie(data)  # type: ignore[union-attr]

    @_gen(_always)
    @rule()
    def restart_coordinator(self) -> None:
        self.gen.restart_coordinator()  # type: ignore[union-attr]

    @_gen(lambda j: bool(j.checkpoints))
    @rule(data=st.data(), world=st.integers(1, MAX_WORLD))
    def lose_store(self, data: st.DataObject, world: int) -> None:
        self.gen.lose_store(data, world)  # type: ignore[union-attr]

    @_gen(lambda j: bool(j.setup.sources) and j.live is not None)
    @rule(data=st.data())
    def amend(self, data: st.DataObject) -> None:
        self.gen.amend(data)  # type: ignore[union-attr]

    @_gen(lambda j: j.live is not None and j.model.known > 0)
    @rule(data=st.data())
    def provenance(self, data: st.DataObject) -> None:
        self.gen.provenance(data)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ a job of replica-group steps

    @_ft(_always)
    @rule(data=st.data())
    def membership(self, data: st.DataObject) -> None:
        self.ft.membership(data)  # type: ignore[union-attr]

    @_ft(lambda j: bool(j._ahead()))
    @rule(data=st.data())
    def ahead_die(self, data: st.DataObject) -> None:
        self.ft.ahead_die(data)  # type: ignore[union-attr]

    @_ft(_always)
    @rule(data=st.data(), k=st.integers(1, 3))
    def attempt_steps(self, data: st.DataObject, k: int) -> None:
        self.ft.train(data, k)  # type: ignore[union-attr]

    @_ft(lambda j: bool(j.pending))
    @rule(data=st.data(), k=st.integers(1, 4))
    def deliver(self, data: st.DataObject, k: int) -> None:
        self.ft.deliver(data, k)  # type: ignore[union-attr]

    @_ft(lambda j: bool(j.pending))
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        self.ft.lose(data)  # type: ignore[union-attr]

    @_ft(lambda j: bool(j.opened) and j.stats["coordinator_restarts"] < 2)
    @rule()
    def restart_step_coordinator(self) -> None:
        self.ft.restart_coordinator()  # type: ignore[union-attr]

    @_ft(lambda j: any(g.history for g in j.groups.values()))
    @rule(data=st.data())
    def checkpoint_group(self, data: st.DataObject) -> None:
        self.ft.checkpoint(data)  # type: ignore[union-attr]

    @_ft(lambda j: bool(j.checkpoints))
    @rule(data=st.data(), groups=st.integers(1, 3))
    def restart_job(self, data: st.DataObject, groups: int) -> None:
        self.ft.restart_job(data, groups)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ what both kinds must keep

    @invariant()
    def every_kinds_invariants(self) -> None:
        """G1 of the generations' epochs so far; the steps' record against the model, each finished epoch once."""
        if self.gen is not None:
            self.gen.no_duplicates_so_far()
        if self.ft is not None:
            self.ft.record_is_the_models()
            self.ft.exactly_once_on_the_timeline()


SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
