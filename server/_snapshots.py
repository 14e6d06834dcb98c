"""A state's snapshot payload, encoding again only the jobs whose events were applied since the last one."""

from __future__ import annotations

from collections.abc import Iterable

import msgpack

from croupier.server._jobs import snapshot_job
from croupier.server._state import State

__all__ = ["SnapshotPacker"]


def _head() -> bytes:
    """The bytes of a snapshot before its jobs: its map with every field but the jobs' array, which comes last."""
    empty = State().snapshot()
    packed = bytes(msgpack.packb(empty))
    if list(empty)[-1] != "jobs" or empty["jobs"] != [] or not packed.endswith(b"\x90"):
        raise RuntimeError(f"a snapshot must end with its jobs' array to be packed job by job (got {empty!r})")
    return packed[:-1]  # without the empty array's header


_HEAD = _head()


class SnapshotPacker:
    """Packs a state's snapshot as :func:`croupier.server._journal.pack_snapshot` does, byte for byte, from
    the encoding of each job it kept since the job last changed.

    Every event names the one job it changes (each handler of ``State.apply`` touches ``state.jobs[ev.job]``
    alone), so a job's encoding stays right until an event of that job is applied. Whoever applies events
    MUST tell :meth:`changed` which jobs they named, or None when the state was replaced.

    NOTE: a snapshot is packed under the commit protocol's lock, where every decision waits; packing every
    job each time made its cost grow with the number of jobs held (measured: 0.5 s for 4,000 one-rank jobs
    on a loaded machine, every ``snapshot_every`` events); now only the jobs changed since the last snapshot
    are encoded (20 ms for 250 of those 4,000), the rest is copied.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, bytes] = {}

    def changed(self, jobs: Iterable[str] | None) -> None:
        """Forgets the encoding of `jobs` (None: of every job, as after the state was replaced)."""
        if jobs is None:
            self._jobs.clear()
            return
        for job in jobs:
            self._jobs.pop(job, None)

    def pack(self, state: State) -> bytes:
        """The snapshot payload of `state`, equal to ``pack_snapshot(state)``."""
        kept, parts = self._jobs, []
        for name, job in state.jobs.items():
            packed = kept.get(name)
            if packed is None:
                packed = kept[name] = bytes(msgpack.packb(snapshot_job(job)))
            parts.append(packed)
        if len(kept) > len(parts):  # a job the state no longer holds
            for name in [n for n in kept if n not in state.jobs]:
                del kept[name]
        return b"".join([_HEAD, msgpack.Packer().pack_array_header(len(parts)), *parts])
