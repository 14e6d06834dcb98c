"""The coordinator served on grpc.aio: a waiting join is a coroutine, admission is ours, a call whose caller left is not run."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from croupier.core import errors as E
from croupier.core.api import MAX_JOIN_WAIT_S, JoinResult
from croupier.server import _deadline
from croupier.server._auth import Authorizer, Credential
from croupier.server._coordinator import Coordinator
from croupier.server._deadline import WouldWait
from croupier.server._options import ServerOptions
from croupier.server._rpcs import REQUESTS, CoordinatorServicer, job_of, join_reply, parse
from croupier.v1 import coordinator_pb2 as pb

log = logging.getLogger("croupier.server")

T = TypeVar("T")

#: The trailing metadata key of a refusal's retry hint: milliseconds the client waits (jittered) before it asks again.
RETRY_AFTER_KEY = "croupier-retry-after-ms"
#: A refusal's retry hint: this much, plus a millisecond for each call refused in the last second, at most HINT_MAX_MS.
HINT_BASE_MS, HINT_MAX_MS = 50, 2000
#: A join refused for a limit that does not pass with time is answered after this long, up to _HELD_REFUSALS at a time.
_HOLD_REFUSAL_S, _HELD_REFUSALS = 0.25, 16
#: The deadline of a call whose client set none, or a longer one (seconds): a join's wait (30 s at most) and its work.
CALL_DEADLINE_S = 120.0
#: How often waiting joins look at a shared store's journal (other replicas' joins arrive there).
SHARED_POLL_S = 0.05


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


class _Start:
    """The joins waiting for one generation to start: one event, one listener on the coordinator, one answer."""

    __slots__ = ("event", "waiters", "fn", "registered", "answer")

    def __init__(self, event: asyncio.Event, fn: Callable[[], None]) -> None:
        self.event, self.fn = event, fn
        self.waiters = 0
        self.registered: asyncio.Future[bool] | None = None
        #: The answer once the event fired, asked of the core once for every waiting rank (it names no rank).
        self.answer: asyncio.Future[JoinResult] | None = None


def _deadline_of(context: grpc.aio.ServicerContext[Any, Any]) -> float:
    """The call's deadline on time.monotonic().

    NOTE: every call has a deadline that reaches the store: the client's, or CALL_DEADLINE_S for a
    client that sets none (a store's round trips never outlive every caller).
    """
    left = context.time_remaining()
    return time.monotonic() + (CALL_DEADLINE_S if left is None else min(left, CALL_DEADLINE_S))


def _in_thread(deadline: float | None, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    """Runs a call's work on a worker thread, with its deadline in reach of the store; not at all once it passed."""
    with _deadline.until(deadline):
        _deadline.check("it was started")
        return fn(*args)


class Serving:
    """The service's calls on one event loop; the core's work on a pool of threads.

    NOTE: the core (``Coordinator``) is synchronous and short under its lock, but a durable change
    waits for its journal append, and a shared store's calls make round trips: that work runs on
    ``workers`` threads, never on the event loop. What waits long -- a join for its generation's
    other ranks -- waits on the loop as a coroutine that holds no thread (``Coordinator.on_start``).
    """

    def __init__(self, core: Coordinator, options: ServerOptions, auth: Authorizer | None, workers: int,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self.core, self.options, self.auth = core, options, auth
        self.servicer = CoordinatorServicer(core, options)
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="croupier-rpc")
        self.admission = Admission(options, on_refuse)
        self._starts: dict[tuple[str, int], _Start] = {}
        self._held = 0
        self._poller: asyncio.Task[None] | None = None
        self.closing = False

    async def run(self, deadline: float | None, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread; not run if the call's caller leaves before a thread takes it."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, _in_thread, deadline, fn, args)

    async def serve(self, method: str, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        """One call: its size, credential and request checked, admitted, served; croupier's errors raised as they are."""
        limit = self.options.max_request_bytes
        if len(raw) > limit:
            raise E.ResourceExhausted(
                f"a request of {len(raw)} bytes is over this coordinator's limit of {limit} bytes "
                f"(croupier serve --max-request-bytes {limit}; a join carries 8 bytes a sample when its spec has lengths)")
        who = None if self.auth is None else self.auth.identify(context)  # type: ignore[arg-type]
        m = parse(REQUESTS[method], raw)
        if method == "Join":
            assert isinstance(m, pb.JoinRequest)
            return await self._join(m, who, _deadline_of(context))
        job = job_of(m)
        self.admission.enter(job)
        try:
            if method == "Grant":
                # NOTE: a grant of a plan the ranks compute asks the store nothing and waits for nothing
                # on a single writer's store, nor on a shared one whose watch confirmed the journal's end
                # within the staleness bound (its progress report is journaled later): it is answered
                # here, on the loop, without the hop to a thread and back that would cost it more than
                # the grant itself. The rest (dynamic dealing, a journal to read) is handed to a thread,
                # changed nothing.
                assert isinstance(m, pb.GrantRequest)
                try:
                    return self.servicer.Grant(m, who, at_once=True)
                except WouldWait:
                    pass
            out: Message = await self.run(_deadline_of(context), getattr(self.servicer, method), m, who)
            return out
        finally:
            self.admission.leave(job)

    async def _join(self, m: pb.JoinRequest, who: Credential | None, deadline: float | None) -> pb.JoinResponse:
        try:
            return await self._join_once(m, who, deadline)
        except Refused:
            raise
        except E.ResourceExhausted:
            # NOTE: a caller past a limit that does not pass with time (--max-jobs, --max-world) usually
            # asks again at once; holding its answer back a little (a few at a time) keeps a flood of
            # them from taking the CPU from the jobs that train.
            if self._held < _HELD_REFUSALS and not self.closing:
                self._held += 1
                try:
                    await asyncio.sleep(_HOLD_REFUSAL_S)
                finally:
                    self._held -= 1
            raise

    async def _join_once(self, m: pb.JoinRequest, who: Credential | None, deadline: float | None) -> pb.JoinResponse:
        self.admission.enter(m.job)
        try:
            # NOTE: the join is decided and journaled first: a rank refused the wait below has joined
            # all the same, and the generation starts once the last rank has.
            req, result = await self.run(deadline, self.servicer.Join, m, who)
        finally:
            self.admission.leave(m.job)
        if result.start is not None or m.wait_ms == 0 or self.closing:
            return join_reply(result, req)
        self.admission.wait(m.rank)
        try:
            wait_s = min(m.wait_ms / 1000.0, MAX_JOIN_WAIT_S)
            if deadline is not None:
                wait_s = min(wait_s, max(0.0, deadline - time.monotonic()))
            answer = await self._wait_start(m.job, result.generation, wait_s)
        finally:
            self.admission.waiting -= 1
        if answer is None:
            answer = await self.run(deadline, self.core.join_answer, m.job, m.rank)
        return join_reply(answer, req)

    async def _wait_start(self, job: str, number: int, timeout: float) -> JoinResult | None:
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
                st.answer = asyncio.ensure_future(self.run(None, self.core.join_answer, job, 0))
            return await asyncio.shield(st.answer)
        finally:
            st.waiters -= 1
            if st.waiters == 0 and self._starts.get(key) is st:
                del self._starts[key]
                if not st.event.is_set():
                    asyncio.ensure_future(self._unregister(key, st))

    async def _register(self, key: tuple[str, int], st: _Start) -> bool:
        try:
            listening = await self.run(None, self.core.on_start, key[0], key[1], st.fn)
        except BaseException:
            st.event.set()  # the waiting joins answer what the coordinator says now
            raise
        if not listening:
            st.event.set()
        return listening

    async def _unregister(self, key: tuple[str, int], st: _Start) -> None:
        assert st.registered is not None
        if await st.registered:
            await self.run(None, self.core.off_start, key[0], key[1], st.fn)

    async def _poll(self) -> None:
        """A shared store: while joins wait, reads the journal every SHARED_POLL_S (one look for all of them)."""
        try:
            while self._starts and not self.closing:
                try:
                    await self.run(None, self.core.poll)
                except E.CroupierError as e:
                    log.debug("waiting joins: the journal could not be read: %s", e)
                # NOTE: the interval between two looks at the database, not synchronisation: a start
                # another replica journaled is seen within it.
                await asyncio.sleep(SHARED_POLL_S)
        finally:
            self._poller = None

    def release_waits(self) -> None:
        """Shutting down: every waiting join answers now (not started: its rank asks again, elsewhere or later)."""
        self.closing = True
        for st in self._starts.values():
            st.event.set()

    def handler(self, method: str, observe: Callable[[str, grpc.StatusCode, float], None] | None,
                unread: Callable[[str], None] | None) -> grpc.RpcMethodHandler[Any, Any]:
        """The gRPC handler of one RPC: croupier's errors turned into their status, a refusal's retry hint in
        the trailing metadata, each call timed and counted by `observe` and, with `unread`, a call whose
        request never arrived counted by it.

        NOTE: a request over gRPC's receive limit is refused by gRPC itself (RESOURCE_EXHAUSTED) before a
        unary handler runs, so a unary handler never learns of it. With `unread` (a server with
        metrics), the call is therefore served as a stream of one request: the handler reads the
        request itself, and a call whose request never arrives is counted (gRPC's refusal ends the call:
        the read fails or finds the stream closed). Nothing changes on the wire; a stream's handler
        costs a grpc.aio server more per call, so a server without metrics serves unary handlers.
        """
        respond = lambda m: m.SerializeToString()  # noqa: E731

        async def served(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
            t0 = time.perf_counter()
            code: grpc.StatusCode | None = grpc.StatusCode.UNKNOWN
            try:
                out = await self.serve(method, raw, context)
                code = grpc.StatusCode.OK
                return out
            except E.CroupierError as err:
                # NOTE: counted before the abort, which sends the status at once: a client that reads
                # the metrics right after its answer finds its call counted.
                failed = grpc.StatusCode[err.code]
                if observe is not None:
                    observe(method, failed, time.perf_counter() - t0)
                code = None
                hint = ((RETRY_AFTER_KEY, str(err.retry_after_ms)),) if isinstance(err, Refused) else ()
                await context.abort(failed, str(err), trailing_metadata=hint)
                raise  # unreachable: abort raises
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            finally:
                if observe is not None and code is not None:
                    observe(method, code, time.perf_counter() - t0)

        if unread is None:
            return grpc.unary_unary_rpc_method_handler(served, request_deserializer=None, response_serializer=respond)
        counted = unread

        async def read_then_served(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> Message:
            try:
                raw = await requests.__anext__()
            except StopAsyncIteration:
                counted(method)
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method!r} requires exactly one request message")
                raise  # unreachable: abort raises
            except (grpc.RpcError, asyncio.CancelledError):
                counted(method)
                raise
            return await served(raw, context)

        return grpc.stream_unary_rpc_method_handler(read_then_served, request_deserializer=None,
                                                    response_serializer=respond)
