"""A replica's round trips to its shared store: a read waits for no other call's append, and a call
past its deadline gives up (UNAVAILABLE) without reaching the store."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from _shared_store import Journal, SharedStore

from croupier.core.api import JoinRequest
from croupier.core.errors import Unavailable
from croupier.core.spec import Spec
from croupier.server._coordinator import Coordinator
from croupier.server._deadline import Budget
from croupier.server._pg_store import PostgresStore
from croupier.server._store import Recovered, StoreUnavailable

#: The fixtures postgres (the session's server) and postgres_url (a fresh database per test).
pytest_plugins = ["_postgres"]

SPEC = Spec(n=600, seed=5)


class HeldStore(SharedStore):
    """A replica's connection whose appends can be held (on an Event), whose journal end a watch
    always knows (``Watched``), and which notes the thread of each round trip."""

    def __init__(self, journal: Journal, name: str) -> None:
        super().__init__(journal, name)
        self.go = threading.Event()
        self.go.set()
        self.appending = threading.Event()
        self.callers: list[str] = []

    def _trip(self) -> None:
        self.callers.append(threading.current_thread().name)

    def known_last(self, max_age_s: float) -> int | None:
        with self.j.lock:
            return len(self.j.records)

    def last_seq(self, *, deadline: float | None = None) -> int:
        self._trip()
        return super().last_seq(deadline=deadline)

    def read_since(self, seq: int, *, deadline: float | None = None) -> Recovered:
        self._trip()
        return super().read_since(seq, deadline=deadline)

    def append_at(self, expected_last: int, records: Sequence[bytes], *, deadline: float | None = None) -> int:
        self._trip()
        self.appending.set()
        assert self.go.wait(60.0), "the append was never let go"
        return super().append_at(expected_last, records, deadline=deadline)


@contextlib.contextmanager
def _append_held(staleness_s: float) -> Iterator[tuple[Coordinator, HeldStore, int]]:
    """A replica serving job j's started generation, while another call's append (a join of job
    `other`) is held in the store; let go at the end."""
    store = HeldStore(Journal(), "r0")
    core = Coordinator(store, max_staleness_s=staleness_s)  # type: ignore[arg-type]
    gen = core.join(JoinRequest("j", SPEC, "t1", 1, 0)).generation
    store.go.clear()
    store.appending.clear()
    slow = threading.Thread(target=core.join, args=(JoinRequest("other", SPEC, "t1", 1, 0),), name="slow-append")
    slow.start()
    try:
        assert store.appending.wait(10.0), "the join never appended"
        yield core, store, gen
    finally:
        store.go.set()
        slow.join()
        core.close()


def _in_thread(name: str, fn: Callable[[], Any], within_s: float) -> Any:
    """`fn()`'s value (or the exception it raised) from a thread of its own; fails past `within_s`."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:  # returned: the test looks at it
            out.append(e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(within_s)
    assert not t.is_alive(), f"{name} was not answered within {within_s} s: it waited for another call's append"
    return out[0]


def test_reads_are_answered_while_another_calls_append_is_held() -> None:
    """A grant, a lease and a job's status on the same replica are answered from its state at once.

    Fails with the coordinator's lock held across the append: each waits for the append to end.
    """
    with _append_held(staleness_s=1.0) as (core, store, gen):
        t0 = time.monotonic()
        grant = _in_thread("grant", lambda: core.grant("j", gen, 0, 0, 0, 4), 5.0)
        took = time.monotonic() - t0
        assert grant.batches == 4 and took < 1.0, (grant, took)
        assert len(_in_thread("lease", lambda: core.lease("j", gen, 0, 0, 4, 4), 5.0).indices) > 0
        assert _in_thread("job", lambda: core.job("j"), 5.0).result.generation == gen
        assert store.callers.count("grant") == store.callers.count("lease") == store.callers.count("job") == 0


def test_a_call_whose_deadline_passes_while_another_appends_never_reaches_the_store() -> None:
    """A join and a grant that must ask the store (no staleness bound) wait for the replica's append in
    flight no longer than their deadline: UNAVAILABLE, and they never call the store, not even later.

    Fails with the coordinator's lock held across the append: they wait for it whatever their deadline.
    """

    def late(call: Callable[[Budget], Any]) -> Callable[[], Any]:
        return lambda: call(Budget(time.monotonic() + 0.3))

    with _append_held(staleness_s=0.0) as (core, store, gen):
        calls: list[tuple[str, Callable[[Budget], Any]]] = [
            ("late-join", lambda b: core.join(JoinRequest("third", SPEC, "t1", 1, 0), b)),
            ("late-grant", lambda b: core.grant("j", gen, 0, 0, 0, 4, budget=b))]
        for name, call in calls:
            t0 = time.monotonic()
            out = _in_thread(name, late(call), 5.0)
            assert isinstance(out, Unavailable) and "deadline passed" in str(out), out
            assert 0.25 <= time.monotonic() - t0 < 2.0
    assert [c for c in store.callers if c.startswith("late-")] == []
    assert core.failed is None


def test_a_call_whose_caller_is_gone_never_reaches_the_store() -> None:
    """Past its deadline (the client gave up), a call is UNAVAILABLE before any round trip, and changes nothing."""
    store = HeldStore(Journal(), "r0")
    core = Coordinator(store)  # type: ignore[arg-type]
    try:
        gen = core.join(JoinRequest("j", SPEC, "t1", 1, 0)).generation
        before, state = len(store.callers), core.snapshot_state()
        gone = Budget(time.monotonic() - 1.0)
        calls: list[Callable[[], Any]] = [
            lambda: core.join(JoinRequest("j", SPEC, "t2", 1, 0), gone),
            lambda: core.grant("j", gen, 0, 0, 0, 4, budget=gone),
            lambda: core.report("j", gen, 0, 0, 3, budget=gone),
            lambda: core.job("j", gone),
            lambda: core.poll(gone),
        ]
        for call in calls:
            with pytest.raises(Unavailable, match="deadline passed"):
                call()
        assert len(store.callers) == before and core.snapshot_state() == state
        assert core.job("j").result.generation == gen
    finally:
        core.close()


def test_a_postgres_checkout_waits_no_longer_than_the_calls_deadline(postgres_url: str) -> None:
    """With every pooled connection in use, a call waits for one until its deadline, not the store's
    5 s timeout; past its deadline it asks for none."""
    store = PostgresStore(postgres_url, timeout=5.0)
    busy = [store._pool.getconn() for _ in range(store._pool.max_size)]
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="left to the call's deadline"):
            store.last_seq(deadline=t0 + 0.3)
        assert time.monotonic() - t0 < 1.5
        with pytest.raises(StoreUnavailable, match="deadline passed"):
            store.last_seq(deadline=time.monotonic() - 1.0)
    finally:
        for conn in busy:
            store._pool.putconn(conn)
        store.close()


