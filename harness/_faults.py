"""The chaos run's data-center faults (``croupier chaos --datacenter``): pauses, clock jumps, a full disk, and a
partitioned or slow, lossy network.

The coordinator and the job run on hosts of their own: two network namespaces behind a router
(:mod:`croupier.harness._netns`), the coordinator's host "co", the job's (torchrun and its workers) "job".
Each fault is one the job trains through, injected on the single coordinator (``croupier serve`` on a
SQLite store), on one of the job's workers or on the network between them:

* ``pause``: the coordinator stopped (SIGSTOP) for a while, as a long GC pause or a frozen VM, then
  woken (SIGCONT); the ranks compute their leases themselves meanwhile;
* ``rank-pause``: one worker stopped and woken the same way (the others wait for it at their next
  collective);
* ``clock``: the coordinator's wall clock jumped an hour forward or back (it runs under libfaketime,
  which reads the clock's offset from a file this rewrites; its monotonic clock is left alone);
* ``disk``: the file system of the coordinator's store (a tmpfs of its own) filled to the last byte
  for a while, then freed; the coordinator answers UNAVAILABLE meanwhile and goes on by itself;
* ``partition``: the job's host cut from the coordinator's for a while (packets dropped silently both
  ways: calls get no answer), then healed;
* ``slow-link``: the link between them delayed 200 ms each way with a tenth of its packets lost, for a
  while (:mod:`croupier.harness._impair`, since not every kernel has netem).

What each needs is checked up front by :func:`available` (root for the tmpfs and the namespaces,
libfaketime's library).
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import random
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from croupier.harness import _netns

#: libfaketime, from Debian's faketime package.
FAKETIME = pathlib.Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
#: The faults this module injects, and how likely each is among themselves.
KINDS = ("pause", "rank-pause", "clock", "disk", "partition", "slow-link")
#: The clock's offsets, in turn: an hour ahead, an hour behind, right.
_JUMPS = ("+1h", "-1h", "+0")
#: Size of the store's own file system: room for the run's journal, snapshots and WAL.
DISK_SIZE = "256m"
#: The slow link: each way's delay, and the share of packets lost.
SLOW_DELAY_MS, SLOW_LOSS = 200.0, 0.1
T = TypeVar("T")


def available() -> str | None:
    """None when every fault here can be injected on this machine, else why not."""
    if os.geteuid() != 0:
        return "the full-disk fault mounts a tmpfs: run as root"
    if not FAKETIME.exists():
        return f"the clock fault needs {FAKETIME} (apt-get install faketime)"
    if not os.path.exists("/dev/net/tun"):
        return "the slow-link fault needs /dev/net/tun"
    return _netns.unavailable_reason()


def fill_up(filler: pathlib.Path) -> None:
    """Writes `filler` until its file system has not a byte left (MiB at a time, then pages)."""
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (b"\0" * (1 << 20), b"\0" * 4096):
            with contextlib.suppress(OSError):  # ENOSPC: this size no longer fits
                while True:
                    os.write(fd, chunk)
    finally:
        os.close(fd)


class Faults:
    """The data-center faults of one run, on the store's file system at `disk` and the clock file `clock`."""

    def __init__(self, work: pathlib.Path, rng: random.Random) -> None:
        self.rng = rng
        self.disk = work / "disk"
        self.clock = work / "faketime"
        self._jumps = 0
        self.hosts: _netns.Hosts | None = None

    def env(self) -> dict[str, str]:
        """The coordinator's environment: its wall clock from the clock file, its monotonic clock its own."""
        return {"LD_PRELOAD": str(FAKETIME), "FAKETIME_TIMESTAMP_FILE": str(self.clock), "FAKETIME_NO_CACHE": "1",
                "DONT_FAKE_MONOTONIC": "1"}

    def prefix(self, host: str) -> Sequence[str]:
        """What runs a command on `host` ("co" or "job")."""
        assert self.hosts is not None, "outside the with block"
        return self.hosts.run(host, [])

    def address(self, host: str) -> str:
        """The address of `host` ("co" or "job")."""
        assert self.hosts is not None, "outside the with block"
        return self.hosts.addr[host]

    def __enter__(self) -> Faults:
        self.clock.write_text("+0\n")
        self.disk.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(self.disk)], check=True,
                       capture_output=True, text=True)
        try:
            self.hosts = _netns.Hosts(["co", "job"])
        except BaseException:
            subprocess.run(["umount", "-l", str(self.disk)], check=False, capture_output=True)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            (self.disk / "filler").unlink()
        subprocess.run(["umount", "-l", str(self.disk)], check=False, capture_output=True)
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None

    def _duration(self, within: float) -> float:
        """A pause or an outage: mostly a few seconds, one in ten long; at most `within` seconds."""
        drawn = self.rng.uniform(5.0, 12.0) if self.rng.random() < 0.1 else self.rng.uniform(0.2, 3.0)
        return min(drawn, within)

    def _lasting(self, within: float, begin: Callable[[], object], end: Callable[[], T]) -> tuple[float, T]:
        """A fault that lasts: `begin`, a drawn while (at most `within` seconds), then `end` whatever happens;
        returns the seconds and what `end` returned."""
        took = self._duration(within)
        begin()
        try:
            time.sleep(took)  # the fault itself: it lasts this long
        finally:
            ended = end()
        return took, ended

    def pause(self, pid: int, within: float = math.inf) -> float:
        """SIGSTOP of `pid`, then SIGCONT; returns the seconds it was stopped (at most `within`)."""
        return self._lasting(within, lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT))[0]

    def jump(self) -> str:
        """The coordinator's wall clock to its next offset; returns it."""
        offset = _JUMPS[self._jumps % len(_JUMPS)]
        self._jumps += 1
        self.clock.write_text(offset + "\n")
        return offset

    def fill(self, within: float = math.inf) -> float:
        """The store's file system full for a while, then freed; returns the seconds it was full (at most `within`)."""
        filler = self.disk / "filler"
        return self._lasting(within, lambda: fill_up(filler), filler.unlink)[0]

    def partition(self, within: float = math.inf) -> float:
        """The job's host cut from the coordinator's for a while, then healed; returns the seconds of the cut."""
        hosts = self.hosts
        assert hosts is not None, "outside the with block"
        return self._lasting(within, lambda: hosts.cut("job", "co"), hosts.heal)[0]

    def slow_link(self, within: float = math.inf) -> tuple[float, int, int]:
        """The link between the job and the coordinator slow and lossy for a while; returns its seconds and
        the packets passed and dropped meanwhile."""
        hosts = self.hosts
        assert hosts is not None, "outside the with block"
        # The impairer's seed is drawn once the duration is (the order a seed replays).
        took, (passed, dropped) = self._lasting(
            within, lambda: hosts.impair("job", "co", SLOW_DELAY_MS, SLOW_LOSS, seed=self.rng.randrange(2**31)),
            lambda: hosts.restore("job", "co"))
        return took, passed, dropped
