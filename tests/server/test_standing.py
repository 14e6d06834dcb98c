"""server/_standing.py's reader of deals: what a state read from a store says a job's current generation was dealt."""

from __future__ import annotations

import pathlib

from croupier.core.api import JoinRequest
from croupier.core.spec import Spec
from croupier.server import Coordinator, generation_deals, open_store, read_journal

SPEC = Spec(n=400, batch_size=8, tail="uneven", dealing="dynamic")


def test_generation_deals_reads_a_snapshot_without_sharing_it(tmp_path: pathlib.Path) -> None:
    url = f"sqlite:///{tmp_path}/j.db"
    core = Coordinator(open_store(url), snapshot_every=1)  # every record is followed by a snapshot
    for r in range(2):
        core.join(JoinRequest("j", SPEC, "t1", 2, r))
    for k in range(3):
        core.grant("j", 1, 0, 0, k, 1)
    core.grant("j", 1, 1, 0, 0, 1)
    core.report("j", 1, 0, 0, 2, (None, None, "t1/0/2"), lockstep=False)
    core.close()
    store = open_store(url)
    try:
        state = read_journal(store).snapshot
    finally:
        store.close()
    assert state is not None
    g = generation_deals(state, "j", 0)
    assert g is not None
    assert (g.incarnation, g.generation, g.world) == ("t1", 1, 2)
    assert g.dealt == {0: 3, 1: 1} and g.committed == {0: 2}
    g.dealt[0] = 99  # a copy: the state is not changed
    g.committed.clear()
    again = generation_deals(state, "j", 0)
    assert again is not None and again.dealt == {0: 3, 1: 1} and again.committed == {0: 2}
    assert generation_deals(state, "j", 1) == type(g)("t1", 1, 2, {}, {})  # an epoch nothing was dealt in
    assert generation_deals(state, "other", 0) is None
