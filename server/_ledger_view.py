"""What the status page shows of a job's step ledger: its timeline's bands and marks, its realized mix, one step's samples.

Pure functions of a :class:`croupier.core.ledger.Ledger` (the coordinator builds it, see
``Coordinator.step_ledger``); ``croupier.server._http`` serves them as ``/api/ledger``, ``/api/mix`` and
``/api/step``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from croupier.core.checks import is_int
from croupier.core.errors import InvalidArgument
from croupier.core.ledger import Ledger, Segment, Version

#: The kept steps are cut into at most this many windows for the realized mix ...
MIX_WINDOWS = 32
#: ... and each window's shares are counted over the samples of at most this many of its steps, spread
#: evenly, sampled until they hold this many samples (a step of 1,024 ranks is one step a window).
MIX_STEPS, MIX_SAMPLES = 8, 2048
#: Samples listed of each micro-batch of a step unless asked (``?samples=``), and at most.
STEP_SAMPLES, MAX_STEP_SAMPLES = 16, 1000
#: Micro-batches listed of one version of a step, at most (``batch_count`` says how many it has).
MAX_STEP_BATCHES = 4096


def ledger_json(ledger: Ledger) -> dict[str, Any]:
    """The job's timeline on a step axis and its marks (``/api/ledger``): no step is computed.

    Returns:
        ``segments``: one per generation that started, oldest first, as ``Ledger.timeline()`` has it
        (``from_step`` .. ``to_step`` trained, kept up to ``kept_to``; ``from_step`` None: it resumed
        from a checkpoint that named no step and has no place on the axis), but for ``amendments``,
        counted; ``marks``: the resizes, rollbacks and amendment changes (:func:`marks`); ``sources``
        (None for a job of one source); ``last_step`` the timeline's last step and ``furthest_step``
        the furthest any version went.
    """
    rows = [{**row, "amendments": len(seg.amendments)} for row, seg in zip(ledger.timeline(), ledger.segments, strict=True)]
    return {"job": ledger.job, "sources": None if ledger.spec.sources is None else len(ledger.spec.sources),
            "last_step": ledger.last_step, "furthest_step": ledger.furthest_step, "segments": rows,
            "marks": marks(ledger.segments, rows)}


def marks(segments: list[Segment], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What changed from each segment to the next (in generation order), at the step the later one begins.

    Each mark has ``kind``, ``generation`` (the later segment), ``previous`` (the earlier one) and
    ``step`` (where the later one begins; None when it has no place on the axis), and:

    - ``resize``: the world changed, ``from_world`` -> ``to_world``;
    - ``rollback``: the later one began below the step the earlier one reached (``from_step``);
    - ``amendment``: the amendments it deals with changed: ``added`` (each described), ``removed`` (a count).
    """
    out: list[dict[str, Any]] = []
    for k in range(1, len(segments)):
        prev, seg, prow, row = segments[k - 1], segments[k], rows[k - 1], rows[k]
        base = {"generation": seg.generation, "previous": prev.generation, "step": row["from_step"]}
        if seg.world != prev.world:
            out.append({"kind": "resize", **base, "from_world": prev.world, "to_world": seg.world})
        if row["from_step"] is not None and prow["to_step"] is not None and row["from_step"] < prow["to_step"]:
            out.append({"kind": "rollback", **base, "from_step": prow["to_step"]})
        if seg.amendments != prev.amendments:
            added = [a.describe() for a in seg.amendments if a not in prev.amendments]
            removed = sum(1 for a in prev.amendments if a not in seg.amendments)
            out.append({"kind": "amendment", **base, "added": added, "removed": removed})
    if segments and segments[0].amendments:
        first = segments[0]
        out.insert(0, {"kind": "amendment", "generation": first.generation, "previous": None, "step": rows[0]["from_step"],
                       "added": [a.describe() for a in first.amendments], "removed": 0})
    return out


