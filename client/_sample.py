"""`Sample`: a dealt index that also says which source, which source epoch and which seed it has."""

from __future__ import annotations

import numpy as np


class Sample(int):
    """A dataset index (an int: it goes wherever an index goes) carrying where it was dealt from.

    A sampler made with ``tag=True`` hands these out. ``Dataset.__getitem__`` receives one and
    can seed the sample's random crops, masks or augmentations from it::

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i.seed)

    The seed depends on (job seed, source, source epoch, index) only
    (:func:`croupier.core.mixture.sample_seed`), so it is the same on any world size, with any
    ``num_workers`` and after any resume. Arithmetic on a Sample gives a plain int.

    Attributes:
        source: The source it comes from (0 without a mixture).
        source_epoch: That source's epoch (without a mixture: the epoch).
        seed: Its seed, in [0, 2**63).
    """

    source: int
    source_epoch: int
    seed: int

    def __new__(cls, index: int, source: int, source_epoch: int, seed: int) -> Sample:
        self = super().__new__(cls, index)
        self.source, self.source_epoch, self.seed = source, source_epoch, seed
        return self

    def __reduce__(self) -> tuple[type[Sample], tuple[int, int, int, int]]:
        # Into a DataLoader worker and back: the same index, the same tags.
        return Sample, (int(self), self.source, self.source_epoch, self.seed)

    def __repr__(self) -> str:
        return f"Sample({int(self)}, source={self.source}, source_epoch={self.source_epoch}, seed={self.seed})"


def tagged(indices: np.ndarray, tags: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[int]:
    """A lease's indices as Samples (ints, as the samplers hand them out), given its (sources, source epochs, seeds)."""
    source, epoch, seed = tags
    return [Sample(i, s, e, d) for i, s, e, d in zip(indices.tolist(), source.tolist(), epoch.tolist(), seed.tolist())]
