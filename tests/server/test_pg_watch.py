"""Replicas on PostgreSQL answer grants without a query each, and never from a state older than their bound."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import psycopg
import pytest

from croupier.core.api import JoinRequest
from croupier.core.errors import Aborted
from croupier.core.spec import Spec
from croupier.server._coordinator import Coordinator
from croupier.server._deadline import Budget, WouldWait
from croupier.server._pg_store import PostgresStore
from croupier.server._pg_watch import APPLICATION, JournalWatch

#: The fixtures postgres (the session's server) and postgres_url (a fresh database per test).
pytest_plugins = ["_postgres"]

SPEC = Spec(n=4096, batch_size=4)

#: The budget of a grant answered on the event loop.
AT_ONCE = Budget(at_once=True)


class Counting(PostgresStore):
    """A PostgreSQL store that counts the journal-end queries its replica makes."""

    asked = 0

    def last_seq(self, *, deadline: float | None = None) -> int:
        self.asked += 1
        return super().last_seq(deadline=deadline)


def _replica(url: str, staleness_s: float) -> tuple[Coordinator, Counting]:
    store = Counting(url)
    return Coordinator(store, max_staleness_s=staleness_s), store


def _start(c: Coordinator, world: int, incarnation: str) -> int:
    """Every rank of a `world` joins through `c`; the generation's number."""
    for r in range(world):
        res = c.join(JoinRequest("j", SPEC, incarnation, world, r))
    assert res.start is not None
    return res.generation


def _until(check: Any, within_s: float) -> float:
    """Calls `check` until it returns True; the seconds that took (fails past `within_s`)."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < within_s, f"not within {within_s} s"
    return time.monotonic() - t0


def _aborted(c: Coordinator, generation: int) -> bool:
    try:
        c.grant("j", generation, 0, 0, 0, 1)
    except Aborted:
        return True
    return False


def test_a_watched_replica_answers_grants_without_asking_the_database(postgres_url: str) -> None:
    a, store = _replica(postgres_url, 0.5)
    try:
        gen = _start(a, 2, "t1")
        a.grant("j", gen, 0, 0, 0, 1)  # starts the watch
        _until(lambda: store.known_last(0.5) is not None, 10.0)
        before = store.asked
        # NOTE: grants without progress: the reports a grant carries are journaled every 50 ms, a write
        # that reads the journal's end for real.
        for i in range(200):
            a.grant("j", gen, i % 2, 0, i // 2, 1)
        assert store.asked - before <= 2, f"{store.asked - before} journal-end queries for 200 grants"
    finally:
        a.close()
    unwatched, store0 = _replica(postgres_url, 0.0)
    try:
        before = store0.asked
        for i in range(20):
            unwatched.grant("j", gen, 0, 0, i, 1)
        assert store0.asked - before >= 20  # the bound at 0: a query per grant, as before the watch
    finally:
        unwatched.close()


def test_a_grant_answered_at_once_asks_the_database_nothing_or_waits_for_a_thread(postgres_url: str) -> None:
    """The event loop's grants (``at_once``): a watched replica whose watch confirmed the journal's end
    answers them, its progress report kept for the writer; an unwatched one refuses with WouldWait
    before any query, having changed nothing (the call goes to a worker thread). Fails if an at-once
    grant reads the journal (a round trip on the event loop's thread)."""
    a, store = _replica(postgres_url, 0.5)
    unwatched, store0 = _replica(postgres_url, 0.0)
    try:
        gen = _start(a, 2, "t1")
        a.grant("j", gen, 0, 0, 0, 1)  # starts the watch
        _until(lambda: store.known_last(0.5) is not None, 10.0)
        before = store.asked
        g = a.grant("j", gen, 1, 0, 0, 2, progress=(0, 1), budget=AT_ONCE)
        assert g.batches == 2 and store.asked == before
        before0, state = store0.asked, unwatched.snapshot_state()
        with pytest.raises(WouldWait):
            unwatched.grant("j", gen, 0, 0, 1, 1, progress=(0, 1), budget=AT_ONCE)
        assert store0.asked == before0 and unwatched.snapshot_state() == state
        assert unwatched.grant("j", gen, 0, 0, 1, 1, progress=(0, 1)).batches == 1  # on a thread: it reads the journal
        assert store0.asked > before0
    finally:
        a.close()
        unwatched.close()


@pytest.mark.parametrize("cut", [False, True], ids=["listening", "watch-connection-cut"])
def test_a_replica_learns_of_a_replaced_generation_within_its_bound(postgres_url: str, cut: bool) -> None:
    """Replica B replaces the generation replica A serves; A refuses the old one within its bound.

    With the watch's connection cut (its backend terminated, as a partition between the replica and
    the database would), A stops confirming and asks the database again once the bound has passed.
    Fails if the confirmation never expires (A would serve the replaced generation for as long as the
    watch is gone).
    """
    bound = 0.3
    db = postgres_url.rsplit("/", 1)[1].split("?")[0]
    admin = postgres_url.rsplit("/", 1)[0] + "/postgres"
    a, store = _replica(postgres_url, bound)
    b, _ = _replica(postgres_url, bound)
    try:
        old = _start(a, 2, "t1")
        a.grant("j", old, 0, 0, 0, 1)
        _until(lambda: store.known_last(bound) is not None, 10.0)
        if cut:  # no new connection to the database; the watch's own cut (the pools' stay open)
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')
                killed = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                      "WHERE application_name = %s", (APPLICATION,)).fetchall()
            assert len(killed) == 1
        # NOTE: B opens a new generation (world 3); its join returns once it is committed.
        b.join(JoinRequest("j", SPEC, "t2", 3, 0))
        committed = time.monotonic()
        _until(lambda: _aborted(a, old), 10.0)
        took = time.monotonic() - committed
        assert took <= bound + 0.2, f"replica A served the replaced generation for {took:.3f} s (bound {bound} s)"
    finally:
        a.close()
        b.close()
        if cut:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')


