"""Computes leases' indices in a helper process, off the training loop's GIL (``CROUPIER_EXPANDER=0``: in this one).

A fixed plan's ``lease`` makes a few hundred numpy calls per lease. Called from a prefetch thread, each of
them has to win the GIL back from the training loop's main thread, so the thread falls behind and
the loop waits on it. A helper process computes the same indices on another core and sends them
back as raw int64 bytes; the prefetch thread then only waits on a pipe, with the GIL released.

One helper per process, started at the first eligible lease (which is computed here, as is every
lease until the helper is ready). The helper exits when its stdin closes: when this process
closes it at exit, or dies. Anything wrong with it (it does not start, dies, or answers
something malformed) is logged once; leases are computed in this process from then on.

Environment:
    CROUPIER_EXPANDER: ``0`` computes every lease in this process and starts no helper.

Protocol (stdin and stdout of the helper, little-endian):
    ready     helper -> parent: ``<I`` length + pickle of the path of its ``croupier.core.order``.
    request   parent -> helper: ``<I`` length + pickle of ``(key, plan or None, rank, first, count)``;
              the plan is sent the first time its key is used, then the helper's cache holds it.
    response  helper -> parent: ``<BQ`` (status, n) + n int64 indices (status 0), or n bytes of
              UTF-8 error text (status 1).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from typing import IO, Any

try:
    import fcntl
except ImportError:  # Windows: pipes keep their size
    fcntl = None  # type: ignore[assignment]

import numpy as np

from croupier.core import settings
from croupier.core.cursor import Cursor
from croupier.core.order import FixedPlan
from croupier.core.plan import EpochPlan, Grant
from croupier.core.spec import Spec

log = logging.getLogger("croupier")

_ENV = "CROUPIER_EXPANDER"
_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<BQ")  # (status, count)
_OK, _ERROR = 0, 1
#: Plans the helper keeps. Both sides evict the oldest beyond this, in the same order, so the
#: parent's table of keys always names plans the helper still holds.
_PLANS = 8
_PIPE_BYTES = 1 << 20
#: Leases of fewer indices are computed in this process: a round trip to the helper costs more
#: than they do (a generation's first lease, ``_prefetch.FIRST_LEASE_INDICES``, is one).
LOCAL_BELOW = 4096

PlanKey = tuple[Spec, Cursor, int]
#: Where this process imports the order engine from; the helper must import the same file.
_ORDER_FILE = sys.modules[FixedPlan.__module__].__file__


class _Helper:
    """The helper process of this process, and the parent's view of what it holds."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # the process that owns the helper (see _forget_after_fork)
        self.lock = threading.Lock()  # one request/response round trip at a time
        self.settled = threading.Event()  # the start ended, one way or the other
        self.usable = False  # the handshake succeeded and nothing has gone wrong since
        self.closed = False  # shut down: compute locally, quietly
        self.proc: subprocess.Popen[bytes] | None = None
        self.keys: dict[PlanKey, int] = {}  # plans the helper holds -> their key there
        self.next_key = 0

    # ---------------------------------------------------------------- start and stop

    def start(self) -> None:
        """Starts the helper process in a background thread; `settled` is set once it is ready or failed."""
        if (settings.get(_ENV) or "1").strip() == "0":
            self.settled.set()
            return
        atexit.register(self.shutdown)
        threading.Thread(target=self._start, name="croupier-expander-start", daemon=True).start()

    def _start(self) -> None:
        try:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) if p else os.getcwd() for p in sys.path)}
            # NOTE: run as a file, not `-m croupier.client._expander`: -m imports the package
            # croupier.client first, hence torch (seconds of a core, hundreds of MB) for a helper
            # that needs numpy and croupier.core. Not multiprocessing either: its spawn re-imports
            # the user's __main__, re-running a training script that has no main guard. The
            # parent's sys.path goes along so the helper imports the same croupier; the handshake
            # checks it did.
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env)
        except Exception as e:  # not started: no helper
            with self.lock:
                self._fail(f"it did not start ({type(e).__name__}: {e})")
            self.settled.set()
            return
        _widen(proc.stdout)
        with self.lock:
            self.proc = proc
            if self.closed:  # the process exits while the helper starts
                self._reap()
                self.settled.set()
                return
        try:
            assert proc.stdout is not None
            where = pickle.loads(_read_exact(proc.stdout, _LEN.unpack(_read_exact(proc.stdout, _LEN.size))[0]))
            if where != _ORDER_FILE:
                raise ValueError(f"it imports croupier.core.order from {where!r}, this process from {_ORDER_FILE!r}")
        except Exception as e:  # any failure of the handshake means no helper
            with self.lock:
                self._fail(f"it did not start ({type(e).__name__}: {e})")
            self.settled.set()
            return
        with self.lock:
            self.usable = not self.closed
        self.settled.set()

    def shutdown(self) -> None:
        """Closes the helper's stdin (it exits) and reaps it; leases are computed here from then on."""
        if os.getpid() != self.pid:  # a forked child does not own the helper
            return
        got = self.lock.acquire(timeout=2.0)  # a prefetch thread may be mid-request; do not hang the exit
        try:
            self.closed, self.usable = True, False
            self._reap()
        finally:
            if got:
                self.lock.release()

    def _reap(self, kill: bool = False) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            if kill:
                proc.kill()
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass  # a dead helper's pipe may refuse the flush
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def _fail(self, why: str) -> None:
        """Turns the helper off for good (the caller holds the lock)."""
        self.usable = False
        if self.closed:
            return
        self.closed = True
        code = None if self.proc is None else self.proc.poll()  # before the kill: did it exit by itself?
        self._reap(kill=True)
        log.warning("croupier: the lease helper process failed: %s%s; leases are computed in this process from now "
                    "on (%s=0 skips the helper)", why, "" if code is None else f" (it exited with code {code})", _ENV)

    # ---------------------------------------------------------------- a lease

    def lease(self, plan: EpochPlan, rank: int, first: int, count: int, total: int) -> np.ndarray | None:
        """The `total` indices of the lease from the helper, or None when it cannot give them."""
        with self.lock:
            if not self.usable or self.proc is None:
                return None
            key: PlanKey = (plan.spec, plan.cursor, plan.world)
            k = self.keys.get(key)
            send: EpochPlan | None = None
            if k is None:
                k, send = self.next_key, plan
                self.next_key += 1
            try:
                stdin, stdout = self.proc.stdin, self.proc.stdout
                assert stdin is not None and stdout is not None
                req = pickle.dumps((k, send, rank, first, count), protocol=pickle.HIGHEST_PROTOCOL)
                stdin.write(_LEN.pack(len(req)) + req)
                stdin.flush()
                if send is not None:
                    self.keys[key] = k
                    _evict(self.keys)
                status, n = _HEAD.unpack(_read_exact(stdout, _HEAD.size))
                if status == _ERROR and n < 1 << 20:
                    # NOTE: the plan raised there; computing it here raises the same error, with
                    # a traceback of this process. The helper stays in use.
                    log.debug("croupier: the lease helper could not compute a lease: %s",
                              _read_exact(stdout, n).decode("utf-8", "replace"))
                    self.keys.clear()
                    return None
                if status != _OK or n != total:
                    raise ValueError(f"it answered status {status} with {n} indices for a lease of {total}")
                idx = np.empty(n, dtype="<i8")  # (n,)
                _read_exact_into(stdout, idx.data.cast("B"))
            except Exception as e:  # a dead helper (EOFError, BrokenPipeError), or a malformed answer
                self._fail(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
                return None
        return idx if idx.dtype == np.int64 else idx.astype(np.int64)


_helper: _Helper | None = None
_helper_lock = threading.Lock()
_orphans: list[_Helper] = []  # helpers of the parent, in a forked child


def _get() -> _Helper:
    global _helper
    h = _helper
    if h is None:
        with _helper_lock:
            if _helper is None:
                _helper = _Helper()
                _helper.start()
            h = _helper
    return h


def _forget_after_fork() -> None:
    # NOTE: a forked child (a DataLoader worker) shares the helper's pipes with its parent; a
    # request from it would interleave with the parent's frames. It starts its own helper if it
    # ever needs one. The parent's helper object is kept referenced so it is never finalised
    # here (finalising flushes and closes the pipes).
    global _helper, _helper_lock
    if _helper is not None:
        _orphans.append(_helper)
    _helper, _helper_lock = None, threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def eligible(plan: EpochPlan) -> bool:
    """Whether leases of `plan` go to the helper process: a portable plan (``plan.portable``), of a
    spec without lengths."""
    # NOTE: the helper holds plans that are a pure function of a small key (spec, cursor, world)
    # and cheap to send: a token plan's packed windows and a dealt plan's runs stay here. Bucket
    # specs carry 8 bytes a sample, too many to send along; the torch order is one index into a
    # cached randperm, nothing to move off this process (and the helper would import torch and
    # build the randperm again).
    return plan.portable and plan.spec.lengths is None and plan.spec.permutation != "torch"


def lease(plan: EpochPlan, rank: int, first: int, count: int, grant: Grant | None = None) -> tuple[np.ndarray, list[int]]:
    """``plan.lease(rank, first, count, grant)``, computed by the helper process when it can.

    Thread-safe. The first eligible call starts the helper and computes here, as does every call
    until the helper is ready, every call of a plan that is not eligible, every lease of fewer
    than ``LOCAL_BELOW`` indices, and every call once the helper has failed (one warning, logger
    ``croupier``).

    Args:
        plan: The epoch's plan.
        rank: The rank whose batches these are.
        first: The first batch of the lease.
        count: At most this many batches (fewer at the epoch's end).
        grant: The coordinator's grant of these batches, if it answered (a plan the coordinator
            deals needs it).

    Returns:
        The dataset indices of the batches end to end (int64), and the size of each batch:
        bit-identical to ``plan.lease``.
    """
    if eligible(plan):
        h = _get()  # started at the first eligible lease, whatever its size, to be ready for the next ones
        own = plan.grant(rank, first, count)  # O(1): what the lease holds
        total = (own.batches - 1) * plan.spec.batch_size + own.last_size if own.batches else 0
        if h.usable and total >= LOCAL_BELOW:
            idx = h.lease(plan, rank, first, count, total)
            if idx is not None:
                return idx, own.sizes(plan.spec.batch_size)
    return plan.lease(rank, first, count, grant)


def ready(timeout: float) -> bool:
    """Starts the helper if it is not started, and waits up to `timeout` s for its handshake.

    Returns:
        Whether leases go to the helper now.
    """
    h = _get()
    h.settled.wait(timeout)
    return h.usable


def _reset_for_tests() -> None:
    """Stops this process's helper and forgets it: the next call starts anew (and reads the environment again)."""
    global _helper
    with _helper_lock:
        h, _helper = _helper, None
    if h is not None:
        h.settled.wait(30.0)  # let a start in flight finish so its process is reaped here
        h.shutdown()
        atexit.unregister(h.shutdown)


def _process() -> subprocess.Popen[bytes] | None:
    """The helper process, for tests."""
    return None if _helper is None else _helper.proc


# --------------------------------------------------------------------------- both sides


def _evict(table: dict[Any, Any]) -> None:
    while len(table) > _PLANS:
        del table[next(iter(table))]


def _widen(stream: IO[bytes] | None) -> None:
    """Lets the pipe of `stream` hold a whole default lease (65,536 indices, 512 KiB) where the OS allows it."""
    # NOTE: at Linux's default 64 KiB, a lease crosses the pipe in 8 turns, and at each turn the
    # prefetch thread must win the GIL back from the training loop (up to a switch interval,
    # 5 ms); one turn is one wake-up. Capped by /proc/sys/fs/pipe-max-size (1 MiB by default).
    setsize = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if stream is None or setsize is None:
        return
    try:
        fcntl.fcntl(stream.fileno(), setsize, _PIPE_BYTES)
    except OSError:
        pass  # not allowed here: the default size works, in more turns


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    """Exactly n bytes of `stream`; EOFError when it ends first."""
    buf = bytearray(n)
    _read_exact_into(stream, memoryview(buf))
    return bytes(buf)


def _read_exact_into(stream: IO[bytes], view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not k:
            raise EOFError(f"the stream ended after {got} of {len(view)} bytes")
        got += k


# --------------------------------------------------------------------------- the helper


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """The helper's loop: answers requests until `inp` ends."""
    plans: dict[int, EpochPlan] = {}
    where = pickle.dumps(_ORDER_FILE)
    out.write(_LEN.pack(len(where)) + where)
    out.flush()
    while True:
        try:
            (size,) = _LEN.unpack(_read_exact(inp, _LEN.size))
            key, plan, rank, first, count = pickle.loads(_read_exact(inp, size))
        except EOFError:
            return  # the parent closed the pipe, or died
        try:
            if plan is not None:
                plans[key] = plan
                _evict(plans)
            idx, _ = plans[key].lease(rank, first, count)
            idx = np.ascontiguousarray(idx, dtype="<i8")  # (n,)
        except Exception as e:  # reported to the parent, which computes the lease itself
            text = f"{type(e).__name__}: {e}".encode()
            out.write(_HEAD.pack(_ERROR, len(text)) + text)
        else:
            out.write(_HEAD.pack(_OK, idx.size))
            out.write(idx.data.cast("B"))
        out.flush()


def _main() -> None:
    # NOTE: Ctrl-C in a terminal reaches the whole process group; the parent handles it, and the
    # helper ends when the parent closes its stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The frames get a descriptor of their own; fd 1 becomes stderr, so a stray print in the
    # helper never lands in a frame.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        _serve(sys.stdin.buffer, out)
    except BrokenPipeError:
        pass  # the parent is gone
    finally:
        try:
            out.close()
        except BrokenPipeError:
            pass


if __name__ == "__main__":
    _main()
