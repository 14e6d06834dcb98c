"""A record of the calls a client makes about its job's generations, for the history checker.

Set ``CROUPIER_CALL_LOG`` to a directory and every client channel of the process records each Join,
Grant, Lease and checkpoint Report it makes, with the ``time.monotonic()`` of its invocation and of
its answer, one JSON line per call in ``DIR/calls-<host>-<pid>.jsonl``; ``croupier.harness.linearize``
reads those files and checks that the history is linearizable (``croupier chaos`` does, after its run).
Each line is one ``write`` to a file opened for appending: a kill -9 of the process loses none that
returned (a crash of the machine may).

What a call's answer says of its effect:

- a Join is on record from its invocation, without an answer (``unknown``: a process killed during
  the call may have had it take effect); a second line of the same call (``"call"``) says how it
  ended: answered, it names its generation (``ok``); no answer (UNAVAILABLE, a deadline, a cancelled
  call) or a RESOURCE_EXHAUSTED leaves it ``unknown``; any other refusal changed nothing
  (``refused``: the checker drops it);
- a Grant or Lease (``grant``) and a Report that carries a checkpoint (``checkpoint``) answered are
  ``ok``, and ABORTED (a newer generation) is ``fenced``; without an answer they constrain nothing
  and are not recorded, nor are progress reports without a checkpoint (advisory).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from typing import Any

import grpc

_SERVICE = "/croupier.v1.Coordinator/"
_KINDS = {"Join": "join", "Grant": "grant", "Lease": "grant", "Report": "checkpoint"}
#: A join refused with these may still have taken effect.
_JOIN_UNKNOWN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                           grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED})


class CallLog(grpc.UnaryUnaryClientInterceptor):
    """Records the calls made through a channel in directory `where` (see the module)."""

    _lock = threading.Lock()
    _ids = itertools.count(1)  # a join's lines share a number (next() is atomic under the GIL)
    #: (directory, pid) -> the file's descriptor and the process's name (a forked child opens its own)
    _fds: dict[tuple[str, int], tuple[int, str]] = {}

    def __init__(self, where: str) -> None:
        os.makedirs(where, exist_ok=True)
        self.where = where

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method
        kind = _KINDS.get(method[len(_SERVICE):]) if method.startswith(_SERVICE) else None
        if kind is None or kind == "checkpoint" and not request.HasField("checkpoint"):
            return continuation(details, request)
        invoked = time.monotonic()
        call = None
        if kind == "join":
            # A join may take effect and its process die before the answer: it is on record from the start,
            # as one without an answer, until a line of the same call says how it ended.
            call = next(self._ids)
            self._write(request.job, kind, 0, "unknown", invoked, None, call)
        outcome = continuation(details, request)
        returned = time.monotonic()
        error = outcome.exception()
        if error is None:
            generation = outcome.result().generation if kind == "join" else request.generation
            self._write(request.job, kind, generation, "ok", invoked, returned, call)
            return outcome
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        if kind == "join" and code not in _JOIN_UNKNOWN:
            self._write(request.job, kind, 0, "refused", invoked, returned, call)  # changed nothing
        elif kind != "join" and code == grpc.StatusCode.ABORTED:
            self._write(request.job, kind, request.generation, "fenced", invoked, returned)
        return outcome

    def _write(self, job: str, kind: str, generation: int, outcome: str, invoked: float, returned: float | None,
               call: int | None = None) -> None:
        pid = os.getpid()
        with self._lock:
            opened = self._fds.get((self.where, pid))
            if opened is None:
                process = f"{socket.gethostname()}-{pid}"
                path = os.path.join(self.where, f"calls-{process}.jsonl")
                opened = self._fds[(self.where, pid)] = (os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), process)
            fd, process = opened
            record = {"process": process, "job": job, "kind": kind, "generation": int(generation), "outcome": outcome,
                      "invoked": invoked, "returned": returned}
            os.write(fd, (json.dumps(record if call is None else {**record, "call": call}) + "\n").encode())
