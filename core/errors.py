"""Domain errors, each with the one gRPC status name it travels as (read in both directions)."""

from __future__ import annotations


class CroupierError(Exception):
    """Base of every error the coordinator reports to a caller.

    Attributes:
        code: The gRPC status name the error travels as; the client turns that name back into
            the same class (see :data:`BY_CODE`).
    """

    code = "UNKNOWN"


class InvalidArgument(CroupierError, ValueError):
    """A value is malformed or out of its domain (bad size, rank >= world, empty name, ...)."""

    code = "INVALID_ARGUMENT"


class NotFound(CroupierError, LookupError):
    """The named job (or generation) does not exist."""

    code = "NOT_FOUND"


class FailedPrecondition(CroupierError, ValueError):
    """The request is well-formed but contradicts the job: another spec, another job's state, ..."""

    code = "FAILED_PRECONDITION"


class Aborted(CroupierError, RuntimeError):
    """The caller belongs to a generation that a newer one has fenced off."""

    code = "ABORTED"


class OutOfRange(CroupierError, ValueError):
    """An epoch or batch outside what the job's progress allows (e.g. before its resume point)."""

    code = "OUT_OF_RANGE"


class ResourceExhausted(CroupierError, ValueError):
    """The request asks for more than the coordinator serves in one call."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(CroupierError, RuntimeError):
    """The coordinator cannot make a change durable (its store is failing); retry later."""

    code = "UNAVAILABLE"


class Unauthenticated(CroupierError, PermissionError):
    """The call carries no credential, or one the coordinator does not know."""

    code = "UNAUTHENTICATED"


class PermissionDenied(CroupierError, PermissionError):
    """The caller's credential does not allow this call for this job."""

    code = "PERMISSION_DENIED"


#: Status name -> domain error: the one table, read by the server (class -> code) and the client (code -> class).
BY_CODE: dict[str, type[CroupierError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, Aborted, OutOfRange, ResourceExhausted, Unavailable,
                Unauthenticated, PermissionDenied)
}
