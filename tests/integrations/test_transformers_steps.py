"""croupier under the HF Trainer, in one process, with gradient accumulation: the Trainer's global step is the
one the checkpoint names, and the coordinator's step ledger places each step on what the model trained."""

from __future__ import annotations

import pathlib
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from croupier.client._rpc import CoordinatorClient
from croupier.core.schedule import Schedule
from croupier.server._service import Server

N, BATCH, ACCUMULATION, STEPS = 40, 4, 3, 4  # 10 batches an epoch: 4 steps, the last one of one batch


class Indexed(Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((2,), float(i)), "idx": i}


class Model(nn.Module):
    """Records the indices each forward receives, in the order the Trainer trains them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(2, 1)
        self.seen: list[list[int]] = []

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen.append(idx.tolist())
        return {"loss": self.w(x).pow(2).mean()}


def test_the_trainers_steps_are_the_ledgers(server: Server, client: CoordinatorClient, tmp_path: pathlib.Path) -> None:
    # NOTE: imported here, not at the top: transformers takes seconds to import, and every pytest-xdist
    # worker imports every test module to collect it, where only the one that runs this test needs it.
    from transformers import TrainingArguments

    from croupier.integrations.transformers import STATE_FILE, CroupierTrainer

    model = Model()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=STEPS,
                             gradient_accumulation_steps=ACCUMULATION, save_strategy="steps", save_steps=2,
                             report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, logging_strategy="no")
    trainer = CroupierTrainer(model=model, args=args, train_dataset=Indexed(),
                              croupier_sampler_kwargs={"job": "hf", "address": server.address, "incarnation": "a"})
    trainer.train()
    assert (tmp_path / "checkpoint-2" / STATE_FILE).exists() and trainer.state.global_step == STEPS
    ledger = client.ledger("hf")
    assert ledger.segments[-1].schedule == Schedule(BATCH * ACCUMULATION)  # the default sampler counts 3 batches a step
    assert [c.step for c in client.status("hf").checkpoints] == [2, 4]
    trained = iter(model.seen)
    for t in range(1, STEPS + 1):
        version = ledger.step(t).kept
        assert version is not None
        assert [b.indices.tolist() for b in version.batches] == [next(trained) for _ in version.batches], t
        assert len(version.batches) == (ACCUMULATION if t < 4 else 1)  # the epoch's last step is short
    trainer.croupier_sampler.close()
