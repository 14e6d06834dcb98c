"""torch's sampler contract, as frameworks and plain loops rely on it: one test per way it used to break."""

from __future__ import annotations

import copy
import logging
import pickle
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from _ranks import on_ranks
from torch.utils.data import BatchSampler, DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from croupier.client import DistributedBatchSampler, DistributedSampler, shards
from croupier.client._rpc import CHANNEL_OPTIONS, GRPC_DEFAULT_MIN_PING_INTERVAL_MS
from croupier.server import Server
from croupier.server._grpc import SERVER_OPTIONS
from croupier.tools.audit import audit, verdict


def test_an_instance_of_torchs_distributed_sampler_with_its_attributes(server: Server) -> None:
    """Frameworks decide by isinstance whether a loader is already sharded, and read these attributes."""
    data = list(range(10))
    s = DistributedSampler(data, num_replicas=3, rank=2, shuffle=False, seed=5, address=server.address,
                           job="attrs", incarnation="t")
    t = TorchSampler(data, num_replicas=3, rank=2, shuffle=False, seed=5)
    assert isinstance(s, TorchSampler)
    for name in ("dataset", "num_replicas", "rank", "shuffle", "seed", "drop_last", "epoch", "num_samples",
                 "total_size"):
        assert getattr(s, name) == getattr(t, name), name
    assert len(s) == len(t)
    s.close()
    one = DistributedSampler(data, num_replicas=1, rank=0, permutation="torch", seed=5, address=server.address,
                             job="attrs-1", incarnation="t")
    t1 = TorchSampler(data, num_replicas=1, rank=0, seed=5)
    one.epoch = 2  # some loops assign it: the same as set_epoch(2)
    t1.set_epoch(2)
    assert one.epoch == t1.epoch == 2
    assert list(one) == list(t1)
    one.close()


SCRIPT = textwrap.dedent("""
    import itertools, sys
    from croupier.client import DistributedSampler
    s = DistributedSampler(int(sys.argv[1]), job="exit-" + sys.argv[1])
    print(sum(1 for _ in itertools.islice(iter(s), 1000)), flush=True)
""")


@pytest.mark.e2e
@pytest.mark.parametrize("n", [10**6, 10**9, 4 * 10**18])
def test_a_script_that_stops_mid_epoch_exits(n: int) -> None:
    """No close(), no loop to the end: background leasing and the embedded coordinator shut down by themselves."""
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(n)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "1000"
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


# --------------------------------------------------------------------------- torch's contract, bullet by bullet


def test_the_batch_sampler_is_a_torch_batch_sampler(server: Server) -> None:
    """Frameworks test isinstance(BatchSampler) and read batch_size, drop_last and sampler."""
    bs = DistributedBatchSampler(list(range(40)), 4, num_replicas=2, rank=1, drop_last=True, address=server.address,
                                 job="bs-attrs", incarnation="t")
    assert isinstance(bs, BatchSampler)
    assert (bs.batch_size, bs.drop_last) == (4, True)
    assert len(bs.sampler) == 20 and len(bs) == 5
    with pytest.raises(TypeError, match="iterate it"):
        iter(bs.sampler)
    bs.close()


@pytest.mark.parametrize("kind", ["index", "batch"])
def test_an_epoch_ends_at_its_last_item(server: Server, kind: str) -> None:
    """A loop that stops at len() (as Lightning does) has finished the epoch: set_epoch(1) goes on, exactly."""
    n = 24
    job = f"last-{kind}-{uuid.uuid4().hex[:6]}"
    s: Any = (DistributedSampler(n, address=server.address, job=job, incarnation="t", tail="uneven") if kind == "index" else
              DistributedBatchSampler(n, 4, address=server.address, job=job, incarnation="t", tail="uneven"))
    for epoch in range(3):
        s.set_epoch(epoch)
        it, got = iter(s), []
        for _ in range(len(s)):  # never asks past the last item
            got.append(next(it))
        flat = got if kind == "index" else [i for b in got for i in b]
        assert sorted(flat) == list(range(n)), f"epoch {epoch}"
        assert s.state_dict()["epoch"] == epoch + 1  # the checkpoint after the last step names the next epoch
    s.close()


