"""The coordinator served on grpc.aio: each RPC's handler; a call whose caller left is not run.

Admission is ``croupier.server._admission``'s, a join's wait for its generation's other ranks
``croupier.server._join_wait``'s; every call's work runs on a worker thread with its budget
(``croupier.server._deadline.Budget``: its deadline, passed as a value down to the store), but for a grant
or a lease that can be answered at once (``AT_ONCE``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from croupier.core import errors as E
from croupier.core.api import MAX_JOIN_WAIT_S
from croupier.server._admission import RETRY_AFTER_KEY, Admission, Refused
from croupier.server._auth import Authorizer, Credential
from croupier.server._coordinator import Coordinator
from croupier.server._deadline import Budget, WouldWait
from croupier.server._join_wait import JoinWaits
from croupier.server._options import ServerOptions
from croupier.server._rpcs import REQUESTS, CoordinatorServicer, job_of, join_reply, parse
from croupier.v1 import coordinator_pb2 as pb

log = logging.getLogger("croupier.server")

T = TypeVar("T")

#: A join refused for a limit that does not pass with time is answered after this long, up to _HELD_REFUSALS at a time.
_HOLD_REFUSAL_S, _HELD_REFUSALS = 0.25, 16
#: The RPCs answered on the event loop when they need not wait (``Budget.at_once``); the rest run on a thread.
AT_ONCE = frozenset({"Grant", "Lease"})
#: The deadline of a call whose client set none, or a longer one (seconds): a join's wait (30 s at most) and its work.
CALL_DEADLINE_S = 120.0


def _budget_of(context: grpc.aio.ServicerContext[Any, Any], at_once: bool = False) -> Budget:
    """The call's budget: its deadline on time.monotonic().

    NOTE: every call has a deadline that reaches the store: the client's, or CALL_DEADLINE_S for a
    client that sets none (a store's round trips never outlive every caller).
    """
    left = context.time_remaining()
    return Budget(time.monotonic() + (CALL_DEADLINE_S if left is None else min(left, CALL_DEADLINE_S)), at_once)


def _in_thread(budget: Budget, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    """Runs a call's work on a worker thread; not at all once its deadline passed (its caller is gone)."""
    budget.check("it was started")
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
        self.waits = JoinWaits(core, self.executor)
        self._held = 0

    @property
    def closing(self) -> bool:
        """Shutting down: a join no longer waits for its generation's other ranks."""
        return self.waits.closing

    async def run(self, budget: Budget, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread; not run if the call's caller leaves before a thread takes it."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, _in_thread, budget, fn, args)

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
            return await self._join(m, who, _budget_of(context))
        job = job_of(m)
        self.admission.enter(job)
        # NOTE: a lease's answer is made and handed to gRPC without the leases computed ahead taking the GIL
        # from it: they are held back until then (the callback runs once this task has handed the answer
        # over and waits for its sending).
        release = self.core.hold_leases() if method == "Lease" else None
        try:
            if method in AT_ONCE:
                # NOTE: a grant of a plan the ranks compute asks the store nothing and waits for nothing
                # on a single writer's store, nor on a shared one whose watch confirmed the journal's end
                # within the staleness bound (its progress report is journaled later): it is answered
                # here, on the loop, without the hop to a thread and back that would cost it more than
                # the grant itself; so is a lease computed ahead. The rest (dynamic dealing, a journal to
                # read, a lease to compute) is handed to a thread, changed nothing.
                try:
                    answer: Message = getattr(self.servicer, method)(m, who, _budget_of(context, at_once=True))
                    return answer
                except WouldWait:
                    pass
            budget = _budget_of(context)
            out: Message = await self.run(budget, getattr(self.servicer, method), m, who, budget)
            return out
        finally:
            self.admission.leave(job)
            if release is not None:
                asyncio.get_running_loop().call_soon(release)

    async def _join(self, m: pb.JoinRequest, who: Credential | None, budget: Budget) -> pb.JoinResponse:
        try:
            return await self._join_once(m, who, budget)
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

    async def _join_once(self, m: pb.JoinRequest, who: Credential | None, budget: Budget) -> pb.JoinResponse:
        self.admission.enter(m.job)
        try:
            # NOTE: the join is decided and journaled first: a rank refused the wait below has joined
            # all the same, and the generation starts once the last rank has.
            req, result = await self.run(budget, self.servicer.Join, m, who, budget)
        finally:
            self.admission.leave(m.job)
        if result.start is not None or m.wait_ms == 0 or self.closing:
            return join_reply(result, req)
        self.admission.wait(m.rank)
        try:
            wait_s = min(m.wait_ms / 1000.0, MAX_JOIN_WAIT_S)
            left = budget.remaining()
            if left is not None:
                wait_s = min(wait_s, left)
            answer = await self.waits.wait_start(m.job, result.generation, wait_s)
        finally:
            self.admission.waited()
        if answer is None:
            answer = await self.run(budget, self.core.join_answer, m.job, m.rank, budget)
        return join_reply(answer, req)

    def release_waits(self) -> None:
        """Shutting down: every waiting join answers now (not started: its rank asks again, elsewhere or later)."""
        self.waits.release()

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
