"""The node cache's plan-driven eviction: the demand board's order (done, then unannounced, then furthest need),
its counts exact across processes, and a shard fetched once where least-recently-used eviction fetches it twice,
counted at the loopback S3 server."""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
from collections.abc import Iterator

import numpy as np
import pytest
from _s3 import S3Server, serve_s3
from _shard_files import write_parquet

from croupier.data import Manifest, ShardedDataset
from croupier.data._board import DemandBoard, LeastRecentlyUsed, PlanDriven


def _entry(root: pathlib.Path, key: str, used: float) -> tuple[float, int, str]:
    return used, 100, str(root / f"{key}.data")


def test_plan_driven_order(tmp_path: pathlib.Path) -> None:
    """Shard 0 read whole (done), 1 read in part with nothing announced, 2 and 3 announced (3 needed later), and an
    entry of another dataset: done first, then the unannounced by last use, then the furthest need first."""
    board = DemandBoard(tmp_path / "plan", "ds", (4, 4, 4, 4))
    board.announce(np.array([0, 1]), np.array([4, 2]), np.array([0, 4]), 6)
    board.consumed(np.array([0, 1]), np.array([4, 2]))
    board.announce(np.array([2, 3]), np.array([1, 1]), np.array([0, 1]), 2)
    assert board.view().tolist() == [[0, 0, 4], [0, 0, 2], [1, 6, 0], [1, 7, 0]] and board.clock() == 8
    policy = PlanDriven(board, {"k0": 0, "k1": 1, "k2": 2, "k3": 3})
    held = [_entry(tmp_path, "k2-0", 1.0), _entry(tmp_path, "k3", 2.0), _entry(tmp_path, "other", 3.0),
            _entry(tmp_path, "k1-1", 5.0), _entry(tmp_path, "k0-0", 9.0)]
    names = [os.path.basename(p) for _, _, p in policy.order(held)]
    assert names == ["k0-0.data", "other.data", "k1-1.data", "k3.data", "k2-0.data"]
    assert [os.path.basename(p) for _, _, p in LeastRecentlyUsed().order(held)][0] == "k2-0.data"
    # the next pass: announced again, shard 0 is needed (its read count starts over), no longer done
    board.announce(np.array([0]), np.array([1]), np.array([0]), 1)
    assert board.view()[0].tolist() == [1, 8, 0]


def _hammer(root: str, rounds: int) -> None:
    board = DemandBoard(root, "ds", (10**9, 10**9))
    for _ in range(rounds):
        board.announce(np.array([0, 1]), np.array([2, 1]), np.array([0, 2]), 3)
        board.consumed(np.array([0]), np.array([1]))


def test_the_board_counts_exactly_across_processes(tmp_path: pathlib.Path) -> None:
    """Three processes (and this one, holding the board open) update one board at once: no update is lost; a board
    that no live process holds starts at zero, one that a process holds is kept."""
    root = str(tmp_path / "plan")
    mine = DemandBoard(root, "ds", (10**9, 10**9))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(root, 2000)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert mine.view()[:, [0, 2]].tolist() == [[3 * 2000, 3 * 2000], [3 * 2000, 0]] and mine.clock() == 9 * 2000
    again = DemandBoard(root, "ds", (10**9, 10**9))
    assert again.clock() == 9 * 2000  # held by `mine`: kept
    again.close()
    mine.close()
    assert DemandBoard(root, "ds", (10**9, 10**9)).clock() == 0  # held by no live process: started afresh


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """The module's S3-API server on loopback."""
    yield from serve_s3()


@pytest.mark.e2e
@pytest.mark.paired  # the S3-API server takes seconds to start: as tests/data's
@pytest.mark.parametrize("eviction", ["plan", "lru"])
def test_a_shard_still_needed_is_fetched_once(s3: S3Server, tmp_path: pathlib.Path, eviction: str) -> None:
    """A cache of two shards, three leases as a sampler announces them (each before it is read): shard A in part,
    B whole, then C and the rest of A. When C comes in, least recently used evicts A (the first fetched), which
    the next lease needs: A is fetched twice. Plan-driven eviction evicts B (every row read) and fetches A once."""
    files = write_parquet(tmp_path / "d", [10, 10, 10])
    urls = s3.put(files, f"evict-{eviction}")
    sizes = [f.stat().st_size for f in files]
    m = Manifest.build(urls, storage_options=s3.options)
    before = [s3.get_bytes(u) for u in urls]  # the footers (these files are shorter than a footer's read)
    ds = ShardedDataset(m, storage_options=s3.options, cache_dir=tmp_path / "node", range_reads=False,
                        cache_bytes=max(a + b for i, a in enumerate(sizes) for b in sizes[i + 1:]),
                        prefetch_threads=1, eviction=eviction)
    a, b, c = (ds.indices(s) for s in range(3))
    leases = [list(a[:5]), list(b), [*c, *a[5:]]]

    def announce(lease: list[int]) -> None:
        for f in ds.read_ahead(lease):
            f.result(timeout=60)

    announce(leases[0])
    # NOTE: a file's times are a tick of the kernel's clock: A's copy is dated back so that the last use of A
    # (its fetch, before B's) is not a tie with B's
    os.utime(ds.cache.path(m.shards[0].key), (1.0, 1.0))
    announce(leases[1])
    assert [r["id"] for r in ds.__getitems__(leases[0])] == leases[0]
    assert [r["id"] for r in ds.__getitems__(leases[1])] == leases[1]
    announce(leases[2])
    assert [r["id"] for r in ds.__getitems__(leases[2])] == leases[2]
    got = [s3.get_bytes(u) - b0 for u, b0 in zip(urls, before)]
    if eviction == "plan":
        assert got == sizes and ds.cache.fetches == 3, got  # each shard fetched once
    else:
        assert got == [2 * sizes[0], sizes[1], sizes[2]] and ds.cache.fetches == 4, got  # A twice
    ds.close()
