"""G1 from the sampler to the rows a training loop receives, through croupier.data's shard reader.

Parquet shards (16 x 40 rows, each row's ``id`` its dataset index) are read by
``DistributedBatchSampler(ds, 4, shard_sizes=ds.shard_sizes, reader_group=2)`` and croupier's ``Loader``
over a DataLoader (``Indexed(ds)``, prefetch_factor 4); every check counts the ids of the rows the loop got.

- Ranks as processes with the torchrun environment (tests/_shard_rank.py) on a ``croupier serve``
  coordinator, the shards on an S3-API server on loopback (moto's application behind werkzeug,
  ``tests/_s3.py``): 4 ranks on 2 nodes, one killed -9 mid-epoch, resumed on 2 ranks on 1 node
  from the last checkpoint, then rolled back to an older checkpoint of that run on 3 ranks on 2 nodes.
- In process: DataLoader workers 0, 2 and 4, cut and resumed with another count (local files); on the
  S3-API server, a read that fails twice then works, and a shard that vanished, skipped (its samples
  FILTERED) or raised. The tests on the server run with the end-to-end runs (e2e, paired).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from _ranks import on_ranks
from _s3 import S3Server, serve_s3
from _shard_rank import ORDER, SEED, loader_of, write_shards

from croupier.client import DistributedBatchSampler
from croupier.data import Manifest, Retry, ShardedDataset, ShardError

RANK = pathlib.Path(__file__).resolve().parents[1] / "_shard_rank.py"
SIZES = [40] * 16
N, BS = sum(SIZES), 4
FAST = Retry(attempts=4, first_wait_s=0.01, max_wait_s=0.05)
Rows = list[list[Any]]  # [index, id] of each sample the loop received; id None for a FILTERED one

# 4 workers of a rank on this machine's 2 cores, on purpose: torch warns.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def s3_run(test: Any) -> Any:
    """A test on the module's S3-API server (seconds to start): with the end-to-end runs, as tests/data's."""
    return pytest.mark.paired(pytest.mark.e2e(test))


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """The module's S3-API server on loopback, stopped at the end."""
    yield from serve_s3()


def once(rows: Rows) -> collections.Counter[str]:
    """What is wrong with `rows` against every row of the dataset exactly once: ids 'missing', 'repeated',
    or read for another index ('misread'); empty when exact."""
    ids = collections.Counter(i for _, i in rows)
    return +collections.Counter(missing=sum(1 for i in range(N) if not ids[i]),
                                repeated=sum(c - 1 for c in ids.values() if c > 1),
                                misread=sum(1 for index, i in rows if index != i))


# ------------------------------------------------------------------ ranks as processes, kill -9, resize, rollback


def _world(address: str, job: str, nodes: list[int], run: pathlib.Path, tmp: pathlib.Path, *extra: str,
           park_rank: int | None = None) -> list[subprocess.Popen[str]]:
    """A run of len(nodes) nodes of nodes[k] ranks each, as torchrun starts them."""
    run.mkdir(parents=True)
    world, procs, rank = sum(nodes), [], 0
    for node, local_world in enumerate(nodes):
        for local in range(local_world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                   "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node), "TORCHELASTIC_RUN_ID": run.name,
                   "CROUPIER_ADDRESS": address, "CROUPIER_JOB": job, "OMP_NUM_THREADS": "1"}
            env.pop("CROUPIER_INCARNATION", None)
            args = [str(run), str(tmp / "manifest.json"), str(tmp / "options.json"), str(tmp / "cache"), *extra]
            if park_rank is not None:
                args += ["--park-rank", str(park_rank)]
            with open(run / f"err-r{rank}.txt", "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, str(RANK), *args], cwd=RANK.parent, env=env, text=True, stderr=err,
                    stdout=subprocess.PIPE if rank == park_rank else subprocess.DEVNULL,
                    start_new_session=True))  # a process group with its DataLoader workers
            rank += 1
    return procs


def _errors(run: pathlib.Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(run.glob("err-r*.txt")))


def _reap(procs: list[subprocess.Popen[str]]) -> None:
    """Kills what is left of each rank's process group (its DataLoader workers and their server)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)


def _finish(procs: list[subprocess.Popen[str]], run: pathlib.Path) -> None:
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        _reap(procs)
    assert codes == [0] * len(procs), _errors(run)


def _records(run: pathlib.Path) -> list[dict[str, Any]]:
    """What the run's loops logged, a record a batch; all of epoch 0."""
    recs = [json.loads(line) for f in sorted(run.glob("log-r*.jsonl")) for line in f.read_text().splitlines()]
    assert {rec["epoch"] for rec in recs} == {0}, run
    return recs


