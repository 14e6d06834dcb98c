"""The step in the record: a sampler's state names the trainer's step and its generation, the join sends
them with the trainer's step schedule, and the coordinator's step ledger places every later step on
the samples the ranks were actually handed (real samplers against a real coordinator on a port)."""

from __future__ import annotations

from typing import Any

import pytest
from _ranks import Ranks, on_ranks

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.client._rpc import CoordinatorClient
from croupier.core.api import JoinRequest
from croupier.core.checkpoint import WITH_STEPS
from croupier.core.errors import FailedPrecondition
from croupier.core.ledger import Ledger
from croupier.core.schedule import Schedule
from croupier.server._service import Server

N, BATCH, GLOBAL = 96, 4, 24  # a step: 24 samples, 3 batches of every rank on 2 ranks, 2 on 3


def _samplers(server: Server, world: int, incarnation: str, **kw: Any) -> list[DistributedBatchSampler]:
    return [DistributedBatchSampler(N, BATCH, num_replicas=world, rank=r, address=server.address, job="steps",
                                    incarnation=incarnation, global_batch=GLOBAL, lease_ahead=4, prefetch=1, **kw)
            for r in range(world)]


def _train(samplers: list[DistributedBatchSampler], batches: int, step: int) -> tuple[list[list[list[int]]], list[dict]]:
    """Every rank takes `batches` batches, then saves its state at `step`: (what each rank was handed, the states)."""
    ranks = Ranks(samplers)
    handed = [[ranks.next(r) for _ in range(batches)] for r in range(len(samplers))]
    states = [s.state_dict(step=step) for s in samplers]
    ranks.close()
    return handed, states


def _agrees(ledger: Ledger, step: int, generation: int, handed: list[list[list[int]]], first: int) -> None:
    """Step `step` as the ledger keeps it is micro-batches first.. of what each rank of `generation` was handed."""
    kept = ledger.step(step).kept
    assert kept is not None and kept.generation == generation
    per_rank = len(kept.batches) // len(handed)
    assert [(b.rank, b.micro, b.indices.tolist()) for b in kept.batches] == [
        (r, m, handed[r][first + m]) for r in range(len(handed)) for m in range(per_rank)]


def test_a_state_names_its_step_and_generation_and_a_resume_places_the_next_steps(
        server: Server, client: CoordinatorClient) -> None:
    first = _samplers(server, 2, "a")
    handed1, states = _train(first, 6, step=2)  # steps 1 and 2: 3 batches of each rank each
    g1 = first[0].generation
    state = states[0]
    assert states[1] == state and state["version"] == WITH_STEPS
    assert (state["step"], state["generation"], state["incarnation"], state["items"]) == (2, g1, "a", 6)
    record = client.status("steps").checkpoints[-1]
    assert (record.step, record.generation, record.items) == (2, g1, 6)  # the record names its items as a field

    second = _samplers(server, 3, "b")  # resized: a step is 2 batches of each of 3 ranks
    for s in second:
        s.load_state_dict(state)
    handed2, _ = _train(second, 4, step=4)  # steps 3 and 4
    g2 = second[0].generation
    ledger = client.ledger("steps")
    seg = ledger.segments[-1]
    assert (seg.generation, seg.step, seg.parent, seg.schedule) == (g2, 2, g1, Schedule(GLOBAL))
    for t in (1, 2):
        _agrees(ledger, t, g1, handed1, 3 * (t - 1))
    for t in (3, 4):
        _agrees(ledger, t, g2, handed2, 2 * (t - 3))

    # Rolled back to step 2 from the coordinator's record: the record gives the step and generation too.
    third = _samplers(server, 2, "c")
    on_ranks(2, lambda r: third[r].resume_from_step(2))
    handed3, _ = _train(third, 3, step=3)
    ledger = client.ledger("steps")
    g3 = third[0].generation
    assert (ledger.segments[-1].step, ledger.segments[-1].parent) == (2, g1)
    _agrees(ledger, 3, g3, handed3, 0)
    abandoned = ledger.step(3).abandoned
    assert [v.generation for v in abandoned] == [g2]
    assert abandoned[0].indices.tolist() == [i for r in range(3) for b in handed2[r][:2] for i in b]


def test_a_state_saved_before_the_first_batch_is_the_one_loaded(server: Server) -> None:
    """Nothing was trained since the state loaded: it is that state, with its step and generation; at another
    step it names that step alone (the generation that took the state loaded did not take it there)."""
    first = _samplers(server, 1, "a")
    _, (state,) = _train(first, 3, step=1)
    again = _samplers(server, 1, "b")[0]
    again.load_state_dict(state)
    assert again.state_dict() == state and again.state_dict(step=1) == state
    other = again.state_dict(step=5)
    assert (other["step"], "generation" in other, other["items"]) == (5, False, state["items"])
    again.close()


def test_ranks_that_count_steps_differently_are_refused_naming_both(server: Server, client: CoordinatorClient) -> None:
    """The sampler sends its global_batch as the join's schedule: a rank with another is refused."""
    spec = _samplers(server, 2, "a")[0].spec
    client.join(JoinRequest("steps", spec, "a", 2, 0, schedule=Schedule(GLOBAL)), wait_s=0)
    late = DistributedBatchSampler(N, BATCH, num_replicas=2, rank=1, address=server.address, job="steps",
                                   incarnation="a", global_batch=2 * GLOBAL)
    with pytest.raises(FailedPrecondition) as e:
        next(iter(late))
    assert f"global_batch={2 * GLOBAL}" in str(e.value) and f"global_batch={GLOBAL}" in str(e.value)
    late.close()


@pytest.mark.parametrize("kw, error, says", [
    ({"global_batch": "24"}, TypeError, "global_batch must be an int (got global_batch='24')"),
    ({"global_batch": 0}, ValueError, "global_batch must be in [1, "),
    ({"global_batch": 26}, ValueError, "a global batch of 26 samples (from step 1) is not a whole number of batches of "
                                       "batch_size=4"),
    ({"rampup": (8, 8, 10)}, ValueError, "rampup=(8, 8, 10) needs global_batch="),
    ({"global_batch": 24, "rampup": (8, 8)}, TypeError, "rampup must be (start, increment, steps)"),
    ({"global_batch": 24, "rampup": (8, 0, 10)}, ValueError, "rampup increment must be in [1, "),
    ({"global_batch": 24, "rampup": (8, 6, 10)}, ValueError, "the global batch must go from 8 to global_batch=24"),
    ({"global_batch": 24, "rampup": (6, 6, 10)}, ValueError, "a global batch of 6 samples (from step 1)"),
])
def test_a_step_schedule_is_checked_when_the_sampler_is_made(kw: dict[str, Any], error: type[Exception], says: str) -> None:
    with pytest.raises(error) as e:
        DistributedBatchSampler(N, BATCH, num_replicas=1, rank=0, **kw)
    assert says in str(e.value)
    with pytest.raises(ValueError, match="token-budget batches have no fixed size"):
        DistributedBatchSampler(N, lengths=[3] * N, max_tokens=12, num_replicas=1, rank=0, global_batch=24)
    DistributedSampler(N, num_replicas=1, rank=0, global_batch=6, rampup=(2, 2, 5)).close()  # batches of one index
