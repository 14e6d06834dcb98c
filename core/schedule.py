"""The trainer's step schedule: how many micro-batches of each rank one optimizer step takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from croupier.core.checks import check_int
from croupier.core.errors import FailedPrecondition, InvalidArgument
from croupier.core.registry import sized_batches
from croupier.core.spec import Spec

__all__ = ["Schedule"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How many micro-batches of each rank one optimizer step takes: the trainer's global batch.

    Attributes:
        global_batch: Samples per optimizer step over every rank (0: ``batch_size x world``, one
            micro-batch per rank per step). It must divide by ``batch_size x world`` for every world
            the job runs on: the quotient is the gradient accumulation (micro-batches per step).
        rampup: ``(start, increment, steps)``: the global batch starts at `start` and grows by
            `increment` every `steps` steps until it is `global_batch` (Megatron's
            ``rampup_batch_size``, counted in steps rather than samples: the step is what a
            checkpoint records). None: no ramp.
    """

    global_batch: int = 0
    rampup: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        check_int("global_batch", self.global_batch, 0, 2**62, InvalidArgument)
        if self.rampup is not None:
            if not isinstance(self.rampup, (tuple, list)) or len(self.rampup) != 3:
                raise InvalidArgument(f"rampup must be (start, increment, steps) (got {self.rampup!r})")
            object.__setattr__(self, "rampup", tuple(self.rampup))
            start, inc, every = self.rampup
            for name, v in (("rampup start", start), ("rampup increment", inc), ("rampup steps", every)):
                check_int(name, v, 1, 2**62, InvalidArgument)
            if not self.global_batch:
                raise InvalidArgument(f"rampup={self.rampup} needs global_batch= (the size it ramps up to)")
            if start > self.global_batch or (self.global_batch - start) % inc:
                raise InvalidArgument(
                    f"rampup={self.rampup}: the global batch must go from {start} to global_batch={self.global_batch} "
                    f"by steps of {inc} (start <= global_batch, and their difference a multiple of {inc})")

    def to_list(self) -> list[int]:
        """``[global_batch, start, increment, steps]`` (the ramp's three 0 without one)."""
        return [self.global_batch, *(self.rampup or (0, 0, 0))]

    @classmethod
    def from_list(cls, v: Sequence[int]) -> Schedule:
        g, start, inc, every = v
        return cls(g, (start, inc, every) if start else None)

    def levels(self) -> list[tuple[int, int | None, int]]:
        """``(first step, last step or None, global batch)`` of each stretch of one global batch."""
        if self.rampup is None:
            return [(1, None, self.global_batch)]
        start, inc, every = self.rampup
        n = (self.global_batch - start) // inc
        out: list[tuple[int, int | None, int]] = [(1 + k * every, (k + 1) * every, start + k * inc) for k in range(n)]
        out.append((1 + n * every, None, self.global_batch))
        return out

    def micro(self, spec: Spec, world: int, batch: int) -> int:
        """Micro-batches per rank for a global batch of `batch` samples (0: the default) on `world` ranks."""
        if not batch:
            return 1
        per = spec.batch_size * world
        if batch % per:
            raise FailedPrecondition(
                f"a global batch of {batch} samples does not divide into micro-batches of batch_size={spec.batch_size} "
                f"on {world} ranks ({per} samples a round): choose a global batch that is a multiple of {per}")
        return batch // per

    def at(self, spec: Spec, world: int, step: int) -> int:
        """Micro-batches per rank that step `step` takes (a short last step of an epoch takes fewer)."""
        g = next(g for lo, hi, g in self.levels() if lo <= step and (hi is None or step <= hi))
        return self.micro(spec, world, g)

    def check(self, spec: Spec, world: int) -> None:
        """Refuses a world on which some step's global batch does not divide (FailedPrecondition)."""
        if self.global_batch and not sized_batches(spec):
            raise FailedPrecondition("token-budget batches have no fixed size: their global batch is one batch per "
                                     "rank per step (leave global_batch unset)")
        for _, _, g in self.levels():
            self.micro(spec, world, g)

    def between(self, spec: Spec, world: int, after: int, upto: int) -> int:
        """Micro-batches per rank that steps ``after + 1 .. upto`` take."""
        total = 0
        for lo, hi, g in self.levels():
            a, b = max(lo, after + 1), upto if hi is None else min(hi, upto)
            if a <= b:
                total += (b - a + 1) * self.micro(spec, world, g)
        return total

    def covering(self, spec: Spec, world: int, after: int, micro: int) -> int:
        """The fewest steps after step `after` whose micro-batches reach `micro` (the last one may be short)."""
        steps, left = 0, micro
        for lo, hi, g in self.levels():
            a = max(lo, after + 1 + steps)
            if hi is not None and a > hi:
                continue
            m = self.micro(spec, world, g)
            span = None if hi is None else hi - a + 1
            if span is None or span * m >= left:
                return steps + -(-left // m)
            steps += span
            left -= span * m
        raise AssertionError("the last level has no end")  # pragma: no cover

    def within(self, spec: Spec, world: int, after: int, micro: int) -> int:
        """The most steps after step `after` whose micro-batches all lie within the first `micro`."""
        n = self.covering(spec, world, after, micro)
        return n if self.between(spec, world, after, after + n) <= micro else n - 1


