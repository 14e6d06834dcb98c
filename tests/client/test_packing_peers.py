"""The peers' packing failure beside croupier's: one packing pipeline preempted mid-epoch and resumed, token audits of both.

The baseline is a packing ``IterableDataset`` as people write it for torchdata's ``StatefulDataLoader``:
each worker packs its share of the rank's documents and counts a document as consumed once it is
in its packing buffer (llm-foundry#1277), and a resume on another world size or worker count,
which its state cannot be mapped to, starts the epoch over (bionemo-recipes#1250). Its losses
and repeats are counted and printed, not asserted to exist; croupier's audit must be exact.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _packing_data import CONTEXT, Docs, run_world, token_audit
from torch.utils.data import IterableDataset, get_worker_info

SEQ_LEN = 32
LENGTHS = [int(x) for x in np.random.default_rng(7).lognormal(np.log(20), 0.8, 160).clip(1, 120)]


class PackingStream(IterableDataset[dict[str, Any]]):
    """A rank's documents (a seeded shuffle, strided by rank, then by worker), packed greedily in the
    worker into rows of SEQ_LEN; its state counts the documents taken into the buffer."""

    def __init__(self, lengths: list[int], rank: int, world: int) -> None:
        self.lengths, self.rank, self.world = lengths, rank, world
        self.consumed = 0  # this worker's documents taken (restored by load_state_dict)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        order = np.random.default_rng(0).permutation(len(self.lengths))[self.rank::self.world][wid::nw]
        row: list[tuple[int, int, int]] = []
        used = 0
        for i in order[self.consumed:].tolist():
            self.consumed += 1  # NOTE: the peers' count: the document is in the buffer, not yet in a row
            for a in range(0, self.lengths[i], SEQ_LEN):
                n = min(SEQ_LEN, self.lengths[i] - a)
                if used + n > SEQ_LEN:
                    yield {"pieces": row}
                    row, used = [], 0
                row.append((i, a, n))
                used += n
        if row:
            yield {"pieces": row}

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = state["consumed"]


def _baseline(world: int, workers: int, steps: int, state: list[dict[str, Any]] | None,
              same_shape: bool) -> tuple[list[tuple[int, int, int]], list[dict[str, Any]]]:
    """Every rank of a world trains `steps` rows (None: the epoch) through a StatefulDataLoader, then saves."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    trained: list[tuple[int, int, int]] = []
    states = []
    for r in range(world):
        ctx = {"multiprocessing_context": CONTEXT} if workers else {}
        dl = StatefulDataLoader(PackingStream(LENGTHS, r, world), batch_size=None, num_workers=workers,
                                **ctx)  # type: ignore[arg-type]
        if state is not None and same_shape:
            dl.load_state_dict(state[r])  # else the saved state does not fit: the epoch starts over
        for k, row in enumerate(dl):
            if steps and k >= steps:
                break
            trained += [tuple(p) for p in row["pieces"]]
        states.append(dl.state_dict())
    return trained, states


@pytest.fixture(scope="module")
def address(module_address: str) -> str:
    """One in-process coordinator for the module's runs (each run is a job of its own: tests/conftest.py)."""
    return module_address


@pytest.mark.slow
def test_the_same_pipeline_with_croupier_and_with_a_stateful_data_loader(address: str) -> None:
    cut = 6  # rows per rank before the preemption
    rows = []
    for w1, k1, w2, k2 in [(2, 4, 2, 4), (2, 4, 3, 2)]:
        job = uuid.uuid4().hex
        first, states = run_world(address, job, Docs(LENGTHS), w1, k1, SEQ_LEN, cut, None, pack="greedy")
        rest, _ = run_world(address, job, Docs(LENGTHS), w2, k2, SEQ_LEN, None, states[0], pack="greedy")
        ours = token_audit(LENGTHS, [p for t in first + rest for p in t], None)
        b_first, b_states = _baseline(w1, k1, cut, None, True)
        b_rest, _ = _baseline(w2, k2, 0, b_states, (w1, k1) == (w2, k2))
        peer = token_audit(LENGTHS, b_first + b_rest, None)
        rows.append(f"| {w1} ranks x {k1} workers -> {w2} x {k2} | croupier: {ours['missing']} missing, "
                    f"{ours['repeated']} repeated | StatefulDataLoader + packing IterableDataset: {peer['missing']} "
                    f"missing, {peer['repeated']} repeated |")
        assert not ours, (w1, k1, w2, k2, ours)
    print("\n| resume | croupier (tokens) | peer (tokens) |\n|---|---|---|\n" + "\n".join(rows))
