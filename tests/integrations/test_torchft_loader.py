"""croupier.integrations.torchft.StepLoader against a stand-in of torchft's quorum and commit calls (tests/_ft_sim.py)."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest

from croupier.client._rpc import CoordinatorClient
from croupier.core import errors as E
from croupier.core.order import order
from croupier.integrations.torchft import StepLoader
from croupier.server._service import Server
from tests._ft_sim import FtSim
from tests._reverse_kind import reverse_registered

N, RANKS = 50, 2


def _group(sim: FtSim, g: int, address: str | None, **kw: object) -> list[StepLoader]:
    return [StepLoader(m, N, job="ft", address=address, group_rank=r, group_world=RANKS, **kw)  # type: ignore[arg-type]
            for r, m in enumerate(sim.add_group(g, RANKS))]


def _attempt(sim: FtSim, loaders: dict[int, list[StepLoader]], members: tuple[int, ...],
             commits: dict[int, bool]) -> dict[int, list[int]]:
    """One attempt: the quorum, every member rank's batch, the commits. Returns the batches per group."""
    sim.open(members, commits)
    got: dict[int, list[int]] = {}
    for g in members:
        got[g] = []
        for loader in loaders[g]:
            got[g] += next(loader).tolist()
    for g in members:
        for loader in loaders[g]:
            loader._manager.should_commit()
    return got


def _run(seed: int, address: str | None, steps: int = 40, mode: str = "global",
         dealing: str = "static") -> tuple[FtSim, list[list[int]], dict[int, list[StepLoader]]]:
    """Random quorums (groups leave, join, heal), aborts on some or all groups. Returns the samples of each
    committed step, in step order."""
    rnd = random.Random(seed)
    sim = FtSim()
    kw: dict[str, object] = {"global_batch": 12} if mode == "global" else {"group_batch": 4}
    kw["dealing"] = dealing
    loaders = {g: _group(sim, g, address, **kw) for g in (0, 1, 2)}
    sim.every = [lo for group in loaders.values() for lo in group]  # type: ignore[attr-defined]
    trained: dict[int, list[int]] = {}
    next_group = 3
    while len(trained) < steps:
        if rnd.random() < 0.15 and len(loaders) > 1:  # a group dies (kill -9: its loaders are gone)
            gone = rnd.choice(sorted(loaders))
            del loaders[gone]
            sim.remove_group(gone)
        if rnd.random() < 0.15:  # a group (re)joins, fresh: it heals at its first quorum
            loaders[next_group] = _group(sim, next_group, address, **kw)
            sim.every += loaders[next_group]  # type: ignore[attr-defined]
            next_group += 1
        members = tuple(rnd.sample(sorted(loaders), rnd.randint(1, len(loaders))))
        top = max(sim.managers[g][0].current_step() for g in loaders)
        if all(sim.managers[g][0].current_step() < top for g in members):  # a quorum has a group at the top step
            members += (next(g for g in sorted(loaders) if sim.managers[g][0].current_step() == top),)
        kind = rnd.random()
        commits = {g: (kind > 0.2) and (kind > 0.35 or g != members[0]) for g in members}
        got = _attempt(sim, loaders, members, commits)
        step = sim.attempts[-1].step
        if any(commits.values()):
            # a step committed again: the groups that had committed it (alone) died with their update
            assert all(g not in loaders for a in sim.attempts[:-1] if a.step >= step and any(a.commits.values())
                       for g, ok in a.commits.items() if ok), f"step {step} committed twice by live groups"
            trained = {s: v for s, v in trained.items() if s < step}
            trained[step] = [i for g in members for i in got[g]]
    return sim, [trained[s] for s in sorted(trained)], loaders


