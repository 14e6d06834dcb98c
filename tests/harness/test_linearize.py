"""The linearizability checker of generations (harness/linearize.py): it accepts what is linearizable, catches a
stale read, and agrees with a brute-force oracle on random small histories."""

from __future__ import annotations

import itertools
import math
import pathlib
import time

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from croupier.client._rpc import CoordinatorClient
from croupier.core import errors as E
from croupier.core.api import JoinRequest
from croupier.core.order import Cursor
from croupier.core.spec import Spec
from croupier.harness.linearize import Call, Recorder, _accepts, _search, check, load
from croupier.server._service import Server
from tests._budget import examples


def C(kind: str, g: int, outcome: str, t0: float, t1: float, who: str = "p", job: str = "j") -> Call:
    return Call(who, job, kind, g, outcome, t0, t1)


def test_a_sequential_history_of_two_generations_is_linearizable() -> None:
    h = [C("join", 1, "ok", 0, 1), C("grant", 1, "ok", 2, 3), C("checkpoint", 1, "ok", 4, 5),
         C("join", 2, "ok", 6, 7), C("grant", 1, "fenced", 8, 9), C("grant", 2, "ok", 10, 11)]
    v = check(h)
    assert v.ok and v.jobs == 1 and v.calls == 6


def test_a_planted_stale_read_is_caught() -> None:
    """A grant of generation 1 answered ok after a join that opened generation 2 had returned: the read
    saw a replaced generation."""
    h = [C("join", 1, "ok", 0, 1, "a"), C("join", 2, "ok", 2, 3, "b"), C("grant", 1, "ok", 4, 5, "a")]
    v = check(h)
    assert not v.ok and v.job == "j" and "grant(g=1) ok" in v.why
    # Overlapping the join, the same grant may have taken effect before it: linearizable.
    assert check([C("join", 1, "ok", 0, 1, "a"), C("join", 2, "ok", 2, 5, "b"), C("grant", 1, "ok", 4, 6, "a")]).ok
    # Within a replica's staleness bound of the join's return, it is allowed; past it, not.
    assert check(h, stale_s=2.5).ok and not check(h, stale_s=0.5).ok


def test_a_lost_acknowledged_join_is_caught() -> None:
    """Two ranks told they joined generation 1, then a third told it opened 1 again: one answer was lost."""
    h = [C("join", 1, "ok", 0, 1, "a"), C("join", 2, "ok", 2, 3, "b"), C("join", 1, "ok", 4, 5, "c")]
    assert not check(h).ok


def test_a_call_without_an_answer_may_have_taken_effect_or_not() -> None:
    took = [C("join", 1, "ok", 0, 1), C("join", 2, "unknown", 2, math.inf), C("grant", 1, "fenced", 5, 6)]
    did_not = [C("join", 1, "ok", 0, 1), C("join", 2, "unknown", 2, math.inf), C("grant", 1, "ok", 5, 6)]
    assert check(took).ok and check(did_not).ok
    with pytest.raises(ValueError, match="a join is ok"):
        C("join", 1, "fenced", 0, 1)
    with pytest.raises(ValueError, match="returned 0 before it was invoked at 1"):
        C("grant", 1, "ok", 1, 0)


def test_jobs_are_checked_apart() -> None:
    h = [C("join", 1, "ok", 0, 1, job="x"), C("join", 1, "ok", 0, 1, job="y"), C("grant", 1, "ok", 2, 3, job="y")]
    assert check(h).ok and check(h).jobs == 2


def _oracle(calls: list[Call]) -> bool:
    """Every subset of the unknown calls, every order: the definition, for small histories."""
    unknown = [c for c in calls if c.outcome == "unknown"]
    for k in range(len(unknown) + 1):
        for dropped in itertools.combinations(unknown, k):
            kept = [c for c in calls if c not in dropped]
            for order in itertools.permutations(kept):
                if any(b.returned < a.invoked for i, a in enumerate(order) for b in order[i + 1:]):
                    continue  # breaks real time: b returned before a was invoked, yet comes after it
                state = 0
                for c in order:
                    nxt = _accepts(c, state)
                    if nxt is None:
                        break
                    state = nxt
                else:
                    return True
    return False


