"""No coordinator call in flight across a fork: a fork waits for the calls in flight (a bounded wait), a call waits
for a fork in progress; and a training loop whose DataLoaders fork workers while the sampler leases makes gRPC
skip none of its fork handlers (its message is not in the loop's stderr)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from croupier.client import _forks
from croupier.server._service import Server

LOOP = Path(__file__).resolve().parents[1] / "_fork_loop.py"
#: What gRPC logs when it finds another thread inside gRPC at a fork (src/core/lib/iomgr/fork_posix.cc).
SKIPPED = "skipping fork() handlers"


def _blocked(target: object) -> threading.Thread:
    """`target` in a thread that is still waiting half a second later (it returns at once if nothing holds it)."""
    t = threading.Thread(target=target, daemon=True)  # type: ignore[arg-type]
    t.start()
    t.join(timeout=0.5)
    assert t.is_alive(), f"{target} did not wait"
    return t


def test_a_fork_waits_for_the_calls_in_flight_and_a_call_for_the_fork() -> None:
    gate = _forks._Gate()
    gate.enter()  # a call in flight
    fork = _blocked(gate.before_fork)
    gate.leave()  # the call ends: the fork goes on
    fork.join(timeout=10)
    assert not fork.is_alive()
    call = _blocked(gate.enter)  # a call that would begin during the fork waits for it
    gate.after_fork_parent()
    call.join(timeout=10)
    assert not call.is_alive() and gate.in_flight == 1
    gate.leave()
    gate.after_fork_child()  # the child starts with no call in flight and no fork in progress
    assert gate.in_flight == 0
    gate.enter()
    gate.leave()


def test_a_call_that_outlasts_the_wait_does_not_hold_the_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_forks, "WAIT_S", 0.2)
    gate = _forks._Gate()
    gate.enter()  # a call that does not end (a join's long poll in another thread)
    began = time.monotonic()
    gate.before_fork()
    assert 0.2 <= time.monotonic() - began < 5.0
    gate.after_fork_parent()
    gate.leave()


@pytest.fixture(params=["served", "embedded"])
def address(request: pytest.FixtureRequest) -> str:
    """A coordinator on port 0 of this process (the loop calls it through gRPC), or none: the loop's process
    starts its own, as the README's pattern does."""
    if request.param == "embedded":
        return "embedded"
    server: Server = request.getfixturevalue("server")
    return server.address


@pytest.mark.e2e
@pytest.mark.paired
def test_a_loop_with_forked_workers_prints_no_grpc_fork_message(address: str) -> None:
    """Its own process; gRPC's fork handlers and its log as a user has them."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GRPC_VERBOSITY", "GRPC_TRACE", "GRPC_ENABLE_FORK_SUPPORT") and not k.startswith("CROUPIER_")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, str(LOOP), address, "forks", "--epochs", "3"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["batches", "375", "forks", "80"], p.stdout
    skipped = [line for line in p.stderr.splitlines() if SKIPPED in line]
    assert not skipped, f"{len(skipped)} of 80 forks found a call in flight:\n" + "\n".join(skipped[:5])
