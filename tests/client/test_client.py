"""The client samplers against a real coordinator: drop-in equality, epochs, state, fencing, restarts."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from _ranks import on_ranks
from conftest import ServeProcess
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.server._service import Server


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_drop_in_for_torch(server: Server, shuffle: bool, drop_last: bool) -> None:
    n, world, job, tok = 53, 3, f"torch-{shuffle}-{drop_last}", uuid.uuid4().hex

    def rank(r: int) -> tuple[list[list[int]], list[int]]:
        s = DistributedSampler(n, world, r, shuffle=shuffle, seed=5, drop_last=drop_last, address=server.address,
                               job=job, incarnation=tok, permutation="torch" if shuffle else None)
        epochs, lens = [], []
        for e in range(3):
            s.set_epoch(e)  # the usual loop; also fine without it (see the next test)
            lens.append(len(s))
            epochs.append(list(s))
        s.close()
        return epochs, lens

    got = on_ranks(world, rank)
    for r in range(world):
        t = TorchSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=5, drop_last=drop_last)
        for e in range(3):
            t.set_epoch(e)
            assert got[r][0][e] == list(t), (r, e)
            assert got[r][1][e] == len(t)


def test_epochs_advance_without_set_epoch_in_one_process() -> None:
    s = DistributedSampler(100, job=f"auto-{uuid.uuid4().hex}")  # no address: the embedded coordinator
    e0, e1 = list(s), list(s)
    assert sorted(e0) == sorted(e1) == list(range(100))
    assert e0 != e1
    assert s.epoch == 2
    s.close()


def test_set_epoch_loop_from_a_later_epoch_and_contradictions(server: Server) -> None:
    job = f"epochs-{uuid.uuid4().hex}"
    s = DistributedSampler(40, address=server.address, job=job, incarnation="a", permutation="torch", seed=1)
    for epoch in range(5, 7):  # a fresh job started at epoch 5
        s.set_epoch(epoch)
        t = TorchSampler(range(40), num_replicas=1, rank=0, seed=1)
        t.set_epoch(epoch)
        assert list(s) == list(t)
    with pytest.raises(ValueError, match=r"set_epoch\(3\) contradicts the job's progress"):
        s.set_epoch(3)
    with pytest.raises(ValueError, match=r"set_epoch\(9\)"):
        s.set_epoch(9)
    state = s.state_dict()
    assert state["epoch"] == 7
    s.close()
    s2 = DistributedSampler(40, address=server.address, job=job, incarnation="b", permutation="torch", seed=1)
    s2.load_state_dict(state)
    with pytest.raises(ValueError, match="contradicts the checkpoint state"):
        s2.set_epoch(2)
    s2.set_epoch(7)
    assert len(list(s2)) == 40
    s2.close()
    # set_epoch before load_state_dict follows the same rule, and a refused load changes nothing.
    s3 = DistributedSampler(40, address=server.address, job=job, incarnation="c", permutation="torch", seed=1)
    s3.set_epoch(2)
    before = s3.state_dict()
    with pytest.raises(ValueError, match=r"set_epoch\(2\) was called before load_state_dict"):
        s3.load_state_dict(state)
    assert s3.state_dict() == before
    s3.close()


def test_state_from_another_job_or_spec_is_refused(server: Server) -> None:
    a = DistributedSampler(50, address=server.address, job="job-a", incarnation="x")
    state = a.state_dict()
    b = DistributedSampler(50, address=server.address, job="job-b", incarnation="x")
    with pytest.raises(ValueError, match="from job 'job-a', not from this job 'job-b'"):
        b.load_state_dict(state)
    c = DistributedSampler(50, address=server.address, job="job-a", incarnation="y", seed=99)
    with pytest.raises(ValueError) as e:
        c.load_state_dict(state)
    assert state["fingerprint"] in str(e.value) and "seed=99" in str(e.value)
    c.load_state_dict({})  # an empty dict is valid: from the start
    with pytest.raises(ValueError, match="missing keys"):
        c.load_state_dict({"epoch": 1})


def test_a_fenced_rank_gets_a_runtime_error(server: Server) -> None:
    job = f"fence-{uuid.uuid4().hex}"
    old = DistributedSampler(10_000, address=server.address, job=job, incarnation="g1", lease_ahead=16, prefetch=1)
    it = iter(old)
    next(it)
    new = DistributedSampler(10_000, address=server.address, job=job, incarnation="g2")
    next(iter(new))  # a new incarnation of the job's world: generation 2
    with pytest.raises(RuntimeError, match="fenced off"):
        for _ in it:
            pass
    old.close()
    new.close()


def test_dataset_argument_and_validation() -> None:
    with pytest.raises(TypeError, match="sized object or an int"):
        DistributedSampler(iter([1, 2]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        DistributedSampler(10, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="dataset size must be >= 0"):
        DistributedSampler(-1)
    assert len(DistributedSampler(list(range(7)), num_replicas=2, rank=1, shuffle=False)) == 4
    with pytest.raises(ValueError, match=r"lease_ahead must be in \[1, \d+\) \(got lease_ahead=100000\): one lease serves at most"):
        DistributedSampler(10, lease_ahead=100_000)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resume_is_exact(server: Server, workers: int) -> None:
    """Checkpoint mid-epoch under prefetching, train on, crash, resume: every index exactly once."""
    n, bs, job = 97, 4, f"sdl-{workers}-{uuid.uuid4().hex}"

    def loader(incarnation: str) -> tuple[DistributedSampler, StatefulDataLoader]:
        s = DistributedSampler(n, address=server.address, job=job, incarnation=incarnation, tail="uneven", lease_ahead=8)
        return s, StatefulDataLoader(list(range(n)), batch_size=bs, sampler=s, num_workers=workers)

    s1, l1 = loader("a")
    seen: list[int] = []
    it = iter(l1)
    for _ in range(7):
        seen += next(it).tolist()
    ckpt = l1.state_dict()
    for _ in range(5):  # trained after the checkpoint, then lost with the crash
        next(it)
    del it
    s1.close()
    s2, l2 = loader("b")
    l2.load_state_dict(ckpt)
    rest = [i for b in l2 for i in b.tolist()]
    assert sorted(seen + rest) == list(range(n))
    s2.close()


def test_plain_dataloader_with_workers_uses_consumed(server: Server) -> None:
    n, bs, job = 60, 5, f"plain-{uuid.uuid4().hex}"
    s = DistributedSampler(n, address=server.address, job=job, incarnation="a", tail="uneven")
    dl = DataLoader(list(range(n)), batch_size=bs, sampler=s, num_workers=2)
    seen: list[int] = []
    it = iter(dl)
    for _ in range(3):
        seen += next(it).tolist()
    state = s.state_dict(consumed=3 * bs)  # the loop took 3 batches; the loader read further ahead
    assert s.items_done > 3 * bs  # the loader read ahead of the loop
    del it
    s.close()
    s2 = DistributedSampler(n, address=server.address, job=job, incarnation="b", tail="uneven")
    s2.load_state_dict(state)
    rest = [i for b in DataLoader(list(range(n)), batch_size=bs, sampler=s2) for i in b.tolist()]
    assert sorted(seen + rest) == list(range(n))
    s2.close()


def test_batch_sampler_with_bucketing(server: Server) -> None:
    lengths = [(i * 37) % 101 for i in range(192)]
    job = f"bucket-{uuid.uuid4().hex}"

    def rank(r: int) -> list[list[int]]:
        s = DistributedBatchSampler(192, 4, 2, r, address=server.address, job=job, incarnation="t", lengths=lengths,
                                    buffer_size=48, pack_size=8, tail="uneven")
        dl = DataLoader(list(range(192)), batch_sampler=s)
        out = [b.tolist() for b in dl]
        assert len(out) == len(s)
        s.close()
        return out

    got = on_ranks(2, rank)
    flat = [i for r in got for b in r for i in b]
    assert sorted(flat) == list(range(192))
    # With W * batch_size == pack_size, one step's batches are one pack: lengths sorted within a
    # window of 48, so a batch spans a small range of lengths (a random batch spans ~75).
    spreads = [max(lengths[i] for i in b) - min(lengths[i] for i in b) for r in got for b in r]
    assert max(spreads) < 25


def test_trains_on_while_the_coordinator_is_down(tmp_path: pathlib.Path, serve_process: type[ServeProcess]) -> None:
    """Only joins need the coordinator: a rank of a started generation finishes its epoch and starts the
    next one from its plan while the coordinator is dead, and is fenced at its first grant once it is back.
    """
    store = f"sqlite:///{tmp_path}/c.db"
    p = serve_process(store)
    n, job = 3000, "outage"
    s = DistributedSampler(n, address=p.address, job=job, incarnation="a", lease_ahead=50, prefetch=1)
    it = iter(s)
    first = [next(it) for _ in range(500)]
    p.kill()
    rest = list(it)  # the rest of epoch 0, with no coordinator at all
    epoch1 = list(s)  # and all of epoch 1
    assert p.proc.poll() is not None, "the coordinator was expected to stay dead"
    assert sorted(first + rest) == list(range(n)) and sorted(epoch1) == list(range(n))
    p2 = serve_process(store, port=p.port)
    ref = DistributedSampler(n, address=p2.address, job="outage-reference", incarnation="r")
    assert first + rest == list(ref)  # the same order the coordinator would have granted
    it2 = iter(s)  # epoch 2, granted again
    next(it2)
    intruder = DistributedSampler(n, address=p2.address, job=job, incarnation="b")
    next(iter(intruder))  # a new incarnation: generation 2 replaces the old one
    with pytest.raises(RuntimeError, match="fenced off"):
        for _ in it2:
            pass
    for x in (s, ref, intruder):
        x.close()


def test_survives_a_coordinator_kill(tmp_path: pathlib.Path, serve_process: type[ServeProcess]) -> None:
    store = f"sqlite:///{tmp_path}/c.db"
    p = serve_process(store)
    job = "survivor"
    s = DistributedSampler(5000, address=p.address, job=job, incarnation="a", lease_ahead=64, prefetch=1)
    it = iter(s)
    first = [next(it) for _ in range(1000)]
    p.kill()
    p2 = serve_process(store, port=p.port)
    rest = list(it)
    assert sorted(first + rest) == list(range(5000))
    ref = DistributedSampler(5000, address=p2.address, job="reference", incarnation="r")
    assert first + rest == list(ref)
    s.close()
    ref.close()


_EMBEDDED_PARENT = """
import os, sys
from croupier.client import DistributedSampler, _embedded, _resolve
address, _ = _resolve._start_embedded(sys.argv[1], "127.0.0.1")
s = DistributedSampler(200, num_replicas=1, rank=0, job="lifeline", incarnation=sys.argv[2], address=address)
assert sorted(s) == list(range(200))
(child,) = _embedded._children.values()
print(os.getpid(), child.proc.pid, address, s.generation, flush=True)
sys.stdin.read()
"""


def _gone(pid: int, within: float) -> bool:
    """Whether process `pid` has exited (or is a zombie) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.e2e  # processes of its own (a trainer, its coordinator), killed with SIGKILL
