"""`Loader` counts the batches that reach the loop: a plain DataLoader's checkpoint is exact with any workers and world."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _packing_data import CONTEXT
from _ranks import on_ranks
from torch.utils.data import BatchSampler, DataLoader

from croupier.client import DistributedBatchSampler, DistributedSampler, Loader
from croupier.tools.audit import audit as audit_logs
from croupier.tools.audit import verdict

N, BS = 120, 4


@pytest.fixture(scope="module")
def address(module_address: str) -> str:
    """One in-process coordinator for the module's runs (each run is a job of its own: tests/conftest.py)."""
    return module_address


def run_world(address: str, job: str, world: int, workers: int, steps: int | None,
              state: dict[str, Any] | None) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Every rank of a world (threads) loads `state`, trains `steps` batches of a plain DataLoader with
    `workers` workers (None: to the end of the epoch) through ``Loader``, and checkpoints; each rank's
    indices trained and its state."""
    incarnation = uuid.uuid4().hex

    def rank(r: int) -> tuple[list[int], dict[str, Any]]:
        s = DistributedSampler(N, num_replicas=world, rank=r, address=address, job=job, seed=5, tail="uneven",
                               incarnation=incarnation)
        ctx = {"multiprocessing_context": CONTEXT} if workers else {}
        loader = Loader(DataLoader(list(range(N)), batch_size=BS, sampler=s, num_workers=workers, **ctx))
        if state is not None:
            loader.load_state_dict(state)
        trained: list[int] = []
        try:
            for batch in loader:  # a batch taken is a batch trained
                trained += batch.tolist()
                if steps is not None and len(trained) >= steps * BS:
                    break
            return trained, loader.state_dict()
        finally:
            loader.close()
            s.close()

    out = on_ranks(world, rank)
    return [t for t, _ in out], [st for _, st in out]


def audit(trained: list[list[int]]) -> Counter[str]:
    """What went wrong with the indices the loops trained over one epoch: 'missing' and 'repeated' ones
    against every index once; empty when exact."""
    seen = Counter(i for t in trained for i in t)
    bad: Counter[str] = Counter()
    bad["missing"] = sum(1 for i in range(N) if not seen[i])
    bad["repeated"] = sum(c - 1 for c in seen.values() if c > 1)
    return +bad


def _resumes(address: str, cases: list[tuple[int, int]]) -> None:
    """World 2 with 4 workers to a cut, then each case ``(world, workers)`` resumed from that checkpoint to
    the epoch's end; and one case cut again and finished by the next from its own checkpoint."""
    job = uuid.uuid4().hex
    first, states = run_world(address, job, 2, 4, 5, None)
    assert states[0] == states[1], "ranks in lockstep save the same state"
    assert states[0]["epoch"] == 0 and sum(map(len, first)) == 2 * 5 * BS
    for world, workers in cases:
        rest, ends = run_world(address, job, world, workers, None, states[0])
        assert not audit(first + rest), (world, workers, audit(first + rest))
        assert all(e["epoch"] == 1 for e in ends), "a pass run to its end saves the next epoch's start"
    # a checkpoint of a resumed epoch, on another world and worker count: counted from the epoch's start
    (w1, k1), (w2, k2) = cases[-1], cases[0]
    middle, again = run_world(address, job, w1, k1, 3, states[0])
    rest, _ = run_world(address, job, w2, k2, None, again[0])
    assert not audit(first + middle + rest), audit(first + middle + rest)


def test_a_plain_data_loader_resumes_exactly_on_other_worlds_and_worker_counts(address: str) -> None:
    _resumes(address, [(1, 0), (3, 2), (1, 8)])


@pytest.mark.slow
def test_a_plain_data_loader_resumes_exactly_more(address: str) -> None:
    _resumes(address, [(3, 8), (2, 0), (3, 0), (1, 2), (2, 8)])


