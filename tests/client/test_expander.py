"""The lease helper process: the same leases as ``FixedPlan.lease``, bit for bit, and a fallback when it is gone."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest

from croupier.client import _expander
from croupier.core.order import Cursor, FixedPlan, fresh
from croupier.core.registry import plan_epoch
from croupier.core.spec import Spec

COUNT = 3  # batches a lease: small, so the epochs below take several leases and end mid-lease


@pytest.fixture(autouse=True)
def _fresh_helper() -> Iterator[None]:
    """Every test starts without a helper process and leaves none behind."""
    _expander._reset_for_tests()
    yield
    _expander._reset_for_tests()


@pytest.fixture(autouse=True)
def _every_lease_to_the_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leases below are tiny; every one goes to the helper (the test of small leases sets the bound back)."""
    monkeypatch.setattr(_expander, "LOCAL_BELOW", 0)


def _resumed(spec: Spec, world: int, batches: int, new_world: int) -> FixedPlan:
    """The plan of a generation of `new_world` ranks resuming after `batches` batches of `world` ranks."""
    first = plan_epoch(spec, fresh(spec, 0), world, 0)
    assert first is not None
    p = plan_epoch(spec, first.advance(batches), new_world, 0)
    assert p is not None
    return p


def _plans() -> list[FixedPlan]:
    plans = []
    for spec, world in [
        (Spec(n=1000, seed=3), 4),
        (Spec(n=1003, seed=3, permutation="none", batch_size=7), 4),
        (Spec(n=1003, seed=5, permutation="window", buffer_size=64, batch_size=8), 3),
        (Spec(n=1003, seed=5, partition="chunked", tail="drop", batch_size=8), 3),
        (Spec(n=1003, seed=5, partition="contiguous", tail="uneven", batch_size=8, drop_last_batch=True), 5),
        (Spec(n=1003, seed=5, partition="strided", tail="pad_last", batch_size=16, even_batches=True), 6),
        (Spec(n=997, seed=9, permutation="window", buffer_size=100, scope="rank", partition="contiguous", batch_size=5), 3),
    ]:
        p = plan_epoch(spec, fresh(spec, 1), world, 2)  # a later epoch than the start
        assert p is not None
        plans.append(p)
    plans.append(_resumed(Spec(n=1003, seed=1, batch_size=8), 3, 11, 5))
    plans.append(_resumed(Spec(n=1003, seed=1, partition="chunked", tail="drop", batch_size=4), 4, 7, 3))
    return plans


def _leases(p: FixedPlan) -> Iterator[tuple[int, int]]:
    """(rank, first batch) of every lease of every rank, one past the end included."""
    for rank in range(p.world):
        yield from ((rank, first) for first in range(0, int(p.nb_r[rank]) + 1, COUNT))


def _wanted(plans: list[FixedPlan]) -> dict[tuple[int, int, int], tuple[list[int], list[int]]]:
    return {(i, rank, first): (idx.tolist(), sizes)
            for i, p in enumerate(plans) for rank, first in _leases(p)
            for idx, sizes in [p.lease(rank, first, COUNT)]}