class HeldPostgres(PostgresStore):
    """A PostgreSQL store whose appends wait (on an Event) before they reach the database, as over a slow link."""

    go = threading.Event()
    appending = threading.Event()

    def append_at(self, expected_last: int, records: Sequence[bytes], *, deadline: float | None = None) -> int:
        self.appending.set()
        assert self.go.wait(60.0), "the append was never let go"
        return super().append_at(expected_last, records, deadline=deadline)


def test_a_replica_on_postgres_grants_while_its_append_is_held(postgres_url: str) -> None:
    """The same on PostgreSQL, with the journal's end confirmed by the store's watch: a grant is
    answered from the state at once while a join's append waits. Fails with the lock held across the append."""
    store = HeldPostgres(postgres_url)
    store.go, store.appending = threading.Event(), threading.Event()
    store.go.set()
    core = Coordinator(store, max_staleness_s=5.0)
    slow = None
    try:
        gen = core.join(JoinRequest("j", SPEC, "t1", 1, 0)).generation
        core.grant("j", gen, 0, 0, 0, 4)  # starts the watch
        confirmed_by = time.monotonic() + 10.0
        while store.known_last(5.0) is None:  # until its first heartbeat is answered
            assert time.monotonic() < confirmed_by, "the watch never confirmed the journal's end"
        store.go.clear()
        store.appending.clear()
        slow = threading.Thread(target=core.join, args=(JoinRequest("other", SPEC, "t1", 1, 0),), name="slow-append")
        slow.start()
        assert store.appending.wait(10.0)
        t0 = time.monotonic()
        assert _in_thread("grant", lambda: core.grant("j", gen, 0, 0, 4, 4), 5.0).batches == 4
        assert time.monotonic() - t0 < 1.0
    finally:
        store.go.set()
        if slow is not None:
            slow.join()
        core.close()