def test_the_embedded_coordinator_lives_in_a_process_of_its_own_and_dies_with_its_parent(
        tmp_path: pathlib.Path) -> None:
    """A process given no coordinator starts one in a child process (no coordinator thread in the trainer's
    own); killed with SIGKILL, its coordinator lets go of the store, and the next process on the same store
    starts its own over it and goes on with the job's generations."""
    env = {k: v for k, v in os.environ.items() if k not in ("CROUPIER_ADDRESS", "CROUPIER_INCARNATION")}
    script = tmp_path / "parent.py"
    script.write_text(_EMBEDDED_PARENT)
    store = f"sqlite:///{tmp_path}/e.db"
    generations = []
    for incarnation in ("first", "second"):
        p = subprocess.Popen([sys.executable, str(script), store, incarnation], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout is not None
        line = p.stdout.readline().split()
        assert len(line) == 4, (line, p.wait())
        pid, child, generations = int(line[0]), int(line[1]), [*generations, int(line[3])]
        assert child != pid
        names = {pathlib.Path(f"/proc/{pid}/task/{t}/comm").read_text().strip() for t in os.listdir(f"/proc/{pid}/task")}
        assert "croupier-aio" not in names, names  # the server's event loop thread is not in the trainer
        os.kill(pid, signal.SIGKILL)
        p.wait()
        assert _gone(child, 10.0), f"the coordinator {child} outlived its parent {pid}"
    assert generations[1] > generations[0], generations


def _forked_child_reads_an_epoch(q: Any) -> None:
    try:
        s = DistributedSampler(500, num_replicas=1, rank=0, job="forked-kid", lease_ahead=16, prefetch=1)
        q.put(sorted(s))
        s.close()
    except BaseException as e:  # reported to the parent
        q.put(repr(e))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_calls_its_parents_embedded_coordinator_through_grpc() -> None:
    """A child forked after the embedded coordinator started calls the same coordinator (the child does not
    own it: its copy of the lifeline is closed at the fork)."""
    import multiprocessing

    parent = DistributedSampler(500, num_replicas=1, rank=0, job=f"fork-parent-{uuid.uuid4().hex}", lease_ahead=16,
                                prefetch=1)
    assert sorted(parent) == list(range(500))  # the embedded coordinator, started by this process
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_child_reads_an_epoch, args=(q,))
    p.start()
    try:
        got = q.get(timeout=120)
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
        parent.close()
    assert got == list(range(500)), got