@st.composite
def histories(draw: st.DrawFn) -> list[Call]:
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        kind = draw(st.sampled_from(["join", "grant", "checkpoint"]))
        outcome = draw(st.sampled_from(["ok", "unknown"] if kind == "join" else ["ok", "fenced", "unknown"]))
        t0 = draw(st.integers(0, 10))
        t1 = math.inf if outcome == "unknown" else t0 + draw(st.integers(0, 6))
        out.append(C(kind, draw(st.integers(0, 3)), outcome, float(t0), float(t1), who=f"p{i}"))
    return out


@pytest.mark.exhaustive  # 3,000 histories: in make test, not in make check
@settings(max_examples=examples(3000), deadline=None)
@given(histories())
def test_the_checker_agrees_with_the_brute_force_oracle(h: list[Call]) -> None:
    assert check(h).ok == _oracle(h) == _search(h, 0.0)


def test_a_recorder_writes_what_load_reads(tmp_path: pathlib.Path) -> None:
    r = Recorder(str(tmp_path / "h.jsonl"), "rank0")
    with r.call("j", "join") as out:
        out["generation"] = 1
    with pytest.raises(TimeoutError), r.call("j", "grant", 1):
        raise TimeoutError
    with r.call("j", "grant", 0) as out:
        out["outcome"] = "fenced"
    calls = load([str(tmp_path / "h.jsonl")])
    assert [(c.kind, c.generation, c.outcome, math.isinf(c.returned)) for c in calls] == [
        ("join", 1, "ok", False), ("grant", 1, "unknown", True), ("grant", 0, "fenced", False)]
    assert check(calls).ok


def test_a_clients_call_log_records_what_the_checker_reads(server: Server, tmp_path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """CROUPIER_CALL_LOG: joins, grants (answered and fenced) and checkpoint reports of a real client, recorded
    with their times and read back; the history is linearizable, and one planted stale grant makes it not."""
    monkeypatch.setenv("CROUPIER_CALL_LOG", str(tmp_path / "calls"))
    spec = Spec(n=100, batch_size=10)
    with CoordinatorClient(server.address, retry_for=5.0) as c:
        g1 = c.join_started(JoinRequest("j", spec, "a", 1, 0), timeout=20).generation
        c.grant("j", g1, 0, 0, 0, 2)
        c.report("j", g1, 0, (0, 2), checkpoint=(2, Cursor(0, ((20, 100),), 0), "step-2"))
        c.report("j", g1, 0, (0, 3))  # progress alone: advisory, not recorded
        g2 = c.join_started(JoinRequest("j", spec, "b", 1, 0), timeout=20).generation
        with pytest.raises(E.Aborted):
            c.grant("j", g1, 0, 0, 2, 2)
        c.grant("j", g2, 0, 0, 0, 2)
    files = [str(f) for f in (tmp_path / "calls").glob("*.jsonl")]
    calls = sorted(load(files), key=lambda c: c.invoked)
    assert [(c.kind, c.generation, c.outcome) for c in calls] == [
        ("join", g1, "ok"), ("grant", g1, "ok"), ("checkpoint", g1, "ok"), ("join", g2, "ok"), ("grant", g1, "fenced"),
        ("grant", g2, "ok")]
    assert check(calls).ok
    # A join is on record from its invocation: a process killed before the answer leaves it without one.
    lines = [ln for f in files for ln in pathlib.Path(f).read_text().splitlines()]
    first = next(ln for ln in lines if '"call"' in ln)
    (tmp_path / "killed.jsonl").write_text(first + "\n")
    assert [(c.kind, c.outcome) for c in load([str(tmp_path / "killed.jsonl")])] == [("join", "unknown")]
    late = time.monotonic()
    planted = Call("zombie", "j", "grant", g1, "ok", late, late + 0.001)  # answered for g1 long after g2 opened
    assert not check([*calls, planted]).ok
