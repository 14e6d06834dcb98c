"""The joins that wait for their generation's other ranks, on a served coordinator's event loop: one listener on
the coordinator and one answer per generation, however many ranks wait for it, and no thread held meanwhile."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from croupier.core import errors as E
from croupier.core.api import JoinResult
from croupier.server._coordinator import Coordinator

log = logging.getLogger("croupier.server")

T = TypeVar("T")

#: How often waiting joins look at a shared store's journal (other replicas' joins arrive there).
SHARED_POLL_S = 0.05


class _Start:
    """The joins waiting for one generation to start: one event, one listener on the coordinator, one answer."""

    __slots__ = ("event", "waiters", "fn", "registered", "answer")

    def __init__(self, event: asyncio.Event, fn: Callable[[], None]) -> None:
        self.event, self.fn = event, fn
        self.waiters = 0
        self.registered: asyncio.Future[bool] | None = None
        #: The answer once the event fired, asked of the core once for every waiting rank (it names no rank).
        self.answer: asyncio.Future[JoinResult] | None = None


class JoinWaits:
    """Joins waiting for their generation to start, by (job, generation).

    Only the event loop's thread uses it. The coordinator calls a generation's listener when it starts or
    is replaced (``Coordinator.on_start``); the core's calls it makes (registering, the answer, a shared
    store's reads) run on `executor`'s threads, with no deadline: they serve every waiting rank at once.
    """

    def __init__(self, core: Coordinator, executor: ThreadPoolExecutor) -> None:
        self.core, self.executor = core, executor
        self._starts: dict[tuple[str, int], _Start] = {}
        self._poller: asyncio.Task[None] | None = None
        self.closing = False

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def wait_start(self, job: str, number: int, timeout: float) -> JoinResult | None:
        """Until generation `number` of `job` starts or is replaced, the coordinator stops, or `timeout` passes;
        then the answer of every rank that waited for it (None: the wait timed out, the rank asks its own)."""
        key = (job, number)
        st = self._starts.get(key)
        if st is None:
            loop = asyncio.get_running_loop()
            event = asyncio.Event()

            def fire() -> None:
                loop.call_soon_threadsafe(event.set)

            st = self._starts[key] = _Start(event, fire)
            st.registered = asyncio.ensure_future(self._register(key, st))
            if self.core.store.shared and self._poller is None:
                self._poller = asyncio.ensure_future(self._poll())
        st.waiters += 1
        try:
            try:
                await asyncio.wait_for(st.event.wait(), timeout)
            except TimeoutError:
                return None
            # NOTE: a generation's start wakes all its waiting ranks at once; their answer is the
            # same (it names no rank), so the core is asked once for all of them, not once each.
            if st.answer is None:
                st.answer = asyncio.ensure_future(self._run(self.core.join_answer, job, 0))
            return await asyncio.shield(st.answer)
        finally:
            st.waiters -= 1
            if st.waiters == 0 and self._starts.get(key) is st:
                del self._starts[key]
                if not st.event.is_set():
                    asyncio.ensure_future(self._unregister(key, st))

    async def _register(self, key: tuple[str, int], st: _Start) -> bool:
        try:
            listening = await self._run(self.core.on_start, key[0], key[1], st.fn)
        except BaseException:
            st.event.set()  # the waiting joins answer what the coordinator says now
            raise
        if not listening:
            st.event.set()
        return listening

    async def _unregister(self, key: tuple[str, int], st: _Start) -> None:
        assert st.registered is not None
        if await st.registered:
            await self._run(self.core.off_start, key[0], key[1], st.fn)

    async def _poll(self) -> None:
        """A shared store: while joins wait, reads the journal every SHARED_POLL_S (one look for all of them)."""
        try:
            while self._starts and not self.closing:
                try:
                    await self._run(self.core.poll)
                except E.CroupierError as e:
                    log.debug("waiting joins: the journal could not be read: %s", e)
                # NOTE: the interval between two looks at the database, not synchronisation: a start
                # another replica journaled is seen within it.
                await asyncio.sleep(SHARED_POLL_S)
        finally:
            self._poller = None

    def release(self) -> None:
        """Shutting down: every waiting join answers now (not started: its rank asks again, elsewhere or later)."""
        self.closing = True
        for st in self._starts.values():
            st.event.set()