def _rows(run: pathlib.Path, upto: int | None = None) -> Rows:
    """The rows the run's loops received, up to step `upto`."""
    return [row for rec in _records(run) if upto is None or rec["step"] <= upto for row in rec["rows"]]


def _checkpoints(run: pathlib.Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in run.glob("ckpt-*.json"))


@s3_run
def test_killed_mid_epoch_resumed_on_other_nodes_and_rolled_back_every_row_once(  # type: ignore[no-untyped-def]
        serve_process, s3: S3Server, tmp_path: pathlib.Path) -> None:
    """a: 4 ranks on 2 nodes, 2 workers each, checkpoints every 4 steps; rank 3 parks after step 10 and is
    killed -9 (with its workers), then the rest. b: 2 ranks on 1 node from a's last checkpoint (step 8), to
    the epoch's end. c: 3 ranks on 2 nodes (2 + 1) from b's checkpoint of step 16, older than b's last.
    The kept rows of a to step 8 and all of b are every row once; so are a to 8, b to 16 and all of c, and
    c trains again exactly what b trained after step 16."""
    server = serve_process(f"sqlite:///{tmp_path}/coordinator.db")
    s3.put(write_shards(tmp_path / "d", SIZES), "e2e")
    Manifest.build(f"s3://{s3.bucket}/e2e/", storage_options=s3.options).save(tmp_path / "manifest.json")
    (tmp_path / "options.json").write_text(json.dumps(s3.options))
    job = uuid.uuid4().hex

    a = tmp_path / "a"
    procs = _world(server.address, job, [2, 2], a, tmp_path, "--park-after", "10", park_rank=3)
    try:
        parked = procs[3].stdout
        assert parked is not None and parked.readline().strip() == "parked", _errors(a)
        os.killpg(procs[3].pid, signal.SIGKILL)  # the rank and its DataLoader workers
        assert procs[3].wait(timeout=30) == -9
    finally:
        _reap(procs)  # the launcher takes the rest of the job down
    assert _checkpoints(a) == [4, 8], _errors(a)
    assert {rec["step"] for rec in _records(a)} >= set(range(1, 11)), "a trained to step 10"

    b = tmp_path / "b"
    _finish(_world(server.address, job, [2], b, tmp_path, "--state", str(a / "ckpt-8.json")), b)
    kept_ab = _rows(a, 8) + _rows(b)
    assert not once(kept_ab), once(kept_ab)
    assert len(_rows(a)) > len(_rows(a, 8)), "a trained past the checkpoint it was resumed from"
    assert _checkpoints(b)[-1] > 16

    c = tmp_path / "c"
    _finish(_world(server.address, job, [2, 1], c, tmp_path, "--state", str(b / "ckpt-16.json")), c)
    kept_abc = _rows(a, 8) + _rows(b, 16) + _rows(c)
    assert not once(kept_abc), once(kept_abc)
    rolled_back = sorted(i for _, i in _rows(b) if i not in {i for _, i in _rows(b, 16)})
    assert sorted(i for _, i in _rows(c)) == rolled_back


# ------------------------------------------------------------------ in process: ranks as threads


@pytest.fixture(scope="module")
def address(module_address: str) -> str:
    """One in-process coordinator for the module's in-process runs, each a job of its own."""
    return module_address


def run_world(address: str, job: str, ds: ShardedDataset, world: int, workers: int, steps: int | None,
              state: dict[str, Any] | None) -> tuple[Rows, list[dict[str, Any]]]:
    """Every rank of a world (threads) loads `state` and takes `steps` batches (None: to the epoch's end)
    through ``Loader`` with `workers` workers; the rows their loops received, and each rank's state."""
    incarnation = uuid.uuid4().hex

    def rank(r: int) -> tuple[Rows, dict[str, Any]]:
        sampler = DistributedBatchSampler(ds, BS, num_replicas=world, rank=r, address=address, job=job,
                                          incarnation=incarnation, seed=SEED, tail="uneven",
                                          shard_sizes=ds.shard_sizes, **ORDER)
        loader = loader_of(ds, sampler, workers)
        if state is not None:
            loader.load_state_dict(state)
        rows: Rows = []
        try:
            for k, batch in enumerate(loader, 1):
                rows += batch
                if k == steps:
                    break
            return rows, loader.state_dict()
        finally:
            loader.close()
            sampler.close()

    out = on_ranks(world, rank)
    return [row for rows, _ in out for row in rows], [st for _, st in out]


