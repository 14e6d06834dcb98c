"""Every loader wrapper counts what the loop consumed by one rule, the epoch's short last batch included.

One rank, in process: an epoch of 18 indices in loader batches of 4 (the last holds 2), driven
through each wrapper's save path (``Loader``, DCP's ``SamplerState``, Ray's ``report``,
Accelerate's loader state, the HF Trainer's ``on_save``, Lightning's callback). After every batch
the loop takes, each wrapper's ``consumed=`` must be the items of the batches taken, and after the
last one what the sampler handed out (its ``items_done``, its ``len()``): a wrapper that counts the
short batch as a full one, or by a rule of its own, disagrees with the others and fails here.
Ray's and Lightning's loaders read one batch ahead of the loop (the sampler is ahead of the count);
they are stood in for by a reader that does the same, without starting either framework.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from torch.utils.data import BatchSampler, DataLoader

from croupier.client import DistributedBatchSampler, DistributedSampler, Loader

# NOTE: each trainer's integration (and its framework: Lightning, Ray, Transformers, Accelerate take
# seconds to import) is imported by the wrapper that drives it, so only the pytest-xdist worker that
# runs this file pays for them, not every worker that collects it.

N, BATCH = 18, 4  # 5 loader batches an epoch: the last holds 2 indices
Sampler = DistributedSampler | DistributedBatchSampler


@pytest.fixture(scope="module")
def address(module_address: str) -> str:
    return module_address


def _index(address: str) -> tuple[DataLoader[Any], Sampler]:
    s = DistributedSampler(N, num_replicas=1, rank=0, address=address, job=uuid.uuid4().hex, tail="uneven")
    return DataLoader(list(range(N)), batch_size=BATCH, sampler=s), s


def _index_under_batch_sampler(address: str) -> tuple[DataLoader[Any], Sampler]:
    s = DistributedSampler(N, num_replicas=1, rank=0, address=address, job=uuid.uuid4().hex, tail="uneven")
    return DataLoader(list(range(N)), batch_sampler=BatchSampler(s, BATCH, False)), s


def _batches(address: str) -> tuple[DataLoader[Any], Sampler]:
    s = DistributedBatchSampler(N, BATCH, num_replicas=1, rank=0, address=address, job=uuid.uuid4().hex, tail="uneven")
    return DataLoader(list(range(N)), batch_sampler=s), s


LOADERS: dict[str, Callable[[str], tuple[DataLoader[Any], Sampler]]] = {
    "index": _index, "index under a BatchSampler": _index_under_batch_sampler, "batch sampler": _batches}


def _one_ahead(batches: Iterator[Any]) -> Iterator[Any]:
    """The batches of `batches`, each yielded once the next one was read (as Ray's and Lightning's loaders do)."""
    it = iter(batches)
    ahead = next(it, None)
    while ahead is not None:
        batch, ahead = ahead, next(it, None)
        yield batch


def _recording(sampler: Sampler, monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The ``consumed=`` of every ``state_dict`` call on `sampler` from now on (each still made)."""
    seen: list[int | None] = []
    real = sampler.state_dict

    def state_dict(consumed: int | None = None, *, step: int | None = None) -> dict[str, Any]:
        seen.append(consumed)
        return real(consumed, step=step)

    monkeypatch.setattr(sampler, "state_dict", state_dict)
    return seen


# Each wrapper: drives one epoch of `loader`, calls `saved()` after every batch the loop took, through
# the wrapper's own save path; returns nothing (the counts are recorded on the sampler).
Drive = Callable[[DataLoader[Any], Sampler, Callable[[Any], None], pytest.MonkeyPatch], None]


def _loader(dl: DataLoader[Any], s: Sampler, took: Callable[[Any], None], mp: pytest.MonkeyPatch) -> None:
    loader = Loader(dl)
    for batch in loader:
        took(batch)
        loader.state_dict()


def _dcp(dl: DataLoader[Any], s: Sampler, took: Callable[[Any], None], mp: pytest.MonkeyPatch) -> None:
    from croupier.integrations.dcp import SamplerState

    loader = Loader(dl)
    state = SamplerState(loader)
    for batch in loader:
        took(batch)
        state.state_dict()


