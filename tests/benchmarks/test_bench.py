"""Smoke run of the one benchmark program (`benchmarks/bench.py --quick`), so that it keeps working; its figures are not checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # several processes

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"


@pytest.mark.slow  # make slow (make bench runs the whole)
def test_bench_quick_writes_its_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    md = (out / "bench.md").read_text()
    header = "| benchmark | case | croupier | peer | peer value | croupier vs peer | target |"
    assert header in md and header in proc.stdout
    for row in ("epoch start: time to first batch", "resume mid-epoch", "steady state: indices/s, DataLoader(sampler=)",
                "steady state: indices/s, DataLoader(batch_sampler=), dataset with __getitems__",
                "whole epoch: indices/s, first batch included", "RPCs per training step per rank",
                "bytes per step per rank", "coordinator capacity: grants/s", "coordinator: grant latency p50 / p99 (paced",
                "durable commit", "floor: bare numpy loop", "steady state reference", "steady state ceiling",
                "steady state: indices/s, DataLoader(batch_sampler=), dataset with __getitems__, collate_fn passing"):
        assert f"| {row}" in md, row
    # Every target has a verdict in its row, and the coordinator rows carry both rank counts.
    for target in (">= 1x: ", ">= 1.5x: ", "<= 0.01: "):
        assert target in md, target
    assert md.count("| coordinator: grant latency p50 / p99 (paced") == 2
    png = out / "bench.png"
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
