"""torchft for real: a Lighthouse, replica groups of 2 ranks under torchrun, a group killed and healed, a step aborted,
a group joining, the whole job preempted; croupier's StepLoader exactly once, torchft's own sampler measured beside it."""

from __future__ import annotations

import concurrent.futures
import pathlib
import subprocess
import sys

import pytest
from _torchft_run import Audit, Plan, run_side, table
from conftest import ServeProcess

pytestmark = pytest.mark.e2e

SHORT = Plan()
#: More epochs, the same four faults at other steps.
LONG = Plan(steps=60, kill_at=7, heal_at=12, abort_at=20, join_at=26, preempt_at=43)


def both(tmp_path: pathlib.Path, address: str, plan: Plan) -> tuple[Audit, Audit]:
    """croupier's and torchft's sides of `plan`, side by side (each its own Lighthouse and groups)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ours = pool.submit(run_side, "croupier", tmp_path / "croupier", plan, address)
        peer = pool.submit(run_side, "torchft", tmp_path / "torchft", plan)
        return ours.result(), peer.result()


def assert_exact(a: Audit, plan: Plan) -> None:
    """Every epoch trained each sample once, every kept step of the promised global batch."""
    assert a.problems == [], a.problems
    assert a.batches == [plan.batch] * plan.steps
    assert [e[:4] for e in a.epochs] == [(e, plan.samples, 0, 0) for e in range(plan.epochs)]
    assert (a.duplicates, a.missing, a.never) == (0, 0, 0)


def assert_measured(a: Audit, plan: Plan) -> None:
    """torchft's side ran its steps under the same faults and its counts add up (whatever they are)."""
    assert a.steps == plan.steps and len(a.batches) == plan.steps and a.trained == sum(a.batches)
    assert a.complete and sum(e[1] for e in a.epochs) == a.trained
    assert all(0 <= e[3] < plan.samples for e in a.epochs)


def croupier_audit(logdir: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """`croupier audit LOGDIR` of the StepLoader's own logs (every rank's attempted steps)."""
    return subprocess.run([sys.executable, "-m", "croupier.tools.cli", "audit", str(logdir)], capture_output=True,
                          text=True, timeout=120)


def run_and_compare(tmp_path: pathlib.Path, serve_process: type[ServeProcess], plan: Plan, peer: bool = True) -> None:
    """croupier's side of `plan` exactly once and audited; with `peer`, torchft's own sampler measured beside it."""
    address = serve_process(f"sqlite:///{tmp_path}/coordinator.db").address
    if peer:
        ours, theirs = both(tmp_path, address, plan)
        print(table([ours, theirs], plan))
        assert_measured(theirs, plan)
    else:
        ours = run_side("croupier", tmp_path / "croupier", plan, address)
        print(table([ours], plan))
    assert_exact(ours, plan)
    checked = croupier_audit(tmp_path / "croupier" / "audit")
    print(checked.stdout)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_croupier_is_exactly_once_under_torchft_faults(tmp_path: pathlib.Path,
                                                       serve_process: type[ServeProcess]) -> None:
    run_and_compare(tmp_path, serve_process, SHORT, peer=False)


# NOTE: make slow: torchft's own sampler under the same faults, beside croupier's (its own Lighthouse and groups:
# twice the processes of the run above).
@pytest.mark.slow
def test_croupier_is_exactly_once_under_torchft_faults_and_torchfts_sampler_is_measured(
        tmp_path: pathlib.Path, serve_process: type[ServeProcess]) -> None:
    run_and_compare(tmp_path, serve_process, SHORT)


@pytest.mark.slow
def test_the_long_run(tmp_path: pathlib.Path, serve_process: type[ServeProcess]) -> None:
    run_and_compare(tmp_path, serve_process, LONG)


@pytest.mark.slow
def test_the_audit_fails_when_the_loader_deals_by_a_step_counter_of_its_own(
        tmp_path: pathlib.Path, serve_process: type[ServeProcess]) -> None:
    """Without the commit protocol (the step dealt is counted at each step's start, committed or not) the same
    faults leave samples out or train them twice, and the audit says so."""
    address = serve_process(f"sqlite:///{tmp_path}/coordinator.db").address
    broken = run_side("croupier", tmp_path / "broken", SHORT, address, "broken", ("--own-counter",))
    broken.side = "croupier, dealt by its own step counter"
    print(table([broken], SHORT))
    assert broken.duplicates + broken.missing > 0
    with pytest.raises(AssertionError):
        assert_exact(broken, SHORT)
