"""`croupier provenance` of a fault-tolerant job, by the path of every job: a committed step's samples per group, a sample's steps, the runs."""

from __future__ import annotations

import io
import json
import pathlib

import numpy as np

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


def test_a_committed_steps_samples_per_group_and_a_samples_steps(server: Server, tmp_path: pathlib.Path) -> None:
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
        doc = _ask(server.address, step=t)
        v = doc["kept"]  # type: ignore[index]
        assert doc["abandoned"] == [] and v["kept"] and v["step"] == t and v["incarnation"] == "fresh"  # type: ignore[index]
        assert v["world"] == len(members[t - 1]) and v["span"] == [8 * (t - 1), 8 * t] and v["generation"] == 1
        # one batch per participating group, in the quorum's participant order, each that group's samples
        assert [b["rank"] for b in v["batches"]] == list(range(len(members[t - 1])))
        assert [b["indices"] for b in v["batches"]] == [trained[t - 1][g] for g in members[t - 1]]
    every = [i for d in trained for g in d.values() for i in g]
    first = every[0]
    occ = _ask(server.address, index=first)
    assert occ == [{"epoch": 0, "step": 1, "rank": 0, "generation": 1, "micro": 0, "kept": True, "source": 0,
                    "source_epoch": 0}]
    summary = _ask(server.address)
    assert summary["last_step"] == 3 and summary["global_batch"] == 8  # type: ignore[index]
    (run,) = summary["timeline"]  # type: ignore[index]
    assert (run["incarnation"], run["from_step"], run["to_step"], run["kept_to"]) == ("fresh", 0, 3, 3)
    out = io.StringIO()
    assert main(server.address, "ft", step=2, out=out) == 0
    assert "generation 1 (fresh), world 2, epoch 0, quorum" in out.getvalue() and ": kept;" in out.getvalue()
    # the kept steps as an order file: the same path as a generation job's, one global batch a step
    assert main(server.address, "ft", export_to=str(tmp_path / "order.npy"), out=io.StringIO()) == 0
    assert np.load(tmp_path / "order.npy").tolist() == [i for t in range(3) for g in members[t] for i in trained[t][g]]


def test_a_step_past_the_record_and_a_bad_step_are_refused(server: Server, capsys: object) -> None:
    sim = FtSim()
    (lo,) = [StepLoader(m, N, global_batch=8, job="ft", address=server.address, group_rank=0, group_world=1)
             for m in sim.add_group(0, 1)]
    _train(sim, {0: [lo]}, (0,), {0: True})
    lo.flush()
    assert main(server.address, "ft", step=2, out=io.StringIO()) == 1
    assert main(server.address, "ft", step=0, out=io.StringIO()) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "step 2 is past the run: job 'ft' has trained 1 steps" in err
    assert "steps count from 1, as the trainers log them; got 0" in err
