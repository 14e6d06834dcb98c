"""Shared fixtures: a coordinator on a real port (in-process or as a `croupier serve` process), always stopped."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from croupier.client._rpc import CoordinatorClient
from croupier.server._service import Server
from croupier.tools import serve

#: End-to-end tests that run alone (make test runs the others two at a time): those that assert a
#: stall, a latency or a duration (partitions, pauses, clock jumps, an outage, a full disk, the
#: admission limits), which a neighbour's load on the shared cores would move, and Ray's, whose
#: restart resumes from the checkpoints Ray's controller took in before the worker's kill (it polls
#: the workers: beside another run it resumed from none, 1 run in 4). The rest each start
#: their own coordinators, PostgreSQL servers, network namespaces (named after the process) on free
#: ports and in directories of their own, and assert counts and orders only.
SERIAL = ("test_partitions.py", "test_pauses.py", "test_clock_jumps.py", "test_outage.py", "test_full_disk.py",
          "test_limits.py", "test_integration_ray.py")


#: The files of the longest tests (a minute or more of the run each), which start first: pytest-xdist hands out
#: tests in collection order, so the short ones fill in around them instead of one long test ending the run
#: alone on one worker.
LONG_FIRST = ("test_state_machine.py", "test_state_machine_ft.py", "test_chaos_dc_replicas.py", "test_multinode.py",
              "test_chaos.py", "test_torchft.py", "test_integration_lightning.py", "test_shard_reads.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts `croupier serve` processes is an end-to-end test (not in `make check`); an
    end-to-end test not in a :data:`SERIAL` file is `paired`; the files of :data:`LONG_FIRST` come first."""
    for item in items:
        if "serve_process" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
        if item.path.name not in SERIAL and item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.paired)
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)  # stable: the order within each part is kept


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


class ServeProcess(serve.ServeProcess):
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