def test_the_samplers_own_count_loses_what_the_workers_read_ahead(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run saving what the sampler handed out (its own state, no count): the batches the four
    workers had read ahead (prefetch_factor 2: 8 per rank) are counted as trained and never are."""
    monkeypatch.setattr(Loader, "state_dict", lambda self, step=None: self.sampler.state_dict(step=step))
    job = uuid.uuid4().hex
    first, states = run_world(address, job, 2, 4, 5, None)
    rest, _ = run_world(address, job, 1, 0, None, states[0])
    assert audit(first + rest) == Counter(missing=2 * 8 * BS), audit(first + rest)


def _one(address: str, n: int = N, **kw: Any) -> DistributedSampler:
    return DistributedSampler(n, num_replicas=1, rank=0, address=address, job=uuid.uuid4().hex, tail="uneven", **kw)


def test_the_count_is_what_the_old_consumed_arithmetic_gave(address: str) -> None:
    """``sampler.state_dict(consumed=steps * batch_size)`` still works, and names the same state."""
    s = _one(address)
    loader = Loader(DataLoader(list(range(N)), batch_size=BS, sampler=s, num_workers=2, multiprocessing_context=CONTEXT))
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert s.items_done > 3 * BS and loader.items_trained == 3 * BS  # the workers read ahead of the loop
    assert loader.state_dict(step=3) == s.state_dict(consumed=3 * BS, step=3)
    loader.close()
    s.close()


def test_the_last_short_batch_and_a_loop_that_stops_and_goes_on(address: str) -> None:
    """10 indices in batches of 4: the last batch holds 2, and the count ends at 10. A loop that stops and
    iterates again goes on with the same pass: the batches the workers read ahead are not lost."""
    s = _one(address, 10)
    loader = Loader(DataLoader(list(range(10)), batch_size=BS, sampler=s, num_workers=2, multiprocessing_context=CONTEXT))
    trained = next(iter(loader)).tolist()
    assert loader.items_trained == 4
    states, counts = [], []
    for batch in loader:
        trained += batch.tolist()
        counts.append(loader.items_trained)
        states.append(loader.state_dict())  # the last one once the short batch was taken, before the pass ends
    assert sorted(trained) == list(range(10)) and counts == [8, 10] and loader.items_trained == 10
    assert states[0]["remaining"] == [[8, 10]] and states[-1]["epoch"] == 1, states
    assert loader.state_dict()["epoch"] == 1
    assert sorted(i for b in loader for i in b.tolist()) == list(range(10))  # the next epoch: a new pass
    s.close()


@pytest.mark.parametrize("dealing", ["static", "dynamic"])
def test_a_batch_sampler_in_a_stateful_data_loader_resumes_exactly(address: str, dealing: str, tmp_path: Path) -> None:
    """``batch_sampler=DistributedBatchSampler`` (one item per batch), torchdata's StatefulDataLoader with two
    workers (its own state unused), static and dynamic dealing; ``croupier audit`` of the samplers' logs,
    cut at the checkpoint's count, agrees."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    job = uuid.uuid4().hex

    def loader(incarnation: str, workers: int) -> Loader:
        s = DistributedBatchSampler(N, BS, num_replicas=1, rank=0, address=address, job=job, tail="uneven",
                                    incarnation=incarnation, dealing=dealing, audit_dir=str(tmp_path))
        if workers:
            return Loader(StatefulDataLoader(list(range(N)), batch_sampler=s, num_workers=workers,
                                             multiprocessing_context=CONTEXT))
        return Loader(DataLoader(list(range(N)), batch_sampler=s))

    a = loader("a", 2)
    assert a.items_per_batch == 1
    trained: list[int] = []
    for k, b in enumerate(a):
        trained += b.tolist()
        if k == 4:
            break
    state = a.state_dict()
    a.close()
    a.sampler.close()
    b = loader("b", 0)
    b.load_state_dict(state)
    trained += [i for x in b for i in x.tolist()]
    b.sampler.close()
    assert sorted(trained) == list(range(N))
    reports = audit_logs(tmp_path)
    assert verdict(reports)[0] and [(r.epoch, r.trained, r.duplicates, r.missing) for r in reports] == [(0, N, 0, 0)]


def test_what_a_loader_is_given(address: str) -> None:
    s = _one(address, 12)
    assert Loader(DataLoader(list(range(12)), batch_size=3, sampler=s)).items_per_batch == 3
    assert Loader(DataLoader(list(range(12)), batch_size=None, sampler=s)).items_per_batch == 1
    assert Loader(DataLoader(list(range(12)), batch_sampler=BatchSampler(s, 5, False))).items_per_batch == 5
    with pytest.raises(TypeError, match=r"this DataLoader's sampler is a SequentialSampler and its batch sampler a "
                                        r"BatchSampler"):
        Loader(DataLoader(list(range(12)), batch_size=3))
    with pytest.raises(TypeError, match=r"this list's sampler is a NoneType"):
        Loader([1, 2, 3])
    loader = Loader(DataLoader(list(range(12)), batch_size=3, sampler=s))
    next(iter(loader))
    before = s.state_dict()
    with pytest.raises(RuntimeError, match=r"load_state_dict must come before the loader's first batch"):
        loader.load_state_dict({})
    assert s.state_dict() == before
    loader.close()
    s.close()


def test_set_epoch_before_the_pass_ended_cuts_the_epoch(address: str, caplog: pytest.LogCaptureFixture) -> None:
    """A loop that moves on after 2 batches: the next iteration is a new pass of epoch 1, whole, and the state
    is epoch 1's, not a count of epoch 0's batches."""
    s = _one(address, 40)
    loader = Loader(DataLoader(list(range(40)), batch_size=BS, sampler=s, num_workers=2, multiprocessing_context=CONTEXT))
    it = iter(loader)
    next(it), next(it)
    s.set_epoch(1)
    assert loader.state_dict()["epoch"] == 1 and loader.items_trained == 0
    with caplog.at_level("WARNING", logger="croupier"):
        epoch1 = [i for b in loader for i in b.tolist()]
    assert "epoch 0 was cut after 2 batches of the loop" in caplog.text
    assert sorted(epoch1) == list(range(40)) and loader.state_dict()["epoch"] == 2
    s.close()
