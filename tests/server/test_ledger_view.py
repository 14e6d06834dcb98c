"""What the status page shows of a job's step ledger (server/_ledger_view.py) and the endpoints that serve it: the
timeline's bands and marks, the realized mix by window of steps (a bounded sample), a step's samples (bounded),
and the errors (404 for an unknown job, 400 for a bad step, with the message)."""

from __future__ import annotations

import json
import pathlib
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _ledger_run import JOB, SPEC, generation, run

from croupier.core.api import JoinRequest
from croupier.core.cursor import fresh
from croupier.core.errors import InvalidArgument
from croupier.core.ledger import Ledger, fresh_segment
from croupier.core.spec import Spec
from croupier.server import Server, ServerOptions, _ledger_view
from croupier.server._coordinator import Coordinator
from croupier.server._ledger_view import MIX_SAMPLES, MIX_STEPS, MIX_WINDOWS, ledger_json, mix, step_json
from croupier.server._memory_store import MemoryStore


@pytest.fixture(scope="module")
def core() -> Iterator[Coordinator]:
    c = Coordinator(MemoryStore())
    try:
        run(c)
        yield c
    finally:
        c.close()


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[Server]:
    s = Server(f"sqlite:///{tmp_path}/c.db", options=ServerOptions(metrics_port=0)).start()
    try:
        yield s
    finally:
        s.stop(grace=0.5)


def test_the_timeline_has_a_band_per_generation_and_marks_what_changed(core: Coordinator) -> None:
    got = ledger_json(core.step_ledger(JOB))
    bands = [(s["generation"], s["world"], s["from_step"], s["to_step"], s["kept_to"]) for s in got["segments"]]
    assert bands == [(1, 2, 0, 20, 10), (2, 3, 10, 25, 25), (3, 3, 25, 33, 33), (4, 3, 33, 40, 40)]
    assert [s["amendments"] for s in got["segments"]] == [0, 0, 1, 1]
    assert (got["last_step"], got["furthest_step"], got["sources"]) == (40, 40, 2)
    marks = got["marks"]
    assert [(m["kind"], m["generation"], m["previous"], m["step"]) for m in marks] == [
        ("resize", 2, 1, 10), ("rollback", 2, 1, 10), ("amendment", 3, 2, 25)]  # generation 4 changed nothing
    assert (marks[0]["from_world"], marks[0]["to_world"], marks[1]["from_step"]) == (2, 3, 20)
    assert marks[2]["removed"] == 0 and len(marks[2]["added"]) == 1 and marks[2]["added"][0].startswith("weights [")