class _ReadAhead:
    """A loader that reads one batch ahead of the loop, as Ray's prepared loader does."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return _one_ahead(iter(self.loader))


def _ray(dl: DataLoader[Any], s: Sampler, took: Callable[[Any], None], mp: pytest.MonkeyPatch) -> None:
    # Ray's side without a Ray session: its prepared loader reads ahead, a worker of rank 1 reports
    import ray.train
    import ray.train.torch

    from croupier.integrations import ray as croupier_ray

    mp.setattr(ray.train.torch, "prepare_data_loader", lambda loader, **_: _ReadAhead(loader))
    mp.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_world_rank=lambda: 1))
    mp.setattr(ray.train, "report", lambda metrics, checkpoint=None: None)
    counted = croupier_ray.prepare_data_loader(dl)
    for batch in counted:
        took(batch)
        croupier_ray.report({}, counted)


def _accelerate(dl: DataLoader[Any], s: Sampler, took: Callable[[Any], None], mp: pytest.MonkeyPatch) -> None:
    import accelerate  # type: ignore[import-untyped]

    from croupier.integrations.accelerate import prepare_data_loader

    loader = prepare_data_loader(accelerate.Accelerator(cpu=True), dl, register=False)
    for batch in loader:
        took(batch)
        loader.croupier_state.state_dict()


def _transformers(dl: DataLoader[Any], s: Sampler, took: Callable[[Any], None], mp: pytest.MonkeyPatch) -> None:
    # the loader CroupierTrainer.get_train_dataloader makes, saved by its callback's on_save
    import accelerate  # type: ignore[import-untyped]

    from croupier.integrations.accelerate import prepare_data_loader
    from croupier.integrations.transformers import CroupierCallback

    loader = prepare_data_loader(accelerate.Accelerator(cpu=True), dl, register=False)
    callback, args = CroupierCallback(), SimpleNamespace(should_save=False)
    for step, batch in enumerate(loader, 1):
        took(batch)
        callback.on_save(args, SimpleNamespace(global_step=step), None, train_dataloader=loader)


def _lightning(dl: DataLoader[Any], s: Sampler, took: Callable[[Any], None], mp: pytest.MonkeyPatch,
               more: int = 0) -> None:
    # what CroupierCheckpoint.state_dict reads of the Trainer: its train loaders, the fit loop's batch count
    from croupier.integrations.lightning import CroupierCheckpoint

    current = SimpleNamespace(processed=0)
    callback = CroupierCheckpoint()
    callback._trainer = SimpleNamespace(  # type: ignore[assignment]
        fit_loop=SimpleNamespace(_combined_loader=SimpleNamespace(flattened=[dl]),
                                 epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=current))),
        num_training_batches=len(dl) + more, global_step=0)
    for batch in _one_ahead(iter(dl)):  # Lightning's fetcher reads one batch ahead
        took(batch)
        current.processed += 1
        callback.state_dict()


def _lightning_longer(dl: DataLoader[Any], s: Sampler, took: Callable[[Any], None], mp: pytest.MonkeyPatch) -> None:
    # Lightning's measure of the epoch longer than what the rank was handed (a dealt epoch's len() is an
    # estimate): the short last batch is counted as any other, not as the epoch's end
    _lightning(dl, s, took, mp, more=1)


WRAPPERS: dict[str, Drive] = {"Loader": _loader, "dcp": _dcp, "ray": _ray, "accelerate": _accelerate,
                              "transformers": _transformers, "lightning": _lightning,
                              "lightning, epoch measured longer": _lightning_longer}


@pytest.mark.parametrize("kind", list(LOADERS))
def test_every_wrapper_counts_a_short_last_batch_as_the_sampler_handed_it_out(
        address: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    counts: dict[str, list[int | None]] = {}
    truths: dict[str, list[int]] = {}
    for name, drive in WRAPPERS.items():
        dl, sampler = LOADERS[kind](address)
        seen = _recording(sampler, monkeypatch)
        truth: list[int] = []

        def took(batch: Any, s: Sampler = sampler, truth: list[int] = truth) -> None:
            # the sampler's items in the batch: its indices, or one batch of the batch sampler
            truth.append((truth[-1] if truth else 0) + (1 if isinstance(s, DistributedBatchSampler) else len(batch)))

        with monkeypatch.context() as mp:
            drive(dl, sampler, took, mp)
        assert truth[-1] == sampler.items_done == len(sampler), (name, truth, sampler.items_done)
        counts[name], truths[name] = seen, truth
        sampler.close()
    expected = truths["Loader"]
    assert len(expected) == 5 and expected[-1] - expected[-2] in (1, 2)  # the short last batch
    wrong = {name: seen for name, seen in counts.items() if seen != truths[name] or seen != expected}
    assert not wrong, f"the items consumed after each batch are {expected}; these wrappers counted otherwise: {wrong}"
