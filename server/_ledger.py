"""A job's step ledger in the coordinator's snapshots: its segments (``croupier.core.ledger.Segment``) read back.

Each segment is one generation that started. It is made when the generation starts and then only
learns how far its ranks got (progress reports, checkpoints) and, with dynamic dealing, what was
dealt to it: the ledger grows with generations and amendments, and with deals only for a job dealt
by its coordinator (one run of global batches per lease call, merged when consecutive).
"""

from __future__ import annotations

from typing import Any

from croupier.core.ledger import Segment
from croupier.server._events import FormatError


def segment_from(what: str, v: Any) -> Segment:
    """A segment of a snapshot, read back. Raises FormatError naming `what` and the field."""
    try:
        return Segment.from_dict(v)
    except ValueError as exc:
        raise FormatError(f"{what}: {exc}") from None
