"""A plain DataLoader with 4 workers through `Loader`, as processes: 2 ranks killed (-9) mid-epoch, resumed from the
last checkpoint on 1 rank with no workers and on 3 ranks with 2 (or 8); every sample once per epoch.

Each rank is a process of its own with the torchrun environment (tests/_loader_rank.py) on a ``croupier serve``
coordinator; rank 0 saves ``Loader.state_dict()`` every 3 steps. Two checks: what the loops logged (run a up to
the checkpoint's step, then all of the resumed run) holds every index once per epoch, and ``croupier audit`` of
the samplers' logs (each incarnation cut at the checkpoint it was resumed from) says the same.

Beside it rank 0 saves the sampler's own state (what it handed out); resumed from that, the batches the workers
had read ahead are never trained: the loops' logs show them missing. The samplers' audit cannot: their logs hold
what they handed out, and the checkpoint cuts run a where its sampler stood, read-ahead included.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from croupier.tools.audit import audit, render, verdict

pytestmark = pytest.mark.e2e  # several processes

RANK = Path(__file__).resolve().parents[1] / "_loader_rank.py"
N, BS, EPOCHS = 240, 4, 2
EVERY, PARK = 3, 8  # checkpoints at steps 3 and 6; killed after step 8, of 30 in an epoch of 2 ranks
READ_AHEAD = 4 * 2  # batches a rank's 4 workers hold at prefetch_factor 2


def _world(address: str, job: str, world: int, run: Path, audit_dir: Path, *extra: str,
           park: bool = False) -> list[subprocess.Popen[str]]:
    run.mkdir(parents=True)
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        for name in ("CROUPIER_ADDRESS", "CROUPIER_JOB", "CROUPIER_INCARNATION", "CROUPIER_AUDIT_DIR"):
            env.pop(name, None)
        with open(run / f"err-r{r}.txt", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(RANK), address, job, f"{run.parent.name}-{run.name}", str(run), str(audit_dir), "--epochs", str(EPOCHS),
                 "--n", str(N), "--batch-size", str(BS), *extra], cwd=RANK.parent, env=env, text=True, stderr=err,
                stdout=subprocess.PIPE if park else None, start_new_session=True))  # a group with its workers
    return procs


def _errors(run: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(run.glob("err-r*.txt")))


def _killed_mid_epoch(address: str, job: str, tmp: Path) -> dict[str, dict]:
    """Run a: 2 ranks x 4 workers, killed (-9, with their workers) once both parked after step PARK; its last
    checkpoints, Loader's and the sampler's own."""
    run = tmp / "a"
    procs = _world(address, job, 2, run, tmp / "audit", "--workers", "4", "--every", str(EVERY), "--park-after",
                   str(PARK), "--own-state", park=True)
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "parked", _errors(run)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    assert [p.returncode for p in procs] == [-9, -9]
    saved = {which: json.loads((run / f"{which}.json").read_text()) for which in ("ckpt", "own")}
    assert all(s["step"] == 6 and s["state"]["epoch"] == 0 for s in saved.values()), saved
    return saved


def _resumed(address: str, job: str, tmp: Path, saved: dict, world: int, workers: int, which: str) -> tuple[Path, Path]:
    """Run b from checkpoint `which` on `world` ranks with `workers` workers each, to the end of epoch EPOCHS - 1,
    its audit logs beside a copy of run a's; its run and audit directories."""
    case = tmp / f"b{world}x{workers}{which}"
    shutil.copytree(tmp / "audit", case / "audit")
    (case / "ckpt.json").write_text(json.dumps(saved))
    procs = _world(address, job, world, case / "run", case / "audit", "--workers", str(workers), "--state",
                   str(case / "ckpt.json"))
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0] * world, _errors(case / "run")
    return case / "run", case / "audit"


def _loop_logs(run: Path, upto: int | None = None) -> list[dict]:
    return [rec for f in sorted(run.glob("log-r*.jsonl")) for line in f.read_text().splitlines()
            if (rec := json.loads(line)) and (upto is None or rec["step"] <= upto)]


def _loop_audit(records: list[dict]) -> dict[int, collections.Counter[str]]:
    """Per epoch, the indices the loops trained 'missing' and 'repeated' against every index once."""
    seen: dict[int, collections.Counter[int]] = {e: collections.Counter() for e in range(EPOCHS)}
    for rec in records:
        seen[rec["epoch"]].update(rec["idx"])
    return {e: +collections.Counter(missing=sum(1 for i in range(N) if not c[i]),
                                    repeated=sum(k - 1 for k in c.values() if k > 1)) for e, c in seen.items()}


@pytest.mark.parametrize("resumes", [[(1, 0, "ckpt"), (3, 2, "ckpt"), (1, 0, "own")],
                                     pytest.param([(3, 8, "ckpt")], marks=pytest.mark.slow)],
                         ids=["1x0-3x2-own", "3x8"])
def test_a_plain_data_loader_killed_with_4_workers_resumes_exactly_on_other_worlds_and_workers(  # type: ignore[no-untyped-def]
        serve_process, tmp_path: Path, resumes: list[tuple[int, int, str]]) -> None:
    """Loader's checkpoint ("ckpt"): every index once per epoch, in the loops' logs and in the audit. The
    sampler's own ("own"): the READ_AHEAD batches of each rank, handed out to its workers and never trained,
    are missing from epoch 0 in the loops' logs; the audit of the samplers' logs cannot see it."""
    server = serve_process(f"sqlite:///{tmp_path}/c.db")
    job = uuid.uuid4().hex
    saved = _killed_mid_epoch(server.address, job, tmp_path)
    first = _loop_logs(tmp_path / "a", PARK)
    assert {rec["step"] for rec in first} == set(range(1, PARK + 1)), "run a trains past its checkpoint"
    for world, workers, which in resumes:
        run, audit_dir = _resumed(server.address, job, tmp_path, saved[which], world, workers, which)
        reports = audit(audit_dir)
        print(f"\n2 ranks x 4 workers killed after step {PARK}, resumed from the step-6 {which} on {world} ranks x "
              f"{workers} workers:\n{render(reports)}\n{verdict(reports)[1]}")
        loops = _loop_audit([rec for rec in first if rec["step"] <= 6] + _loop_logs(run))
        lost = {"ckpt": {}, "own": {"missing": 2 * READ_AHEAD * BS}}[which]
        assert loops == {0: lost, 1: {}}, (which, loops)
        assert verdict(reports)[0], render(reports)
        assert [(r.epoch, r.finished, r.trained, r.duplicates, r.missing) for r in reports] == [
            (e, True, N, 0, 0) for e in range(EPOCHS)], render(reports)
