"""Committed steps through the coordinator under random quorums, commits and aborts, dead groups, lost and repeated
reports, restarts: the state machine's planted bugs of a job of replica-group steps.

The state machine (tests/server/_machine_jobs.py, run by tests/server/test_state_machine.py) draws jobs of
generations and jobs of replica-group steps in one model. A job of steps (tests/server/_machine_ft.py) drives
torchft replica groups (the stand-in of tests/_ft_sim.py) with real ``StepLoader`` ranks against a real
coordinator on a SQLite store, over the order's positions or the toy way of dealing's stepped variant
(tests/_reverse_kind.py), and after every rule checks the coordinator's record of committed steps and the
job's history against its model, and that every sample of each finished epoch is in exactly one committed
step. Here the machine draws jobs of steps only, each test with a bug planted that it must find.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

import _machine_world
import hypothesis.errors
import pytest
from _machine_jobs import SETTINGS, Jobs
from _machine_world import STEPPED, TOTALS
from _reverse_kind import reverse_registered
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from croupier.core import quorum_ledger
from croupier.core.errors import FailedPrecondition
from croupier.core.ftsteps import CommittedStep, StepRun, Steps
from croupier.core.registry import FIXED
from croupier.integrations.torchft import StepLoader


@pytest.fixture(autouse=True)
def _steps_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The machine draws jobs of replica-group steps only, the toy way of dealing's stepped variant among them."""
    monkeypatch.setattr(_machine_world, "KINDS", list(STEPPED))
    with reverse_registered():
        yield


# ---------------------------------------------------------------------- the test can fail

# NOTE: one failure is enough (report_multiple_bugs=False); a replay that draws differently is a Flaky, which is
# a catch too. A planted record bug may also show as the coordinator refusing a later report that contradicts it.
CAUGHT = (AssertionError, hypothesis.errors.Flaky, FailedPrecondition)
PLANTED = settings(SETTINGS, max_examples=600, database=None, phases=[Phase.generate], report_multiple_bugs=False)


class _LoadedStateRefused(Exception):
    """StepLoader's refusal to deal from a loaded state whose step is not the manager's (a RuntimeError)."""


def _caught(plant: str, also: tuple[type[BaseException], ...] = ()) -> None:
    TOTALS.clear()
    with pytest.raises(CAUGHT + also) as e:
        run_state_machine_as_test(Jobs, settings=PLANTED)
    print(f"\n{plant}: caught after {TOTALS['ft_examples']} examples: {type(e.value).__name__}: {str(e.value)[:300]}")


@pytest.mark.exhaustive  # in make test, not in make check
def test_a_recorded_stale_report_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator without the staleness rule: a report of a step a later quorum trained again is recorded."""
    def is_new(self: Steps, run: str, c: CommittedStep) -> bool:
        r = self.run(run)
        return r is None or (c not in r.steps and c not in r.dropped)

    monkeypatch.setattr(Steps, "is_new", is_new)
    _caught("stale report recorded")


@pytest.mark.exhaustive
@pytest.mark.parametrize("counts", ["dealt", "committed"])
def test_a_loader_counting_its_own_steps_is_caught(monkeypatch: pytest.MonkeyPatch, counts: str) -> None:
    """A loader that deals by its own count of steps, not the quorum's committed count: of the steps it dealt (an
    aborted one counted), or of those its own group committed (a heal does not move it)."""
    real_next, real_hook = StepLoader.__next__, StepLoader._hook

    def own_count(self: StepLoader) -> Any:
        own = self.__dict__.get("_own", 0)
        m = self._manager
        m.current_step = lambda: own
        try:
            return real_next(self)
        except RuntimeError as e:
            if str(e).startswith("the loaded state is of step"):
                raise _LoadedStateRefused(str(e)) from e
            raise
        finally:
            del m.current_step
            if counts == "dealt":
                self._own = own + 1  # type: ignore[attr-defined]

    def hook(self: StepLoader, manager: Any) -> None:
        real_hook(self, manager)
        commit = manager.should_commit

        def should_commit() -> bool:
            ok = bool(commit())
            if ok and counts == "committed":
                self._own = self.__dict__.get("_own", 0) + 1  # type: ignore[attr-defined]
            return ok

        manager.should_commit = should_commit

    monkeypatch.setattr(StepLoader, "__next__", own_count)
    monkeypatch.setattr(StepLoader, "_hook", hook)
    # A loader resumed from a checkpoint may find its own count at odds with the step the manager was restored
    # to and refuse to deal (StepLoader's check of a loaded state): the plant is caught there too.
    _caught(f"loader's own count of steps {counts}", also=(_LoadedStateRefused,))


@pytest.mark.exhaustive
def test_superseding_without_dropping_later_records_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator replaces a step committed again but keeps the earlier quorum's records of later steps."""
    def record(self: Steps, run: str, parent: str, resumed: int, mode: str, batch: int, c: CommittedStep) -> bool:
        if not self.is_new(run, c):
            return False
        r = self.run(run)
        if r is None:
            r = StepRun(run, parent, resumed, mode, batch)
            self.runs.append(r)
        lo = bisect.bisect_left(r.steps, c.step, key=lambda x: x.step)
        hi = lo + (lo < len(r.steps) and r.steps[lo].step == c.step)
        r.dropped.extend(r.steps[lo:hi])
        r.steps[lo:hi] = [c]
        return True

    monkeypatch.setattr(Steps, "record", record)
    _caught("superseding that keeps later records")


def test_a_history_without_the_stepped_variant_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's history reads a toy kind's steps (tests/_reverse_kind.py) in the order's own sequence, not in its
    stepped variant's: the samples it names for a step are not those its quorum was dealt."""
    monkeypatch.setattr(quorum_ledger, "kind_of", lambda spec: FIXED)
    monkeypatch.setattr(_machine_world, "KINDS", ["reverse-steps"])
    _caught("history without the stepped variant")
