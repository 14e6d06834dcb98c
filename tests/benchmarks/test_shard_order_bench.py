"""Smoke run of the shard order's speed benchmark (`benchmarks/shard_order_bench.py --quick`), so that it keeps
working: every target measured at both reader-group sizes, each verdict the one its figure earns."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.exhaustive  # a benchmark's quick run: in make test, not in make check

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "shard_order_bench.py"
BOUNDS = {"<= 50 ms": 50.0, "<= 16 B": 16.0, "<= 5 us": 5.0, "<= 50 us": 50.0}


def test_shard_order_bench_quick_writes_every_target(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "shard_order.md").read_text()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| ")]
    measured = {(r[0], r[1]) for r in rows if r[4]}
    for group in ("reader_group 1", "reader_group 8"):
        for measure in ("epoch start, fresh job", "epoch start, resume mid-epoch", "memory per shard, held",
                        "position -> index", "batch of 64"):
            assert (measure, group) in measured, text
    for row in rows:
        if row[4] in BOUNDS:
            value = float(row[2].split()[0].replace(",", ""))
            assert value > 0, row
            assert row[5] == ("met" if value <= BOUNDS[row[4]] else "**missed**"), row
    assert "## torch's DistributedSampler" in text and "| epoch start | N = 1e+05 |" in text, text
