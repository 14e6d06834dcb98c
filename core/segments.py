"""A job's history as the step ledger reads it: one segment per generation that started, and its wire form."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from croupier.core.amend import Amendment
from croupier.core.checks import check_int, check_type
from croupier.core.cursor import Cursor, fresh
from croupier.core.deals import EpochDeals
from croupier.core.schedule import Schedule
from croupier.core.spec import Spec

__all__ = ["Segment", "fresh_segment", "pack", "unpack"]


@dataclasses.dataclass
class Segment:
    """One generation's stretch of a job's run, as the coordinator records it.

    Attributes:
        generation: The generation's number.
        incarnation: The incarnation its ranks joined as.
        world: Its world size.
        start: Its resume point (bound to its world).
        step: Optimizer steps taken before it (the step of the checkpoint it resumed from; 0 for a
            fresh job); None when its ranks loaded a checkpoint that named no step.
        parent: The generation that took that checkpoint (None: a fresh start, or not named).
        schedule: Its trainer's step schedule.
        amendments: A mixture's amendments it dealt with, each from its position.
        reached: ``epoch -> micro-batches`` the furthest rank reported taking of each epoch.
        checkpoints: Steps of the checkpoints its ranks recorded.
        deals: Dynamic dealing: what the coordinator dealt it, by epoch (the deal books, with the
            ranks' ``own`` commits: the coordinator reads its current generation's through it).
        at_ms: When it started (the coordinator's clock).
        cuts: ``epoch -> micro-batches``: an epoch its trainer cut short (``set_epoch`` of the next
            before it ended), and the micro-batches of the rank with the most its ranks took of it:
            the next epoch's steps follow from there (``EpochCut``, ``croupier.server._decide``).
        ranks: ``rank -> (epoch, micro-batches, ms)``: each rank's last report, kept while the
            generation is the job's current one (not part of the wire form: a snapshot writes it as
            its job's ``progress``).

    NOTE: a segment is the one owner of what its generation did: the coordinator's job reads its
    current generation's progress, deals and held amendments through it (``croupier.server._jobs``),
    and its state writes each event's facts here alone; no second copy exists to disagree with it.
    """

    generation: int
    incarnation: str
    world: int
    start: Cursor
    step: int | None
    parent: int | None
    schedule: Schedule = Schedule()
    amendments: tuple[Amendment, ...] = ()
    reached: dict[int, int] = dataclasses.field(default_factory=dict)
    checkpoints: list[int] = dataclasses.field(default_factory=list)
    deals: dict[int, EpochDeals] = dataclasses.field(default_factory=dict)
    at_ms: int = 0
    cuts: dict[int, int] = dataclasses.field(default_factory=dict)
    ranks: dict[int, tuple[int, int, int]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def report(self, epoch: int, micro: int) -> None:
        """A rank reported taking `micro` micro-batches of `epoch`."""
        if micro > self.reached.get(epoch, 0):
            self.reached[epoch] = micro

    def reported(self, rank: int, epoch: int, micro: int, at_ms: int) -> None:
        """Rank `rank` reported taking `micro` micro-batches of `epoch` at `at_ms`: its last report, and how far
        the generation reached."""
        self.ranks[rank] = (epoch, micro, at_ms)
        self.report(epoch, micro)

    def checkpoint(self, step: int | None) -> None:
        if step is not None and (not self.checkpoints or step > self.checkpoints[-1]):
            self.checkpoints.append(step)

    def deal(self, epoch: int, rank: int, first: int, count: int) -> None:
        self.deals.setdefault(epoch, EpochDeals()).deal(rank, first, count)

    def cut(self, epoch: int, micro: int) -> None:
        """The trainer cut `epoch` after `micro` micro-batches of the rank with the most (its first cut stands)."""
        self.cuts.setdefault(epoch, micro)

    def commit(self, epoch: int, rank: int, batches: int) -> None:
        """Rank `rank` committed the first `batches` batches of its sequence in `epoch` (an ``own`` checkpoint)."""
        self.deals.setdefault(epoch, EpochDeals()).commit(rank, batches)

    def to_dict(self) -> dict[str, Any]:
        """The segment as a plain (msgpack-able) map: what a snapshot and GetLedger carry."""
        return {
            "generation": self.generation, "incarnation": self.incarnation, "world": self.world,
            "start": [self.start.epoch, [list(iv) for iv in self.start.remaining], self.start.base_world],
            "step": self.step, "parent": self.parent, "schedule": self.schedule.to_list(),
            "amendments": [a.to_list() for a in self.amendments],
            "reached": [[e, m] for e, m in sorted(self.reached.items())], "checkpoints": list(self.checkpoints),
            "deals": [[e, [[r, [list(x) for x in runs]] for r, runs in sorted(b.runs.items())]]
                      for e, b in sorted(self.deals.items())],
            "at_ms": self.at_ms, "cuts": [[e, m] for e, m in sorted(self.cuts.items())],
        }

    @classmethod
    def from_dict(cls, d: Any) -> Segment:
        """Inverse of :meth:`to_dict`. Raises ValueError (naming the field) for a map it would not have written.

        A segment of a snapshot of format 8 or older has no ``cuts`` (none recorded)."""
        if not isinstance(d, dict) or set(d) not in (set(_KEYS), set(_KEYS) - {"cuts"}):
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"a segment must be a map with the fields {_KEYS} (got {got})")
        try:
            epoch, remaining, base = d["start"]
            start = Cursor(_int("start epoch", epoch), tuple((_int("start", a), _int("start", b)) for a, b in remaining),
                           _int("start base world", base))
            seg = cls(_int("generation", d["generation"]), _str("incarnation", d["incarnation"]), _int("world", d["world"]),
                      start, _opt_int("step", d["step"]), _opt_int("parent", d["parent"]),
                      Schedule.from_list([_int("schedule", x) for x in d["schedule"]]),
                      tuple(Amendment.from_list(a) for a in d["amendments"]), at_ms=_int("at_ms", d["at_ms"]))
            for e, m in d["reached"]:
                seg.reached[_int("reached epoch", e)] = _int("reached", m)
            seg.checkpoints = [_int("checkpoints", x) for x in d["checkpoints"]]
            for e, m in d.get("cuts", []):
                seg.cut(_int("cuts epoch", e), _int("cuts", m))
            for e, ranks in d["deals"]:
                for r, runs in ranks:
                    for first, count in runs:
                        seg.deal(_int("deals epoch", e), _int("deals rank", r), _int("deals", first), _int("deals", count))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"segment is malformed: {exc}") from None
        return seg


_KEYS = ["generation", "incarnation", "world", "start", "step", "parent", "schedule", "amendments", "reached",
         "checkpoints", "deals", "at_ms", "cuts"]


def _int(what: str, v: Any) -> int:
    return check_int(what, v, None)


def _opt_int(what: str, v: Any) -> int | None:
    return None if v is None else _int(what, v)


def _str(what: str, v: Any) -> str:
    return check_type(what, v, str)


def pack(segments: Sequence[Segment]) -> bytes:
    """Segments as GetLedger sends them: msgpack of :meth:`Segment.to_dict`'s maps."""
    import msgpack  # NOTE: not at the top: the pure core imports no codec (tests/project/test_layout.py)

    out: bytes = msgpack.packb([s.to_dict() for s in segments], use_bin_type=True)
    return out


def unpack(blob: bytes) -> list[Segment]:
    """Inverse of :func:`pack`. Raises ValueError for bytes it would not have written."""
    import msgpack

    try:
        raw = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData) as exc:
        raise ValueError(f"the ledger is not msgpack: {exc}") from None
    if not isinstance(raw, list):
        raise ValueError(f"the ledger must be a list of segments (got {type(raw).__name__})")
    return [Segment.from_dict(v) for v in raw]


def fresh_segment(spec: Spec, generation: int, incarnation: str, world: int, **kw: Any) -> Segment:
    """A segment of a job started fresh at epoch 0 (for tests and examples)."""
    return Segment(generation, incarnation, world, fresh(spec, 0), 0, None, **kw)
