"""examples/mixture_train.py under torchrun: a mixture whose weights change mid-run, preempted on 4 ranks and
resumed on 3, audited exactly once per source epoch."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from _torchrun import torchrun

from croupier.tools.audit import audit, by_source, verdict

pytestmark = pytest.mark.e2e


def test_a_mixture_preempted_on_4_ranks_and_resumed_on_3_is_audited_exactly_once(tmp_path: pathlib.Path) -> None:
    ckpt = str(tmp_path / "mix.pt")
    out, _ = torchrun("mixture_train.py", 4, tmp_path, ["--ckpt", ckpt, "--stop-after-steps", "8"])
    assert "saved" in out and "epoch 0" in out
    out, _ = torchrun("mixture_train.py", 3, tmp_path, ["--ckpt", ckpt, "--resume"])
    assert "epoch 1 done" in out
    reports = audit(tmp_path / "audit")
    ok, summary = verdict(reports)
    assert ok, summary
    # 440 samples an epoch: 4 ranks take 8 steps of 4 (128 samples) in the first run, 3 ranks the rest
    assert [(r.epoch, r.finished, r.missing) for r in reports] == [(0, True, 0), (1, True, 0)]
    assert sum(r.duplicates for r in reports) <= 2 * 2  # the pad tail: fewer than W = 3 repeats per epoch
    rows = by_source(reports)
    whole = [r for r in rows if r.expected == r.size]
    # math (40 samples, weight 0.1 then 0.4) went round several times; each whole source epoch once
    assert len([r for r in whole if r.source == 2]) >= 3
    assert all(r.trained == r.size and r.missing == 0 for r in whole)
    assert sum(r.duplicates for r in rows) == sum(r.duplicates for r in reports)
    shown = subprocess.run([sys.executable, "-m", "croupier.tools.cli", "audit", str(tmp_path / "audit")],
                           capture_output=True, text=True)
    assert shown.returncode == 0 and "by source and source epoch" in shown.stdout, shown.stdout + shown.stderr