@pytest.mark.parametrize("seed", range(6))
def test_every_sample_is_trained_once_per_epoch_in_committed_steps(seed: int) -> None:
    _, steps, _ = _run(seed, None)
    assert [len(s) for s in steps] == [12] * len(steps)  # the global batch, whatever the quorum
    stream = [i for s in steps for i in s]
    for e in range(len(stream) // N):
        assert sorted(stream[e * N:(e + 1) * N]) == list(range(N)), f"epoch {e}"
    assert len(set(stream[len(stream) // N * N:])) == len(stream) % N  # the epoch in progress: no repeat


def test_group_mode_keeps_each_groups_batch_and_is_exact() -> None:
    sim, steps, _ = _run(7, None, mode="group")
    committed = [a for a in sim.attempts if any(a.commits.values())]
    assert [len(s) for s in steps] == [4 * len(a.members) for a in committed]
    stream = [i for s in steps for i in s]
    for e in range(len(stream) // N):
        assert sorted(stream[e * N:(e + 1) * N]) == list(range(N))


def test_an_aborted_step_is_dealt_again_to_the_next_quorum() -> None:
    sim = FtSim()
    loaders = {g: _group(sim, g, None, global_batch=12) for g in (0, 1, 2)}
    first = _attempt(sim, loaders, (0, 1, 2), {0: False, 1: False, 2: False})
    again = _attempt(sim, loaders, (2, 0), {0: True, 2: True})
    assert sorted(i for v in first.values() for i in v) == sorted(i for v in again.values() for i in v)
    assert len(again[2]) == len(again[0]) == 6 and sim.attempts[-1].step == 0
    nxt = _attempt(sim, loaders, (0, 1, 2), {0: True, 1: True, 2: True})  # group 1 heals to step 1
    assert sim.attempts[-1].step == 1 and set(i for v in nxt.values() for i in v).isdisjoint(again[0] + again[2])


def test_the_loader_starts_the_steps_quorum_once_whoever_asks_first() -> None:
    sim = FtSim()
    (loader,) = [StepLoader(m, N, job="ft", address=None, group_rank=0, group_world=1, global_batch=4)
                 for m in sim.add_group(0, 1)]
    m = loader._manager
    sim.open((0,), {0: True})
    m.start_quorum()  # the trainer's zero_grad first
    next(loader)
    m.start_quorum()  # ... or again after the deal: the same step's quorum is not started again
    assert m.quorums_started == 1
    m.should_commit()
    next(loader)  # the next step: the loader starts its quorum
    assert m.quorums_started == 2


def test_committed_steps_are_recorded_once_per_step_with_their_quorum(server: Server, client: CoordinatorClient) -> None:
    sim, steps, loaders = _run(3, server.address, steps=25)
    for loader in sim.every:  # type: ignore[attr-defined]
        loader.flush()  # a group killed before its thread sent its reports would leave its steps to the others' reports
    spec, record = client.steps("ft")
    assert spec.n == N and [r.run for r in record.runs] == ["fresh"]
    committed = {a.step: a for a in sim.attempts if any(a.commits.values())}
    for step, samples in enumerate(steps):
        kept = record.kept(step + 1)  # steps count from 1: the one after `step` committed
        assert kept is not None, f"step {step} was not recorded"
        _, c = kept
        assert (c.start, c.stop, c.quorum, c.participants) == (step * 12, step * 12 + 12, committed[step].quorum,
                                                               len(committed[step].members))
        positions = np.arange(c.start, c.stop)
        assert sorted(samples) == sorted(loaders[next(iter(loaders))][0]._indices(int(positions[0]),
                                                                                  int(positions[-1]) + 1).tolist())
    reporters = [lo for group in loaders.values() for lo in group if lo.group_rank == 0]
    assert all(lo._client is not None for lo in reporters)
    assert all(lo._client is None for group in loaders.values() for lo in group if lo.group_rank != 0)


def test_a_restart_from_a_checkpoint_opens_a_run_and_abandons_the_steps_after_it(server: Server,
                                                                                 client: CoordinatorClient) -> None:
    sim = FtSim()
    loaders = {g: _group(sim, g, server.address, global_batch=12) for g in (0, 1)}
    for _ in range(3):
        _attempt(sim, loaders, (0, 1), {0: True, 1: True})
    saved = (loaders[0][0].state_dict(), loaders[0][0]._manager.state_dict())
    for _ in range(2):
        _attempt(sim, loaders, (0, 1), {0: True, 1: True})
    for group in loaders.values():
        for lo in group:
            lo.close()
    sim2 = FtSim()  # the whole job again, on one group, from the checkpoint of step 3
    again = {5: _group(sim2, 5, server.address, global_batch=12)}
    for lo in again[5]:
        lo._manager.load_state_dict(saved[1])
        lo.load_state_dict(saved[0])
    got = _attempt(sim2, again, (5,), {5: True})
    for lo in again[5]:
        lo.flush()
    assert again[5][0].run == "fresh>3"
    _, record = client.steps("ft")
    kept = record.kept(4)  # the step after the checkpoint of step 3
    assert kept is not None and kept[0].run == "fresh>3" and kept[1].participants == 1
    assert [r.run for r, _ in record.abandoned(4)] == ["fresh"] and record.kept(5) is None
    assert record.kept(3) is not None and record.kept(3)[0].run == "fresh"  # type: ignore[index]
    assert sorted(got[5]) == sorted(again[5][0]._indices(36, 48).tolist())


def test_a_healing_group_takes_the_run_it_heals_into() -> None:
    sim = FtSim()
    loaders = {0: _group(sim, 0, None, global_batch=4)}
    for lo in loaders[0]:
        lo.run = "r1"
    _attempt(sim, loaders, (0,), {0: True})
    loaders[1] = _group(sim, 1, None, global_batch=4)
    _attempt(sim, loaders, (0, 1), {0: True, 1: True})
    assert [lo.run for lo in loaders[1]] == ["r1", "r1"] and loaders[1][0].step == 1


def test_bad_arguments_and_states_are_refused_naming_them() -> None:
    sim = FtSim()
    (m,) = sim.add_group(0, 1)
    with pytest.raises(ValueError, match="exactly one of global_batch and group_batch"):
        StepLoader(m, N, address=None, group_rank=0, group_world=1)
    with pytest.raises(ValueError, match="global_batch"):
        StepLoader(m, N, global_batch=0, address=None, group_rank=0, group_world=1)
    with pytest.raises(ValueError, match="group_rank"):
        StepLoader(m, N, global_batch=4, address=None, group_rank=2, group_world=2)
    lo = StepLoader(m, N, global_batch=4, address=None, group_rank=0, group_world=1)
    state = lo.state_dict()
    with pytest.raises(ValueError, match="the state's batch is 4, this loader's 8"):
        StepLoader(m, N, global_batch=8, address=None, group_rank=0, group_world=1).load_state_dict(state)
    lo.load_state_dict({**state, "step": 5})
    sim.open((0,), {0: True})
    with pytest.raises(RuntimeError, match="state is of step 5 but the manager is at step 0"):
        next(lo)


def test_the_coordinator_refuses_a_report_that_contradicts_the_record(client: CoordinatorClient) -> None:
    from croupier.core.ftsteps import CommittedStep
    from croupier.core.spec import Spec

    spec = Spec(n=N, seed=0, permutation="feistel", batch_size=12)
    assert client.commit_step("j", spec, "r", "", 0, "global", 12, CommittedStep(1, 0, 12, 1, 2))
    assert not client.commit_step("j", spec, "r", "", 0, "global", 12, CommittedStep(1, 0, 12, 1, 2))
    with pytest.raises(E.FailedPrecondition,
                       match=r"step 1 of run 'r' was recorded as stream \[0, 12\) of quorum 1 with 2 participants"):
        client.commit_step("j", spec, "r", "", 0, "global", 12, CommittedStep(1, 0, 12, 1, 3))
    with pytest.raises(E.FailedPrecondition, match="starts at 12, not 0"):
        client.commit_step("j", spec, "r", "", 0, "global", 12, CommittedStep(2, 0, 12, 1, 2))
    with pytest.raises(E.FailedPrecondition, match="different spec"):
        client.commit_step("j", Spec(n=N + 1, seed=0, permutation="feistel", batch_size=12), "r", "", 0, "global", 12,
                           CommittedStep(2, 12, 24, 1, 2))
    with pytest.raises(E.InvalidArgument, match="mode must be one of"):
        client.commit_step("j", spec, "r", "", 0, "both", 12, CommittedStep(2, 12, 24, 1, 2))
    _, record = client.steps("j")
    assert [c.to_list() for c in record.runs[0].steps] == [[0, 0, 12, 1, 2]]  # refused reports changed nothing


def test_counts_of_a_run() -> None:
    sim, steps, _ = _run(11, None, steps=30)
    counts = collections.Counter(len(a.members) for a in sim.attempts)
    assert sum(counts.values()) >= 30 and len(steps) == 30


def test_a_step_committed_again_by_a_later_quorum_supersedes_the_lost_updates(client: CoordinatorClient) -> None:
    from croupier.core.ftsteps import CommittedStep
    from croupier.core.spec import Spec

    spec = Spec(n=N, seed=0, permutation="feistel", batch_size=12)
    for c in (CommittedStep(1, 0, 12, 1, 2), CommittedStep(2, 12, 24, 1, 2), CommittedStep(3, 24, 36, 2, 1)):
        assert client.commit_step("j", spec, "r", "", 0, "global", 12, c)
    # the group alone at steps 1-2 died; the survivor, behind at step 1, trains it again in quorum 3
    assert client.commit_step("j", spec, "r", "", 0, "global", 12, CommittedStep(2, 12, 24, 3, 1))
    assert not client.commit_step("j", spec, "r", "", 0, "global", 12, CommittedStep(3, 24, 36, 2, 1))  # stale
    _, record = client.steps("j")
    assert [c.to_list() for c in record.runs[0].steps] == [[0, 0, 12, 1, 2], [1, 12, 24, 3, 1]]
    assert record.kept(3) is None
    assert [c.to_list() for _, c in record.abandoned(2)] == [[1, 12, 24, 1, 2]]


def test_the_plain_sampler_is_refused_under_torchft(monkeypatch: pytest.MonkeyPatch) -> None:
    from croupier.client import DistributedSampler

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    with pytest.raises(RuntimeError, match=r"TORCHFT_LIGHTHOUSE is set \('http://lighthouse:29510'\).*StepLoader"):
        DistributedSampler(N, num_replicas=2, rank=0, address="127.0.0.1:1")


def test_a_fault_tolerant_job_and_a_job_of_generations_do_not_share_a_name(server: Server,
                                                                           client: CoordinatorClient) -> None:
    from croupier.client import DistributedSampler
    from croupier.core.ftsteps import CommittedStep
    from croupier.core.spec import Spec

    spec = Spec(n=N, seed=0, permutation="feistel", batch_size=12)
    client.commit_step("ft-job", spec, "r", "", 0, "global", 12, CommittedStep(1, 0, 12, 1, 1))
    sampler = DistributedSampler(N, num_replicas=1, rank=0, address=server.address, job="ft-job")
    with pytest.raises(E.FailedPrecondition, match="'ft-job' is a fault-tolerant job"):
        next(iter(sampler))
    sampler.close()
    other = DistributedSampler(N, num_replicas=1, rank=0, address=server.address, job="gen-job")
    next(iter(other))
    with pytest.raises(E.FailedPrecondition, match="'gen-job' is dealt to ranks by generations"):
        client.commit_step("gen-job", other.spec, "r", "", 0, "global", 12, CommittedStep(1, 0, 12, 1, 1))
    other.close()


def _from_the_back(n: int, batch: int) -> list[int]:
    """The toy kind's batches of an epoch of `n` (tests/_reverse_kind.py) as its stepped variant takes them: every
    batch but the last from the back, then the last."""
    batches = [list(range(a, min(a + batch, n))) for a in range(0, n, batch)]
    return [p for b in batches[-2::-1] + batches[-1:] for p in b]


def test_a_toy_kinds_stepped_variant_goes_through_loader_record_and_history(server: Server,
                                                                          client: CoordinatorClient) -> None:
    """A way of dealing defined in a test, with a stepped variant (tests/_reverse_kind.py), is a StepLoader's dealing
    while it is registered: its steps train each epoch's batches from the back, the coordinator records them and
    the job's history names the samples the groups were dealt, with nothing of it outside its module and entry."""
    with reverse_registered():
        sim, steps, loaders = _run(5, server.address, steps=12, dealing="reverse")
        for loader in sim.every:  # type: ignore[attr-defined]
            loader.flush()
        spec = next(iter(loaders.values()))[0].spec
        places = _from_the_back(N, 12)
        for s, samples in enumerate(steps):
            want = [int(order(spec, p // N, np.array([places[p % N]]))[0]) for p in range(s * 12, s * 12 + 12)]
            assert sorted(samples) == sorted(want), f"step {s + 1}: dealt {samples}, its batches from the back {want}"
        history, _ = client.history("ft")
        assert history.spec.dealing == "reverse" and history.last_step == len(steps)
        for t, samples in enumerate(steps, 1):
            kept = history.step(t).kept
            assert kept is not None and sorted(kept.indices.tolist()) == sorted(samples), f"step {t}"
            i = samples[t % len(samples)]
            assert any(o.step == t and o.kept for o in history.index(i)), f"index {i} not found at step {t}"
    with pytest.raises(ValueError, match="reverse"):  # gone with its block
        StepLoader(FtSim().add_group(0, 1)[0], N, job="ft", address=None, global_batch=12, dealing="reverse")
