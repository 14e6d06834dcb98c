"""croupier under torch.distributed.checkpoint (DCP): the data order saved mid-epoch by 2 ranks, resumed on 2 and on 1.

The end-to-end tests run ``examples/dcp_train.py`` under torchrun (gloo, CPU): one run trains and
saves a DCP checkpoint mid-epoch, then stops (a preemption); each resume starts from a copy of that
run's audit logs and coordinator store, and ``croupier audit`` judges the whole job. One resume
leaves the dataloader state out of ``dcp.load``, and the audit must fail it. The in-process tests
show what DCP does to the sampler's state, handed over as it is or through ``SamplerState``.
"""

from __future__ import annotations

import collections
import json
import pathlib
import shutil
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from _packing_data import CONTEXT
from _torchrun import torchrun as run_example
from torch.utils.data import DataLoader

from croupier.client import DistributedSampler, Loader
from croupier.integrations.dcp import KEY, SamplerState
from croupier.tools.audit import audit, load, render, verdict

EXAMPLE = "dcp_train.py"
SAMPLES, EPOCHS, BATCH, STOP = 80, 2, 4, 13  # world 2: 10 steps an epoch, so step 13 is 3 steps into epoch 1
TIMEOUT = 120.0


def torchrun(nproc: int, workdir: pathlib.Path, *extra: str) -> str:
    """Runs the example on `nproc` ranks with `workdir`'s audit and state directories; its stdout."""
    args = ["--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
            "--ckpt-dir", str(workdir / "ckpt"), *extra]
    return run_example(EXAMPLE, nproc, workdir, args, timeout=TIMEOUT)[0]


pytestmark = pytest.mark.xdist_group("dcp")  # its end-to-end tests resume one module-scoped run: one worker runs them all (make test's --dist loadgroup)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """2 ranks (2 DataLoader workers each, so the save passes `consumed`), a DCP checkpoint at step 13, then stop."""
    work = tmp_path_factory.mktemp("dcp-first")
    out = torchrun(2, work, "--stop-after-steps", str(STOP), "--num-workers", "2")
    assert f"saved {work / 'ckpt' / f'step-{STOP}'} at epoch 1, 3 steps in" in out
    return work


def resume_from(preempted: pathlib.Path, work: pathlib.Path, nproc: int, *extra: str) -> list[Any]:
    """Resumes `preempted`'s checkpoint with `nproc` ranks, on copies of its audit logs and store; the audit."""
    shutil.copytree(preempted / "audit", work / "audit")
    shutil.copytree(preempted / "state", work / "state")
    out = torchrun(nproc, work, "--resume", str(preempted / "ckpt" / f"step-{STOP}"), *extra)
    assert "training done" in out
    reports = audit(work / "audit")
    ok, summary = verdict(reports)
    print(f"audit of the resume on {nproc} rank(s){' ' + ' '.join(extra) if extra else ''}:\n{render(reports)}\n{summary}")
    return reports


@pytest.mark.e2e
def test_checkpoint_holds_one_copy_of_the_sampler_state(preempted: pathlib.Path) -> None:
    """Both ranks saved the same state under one key; DCP wrote it once, as a byte item."""
    md = dcp.FileSystemReader(str(preempted / "ckpt" / f"step-{STOP}")).read_metadata()
    loader_keys = [k for k in md.state_dict_metadata if k.startswith("dataloader")]
    assert loader_keys == [f"dataloader.{KEY}"]
    assert type(md.state_dict_metadata[loader_keys[0]]).__name__ == "BytesStorageMetadata"
    writes = [idx for idx in md.storage_data if idx.fqn == loader_keys[0]]
    assert len(writes) == 1, writes


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.slow), 1])  # the same world: in make slow
def test_resume_any_world_exactly_once(preempted: pathlib.Path, tmp_path: pathlib.Path, nproc: int) -> None:
    reports = resume_from(preempted, tmp_path, nproc)
    ok, summary = verdict(reports)
    assert ok, summary
    assert [(r.epoch, r.finished, r.trained, r.duplicates, r.missing) for r in reports] == [
        (0, True, SAMPLES, 0, 0), (1, True, SAMPLES, 0, 0)], render(reports)
    # The resumed incarnation names the checkpoint it came from: the first run's, at epoch 1 item 12.
    incs = load(tmp_path / "audit")["dcp-train"]
    assert len(incs) == 2 and incs[1].world == nproc
    assert incs[1].origin == f"{incs[0].name}/1/{3 * BATCH}"


