"""`croupier provenance --index I --logdir LOGDIR`: the epochs in which a sample was filtered out, from the audit logs.

The step ledger places a step's samples by the sampler's batches and never sees the packer, so it
cannot tell a trained sample from one a filter rejected after loading. The samplers' audit logs
can: ``PackedLoader`` writes a ``filtered`` record (epoch, the rank's item, index) for each rejection,
read by the one reader of audit logs (``croupier.tools.audit_log``) and kept or lost along the same
checkpoints' chain as ``croupier audit`` follows.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from croupier.core.answers import Occurrence
from croupier.core.errors import NotFound
from croupier.tools.audit import Incarnation, checkpoint_chain, load
from croupier.tools.status import table


@dataclasses.dataclass(frozen=True, order=True)
class FilteredAt:
    """One rejection of a sample: rank `rank` of generation `generation` filtered it out at its item `at` of `epoch`.

    `kept` is False when the rejection was lost with a restart (the generation's work after the
    checkpoint its successor resumed from, or a generation no later one resumed from): the sample
    was dealt again, and its rejection there is the one that counts, as ``croupier audit`` counts it.
    """

    epoch: int
    generation: int
    rank: int
    at: int
    incarnation: str
    kept: bool
    source: int

    def to_dict(self) -> dict[str, Any]:
        """As an entry of ``--index --json``'s list: the ledger's keys (step, micro-batch and source epoch null),
        ``incarnation``, ``at`` and ``filtered``."""
        return {"filtered": True, "epoch": self.epoch, "step": None, "rank": self.rank, "generation": self.generation,
                "incarnation": self.incarnation, "micro": None, "at": self.at, "kept": self.kept,
                "source": self.source, "source_epoch": None}


def _global(inc: Incarnation, index: int, source: int | None) -> int | None:
    """Sample `index` of `source` as `inc`'s sampler numbered it (None: past that source's size there)."""
    if source is None:
        return index
    if inc.mixture is None:
        return None
    from croupier.core.amend import Amendment, sizes_after

    sizes = sizes_after(tuple(inc.mixture["sources"]),
                        tuple(Amendment.from_list(a) for a in inc.mixture.get("amendments") or ()))
    return int(sum(sizes[:source])) + index if source < len(sizes) and index < sizes[source] else None


def filtered_at(logdir: str | os.PathLike[str], job: str, index: int, source: int | None = None) -> list[FilteredAt]:
    """Every rejection of dataset index `index` (of `source`, numbered within it, when given) the job's
    audit logs under `logdir` record, oldest epoch first.

    Raises:
        NotFound: no audit log of `job` under `logdir` (the message names the jobs logged there).
        ValueError: the checkpoints' chain cannot be followed (as ``croupier audit`` says).
    """
    incs = load(logdir, job).get(job, [])
    if not incs:
        logged = sorted(p.name for p in pathlib.Path(logdir).glob("*") if any(p.glob("*.audit")))
        raise NotFound(f"no audit logs of job {job!r} under {logdir} (jobs logged there: {', '.join(logged) or 'none'})")
    # NOTE: kept as croupier audit counts: along the checkpoints' chain from the latest incarnation, an
    # incarnation's records up to the checkpoint its successor resumed from; anything else was lost.
    limits = {inc.name: until for inc, until in checkpoint_chain(job, incs)}
    out = []
    for inc in incs:
        want = _global(inc, index, source)
        for e, at, got, rank in inc.filtered:
            if want is None or got != want:
                continue
            until = limits.get(inc.name, (-1, -1))
            out.append(FilteredAt(e, inc.generation, rank, at, inc.name, until is None or (e, at) < until, source or 0))
    return sorted(out)


def index_lines(job: str, index: int, source: int | None, occurrences: Sequence[Occurrence],
                filtered: Sequence[FilteredAt], ledger_lines: list[str]) -> list[str]:
    """`croupier provenance --index` as text with the rejections beside the ledger's occurrences.

    `ledger_lines` is the ledger's answer as text; an index that was filtered is not said to be
    never trained (it was dealt, and rejected).
    """
    if not filtered:
        return ledger_lines
    what = f"index {index}" if source is None else f"sample {index} of source {source}"
    kept = [f for f in filtered if f.kept]
    epochs = sorted({f.epoch for f in kept})
    head = (f"job {job!r}, {what}: filtered {len(filtered)} time{'s' if len(filtered) != 1 else ''} "
            f"({len(kept)} kept, {len(filtered) - len(kept)} abandoned)"
            + (f", in epoch{'s' if len(epochs) != 1 else ''} {', '.join(map(str, epochs))}" if epochs else ""))
    rows = [[str(f.epoch), str(f.rank), str(f.at), str(f.generation), f.incarnation,
             "filtered" if f.kept else "filtered, ABANDONED"] for f in filtered]
    lines = [head, *(f"  {line}" for line in table(["EPOCH", "RANK", "ITEM", "GENERATION", "INCARNATION", ""], rows))]
    if occurrences:
        lines += ["the step ledger (it places the samples the sampler dealt, filtered ones included):",
                  *ledger_lines]
    return lines
