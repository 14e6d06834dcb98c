"""croupier under JAX and Grain, end to end: JAX processes, a checkpoint mid-epoch, resumes on 1, 2 and 3 processes.

examples/grain_train.py runs as a JAX multi-process job (``jax.distributed`` on 127.0.0.1, the CPU),
each process reading with Grain's ``DataLoader`` over croupier's sampler, 2 Grain workers each. A
first run on 2 processes saves the iterators' state after step 3 and is "preempted" after step
5; at step 3 one worker of each process is a batch ahead of the other and its batch straddles
the end of epoch 0, so the state holds two epochs' cursors. From that checkpoint, runs on 1, 2
and 3 processes (each in a copy) train to the end of 2 epochs. The audit reads what each
process's model received and identifies each record's epoch by its augmentation draw (drawn
from the record's rng, croupier's per-sample seed of (seed, epoch, index)): every epoch must
hold every index exactly once, and every draw must be the one its (epoch, index) gives, whoever
dealt it.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from _torchrun import exactly_once

from croupier.core.mixture import sample_seed

pytestmark = [pytest.mark.e2e,  # several processes
              pytest.mark.xdist_group("grain")]  # its end-to-end tests resume one module-scoped run: one worker runs them all (make test's --dist loadgroup)

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORDS, BATCH, EPOCHS, SEED, SAVE, STOP = 36, 6, 2, 7, 3, 5
TIMEOUT = 180.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(nproc: int, out: pathlib.Path, *extra: str) -> list[str]:
    """Runs the example as `nproc` JAX processes; their stdouts (asserts every one exits 0)."""
    port = _port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "examples" / "grain_train.py"), "--num-processes", str(nproc),
                               "--process-id", str(k), "--port", str(port), "--out", str(out), "--records", str(RECORDS),
                               "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--seed", str(SEED), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for k in range(nproc)]
    outs = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, f"process exited {p.returncode}:\n{o}\n{e[-5000:]}"
            outs.append(o)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


def _draw(epoch: int, index: int) -> int:
    return int(np.random.Generator(np.random.Philox(key=sample_seed(SEED, 0, epoch, index))).integers(2**62))


def audit(out: pathlib.Path) -> tuple[dict[int, collections.Counter[int]], list[tuple[int, int]]]:
    """Per epoch, how often each index reached a model: the first run up to its checkpoint, then the resume.

    Returns also the (index, draw) pairs whose draw belongs to no (epoch, index).
    """
    which = {_draw(e, i): (e, i) for e in range(EPOCHS) for i in range(RECORDS)}
    seen: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    strays = []
    for path in sorted((out / "trained").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if path.name.startswith("first-") and rec["step"] > SAVE:
                continue  # trained after the checkpoint the job resumed from: redone by the resume
            for i, d in zip(rec["keys"], rec["draws"]):
                e, j = which.get(d, (-1, -1))
                if j != i:
                    strays.append((i, d))
                else:
                    seen[e][i] += 1
    return seen, strays


def table(seen: dict[int, collections.Counter[int]]) -> str:
    rows = ["epoch  size  trained  duplicates  missing"]
    for e in range(EPOCHS):
        c = seen.get(e, collections.Counter())
        dup = sum(v - 1 for v in c.values() if v > 1)
        rows.append(f"{e:5d} {RECORDS:5d} {sum(c.values()):8d} {dup:11d} {RECORDS - len(c):8d}")
    return "\n".join(rows)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("grain-first")
    stdout = run(2, out, "--save-at", str(SAVE), "--stop-at", str(STOP))
    assert all(f"preempted after step {STOP}" in o for o in stdout), stdout
    states = [json.loads(p.read_text())["croupier"] for p in sorted((out / "ckpt" / f"step_{SAVE}").glob("*.json"))]
    assert len(states) == 2 and states[0] == states[1]
    assert [c["epoch"] for c in states[0]["cursors"]] == [0, 1]  # a worker's batch straddled the epoch's end
    return out


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow), 3])  # the same world: in make slow
def test_resume_on_any_process_count_exactly_once(preempted: pathlib.Path, tmp_path: pathlib.Path, nproc: int) -> None:
    out = tmp_path / "run"
    shutil.copytree(preempted, out)
    stdout = run(nproc, out, "--resume", str(out / "ckpt" / f"step_{SAVE}"))
    assert all("training done" in o for o in stdout), stdout
    seen, strays = audit(out)
    print(f"audit of the resume on {nproc} process(es), 2 Grain workers each:\n{table(seen)}")
    assert not strays, f"records whose augmentation draw is not their (epoch, index)'s: {strays[:5]}"
    assert exactly_once(seen, EPOCHS, RECORDS), table(seen)
