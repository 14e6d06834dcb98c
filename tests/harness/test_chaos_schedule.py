"""The chaos run in process: its fault schedule (harness/_schedule.py: one of each kind first, a fault due past the
job's end brought early as a rollback, a relaunch left room for a checkpoint, a seed replayed) and its settings
refused before anything is touched (harness/chaos.py)."""

from __future__ import annotations

import pathlib
import random
import re
from typing import Any

import pytest

from croupier.harness import chaos
from croupier.harness._schedule import KINDS, ONLINE, REPLICATED_KINDS, Due, FaultSchedule, JobShape

JOB = JobShape(epochs=20, n=1200, batch=12, ckpt_every=2)
PACE = 0.04  # seconds a step of the simulated job


def status(step: int, world: int = 2, job: JobShape = JOB) -> dict[str, Any]:
    """The furthest rank's status at global step `step` of a job of `world` ranks that never restarts."""
    per_epoch = job.n // (world * job.batch)
    return {"epoch": step // per_epoch, "step": step, "k": step % per_epoch, "of": per_epoch, "world": world}


def drive(schedule: FaultSchedule, steps: int) -> list[tuple[int, Due]]:
    """The faults the schedule makes due over `steps` steps of the job, each at its step (a fault that ends
    the launch starts a new one, as the run's watch does)."""
    out: list[tuple[int, Due]] = []
    for step in range(steps):
        due = schedule.due(status(step), step * PACE, len(out), restart_s=0.0)
        if due is not None:
            out.append((step, due))
            if due.kind not in ONLINE:
                schedule.new_launch()
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_first_faults_are_one_of_each_kind(seed: int) -> None:
    schedule = FaultSchedule(3, JOB, random.Random(seed))
    dues = drive(schedule, 20 * 50)
    assert sorted(d.kind for _, d in dues) == sorted(KINDS), dues
    assert not any(d.rollback for _, d in dues)
    replicated = FaultSchedule(5, JOB, random.Random(seed), replicated=True, database=True)
    # the database is restarted twice, once with each shutdown mode
    assert sorted(d.kind for _, d in drive(replicated, 20 * 50)) == sorted([*REPLICATED_KINDS, "database"])


def test_a_seed_replays_the_same_faults_at_the_same_steps() -> None:
    runs = [drive(FaultSchedule(12, JOB, random.Random(7)), 20 * 50) for _ in range(2)]
    assert len(runs[0]) == 12 and runs[0] == runs[1]


def test_a_fault_due_past_the_end_comes_early_as_a_rollback_unless_it_is_the_last() -> None:
    schedule = FaultSchedule(3, JOB, random.Random(1))
    first = list(schedule.first_kinds)
    end = status(20 * 50 - 1)  # one step left: near the end, whatever the gap drawn
    assert schedule.due(end, 0.0, 0, restart_s=0.0) == Due("preempt", True)
    # the first fault of its kind turned into a rollback comes next, so a short run still has one of each kind
    want = [first[0], *first] if first[0] != "preempt" else first
    assert schedule.first_kinds == want
    # the last fault asked comes as drawn, with no rollback after it
    schedule.new_launch()
    assert schedule.due(end, 0.0, 2, restart_s=0.0) == Due(want[2], False)


def test_a_relaunch_is_left_room_for_a_checkpoint_past_the_one_it_resumed_from() -> None:
    job = JobShape(epochs=1, n=48, batch=12, ckpt_every=2)  # every gap drawn is a step or less
    far = {"epoch": 0, "step": 10, "k": 0, "of": 100, "world": 4}
    for seed in range(20):
        schedule = FaultSchedule(3, job, random.Random(seed))
        assert schedule.due(far, 0.0, 0, restart_s=0.0) is None and schedule.target is not None
        kind, at = schedule.target
        assert at - far["step"] == (1 if kind in ONLINE else job.ckpt_every + 1), (kind, at)


@pytest.mark.parametrize("kw, error, says", [
    ({"batching": "tokens", "mixture": True}, ValueError,
     "batching must be one of ['fixed'] (got batching='tokens'): a mixture is dealt in fixed batches"),
    ({"batching": "random"}, ValueError, "batching must be one of ['fixed', 'tokens', 'dynamic'] (got batching='random')"),
    ({"step_ms": 0}, ValueError, "step_ms must be in [1, 10001) (got step_ms=0)"),
    ({"faults": -1}, ValueError, "faults must be >= 0 (got faults=-1)"),
    ({"epochs": 0}, ValueError, "epochs must be >= 1 (got epochs=0)"),
    ({"n": 47}, ValueError, "n must be >= 48 (got n=47): so that 4 workers each get a batch"),
    ({"n": "1200"}, TypeError, "n must be an int (got n='1200')"),
    ({"replicas": 0}, ValueError, "replicas must be >= 1 (got replicas=0)"),
    ({"replicas": 3}, ValueError, "replicas must be in [1, 2) (got replicas=3): more than 1 needs a shared store"),
    ({"database": object()}, ValueError, "a database control needs the replicated mode"),
])
def test_bad_settings_are_refused_by_name_before_anything_is_touched(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any], error: type[Exception],
        says: str) -> None:
    def touched(workdir: str) -> pathlib.Path:
        pytest.fail(f"the workdir {workdir} was touched")

    monkeypatch.setattr(chaos, "_empty_workdir", touched)
    with pytest.raises(error, match=re.escape(says)):
        chaos.main(str(tmp_path / "chaos"), **kw)
    assert not (tmp_path / "chaos").exists()
