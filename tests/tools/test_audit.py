"""`croupier audit`: passes a job that restarted and resized, and catches a planted duplicate and gap."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import msgpack
import numpy as np
import pytest
from _ranks import on_ranks

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.server._service import Server
from croupier.tools.audit import audit

pytestmark = pytest.mark.e2e  # several processes

N = 101


def run_ranks(server: Server, logdir: pathlib.Path, world: int, incarnation: str, state: dict | None,
              steps: int | None, save_at: int | None) -> dict:
    """One incarnation: every rank takes `steps` indices (None: to the end of the epoch); returns rank 0's checkpoint."""
    saved: dict = {}

    def rank(r: int) -> None:
        s = DistributedSampler(N, world, r, address=server.address, job="audited", incarnation=incarnation, tail="uneven",
                               audit_dir=str(logdir), lease_ahead=7)
        if state:
            s.load_state_dict(state)
        it = iter(s)
        k = 0
        for _ in it:
            k += 1
            if k == save_at and r == 0:
                saved.update(s.state_dict())
            if steps is not None and k == steps:
                break
        s.close()

    on_ranks(world, rank)
    return saved


def make_job(server: Server, logdir: pathlib.Path) -> None:
    ck = run_ranks(server, logdir, 2, "g1", None, steps=30, save_at=20)  # dies at 30, checkpoint at 20
    ck2 = run_ranks(server, logdir, 3, "g2", ck, steps=None, save_at=5)  # resized 2 -> 3, to the end
    assert ck2
    run_ranks(server, logdir, 1, "g3", ck2, steps=None, save_at=None)  # an older checkpoint: rolls back


def test_audit_passes_a_restarted_resized_job(server: Server, tmp_path: pathlib.Path) -> None:
    make_job(server, tmp_path)
    reports = audit(tmp_path)
    assert [r.epoch for r in reports] == [0]
    assert reports[0].ok and reports[0].finished and reports[0].missing == 0 and reports[0].duplicates == 0
    out = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "audit", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "G1 holds" in out.stdout


def test_audit_counts_batches_of_the_batch_sampler(server: Server, tmp_path: pathlib.Path) -> None:
    """A checkpoint 3 batches into an epoch keeps 3 whole batches per rank, not 3 indices."""
    def incarnation(world: int, incarnation: str, state: dict | None, steps: int | None) -> dict:
        saved: dict = {}

        def rank(r: int) -> None:
            s = DistributedBatchSampler(N, 4, world, r, address=server.address, job="batches", incarnation=incarnation,
                                        tail="uneven", audit_dir=str(tmp_path), lease_ahead=2)
            if state:
                s.load_state_dict(state)
            for k, _ in enumerate(s, 1):
                if k == 3 and steps is not None and r == 0:
                    saved.update(s.state_dict())
                if k == steps:
                    break
            s.close()

        on_ranks(world, rank)
        return saved

    ck = incarnation(2, "b1", None, steps=5)  # checkpoint after 3 batches, dies after 5
    incarnation(3, "b2", ck, steps=None)
    (report,) = audit(tmp_path)
    assert report.ok and report.finished and (report.missing, report.duplicates, report.trained) == (0, 0, N), report


def _rewrite(path: pathlib.Path, fn) -> None:  # type: ignore[no-untyped-def]
    recs = list(msgpack.Unpacker(open(path, "rb"), raw=False))
    path.write_bytes(b"".join(msgpack.packb(r) for r in fn(recs)))


def test_audit_catches_a_planted_duplicate(server: Server, tmp_path: pathlib.Path) -> None:
    make_job(server, tmp_path)
    final = sorted((tmp_path / "audited").glob("g3-r0.audit"))[0]

    def plant(recs: list[dict]) -> list[dict]:
        last = [r for r in recs if r["t"] == "batch"][-1]
        extra = dict(last, at=last["at"] + 1000, idx=np.array([3], "<i8").tobytes())
        return recs + [extra]

    _rewrite(final, plant)
    r = audit(tmp_path)[0]
    assert not r.ok and r.duplicates == 1
    out = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "audit", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1 and "G1 VIOLATED" in out.stdout


def test_audit_catches_a_planted_gap(server: Server, tmp_path: pathlib.Path) -> None:
    make_job(server, tmp_path)
    final = sorted((tmp_path / "audited").glob("g3-r0.audit"))[0]

    def drop_one(recs: list[dict]) -> list[dict]:
        batches = [i for i, r in enumerate(recs) if r["t"] == "batch"]
        return [r for i, r in enumerate(recs) if i != batches[len(batches) // 2]]

    _rewrite(final, drop_one)
    r = audit(tmp_path)[0]
    assert not r.ok and r.missing > 0


def test_audit_flags_a_restart_that_did_not_load_the_sampler_state(server: Server, tmp_path: pathlib.Path) -> None:
    """A trainer that restores its model but not the sampler starts a fresh chain: not vouched for."""
    run_ranks(server, tmp_path, 2, "h1", None, steps=30, save_at=20)
    run_ranks(server, tmp_path, 2, "h2", None, steps=None, save_at=None)  # forgot load_state_dict
    reports = audit(tmp_path)
    assert not reports[0].ok and "UNVERIFIED" in reports[0].why
    out = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "audit", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1


@pytest.mark.parametrize("dealing", ["static", "dynamic"])
def test_an_epoch_ends_when_every_dynamic_rank_ended(tmp_path: pathlib.Path, dealing: str) -> None:
    """With dynamic dealing one rank out of batches does not end the epoch: the others may still hold some."""
    from croupier.client._audit_log import AuditLog
    from croupier.tools.audit import audit_job, load

    n, world = 8, 2
    for r in range(world):
        log = AuditLog(tmp_path, "j", "t1", r)
        log.start(job="j", token="t1", generation=1, world=world, rank=r, n=n, tail="uneven", partition="strided",
                  unit=2, origin=None, epoch=0, dealing=dealing)
        log.batch(0, 0, np.array([2 * r, 2 * r + 1], dtype=np.int64))  # 4 of 8 taken, the rest still held
        if r == 0:
            log.write(t="end", epoch=0)
        log.close()
    (report,) = audit_job("j", load(tmp_path)["j"])
    if dealing == "dynamic":
        assert not report.finished and report.ok and report.why.startswith("UNFINISHED"), report
    else:  # a static rank at its end means the epoch was iterated to its end: the gap is a violation
        assert report.finished and not report.ok, report
