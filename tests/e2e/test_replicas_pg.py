"""Several `croupier serve` replicas on one real PostgreSQL database: failover, and kill -9 mid-commit."""

from __future__ import annotations

import random
import threading

import pytest
from _ranks import on_ranks

from croupier.client import DistributedSampler
from croupier.client._rpc import CoordinatorClient
from croupier.core.api import JoinRequest
from croupier.core.spec import Spec
from croupier.server import GenerationOpened, open_store, read_journal

pytestmark = pytest.mark.e2e
pytest_plugins = ["_postgres"]

N = 1200


def _generations(url: str, job: str) -> list[tuple[int, str]]:
    """(number, incarnation) of every generation the journal opened for `job`, in journal order."""
    store = open_store(url)
    try:
        out = []
        for _, ev in read_journal(store).events:
            if isinstance(ev, GenerationOpened) and ev.job == job:
                out.append((ev.generation, ev.incarnation))
        return out
    finally:
        store.close()


def test_ranks_fail_over_when_their_replica_is_killed(postgres_url: str, serve_process: type) -> None:
    """Three replicas; the ranks use the first. kill -9 of it mid-epoch; the job trains on, then
    resizes through the others, exactly once."""
    reps = [serve_process(postgres_url) for _ in range(3)]
    address = ",".join(r.address for r in reps)
    first = [DistributedSampler(N, num_replicas=3, rank=r, address=address, job="ha", incarnation="g1", lease_ahead=40,
                                prefetch=1, seed=2) for r in range(3)]
    its = [iter(s) for s in first]
    got = on_ranks(3, lambda r: [next(its[r]) for _ in range(100)])
    reps[0].kill()  # the replica every rank talks to
    got = [g + [next(its[r]) for _ in range(50)] for r, g in enumerate(got)]
    states = [s.state_dict() for s in first]  # reaches a live replica: the state is recorded there
    assert len({str(st) for st in states}) == 1
    for s in first:
        s.close()
    second = [DistributedSampler(N, num_replicas=2, rank=r, address=address, job="ha", incarnation="g2", seed=2)
              for r in range(2)]
    for s in second:
        s.load_state_dict(states[0])
    rest = on_ranks(2, lambda r: list(second[r]))
    trained = sorted(i for part in got + rest for i in part)
    assert trained == list(range(N))
    with CoordinatorClient(address, retry_for=10.0) as c:
        st = c.status("ha")
        assert (st.result.generation, st.result.world) == (2, 2)
        assert [c.step for c in st.checkpoints] == [None]
    for s in second:
        s.close()
    assert _generations(postgres_url, "ha") == [(1, "g1"), (2, "g2")]


def test_a_replica_killed_mid_commit_loses_no_acknowledged_join(postgres_url: str, serve_process: type) -> None:
    """Joins of new generations through replica A, acknowledged one after another, while A is
    killed at a random moment: every acknowledged generation is in the database, in order."""
    a, b = serve_process(postgres_url), serve_process(postgres_url)
    acked: list[tuple[int, str]] = []
    spec = Spec(n=100)
    stop = threading.Event()
    failures: list[BaseException] = []

    def joiner() -> None:
        with CoordinatorClient(a.address, retry_for=0.0, call_timeout=5.0) as c:
            k = 0
            while not stop.is_set():
                incarnation = f"t{k}"
                try:
                    r = c.join(JoinRequest("mid", spec, incarnation, 1, 0), wait_s=0.0)
                except Exception as e:  # the replica dies under it
                    failures.append(e)
                    return
                acked.append((r.generation, incarnation))
                k += 1

    t = threading.Thread(target=joiner)
    t.start()
    while len(acked) < 20 + random.randrange(40):  # a random moment, after some commits
        stop.wait(0.01)
    a.kill()
    t.join(timeout=60)
    stop.set()
    assert failures, "the joins were expected to fail once the replica was killed"
    history = _generations(postgres_url, "mid")
    numbers = [g for g, _ in history]
    assert numbers == list(range(1, len(numbers) + 1)), "a generation accepted twice or out of order"
    assert set(acked) <= set(history), f"acknowledged joins lost: {sorted(set(acked) - set(history))[:5]}"
    assert len(history) - len(acked) <= 1  # at most the commit in flight landed unacknowledged
    with CoordinatorClient(b.address, retry_for=10.0) as c:  # the other replica serves what was acknowledged
        assert c.status("mid").result.generation == len(history)
