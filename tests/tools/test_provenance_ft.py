"""`croupier provenance` of a fault-tolerant job: a committed step's samples per group, a sample's steps, the runs."""

from __future__ import annotations

import io
import json

from croupier.integrations.torchft import StepLoader
from croupier.server._service import Server
from croupier.tools.provenance import main
from tests._ft_sim import FtSim

N = 30


def _train(sim: FtSim, loaders: dict[int, list[StepLoader]], members: tuple[int, ...],
           commits: dict[int, bool]) -> dict[int, list[int]]:
    sim.open(members, commits)
    got = {g: [i for lo in loaders[g] for i in next(lo).tolist()] for g in members}
    for g in members:
        for lo in loaders[g]:
            lo._manager.should_commit()
    return got


def _ask(address: str, **kw: object) -> object:
    out = io.StringIO()
    assert main(address, "ft", as_json=True, out=out, **kw) == 0  # type: ignore[arg-type]
    return json.loads(out.getvalue())


def test_a_committed_steps_samples_per_group_and_a_samples_steps(server: Server) -> None:
    sim = FtSim()
    loaders = {g: [StepLoader(m, N, global_batch=8, job="ft", address=server.address, group_rank=r, group_world=2)
                   for r, m in enumerate(sim.add_group(g, 2))] for g in (0, 1, 2)}
    trained = []
    trained.append(_train(sim, loaders, (0, 1, 2), {0: True, 1: True, 2: True}))
    _train(sim, loaders, (2, 0, 1), {0: False, 1: False, 2: False})  # aborted: dealt again below
    trained.append(_train(sim, loaders, (2, 0), {0: True, 2: True}))
    trained.append(_train(sim, loaders, (1, 0, 2), {0: True, 1: False, 2: True}))  # group 1 aborts alone
    for group in loaders.values():
        for lo in group:
            lo.flush()
    members = [(0, 1, 2), (2, 0), (1, 0, 2)]
    for t in (1, 2, 3):
        (v,) = _ask(server.address, step=t)  # type: ignore[misc]
        assert v["kept"] and v["step"] == t and v["run"] == "fresh"
        assert v["groups"] == [trained[t - 1][g] for g in members[t - 1]]  # participant order, each group's samples
    every = [i for d in trained for g in d.values() for i in g]
    first = every[0]
    occ = _ask(server.address, index=first)
    assert occ == [{"epoch": 0, "step": 1, "run": "fresh", "quorum": 1, "group": 0, "position": 0}]
    summary = _ask(server.address)
    assert summary["last_step"] == 3 and summary["runs"][0]["steps"] == 3  # type: ignore[index]


def test_a_step_past_the_record_and_a_bad_step_are_refused(server: Server, capsys: object) -> None:
    sim = FtSim()
    (lo,) = [StepLoader(m, N, global_batch=8, job="ft", address=server.address, group_rank=0, group_world=1)
             for m in sim.add_group(0, 1)]
    _train(sim, {0: [lo]}, (0,), {0: True})
    lo.flush()
    assert main(server.address, "ft", step=2, out=io.StringIO()) == 1
    assert main(server.address, "ft", step=0, out=io.StringIO()) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "no run of the job recorded committed step 2 (its timeline reaches step 1)" in err
    assert "steps count from 1 (got step 0)" in err