def test_a_generations_first_lease_is_small_and_the_rest_are_whole(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first batch after a join waits for a lease of about FIRST_LEASE_INDICES indices, not a whole
    lease_ahead; the leases after it, and a later epoch's first, are whole; every index still comes once."""
    from croupier.client import _prefetch
    from croupier.client._rpc import CoordinatorClient

    asked: list[tuple[int, int, int]] = []  # (epoch, first batch, count) of each grant asked
    real = CoordinatorClient.grant

    def grant(self: CoordinatorClient, job: str, gen: int, rank: int, epoch: int, first: int, count: int,
              *a: Any, **kw: Any) -> Any:
        asked.append((epoch, first, count))
        return real(self, job, gen, rank, epoch, first, count, *a, **kw)

    monkeypatch.setattr(CoordinatorClient, "grant", grant)
    first = _prefetch.FIRST_LEASE_INDICES
    s = DistributedSampler(3 * first + 5, num_replicas=1, rank=0, address=server.address, job="ramp", incarnation="g1",
                           lease_ahead=2 * first)
    for _ in range(2):  # epochs 0 and 1
        assert sorted(s) == list(range(3 * first + 5))
    s.close()
    assert asked == [(0, 0, first), (0, first, 2 * first), (0, 3 * first, 2 * first),  # 1,024 + 2,048 + 5
                     (1, 0, 2 * first), (1, 2 * first, 2 * first)]  # 2,048 + 1,029
    asked.clear()
    b = DistributedBatchSampler(3 * first, 100, num_replicas=1, rank=0, address=server.address, job="ramp-b",
                                incarnation="g1", lease_ahead=40)
    assert sorted(i for batch in b for i in batch) == list(range(3 * first))
    b.close()
    assert [count for _, _, count in asked] == [first // 100, 40]  # 10 batches of 100 first, then the rest (21)
