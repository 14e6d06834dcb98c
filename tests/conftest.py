"""Shared fixtures: a coordinator on a real port (in-process or as a `croupier serve` process), always stopped."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from croupier.client._rpc import CoordinatorClient
from croupier.server._service import Server
from croupier.tools import _serve

#: End-to-end tests that may run beside another one (make test runs them two at a time): the trainers'
#: integrations, each on its own embedded coordinator, ports and directories, none measuring a stall.
PAIRED = ("test_integration_lightning.py", "test_integration_accelerate.py", "test_integration_transformers.py",
          "test_integration_dcp.py", "test_integration_grain.py", "test_integration_mixture.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts `croupier serve` processes is an end-to-end test (not in `make check`); the
    integrations' end-to-end tests are `paired`."""
    for item in items:
        if "serve_process" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
        if item.path.name in PAIRED and item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.paired)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """An in-process coordinator on port 0 with a SQLite store in tmp_path."""
    s = Server(f"sqlite:///{tmp_path}/coordinator.db").start()
    try:
        yield s
    finally:
        s.stop(grace=0.5)


@pytest.fixture(scope="module")
def module_address() -> Iterator[str]:
    """One in-process coordinator (SQLite in a temporary directory) for a whole module's runs, each a job of its own."""
    with tempfile.TemporaryDirectory() as d:
        s = Server(f"sqlite:///{Path(d) / 'coordinator.db'}").start()
        try:
            yield s.address
        finally:
            s.stop(grace=0.5)


@pytest.fixture
def client(server: Server) -> Iterator[CoordinatorClient]:
    c = CoordinatorClient(server.address, retry_for=5.0)
    try:
        yield c
    finally:
        c.close()


class ServeProcess(_serve.ServeProcess):
    """`croupier serve` in a child process, started at once as the tools start one; its log is kept in a
    temporary file."""

    def __init__(self, store: str, port: int = 0, extra_env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        log = tempfile.NamedTemporaryFile("w+", prefix="croupier-serve-", suffix=".log")
        super().__init__(store, log, port=port, args=args, env=extra_env)
        self.start()


@pytest.fixture
def serve_process() -> Iterator[type[ServeProcess]]:
    """A factory of `croupier serve` processes; every one it made is killed at teardown."""
    made: list[ServeProcess] = []

    class Tracked(ServeProcess):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, **kw)  # type: ignore[arg-type]
            made.append(self)

    try:
        yield Tracked
    finally:
        for p in made:
            p.kill()