@pytest.mark.e2e
def test_resume_without_dataloader_state_fails_the_audit(preempted: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Model and optimizer resumed, the data order not: samples are trained twice, and the audit says so."""
    reports = resume_from(preempted, tmp_path, 2, "--skip-dataloader-state")
    ok, summary = verdict(reports)
    assert not ok, summary
    assert any(not r.ok and r.why.startswith("UNVERIFIED") for r in reports), render(reports)
    # What the audit refuses to vouch for, counted from the logs: the second run trained epoch 0
    # again and epoch 1 from its start, repeating all the first run trained before its checkpoint.
    first, second = load(tmp_path / "audit")["dcp-train"]
    assert second.origin is None
    ckpt_epoch, ckpt_items = 1, 3 * BATCH  # the first run's checkpoint: epoch 1, 12 items per rank in
    seen: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for inc, cut in ((first, True), (second, False)):
        for rank in inc.ranks.values():
            for epoch, at, idx in rank.batches:
                if cut and epoch > ckpt_epoch:
                    continue
                stop = max(0, ckpt_items - at) if cut and epoch == ckpt_epoch else len(idx)
                seen[epoch].update(idx[:stop].tolist())
    repeats = {e: sum(c - 1 for c in counter.values()) for e, counter in seen.items()}
    print(f"repeated samples per epoch without the dataloader state: {repeats}")
    assert repeats == {0: SAMPLES, 1: 2 * 3 * BATCH}


def _sampler(job: str) -> DistributedSampler:
    return DistributedSampler(64, num_replicas=1, rank=0, seed=3, job=job)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_sampler_through_dcp_loses_its_origin(tmp_path: pathlib.Path) -> None:
    """Why SamplerState exists: DCP loads only the keys of the new sampler's template, which has no `origin`."""
    a = _sampler("dcp-plain")
    try:
        it = iter(a)
        taken = [next(it) for _ in range(5)]
        saved = a.state_dict()
        dcp.save({"dataloader": a}, checkpoint_id=str(tmp_path / "ckpt"))
    finally:
        a.close()
    assert "origin" in saved
    b = _sampler("dcp-plain")
    received: list[dict[str, Any]] = []
    real = b.load_state_dict

    def spy(sd: dict[str, Any]) -> None:
        received.append(dict(sd))
        real(sd)

    b.load_state_dict = spy  # type: ignore[method-assign,assignment]
    try:
        dcp.load({"dataloader": b}, checkpoint_id=str(tmp_path / "ckpt"))
        rest = list(b)
    finally:
        b.close()
    # the position survives; the origin and the generation that took the state do not
    assert received == [{k: v for k, v in saved.items() if k not in ("origin", "generation", "incarnation")}]
    assert sorted(taken + rest) == list(range(64))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sampler_state_through_dcp_keeps_everything(tmp_path: pathlib.Path) -> None:
    a = _sampler("dcp-wrapped")
    try:
        it = iter(a)
        taken = [next(it) for _ in range(5)]
        dcp.save({"dataloader": SamplerState(a)}, checkpoint_id=str(tmp_path / "ckpt"))
        saved = a.state_dict()
    finally:
        a.close()
    b = _sampler("dcp-wrapped")
    try:
        dcp.load({"dataloader": SamplerState(b)}, checkpoint_id=str(tmp_path / "ckpt"))
        assert b.state_dict() == saved  # origin included
        rest = list(b)
    finally:
        b.close()
    assert sorted(taken + rest) == list(range(64))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sampler_state_names_the_trainers_step(tmp_path: pathlib.Path) -> None:
    """DCP's state_dict() takes no argument: SamplerState's `step` callable names the step at every save."""
    a = _sampler("dcp-step")
    progress = {"step": 0}
    try:
        it = iter(a)
        for _ in range(5):
            next(it)
            progress["step"] += 1
        dcp.save({"dataloader": SamplerState(a, step=lambda: progress["step"])}, checkpoint_id=str(tmp_path / "ckpt"))
        generation = a.generation
    finally:
        a.close()
    b = _sampler("dcp-step")
    try:
        dcp.load({"dataloader": SamplerState(b, step=lambda: 0)}, checkpoint_id=str(tmp_path / "ckpt"))
        state = b.state_dict()  # before the first batch: the state loaded
        assert (state["step"], state["generation"], state["items"]) == (5, generation, 5)
    finally:
        b.close()


def test_sampler_state_consumed_and_errors() -> None:
    s = _sampler("dcp-consumed")
    try:
        it = iter(s)
        for _ in range(10):
            next(it)  # read ahead: the loop took only 4
        consumed = SamplerState(s, consumed=lambda: 4).state_dict()
        assert json.loads(consumed[KEY])["origin"].endswith("/0/4")
        assert json.loads(SamplerState(s).state_dict()[KEY])["origin"].endswith(f"/0/{s.items_done}")
        with pytest.raises(ValueError, match="not a croupier SamplerState"):
            SamplerState(_sampler("dcp-consumed")).load_state_dict({"epoch": 0})
        with pytest.raises(ValueError, match="not JSON"):
            SamplerState(_sampler("dcp-consumed")).load_state_dict({KEY: "{"})
        with pytest.raises(RuntimeError, match="before the first batch"):
            SamplerState(s).load_state_dict(consumed)
    finally:
        s.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sampler_state_of_a_loader_saves_what_the_loop_took(tmp_path: pathlib.Path) -> None:
    """DataLoader workers read the sampler ahead of the loop: SamplerState over the Loader saves the state at the
    batches that reached the loop (``Loader.state_dict(step=...)``, no count kept by the trainer) and loads it
    through the Loader; the resumed loop trains exactly the rest."""
    a = _sampler("dcp-loader")
    loader = Loader(DataLoader(list(range(64)), batch_size=4, sampler=a, num_workers=2, multiprocessing_context=CONTEXT))
    try:
        it = iter(loader)
        taken = [int(i) for _ in range(3) for i in next(it)]
        assert a.items_done > 12 and loader.items_trained == 12  # the workers read ahead
        dcp.save({"dataloader": SamplerState(loader, step=lambda: 3)}, checkpoint_id=str(tmp_path / "ckpt"))
        assert loader.state_dict(step=3) == a.state_dict(consumed=12, step=3)
    finally:
        loader.close()
        a.close()
    b = _sampler("dcp-loader")
    resumed = Loader(DataLoader(list(range(64)), batch_size=4, sampler=b))
    try:
        dcp.load({"dataloader": SamplerState(resumed, step=lambda: 0)}, checkpoint_id=str(tmp_path / "ckpt"))
        assert (b.state_dict()["step"], b.state_dict()["items"]) == (3, 12)
        rest = [int(i) for batch in resumed for i in batch]
        with pytest.raises(ValueError, match="leave consumed out"):
            SamplerState(resumed, consumed=lambda: 0)
    finally:
        b.close()
    assert sorted(taken + rest) == list(range(64))
