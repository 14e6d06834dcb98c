"""The coordinator's log lines for an operator: text, or one JSON object per line, both carrying job, generation and rank."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import IO, Any

from croupier.core.checks import check_choice

#: Record attributes a log call about one job sets through ``extra=``, in the order they are shown.
FIELDS = ("job", "generation", "rank")
#: Today's text format; :class:`TextFormatter` appends the fields a record carries.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The job, generation and rank a record carries (set through ``extra=``), skipping those it lacks or left None."""
    return {k: v for k in FIELDS if (v := getattr(record, k, None)) is not None}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``msg``, then
    ``job``, ``generation`` and ``rank`` when the record carries them, and ``exc`` (the formatted
    traceback) when it has exception info.

    NOTE: no other ``extra=`` attributes are copied, so that every line has one known shape and a
    value that is not JSON (an object passed by mistake) cannot break the stream: such values are
    written as their ``str()``.
    """

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT`, with `` job=… generation=… rank=…`` appended for the fields a record carries."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = _fields(record)
        return line + "".join(f" {k}={v}" for k, v in fields.items()) if fields else line


def configure_logging(fmt: str = "text", level: int = logging.WARNING, stream: IO[str] | None = None) -> logging.Handler:
    """Sends the root logger's records at `level` and above to `stream` (stderr) as `fmt` lines.

    Replaces the root logger's handlers (``logging.basicConfig(force=True)``), as a program's
    entry point does once.

    Args:
        fmt: ``"text"`` or ``"json"``.
        level: The lowest level written.
        stream: Where lines go; None for sys.stderr.

    Returns:
        The handler installed.

    Raises:
        ValueError: An unknown `fmt`.
    """
    check_choice("log format", fmt, FORMATS)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    return handler
