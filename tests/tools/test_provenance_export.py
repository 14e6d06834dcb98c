"""`croupier provenance --export`: an OLMo-style global_indices.npy read back as OLMo's tools read it, and its refusals."""

from __future__ import annotations

import pathlib

import numpy as np
from _provenance_run import generation, run_cli

from croupier.client import CoordinatorClient
from croupier.server import Server
from croupier.tools import provenance as prov


def test_a_run_resized_and_rolled_back_at_one_global_batch_is_written_and_read_back(server: Server,
                                                                                     tmp_path: pathlib.Path) -> None:
    """Generation 1 (2 ranks, 2 batches each a step) trains steps 1-8; generation 2 (4 ranks, 1 batch each) resumes
    from step 3 and trains 4-9: 16 samples a step throughout, steps 4-8 from generation 2."""
    saved = generation(server.address, "run", "a", 2, 8, dataset=400, global_batch=16, save_at=(3, 8))
    generation(server.address, "run", "b", 4, 6, dataset=400, global_batch=16, resume=saved[3], save_at=(9,))
    path = tmp_path / "global_indices.npy"
    code, out, err = run_cli("provenance", "run", "--export", str(path), "--address", server.address)
    assert (code, err) == (0, "")
    assert out == f"job 'run': wrote {path}: 9 steps of 16 samples (uint32; batch N is step N + 1)\n"
    with CoordinatorClient(server.address) as c:
        led = c.ledger("run")
    order = np.load(path, mmap_mode="r")  # as OLMo's tools read it
    assert isinstance(order, np.memmap) and order.dtype == np.uint32 and order.shape == (9 * 16,)
    batch = 16
    for n in range(order.size // batch):
        rec = led.step(n + 1)
        assert rec.kept is not None
        assert np.array_equal(order[n * batch: (n + 1) * batch], rec.kept.indices), f"batch {n}"
    assert led.step(5).kept is not None and led.step(5).kept.generation == 2  # the rollback's version
    assert np.unique(order).size == order.size  # one epoch: no sample twice along the kept timeline
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def _refused(server: Server, tmp_path: pathlib.Path, job: str, message: str) -> None:
    path = tmp_path / f"{job}.npy"
    code, out, err = run_cli("provenance", job, "--export", str(path), "--address", server.address)
    assert (code, out) == (1, "")
    assert message in err and "Traceback" not in err
    assert not path.exists() and [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_rampup_is_refused(server: Server, tmp_path: pathlib.Path) -> None:
    generation(server.address, "ramp", "a", 2, 5, dataset=400, global_batch=16, rampup=(8, 8, 2), save_at=(5,))
    _refused(server, tmp_path, "ramp", "job 'ramp' cannot be written as an order file of one global batch a step: "
                                       "generation 1 ramps its global batch up (from 8 by 8 every 2 steps to 16)")


def test_a_resize_that_changed_the_global_batch_is_refused(server: Server, tmp_path: pathlib.Path) -> None:
    saved = generation(server.address, "grow", "a", 2, 4, dataset=400, save_at=(4,))
    generation(server.address, "grow", "b", 3, 2, dataset=400, resume=saved[4], save_at=(6,))
    _refused(server, tmp_path, "grow", "its global batch changed: generation 1 (world 2) took 8 samples a step, "
                                       "generation 2 (world 3) took 12 samples a step")


def test_token_budgets_are_refused(server: Server, tmp_path: pathlib.Path) -> None:
    lengths = [(7 * i) % 50 + 1 for i in range(300)]
    generation(server.address, "tok", "a", 2, 3, dataset=300, max_tokens=120, lengths=lengths, save_at=(3,))
    _refused(server, tmp_path, "tok", "its batches are token budgets (max_tokens)")


def test_an_epochs_short_last_step_is_refused(server: Server, tmp_path: pathlib.Path) -> None:
    """100 samples on 2 ranks of 4: 12 full steps, then one of 2 samples a rank."""
    generation(server.address, "short", "a", 2, 13, dataset=100, save_at=(13,))
    _refused(server, tmp_path, "short", "step 13 of job 'short' trained 4 samples, not 8 (an epoch's short last step)")


def test_the_python_function_writes_what_the_command_writes(server: Server, tmp_path: pathlib.Path) -> None:
    generation(server.address, "f", "a", 1, 3, dataset=40, batch=5, save_at=(3,))
    done = prov.export(prov.ledger(server.address, "f"), tmp_path / "f.npy")
    assert (done.steps, done.batch, done.dtype) == (3, 5, "uint32")
    code, _, _ = run_cli("provenance", "f", "--export", str(tmp_path / "g.npy"), "--address", server.address)
    assert code == 0 and np.array_equal(np.load(tmp_path / "f.npy"), np.load(tmp_path / "g.npy"))