class Proxy:
    """A TCP proxy to the test server whose link can be frozen: it then forwards nothing, either way,
    and closes nothing, as a network path that went silent (no reset, no FIN)."""

    def __init__(self, port: int) -> None:
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listen.getsockname()[1])
        self._target = port
        self.frozen = False
        #: Set once the client sent something while the link was frozen: it waits for an answer.
        self.held = threading.Event()
        #: Set once the client closed (or shut down) its end.
        self.client_closed = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                if from_client:
                    self.client_closed.set()
                return
            if self.frozen:
                if from_client:
                    self.held.set()
                continue  # dropped: the link is silent
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for s in (self._listen, *self._socks):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@pytest.mark.parametrize("where", ["mid-query", "waiting-for-notifications"])
def test_a_watch_whose_connection_hangs_closes_at_once(postgres: Any, where: str) -> None:
    """The link between a watch and the database goes silent, with the watch's heartbeat query in
    flight or while it waits for notifications: close() still stops its thread and closes its
    connection, at once. Fails without the socket's shutdown in close(): the thread stays stuck in
    its query until TCP gives up (close() returns after its 6 s join, the thread still alive), or in
    its wait until the heartbeat's 30 s are over."""
    proxy = Proxy(postgres.port)
    url = postgres.url().replace(f":{postgres.port}/", f":{proxy.port}/")
    heartbeat = 0.05 if where == "mid-query" else 30.0
    watch = JournalWatch(url, "SELECT 1", heartbeat, "test")
    try:
        _until(lambda: watch.known_last(60.0) is not None, 10.0)
        proxy.frozen = True
        if where == "mid-query":
            assert proxy.held.wait(10.0), "the watch sent no heartbeat query"
        t0 = time.monotonic()
        watch.close()
        took = time.monotonic() - t0
        assert not watch._thread.is_alive(), f"the watch's thread still runs {took:.1f} s after close()"
        assert took < 2.0, f"close() took {took:.1f} s"
        assert proxy.client_closed.wait(2.0), "the watch's connection was not closed"
    finally:
        proxy.close()
