"""The embedded coordinator: one that a training process starts for its job when it is given none, in a child
process of its own (``croupier.server._embedded`` says the protocol between the two).

NOTE: why a process of its own. A ``DataLoader`` forks its workers from the training process; a coordinator
served from that process has threads inside gRPC at every fork, and gRPC then skips its fork handlers and
logs so. In a child process, the trainer's own calls are the only gRPC in it, and those never cross a fork
(``_forks``). The child costs a Python start (about a third of a second here) once per process and store.

The child lives while its parent does: it reads its stdin until the parent closes it (at exit, or
:func:`stop`) or dies (the kernel closes a killed process's descriptors), then stops. A forked child of the
parent (a DataLoader worker) closes its copy of that pipe at once, so that a worker alive after its parent
does not keep the coordinator up; it still calls its parent's coordinator (the same one for the same store).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time

#: How long a start waits for a store still held by the coordinator of a process that was killed (it lets go
#: of the store as soon as it sees its parent gone: well under a second).
HELD_WAIT_S = 15.0
#: How long :func:`stop` waits for the child to exit before it kills it.
STOP_WAIT_S = 5.0


@dataclasses.dataclass
class Child:
    """A coordinator process of this one: its address, its secret, and the write end of its lifeline (-1 in
    a forked child of the process that started it, which may call it but does not own it)."""

    proc: subprocess.Popen[str]
    address: str
    secret: str | None
    lifeline: int


_children: dict[str, Child] = {}
_lock = threading.Lock()


def _close_lifelines_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    for child in _children.values():
        if child.lifeline >= 0:
            try:
                os.close(child.lifeline)
            except OSError:
                pass
            child.lifeline = -1


os.register_at_fork(after_in_child=_close_lifelines_in_child)


def start(store_url: str, host: str, name: str, secret: str | None) -> tuple[str, str | None]:
    """The address and secret of this process's coordinator over `store_url`, started on `host` if it is not.

    Raises:
        RuntimeError: the coordinator did not start (its message says why: a store that cannot be opened,
            or still held by another coordinator after :data:`HELD_WAIT_S`).
    """
    with _lock:
        child = _children.get(store_url)
        if child is None:
            child = _spawn(store_url, host, name, secret)
            _children[store_url] = child
        return child.address, child.secret


def _spawn(store_url: str, host: str, name: str, secret: str | None) -> Child:
    deadline, pause = time.monotonic() + HELD_WAIT_S, 0.05
    conf = json.dumps({"store": store_url, "host": host, "name": name, "secret": secret}) + "\n"
    while True:
        read, write = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-m", "croupier.server._embedded"], stdin=read,
                                    stdout=subprocess.PIPE, text=True)
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        os.write(write, conf.encode())
        assert proc.stdout is not None
        line = proc.stdout.readline().rstrip("\n")
        proc.stdout.close()
        if line.startswith("listening on "):
            return Child(proc, line.split()[-1], secret, write)
        os.close(write)
        proc.wait()
        if not line.startswith("held ") or time.monotonic() + pause > deadline:
            what = line.partition(" ")[2] or f"it exited with {proc.returncode} before it said where it listens"
            raise RuntimeError(f"the embedded coordinator over {store_url} did not start: {what}")
        time.sleep(pause)  # the previous coordinator of this store is closing it (its parent was killed)
        pause = min(pause * 2, 1.0)


def serving(address: str) -> bool:
    """Whether `address` is a coordinator this process started and has not stopped."""
    with _lock:
        return any(c.address == address and c.lifeline >= 0 and c.proc.poll() is None for c in _children.values())


def stop(store_url: str | None = None) -> None:
    """Stops this process's coordinator over `store_url` (None: all of them), and waits for each to exit
    (it lets the calls in flight finish; killed after :data:`STOP_WAIT_S`)."""
    with _lock:
        urls = list(_children) if store_url is None else [store_url] if store_url in _children else []
        children = [c for c in (_children.pop(url) for url in urls) if c.lifeline >= 0]
    for child in children:
        try:
            os.close(child.lifeline)
        except OSError:
            pass
    for child in children:
        try:
            child.proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
