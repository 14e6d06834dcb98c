"""Hosts on one machine: Linux network namespaces joined by a router namespace; cuts and slow, lossy links between them.

Each host is a network namespace of its own, on a /24 of its own, with one veth to a router that is a
namespace of its own too (forwarding on), so no traffic leaves the namespaces made here (the root
namespace has no link to them). A cut between two hosts is a pair of policy rules in the router that
drop, silently, what one sends the other: as in a real partition, a connection attempt or a call across
it gets no answer at all and waits for its deadline. Processes run in a host through ``ip netns exec``;
the test talks to them through pipes and files, which cross namespaces.

A link between two hosts can also be made slow and lossy (:meth:`Hosts.impair`): the router's policy
routing sends what they send each other through a TUN device whose process (:mod:`croupier.harness._impair`)
delays every packet and drops some, which does what ``tc ... netem delay loss`` would on a kernel that
has netem (many, this one included, do not).

Needs root and ``ip`` (iproute2); the partition tests and ``croupier chaos --datacenter`` use it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

#: The hosts' networks, host i on SUBNET.(i+1).0/24: used only inside these namespaces.
SUBNET = "10.233"
#: Policy rule priorities in the router: a cut comes first, then packets back from an impairer go on as
#: routed, then the packets of an impaired link go to their impairer.
_CUT, _FROM_IMPAIRER, _TO_IMPAIRER = 100, 150, 200


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
        self._impaired: dict[frozenset[str], tuple[subprocess.Popen[str], int]] = {}
        self._tables = 1000  # the routing table of the last impaired link
        _ip("netns", "add", self.router)
        try:
            _ip("-n", self.router, "link", "set", "lo", "up")
            # Forwarding on; no reverse-path filter (a packet back from an impairer comes in on its device).
            subprocess.run(["ip", "netns", "exec", self.router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward; "
                            "echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter; echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter"],
                           check=True, capture_output=True)
            for i, name in enumerate(names):
                ns = f"{self.tag}-{name}"
                _ip("netns", "add", ns)
                self._ns[name] = ns
                here, there = f"{self.tag}h{i}", f"{self.tag}r{i}"
                net = f"{SUBNET}.{i + 1}"
                # Made inside the router's namespace, so that no failure leaves a link in the root one.
                _ip("-n", self.router, "link", "add", here, "type", "veth", "peer", "name", there)
                _ip("-n", self.router, "link", "set", here, "netns", ns)
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
        _ip("-n", self.router, "rule", op, "from", self.addr[x], "to", self.addr[y], "blackhole", "priority", str(_CUT))

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

    def impair(self, a: str, b: str, delay_ms: float = 200.0, loss: float = 0.0, seed: int | None = None) -> None:
        """Every packet between hosts `a` and `b`, either way, delayed `delay_ms` and dropped with probability
        `loss` (in the router), until :meth:`restore`. A cut between them still drops everything."""
        key = frozenset((a, b))
        if key in self._impaired:
            raise ValueError(f"the link {a} <-> {b} is impaired already")
        self._tables += 1
        table = self._tables
        dev = f"{self.tag}i{table}"
        cmd = [sys.executable, "-m", "croupier.harness._impair", dev, "--delay-ms", str(delay_ms), "--loss", str(loss),
               *(["--seed", str(seed)] if seed is not None else [])]
        proc = subprocess.Popen(["ip", "netns", "exec", self.router, *cmd],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            _, err = proc.communicate()
            raise RuntimeError(f"the impairer of {a} <-> {b} did not start: {err.strip()[-500:]}")
        self._impaired[key] = (proc, table)
        _ip("-n", self.router, "route", "add", "default", "dev", dev, "table", str(table))
        _ip("-n", self.router, "rule", "add", "iif", dev, "lookup", "main", "priority", str(_FROM_IMPAIRER))
        for x, y in ((a, b), (b, a)):
            _ip("-n", self.router, "rule", "add", "from", self.addr[x], "to", self.addr[y], "lookup", str(table),
                "priority", str(_TO_IMPAIRER))

    def restore(self, a: str, b: str) -> tuple[int, int]:
        """Ends the impairment of the link between `a` and `b`; returns the packets its impairer (passed, dropped)."""
        proc, table = self._impaired[frozenset((a, b))]
        for x, y in ((a, b), (b, a)):
            _ip("-n", self.router, "rule", "del", "from", self.addr[x], "to", self.addr[y], "lookup", str(table),
                "priority", str(_TO_IMPAIRER))
        dev = f"{self.tag}i{table}"
        _ip("-n", self.router, "rule", "del", "iif", dev, "lookup", "main", "priority", str(_FROM_IMPAIRER))
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            del self._impaired[frozenset((a, b))]
        words = out.split()
        if proc.returncode != 0 or words[:1] != ["passed"]:
            raise RuntimeError(f"the impairer of {a} <-> {b} failed (exit {proc.returncode}): {err.strip()[-500:]}")
        return int(words[1]), int(words[3])

    def close(self) -> None:
        for proc, _ in self._impaired.values():
            proc.kill()
            proc.wait()
        self._impaired.clear()
        for ns in [*self._ns.values(), self.router]:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        self._ns.clear()
