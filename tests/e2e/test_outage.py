"""A coordinator outage mid-epoch: real torchrun ranks train on from their plans, with no stall, exactly once."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from croupier.client._rpc import CoordinatorClient

pytestmark = pytest.mark.e2e  # several processes

HERE = pathlib.Path(__file__).resolve().parents[1]
WORLD, BATCH = 3, 4
#: The longest a rank may go without a step: steps take ~25 ms; a rank that waits for the
#: coordinator at all waits at least a lease's timeout (0.25 s) per lease.
STALL_S = 1.0


# NOTE: the 30 s outage is in `make slow`; the suite stops the coordinator for 10 s.
@pytest.mark.parametrize("outage_s", [10.0, pytest.param(30.0, marks=pytest.mark.slow)])
def test_three_ranks_train_through_a_coordinator_outage(tmp_path: pathlib.Path, serve_process: type,
                                                         outage_s: float) -> None:
    # At 20 ms of compute a step, the run outlasts the outage twice over.
    steps = 100 + int(outage_s * 80)
    n = WORLD * BATCH * steps
    coordinator = serve_process(f"sqlite:///{tmp_path}/coordinator.db")
    args = ["--logdir", str(tmp_path), "--tag", "run", "--n", str(n), "--batch-size", str(BATCH), "--step-ms", "20",
            "--mark-at", "100", "--lease-ahead", "256"]  # a lease of 256 indices lasts 64 steps
    env = {**os.environ, "CROUPIER_JOB": "outage", "CROUPIER_ADDRESS": coordinator.address, "OMP_NUM_THREADS": "1",
           "TRAINER_ARGS": " ".join(args)}
    env.pop("CROUPIER_INCARNATION", None)
    env.pop("CROUPIER_TOKEN", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(HERE / "_trainer.py")]
    ranks = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    try:
        assert ranks.stdout is not None
        while (line := ranks.stdout.readline()) != "marked\n":  # rank 0 is 100 steps in
            assert line, f"the ranks ended before step 100: {ranks.stderr.read() if ranks.stderr else ''}"
        os.kill(coordinator.proc.pid, signal.SIGSTOP)  # stopped: it holds its port and answers nothing
        t0 = time.time()
        try:
            ranks.wait(timeout=outage_s)  # the outage's length; the ranks must not end inside it
            raise AssertionError(f"the ranks ended during the outage (exit {ranks.returncode})")
        except subprocess.TimeoutExpired:
            pass
        t1 = time.time()
    finally:
        os.kill(coordinator.proc.pid, signal.SIGCONT)
    out, err = ranks.communicate(timeout=240)
    assert ranks.returncode == 0, err[-4000:]

    logs: dict[int, list[dict]] = {}
    for r in range(WORLD):
        path = tmp_path / f"log-run-r{r}.jsonl"
        logs[r] = [json.loads(line) for line in path.read_text().splitlines()]
    for r, recs in logs.items():
        times = [rec["t"] for rec in recs if "t" in rec]
        inside = [t for t in times if t0 <= t <= t1]
        assert inside and inside[0] - t0 < STALL_S and t1 - inside[-1] < STALL_S, f"rank {r} stalled at an edge"
        gaps = [b - a for a, b in zip(inside, inside[1:])]
        assert max(gaps) < STALL_S, f"rank {r} stalled {max(gaps):.2f} s during the outage"
        assert any(t > t1 for t in times), f"rank {r} finished inside the outage: not mid-epoch"
        print(f"rank {r}: {len(inside)} steps during the {t1 - t0:.1f} s outage, longest gap {max(gaps) * 1000:.0f} ms")

    trained = [i for recs in logs.values() for rec in recs if "indices" in rec for i in rec["indices"]]
    counts = collections.Counter(trained)
    assert sorted(counts) == list(range(n)) and max(counts.values()) == 1, "not exactly once"  # n divides evenly

    # Back, the coordinator hears from every rank again (progress rides on the next leases).
    with CoordinatorClient(coordinator.address) as c:
        seen = {rc.rank: rc.batches for rc in c.status("outage").ranks}
    before = 100 * BATCH
    assert set(seen) == set(range(WORLD)) and min(seen.values()) > before, seen
