"""Hosts for partition tests: Linux network namespaces joined by a router namespace, and cuts between them.

Each host is a network namespace of its own, on a /24 of its own, with one veth to a router that is a
namespace of its own too (forwarding on), so no traffic leaves the namespaces made here (the root
namespace has no link to them). A cut between two hosts is a pair of policy rules in the router that
drop, silently, what one sends the other: as in a real partition, a connection attempt or a call across
it gets no answer at all and waits for its deadline. Processes run in a host through ``ip netns exec``;
the test talks to them through pipes and files, which cross namespaces.

Needs root and ``ip`` (iproute2). The kernel here has no ``netem`` queueing discipline, so loss and
delay on a link are not offered.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

#: The hosts' networks, host i on SUBNET.(i+1).0/24: used only inside these namespaces.
SUBNET = "10.233"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"no usable `ip netns`: {e}"
    return None


class Hosts:
    """Named hosts behind one router; :meth:`close` removes every namespace made."""

    def __init__(self, names: Sequence[str]) -> None:
        self.tag = f"cr{os.getpid() % 100000}"
        self.router = f"{self.tag}-rt"
        self.addr: dict[str, str] = {}
        self._ns: dict[str, str] = {}
        self._cuts: set[tuple[str, str]] = set()
        _ip("netns", "add", self.router)
        try:
            _ip("-n", self.router, "link", "set", "lo", "up")
            subprocess.run(["ip", "netns", "exec", self.router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"],
                           check=True, capture_output=True)
            for i, name in enumerate(names):
                ns = f"{self.tag}-{name}"
                _ip("netns", "add", ns)
                self._ns[name] = ns
                here, there = f"{self.tag}h{i}", f"{self.tag}r{i}"
                net = f"{SUBNET}.{i + 1}"
                _ip("link", "add", here, "type", "veth", "peer", "name", there)
                _ip("link", "set", here, "netns", ns)
                _ip("link", "set", there, "netns", self.router)
                _ip("-n", self.router, "addr", "add", f"{net}.1/24", "dev", there)
                _ip("-n", self.router, "link", "set", there, "up")
                self.addr[name] = f"{net}.2"
                _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", here)
                _ip("-n", ns, "link", "set", here, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "route", "add", "default", "via", f"{net}.1")
        except BaseException:
            self.close()
            raise

    def run(self, name: str, cmd: Sequence[str]) -> list[str]:
        """`cmd` as it runs in host `name`."""
        return ["ip", "netns", "exec", self._ns[name], *cmd]

    def _rule(self, op: str, x: str, y: str) -> None:
        _ip("-n", self.router, "rule", op, "from", self.addr[x], "to", self.addr[y], "blackhole", "priority", "100")

    def cut(self, a: str, b: str) -> None:
        """No packet between hosts `a` and `b`, either way (dropped in the router), until :meth:`heal`."""
        for x, y in ((a, b), (b, a)):
            if (x, y) not in self._cuts:
                self._rule("add", x, y)
                self._cuts.add((x, y))

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        """Ends the cut between `a` and `b` (every cut without arguments)."""
        for x, y in sorted(self._cuts):
            if a is None or {x, y} == {a, b}:
                self._rule("del", x, y)
                self._cuts.discard((x, y))

    def close(self) -> None:
        for ns in [*self._ns.values(), self.router]:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        self._ns.clear()
