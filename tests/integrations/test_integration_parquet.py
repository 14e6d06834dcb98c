"""examples/parquet_train.py under torchrun: a folder of parquet files in a shard-local order, stopped on 3 ranks
with a checkpoint and resumed on 2, every row once in each epoch (counted by the ids in the rows)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
from _torchrun import ROOT, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.paired]


def test_parquet_shards_stopped_on_3_ranks_resume_on_2_exactly_once(tmp_path: pathlib.Path) -> None:
    data = tmp_path / "parquet"
    subprocess.run([sys.executable, str(ROOT / "examples" / "parquet_train.py"), str(data), "--make"], check=True)
    ckpt = tmp_path / "ckpt.json"
    args = [str(data), "--checkpoint", str(ckpt), "--batch-size", "16", "--workers", "2"]
    out, _ = torchrun("parquet_train.py", 3, tmp_path, [*args, "--stop-at", "150"])
    assert "stopped at step 150" in out
    saved = json.loads(ckpt.read_text())
    assert saved["epoch"] == 0 and len(saved["seen"]) == 150 * 3 * 16  # what 3 ranks trained before the checkpoint
    out, _ = torchrun("parquet_train.py", 2, tmp_path, args)
    # epoch 0: the rows before the checkpoint (3 ranks) and after it (2 ranks); epoch 1 whole on 2 ranks
    assert re.findall(r"epoch (\d): 16000 rows trained, .* every row once", out) == ["0", "1"], out
