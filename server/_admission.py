"""Admission of the calls a served coordinator takes: calls in progress bounded per job and in all, joins waiting
bounded, one more refused at once with a retry hint."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from croupier.core import errors as E
from croupier.server._options import ServerOptions

#: The trailing metadata key of a refusal's retry hint: milliseconds the client waits (jittered) before it asks again.
RETRY_AFTER_KEY = "croupier-retry-after-ms"
#: A refusal's retry hint: this much, plus a millisecond for each call refused in the last second, at most HINT_MAX_MS.
HINT_BASE_MS, HINT_MAX_MS = 50, 2000


class Refused(E.ResourceExhausted):
    """Over an admission bound: asked again after `retry_after_ms`, the call may pass."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(f"{message}; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class Admission:
    """Calls in progress, bounded per job and in all, and joins waiting, bounded: one more is refused at once.

    Only the event loop's thread uses it (no lock). A call counts from its request's arrival to its
    answer, but a join's wait for the other ranks, which costs no thread and no CPU, counts apart
    (``max_concurrent_joins``).
    """

    def __init__(self, options: ServerOptions, on_refuse: Callable[[str], None] | None = None) -> None:
        self.max_calls, self.max_job_calls = options.max_calls, options.max_job_calls
        self.max_waiting = options.max_concurrent_joins
        self.calls = 0
        self.waiting = 0
        self.by_job: dict[str, int] = {}
        self.refused = 0
        self._recent: collections.deque[float] = collections.deque()
        #: Called with the bound's name at each refusal (the metrics count them).
        self.on_refuse = on_refuse

    def hint_ms(self) -> int:
        """The retry hint now: longer while many calls are refused (HINT_BASE_MS + 1 ms per refusal in the last second)."""
        now = time.monotonic()
        while self._recent and now - self._recent[0] > 1.0:
            self._recent.popleft()
        return min(HINT_MAX_MS, HINT_BASE_MS + len(self._recent))

    def _refuse(self, bound: str, message: str) -> Refused:
        self.refused += 1
        self._recent.append(time.monotonic())
        if self.on_refuse is not None:
            self.on_refuse(bound)
        return Refused(message, self.hint_ms())

    def enter(self, job: str | None) -> None:
        """Admits a call of `job` (None: of no job), or raises Refused naming the bound."""
        if self.calls >= self.max_calls:
            raise self._refuse("calls", f"{self.calls} calls are in progress, this coordinator's limit "
                                        f"(croupier serve --max-calls {self.max_calls})")
        if job is not None:
            n = self.by_job.get(job, 0)
            if n >= self.max_job_calls:
                raise self._refuse("job_calls", f"{n} calls of job {job!r} are in progress, the limit for one job "
                                                f"(croupier serve --max-job-calls {self.max_job_calls})")
            self.by_job[job] = n + 1
        self.calls += 1

    def leave(self, job: str | None) -> None:
        self.calls -= 1
        if job is not None:
            n = self.by_job[job] - 1
            if n:
                self.by_job[job] = n
            else:
                del self.by_job[job]

    def wait(self, rank: int) -> None:
        """Admits a join's wait for its generation's other ranks, or raises Refused (the join itself is recorded)."""
        if self.waiting >= self.max_waiting:
            raise self._refuse("waiting_joins", f"rank {rank} joined, but {self.waiting} joins are waiting, this "
                                                f"coordinator's limit (croupier serve --max-concurrent-joins "
                                                f"{self.max_waiting}); ask again")
        self.waiting += 1

    def waited(self) -> None:
        """A join's wait admitted by :meth:`wait` ended."""
        self.waiting -= 1
