"""A `croupier serve` child process: the one way the demos, the harness (chaos), the tests and the benchmarks
start one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO


def start_serve(port: int, store: str, log: IO[str], what: str = "croupier serve", error: type[Exception] = RuntimeError,
                verbose: bool = False, new_session: bool = False, args: Sequence[str] = (),
                env: Mapping[str, str] | None = None, host: str = "127.0.0.1",
                prefix: Sequence[str] = ()) -> tuple[subprocess.Popen[str], str]:
    """Starts ``croupier serve`` on `host`:`port` (0: any free port) over `store`.

    The store's URL (a password, maybe) goes in ``CROUPIER_STORE``, not on the command line; the
    process's output is copied to `log` by a daemon thread.

    Args:
        args: More of ``croupier serve``'s options.
        env: Variables set for the process beside this one's environment.
        prefix: What runs the command (``ip netns exec NAME`` to run it in a network namespace; it must
            exec the command, so that the process started is the server's).

    Returns:
        The process and the address it listens on.

    Raises:
        error: it did not start (`what` names it in the message).
    """
    cmd = [*prefix, sys.executable, "-m", "croupier.tools.cli", "serve", "--host", host, "--port", str(port),
           *(["-v"] if verbose else []), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=new_session,
                            env={**os.environ, **(env or {}), "CROUPIER_STORE": store})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait()
        raise error(f"{what} did not start (exit {proc.returncode}, first line {line!r}); see {log.name}")
    threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
    return proc, line.split()[-1]


def _drain(out: IO[str], log: IO[str]) -> None:
    for line in out:
        log.write(line)
        log.flush()


class ServeProcess:
    """``croupier serve`` over a store in a child process, started again on the same port after a kill.

    The first :meth:`start` takes `port` (0: any free port); every later one takes the port the
    process listened on, so that the clients' address stays true.

    Args:
        store: The store's URL.
        log: Where the process's output goes.
        name: How messages call it.
        error: What :meth:`start` raises when the process does not start.
        port: The port of the first start.
        verbose: Log at INFO level (``-v``).
        new_session: Start it in a session of its own (a signal to this one's group misses it).
        args: More of ``croupier serve``'s options.
        env: Variables set for the process beside this one's environment.
        host: The address it listens on.
        prefix: What runs the command (see :func:`start_serve`).
    """

    def __init__(self, store: str, log: IO[str], name: str = "the coordinator", error: type[Exception] = RuntimeError,
                 *, port: int = 0, verbose: bool = False, new_session: bool = False, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> None:
        self.store = store
        self.log = log
        self.name = name
        self.error = error
        self.port = port
        self.verbose = verbose
        self.new_session = new_session
        self.args = tuple(args)
        self.env = dict(env or {})
        self.host, self.prefix = host, tuple(prefix)
        self.address = ""
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> ServeProcess:
        """Starts the process (on the port of the last one, if any); returns self.

        Raises:
            error: It did not start.
        """
        self.proc, self.address = start_serve(self.port, self.store, self.log, f"croupier serve --port {self.port} ({self.name})",
                                              self.error, self.verbose, self.new_session, self.args, self.env,
                                              self.host, self.prefix)
        self.port = int(self.address.rsplit(":", 1)[1])
        return self

    def exited(self) -> int | None:
        """The process's exit code once it has exited (by itself, killed or stopped); None while it runs
        or before it starts."""
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """kill -9, and wait for it (nothing if it does not run)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a graceful stop), and wait for it; kill -9 if it is still running after `timeout` seconds.

        Returns:
            Its exit code (None if it never started).
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class ServeGroup:
    """Several :class:`ServeProcess` (replicas on one shared store, say) started, checked and killed together.

    Args:
        members: The processes, the first the first endpoint.
    """

    def __init__(self, members: Sequence[ServeProcess]) -> None:
        self.members = list(members)

    @property
    def address(self) -> str:
        """Every member's endpoint, the first first: what CROUPIER_ADDRESS names."""
        return ",".join(m.address for m in self.members)

    def start(self) -> None:
        for m in self.members:
            m.start()

    def check(self) -> None:
        """Raises a member's `error` if one has exited: called while they should all run, an exit nobody
        asked for."""
        for m in self.members:
            code = m.exited()
            if code is not None:
                raise m.error(f"{m.name} exited by itself (exit {code}); see {m.log.name}")

    def kill(self) -> None:
        """kill -9 of every member, and wait for them."""
        for m in self.members:
            m.kill()


def active_clients(port: int, within_ms: int = 2000, prefix: Sequence[str] = ()) -> int:
    """Connections to local `port` that sent something in the last `within_ms` (from ``ss -ti``, run through
    `prefix`: ``ip netns exec NAME`` for a server in a network namespace); 0 without ss.

    NOTE: a client keeps the channels of replicas it moved away from open, idle; counting only
    connections with recent traffic tells the replica the ranks are using from one they used.
    """
    try:
        out = subprocess.run([*prefix, "ss", "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    active = 0
    for line in out.stdout.splitlines():
        if not line[:1].isspace():
            continue  # the connection's addresses; its TCP info follows on an indented line
        m = re.search(r"\blastrcv:(\d+)", line)
        active += m is None or int(m[1]) <= within_ms  # ss leaves out lastrcv:0
    return active
