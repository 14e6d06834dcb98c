"""Smoke run of the one benchmark program (`benchmarks/bench.py --quick`), so that it keeps working; its figures are not checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # several processes

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


def test_bench_quick_writes_its_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    md = (out / "bench.md").read_text()
    header = "| benchmark | case | croupier | peer | peer value | croupier vs peer | target |"
    assert header in md and header in proc.stdout
    for row in ("epoch start: time to first batch", "resume mid-epoch", "steady state", "coordinator capacity",
                "durable commit", "floor: bare numpy loop"):
        assert f"| {row}" in md, row
    png = out / "bench.png"
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
