"""Each fact of a generation is written once: its segment owns its progress, deals, commits and held
amendments, and the job reads its current generation's through it (``croupier.server._jobs.Job``)."""

from __future__ import annotations

import dataclasses

import msgpack

from croupier.core.amend import Amendment
from croupier.core.api import JoinRequest
from croupier.core.cursor import Cursor
from croupier.core.deals import KEEP_EPOCHS
from croupier.core.mixture import parts_of
from croupier.core.spec import Spec
from croupier.server._decide import decide_amend, decide_deal, decide_join, decide_report
from croupier.server._events import Event, decode_event, encode_event
from croupier.server._jobs import Job
from croupier.server._state import State

DYNAMIC = Spec(n=64, seed=3, batch_size=2, dealing="dynamic", tail="uneven")
MIX = Spec(n=100, sources=(30, 70), weights=((0, parts_of([1, 1])),))


def _apply(st: State, events: list[Event]) -> None:
    for ev in events:  # through the journal's codec, as a replay reads them
        st.apply(decode_event(msgpack.unpackb(msgpack.packb(encode_event(ev)))))


def _join(st: State, spec: Spec, incarnation: str, world: int, resume: Cursor | None = None) -> None:
    for r in range(world):
        _apply(st, decide_join(st, JoinRequest("j", spec, incarnation, world, r, resume), 0))


def _one_owner(job: Job) -> None:
    """The job's view of its current generation is its segment's own objects, not a copy."""
    seg = job.segment
    assert seg is not None
    assert job.progress is seg.ranks
    assert job.held is seg.amendments
    assert job.deals and all(book is seg.deals[e] for e, book in job.deals.items())


def test_a_job_keeps_no_copy_of_what_its_generation_did() -> None:
    assert {"progress", "deals", "held"}.isdisjoint(f.name for f in dataclasses.fields(Job))
    st = State()
    _join(st, DYNAMIC, "t1", 2)
    job = st.jobs["j"]
    at = 0
    for epoch in range(KEEP_EPOCHS + 2):  # the first epochs are left behind by the job's view, kept by the segment
        for first in range(0, 16, 4):
            for rank in range(2):
                _apply(st, decide_deal(st, "j", 1, rank, epoch, first, 4)[1])
            at += 1
            for rank in range(2):  # workers' own commits: each rank's progress and checkpoint
                _apply(st, decide_report(st, "j", 1, rank, epoch, first + 4, at, (None, None, f"t1/{rank}/{at}"),
                                         lockstep=False)[1])
            _one_owner(job)
    seg = job.segment
    assert seg is not None
    assert sorted(seg.deals) == list(range(KEEP_EPOCHS + 2)) and sorted(job.deals) == [2, 3]
    assert job.progress == {0: (3, 16, at), 1: (3, 16, at)} and seg.reached == {e: 16 for e in range(4)}
    assert job.deals[3].committed == {0: 16, 1: 16}
    # A replay of the snapshot reads each fact back into its one owner.
    back = State.restore(st.snapshot())
    assert back.snapshot() == st.snapshot()
    _one_owner(back.jobs["j"])
    assert back.jobs["j"].deals == job.deals and back.jobs["j"].progress == job.progress
    # A new generation's view starts empty; the replaced one's segment keeps its deals for the ledger.
    _join(st, DYNAMIC, "t2", 3, Cursor(4, ((0, 64),)))
    assert (job.progress, job.deals, job.held) == ({}, {}, ()) and job.segment is not None
    assert sorted(job.ledger[0].deals) == list(range(4)) and job.ledger[0].ranks == {}


def test_the_held_amendments_are_the_segments() -> None:
    st = State()
    _join(st, MIX, "t1", 1)
    _apply(st, decide_amend(st, "j", "skip", [3, 40])[1])
    _join(st, MIX, "t2", 1, Cursor(2, ((37, 100),)))
    job = st.jobs["j"]
    assert job.held == (Amendment("skip", (0, 3, 1, 10), 237),) and job.segment is not None
    assert job.held is job.segment.amendments and job.ledger[0].amendments == ()
    _apply(st, decide_report(st, "j", 2, 0, 2, 1, 5, (7, Cursor(2, ((39, 100),)), "t2/0/7"))[1])
    assert job.checkpoints[-1].amendments is job.segment.amendments


def test_a_generation_started_before_the_ledger_gets_its_segment_from_the_snapshot() -> None:
    """A snapshot of format 5 holds no ledger: its current generation's progress and deals go into a segment
    made from the generation, and the events after the snapshot are kept there."""
    st = State()
    _join(st, DYNAMIC, "t1", 2)
    _apply(st, decide_deal(st, "j", 1, 0, 0, 0, 4)[1])
    _apply(st, decide_report(st, "j", 1, 0, 0, 3, 9)[1])
    snap = st.snapshot()
    for jd in snap["jobs"]:
        del jd["ledger"], jd["steps"]
        jd["generation"].pop("steps")
    snap["version"] = 5
    back = State.restore(snap)
    job = back.jobs["j"]
    assert job.segment is not None and (job.segment.generation, job.segment.step) == (1, 0)
    assert job.progress == {0: (0, 3, 9)} and job.deals[0].runs == {0: [(0, 4)]}
    _apply(back, decide_deal(back, "j", 1, 1, 0, 0, 4)[1])
    assert job.segment.deals[0].runs == {0: [(0, 4)], 1: [(4, 4)]}
