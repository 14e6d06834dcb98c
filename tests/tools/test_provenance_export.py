"""`croupier provenance --export`: an OLMo-style global_indices.npy read back as OLMo's tools read it, and its refusals."""

from __future__ import annotations

import pathlib
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
from _provenance_run import generation, run_cli

from croupier.client import CoordinatorClient
from croupier.core import kept as kept_mod
from croupier.core.history import History
from croupier.core.kept import KeptSteps
from croupier.core.ledger import Ledger
from croupier.core.schedule import Schedule
from croupier.core.spec import Spec
from croupier.server import Server
from croupier.tools import provenance as prov
from tests.core.test_ledger import Model


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


def _step_by_step(led: History, path: pathlib.Path) -> None:
    """The export as it was written before it walked the history in pieces: each step's record asked one by
    one, its kept indices written into a memory map of the file (the reference the export must match byte
    for byte)."""
    batch = led.constant_batch()
    assert batch is not None
    dtype = np.uint32 if led.spec.space <= 2**32 else np.uint64
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(led.last_step * batch,))
    for rec in led.steps(1, led.last_step):
        assert rec.kept is not None and rec.kept.indices.size == batch
        out[(rec.step - 1) * batch: rec.step * batch] = rec.kept.indices
    out.flush()
    del out


def _same_file(led: History, tmp_path: pathlib.Path, name: str) -> None:
    before, now = tmp_path / f"{name}-before.npy", tmp_path / f"{name}.npy"
    _step_by_step(led, before)
    prov.export(led, now)
    assert now.read_bytes() == before.read_bytes()


def test_the_export_writes_the_bytes_the_step_by_step_export_wrote(server: Server, tmp_path: pathlib.Path) -> None:
    """A run resized and rolled back through a coordinator, and a larger one made in process (3 generations on 4,
    2 and 4 ranks with accumulation, two rollbacks, 6 epochs), its pieces cut within epochs and steps."""
    saved = generation(server.address, "run", "a", 2, 8, dataset=400, global_batch=16, save_at=(3, 8))
    generation(server.address, "run", "b", 4, 6, dataset=400, global_batch=16, resume=saved[3], save_at=(9,))
    with CoordinatorClient(server.address) as c:
        _same_file(c.ledger("run"), tmp_path, "run")
    spec = Spec(n=480, seed=9, batch_size=3)
    model = Model(spec)
    for world, steps, resume in [(4, 50, None), (2, 60, 30), (4, 70, 70)]:
        model.generation(world, steps, resume, Schedule(24))
    led = Ledger("big", spec, model.segments)
    assert led.last_step == 140 and led.step(40).abandoned and led.step(80).abandoned  # trained twice: rolled back
    for piece in (1, 24 * 3 + 5, 1 << 20):  # a step a piece, pieces cut within a step's, and the default
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kept_mod, "PIECE", piece)
            _same_file(led, tmp_path, f"big{piece}")


def test_the_export_holds_a_piece_at_a_time(tmp_path: pathlib.Path) -> None:
    """The history is walked lazily and each piece let go once written: when a piece is computed, every piece
    but the one before it is gone (what bounds the export's memory, whatever the run's length)."""
    spec = Spec(n=960, seed=2, batch_size=4)
    model = Model(spec)
    model.generation(4, 200, None, Schedule(32))
    led = Ledger("lazy", spec, model.segments)
    alive: list[weakref.ref[np.ndarray]] = []
    held: list[int] = []
    walk = led.kept_order

    def watched(a: int, b: int) -> Iterator[KeptSteps]:
        for piece in walk(a, b):
            held.append(sum(r() is not None for r in alive))
            alive.append(weakref.ref(piece.indices))
            yield piece

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kept_mod, "PIECE", 32 * 10)
        mp.setattr(led, "kept_order", watched)
        prov.export(led, tmp_path / "lazy.npy")
    assert len(held) == 20 and max(held) <= 1, held
    assert (tmp_path / "lazy.npy").stat().st_size == 128 + 200 * 32 * 4
