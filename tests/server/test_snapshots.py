"""The snapshot packer: the same bytes as packing the whole state, from the jobs it kept since they last changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from croupier.core.api import JoinRequest, now_ms
from croupier.core.order import Cursor
from croupier.core.spec import Spec
from croupier.server._coordinator import Coordinator
from croupier.server._decide import decide_join
from croupier.server._journal import pack_snapshot, read_journal, recover
from croupier.server._snapshots import SnapshotPacker
from croupier.server._state import State
from croupier.server._stores import open_store

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SPEC = Spec(n=40, seed=1, batch_size=4)


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("journal-*.db")))
def test_every_journal_fixture_packs_as_the_whole_state_after_each_event(tmp_path: Path, fixture: str) -> None:
    """Every kind of event the fixtures hold (joins, resizes, reports, checkpoints, deals, amendments, steps)."""
    copy = tmp_path / fixture
    shutil.copyfile(FIXTURES / fixture, copy)
    store = open_store(f"sqlite:///{copy}")
    try:
        read = read_journal(store)
    finally:
        store.close()
    assert read.events, f"{fixture} holds no records after its snapshot"
    state = read.snapshot if read.snapshot is not None else State()
    packer = SnapshotPacker()
    assert packer.pack(state) == pack_snapshot(state)
    for _, ev in read.events:
        packer.changed([ev.job])
        state.apply(ev)
        assert packer.pack(state) == pack_snapshot(state), f"{fixture}: after {ev!r}"


def test_a_job_changed_and_not_told_packs_stale() -> None:
    """The packer keeps what it encoded: the check above fails when an apply is not told."""
    state, packer = State(), SnapshotPacker()
    for ev in decide_join(state, JoinRequest("a", SPEC, "t", 2, 0), now_ms()):
        state.apply(ev)
    packer.pack(state)
    for ev in decide_join(state, JoinRequest("a", SPEC, "t", 2, 1), now_ms()):
        state.apply(ev)
    assert packer.pack(state) != pack_snapshot(state)
    packer.changed(None)
    assert packer.pack(state) == pack_snapshot(state)


def test_snapshots_written_under_load_recover_the_state(tmp_path: Path) -> None:
    """A snapshot after every event, over joins, resizes and checkpoints of several jobs: recovery from the
    last one gives the state the coordinator held."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    core = Coordinator(open_store(url), snapshot_every=1)
    try:
        for world, incarnation in ((2, "a"), (3, "b")):
            for job in ("x", "y", "z"):
                for rank in range(world):
                    g = core.join(JoinRequest(job, SPEC, incarnation, world, rank))
                    if g.start is not None:
                        core.report(job, g.generation, 0, 0, 1, (world, Cursor(0, ((8, SPEC.n),)), f"{job}/{world}"))
        live = core.snapshot_state()
    finally:
        core.close()
    store = open_store(url)
    try:
        state, rec = recover(store)
    finally:
        store.close()
    assert rec.records == [] and rec.snapshot is not None  # everything came from the last snapshot
    assert pack_snapshot(state) == live
