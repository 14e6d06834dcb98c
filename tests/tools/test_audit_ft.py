"""`croupier audit` of a fault-tolerant (torchft) job from its ranks' logs (tools/audit_ft.py)."""

from __future__ import annotations

import pathlib
import random

import pytest

from croupier.integrations.torchft import StepLoader
from croupier.tools.audit_ft import audit_ft, load_ft
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
    (records,) = load_ft(tmp_path).values()
    a = audit_ft("ft", records)
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
    (records,) = load_ft(tmp_path).values()
    assert not audit_ft("ft", records).ok


def test_a_lost_log_is_named_not_guessed(tmp_path: pathlib.Path) -> None:
    _run(tmp_path, 2)
    next(iter(sorted(tmp_path.glob("ft/*-r1-*.ftaudit")))).unlink()
    (records,) = load_ft(tmp_path).values()
    a = audit_ft("ft", records)
    assert not a.ok and a.incomplete


def test_the_command_audits_the_logs(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path, 3)
    assert cli(["audit", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "job 'ft' (fault-tolerant)" in out and "OK: every sample once per epoch" in out
