"""The linearizability checker of generations (tools/linearize.py): it accepts what is linearizable, catches a
stale read, and agrees with a brute-force oracle on random small histories."""

from __future__ import annotations

import itertools
import math
import pathlib

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from croupier.tools.linearize import Call, Recorder, _accepts, check, load


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


@settings(max_examples=400, deadline=None)
@given(histories())
def test_the_checker_agrees_with_the_brute_force_oracle(h: list[Call]) -> None:
    assert check(h).ok == _oracle(h)


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
