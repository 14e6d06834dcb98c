"""A `croupier serve` child process: the one way the tools (chaos, infer-demo, the demo) and the tests start one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO


def start_serve(port: int, store: str, log: IO[str], what: str = "croupier serve", error: type[Exception] = RuntimeError,
                verbose: bool = False, new_session: bool = False, args: Sequence[str] = (),
                env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """Starts ``croupier serve`` on 127.0.0.1:`port` (0: any free port) over `store`.

    The store's URL (a password, maybe) goes in ``CROUPIER_STORE``, not on the command line; the
    process's output is copied to `log` by a daemon thread.

    Args:
        args: More of ``croupier serve``'s options.
        env: Variables set for the process beside this one's environment.

    Returns:
        The process and the address it listens on.

    Raises:
        error: it did not start (`what` names it in the message).
    """
    cmd = [sys.executable, "-m", "croupier.tools.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
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
