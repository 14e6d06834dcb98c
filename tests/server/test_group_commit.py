"""Group commit on a single-writer store: concurrent durable commits share one append, and none is answered before it.

The store here wraps a real ``SqliteStore`` and writes, into one log, when each append became
durable (its fsync returned) and which jobs' events it carried; the callers write when their
commit was answered. Journal before reply holds when every answer comes after the append that
carried its events.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import msgpack
import pytest

from croupier.core.api import JoinRequest, now_ms
from croupier.core.spec import Spec
from croupier.server._commits import WriterCommits
from croupier.server._coordinator import Coordinator
from croupier.server._deadline import UNBOUNDED
from croupier.server._decide import decide_join
from croupier.server._events import decode_event
from croupier.server._sqlite_store import SqliteStore
from croupier.server._state import State
from croupier.server._store import Recovered

SPEC = Spec(n=40, seed=1, batch_size=4)
#: How long an append waits, before its fsync, for an answer to a caller whose events it carries. No
#: answer can come while the writer is right (the test then waits this long per append); a writer that
#: answers before its fsync is caught in the act.
WINDOW_S = 0.2
#: How long anything in these tests may take before it counts as hung.
HUNG_S = 60.0


class Witnessed:
    """A ``Store`` over a ``SqliteStore`` that logs each durable append and the jobs it carried.

    Before it appends, it waits up to :data:`WINDOW_S` for an answer to one of the jobs it carries
    (there must be none), and, for the first append, until :attr:`hold_first` says go (the test
    gathers concurrent callers behind it).
    """

    shared = False

    def __init__(self, inner: SqliteStore) -> None:
        self.inner, self.url = inner, inner.url
        self.cond = threading.Condition()
        #: ("durable", jobs) once an append returned; ("answered", job) once a caller got its answer.
        self.log: list[tuple[str, frozenset[str]]] = []
        self.appends = 0
        self.hold_first: Callable[[], bool] = lambda: True

    def answered(self, job: str) -> None:
        with self.cond:
            self.log.append(("answered", frozenset({job})))
            self.cond.notify_all()

    def append(self, records: Sequence[bytes]) -> int:
        jobs = frozenset(decode_event(msgpack.unpackb(r)).job for r in records)
        with self.cond:
            if self.appends == 0 and not self.cond.wait_for(self.hold_first, HUNG_S):
                raise RuntimeError("the callers never all decided")
            self.cond.wait_for(lambda: any(kind == "answered" and who <= jobs for kind, who in self.log), WINDOW_S)
        last = self.inner.append(records)
        with self.cond:
            self.appends += 1
            self.log.append(("durable", jobs))
            self.cond.notify_all()
        return last

    def append_at(self, expected_last: int, records: Sequence[bytes], *, deadline: float | None = None) -> int:
        raise AssertionError("a single writer appends with append")

    def last_seq(self, *, deadline: float | None = None) -> int:
        return self.inner.last_seq()

    def write_snapshot(self, seq: int, payload: bytes) -> None:
        self.inner.write_snapshot(seq, payload)

    def load(self) -> Recovered:
        return self.inner.load()

    def read_since(self, seq: int, *, deadline: float | None = None) -> Recovered:
        return self.inner.read_since(seq)

    def has_room(self) -> bool:
        return self.inner.has_room()

    def close(self) -> None:
        self.inner.close()


def early_answers(log: list[tuple[str, frozenset[str]]]) -> list[str]:
    """The jobs whose answer came before any durable append carried their events."""
    durable: set[str] = set()
    early: list[str] = []
    for kind, jobs in log:
        if kind == "durable":
            durable |= jobs
        else:
            early += sorted(jobs - durable)
    return early


def run_all(fns: list[Callable[[], None]]) -> None:
    """Runs every function in a thread of its own and waits for them all; re-raises the first error."""
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HUNG_S)
        assert not t.is_alive(), "a commit hung"
    if errors:
        raise errors[0]


def witnessed(tmp_path: Path) -> Witnessed:
    path = tmp_path / "journal.db"
    return Witnessed(SqliteStore(f"sqlite:///{path}", path))


@pytest.mark.parametrize("callers", [2, 16])
def test_concurrent_durable_commits_share_one_append_answered_after_it(tmp_path: Path, callers: int) -> None:
    store = witnessed(tmp_path)
    decided: set[str] = set()

    def changed(jobs: set[str] | None) -> None:  # under the protocol's lock, once a decision's events are applied
        with store.cond:
            decided.update(jobs or ())
            store.cond.notify_all()

    # The first append waits until every caller has decided: the others queue while it is "in flight".
    store.hold_first = lambda: len(decided) == callers
    commits = WriterCommits(store, State(), Recovered(None, 0, []), 10**6, changed, lambda took, n: None)
    commits.start()

    def caller(i: int) -> Callable[[], None]:
        def go() -> None:
            req = JoinRequest(f"job-{i}", SPEC, "t", 1, 0)
            commits.commit(lambda: (None, decide_join(commits.state, req, now_ms())), True, UNBOUNDED)
            store.answered(req.job)
        return go

    try:
        run_all([caller(i) for i in range(callers)])
    finally:
        commits.close()
        store.close()
    assert early_answers(store.log) == []
    assert sorted(j for kind, jobs in store.log if kind == "answered" for j in jobs) == sorted(
        f"job-{i}" for i in range(callers))
    # the first append carried one or more; everything queued meanwhile went into one more
    assert store.appends <= 2
    assert store.inner.commits == store.appends


def test_a_join_is_answered_only_after_its_events_are_durable(tmp_path: Path) -> None:
    """The whole join path (the coordinator over the writer): every answer after the append that carried the join."""
    store = witnessed(tmp_path)
    core = Coordinator(store)

    def join(i: int) -> Callable[[], None]:
        def go() -> None:
            core.join(JoinRequest(f"job-{i}", SPEC, "t", 1, 0))
            store.answered(f"job-{i}")
        return go

    try:
        run_all([join(i) for i in range(8)])
    finally:
        core.close()
    assert early_answers(store.log) == []
    assert len([kind for kind, _ in store.log if kind == "answered"]) == 8


def test_the_check_finds_an_answer_before_its_append() -> None:
    log = [("durable", frozenset({"a"})), ("answered", frozenset({"a"})), ("answered", frozenset({"b"})),
           ("durable", frozenset({"b", "c"})), ("answered", frozenset({"c"}))]
    assert early_answers(log) == ["b"]
