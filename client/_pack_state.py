"""A packed loader's checkpoint: each rank's part, their merge into one state, and a new rank's share of it."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from croupier.core.checks import check_int, is_int

#: The packed state's format: ``{"version", "epoch", "sampler", "waiting", "skip"}``.
VERSION = 1
_KEYS = {"version", "epoch", "sampler", "waiting", "skip"}
Key = tuple[int, int, int]  # (dataset index, token offset, length) of a piece


@dataclasses.dataclass(frozen=True)
class Part:
    """What one rank contributes to a checkpoint of the packed loader.

    Attributes:
        rank: The rank.
        epoch: The epoch its packer is in.
        pulled: Samples of the epoch it took from the loader, counted from the epoch's start as the
            sampler counts its items (those before a resumed checkpoint included).
        done: Its loader's epoch ended and every piece went into a yielded row.
        log: The dataset indices it took at items ``[pulled - len(log), pulled)``, in order (it
            keeps them from its last checkpoint on: enough to hold every item past the new cut).
        hits: Indices of the state it loaded that it dropped as already trained (see :func:`merge`).
        waiting: Its pieces loaded but in no yielded row, in the order it would train them.
    """

    rank: int
    epoch: int
    pulled: int
    done: bool
    log: tuple[int, ...] = ()
    hits: tuple[int, ...] = ()
    waiting: tuple[Key, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (what a collective sends)."""
        return {"rank": self.rank, "epoch": self.epoch, "pulled": self.pulled, "done": self.done,
                "log": list(self.log), "hits": list(self.hits), "waiting": [list(k) for k in self.waiting]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Part:
        """The part :meth:`to_dict` made."""
        return cls(d["rank"], d["epoch"], d["pulled"], d["done"], tuple(d["log"]), tuple(d["hits"]),
                   tuple((int(a), int(b), int(c)) for a, b, c in d["waiting"]))


@dataclasses.dataclass(frozen=True)
class Merged:
    """Every rank's parts made one: the sampler's cut and what the packer adds to it.

    Attributes:
        epoch: The epoch the ranks' packers are in (the waiting pieces are of it).
        cut: The sampler's items every rank took (the fewest any rank pulled): the sampler's state
            is taken at ``consumed=cut``.
        done: Every rank's epoch is over, every piece trained: the sampler's state is the next epoch's.
        waiting: Every rank's waiting pieces, rank by rank, each rank's in its order.
        skip: Indices the sampler deals again after the cut that must not be loaded again (one
            entry per time), sorted.
    """

    epoch: int
    cut: int
    done: bool
    waiting: tuple[Key, ...]
    skip: tuple[int, ...]


def merge(parts: Sequence[Part], loaded_skip: Sequence[int]) -> Merged:
    """The checkpoint of a world whose ranks each gave their `parts`.

    The ranks pulled different numbers of samples (documents vary in length), but a sampler's
    state is one count for every rank: it is taken at the fewest, the *cut*. A sample a rank took
    past the cut is dealt again after a resume, though it was trained or is waiting: it goes into
    `skip`, and the packer that meets it drops it (its waiting pieces are reloaded by index). The
    skip entries of the state loaded that no rank met yet stay.

    Args:
        parts: One part per rank of the world, each logging at least its items past the cut.
        loaded_skip: The skip entries of the state the ranks loaded for this epoch (every rank
            loaded the same).

    Raises:
        ValueError: the parts are not of one world in one epoch, or a log is too short.
    """
    if not parts:
        raise ValueError("merge needs every rank's part (got none)")
    ranks = sorted(p.rank for p in parts)
    if ranks != list(range(len(parts))):
        raise ValueError(f"merge needs one part from each rank 0..{len(parts) - 1} (got ranks {ranks})")
    epochs = sorted({p.epoch for p in parts})
    if len(epochs) > 1:
        raise ValueError(f"the ranks' packers are in different epochs {epochs}: take the checkpoint inside an "
                         "epoch, on every rank at the same step")
    parts = sorted(parts, key=lambda p: p.rank)
    cut = min(p.pulled for p in parts)
    skip = Counter(loaded_skip)
    for p in parts:
        skip.subtract(Counter(p.hits))
        first = p.pulled - len(p.log)
        if first > cut:
            raise ValueError(f"rank {p.rank} logged its items from {first} on, after the cut at {cut}")
        skip.update(p.log[cut - first:])
    if any(v < 0 for v in skip.values()):
        raise ValueError(f"the ranks dropped more samples than the state loaded named: {dict(-skip)}")
    done = all(p.done for p in parts)
    waiting = tuple(k for p in parts for k in p.waiting)
    return Merged(epochs[0], cut, done, waiting, () if done else tuple(sorted(skip.elements())))


def share(waiting: Sequence[Key], world: int, rank: int) -> list[Key]:
    """`rank`'s share of a state's waiting pieces in a world of `world` ranks: every `world`-th
    piece from the `rank`-th, in the state's order (any world size: each piece to exactly one rank)."""
    return list(waiting[rank::world])


def to_state(sampler_state: dict[str, Any], m: Merged) -> dict[str, Any]:
    """The packed loader's checkpoint state: the sampler's at the cut, the waiting pieces, the skip entries."""
    return {"version": VERSION, "epoch": m.epoch, "sampler": sampler_state, "waiting": [list(k) for k in m.waiting],
            "skip": list(m.skip)}


def from_state(state: Mapping[str, Any]) -> tuple[int | None, dict[str, Any], list[Key], list[int]]:
    """Reads a packed loader's state: its epoch, the sampler's state, the waiting pieces and the skip entries.

    An empty mapping is "from the start": ``(None, {}, [], [])``.

    Raises:
        TypeError: `state` is not a mapping.
        ValueError: it is malformed (the message names the key and the value).
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"a packed loader's state must be a dict (got {type(state).__name__})")
    if not state:
        return None, {}, [], []
    if set(state) != _KEYS:
        raise ValueError(f"a packed loader's state has the keys {sorted(_KEYS)} (got {sorted(state)}); a sampler's "
                         "own state goes to the sampler's load_state_dict")
    if state["version"] != VERSION:
        raise ValueError(f"packed loader state version {state['version']!r} is not one this release reads ({VERSION})")
    check_int("the packed state's epoch", state["epoch"], 0, type_error=ValueError)
    if not isinstance(state["sampler"], Mapping):
        raise ValueError(f"the packed state's sampler must be a sampler's state dict (got {state['sampler']!r})")
    waiting: list[Key] = []
    for k in state["waiting"]:
        if not (isinstance(k, (list, tuple)) and len(k) == 3):
            raise ValueError(f"a waiting piece is [index >= 0, offset >= 0, length >= 1] (got {k!r})")
        waiting.append((check_int("a waiting piece's index", k[0], 0, type_error=ValueError),
                        check_int("a waiting piece's offset", k[1], 0, type_error=ValueError),
                        check_int("a waiting piece's length", k[2], 1, type_error=ValueError)))
    skip = state["skip"]
    if not isinstance(skip, (list, tuple)) or not all(is_int(i) and i >= 0 for i in skip):
        raise ValueError(f"the packed state's skip is a list of indices >= 0 (got {skip!r})")
    return int(state["epoch"]), dict(state["sampler"]), waiting, [int(i) for i in skip]
