"""The coordinator's log lines: the JSON and text formatters, and `croupier serve --log-format json` end to end."""

from __future__ import annotations

import datetime
import io
import json
import logging
import pathlib
import threading
from collections.abc import Iterator

import pytest
from _joins import join_started

from croupier.client import CoordinatorClient
from croupier.core.api import JoinRequest
from croupier.core.spec import Spec
from croupier.server import JsonFormatter, TextFormatter, configure_logging
from croupier.tools.serve import ServeProcess


@pytest.fixture
def logger() -> Iterator[tuple[logging.Logger, logging.StreamHandler[io.StringIO]]]:
    """A logger of its own (not propagating) writing to a StringIO handler without a formatter yet."""
    log = logging.getLogger("croupier.test_logs")
    handler = logging.StreamHandler(io.StringIO())
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        yield log, handler
    finally:
        log.removeHandler(handler)


def _lines(handler: logging.StreamHandler[io.StringIO]) -> list[str]:
    return handler.stream.getvalue().splitlines()


def test_json_lines_carry_the_fields_and_what_extra_passes(logger: tuple[logging.Logger, logging.StreamHandler[io.StringIO]]) -> None:
    log, handler = logger
    handler.setFormatter(JsonFormatter())
    before = datetime.datetime.now(datetime.timezone.utc)
    log.info("generation %d of job %r opened", 3, "j", extra={"job": "j", "generation": 3, "rank": 0})
    log.warning("no job here", extra={"other": "not copied"})
    log.info("half", extra={"job": "k", "rank": None})
    first, second, third = (json.loads(line) for line in _lines(handler))
    assert first == {"ts": first["ts"], "level": "INFO", "logger": "croupier.test_logs",
                     "msg": "generation 3 of job 'j' opened", "job": "j", "generation": 3, "rank": 0}
    assert first["ts"].endswith("Z")
    ts = datetime.datetime.fromisoformat(first["ts"].replace("Z", "+00:00"))
    assert ts.utcoffset() == datetime.timedelta(0)
    assert before - datetime.timedelta(seconds=1) <= ts <= datetime.datetime.now(datetime.timezone.utc)
    assert set(second) == {"ts", "level", "logger", "msg"} and second["level"] == "WARNING"
    assert third["job"] == "k" and "rank" not in third and "generation" not in third


def test_json_lines_hold_exceptions_and_values_that_are_not_json(
        logger: tuple[logging.Logger, logging.StreamHandler[io.StringIO]]) -> None:
    log, handler = logger
    handler.setFormatter(JsonFormatter())
    try:
        1 / 0  # noqa: B018 - the exception is the point
    except ZeroDivisionError:
        log.exception("store failed", extra={"job": object()})
    log.info("multi\nline")
    lines = _lines(handler)
    assert len(lines) == 2  # one object per line, whatever the message holds
    d = json.loads(lines[0])
    assert d["level"] == "ERROR" and d["msg"] == "store failed"
    assert "Traceback" in d["exc"] and "ZeroDivisionError: division by zero" in d["exc"]
    assert d["job"].startswith("<object object")
    assert json.loads(lines[1])["msg"] == "multi\nline"


def test_text_lines_keep_the_format_and_append_the_fields(
        logger: tuple[logging.Logger, logging.StreamHandler[io.StringIO]]) -> None:
    log, handler = logger
    handler.setFormatter(TextFormatter())
    log.info("opened", extra={"job": "j", "generation": 2, "rank": 1})
    log.info("plain")
    log.info("some", extra={"generation": 4})
    opened, plain, some = _lines(handler)
    assert opened.endswith(" INFO croupier.test_logs: opened job=j generation=2 rank=1")
    assert plain.endswith(" INFO croupier.test_logs: plain")
    assert some.endswith(": some generation=4")
    datetime.datetime.strptime(plain.split(" INFO ")[0], "%Y-%m-%d %H:%M:%S,%f")  # asctime, as before


def test_configure_logging_installs_the_format_on_the_root_logger() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        out = io.StringIO()
        configure_logging("json", logging.INFO, out)
        logging.getLogger("croupier.server").info("x", extra={"job": "j"})
        logging.getLogger("croupier.server").debug("below the level")
        assert [json.loads(line)["job"] for line in out.getvalue().splitlines()] == ["j"]
        with pytest.raises(ValueError, match=r"log format must be one of \[.*\] \(got log format='xml'\)"):
            configure_logging("xml")
    finally:
        root.handlers[:], root.level = saved  # type: ignore[misc]


def test_serve_with_json_logs_says_which_job_generation_and_rank(tmp_path: pathlib.Path) -> None:
    with open(tmp_path / "serve.log", "w+") as log:
        p = ServeProcess("memory://", log, args=("--log-format", "json"), verbose=True)
        try:
            p.start()
            spec = Spec(n=100)
            with CoordinatorClient(p.address, retry_for=10.0) as c:
                # rank 1 opens generation 1 (it does not wait), rank 0 completes it
                assert c.join(JoinRequest("lj", spec, "t", 2, 1), wait_s=0).start is None
                assert c.join(JoinRequest("lj", spec, "t", 2, 0), wait_s=0).start is not None
            code = p.terminate(30)
        finally:
            p.kill()
    err = (tmp_path / "serve.log").read_text()
    assert code == 0, err
    records = [json.loads(line) for line in err.splitlines()]  # every line is one JSON object
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    about = [(r["msg"].split(" of job")[0], r.get("job"), r.get("generation"), r.get("rank"))
             for r in records if "generation" in r]
    assert about == [("generation 1", "lj", 1, 1), ("generation 1", "lj", 1, 0)], records
    opened, started = (r for r in records if "generation" in r)
    assert "opened" in opened["msg"] and "started" in started["msg"]
    assert [r["level"] for r in (opened, started)] == ["INFO", "INFO"]
    assert any(r["msg"].startswith("job 'lj' registered") and r["job"] == "lj" and r["rank"] == 1 for r in records)


def test_a_join_is_logged_once_durable_and_the_wait_still_ends(caplog: pytest.LogCaptureFixture) -> None:
    """In-process: the lines come from Coordinator.join, and a waiting join still sees its generation start."""
    from croupier.server import Coordinator, open_store

    core = Coordinator(open_store("memory://"))
    try:
        spec = Spec(n=10)
        with caplog.at_level(logging.INFO, logger="croupier.server"):
            assert core.join(JoinRequest("w", spec, "t", 2, 0)).start is None
            out: list[object] = []  # rank 0 again (a retried call): waits for the generation to start
            t = threading.Thread(target=lambda: out.append(join_started(core, JoinRequest("w", spec, "t", 2, 0), 10)))
            t.start()
            assert join_started(core, JoinRequest("w", spec, "t", 2, 1), 10).start is not None
            t.join(timeout=20)
        assert out and out[0].start is not None  # type: ignore[attr-defined]
        got = [(r.getMessage().split(":")[0], getattr(r, "generation", None), getattr(r, "rank", None))
               for r in caplog.records if getattr(r, "job", None) == "w"]
        assert got == [("job 'w' registered", None, 0), ("generation 1 of job 'w' opened", 1, 0),
                       ("generation 1 of job 'w' started", 1, 1)]
    finally:
        core.close()
