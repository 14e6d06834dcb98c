"""Documents some of which the dataset rejects (it raises `Filtered`), for the filtering tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from _packing_data import Docs

from croupier.client import Filtered


class FilteringDocs(Docs):
    """`Docs` whose documents in `rejected` raise ``Filtered`` when loaded (a quality filter in the workers)."""

    def __init__(self, lengths: Sequence[int], rejected: Sequence[int]) -> None:
        super().__init__(lengths)
        self.rejected = frozenset(rejected)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.rejected:
            raise Filtered(f"document {i} fails the filter")
        return super().__getitem__(i)


def kept_lengths(lengths: Sequence[int], rejected: Sequence[int]) -> list[int]:
    """The lengths every trained token is audited against: a rejected document has none to train."""
    out = set(rejected)
    return [0 if i in out else n for i, n in enumerate(lengths)]
