"""croupier under ``torch.distributed.checkpoint`` (DCP), as torchtitan checkpoints its dataloader.

Save ``{"model": ..., "optim": ..., "dataloader": SamplerState(loader)}`` with ``dcp.save`` and
load the same dict with ``dcp.load``, with any world size on load (``loader`` is the
:class:`~croupier.client.Loader` the loop iterates, which counts the batches that reached it)::

    from croupier.client import DistributedSampler, Loader
    from croupier.integrations.dcp import SamplerState

    loader = Loader(DataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset), num_workers=4))
    data = SamplerState(loader, step=lambda: train_state.step)
    state = {"model": model_state, "optim": optim_state, "dataloader": data}
    dcp.load(state, checkpoint_id=resume_dir)  # before the first batch; saved with any world size
    ...
    dcp.save(state, checkpoint_id=step_dir)    # on every rank (a collective), mid-epoch is fine

How DCP treats a ``Stateful`` whose ``state_dict()`` holds plain values (torch 2.4 to 2.13, read in
``torch/distributed/checkpoint``; checked by ``tests/integrations/test_integration_dcp.py``), and what follows:

* Flattening: nested mappings are flattened into dotted keys (``dataloader.epoch``,
  ``dataloader.remaining``, ...); a list holding no tensor and no mapping is a leaf. Every leaf
  that is not a tensor is pickled with ``torch.save`` into its own byte item.
* Dedup across ranks: byte items are keyed by their dotted key alone, so N ranks saving the same
  key write it once (``dedup_save_plans`` keeps one rank's copy). The sampler's state is identical
  on every rank in lockstep, so one copy is all there is, and a checkpoint saved by N ranks loads
  on M: every rank of the new world reads the same items. NOTE: if ranks ever disagreed (a
  ``consumed`` counted differently on one rank), DCP would keep one of them without a word.
* Loading: ``dcp.load`` calls ``state_dict()`` on the *new* object for a template and reads back
  only the keys that template has (a template key absent from the checkpoint is an error; a
  checkpoint key absent from the template is dropped silently). Then it calls
  ``load_state_dict`` with the filled-in template.

The last point is why the sampler is not handed to DCP directly, although it is a ``Stateful``
(it has both methods) and would resume at the right position: a sampler that has loaded nothing
returns a state without the optional ``origin``, ``generation`` and ``incarnation`` keys (the
checkpoint's name, and who took it), so ``dcp.load`` drops them and the resumed incarnation's audit
log names no checkpoint: ``croupier audit`` then cannot follow the chain and fails the job
("UNVERIFIED: ... a restart that did not load the sampler's checkpoint state?"). Any optional key
a later release adds would be dropped the same way.

:class:`SamplerState` therefore saves the whole state as one JSON string under one key: DCP stores
it as one byte item (still deduplicated, still read by every rank of any world), the template
always has that key, and nothing the sampler put in its state is lost. JSON rather than the dict
itself: a str survives any ``torch.load`` (``weights_only`` or not) and reads as text in the
checkpoint. A ``uint8`` tensor was not chosen: DCP loads a tensor into the template's tensor,
whose size would have to be known before loading.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from croupier.client import DistributedBatchSampler, DistributedSampler, Loader

#: The one key of :meth:`SamplerState.state_dict`; its value is the sampler's state as JSON.
KEY = "croupier_sampler_state"


class SamplerState(Stateful):
    """A croupier sampler as a DCP ``Stateful``: its checkpoint state as one JSON string under one key.

    Args:
        sampler: The job's :class:`~croupier.client.DistributedSampler` or
            :class:`~croupier.client.DistributedBatchSampler`, or the :class:`~croupier.client.Loader`
            the loop iterates over it: a ``Loader`` counts the batches that reached the loop, so its
            state is exact with any ``num_workers`` (``Loader.state_dict(step=...)``), and it is
            loaded through ``Loader.load_state_dict``.
        consumed: A sampler under a loader that reads it ahead (a plain ``DataLoader`` with
            ``num_workers > 0``) without a ``Loader``: a callable that returns how many items
            (indices, or batches for the batch sampler) this rank's loop has taken in the current
            epoch, from the epoch's start; it is called at every save. Leave it out with a
            ``Loader`` (which counts them), ``num_workers=0`` or a ``StatefulDataLoader``: the
            sampler has then yielded exactly what the loop took.
        step: A callable that returns the trainer's global step (torchtitan's ``train_state.step``),
            called at every save: DCP's ``state_dict()`` takes no argument, so this is how the
            sampler's state names its step (``state_dict(step=...)``) for the coordinator's step
            ledger and ``resume_from_step``. Leave it out to name none.
    """

    def __init__(self, sampler: DistributedSampler | DistributedBatchSampler | Loader,
                 consumed: Callable[[], int] | None = None, step: Callable[[], int] | None = None) -> None:
        if isinstance(sampler, Loader) and consumed is not None:
            raise ValueError("SamplerState(Loader, consumed=...): the Loader counts what the loop took; leave consumed out")
        self.sampler = sampler
        self.consumed = consumed
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        """``{KEY: json}``: the sampler's state, the same on every rank in lockstep (DCP saves it once).

        NOTE: after the first batch, each call names a checkpoint in the sampler's audit log
        (``dcp.save`` calls it once per save); ``dcp.load`` calls it before the first batch, for a
        template, which names nothing.
        """
        step = None if self.step is None else self.step()
        if isinstance(self.sampler, Loader):
            state = self.sampler.state_dict(step=step)
        else:
            consumed = None if self.consumed is None else self.consumed()
            state = self.sampler.state_dict(consumed=consumed, step=step)
        return {KEY: json.dumps(state, sort_keys=True, separators=(",", ":"))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` saved, with any world size; before the sampler's first batch.

        Raises:
            ValueError: `state_dict` has no ``KEY`` (a checkpoint that saved something else under
                this name, e.g. the sampler itself), or its value is not a JSON object; and the
                sampler's own errors (another job or spec).
            RuntimeError: the sampler has already served a batch (a ``Loader``: has begun a pass).
        """
        if KEY not in state_dict:
            raise ValueError(f"not a croupier SamplerState: no {KEY!r} key (got keys {sorted(state_dict)})")
        raw = state_dict[KEY]
        if isinstance(raw, bytes):
            raw = raw.decode()
        try:
            state = json.loads(raw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the saved sampler state is not JSON ({e}): {raw!r:.200}") from None
        if not isinstance(state, dict):
            raise ValueError(f"the saved sampler state is not a JSON object: {raw!r:.200}")
        self.sampler.load_state_dict(state)
