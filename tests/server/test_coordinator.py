"""The coordinator's writer thread: the one group-commit layer between joins and the store."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from croupier.core.api import JoinRequest
from croupier.core.spec import Spec
from croupier.server._coordinator import Coordinator
from croupier.server._memory_store import MemoryStore

SPEC = Spec(n=40, seed=1, batch_size=4)
#: The events of a job's first join with world 1: JobRegistered, GenerationOpened, RankJoined, GenerationStarted.
EVENTS_PER_JOB = 4


class GatedStore(MemoryStore):
    """A memory store whose first append waits until the test lets it go, recording every append's size.

    It also checks the Store contract's one-writer rule: no append overlaps another.
    """

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.overlapped = False
        self._in_append = threading.Lock()

    def append(self, records: Sequence[bytes]) -> int:
        if not self._in_append.acquire(blocking=False):
            self.overlapped = True
            raise AssertionError("append called while another append is running")
        try:
            self.batches.append(len(records))
            if len(self.batches) == 1:
                self.entered.set()
                if not self.release.wait(timeout=60):
                    raise AssertionError("the test never released the first append")
            return super().append(records)
        finally:
            self._in_append.release()


def test_joins_queued_during_a_commit_share_the_next_append() -> None:
    store = GatedStore()
    core = Coordinator(store)
    joins = 8
    errors: list[BaseException] = []

    def join(job: str) -> None:
        try:
            result = core.join(JoinRequest(job, SPEC, "t", 1, 0))
            assert result.start is not None
        except BaseException as exc:  # reported below; a thread's exception is otherwise lost
            errors.append(exc)

    first = threading.Thread(target=join, args=("first",))
    others = [threading.Thread(target=join, args=(f"job{i}",)) for i in range(joins)]
    try:
        first.start()
        assert store.entered.wait(timeout=60), "the writer never appended the first join"
        for t in others:
            t.start()
        # Every other join is decided, applied and queued while the first commit is in flight.
        lock = core._commits._cond  # type: ignore[attr-defined]  # the protocol's own lock, as its writer waits on it
        with lock:
            queued = lock.wait_for(lambda: len(core._commits._pending) == joins * EVENTS_PER_JOB, timeout=60)
        assert queued, f"only {len(core._commits._pending)} events queued"
    finally:
        store.release.set()
        first.join()
        for t in others:
            t.join()
    try:
        assert not errors, errors
        assert not store.overlapped
        assert store.batches == [EVENTS_PER_JOB, joins * EVENTS_PER_JOB]
        assert core.failed is None
        assert store.load().last_seq == (joins + 1) * EVENTS_PER_JOB
    finally:
        core.close()


def test_a_closed_coordinator_refuses_to_decide_instead_of_waiting_for_its_writer() -> None:
    """A caller in the coordinator's own process (a rank beside its embedded coordinator) may reach
    it while it closes: a commit then is UNAVAILABLE, not a wait for a writer that has stopped."""
    import pytest

    from croupier.core.errors import Unavailable

    core = Coordinator(MemoryStore())
    g = core.join(JoinRequest("closing", SPEC, "t", 1, 0))
    assert g.start is not None
    core.grant("closing", g.generation, 0, 0, 0, 2, (0, 1))  # a progress report: a commit
    core.close()
    done: list[BaseException] = []
    t = threading.Thread(target=lambda: done.append(_raised(lambda: core.join(JoinRequest("later", SPEC, "t", 1, 0)))),
                         daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "a join on a closed coordinator waited for its stopped writer"
    with pytest.raises(Unavailable, match="shutting down"):
        raise done[0]


def _raised(call: object) -> BaseException:
    try:
        call()  # type: ignore[operator]
    except BaseException as e:
        return e
    raise AssertionError("no error")
