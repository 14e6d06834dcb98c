"""Several coordinators (replicas) on one shared store: no leader, one truth.

The in-process tests run replicas on a shared in-memory journal that keeps the shared-store
contract (``append_at`` refuses a writer that has not read the last record); the end-to-end
ones run ``croupier serve`` processes on a real PostgreSQL server.
"""

from __future__ import annotations

import pytest
from _joins import join_started
from _ranks import on_ranks
from _shared_store import Journal, SharedStore

from croupier.client import DistributedSampler
from croupier.core.api import JoinRequest
from croupier.core.errors import Aborted
from croupier.core.spec import Spec
from croupier.server import Server
from croupier.server._coordinator import Coordinator

SPEC = Spec(n=600, seed=5)


def _replicas(journal: Journal, k: int) -> list[Coordinator]:
    return [Coordinator(SharedStore(journal, f"r{i}")) for i in range(k)]  # type: ignore[arg-type]


def test_ranks_joining_through_different_replicas_start_one_generation() -> None:
    journal = Journal()
    reps = _replicas(journal, 3)
    out = on_ranks(3, lambda r: join_started(reps[r], JoinRequest("j", SPEC, "t1", 3, r), 10.0))
    assert {(x.generation, x.start) for x in out} == {(1, out[0].start)} and out[0].start is not None
    for c in reps:
        c.close()


def test_a_generation_replaced_through_one_replica_is_fenced_by_every_other() -> None:
    journal = Journal()
    a, b, c = _replicas(journal, 3)
    on_ranks(2, lambda r: join_started(a, JoinRequest("j", SPEC, "t1", 2, r), 10.0))
    assert c.grant("j", 1, 0, 0, 0, 4).batches == 4
    join_started(b, JoinRequest("j", SPEC, "t2", 1, 0), 10.0)  # a new incarnation, through b
    for replica in (a, c):
        with pytest.raises(Aborted, match="replaced by generation 2"):
            replica.grant("j", 1, 0, 0, 0, 4)
    for replica in (a, b, c):
        replica.close()


def test_concurrent_joins_of_new_generations_never_accept_two_at_once() -> None:
    """Every replica races to open its own generation: each journaled generation follows the last."""
    journal = Journal()
    reps = _replicas(journal, 4)
    out = on_ranks(4, lambda r: reps[r].join(JoinRequest("j", SPEC, f"t{r}", 1, 0)))
    assert sorted(x.generation for x in out) == [1, 2, 3, 4]
    fresh = Coordinator(SharedStore(journal, "reader"))  # type: ignore[arg-type]
    assert fresh.job("j").result.generation == 4
    stores = [r.store for r in reps]
    assert sum(s.appends for s in stores) == 4 + 0 * len(stores)  # type: ignore[attr-defined]
    for c in (*reps, fresh):
        c.close()


def test_a_replica_that_loses_the_database_stops_acknowledging_and_recovers() -> None:
    from croupier.core.errors import Unavailable

    journal = Journal()
    a, b = _replicas(journal, 2)
    join_started(a, JoinRequest("j", SPEC, "t1", 1, 0), 1.0)
    journal.down = True
    with pytest.raises(Unavailable, match="unavailable"):
        b.join(JoinRequest("j", SPEC, "t2", 1, 0))
    with pytest.raises(Unavailable):
        a.grant("j", 1, 0, 0, 0, 4)
    journal.down = False
    assert a.grant("j", 1, 0, 0, 0, 4).batches == 4
    assert join_started(b, JoinRequest("j", SPEC, "t2", 1, 0), 1.0).generation == 2
    a.close()
    b.close()


def test_samplers_fail_over_between_replicas(tmp_path: object) -> None:
    """A sampler given several endpoints goes on when the replica it uses stops."""
    journal = Journal()
    servers = [Server(SharedStore(journal, f"r{i}")).start() for i in range(2)]  # type: ignore[arg-type]
    address = ",".join(s.address for s in servers)
    s = DistributedSampler(SPEC.n, address=address, job="fo", incarnation="a", lease_ahead=50, prefetch=1, seed=5)
    it = iter(s)
    first = [next(it) for _ in range(100)]
    servers[0].stop(0)
    rest = list(it)
    assert sorted(first + rest) == list(range(SPEC.n))
    s2 = DistributedSampler(SPEC.n, address=address, job="fo", incarnation="b", seed=5)
    assert len(list(s2)) == SPEC.n  # a new incarnation joins through the live replica
    for x in (s, s2):
        x.close()
    servers[1].stop(0)


def test_progress_reported_to_one_replica_reaches_the_others() -> None:
    """On a shared store a grant's progress report is journaled in the background (no commit per
    grant); a replica that closes writes what it holds first."""
    journal = Journal()
    a, b = _replicas(journal, 2)
    on_ranks(2, lambda r: join_started(a, JoinRequest("j", SPEC, "t1", 2, r), 10.0))
    appends = a.store.appends  # type: ignore[attr-defined]
    for first in range(0, 40, 4):
        a.grant("j", 1, 0, 0, first, 4, progress=(0, first))
    a.grant("j", 1, 1, 0, 0, 4, progress=(0, 3))
    a.close()
    assert a.store.appends - appends < 11  # type: ignore[attr-defined]  (batched: fewer appends than grants)
    assert [(c.rank, c.batches) for c in b.job("j").ranks] == [(0, 36), (1, 3)]
    b.close()
