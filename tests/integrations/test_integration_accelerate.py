"""croupier under HF Accelerate: saved mid-epoch by 2 ranks with ``save_state``, resumed on 2 and on 1, audited.

The end-to-end tests run ``examples/accelerate_train.py`` under torchrun (gloo, CPU): one run trains
and ``save_state``s mid-epoch (global step 11: epoch 1, 3 steps in), then stops (a preemption); each
resume starts from a copy of that run's audit logs, coordinator store and loop logs, and both
``croupier audit`` (what the sampler handed out, cut at the checkpoint) and the loop's own log (the
indices the training loop received after Accelerate's loader) must show every epoch exactly once.
The last test prepares the loader with plain ``accelerator.prepare``: Accelerate would re-shard
croupier's batches and the loop train half of each epoch with exit code 0; the sampler refuses it.
"""

from __future__ import annotations

import collections
import pathlib
import shutil

import pytest
from _torchrun import audited_exactly_once, loop_counts
from _torchrun import exactly_once as each_once
from _torchrun import torchrun as run_example

from croupier.tools.audit import load

EXAMPLE = "accelerate_train.py"
SAMPLES, EPOCHS, BATCH, STOP = 64, 2, 4, 11  # world 2: 8 steps an epoch, so step 11 is 3 steps into epoch 1
TIMEOUT = 120.0


def torchrun(nproc: int, workdir: pathlib.Path, *extra: str) -> str:
    """Runs the example on `nproc` ranks with `workdir`'s audit, state and loop-log directories; its stdout."""
    args = ["--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
            "--ckpt-dir", str(workdir / "ckpt"), "--trained-log", str(workdir / "trained"), *extra]
    return run_example(EXAMPLE, nproc, workdir, args, timeout=TIMEOUT)[0]


def exactly_once(seen: dict[int, collections.Counter[int]]) -> bool:
    return each_once(seen, EPOCHS, SAMPLES)


pytestmark = pytest.mark.xdist_group("accelerate")  # its end-to-end tests resume one module-scoped run: one worker runs them all (make test's --dist loadgroup)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """2 ranks (2 DataLoader workers each: the loader reads well ahead), save_state at step 11, then stop."""
    work = tmp_path_factory.mktemp("accelerate-first")
    out = torchrun(2, work, "--stop-after-steps", str(STOP), "--num-workers", "2")
    assert f"saved {work / 'ckpt' / f'step-{STOP}'} at epoch 1, step {STOP}" in out
    return work


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.slow), 1])  # the same world: in make slow
def test_resume_any_world_exactly_once(preempted: pathlib.Path, tmp_path: pathlib.Path, nproc: int) -> None:
    for name in ("audit", "state", "trained"):
        shutil.copytree(preempted / name, tmp_path / name)
    out = torchrun(nproc, tmp_path, "--resume", str(preempted / "ckpt" / f"step-{STOP}"), "--num-workers", "2")
    assert f"resumed {preempted / 'ckpt' / f'step-{STOP}'} at step {STOP}, epoch 1, world {nproc}" in out
    assert "training done" in out
    audited_exactly_once(tmp_path / "audit", f"audit of the resume on {nproc} rank(s)", EPOCHS, SAMPLES)
    incs = load(tmp_path / "audit")["accelerate-train"]
    assert len(incs) == 2 and incs[1].world == nproc
    assert incs[1].origin == f"{incs[0].name}/1/{3 * BATCH}"  # the first run's save_state: epoch 1, 12 indices a rank
    seen = loop_counts(tmp_path)
    print("loop log: " + ", ".join(f"epoch {e}: {sum(c.values())} indices, {len(c)} distinct" for e, c in sorted(seen.items())))
    assert exactly_once(seen), {e: (sum(c.values()), len(c)) for e, c in seen.items()}


@pytest.mark.e2e
def test_plain_prepare_is_refused(tmp_path: pathlib.Path) -> None:
    """Without the integration, accelerator.prepare re-shards croupier's batches (each rank would train half of its
    share, and exit 0): the sampler refuses to be iterated so, naming the integration to use."""
    args = ["--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
            "--ckpt-dir", str(tmp_path / "ckpt"), "--trained-log", str(tmp_path / "trained"), "--plain-prepare"]
    out, err = run_example(EXAMPLE, 2, tmp_path, args, timeout=TIMEOUT, fails=True)
    assert "training done" not in out
    assert "re-sharding a croupier sampler" in err and "prepare_data_loader(accelerator, loader)" in err, err[-3000:]
    assert not loop_counts(tmp_path)  # not one batch reached the loop