def _local_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes computing a lease in this process fail, so a right answer can only come from the helper."""
    def refuse(self: FixedPlan, *a: Any) -> Any:
        raise AssertionError("computed in the training process, not by the helper")

    monkeypatch.setattr(FixedPlan, "lease", refuse)


def _same(got: tuple[np.ndarray, list[int]], want: tuple[list[int], list[int]]) -> None:
    idx, sizes = got
    assert idx.dtype == np.int64 and idx.ndim == 1
    assert (idx.tolist(), sizes) == want


def test_the_helper_computes_the_same_leases_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = _plans()
    want = _wanted(plans)
    assert _expander.ready(60.0)
    _local_forbidden(monkeypatch)
    for (i, rank, first), w in want.items():
        if w[1]:  # (a lease past a rank's end is empty, answered by FixedPlan.lease here)
            _same(_expander.lease(plans[i], rank, first, COUNT), w)
    # More plans than the helper keeps: the evicted ones are sent again.
    for (i, rank, first), w in want.items():
        if first == 0:
            _same(_expander.lease(plans[i], rank, first, COUNT), w)


def test_leases_are_computed_here_while_the_helper_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    go = threading.Event()
    real_start = _expander._Helper._start

    def slow_start(self: Any) -> None:
        go.wait()
        real_start(self)

    monkeypatch.setattr(_expander._Helper, "_start", slow_start)
    p = _plans()[0]
    for first in (0, COUNT):  # the first lease starts the helper; neither waits for it
        want = p.lease(0, first, COUNT)
        _same(_expander.lease(p, 0, first, COUNT), (want[0].tolist(), want[1]))
    assert not _expander.ready(0.0)
    go.set()
    assert _expander.ready(60.0) and _expander._process() is not None


def test_concurrent_callers_get_their_own_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = _plans()
    want = _wanted(plans)
    assert _expander.ready(60.0)
    _local_forbidden(monkeypatch)
    keys = [k for k, w in want.items() if w[1]]
    errors: list[BaseException] = []

    def caller(t: int) -> None:
        try:
            for _ in range(3):
                for i, rank, first in keys[t::4]:
                    _same(_expander.lease(plans[i], rank, first, COUNT), want[i, rank, first])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]


def test_a_killed_helper_falls_back_to_this_process_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    plans = _plans()
    want = _wanted(plans)
    assert _expander.ready(60.0)
    proc = _expander._process()
    assert proc is not None
    _same(_expander.lease(plans[0], 0, 0, COUNT), want[0, 0, 0])
    proc.kill()
    proc.wait()
    with caplog.at_level(logging.WARNING, logger="croupier"):
        for (i, rank, first), w in want.items():
            _same(_expander.lease(plans[i], rank, first, COUNT), w)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "lease helper" in warnings[0].getMessage(), warnings
    assert not _expander.ready(0.0)


def test_the_helper_ignores_sigint() -> None:
    p = _plans()[0]
    assert _expander.ready(60.0)
    proc = _expander._process()
    assert proc is not None
    proc.send_signal(signal.SIGINT)
    want = p.lease(1, 3, COUNT)
    _same(_expander.lease(p, 1, 3, COUNT), (want[0].tolist(), want[1]))  # answered after the signal
    assert proc.poll() is None and _expander.ready(0.0)


def test_croupier_expander_0_starts_no_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CROUPIER_EXPANDER", "0")
    p = _plans()[0]
    want = p.lease(2, 0, COUNT)
    _same(_expander.lease(p, 2, 0, COUNT), (want[0].tolist(), want[1]))
    assert not _expander.ready(5.0)
    assert _expander._process() is None


@pytest.mark.parametrize("spec", [
    Spec.with_lengths(np.arange(100) % 7, permutation="bucket", buffer_size=50, pack_size=4, batch_size=4),
    Spec(n=100, permutation="torch", batch_size=4),
])
def test_plans_that_are_not_sent_start_no_helper(spec: Spec) -> None:
    p = plan_epoch(spec, fresh(spec, 0), 2, 0)
    assert p is not None
    want = p.lease(1, 2, COUNT)
    _same(_expander.lease(p, 1, 2, COUNT), (want[0].tolist(), want[1]))
    assert _expander._process() is None


def test_the_helper_exits_when_its_stdin_closes() -> None:
    assert _expander.ready(60.0)
    proc = _expander._process()
    assert proc is not None and proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


def test_the_helper_does_not_outlive_a_killed_parent() -> None:
    with subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from croupier.client import _expander
        assert _expander.ready(60.0)
        print(_expander._process().pid, flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as parent:
        assert parent.stdout is not None
        helper = int(parent.stdout.readline())
        assert psutil.Process(helper).ppid() == parent.pid
        parent.kill()
        # The helper holds the parent's stderr (as its fds 1 and 2) until it exits: the pipe ends
        # once both have exited (a TimeoutExpired otherwise), whether or not anything has reaped
        # the orphaned helper yet.
        parent.communicate(timeout=30)


def test_a_resumed_cursor_is_a_different_plan_for_the_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = Spec(n=500, seed=2, batch_size=4)
    fresh_plan = plan_epoch(spec, fresh(spec, 0), 2, 0)
    resumed = plan_epoch(spec, Cursor(epoch=0, remaining=((40, 300), (310, 500))), 2, 0)
    assert fresh_plan is not None and resumed is not None
    want = [p.lease(0, 1, COUNT) for p in (fresh_plan, resumed)]
    assert not np.array_equal(want[0][0], want[1][0])
    assert _expander.ready(60.0)
    _local_forbidden(monkeypatch)
    for _ in range(2):
        for p, w in zip((fresh_plan, resumed), want):
            _same(_expander.lease(p, 0, 1, COUNT), (w[0].tolist(), w[1]))


@pytest.mark.parametrize("frame", [b"\x07" + bytes(8), b"\x00" + (5).to_bytes(8, "little"), b"\x00\x01"])
def test_a_malformed_answer_falls_back_with_one_warning(frame: bytes, caplog: pytest.LogCaptureFixture) -> None:
    p = _plans()[0]
    assert _expander.ready(60.0)
    proc = _expander._process()
    assert proc is not None and proc.stdout is not None
    pipe, proc.stdout = proc.stdout, io.BytesIO(frame)  # what the parent reads instead of the helper's answer
    try:
        with caplog.at_level(logging.WARNING, logger="croupier"):
            for first in (0, COUNT):
                want = p.lease(1, first, COUNT)
                _same(_expander.lease(p, 1, first, COUNT), (want[0].tolist(), want[1]))
    finally:
        pipe.close()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert proc.returncode is not None  # killed and reaped


def _lease_in_fork(p: FixedPlan, out: Any) -> None:
    inherited = _expander._helper is not None  # the parent's, if the fork did not forget it
    got = _expander.lease(p, 1, 2, COUNT)[0].tolist()
    h = _expander._helper
    out.put((inherited, got, h is not None and h.pid == os.getpid()))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_use_its_parents_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    p = _plans()[0]
    want = p.lease(1, 2, COUNT)[0].tolist()
    assert _expander.ready(60.0)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_lease_in_fork, args=(p, out))
    child.start()
    assert out.get(timeout=60) == (False, want, True)  # a helper of its own
    child.join(timeout=60)
    assert child.exitcode == 0
    _local_forbidden(monkeypatch)
    _same(_expander.lease(p, 1, 2, COUNT), (want, [1] * COUNT))  # the parent's helper still answers in step


@pytest.mark.skipif(sys.platform != "linux", reason="pipe sizes are set on Linux only")
def test_a_default_lease_crosses_the_pipe_in_one_turn() -> None:
    """The helper's answers go through a pipe that holds a whole default lease (512 KiB), so the
    prefetch thread wakes once per lease rather than once per 64 KiB."""
    import fcntl

    with open("/proc/sys/fs/pipe-max-size") as f:
        limit = int(f.read())
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, min(limit, 65536 * 8))
    except OSError as e:  # a user over its pipe-user-pages-soft quota keeps 64 KiB pipes
        pytest.skip(f"this user may not widen a pipe here: {e}")
    finally:
        os.close(r)
        os.close(w)
    assert _expander.ready(60.0)
    proc = _expander._process()
    assert proc is not None and proc.stdout is not None
    assert fcntl.fcntl(proc.stdout.fileno(), fcntl.F_GETPIPE_SZ) >= min(limit, 65536 * 8)


def test_small_leases_are_computed_here_and_start_the_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease of fewer than LOCAL_BELOW indices (a generation's first) is computed in this process,
    where it costs less than the round trip; it starts the helper all the same, and the next,
    larger lease goes there."""
    monkeypatch.setattr(_expander, "LOCAL_BELOW", 100)
    spec = Spec(n=10_000, seed=4, batch_size=10)
    p = plan_epoch(spec, fresh(spec, 0), 2, 0)
    assert p is not None
    small, large = p.lease(1, 0, 9), p.lease(1, 9, 10)  # 90 and 100 indices
    asked: list[int] = []
    real = _expander._Helper.lease

    def counted(self: Any, plan: Any, rank: int, first: int, count: int, total: int) -> Any:
        asked.append(total)
        return real(self, plan, rank, first, count, total)

    monkeypatch.setattr(_expander._Helper, "lease", counted)
    assert _expander._process() is None
    _same(_expander.lease(p, 1, 0, 9), (small[0].tolist(), small[1]))
    assert _expander.ready(60.0) and _expander._process() is not None  # the small lease started it
    _same(_expander.lease(p, 1, 0, 9), (small[0].tolist(), small[1]))
    assert asked == []
    _same(_expander.lease(p, 1, 9, 10), (large[0].tolist(), large[1]))
    assert asked == [100]
