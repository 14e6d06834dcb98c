"""A lossy, slow link for the network-namespace hosts of :mod:`croupier.harness._netns`: packets delayed and dropped.

    python -m croupier.harness._impair DEVICE --delay-ms 200 --loss 0.1 [--seed S]

Run inside the router namespace. It makes the TUN device DEVICE (layer 3, no packet information) and
brings it up; the router's policy routing then sends the packets of one link into it
(:meth:`croupier.harness._netns.Hosts.impair`). Every packet read from the device is dropped with
probability ``loss``, else written back into it ``delay-ms`` later; the kernel takes a packet written
into a TUN device as one received on it, and forwards it on to its destination. Packets leave in the
order they came (the delay is the same for every packet), so what TCP sees is a longer round trip and
lost segments, as on a congested or lossy path.

This stands in for ``tc qdisc ... netem delay 200ms loss 10%`` on kernels without the netem queueing
discipline. It prints ``ready`` once the device is up, and on SIGTERM ``passed P dropped D`` before it
exits (the device goes with it).
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_MAX_PACKET = 65536


def open_tun(name: str) -> int:
    """The file descriptor of a new TUN device `name` (layer 3, no packet information), non-blocking.

    Raises:
        OSError: the device could not be made (no /dev/net/tun, not root, a name in use).
    """
    if not 0 < len(name.encode()) < 16:
        raise ValueError(f"a device name has 1 to 15 bytes (got {name!r})")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def run(name: str, delay_s: float, loss: float, rng: random.Random) -> tuple[int, int]:
    """Impairs what the kernel routes into device `name` until SIGTERM; returns (passed, dropped)."""
    fd = open_tun(name)
    subprocess.run(["ip", "link", "set", name, "up"], check=True, capture_output=True)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    queued: list[tuple[float, int, bytes]] = []
    passed = dropped = seq = 0
    while not stopping:
        now = time.monotonic()
        while queued and queued[0][0] <= now:
            _, _, packet = heapq.heappop(queued)
            try:
                os.write(fd, packet)
                passed += 1
            except OSError:  # the device refused it (down, or the packet malformed): lost
                dropped += 1
        timeout = max(0.0, queued[0][0] - now) if queued else 0.5
        try:
            ready, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        if not ready:
            continue
        while True:
            try:
                packet = os.read(fd, _MAX_PACKET)
            except BlockingIOError:
                break
            if rng.random() < loss:
                dropped += 1
                continue
            seq += 1
            heapq.heappush(queued, (time.monotonic() + delay_s, seq, packet))
    os.close(fd)
    return passed, dropped + len(queued)  # those still delayed at the stop are lost with the device


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m croupier.harness._impair", description=__doc__.split("\n\n")[0])
    p.add_argument("device")
    p.add_argument("--delay-ms", type=float, default=200.0)
    p.add_argument("--loss", type=float, default=0.0, help="probability that a packet is dropped, in [0, 1)")
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args(argv)
    if not 0.0 <= a.delay_ms <= 60_000 or not 0.0 <= a.loss < 1.0:
        p.error(f"--delay-ms must be in [0, 60000] and --loss in [0, 1) (got {a.delay_ms}, {a.loss})")
    passed, dropped = run(a.device, a.delay_ms / 1000, a.loss, random.Random(a.seed))
    print(f"passed {passed} dropped {dropped}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