def cut_and_resume(address: str, ds: ShardedDataset, workers: tuple[int, int], steps: int = 6) -> Rows:
    """2 ranks with workers[0] workers take `steps` batches each and checkpoint; 1 rank with workers[1]
    resumes from it to the epoch's end: the rows the loops received."""
    job = uuid.uuid4().hex
    first, states = run_world(address, job, ds, 2, workers[0], steps, None)
    assert states[0] == states[1] and len(first) == 2 * steps * BS
    rest, _ = run_world(address, job, ds, 1, workers[1], None, states[0])
    return first + rest


@pytest.mark.e2e  # DataLoader worker processes: with the end-to-end runs, not in make check
@pytest.mark.paired
@pytest.mark.parametrize("workers", [(0, 2), (2, 4), (4, 0)], ids=lambda w: f"{w[0]}to{w[1]}")
def test_workers_0_2_4_cut_and_resumed_with_another_count_every_row_once(address: str, tmp_path: pathlib.Path,
                                                                         workers: tuple[int, int]) -> None:
    write_shards(tmp_path / "d", SIZES)
    ds = ShardedDataset(tmp_path / "d", cache_dir=tmp_path / "cache")
    rows = cut_and_resume(address, ds, workers)
    assert not once(rows), once(rows)


def _on_s3(s3: S3Server, tmp_path: pathlib.Path, prefix: str, **kw: Any) -> tuple[ShardedDataset, list[str]]:
    urls = s3.put(write_shards(tmp_path / "d", SIZES), prefix)
    m = Manifest.build(f"s3://{s3.bucket}/{prefix}/", storage_options=s3.options)  # reads the footers
    return ShardedDataset(m, storage_options=s3.options, cache_dir=tmp_path / "cache", retry=FAST, **kw), urls


@s3_run
def test_a_read_that_fails_twice_then_works_every_row_once(address: str, s3: S3Server, tmp_path: pathlib.Path) -> None:
    """The store answers the first two GETs of shard 5 with a 500 (a row group's read: the manifest carries the
    footer): the read is tried again and the third works. The node's cache fetches the shard once: its 4 row
    groups, so 2 + 4 GETs in all."""
    ds, urls = _on_s3(s3, tmp_path, "flaky")
    before = s3.gets(urls[5])
    s3.fail(urls[5], 2)
    rows = cut_and_resume(address, ds, (2, 2))
    assert not once(rows), once(rows)
    assert s3.failed[urls[5]] == 2 and s3.gets(urls[5]) - before == 2 + SIZES[5] // 10


@s3_run
@pytest.mark.parametrize("workers", [0, 2])
def test_a_vanished_shard_skipped_comes_back_filtered_not_missing(address: str, s3: S3Server, tmp_path: pathlib.Path,
                                                                   workers: int, caplog: pytest.LogCaptureFixture) -> None:
    """Shard 3 vanishes after the manifest was made; with on_error="skip" each of its 40 samples reaches
    the loop as FILTERED, once: the ids received and the skipped shard's indices are every row once."""
    ds, urls = _on_s3(s3, tmp_path, f"vanish{workers}", on_error="skip")
    s3.remove(urls[3])
    with caplog.at_level(logging.WARNING, logger="croupier.data"):
        rows = cut_and_resume(address, ds, (workers, workers))
    filtered = sorted(index for index, i in rows if i is None)
    assert filtered == list(ds.indices(3))
    kept = [row for row in rows if row[1] is not None]
    assert once(kept) == collections.Counter(missing=40) and not once(kept + [[i, i] for i in filtered])
    if workers == 0:  # read in this process: the warning is here
        assert urls[3] in caplog.text and "missing" in caplog.text and "FILTERED" in caplog.text


@s3_run
def test_a_vanished_shard_raises_naming_it(address: str, s3: S3Server, tmp_path: pathlib.Path) -> None:
    ds, urls = _on_s3(s3, tmp_path, "raise")
    s3.remove(urls[3])
    with pytest.raises(ShardError) as e:
        run_world(address, uuid.uuid4().hex, ds, 1, 2, None, None)
    assert urls[3] in str(e.value) and "is missing" in str(e.value) and "indices 120 to 159" in str(e.value)
