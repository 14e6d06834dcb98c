"""`croupier audit` of a fault-tolerant (torchft) job from its ranks' logs (tools/audit_ft.py), read by the one reader of
audit logs (tools/audit_log.py), the earlier format (``*.ftaudit``) included."""

from __future__ import annotations

import pathlib
import random

import pytest

from croupier.integrations.torchft import StepLoader
from croupier.tools.audit import ft_reports, verdict
from croupier.tools.audit_ft import audit_ft
from croupier.tools.audit_log import load
from croupier.tools.cli import main as cli
from tests._ft_sim import FakeManager, FtSim

N = 40


def _run(logdir: pathlib.Path, seed: int, steps: int = 30) -> None:
    """Random quorums, groups dying and (re)joining, aborts on one or all groups; every rank logs."""
    rnd = random.Random(seed)
    sim = FtSim()

    def group(g: int) -> list[StepLoader]:
        return [StepLoader(m, N, global_batch=12, job="ft", address=None, group_rank=r, group_world=2,
                           audit_dir=str(logdir), group=f"g{g}") for r, m in enumerate(sim.add_group(g, 2))]

    loaders = {g: group(g) for g in (0, 1, 2)}
    committed, nxt = 0, 3
    while committed < steps:
        if rnd.random() < 0.1 and len(loaders) > 1:
            gone = rnd.choice(sorted(loaders))
            for lo in loaders.pop(gone):
                lo.close()
            sim.remove_group(gone)
        if rnd.random() < 0.1:
            loaders[nxt] = group(nxt)
            nxt += 1
        top = max(sim.managers[g][0]._step for g in loaders)
        members = tuple(rnd.sample(sorted(loaders), rnd.randint(1, len(loaders))))
        if all(sim.managers[g][0]._step < top for g in members):
            members += (next(g for g in sorted(loaders) if sim.managers[g][0]._step == top),)
        kind = rnd.random()
        commits = {g: kind > 0.2 and (kind > 0.35 or g != members[0]) for g in members}
        sim.open(members, commits)
        for g in members:
            for lo in loaders[g]:
                next(lo)
        for g in members:
            for lo in loaders[g]:
                lo._manager.should_commit()
        committed += any(commits.values())
    for group_loaders in loaders.values():
        for lo in group_loaders:
            lo.close()


@pytest.mark.parametrize("seed", range(4))
def test_a_run_with_faults_is_audited_exactly_once(tmp_path: pathlib.Path, seed: int) -> None:
    _run(tmp_path, seed)
    (incs,) = load(tmp_path).values()
    a = audit_ft("ft", incs)
    assert a.ok, a
    assert [s for _, s, _, _ in a.epochs[:-1]] == [N] * (len(a.epochs) - 1)


def test_dealing_by_attempts_instead_of_commits_fails_the_audit(tmp_path: pathlib.Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[int, int] = {}

    def attempts(self: FakeManager) -> int:  # the step as a loader counting its own deals would see it
        calls[id(self)] = calls.get(id(self), -1) + 1
        return calls[id(self)]

    monkeypatch.setattr(FakeManager, "current_step", attempts)
    _run(tmp_path, 1)
    (incs,) = load(tmp_path).values()
    assert not audit_ft("ft", incs).ok


def test_a_lost_log_is_named_not_guessed(tmp_path: pathlib.Path) -> None:
    _run(tmp_path, 2)
    next(iter(sorted(tmp_path.glob("ft/*-r1-*.audit")))).unlink()
    (incs,) = load(tmp_path).values()
    a = audit_ft("ft", incs)
    assert not a.ok and a.incomplete


def test_the_command_audits_the_logs(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path, 3)
    assert cli(["audit", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ok: every index exactly once in the kept committed steps" in out and "G1 holds" in out


FIXTURE = pathlib.Path(__file__).parent.parent / "fixtures" / "ftaudit-v1"


def test_the_earlier_format_reads_into_the_same_model_and_audits_as_it_did() -> None:
    """tests/fixtures/ftaudit-v1: the logs of the release before (``*.ftaudit``, steps numbered by the steps committed
    before them) of run "fresh" (steps 1-6, an aborted attempt) and run "fresh>3" resumed at step 3 (steps 4-10)."""
    (incs,) = load(FIXTURE).values()
    assert [(i.name, i.resumed and (i.resumed["incarnation"], i.resumed["step"])) for i in incs] == [
        ("fresh", None), ("fresh>3", ("fresh", 3))]
    assert sorted({r["step"] for r in incs[0].steps}) == [1, 2, 3, 4, 5, 6]  # numbered from 1 as read
    assert sorted({r["step"] for r in incs[1].steps}) == list(range(4, 11))
    a = audit_ft("ft", incs)
    # what the release before said of these logs: 10 steps kept, 3 abandoned, two epochs exactly once
    assert (a.steps, a.abandoned, a.epochs, a.ok) == (10, 3, [(0, 20, 0, 0), (1, 20, 0, 0)], True)
    assert verdict(ft_reports(a)) == (True, "2 finished epochs audited, 40 indices; G1 holds")
    assert cli(["audit", str(FIXTURE)]) == 0

