"""How a replica knows the journal's end without asking the database on every call: LISTEN plus a heartbeat.

Every append on PostgreSQL notifies ``croupier_journal`` with its schema and last seq (in its
statement, so the notification goes out at its commit). A :class:`JournalWatch` listens on a connection of its
own and, every ``heartbeat_s``, asks the journal's last seq on that same connection. What it knows
is the largest seq either told it; it is *confirmed* as of the moment the last heartbeat was sent
(the answer reflects the database at that moment or later).

A replica may then take "the journal ends at seq S" without a query while that confirmation is
younger than its staleness bound: what it serves is the database's state as of at most the bound
ago. A notification tells it sooner that it is behind (it then reads what it lacks). A watch that
loses its connection stops confirming, so after the bound the replica asks the database on every
call again, as it would without a watch, and answers UNAVAILABLE if the database is gone.

Closing a watch shuts its connection's socket down, so that a thread stuck on a connection that
hangs (a query or a wait for notifications that no answer ends) wakes up, closes it and stops.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import psycopg

from croupier.core.checks import check_seconds

log = logging.getLogger("croupier.server")

#: The channel appends notify.
CHANNEL = "croupier_journal"
#: The watch's connection's name in ``pg_stat_activity``.
APPLICATION = "croupier-watch"
#: The longest a watch waits before connecting again after losing its connection.
_MAX_BACKOFF_S = 1.0
#: How long :meth:`JournalWatch.close` waits for the thread beyond a connection attempt's timeout.
_CLOSE_S = 6.0


def _now() -> float:
    """Seconds on a clock that never goes back and goes on while the machine sleeps (CLOCK_BOOTTIME where
    there is one): a confirmation taken before a suspend of the host must look as old as it is."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


class JournalWatch:
    """A thread that keeps the journal's last seq known and confirmed (see the module)."""

    def __init__(self, conninfo: str, last_query: str, heartbeat_s: float, url: str) -> None:
        heartbeat_s = check_seconds("heartbeat_s", heartbeat_s)
        self._conninfo, self._last_query, self.heartbeat_s, self._url = conninfo, last_query, heartbeat_s, url
        self._lock = threading.Lock()
        self._known = 0
        self._confirmed = -float("inf")  # _now() of the last heartbeat sent and answered
        self._closed = threading.Event()
        #: The connection in use (under ``_lock``): close() shuts its socket down.
        self._conn: psycopg.Connection[Any] | None = None
        self._thread = threading.Thread(target=self._run, name="croupier-pg-watch", daemon=True)
        self._thread.start()

    def known_last(self, max_age_s: float) -> int | None:
        """The journal's last seq if confirmed within `max_age_s`, else None: ask the database."""
        with self._lock:
            if 0 <= _now() - self._confirmed <= max_age_s:
                return self._known
            return None

    def _saw(self, seq: int, sent: float | None) -> None:
        with self._lock:
            self._known = max(self._known, seq)
            if sent is not None:
                self._confirmed = max(self._confirmed, sent)

    def _run(self) -> None:
        backoff = 0.05
        while not self._closed.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True, application_name=APPLICATION) as conn:
                    try:
                        with self._lock:
                            if self._closed.is_set():
                                return
                            self._conn = conn
                        conn.execute(f"LISTEN {CHANNEL}")
                        backoff = 0.05
                        self._serve(conn)
                    finally:
                        with self._lock:  # close() no longer touches its socket: it is closed next
                            self._conn = None
            except psycopg.Error as e:
                if not self._closed.is_set():
                    log.debug("store %s: journal watch lost its connection: %s", self._url, e)
            # NOTE: a backoff between connection attempts (bounded), not synchronisation.
            self._closed.wait(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    def _serve(self, conn: psycopg.Connection[Any]) -> None:
        row = conn.execute("SELECT current_schema()").fetchone()
        mine = f"{row[0] if row is not None else ''}:"
        while not self._closed.is_set():
            sent = _now()
            row = conn.execute(self._last_query).fetchone()
            self._saw(int(row[0]) if row is not None else 0, sent)
            for n in conn.notifies(timeout=self.heartbeat_s):
                if n.payload.startswith(mine):  # another schema's journal says nothing of this one's
                    try:
                        self._saw(int(n.payload[len(mine):]), None)
                    except ValueError:
                        log.warning("store %s: notification %r on %s is not a seq", self._url, n.payload, CHANNEL)
                if _now() - sent >= self.heartbeat_s:
                    break

    def close(self) -> None:
        """Stops the thread and closes its connection, also when the connection hangs mid-query.

        NOTE: setting ``_closed`` alone reaches the thread only between its waits; a query or a wait
        for notifications on a connection whose peer went silent ends only when TCP keepalives give
        up (tens of seconds). Shutting the socket down makes that wait return at once (the
        connection reads end-of-file), and the thread then closes the connection and stops. The
        join is bounded: a connection attempt in flight (no socket to shut down yet) ends within
        its ``connect_timeout``.
        """
        with self._lock:
            self._closed.set()
            conn = self._conn
            if conn is not None:
                _shut_down(conn)
        self._thread.join(timeout=_CLOSE_S)
        if self._thread.is_alive():
            log.warning("store %s: the journal watch's thread did not stop within %g s", self._url, _CLOSE_S)


def _shut_down(conn: psycopg.Connection[Any]) -> None:
    """Shuts down (without closing: the connection's thread does) the socket of `conn`."""
    try:
        fd = conn.pgconn.socket
    except psycopg.Error:  # closed already
        return
    try:
        # NOTE: a duplicate of the descriptor: shutting it down shuts the connection's socket down;
        # closing the duplicate leaves the descriptor the connection owns for it to close.
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError as e:
        log.debug("journal watch: socket not shut down: %s", e)
