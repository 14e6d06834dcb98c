"""Several torchrun nodes resized in place: a worker kill, a node joining, a node lost, a preemption; audited.

This is ``croupier demo`` itself: two, then three torchrun agents on
127.0.0.1 sharing one c10d rendezvous stand in for nodes. It passes only when the audit finds G1
for every epoch (all finished), the coordinator saw exactly the planned generations (a live rank
that croupier fenced would cost an unplanned restart), and no live rank raised a croupier error.
"""

from __future__ import annotations

import pathlib

import pytest

from croupier.demos import demo

pytestmark = pytest.mark.e2e  # several processes


@pytest.mark.timeout(900)
# NOTE: the standalone coordinator's run (the same story, 90 s) is in `make slow`; the suite runs the demo's default.
@pytest.mark.parametrize("coordinator", ["embedded", pytest.param("standalone", marks=pytest.mark.slow)])
def test_worker_kill_scale_up_scale_down_in_place_then_preemption(
    tmp_path: pathlib.Path, coordinator: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # NOTE: the demo's own size. A node's agent takes a few seconds (tens under load) to start
    # and join; the job must still be training by then, or the story cannot happen in place.
    code = demo.main(str(tmp_path / "demo"), coordinator=coordinator)
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert f"{demo.PLANNED_GENERATIONS} generations (planned: {demo.PLANNED_GENERATIONS})" in out
    assert "croupier errors in live ranks: 0" in out
    assert "5 finished epochs audited" in out


def test_the_story_plans_every_kind_of_change() -> None:
    """The story the test runs: a worker kill, a node joining, a node lost, in place, then a preemption."""
    kinds = [e.kind for e in demo.STORY]
    assert kinds == ["kill_worker", "add_node", "lose_node", "preempt"]
    assert [e.world for e in demo.STORY] == [2, 2, 3, 2]
