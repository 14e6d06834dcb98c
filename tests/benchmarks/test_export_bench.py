"""The export benchmark's quick run (`benchmarks/export_bench.py --quick`): its table, and its checks that the files agree."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

pytestmark = pytest.mark.e2e  # the benchmark and its three children, each a process

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
BENCH = BENCHMARKS / "export_bench.py"


def _bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it reads its run's history from provenance_bench, beside it
    spec = importlib.util.spec_from_file_location("export_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_export_bench_quick_prints_its_table_and_the_files_agree() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "| export to .npy | time | CPU time | samples/s | peak RSS (growth during the export) | target | verdict |" in lines
    for row in ("| croupier (History.kept_order", "| floor: np.save of the array in memory |",
                "| before: step by step (History.steps, a memory map) |"):
        assert any(line.startswith(row) for line in lines), row
    assert "## The run: 3,000 steps of a global batch of 64" in proc.stdout
    assert ("Identical: the export and np.save of its array: same bytes; the step-by-step export's 1,000 steps and the "
            "export's first ones: same indices") in lines


def test_its_checks_see_one_changed_sample(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bench = _bench(monkeypatch)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    arr = np.arange(1000, dtype=np.uint32)
    np.save(a, arr)
    np.save(b, arr)
    assert bench.same_bytes(a, b, chunk=64) and bench._prefix_agrees(a, b, 1000)
    arr[997] += 1
    np.save(b, arr)
    assert not bench.same_bytes(a, b, chunk=64) and not bench._prefix_agrees(a, b, 1000)


def test_the_history_it_exports_is_resized_and_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench(monkeypatch)
    led = bench.ledger_of(bench.QUICK)
    rows = led.timeline()
    assert [r["world"] for r in rows] == [8, 4, 8] and led.last_step == 3000 and led.constant_batch() == 64
    assert rows[1]["to_step"] > rows[2]["from_step"]  # generation 2 trained past where generation 3 resumed
