"""A throwaway PostgreSQL server for tests: Debian's binaries, a temporary cluster, always stopped.

``Postgres`` runs one cluster in a temporary directory, listening on 127.0.0.1 on a free port
(and on a Unix socket in that directory only), ``fsync=on``, password (SCRAM) authentication
for a superuser ``croupier``. As root it runs the binaries as the ``postgres`` OS user (the
server refuses to run as root); as anyone else it runs them directly.

Fixtures, for a test module that says ``pytest_plugins = ["_postgres"]`` (a plugin, so that every
module shares one server):

- ``postgres``: the session's server, started on first use and stopped (and its directory
  removed) at the end of the session, also when a test fails. Skips when there is no server
  binary, naming why; under CI (``CI`` set) that is a failure instead: CI runs these tests.
- ``postgres_url``: a fresh, empty database for one test, as a URL with the password in it;
  the server is (re)started first if a test before left it stopped.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["Postgres", "postgres", "postgres_url", "unavailable_reason"]

USER = "croupier"
_OS_USER = "postgres"


def _bindir() -> Path | None:
    """Where initdb, pg_ctl and postgres are: ``$CROUPIER_PG_BINDIR`` or ``pg_config --bindir``."""
    if env := os.environ.get("CROUPIER_PG_BINDIR"):
        return Path(env)
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        return None
    out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def unavailable_reason() -> str | None:
    """Why no server can be started here, or None if one can."""
    bindir = _bindir()
    if bindir is None:
        return "no PostgreSQL server binaries: pg_config is not on PATH (apt-get install postgresql)"
    missing = [b for b in ("initdb", "pg_ctl", "postgres") if not (bindir / b).is_file()]
    if missing:
        return f"no PostgreSQL server binaries {missing} in {bindir} (apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(_OS_USER)
        except KeyError:
            return f"running as root, and there is no {_OS_USER!r} OS user to run the server as"
        if shutil.which("runuser") is None and shutil.which("su") is None:
            return f"running as root, and neither runuser nor su is there to run the server as {_OS_USER!r}"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Postgres:
    """One PostgreSQL cluster in a temporary directory; :meth:`close` stops it and removes the directory.

    Attributes:
        root: The temporary directory (data directory, socket, log).
        port: The TCP port on 127.0.0.1 (kept across restarts).
        password: The superuser's password, in every :meth:`url`.
    """

    def __init__(self) -> None:
        """Makes the directory and the cluster's settings; nothing runs until :meth:`start`."""
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        bindir = _bindir()
        assert bindir is not None
        self._bindir = bindir
        self._as_postgres = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="croupier-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = _free_port()
        self.password = f"pw-{secrets.token_hex(8)}"
        self._initialized = False
        self._databases = 0
        atexit.register(self.close)  # a session that never reaches its teardown still stops it

    # -- running the binaries -------------------------------------------------------------------

    def _run(self, *args: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        cmd = [str(self._bindir / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", _OS_USER, "--", *cmd] if shutil.which("runuser") else [
                "su", _OS_USER, "-s", "/bin/sh", "-c", " ".join(map(_quote, cmd))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:1])} failed ({out.returncode}): {out.stdout}{out.stderr}{self._log_tail()}")
        return out

    def _log_tail(self) -> str:
        try:
            return "\nserver log:\n" + "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        except OSError:
            return ""

    def _init(self) -> None:
        pwfile = self.root / "pwfile"
        pwfile.write_text(self.password + "\n")
        if self._as_postgres:
            uid, gid = pwd.getpwnam(_OS_USER)[2:4]
            for p in (self.root, pwfile):
                os.chown(p, uid, gid)
        self.root.chmod(0o700)
        self._run("initdb", "-D", str(self.data), "-U", USER, f"--pwfile={pwfile}", "--auth-local=trust",
                  "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions")
        pwfile.unlink()
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# croupier tests\n"
                "listen_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.root}'\n"
                "fsync = on\n"
                "synchronous_commit = on\n"
                "full_page_writes = on\n"
                "max_connections = 60\n"
                "shared_buffers = 32MB\n"
                "logging_collector = off\n"
            )
        self._initialized = True

    # -- the server -------------------------------------------------------------------------------

    def start(self) -> Postgres:
        """Initializes the cluster (the first time) and starts the server; returns once it accepts connections."""
        if not self._initialized:
            self._init()
        for attempt in range(3):
            out = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", f"-p {self.port}",
                            "-w", "-t", "60", "start", check=False)
            if out.returncode == 0:
                return self
            if attempt < 2 and "could not bind" in self._log_tail():
                self.port = _free_port()  # taken since we looked: try another
                continue
            raise RuntimeError(f"pg_ctl start failed ({out.returncode}): {out.stdout}{out.stderr}{self._log_tail()}")
        raise AssertionError("unreachable")

    def running(self) -> bool:
        """Whether the server is up (``pg_ctl status``)."""
        return self._initialized and self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def stop(self, mode: str = "fast") -> None:
        """Stops the server: ``fast`` (clean shutdown) or ``immediate`` (like a crash: recovery at the next start).

        Falls back to SIGKILL of the postmaster if pg_ctl cannot stop it.
        """
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"mode must be 'smart', 'fast' or 'immediate' (got {mode=})")
        if not self.running():
            return
        out = self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop", check=False)
        if out.returncode != 0:
            self._kill()

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m MODE``: stops the server and starts it again on the same port."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"mode must be 'smart', 'fast' or 'immediate' (got {mode=})")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", f"-p {self.port}", "-m", mode,
                  "-w", "-t", "60", "restart")

    def _kill(self) -> None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data / "postmaster.pid").read_text().splitlines()[0])
            os.kill(pid, signal.SIGKILL)  # the postmaster we started; its backends exit when it dies

    def close(self) -> None:
        """Stops the server (immediate) if it runs and removes the directory; idempotent."""
        if self.root.exists():
            try:
                self.stop("immediate")
            finally:
                shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.close)

    # -- databases --------------------------------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        """The URL of database ``dbname`` as the superuser, password included."""
        return f"postgresql://{USER}:{self.password}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """Creates an empty database and returns its :meth:`url`."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drops a database, disconnecting whoever is still on it."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def fresh_database(self, hint: str = "db") -> str:
        """A new database named after ``hint`` (made unique); returns its URL."""
        self._databases += 1
        name = f"{re.sub(r'[^a-z0-9_]+', '_', hint.lower())[:40]}_{self._databases}"
        return self.create_database(name)


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """The session's PostgreSQL server; stopped at the end of the session whatever happened."""
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the PostgreSQL tests, but {reason}")
        pytest.skip(f"PostgreSQL tests skipped: {reason}")
    pg = Postgres()
    try:
        pg.start()
        yield pg
    finally:
        pg.close()


@pytest.fixture
def postgres_url(postgres: Postgres, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty database on the session's server, as a URL (password included); dropped after the test."""
    if not postgres.running():
        postgres.start()
    url = postgres.fresh_database(request.node.name)
    try:
        yield url
    finally:
        if not postgres.running():
            postgres.start()
        with contextlib.suppress(Exception):
            postgres.drop_database(url.rsplit("/", 1)[1])
