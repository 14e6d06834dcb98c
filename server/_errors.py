"""Domain errors of the coordinator; the gRPC layer maps each class to one status code."""

from __future__ import annotations


class CroupierError(Exception):
    """Base of every error the coordinator reports to a caller."""


class InvalidArgument(CroupierError, ValueError):
    """A value is malformed or out of its domain (bad size, rank >= world, empty name, ...)."""


class NotFound(CroupierError, LookupError):
    """The named job (or generation) does not exist."""


class FailedPrecondition(CroupierError, ValueError):
    """The request is well-formed but contradicts the job: another spec, another job's state, ..."""


class Aborted(CroupierError, RuntimeError):
    """The caller belongs to a generation that a newer one has fenced off."""


class OutOfRange(CroupierError, ValueError):
    """An epoch or batch outside what the job's progress allows (e.g. before its resume point)."""


class ResourceExhausted(CroupierError, ValueError):
    """The request asks for more than the coordinator serves in one call."""


class Unavailable(CroupierError, RuntimeError):
    """The coordinator cannot make a change durable (its store is failing); retry later."""
