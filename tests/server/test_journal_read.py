"""croupier.server.read_journal: the public way to read a store's events (no tool unpacks the journal itself)."""

from __future__ import annotations

import pathlib

import pytest
from _joins import join_started
from _ranks import on_ranks

from croupier.core.api import JoinRequest
from croupier.core.spec import Spec
from croupier.server import (
    Coordinator,
    GenerationOpened,
    GenerationStarted,
    RankJoined,
    StoreCorrupt,
    open_store,
    read_journal,
)


def _two_generations(url: str) -> None:
    core = Coordinator(open_store(url))
    try:
        spec = Spec(n=40)
        for incarnation, world in (("t1", 2), ("t2", 3)):
            on_ranks(world, lambda r, t=incarnation, w=world: join_started(core, JoinRequest("j", spec, t, w, r), 10.0))
    finally:
        core.close()


def test_the_events_come_decoded_in_journal_order(tmp_path: pathlib.Path) -> None:
    url = f"sqlite:///{tmp_path}/c.db"
    _two_generations(url)
    store = open_store(url)
    try:
        rec = read_journal(store)
        later = read_journal(store, since=3)
    finally:
        store.close()
    assert rec.snapshot is None and rec.snapshot_seq == 0
    seqs = [seq for seq, _ in rec.events]
    assert seqs == list(range(1, len(seqs) + 1))
    opened = [(ev.generation, ev.incarnation, ev.world) for _, ev in rec.events if isinstance(ev, GenerationOpened)]
    assert opened == [(1, "t1", 2), (2, "t2", 3)]
    assert sum(isinstance(ev, RankJoined) for _, ev in rec.events) == 5
    assert [ev.generation for _, ev in rec.events if isinstance(ev, GenerationStarted)] == [1, 2]
    assert later.events == rec.events[3:]


def test_a_record_that_does_not_decode_is_named(tmp_path: pathlib.Path) -> None:
    url = f"sqlite:///{tmp_path}/c.db"
    _two_generations(url)
    store = open_store(url)
    try:
        seq = store.append([b"\x93not an event"])
        with pytest.raises(StoreCorrupt, match=rf"journal record {seq} cannot be read"):
            read_journal(store)
    finally:
        store.close()
