"""croupier under the HF Trainer: checkpointed mid-epoch by 2 ranks, resumed on 2 and on 1, audited.

The end-to-end tests run ``examples/hf_trainer_train.py`` under torchrun (gloo, CPU): one run trains
with :class:`croupier.integrations.transformers.CroupierTrainer` and stops right after
``checkpoint-11`` (epoch 1, 3 steps in), as if preempted; each resume (``train(resume_from_checkpoint=)``)
starts from a copy of that run's audit logs, coordinator store and loop logs. ``croupier audit``
(what the sampler handed out, cut at the checkpoint) and the model's own log (the indices its
forward received) must both show every epoch exactly once. Resumed on 1 rank, the Trainer's own
arithmetic would start at epoch ``11 // 16 = 0``; the integration starts at the data's epoch 1.
The last test uses the plain Trainer with croupier's sampler: Accelerate would re-shard it and each
rank train half of its share with exit code 0; the sampler refuses it, naming CroupierTrainer.
"""

from __future__ import annotations

import collections
import json
import pathlib
import shutil

import pytest
from _torchrun import audited_exactly_once, loop_counts
from _torchrun import exactly_once as each_once
from _torchrun import torchrun as run_example

from croupier.tools.audit import load

EXAMPLE = "hf_trainer_train.py"
SAMPLES, EPOCHS, BATCH, STOP = 64, 2, 4, 11  # world 2: 8 steps an epoch, so step 11 is 3 steps into epoch 1
TIMEOUT = 150.0


def torchrun(nproc: int, workdir: pathlib.Path, *extra: str, fails: bool = False) -> tuple[str, str]:
    """Runs the example on `nproc` ranks with `workdir`'s audit, state and loop-log directories; (stdout, stderr)."""
    args = ["--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
            "--output-dir", str(workdir / "out"), "--trained-log", str(workdir / "trained"), *extra]
    return run_example(EXAMPLE, nproc, workdir, args, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                       timeout=TIMEOUT, fails=fails)


def exactly_once(seen: dict[int, collections.Counter[int]]) -> bool:
    return each_once(seen, EPOCHS, SAMPLES)


pytestmark = pytest.mark.xdist_group("transformers")  # its end-to-end tests resume one module-scoped run: one worker runs them all (make test's --dist loadgroup)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """2 ranks, checkpoint-11 (with croupier_sampler.json), then stop."""
    work = tmp_path_factory.mktemp("hf-first")
    out, _ = torchrun(2, work, "--stop-after-steps", str(STOP))
    ckpt = work / "out" / f"checkpoint-{STOP}"
    assert f"saved {ckpt.parent}/checkpoint-{STOP}; stopping (preempted)" in out
    state = json.loads((ckpt / "croupier_sampler.json").read_text())
    assert (state["epoch"], state["items"]) == (1, 3 * BATCH), state
    return work


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.slow), 1])  # the same world: in make slow
def test_resume_any_world_exactly_once(preempted: pathlib.Path, tmp_path: pathlib.Path, nproc: int) -> None:
    for name in ("audit", "state", "trained"):
        shutil.copytree(preempted / name, tmp_path / name)
    out, _ = torchrun(nproc, tmp_path, "--resume", str(preempted / "out" / f"checkpoint-{STOP}"))
    # The data left: epoch 1 from 24 positions in, then nothing; 40 positions in batches of 4 per rank.
    assert f"training done at step {STOP + 40 // (BATCH * nproc)}, world {nproc}" in out
    audited_exactly_once(tmp_path / "audit", f"audit of the resume on {nproc} rank(s)", EPOCHS, SAMPLES)
    incs = load(tmp_path / "audit")["hf-trainer-train"]
    assert len(incs) == 2 and incs[1].world == nproc
    assert incs[1].origin == f"{incs[0].name}/1/{3 * BATCH}"  # checkpoint-11: epoch 1, 12 indices a rank
    seen = loop_counts(tmp_path)
    print("model's log: " + ", ".join(f"epoch {e}: {sum(c.values())} indices, {len(c)} distinct" for e, c in sorted(seen.items())))
    assert exactly_once(seen), {e: (sum(c.values()), len(c)) for e, c in seen.items()}


@pytest.mark.e2e
def test_plain_trainer_is_refused(tmp_path: pathlib.Path) -> None:
    """Without the integration, the Trainer's accelerator.prepare re-shards croupier's sampler (each rank would
    train half of its share, and exit 0): the sampler refuses to be iterated so, naming CroupierTrainer."""
    out, err = torchrun(2, tmp_path, "--plain-trainer", fails=True)
    assert "training done" not in out
    assert "re-sharding a croupier sampler" in err and "croupier.integrations.transformers.CroupierTrainer" in err, err[-3000:]
    assert not loop_counts(tmp_path)  # not one batch reached the model
