"""A job's generations as the coordinator numbers and times them: a store that lost the job's history numbers its
generations apart from every earlier store's, so the step ledger answers right after; each start's time is
decided once, in its event."""

from __future__ import annotations

from pathlib import Path

import pytest
from _ledger_run import generation

from croupier.core.api import JoinRequest, now_ms
from croupier.core.cursor import Cursor
from croupier.core.errors import FailedPrecondition
from croupier.core.spec import Spec
from croupier.server._coordinator import Coordinator
from croupier.server._decide import NUMBERS_PER_MS, decide_join, next_number
from croupier.server._events import decode_event, encode_event
from croupier.server._state import State
from croupier.server._stores import open_store

JOB = "lost"
SPEC = Spec(n=400, seed=3, batch_size=2)


def test_a_store_that_lost_the_job_numbers_its_generations_apart_and_the_ledger_answers_right() -> None:
    """Store A: generation 1 (1 rank) checkpoints at steps 4 and 8, generation 2 (2 ranks) resumes at 8 and
    checkpoints at 12. A is lost. Store B: b1 resumes from A's older state at step 4 (a rollback) and checkpoints
    at 8 and 12, b2 resumes from b1's step 12 and trains to 16, then b3 rolls back to A's last state (step 12,
    taken by A's generation 2). B knows nothing before step 12 on b3's timeline: A's steps. Had B numbered
    from 1 again, b2 would be generation 2, the number b3's checkpoint names, and the ledger would keep b1's
    steps 5-12 (trained on another timeline) as if they were A's."""
    a = Coordinator(open_store("memory://"))
    first = generation(a, "a1", 1, 8, checkpoints=(4, 8), job=JOB, spec=SPEC)
    second = generation(a, "a2", 2, 4, first[8], checkpoints=(12,), job=JOB, spec=SPEC)
    old = {s.generation for s in a.step_ledger(JOB).segments}
    a.close()
    assert old == {1, 2} and second[12][2] == 2

    b = Coordinator(open_store("memory://"))  # a fresh store: the job comes back from its checkpoints alone (G6)
    x = generation(b, "b1", 1, 8, first[4], checkpoints=(8, 12), job=JOB, spec=SPEC)
    generation(b, "b2", 1, 4, x[12], checkpoints=(16,), job=JOB, spec=SPEC)
    generation(b, "b3", 2, 2, second[12], job=JOB, spec=SPEC)
    ledger = b.step_ledger(JOB)
    numbers = {s.incarnation: s.generation for s in ledger.segments}
    b.close()
    for t in (5, 10, 12):  # A's history: B cannot place it
        with pytest.raises(FailedPrecondition, match="missing"):
            ledger.step(t)
    rec = ledger.step(14)
    assert rec.kept is not None and rec.kept.incarnation == "b3"
    assert [v.incarnation for v in rec.abandoned] == ["b2"]
    # A sample b1 trained at step 10 (its 6th step) is found there, abandoned: b3 did not resume from b1.
    sample = int(ledger.step(14).abandoned[0].batches[0].indices[0])
    found = [o for o in ledger.index(sample) if o.generation == numbers["b2"] and o.step == 14]
    assert found and not found[0].kept
    assert all(not o.kept for o in ledger.index(sample) if o.generation in (numbers["b1"], numbers["b2"]))
    assert not set(numbers.values()) & old, f"store B reused a number of store A: {numbers}"
    assert numbers["b1"] < numbers["b2"] < numbers["b3"]


def test_a_generation_is_numbered_past_the_job_and_past_the_checkpoint_it_resumes_from() -> None:
    """Within a store the numbers count up from the job's current one (or from the checkpoint's generation, if
    newer); a store that does not hold the job numbers a resumed one from the time, in microseconds."""
    at = 1_700_000_000_000
    s = State()
    for ev in decide_join(s, JoinRequest("j", SPEC, "t1", 1, 0), at):
        s.apply(ev)
    assert s.current("j").number == 1  # a fresh job, no checkpoint: from 1
    resume = Cursor(0, ((20, 400),))
    assert next_number(s.jobs["j"], JoinRequest("j", SPEC, "t2", 1, 0, resume, resume_generation=1), at) == 2
    assert next_number(s.jobs["j"], JoinRequest("j", SPEC, "t2", 1, 0, resume, resume_generation=7), at) == 8
    fresh_store = next_number(None, JoinRequest("j", SPEC, "t2", 1, 0, resume, resume_generation=7), at)
    assert fresh_store == at * NUMBERS_PER_MS


def test_a_generation_start_records_its_time_once_and_a_replay_gives_it_back(tmp_path: Path) -> None:
    """The time is the start event's: recorded in the ledger's segment, the same after the journal is replayed."""
    url = f"sqlite:///{tmp_path}/c.db"
    core = Coordinator(open_store(url))
    before = now_ms()
    core.join(JoinRequest(JOB, SPEC, "t1", 1, 0))
    after = now_ms()
    at = core.step_ledger(JOB).segments[0].at_ms
    core.close()
    assert before <= at <= after
    again = Coordinator(open_store(url))  # replays the journal
    try:
        assert again.step_ledger(JOB).segments[0].at_ms == at
        assert again.step_ledger(JOB).timeline()[0]["at_ms"] == at
    finally:
        again.close()
    # The value travels in the event: a state rebuilt from the encoded events has it, whatever the clock says now.
    s, rebuilt = State(), State()
    for ev in decide_join(s, JoinRequest(JOB, SPEC, "t1", 1, 0), 1234):
        s.apply(ev)
        rebuilt.apply(decode_event(encode_event(ev)))
    assert s.jobs[JOB].ledger[0].at_ms == rebuilt.jobs[JOB].ledger[0].at_ms == 1234
