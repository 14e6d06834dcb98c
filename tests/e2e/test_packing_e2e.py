"""A packed loader's job on a `croupier serve` coordinator, preempted (killed) mid-epoch and resumed on another
world size and worker count: every token of every document trained once over the kept steps."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from _packing_data import token_audit

SCRIPT = Path(__file__).resolve().parents[1] / "_packing_rank.py"
LENGTHS = [(i * 37) % 45 + 1 for i in range(90)]


def _world(address: str, job: str, world: int, run: Path, *extra: str) -> list[int]:
    run.mkdir()
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), address, job, str(r), str(world), str(run / "init"),
                               str(run / f"{r}.jsonl"), json.dumps(LENGTHS), *extra]) for r in range(world)]
    return [p.wait(timeout=300) for p in procs]


def _lines(run: Path, world: int) -> list[dict]:
    return [json.loads(line) for r in range(world) for line in (run / f"{r}.jsonl").read_text().splitlines()]


def test_a_packed_job_killed_mid_epoch_resumes_on_another_world(serve_process, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = serve_process(f"sqlite:///{tmp_path}/c.db")
    job = uuid.uuid4().hex
    # 2 ranks with 2 workers each checkpoint every 2 steps and are killed after step 5: step 5 is lost work
    codes = _world(server.address, job, 2, tmp_path / "a", "--every", "2", "--kill-after", "5", "--workers", "2")
    assert codes == [-9, -9], codes
    saved = json.loads((tmp_path / "a" / "0.jsonl.state").read_text())
    assert saved["step"] == 4 and saved["state"]["waiting"], saved
    kept = [tuple(p) for line in _lines(tmp_path / "a", 2) if line["step"] <= saved["step"] for p in line["pieces"]]
    # 3 ranks with 1 worker each load the state and finish the epoch
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(saved))
    assert _world(server.address, job, 3, tmp_path / "b", "--state", str(state_file), "--workers", "1") == [0, 0, 0]
    rest = _lines(tmp_path / "b", 3)
    ends = [line["state"] for line in rest if "state" in line]
    assert len(ends) == 3 and all(e == ends[0] for e in ends) and ends[0]["sampler"]["epoch"] == 1
    resumed = [tuple(p) for line in rest if "pieces" in line for p in line["pieces"]]
    assert not token_audit(LENGTHS, kept + resumed, None)
