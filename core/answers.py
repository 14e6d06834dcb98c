"""The step ledger's answers: a step's versions (per rank and micro-batch, with sources and seeds) and a sample's places."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

__all__ = ["Batch", "Occurrence", "StepRecord", "Version"]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One micro-batch of one rank in one step: its samples, each with its source, source epoch and seed."""

    rank: int
    micro: int  # which micro-batch of the step (0 .. A - 1)
    indices: np.ndarray
    sources: np.ndarray
    source_epochs: np.ndarray
    seeds: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "micro": self.micro, "indices": self.indices.tolist(),
                "sources": self.sources.tolist(), "source_epochs": self.source_epochs.tolist(),
                "seeds": self.seeds.tolist()}


@dataclasses.dataclass(frozen=True)
class Version:
    """One version of a step: the run that trained it, and whether the job's timeline keeps it.

    Every kind of job answers with it (``croupier.core.history``). A generation's version has its
    world's ranks as `world` and each rank's micro-batches; a version of a torchft step
    (``croupier.core.quorum_ledger``) has the step's participating replica groups as its "ranks"
    (`world` of them, one micro-batch each, in the quorum's participant order: group ``g`` trained
    part ``g`` of the step), the `quorum` that trained it and its `span` of the job's stream;
    `generation` numbers the run (its place in the job's history) and `incarnation` names it.

    NOTE: the step's samples are kept as flat arrays in rank then micro-batch order (`samples`:
    rank, micro-batch, index, source, source epoch, seed); :attr:`batches` cuts them into one
    :class:`Batch` per rank and micro-batch when asked (thousands of objects for a big world).
    """

    step: int
    generation: int
    incarnation: str
    world: int
    epoch: int
    kept: bool
    samples: tuple[np.ndarray, ...] = dataclasses.field(repr=False, compare=False, default=())
    quorum: int | None = None  # a torchft step's quorum id; None for a generation's
    span: tuple[int, int] | None = None  # a torchft step's stream positions [start, stop); None for a generation's

    @functools.cached_property
    def batches(self) -> tuple[Batch, ...]:
        """The step's micro-batches, one per rank and micro-batch, in rank then micro-batch order."""
        if not self.samples or self.samples[0].size == 0:
            return ()
        rank, micro, idx, src, sep, seeds = self.samples
        key = rank * (int(micro.max()) + 2) + micro
        cut = np.flatnonzero(np.diff(key)) + 1
        starts, ends = np.r_[0, cut].tolist(), np.r_[cut, key.size].tolist()
        ranks, micros = rank[starts].tolist(), micro[starts].tolist()
        return tuple(Batch(r, m, idx[s:e], src[s:e], sep[s:e], seeds[s:e])
                     for r, m, s, e in zip(ranks, micros, starts, ends, strict=True))

    @property
    def indices(self) -> np.ndarray:
        """Every sample of the step, in rank then micro-batch order."""
        return self.samples[2] if self.samples else np.zeros(0, dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        out = {"step": self.step, "generation": self.generation, "incarnation": self.incarnation,
               "world": self.world, "epoch": self.epoch, "kept": self.kept,
               "batches": [b.to_dict() for b in self.batches]}
        if self.quorum is not None:
            out["quorum"] = self.quorum
        if self.span is not None:
            out["span"] = list(self.span)
        return out


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Step T: the version the timeline keeps (None when every version was abandoned) and the abandoned ones."""

    step: int
    kept: Version | None
    abandoned: tuple[Version, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "kept": None if self.kept is None else self.kept.to_dict(),
                "abandoned": [v.to_dict() for v in self.abandoned]}


@dataclasses.dataclass(frozen=True, order=True)
class Occurrence:
    """One place where a sample was trained: (epoch, step, rank, generation), kept or abandoned."""

    epoch: int
    step: int
    rank: int
    generation: int
    micro: int
    kept: bool
    source: int
    source_epoch: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
