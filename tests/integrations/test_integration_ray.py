"""croupier under Ray Train, end to end: a local Ray cluster, a worker killed mid-epoch, a restart on 3 workers.

examples/ray_train.py runs a ``TorchTrainer`` of 2 workers on a local Ray cluster (gloo, CPU) with
croupier's sampler in ``train_loop_per_worker`` and its state in Ray's checkpoints
(``croupier.integrations.ray``). At step 7 the last worker SIGKILLs itself, mid-epoch; Ray
restarts the worker group (``FailureConfig(max_failures=1)``) from the last checkpoint it had
registered, and the run stops at step 9, as if preempted. A new run of 3 workers starts from the
newest checkpoint and trains to the end of 2 epochs. ``croupier audit`` (what the samplers
handed out, cut at each checkpoint resumed from) and the model's own log (each attempt's indices,
cut at the step the next attempt resumed from) must both show every epoch exactly once.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys

import pytest
from _torchrun import audited_exactly_once, exactly_once

pytestmark = pytest.mark.e2e  # a Ray cluster and its workers

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAMPLES, EPOCHS, KILL, STOP = 96, 2, 7, 9  # 72 of epoch 0 by step 9: the 24 left divide by 3
TIMEOUT = 240.0


def run(out: pathlib.Path, *args: str) -> str:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_train.py"), "--out", str(out), "--samples",
                           str(SAMPLES), "--epochs", str(EPOCHS), *args],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout + proc.stderr


def attempts(out: pathlib.Path) -> list[tuple[int, int, list[dict[str, object]]]]:
    """Each worker group's attempt, oldest first: (step it resumed from, world, its ranks' log records)."""
    groups: dict[str, list[pathlib.Path]] = collections.defaultdict(list)
    for path in (out / "trained").glob("*-rank*.jsonl"):
        groups[path.name.rsplit("-rank", 1)[0]].append(path)
    found = []
    for name in sorted(groups, key=lambda a: int(a.split("-")[0])):
        records = [json.loads(line) for p in groups[name] for line in p.read_text().splitlines()]
        head = [r for r in records if "resumed_from" in r]
        found.append((int(head[0]["resumed_from"]), int(head[0]["world"]), [r for r in records if "step" in r]))
    return found


def model_log(groups: list[tuple[int, int, list[dict[str, object]]]]) -> dict[int, collections.Counter[int]]:
    """Per epoch, how often each index reached a model: each attempt up to the step the next one resumed from."""
    seen: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for i, (_, _, records) in enumerate(groups):
        until = groups[i + 1][0] if i + 1 < len(groups) else None  # the next attempt redoes what came after
        for r in records:
            if until is None or int(r["step"]) <= until:  # type: ignore[call-overload]
                seen[int(r["epoch"])].update(r["idx"])  # type: ignore[call-overload, arg-type]
    return seen


def test_killed_worker_and_a_restart_on_three_workers_exactly_once(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "ray"
    first = run(out, "--workers", "2", "--kill-at", str(KILL), "--stop-at", str(STOP))
    assert f"preempted after step {STOP}" in first, first[-3000:]
    assert (out / "killed").read_text() == str(KILL)
    second = run(out, "--workers", "3", "--resume-latest")
    assert "training done" in second and "resuming from" in second, second[-3000:]

    groups = attempts(out)
    print("attempts (resumed from step, workers): " + ", ".join(f"({s}, {w})" for s, w, _ in groups))
    assert [w for _, w, _ in groups] == [2, 2, 3]  # the first group, Ray's restart after the kill, the new run
    assert 0 < groups[1][0] < KILL and groups[2][0] == STOP
    seen = model_log(groups)
    print("model's log: " + ", ".join(f"epoch {e}: {sum(c.values())} indices, {len(c)} distinct"
                                      for e, c in sorted(seen.items())))
    assert exactly_once(seen, EPOCHS, SAMPLES), {e: sorted(c.items()) for e, c in seen.items()}
    audited_exactly_once(out / "audit", "audit", EPOCHS, SAMPLES)

