"""A coordinator whose SQLite store fills its file system: UNAVAILABLE naming the store and the cause, nothing
acknowledged lost, and serving again once there is room, without a restart.

The store sits on a tmpfs of 3 MiB of its own (mounted here: the test needs root, as CI has), filled to
the last byte by a file beside it; a real `croupier serve` process answers over a real port.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest

from croupier.core.spec import Spec
from croupier.core.wire import spec_to_proto
from croupier.harness._faults import fill_up
from croupier.server._store import StoreFull
from croupier.server._stores import open_store
from croupier.v1 import coordinator_pb2 as pb
from croupier.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs of its own: needs root (CI runs as root)")]

SPEC = spec_to_proto(Spec(n=1000, batch_size=10))


@pytest.fixture
def small_fs(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    where = tmp_path / "fs"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(where: pathlib.Path) -> pathlib.Path:
    """A file that takes every free byte of `where`'s file system."""
    filler = where / "filler"
    fill_up(filler)
    return filler


def _join(stub: pb_grpc.CoordinatorStub, job: str) -> pb.JoinResponse:
    return stub.Join(pb.JoinRequest(request_id=f"{job}-r0", job=job, spec=SPEC, incarnation="t", world=1, rank=0), timeout=10)


def test_a_full_disk_is_unavailable_then_goes_on_by_itself(small_fs: pathlib.Path, serve_process: type) -> None:
    url = f"sqlite:///{small_fs}/c.db"
    server = serve_process(url)
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        acked = [f"before-{i}" for i in range(20)]
        for job in acked:
            assert _join(stub, job).started
        filler = _fill(small_fs)
        # Joins until the store finds no room (a WAL reuses the room it had: a few may still fit).
        refused: grpc.RpcError | None = None
        for i in range(5000):
            try:
                _join(stub, f"during-{i}")
            except grpc.RpcError as e:
                refused = e
                break
            acked.append(f"during-{i}")
        assert refused is not None, "the store never ran out of room"
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        details = refused.details() or ""
        assert str(small_fs / "c.db") in details and "SQLITE_FULL" in details and "no room" in details, details
        # Until there is room, calls that write are refused, and the process goes on.
        with pytest.raises(grpc.RpcError) as again:
            _join(stub, "while-full")
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE and server.exited() is None
        filler.unlink()
        t0 = time.monotonic()
        while True:  # bounded: the coordinator looks at the free space with a backoff of at most 1 s
            try:
                assert _join(stub, "after").started
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 15, e
        acked.append("after")
        listed = set(stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs)
        assert set(acked) <= listed and "while-full" not in listed
    assert server.exited() is None  # never restarted
    server.kill()
    store = open_store(url)  # verifies the file: every checksum, the records contiguous
    try:
        from croupier.server._journal import recover

        state, _ = recover(store)
        assert set(acked) <= set(state.jobs) and "while-full" not in state.jobs
    finally:
        store.close()


def test_a_full_disk_does_not_poison_the_sqlite_store(small_fs: pathlib.Path) -> None:
    """The store itself: SQLITE_FULL is StoreFull (nothing stored), and the same object writes again with room.

    Fails if the store poisons itself on a full disk as it does on a failed fsync.
    """
    store = open_store(f"sqlite:///{small_fs}/s.db")
    try:
        last = store.append([b"x" * 100])
        filler = _fill(small_fs)
        with pytest.raises(StoreFull, match="no room"):
            for _ in range(5000):
                last = store.append([os.urandom(4000)])
        assert not store.has_room()
        filler.unlink()
        assert store.has_room()
        assert store.append([b"y"]) == last + 1
        assert store.load().last_seq == last + 1
    finally:
        store.close()
