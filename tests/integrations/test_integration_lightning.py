"""croupier under PyTorch Lightning, end to end: torchrun ranks, a mid-epoch checkpoint, a preemption, resumes, the audit.

examples/lightning_train.py trains with default Trainer settings and croupier's sampler in a plain
``DataLoader`` or torchdata's ``StatefulDataLoader`` (2 workers each: the loader reads the sampler
ahead). A first run on 2 ranks checkpoints at step 5 (``ModelCheckpoint``) and is "preempted"
at step 7 (every rank ``os._exit``). From that checkpoint, ``trainer.fit(ckpt_path=...)`` resumes
with 2 ranks and, separately (a copy of the audit directory), with 1 rank; both run to the end of
3 epochs, and ``croupier audit`` must find every epoch exactly once. Without
:class:`~croupier.integrations.lightning.CroupierCheckpoint`, the same resume is refused (with either loader).
"""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from _torchrun import torchrun as run_example

from croupier.tools.audit import audit, render, verdict

pytestmark = [pytest.mark.e2e,  # several processes
              pytest.mark.xdist_group("lightning")]  # its end-to-end tests resume one module-scoped run: one worker runs them all (make test's --dist loadgroup)

EXAMPLE = "lightning_train.py"
EPOCHS, SAVE_AT, STOP_AT = 3, 5, 7
TIMEOUT = 150  # seconds, per torchrun


def torchrun(nproc: int, work: pathlib.Path, audit_dir: pathlib.Path, job: str, *args: str, fails: bool = False) -> str:
    """Runs the example under torchrun; returns its stderr (asserts exit 0, or non-zero with `fails`)."""
    env = {"CROUPIER_JOB": job, "CROUPIER_AUDIT_DIR": str(audit_dir), "CROUPIER_STATE_DIR": str(work / "coordinator"),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONWARNINGS": "ignore"}
    args = ("--ckpt-dir", str(work / "ckpt"), "--epochs", str(EPOCHS), "--workers", "2", *args)
    return run_example(EXAMPLE, nproc, work, list(args), env=env, timeout=TIMEOUT, fails=fails)[1]


def cut_records(audit_dir: pathlib.Path) -> list[dict[str, Any]]:
    """The ``cut`` records of the audit logs: an epoch the training loop left before its end."""
    out = []
    for path in sorted(audit_dir.glob("*/*.audit")):
        with open(path, "rb") as f:
            out += [r for r in msgpack.Unpacker(f, raw=False) if r.get("t") == "cut"]
    return out


def check_audit(audit_dir: pathlib.Path, title: str) -> tuple[bool, str]:
    """Audits `audit_dir`, prints the table (shown with -s); returns the verdict and the table."""
    reports = audit(audit_dir)
    ok, summary = verdict(reports)
    cuts = cut_records(audit_dir)
    # NOTE: tools/audit.py does not read ``cut`` records yet, so an epoch that the loop left before
    # its end shows as trained in full there; count them separately.
    text = f"{render(reports)}\n\n{summary}; cut records: {len(cuts)}"
    print(f"\n== {title}\n{text}")
    return ok and not cuts, text


@pytest.fixture(scope="module", params=["plain", pytest.param("stateful", marks=pytest.mark.slow)])  # stateful: make slow
def preempted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, pathlib.Path]]:
    """A first run on 2 ranks: checkpoint at step SAVE_AT, preempted at STOP_AT. Yields (loader, its directory)."""
    loader: str = request.param
    work = tmp_path_factory.mktemp(f"lightning-{loader}")
    torchrun(2, work, work / "audit", f"lt-{loader}", "--loader", loader, "--checkpoint-every", str(SAVE_AT),
             "--stop-after-steps", str(STOP_AT))
    ckpts = sorted((work / "ckpt").glob("*.ckpt"))
    assert [c.name for c in ckpts] == [f"step={SAVE_AT}.ckpt"], ckpts
    yield loader, work


def resume(preempted: tuple[str, pathlib.Path], tmp_path: pathlib.Path, nproc: int, *extra: str) -> tuple[bool, str, str]:
    """Resumes the preempted run from its checkpoint with `nproc` ranks, in a copy of its audit directory."""
    loader, work = preempted
    audit_dir = tmp_path / "audit"
    shutil.copytree(work / "audit", audit_dir)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(work / "ckpt", run / "ckpt")
    err = torchrun(nproc, run, audit_dir, f"lt-{loader}", "--loader", loader, "--resume",
                   str(run / "ckpt" / f"step={SAVE_AT}.ckpt"), *extra)
    ok, text = check_audit(audit_dir, f"{loader} loader, 2 ranks -> {nproc} {' '.join(extra)}".rstrip())
    return ok, text, err


@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.slow), 1])  # the same world: in make slow
def test_resume_mid_epoch_exactly_once(preempted: tuple[str, pathlib.Path], tmp_path: pathlib.Path, nproc: int) -> None:
    """Preempted on 2 ranks, resumed from the mid-epoch checkpoint on `nproc`: every epoch exactly once."""
    ok, text, err = resume(preempted, tmp_path, nproc)
    assert ok, text
    assert "cuts epoch" not in err, err[-3000:]
    assert f"{EPOCHS} finished epochs audited" in text


@pytest.mark.slow  # make slow
def test_stateful_loader_resumes_from_an_epoch_end_checkpoint(tmp_path: pathlib.Path) -> None:
    """Lightning restores a StatefulDataLoader's state only inside an epoch; from an epoch's end the callback's state is used."""
    job = "lt-epoch-end"
    torchrun(2, tmp_path, tmp_path / "audit", job, "--loader", "stateful", "--epoch-end-checkpoints",
             "--stop-after-steps", "14")  # 12 steps an epoch: checkpoint at step 12, preempted at 14
    ckpt = tmp_path / "ckpt" / "step=12.ckpt"
    assert ckpt.exists(), sorted((tmp_path / "ckpt").glob("*"))
    err = torchrun(2, tmp_path, tmp_path / "audit", job, "--loader", "stateful", "--resume", str(ckpt))
    ok, text = check_audit(tmp_path / "audit", "stateful loader, epoch-end checkpoint, 2 ranks -> 2")
    assert ok, text
    assert "cuts epoch" not in err, err[-3000:]


def test_resume_without_the_callback_is_refused(preempted: tuple[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    """The same resume on 1 rank without CroupierCheckpoint (a plain DataLoader would start the epoch over, a
    StatefulDataLoader size it for 2 ranks): refused before the first batch, naming the callback."""
    loader, work = preempted
    audit_dir = tmp_path / "audit"
    shutil.copytree(work / "audit", audit_dir)
    before = sorted(p.name for p in audit_dir.rglob("*"))
    run = tmp_path / "run"
    shutil.copytree(work / "ckpt", run / "ckpt")
    err = torchrun(1, run, audit_dir, f"lt-{loader}", "--loader", loader, "--no-callback", "--resume",
                   str(run / "ckpt" / f"step={SAVE_AT}.ckpt"), fails=True)
    assert "without croupier.integrations.lightning.CroupierCheckpoint" in err, err[-3000:]
    assert sorted(p.name for p in audit_dir.rglob("*")) == before  # not one index dealt