def mix(ledger: Ledger, windows: int = MIX_WINDOWS, per_window: int = MIX_STEPS,
        enough: int = MIX_SAMPLES) -> dict[str, Any] | None:
    """A mixture's realized mix (``/api/mix``): each source's share among the samples of the kept steps, by window.

    The kept steps (from the oldest kept segment's first to the timeline's last) are cut into at most
    `windows` windows of consecutive steps. In each, up to `per_window` steps spread evenly over it
    are candidates, taken in bit-reversed order (so that those taken are spread over the window too)
    until the samples counted reach `enough`. At most ``windows x per_window`` steps are computed, however long
    the run, and a run of large steps computes one a window.

    NOTE: sampled, not summed: a step of a 1,024-rank run takes tens of milliseconds to compute, so a
    1e6-step run's every step would take hours; a mixture deals each source's share exactly over any
    stretch of its stream, so a few thousand samples a window show its weights and every change of them.

    Returns:
        None for a job of one source; else ``sources`` (how many), ``windows``, ``steps_per_window``
        and ``samples_per_window`` (the bounds used) and ``series``: per window ``first`` and ``last``
        step, ``steps`` (the ones sampled), ``samples`` (counted over them) and ``shares`` (per
        source, adding up to 1; all 0 when no sampled step had a kept version).
    """
    if ledger.spec.sources is None:
        return None
    n_src = len(ledger.spec.sources)
    out: dict[str, Any] = {"sources": n_src, "windows": windows, "steps_per_window": per_window,
                           "samples_per_window": enough, "series": []}
    kept = [r for r in ledger.timeline() if r["kept_to"] is not None and r["from_step"] is not None]
    if not kept:
        return out
    first = kept[0]["from_step"] + 1
    span = ledger.last_step - first + 1
    cut = min(windows, max(span, 0))
    for w in range(cut):
        a, b = first + w * span // cut, first + (w + 1) * span // cut - 1
        size, k = b - a + 1, min(per_window, b - a + 1)
        counts, taken = np.zeros(n_src, dtype=np.int64), []
        for i in _spread(k):
            t = a + (2 * i + 1) * size // (2 * k)
            version = ledger.step(t).kept
            taken.append(t)
            if version is not None:
                for batch in version.batches:
                    counts += np.bincount(batch.sources, minlength=n_src)[:n_src]
            if counts.sum() >= enough:
                break
        total = int(counts.sum())
        shares = (counts / total).tolist() if total else [0.0] * n_src
        out["series"].append({"first": a, "last": b, "steps": sorted(taken), "samples": total, "shares": shares})
    return out


def _spread(k: int) -> list[int]:
    """0 .. k - 1 in bit-reversed order (0, 4, 2, 6, 1, ... for 8): every prefix is spread over the range."""
    bits = max(1, (k - 1).bit_length())
    return sorted(range(k), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))


def step_json(ledger: Ledger, step: Any, samples: Any = STEP_SAMPLES) -> dict[str, Any]:
    """Step `step`'s samples as ``Ledger.step(step).to_dict()`` has them, bounded (``/api/step``).

    Each micro-batch lists its first `samples` samples (indices, sources, source epochs, seeds;
    ``shown`` says how many at most) and gains ``count``, how many it has; each version lists its
    first ``MAX_STEP_BATCHES`` micro-batches and gains ``batch_count`` and ``samples``, how many it
    has of each.

    Raises:
        InvalidArgument: `step` or `samples` is not an int in its range (the message names the value).
        OutOfRange, FailedPrecondition: as ``Ledger.step``.
    """
    t, k = _as_int(step), _as_int(samples)
    if t is None or t < 1:
        raise InvalidArgument(f"step must be an int >= 1 (steps count from 1, as the trainers log them; got step={step!r})")
    if k is None or not 1 <= k <= MAX_STEP_SAMPLES:
        raise InvalidArgument(f"samples must be an int in [1, {MAX_STEP_SAMPLES}] (got samples={samples!r})")
    rec = ledger.step(t)
    return {"step": rec.step, "shown": k, "kept": None if rec.kept is None else _version(rec.kept, k),
            "abandoned": [_version(v, k) for v in rec.abandoned]}


def _version(v: Version, k: int) -> dict[str, Any]:
    shown = v.batches[:MAX_STEP_BATCHES]
    d: dict[str, Any] = {"step": v.step, "generation": v.generation, "incarnation": v.incarnation, "world": v.world,
                         "epoch": v.epoch, "kept": v.kept}
    d["batches"] = [dataclasses.replace(b, indices=b.indices[:k], sources=b.sources[:k],
                                        source_epochs=b.source_epochs[:k], seeds=b.seeds[:k]).to_dict() for b in shown]
    for bd, b in zip(d["batches"], shown, strict=True):
        bd["count"] = int(b.indices.size)
    d["batch_count"] = len(v.batches)
    d["samples"] = sum(int(b.indices.size) for b in v.batches)
    return d


def _as_int(v: Any) -> int | None:
    """An int, or the decimal digits of a query parameter as one; None for anything else."""
    if is_int(v):
        return int(v)
    if isinstance(v, str) and _DECIMAL.fullmatch(v):
        return int(v)
    return None


_DECIMAL = re.compile(r"-?[0-9]{1,19}")
