"""croupier under HF Accelerate, in one process: the loader counts the optimizer steps that ``save_state``
cannot pass, and the sampler's state carries them across a resume."""

from __future__ import annotations

from typing import Any

import accelerate  # type: ignore[import-untyped]
from torch.utils.data import DataLoader

from croupier.client import DistributedBatchSampler
from croupier.client._rpc import CoordinatorClient
from croupier.integrations.accelerate import CroupierDataLoader, prepare_data_loader
from croupier.server._service import Server

N, BATCH, ACCUMULATION = 36, 4, 2  # 9 batches an epoch: 5 steps, the last one short


def _loader(server: Server, incarnation: str) -> CroupierDataLoader:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    sampler = DistributedBatchSampler(N, BATCH, num_replicas=1, rank=0, address=server.address, job="acc",
                                      incarnation=incarnation, global_batch=BATCH * ACCUMULATION)
    return prepare_data_loader(accelerator, DataLoader(list(range(N)), batch_sampler=sampler), register=False)


def _take(loader: CroupierDataLoader, batches: int) -> list[Any]:
    it = iter(loader)
    return [next(it) for _ in range(batches)]


def test_the_loader_names_the_optimizer_steps_and_a_resume_counts_on(server: Server, client: CoordinatorClient) -> None:
    loader = _loader(server, "a")
    it = iter(loader)
    for _ in range(5):
        next(it)
    assert loader.croupier_state.state_dict()["sampler"]["step"] == 2  # 5 batches: 2 whole steps
    assert len(list(it)) == 4  # the rest of epoch 0: 9 batches, 5 steps (the last one short)
    _take(loader, 3)  # epoch 1
    saved = loader.croupier_state.state_dict()
    assert (saved["epoch"], saved["items"], saved["sampler"]["step"]) == (1, 3, 6)
    assert loader.croupier_state.state_dict(step=40)["sampler"]["step"] == 40  # a step given wins
    loader.croupier_sampler.close()

    resumed = _loader(server, "b")
    resumed.croupier_state.load_state_dict(saved)
    _take(resumed, 3)  # 6 batches of epoch 1
    assert resumed.croupier_state.state_dict()["sampler"]["step"] == 8
    segment = client.ledger("acc").segments[-1]
    assert (segment.step, segment.parent) == (6, 1)  # the join named the step of the state loaded
    resumed.croupier_sampler.close()

    old = {**saved, "sampler": {k: v for k, v in saved["sampler"].items()
                                if k not in ("step", "generation", "incarnation")} | {"version": 3}}
    again = _loader(server, "c")
    again.croupier_state.load_state_dict(old)  # a state that named no step: the count cannot go on from it
    _take(again, 1)
    assert "step" not in again.croupier_state.state_dict()["sampler"]
    again.croupier_sampler.close()