def test_the_mix_is_the_share_of_each_source_in_the_kept_steps(core: Coordinator) -> None:
    ledger = core.step_ledger(JOB)
    got = mix(ledger)
    assert got is not None
    assert (got["sources"], got["windows"], got["steps_per_window"], got["samples_per_window"]) == (
        2, MIX_WINDOWS, MIX_STEPS, MIX_SAMPLES)
    series = got["series"]
    # 40 kept steps in 32 windows of one or two steps, each step of 4 or 6 samples: every step is sampled
    assert [t for w in series for t in w["steps"]] == list(range(1, 41))
    assert all(w["steps"] == list(range(w["first"], w["last"] + 1)) for w in series)
    for w in series:
        want = np.zeros(2, dtype=np.int64)
        for t in w["steps"]:
            kept = ledger.step(t).kept
            assert kept is not None
            want += np.bincount(kept.indices >= 120, minlength=2)  # source 0 holds indices 0..119
        assert w["samples"] == int(want.sum()) and w["shares"] == pytest.approx((want / want.sum()).tolist())
    # the weights, 1:3 until generation 3 dealt 3:1 from step 26
    before = np.mean([w["shares"][0] for w in series if w["last"] <= 25])
    after = np.mean([w["shares"][0] for w in series if w["first"] > 25])
    assert before == pytest.approx(0.25, abs=0.05) and after == pytest.approx(0.75, abs=0.05)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps Ledger.step is asked for from now on."""
    asked: list[int] = []
    step = Ledger.step

    def counted(self: Ledger, t: int) -> Any:
        asked.append(t)
        return step(self, t)

    monkeypatch.setattr(Ledger, "step", counted)
    return asked


def test_the_mix_of_a_long_run_computes_a_bounded_number_of_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    seg = fresh_segment(SPEC, 1, "a", 2)
    for epoch in range(200):
        seg.report(epoch, 90)  # every batch of 200 epochs: 18,000 steps of 4 samples
    ledger = Ledger("long", SPEC, [seg])
    asked = _counting(monkeypatch)
    got = mix(ledger)
    assert got is not None and ledger.last_step == 18_000
    series = got["series"]
    assert len(series) == MIX_WINDOWS and len(asked) == len(set(asked)) == MIX_WINDOWS * MIX_STEPS
    assert series[0]["first"] == 1 and series[-1]["last"] == 18_000
    assert all(a["last"] + 1 == b["first"] for a, b in zip(series, series[1:]))  # the windows tile the kept steps
    for w in series:
        gaps = np.diff([w["first"] - 1, *w["steps"], w["last"] + 1])
        assert len(w["steps"]) == MIX_STEPS and gaps.max() - gaps.min() <= 72  # spread evenly over its 562 or 563 steps
        assert w["samples"] == 4 * MIX_STEPS and w["shares"] == pytest.approx([0.25, 0.75], abs=0.1)


def test_a_mix_of_large_steps_computes_one_step_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = Spec(n=2048 * 40, seed=3, batch_size=256, sources=(2048 * 10, 2048 * 30), weights=SPEC.weights)
    seg = fresh_segment(spec, 1, "a", 8)  # 2,048 samples a step
    seg.report(0, 40)
    asked = _counting(monkeypatch)
    got = mix(Ledger("wide", spec, [seg]))
    assert got is not None
    assert [len(w["steps"]) for w in got["series"]] == [1] * MIX_WINDOWS and len(asked) == MIX_WINDOWS
    # the one step taken is the first candidate: the bit-reversed order begins with the window's first
    assert all(w["steps"] == [w["first"]] and w["samples"] == 2048 for w in got["series"])
    assert all(w["shares"] == pytest.approx([0.25, 0.75], abs=0.01) for w in got["series"])


def test_a_job_of_one_source_has_no_mix() -> None:
    spec = Spec(n=50, batch_size=2)
    seg = fresh_segment(spec, 1, "a", 1)
    seg.report(0, 10)
    got = ledger_json(Ledger("one", spec, [seg]))
    assert mix(Ledger("one", spec, [seg])) is None and got["sources"] is None and got["marks"] == []
    assert [(s["from_step"], s["to_step"], s["kept_to"]) for s in got["segments"]] == [(0, 10, 10)]


def test_a_steps_samples_are_the_ledgers_bounded(core: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = core.step_ledger(JOB)
    rec = ledger.step(15).to_dict()  # kept by generation 2, abandoned by generation 1
    got = step_json(ledger, "15", "1000")
    assert got["shown"] == 1000
    for want, have in zip([rec["kept"], *rec["abandoned"]], [got["kept"], *got["abandoned"]], strict=True):
        assert have["batch_count"] == len(want["batches"]) and have["samples"] == sum(len(b["indices"]) for b in want["batches"])
        assert [b.pop("count") for b in have["batches"]] == [len(b["indices"]) for b in want["batches"]]
        del have["batch_count"], have["samples"]
        assert have == want
    one = step_json(ledger, 15, 1)
    assert [(b["indices"], b["seeds"], b["count"]) for b in one["kept"]["batches"]] == [
        (b["indices"][:1], b["seeds"][:1], 2) for b in rec["kept"]["batches"]]
    monkeypatch.setattr(_ledger_view, "MAX_STEP_BATCHES", 2)
    cut = step_json(ledger, 15)["kept"]
    assert (len(cut["batches"]), cut["batch_count"], cut["samples"]) == (2, 3, 6)


@pytest.mark.parametrize("step, samples, message", [
    (0, 1, "step must be an int >= 1 (steps count from 1, as the trainers log them; got step=0)"),
    ("-3", 1, "step must be an int >= 1 (steps count from 1, as the trainers log them; got step='-3')"),
    ("1.5", 1, "got step='1.5'"), ("--5", 1, "got step='--5'"), (" 7", 1, "got step=' 7'"), ("\u0667", 1, "got step='\u0667'"),
    (None, 1, "got step=None"), (True, 1, "got step=True"),
    (3, 0, "samples must be an int in [1, 1000] (got samples=0)"), (3, "many", "(got samples='many')"),
    (3, 1001, "(got samples=1001)")])
def test_a_bad_step_or_bound_is_refused_naming_it(core: Coordinator, step: Any, samples: Any, message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        step_json(core.step_ledger(JOB), step, samples)
    assert message in str(e.value)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_endpoints_serve_the_ledger_and_its_steps(server: Server) -> None:
    run(server.core)
    base = f"http://{server.metrics_address}"
    status, body = _get(f"{base}/api/ledger?job={JOB}")
    assert status == 200 and json.loads(body) == json.loads(json.dumps(ledger_json(server.core.step_ledger(JOB))))
    status, body = _get(f"{base}/api/mix?job={JOB}")
    assert status == 200 and json.loads(body) == json.loads(json.dumps(mix(server.core.step_ledger(JOB))))
    status, body = _get(f"{base}/api/step?job={JOB}&step=12&samples=1")
    assert status == 200 and json.loads(body) == json.loads(json.dumps(step_json(server.core.step_ledger(JOB), 12, 1)))


def test_the_endpoints_answer_a_bad_question_with_its_status_and_message(server: Server) -> None:
    run(server.core)
    # a job whose history starts at a checkpoint of step 5 (a coordinator rebuilt from checkpoints)
    generation(server.core, "late", 1, 2, (fresh(SPEC, 0), 5, None, ()), job="late")  # type: ignore[arg-type]
    server.core.join(JoinRequest("waiting", SPEC, "a", 2, 0))  # one rank of two: no generation started
    before = server.core.snapshot_state()
    base = f"http://{server.metrics_address}"
    cases = [
        ("/api/ledger?job=nope", 404, "job 'nope' is not known to this coordinator"),
        ("/api/step?job=nope&step=1", 404, "job 'nope' is not known to this coordinator"),
        ("/api/mix?job=nope", 404, "job 'nope' is not known to this coordinator"),
        ("/api/ledger", 400, "job= is missing: /api/ledger?job=NAME"),
        ("/api/step?step=1", 400, "job= is missing: /api/step?job=NAME"),
        (f"/api/step?job={JOB}&step=0", 400, "step must be an int >= 1 (steps count from 1, as the trainers log them; got step='0')"),
        (f"/api/step?job={JOB}&step=x7", 400, "got step='x7'"),
        (f"/api/step?job={JOB}", 400, "got step=None"),
        (f"/api/step?job={JOB}&step=41", 400, f"step 41 is past the run: job {JOB!r} has trained 40 steps"),
        (f"/api/step?job={JOB}&step=3&samples=0", 400, "samples must be an int in [1, 1000] (got samples='0')"),
        ("/api/step?job=late&step=3", 409, "the history before step 6 is missing"),
        ("/api/step?job=waiting&step=1", 409, "job 'waiting' has no generation that started: no step was trained yet"),
        ("/api/step?job=" + "x" * 5000 + "&step=1", 400, "job name"),
    ]
    for path, status, message in cases:
        got_status, got_body = _get(base + path)
        assert (got_status, message in got_body) == (status, True), (path, got_status, got_body)
    assert server.core.snapshot_state() == before  # a question changes nothing
    status, body = _get(f"{base}/api/ledger?job=waiting")
    assert status == 200 and (json.loads(body)["segments"], json.loads(body)["last_step"]) == ([], 0)
    assert json.loads(_get(f"{base}/api/mix?job=waiting")[1])["series"] == []
    assert _get(f"{base}/api/step?job=late&step=7")[0] == 200
