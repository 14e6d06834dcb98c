"""Smoke run of the shard-order benchmark (`benchmarks/shards_sim.py --quick`), so that it keeps working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.exhaustive  # a benchmark's quick run: in make test, not in make check

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "shards_sim.py"


def test_shards_sim_quick_writes_its_tables_and_plots(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "shards.md").read_text()
    assert (tmp_path / "shards.png").stat().st_size > 0
    assert (tmp_path / "shards_scale.png").stat().st_size > 0
    for heading in ("## Shuffle quality", "### Fetches: steady epoch", "## Fetches at scale", "## Targets"):
        assert heading in text, text
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| croupier ")]
    assert any(r[1].strip() == "croupier global permutation" for r in rows), text
    assert any(r[1].strip().startswith("croupier shards ") for r in rows), text
    # every croupier row of the fetch tables accounts for its samples: none dealt twice
    coverage = [r[-2].strip() for r in rows if r[-2].strip().count("/") == 1]
    assert coverage and all(c.split("/")[0].strip() == "0" for c in coverage), coverage
