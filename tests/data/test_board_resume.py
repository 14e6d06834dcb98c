"""The demand board seeded at a resume point: each shard's rows read are what the epoch consumed before it (counted
against the plan's own leases), seeded once per point, and a shard half read before a resume and finished after it
evicted before a shard still needed."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import numpy as np
import pytest
from _budget import examples
from _s3 import S3Server, serve_s3
from _shard_files import write_parquet
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.core.checkpoint import to_state
from croupier.core.cursor import Cursor, fresh
from croupier.core.registry import plan_epoch
from croupier.core.shards import consumed_rows
from croupier.core.spec import Spec
from croupier.data import Manifest, ShardedDataset
from croupier.data._board import DemandBoard, PlanDriven, seed_at


def _run(spec: Spec, legs: list[tuple[int, float]], epoch: int = 0) -> tuple[Cursor, np.ndarray]:
    """The cursor after `legs` (each a world and the fraction of its longest rank's steps it takes) from the start of
    `epoch`, and each shard's rows the legs' leases dealt (counted from the indices, not from positions)."""
    sizes = np.frombuffer(spec.shards or b"", dtype="<i8")
    off = np.concatenate([[0], np.cumsum(sizes)])
    dealt = np.zeros(sizes.size, dtype=np.int64)
    cursor = fresh(spec, epoch)
    for world, frac in legs:
        plan = plan_epoch(spec, cursor, world, epoch)
        assert plan is not None
        j = int(frac * max(plan.steps(r) for r in range(world)))
        for r in range(world):
            idx, _ = plan.lease(r, 0, min(j, plan.steps(r)))
            np.add.at(dealt, np.searchsorted(off, idx, side="right") - 1, 1)
        after = plan.advance(j)
        if after.epoch != epoch:  # the legs finished the epoch: stop at its last cursor
            break
        cursor = after
    return cursor, dealt


@settings(max_examples=examples(60), deadline=None)
@given(sizes=st.lists(st.integers(1, 30), min_size=1, max_size=24), window=st.integers(1, 6), lanes=st.integers(1, 4),
       group=st.integers(1, 3), batch=st.integers(1, 4), seed=st.integers(0, 2**32), epoch=st.integers(0, 3),
       legs=st.lists(st.tuples(st.integers(1, 6), st.floats(0.0, 0.9)), min_size=1, max_size=3))
def test_consumed_rows_are_the_rows_the_plan_dealt(sizes: list[int], window: int, lanes: int, group: int, batch: int,
                                                   seed: int, epoch: int, legs: list[tuple[int, float]]) -> None:
    """Across resizes (each leg another world), the rows consumed_rows counts for the cursor are, shard by shard,
    the rows the legs' leases dealt: whole windows, the windows the cursor cuts (walked on either side), none."""
    spec = Spec.with_shards(sizes, batch_size=batch, shard_window=window, lanes=lanes, reader_group=group, seed=seed,
                            tail="drop")
    cursor, dealt = _run(spec, legs, epoch)
    assert consumed_rows(spec, cursor).tolist() == dealt.tolist()


def test_consumed_rows_refuses_an_order_that_is_not_a_shard_order() -> None:
    with pytest.raises(ValueError, match="permutation='feistel'"):
        consumed_rows(Spec(n=10), fresh(Spec(n=10), 0))


def _half_read(spec: Spec, dealt: np.ndarray) -> tuple[int, int]:
    """Two shards read in part before the resume (H and K)."""
    part = np.flatnonzero((dealt > 0) & (dealt < np.frombuffer(spec.shards or b"", dtype="<i8")))
    assert part.size >= 2, dealt
    return int(part[0]), int(part[1])


def test_a_resumed_board_evicts_a_shard_finished_after_the_resume_first(tmp_path: pathlib.Path) -> None:
    """A node resumes mid-epoch with two shards read in part before the resume, H and K, in its cache. It reads the
    rest of H (K's rest is still to come, not yet announced), and the cache needs room: H, finished, goes first.
    Without the seed the board counts only H's rows read after the resume, H is not finished, and K, used longer
    ago, would go first: a shard still needed, fetched again."""
    sizes = [8] * 12
    spec = Spec.with_shards(sizes, batch_size=2, shard_window=3, lanes=2, reader_group=2, tail="drop")
    cursor, dealt = _run(spec, [(4, 0.4)])
    h, k = _half_read(spec, dealt)
    board = DemandBoard(tmp_path / "plan", "ds", tuple(sizes))
    assert seed_at(board, spec, cursor)
    assert board.view()[:, 2].tolist() == dealt.tolist()  # the rows read are the plan's consumed rows
    board.consumed(np.array([h]), np.array([sizes[h] - dealt[h]]))  # the rest of H, read after the resume
    policy = PlanDriven(board, {f"s{s}": s for s in range(len(sizes))})
    held = [(1.0, 100, str(tmp_path / f"s{k}.data")), (2.0, 100, str(tmp_path / f"s{h}.data"))]
    assert [os.path.basename(p) for _, _, p in policy.order(held)] == [f"s{h}.data", f"s{k}.data"]


def test_a_resume_point_is_seeded_once(tmp_path: pathlib.Path) -> None:
    """The node's processes each seed the same point: the first seeds, the others keep the reads counted since; a
    new point (a rollback) seeds again; a spec that is not a shard order seeds nothing."""
    sizes = [5] * 9
    spec = Spec.with_shards(sizes, batch_size=1, shard_window=2, lanes=2, reader_group=1, tail="drop")
    later, dealt = _run(spec, [(3, 0.6)])
    earlier, dealt_earlier = _run(spec, [(3, 0.3)])
    board = DemandBoard(tmp_path / "plan", "ds", tuple(sizes))
    other = DemandBoard(tmp_path / "plan", "ds", tuple(sizes))  # another process of the node
    assert seed_at(board, spec, later)
    board.consumed(np.array([0]), np.array([0 if dealt[0] == 5 else 1]))
    counted = board.view()[:, 2].tolist()
    assert not seed_at(other, spec, later) and other.view()[:, 2].tolist() == counted
    assert seed_at(other, spec, earlier) and board.view()[:, 2].tolist() == dealt_earlier.tolist()
    assert not seed_at(board, Spec(n=45), fresh(Spec(n=45), 0))


def test_a_bad_seed_is_refused_and_changes_nothing(tmp_path: pathlib.Path) -> None:
    board = DemandBoard(tmp_path / "plan", "ds", (4, 4))
    board.consumed(np.array([1]), np.array([3]))
    for point, read, match in [(0, np.array([1, 1]), "resume point"), (2**63, np.array([1, 1]), "resume point"), (7, np.array([1, 5]), r"shard 1 holds 4 rows"),
                               (7, np.array([1]), "2 ints"), (7, np.array([-1, 0]), r"shard 0 holds 4 rows")]:
        with pytest.raises(ValueError, match=match):
            board.seed(point, lambda read=read: read)  # type: ignore[misc]
        assert board.view()[:, 2].tolist() == [0, 3]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """The module's S3-API server on loopback."""
    yield from serve_s3()


@pytest.mark.e2e
@pytest.mark.paired  # the S3-API server takes seconds to start: as tests/data's
def test_a_dataset_resumes_its_board_from_the_checkpoint(s3: S3Server, tmp_path: pathlib.Path) -> None:
    """``ShardedDataset.resume(spec, state)`` (shards in object storage, plan eviction): the board's rows read are the
    rows the plan dealt before the checkpoint; a second process of the node resuming the same state changes
    nothing; a spec of other shards and a state of another spec are refused, naming them."""
    files = write_parquet(tmp_path / "d", [6] * 8)
    urls = s3.put(files, "resume")
    m = Manifest.build(urls, storage_options=s3.options)
    ds = ShardedDataset(m, storage_options=s3.options, cache_dir=tmp_path / "node", range_reads=False)
    spec = Spec.with_shards(ds.shard_sizes, batch_size=2, shard_window=2, lanes=2, reader_group=2, tail="drop")
    cursor, dealt = _run(spec, [(4, 0.5)])
    state = to_state("job", spec, cursor)
    assert not ds.resume(spec, {})  # a fresh start: nothing to seed
    assert ds.resume(spec, state)
    assert ds._board is not None and ds._board.view()[:, 2].tolist() == dealt.tolist()
    again = ShardedDataset(m, storage_options=s3.options, cache_dir=tmp_path / "node", range_reads=False)
    assert not again.resume(spec, state)
    with pytest.raises(ValueError, match="are not this dataset's 8"):
        ds.resume(Spec.with_shards([6] * 7 + [5], batch_size=2), state)
    with pytest.raises(ValueError, match="fingerprint|spec"):
        ds.resume(Spec.with_shards(ds.shard_sizes, batch_size=3), state)
    with pytest.raises(ValueError, match="must be a dict"):
        ds.resume(spec, [("job", "job")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="croupier Spec"):
        ds.resume("spec", state)  # type: ignore[arg-type]
    ds.close()
    again.close()
