"""The known wrong ways to drive a croupier sampler are refused, naming the integration to use (no silent loss).

A wrapper that re-shards a croupier sampler (Accelerate's ``BatchSamplerShard``), a Lightning
resume without ``CroupierCheckpoint`` (a fresh ``fit`` without it warns), and a state taken from a
sampler that Ray's loader reads ahead. In process, one rank. The trainers are imported by the tests
that use them (importing Lightning and Accelerate takes seconds, paid by every collecting worker).
"""

from __future__ import annotations

import pathlib
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

from croupier.client import DistributedBatchSampler, DistributedSampler, MissingCallbackWarning


@pytest.mark.parametrize("make", [
    lambda: DistributedBatchSampler(16, 4, num_replicas=2, rank=0),
    lambda: BatchSampler(DistributedSampler(16, num_replicas=2, rank=0), 4, False),
], ids=["batch sampler", "index sampler in torch's BatchSampler"])
def test_accelerate_resharding_a_croupier_sampler_is_refused(make) -> None:  # type: ignore[no-untyped-def]
    from accelerate.data_loader import BatchSamplerShard

    shard = BatchSamplerShard(make(), num_processes=2, process_index=1)
    with pytest.raises(RuntimeError, match=r"re-sharding a croupier sampler.*prepare_data_loader\(accelerator, loader\)"):
        next(iter(shard))


def test_a_batch_sampler_shard_of_one_process_changes_nothing_and_passes() -> None:
    from accelerate.data_loader import BatchSamplerShard

    sampler = DistributedBatchSampler(16, 4, num_replicas=1, rank=0, seed=3)
    try:
        batches = list(BatchSamplerShard(sampler, num_processes=1, process_index=0))
        assert len(batches) == 4 and sorted(i for b in batches for i in b) == list(range(16))  # the whole epoch
    finally:
        sampler.close()


# --------------------------------------------------------------------------- Lightning without CroupierCheckpoint


def _tiny(job: str) -> Any:
    """A LightningModule of one linear layer over 16 samples, with croupier's sampler on one rank."""
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)
            x = torch.arange(32, dtype=torch.float32).reshape(16, 2)
            self.dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))

        def train_dataloader(self) -> DataLoader[Any]:
            sampler = DistributedSampler(self.dataset, num_replicas=1, rank=0, job=job, seed=1)
            return DataLoader(self.dataset, batch_size=4, sampler=sampler)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Tiny()


def _trainer(tmp_path: pathlib.Path, epochs: int, callback: bool = False) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from croupier.integrations.lightning import CroupierCheckpoint

    extra = [CroupierCheckpoint()] if callback else []
    return pl.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True),
                                                            *extra])


@pytest.fixture(autouse=False)
def state_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    monkeypatch.setenv("CROUPIER_STATE_DIR", str(tmp_path / "state"))
    return tmp_path


def test_lightning_fit_without_the_callback_warns_and_its_resume_is_refused(state_dir: pathlib.Path) -> None:
    with pytest.warns(MissingCallbackWarning, match=r"without croupier\.integrations\.lightning\.CroupierCheckpoint"):
        _trainer(state_dir, 1).fit(_tiny("lt-no-callback"))
    last = state_dir / "ckpt" / "last.ckpt"
    assert last.exists()
    with pytest.raises(RuntimeError, match=r"resumes from .*last\.ckpt without .*CroupierCheckpoint.*callbacks="):
        _trainer(state_dir, 2).fit(_tiny("lt-no-callback"), ckpt_path=last)


def test_lightning_with_the_callback_neither_warns_nor_refuses(state_dir: pathlib.Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingCallbackWarning)
        _trainer(state_dir, 1, callback=True).fit(_tiny("lt-callback"))
        trainer = _trainer(state_dir, 2, callback=True)
        trainer.fit(_tiny("lt-callback"), ckpt_path=state_dir / "ckpt" / "last.ckpt")
    assert trainer.global_step == 8  # 4 batches an epoch, 2 epochs


# --------------------------------------------------------------------------- a loader that reads ahead


def test_a_sampler_read_ahead_by_rays_loader_wants_what_the_loop_consumed() -> None:
    """Ray Train's prepared loader moves the next batch while this one trains: the sampler has handed out one
    batch more than the loop took, so its state_dict() without consumed= is refused."""
    train_loop_utils = pytest.importorskip("ray.train.torch.train_loop_utils")
    dataset = TensorDataset(torch.arange(32))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=2)
    try:
        loader = train_loop_utils._WrappedDataLoader(DataLoader(dataset, batch_size=4, sampler=sampler),
                                                     torch.device("cpu"), False)
        it = iter(loader)
        next(it)  # the loop has taken 1 batch; the sampler has handed out 2
        assert sampler.items_done == 8
        with pytest.raises(ValueError, match="Ray Train's prepare_data_loader reads this sampler one batch ahead"):
            sampler.state_dict()
        assert sampler.state_dict(consumed=4)["items"] == 4
    finally:
        sampler.close()


def test_the_integrations_find_the_croupier_sampler_of_a_loader_or_refuse_it() -> None:
    """What Accelerate's and Ray's prepare_data_loader read of a loader (the client's one ``sampler_of``): its
    croupier sampler and items per batch, or a refusal naming the function that asked and what to use instead."""
    from croupier.client import sampler_of

    dataset = TensorDataset(torch.arange(16))
    index = DistributedSampler(dataset, num_replicas=1, rank=0)
    batches = DistributedBatchSampler(dataset, 4, num_replicas=1, rank=0)
    try:
        assert sampler_of(DataLoader(dataset, batch_size=4, sampler=index), "f", "g") == (index, 4)
        assert sampler_of(DataLoader(dataset, batch_sampler=batches), "f", "g") == (batches, 1)
        assert sampler_of(DataLoader(dataset, sampler=batches, batch_size=None), "f", "g") == (batches, 1)
        assert sampler_of(DataLoader(dataset, batch_size=None, sampler=index), "f", "g") == (index, 1)
        with pytest.raises(TypeError, match="f: a DataLoader over croupier's DistributedSampler needs a batch_size"):
            sampler_of(DataLoader(dataset, batch_size=None, sampler=index), "f", "g", batched=True)
        with pytest.raises(TypeError, match=r"f is for a DataLoader over a croupier sampler .*; use g for the others: "
                                            r"this DataLoader's sampler is a RandomSampler"):
            sampler_of(DataLoader(dataset, batch_size=4, shuffle=True), "f", "g")
    finally:
        index.close()
        batches.close()