@pytest.mark.parametrize("kind", ["index", "batch"])
def test_len_after_a_resume_is_the_whole_share(server: Server, kind: str) -> None:
    """Trainers restore their own batch counter and stop at len(): the resumed pass yields the rest, len() is the epoch."""
    n, job = 64, f"len-{kind}-{uuid.uuid4().hex[:6]}"

    def make(incarnation: str) -> Any:
        if kind == "index":
            return DistributedSampler(n, address=server.address, job=job, incarnation=incarnation)
        return DistributedBatchSampler(n, 4, address=server.address, job=job, incarnation=incarnation)

    a = make("a")
    whole = len(a)
    it = iter(a)
    taken = [next(it) for _ in range(whole * 5 // 8)]
    state = a.state_dict()
    a.close()
    b = make("b")
    b.load_state_dict(state)
    assert len(b) == whole and b.items_done == len(taken)  # before the first batch
    rest = list(b)
    assert len(taken) + len(rest) == whole == len(b)
    flat = [i for x in taken + rest for i in (x if kind == "batch" else [x])]
    assert sorted(flat) == list(range(n))
    b.close()


def test_a_loop_that_moves_on_early_cuts_the_epoch_and_the_audit_says_so(server: Server, tmp_path: Path) -> None:
    """set_epoch(e + 1) mid-epoch starts e + 1 as torch does; the audit log names the cut; going back stays an error."""
    n, job = 40, f"cut-{uuid.uuid4().hex[:6]}"
    s = DistributedSampler(n, address=server.address, job=job, incarnation="t", audit_dir=str(tmp_path))
    s.set_epoch(0)
    it = iter(s)
    first = [next(it) for _ in range(10)]  # a batch limit: the trainer moves on
    s.set_epoch(1)
    assert s.epoch == 1 and len(s) == n
    assert sorted(s) == list(range(n))  # epoch 1 whole
    assert not set(first) - set(range(n))
    with pytest.raises(ValueError, match=r"set_epoch\(0\) contradicts"):
        s.set_epoch(0)
    s.close()
    reports = audit(tmp_path)
    by_epoch = {r.epoch: r for r in reports}
    assert by_epoch[0].cut and "moved on to epoch 1 after 10 items" in by_epoch[0].why and by_epoch[0].missing == 30
    assert by_epoch[1].ok and by_epoch[1].finished
    assert not verdict(reports)[0] and verdict(reports, allow_cut=True)[0]


@pytest.mark.parametrize("kind", ["index", "batch"])
def test_an_empty_dataset(kind: str) -> None:
    """N = 0 is a dataset like any other: nothing to deal, no coordinator needed."""
    s: Any = DistributedSampler([]) if kind == "index" else DistributedBatchSampler([], 4)
    for epoch in range(2):
        s.set_epoch(epoch)
        assert len(s) == 0 and list(s) == []
    assert s.state_dict() == {}
    s.load_state_dict({})
    assert list(DataLoader([], sampler=s if kind == "index" else None, batch_sampler=s if kind == "batch" else None)) == []


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_copy_after_the_first_batch_goes_on(server: Server, how: str) -> None:
    """Spawn launchers pickle, frameworks deep-copy: a copy carries the position, not the connection."""
    n, job = 50, f"copy-{how}-{uuid.uuid4().hex[:6]}"
    s = DistributedSampler(n, address=server.address, job=job, incarnation="t", lease_ahead=8)
    it = iter(s)
    taken = [next(it) for _ in range(13)]
    c = pickle.loads(pickle.dumps(s)) if how == "pickle" else copy.deepcopy(s)
    assert c.items_done == 13 and len(c) == n
    rest = list(c)
    assert sorted(taken + rest) == list(range(n))
    s.close()
    c.close()


def test_train_and_val_samplers_in_one_process_do_not_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    """No job= anywhere: distinct specs get distinct jobs, and so do two samplers of one spec."""
    for k in ("CROUPIER_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE", "RANK", "CROUPIER_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    train = DistributedSampler(60, seed=1)
    val = DistributedSampler(20, shuffle=False)
    test = DistributedSampler(20, shuffle=False)
    assert len({train.job, val.job, test.job}) == 3
    for _ in range(2):  # interleaved, as a trainer validates inside an epoch
        assert sorted(train) == list(range(60))
        assert list(val) == list(range(20)) == list(test)
    state = train.state_dict()
    for s in (train, val, test):
        s.close()
    # A later launch (another run id) makes another job; loading the state continues the saved one.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "next-launch")
    again = DistributedSampler(60, seed=1)
    assert again.job != train.job and again.job.startswith("next-launch.")
    again.load_state_dict(state)
    assert again.job == train.job
    named = DistributedSampler(60, seed=1, job="mine")
    with pytest.raises(ValueError, match="not from this job 'mine'"):
        named.load_state_dict(state)  # an explicit job= still wins
    again.close()


def test_world_and_rank_are_resolved_when_first_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built before the launcher's world is known: resolved at len() or the first batch, never a silent 1/0 at build."""
    for k in ("WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    s = DistributedSampler(10, job="lazy", incarnation="t", address="127.0.0.1:1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert (s.num_replicas, s.rank, len(s)) == (2, 1, 5)


def test_a_sampler_passed_as_dataset_is_a_type_error() -> None:
    """A framework that rebuilds the batch sampler around its own sampler must not shrink the dataset to a shard."""
    torch_sampler = TorchSampler(list(range(64)), num_replicas=2, rank=0)
    with pytest.raises(TypeError, match="a sampler, not a dataset"):
        DistributedBatchSampler(torch_sampler, 4)
    with pytest.raises(TypeError, match="a sampler, not a dataset"):
        DistributedSampler(torch_sampler)


@pytest.mark.parametrize("batch_size", [None, 3])
def test_every_ranks_share_offline_is_what_the_ranks_get(server: Server, batch_size: int | None) -> None:
    """shards(): every rank's part of an epoch in one process, no coordinator; the same as the real samplers'."""
    n, world, job = 31, 3, f"offline-{batch_size}-{uuid.uuid4().hex[:6]}"

    def make(r: int, incarnation: str, world: int) -> Any:
        if batch_size is None:
            return DistributedSampler(n, num_replicas=world, rank=r, address=server.address, job=job, incarnation=incarnation, seed=4)
        return DistributedBatchSampler(n, batch_size, num_replicas=world, rank=r, address=server.address, job=job,
                                       incarnation=incarnation, seed=4)

    samplers = [make(r, "a", world) for r in range(world)]
    got = on_ranks(world, lambda r: list(samplers[r]))
    assert got == shards(n, world, batch_size=batch_size, seed=4)
    assert got != shards(n, world, batch_size=batch_size, seed=4, epoch=1)
    # Resumed from a mid-epoch state under another world size, too.
    its = [iter(s) for s in samplers]
    on_ranks(world, lambda r: [next(its[r]) for _ in range(2)])
    state = samplers[0].state_dict()
    for s in samplers:
        s.close()
    two = [make(r, "b", 2) for r in range(2)]
    for s in two:
        s.load_state_dict(state)
    w2 = 2
    assert on_ranks(w2, lambda r: list(two[r])) == shards(n, w2, batch_size=batch_size, seed=4, state=state)
    for s in two:
        s.close()


def test_a_join_that_waits_names_the_ranks_and_gives_up(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    """Every rank's sampler built in one process, iterated one after the other: an error naming the missing ranks."""
    s = DistributedSampler(40, num_replicas=3, rank=0, address=server.address, job="alone", incarnation="t", join_timeout=1.5)
    with caplog.at_level(logging.WARNING, logger="croupier"), pytest.raises(TimeoutError) as e:
        next(iter(s))
    assert "still waits for ranks [1, 2]" in str(e.value) and "croupier.client.shards" in str(e.value)
    assert any("waited" in r.getMessage() and "[1, 2]" in r.getMessage() for r in caplog.records)
    s.close()


def test_client_keepalive_is_what_any_grpc_server_accepts() -> None:
    """A client that pings more often than its server allows is sent GOAWAY too_many_pings."""
    opts = dict(CHANNEL_OPTIONS)
    assert opts["grpc.keepalive_time_ms"] >= GRPC_DEFAULT_MIN_PING_INTERVAL_MS
    assert opts.get("grpc.keepalive_permit_without_calls", 0) == 0
    assert dict(SERVER_OPTIONS)["grpc.http2.min_recv_ping_interval_without_data_ms"] <= opts["grpc.keepalive_time_ms"]
