"""A torchft job's journal of format 7 (fixtures/make_journal_v7_ft.py) recovers into the one history, steps from 1 (G9)."""

from __future__ import annotations

import shutil
from pathlib import Path

from croupier.client import CoordinatorClient
from croupier.core.ftsteps import CommittedStep
from croupier.core.spec import Spec
from croupier.server._service import Server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SPEC = Spec(n=10, seed=5, permutation="feistel", batch_size=4)


def _check(address: str) -> None:
    with CoordinatorClient(address, retry_for=5.0) as client:
        led, record = client.history("ft")
        assert led.spec == SPEC and [r.run for r in record.runs] == ["fresh", "fresh>2"]
        assert [(r.run, r.parent, r.resumed) for r in record.runs] == [("fresh", "", 0), ("fresh>2", "fresh", 2)]
        # the reports said "2 steps committed before it" for the third step: the history numbers it 3
        assert [c.step for c in record.runs[0].steps] == [1, 2, 3, 4]
        assert [c.to_list() for c in record.runs[0].steps] == [[0, 0, 4, 1, 2], [1, 4, 8, 1, 2], [2, 8, 12, 3, 1],
                                                               [3, 12, 16, 3, 1]]
        assert sorted(c.step for c in record.runs[0].dropped) == [3, 4, 5]  # superseded by quorum 3
        assert led.last_step == 4
        one = led.step(2)
        assert one.kept is not None and one.kept.incarnation == "fresh" and one.kept.span == (4, 8)
        three = led.step(3)  # kept by the run that resumed at step 2; every other version abandoned
        assert three.kept is not None and (three.kept.incarnation, three.kept.quorum) == ("fresh>2", 7)
        assert sorted((v.incarnation, v.quorum) for v in three.abandoned) == [("fresh", 1), ("fresh", 3)]
        assert [r["kept_to"] for r in led.timeline()] == [2, 4]


def test_a_coordinator_recovers_a_torchft_jobs_format_7_journal_and_goes_on(tmp_path: Path) -> None:
    copy = tmp_path / "journal-v7-ft.db"
    shutil.copyfile(FIXTURES / "journal-v7-ft.db", copy)
    server = Server(f"sqlite:///{copy}").start()
    try:
        _check(server.address)
        with CoordinatorClient(server.address, retry_for=5.0) as client:  # it goes on: step 5 of run fresh>2
            assert client.commit_step("ft", SPEC, "fresh>2", "fresh", 2, "global", 4, CommittedStep(5, 16, 20, 7, 1))
    finally:
        server.stop(grace=0.5)
    again = Server(f"sqlite:///{copy}").start()
    try:
        with CoordinatorClient(again.address, retry_for=5.0) as client:
            led, _ = client.history("ft")
            five = led.step(5)
            assert led.last_step == 5 and five.kept is not None and five.kept.span == (16, 20)
    finally:
        again.stop(grace=0.5)
