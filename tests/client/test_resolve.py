"""client/_resolve.py: the derived job name of samplers of one spec in one process, against a real coordinator."""

from __future__ import annotations

import pytest

from croupier.client import DistributedSampler
from croupier.client._rpc import CoordinatorClient
from croupier.server import Server

N = 40


@pytest.fixture(autouse=True)
def _no_named_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("CROUPIER_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE", "RANK", "CROUPIER_ADDRESS"):
        monkeypatch.delenv(k, raising=False)


def test_a_sampler_rebuilt_every_epoch_stays_one_job(server: Server, client: CoordinatorClient) -> None:
    """A loop that makes its sampler anew each epoch (as many scripts do) goes on with one job, and each
    epoch is the one a single sampler would have dealt."""
    ref = DistributedSampler(N, seed=101, address=server.address, job="one-sampler")
    expected = [list(ref) for _ in range(3)]
    ref.close()
    jobs, got = [], []
    for epoch in range(3):
        s = DistributedSampler(N, seed=101, address=server.address)
        s.set_epoch(epoch)
        got.append(list(s))
        jobs.append(s.job)
    assert jobs == [jobs[0]] * 3, jobs
    assert got == expected
    assert sorted(client.jobs()) == sorted({"one-sampler", jobs[0]})  # no job left behind per epoch
    assert client.status(jobs[0]).result.generation == 3  # each new sampler joined as the next generation
    s.close()


def test_samplers_in_use_together_keep_jobs_of_their_own(server: Server) -> None:
    """Made before either is iterated, or while the other is in the middle of its epoch: two jobs."""
    val = DistributedSampler(N, seed=102, shuffle=False, address=server.address)
    test = DistributedSampler(N, seed=102, shuffle=False, address=server.address)
    assert test.job == f"{val.job}.2"
    it = iter(val)
    next(it)  # val is in the middle of its epoch
    third = DistributedSampler(N, seed=102, shuffle=False, address=server.address)
    assert third.job == f"{val.job}.3"
    for _ in range(2):  # interleaved, as a trainer validates inside an epoch
        assert list(test) == list(range(N))
    assert sorted([0, *it]) == list(range(N))
    for s in (val, test, third):
        s.close()


def test_a_closed_sampler_frees_its_name() -> None:
    first = DistributedSampler(N, seed=103)
    first.close()
    again = DistributedSampler(N, seed=103)
    assert again.job == first.job
    again.close()


def test_a_sampler_whose_job_a_later_one_took_over_is_refused(server: Server) -> None:
    """Made after the earlier one finished its epoch, the later one goes on with its job; the earlier one,
    iterated again, would be a zombie of that job: refused with the reason and the way out."""
    early = DistributedSampler(N, seed=104, address=server.address)
    assert sorted(early) == list(range(N))
    late = DistributedSampler(N, seed=104, address=server.address)
    assert late.job == early.job
    assert sorted(late) == list(range(N))
    with pytest.raises(RuntimeError, match=rf"job '{early.job}' was taken over .* pass job= to each"):
        list(early)
    assert sorted(late) == list(range(N))  # the later one goes on
    late.close()
    early.close()


def test_samplers_given_one_incarnation_keep_names_of_their_own(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the incarnation fixed (CROUPIER_INCARNATION, or incarnation=), a rebuilt sampler would join its
    predecessor's job as the same incarnation, which the coordinator refuses: each takes a name of its
    own, and every epoch trains."""
    monkeypatch.setenv("CROUPIER_INCARNATION", "fixed-incarnation")
    jobs = []
    for epoch in range(3):
        s = DistributedSampler(N, seed=104, shuffle=False, address=server.address)
        s.set_epoch(epoch)
        assert list(s) == list(range(N))
        jobs.append(s.job)
    assert jobs == [jobs[0], f"{jobs[0]}.2", f"{jobs[0]}.3"]
    s.close()


@pytest.mark.parametrize("collect", [False, True], ids=["kept", "collected"])
def test_the_names_do_not_depend_on_the_garbage_collector(server: Server, collect: bool) -> None:
    """Samplers rebuilt each epoch and left mid-epoch (a loop that stops after its steps): whether the
    collector ran in between or not, each rank of the job derives the same names (the earlier samplers
    still hold theirs: they never finished their epoch)."""
    import gc

    jobs = []
    kept = []
    gc.disable()
    try:
        for _ in range(3):
            s = DistributedSampler(N, seed=105 + collect, address=server.address)
            next(iter(s))
            jobs.append(s.job)
            if collect:
                del s
                gc.collect()
            else:
                kept.append(s)
    finally:
        gc.enable()
    assert jobs == [jobs[0], f"{jobs[0]}.2", f"{jobs[0]}.3"]
