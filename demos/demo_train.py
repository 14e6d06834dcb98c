"""The demo's trainer: a small model on a synthetic dataset, data-parallel over gloo, fed by croupier.

Run by torchrun (see ``croupier demo``). Settings come from the DEMO environment variable
(JSON; torchrun would read "--n" and the like as abbreviations of its own options):
workdir, n, epochs, batch_size, ckpt_every. Every rank writes its progress to
WORKDIR/status/rRANK.json; rank 0 checkpoints model, optimizer and the sampler's state to
WORKDIR/ckpt.pt every `ckpt_every` steps (atomically), and every rank resumes from it.
Optional keys (``croupier chaos`` uses them): `keep_checkpoints` also keeps every checkpoint as
WORKDIR/ckpts/step-XXXXXX.pt; `resume_from` names the checkpoint file to resume from instead of
ckpt.pt (relative to WORKDIR, or absolute); `lease_ahead` is the sampler's lease size; `step_ms`
stands in for a larger model's compute: each step takes at least that long (the multi-node demo
uses it so that a node joining, which takes its agent a few seconds, happens mid-training).
After its sampler's first batch, every rank appends the join it got acknowledged (incarnation,
generation, rank, world) as one JSON line to WORKDIR/joins.jsonl (``croupier chaos`` checks them
against the coordinator's journal).
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.core import settings


def synthetic(n: int) -> TensorDataset:
    """y = a fixed linear map of x, plus noise: a dataset every rank builds identically."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def lengths(n: int) -> list[int]:
    """Each sample's (synthetic) token count for token-budget batches: long-tailed, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    out: list[int] = torch.exp(3.0 + 0.8 * torch.randn(n, generator=g)).clamp(1, 200).int().tolist()
    return out


def mixture_of(n: int, epochs: int) -> dict[str, Any]:
    """``croupier chaos --mixture``'s mixture over the `n` samples: three sources (a half, a third and
    the rest), weights 5 : 3 : 2 changed to 2 : 3 : 5 halfway through the run, the smallest capped at
    `epochs` epochs of its own (it reaches the cap before the end: its weight then goes to the others)."""
    sizes = [n // 2, n // 3, n - n // 2 - n // 3]
    return {"sources": sizes, "weights": [(0, [5, 3, 2]), (n * epochs // 2, [2, 3, 5])], "max_epochs": [None, None, epochs]}


def init_process_group() -> None:
    """gloo over the rendezvous torchrun made for this round of workers.

    NOTE: run torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in its environment: every
    rendezvous round (a restart after a failure, a node that joins or leaves) then gets a store
    of its own. With the store shared across rounds, the plain ``env://`` init of a restarted
    group finds the previous round's keys and hangs, and a joining node waits for keys that
    nobody publishes again.
    """
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))


def _write_json(path: pathlib.Path, obj: object) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def _save(state: dict[str, object], path: pathlib.Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def _record_join(work: pathlib.Path, sampler: DistributedSampler | DistributedBatchSampler, rank: int, world: int) -> None:
    """Appends the join this rank's sampler got acknowledged to WORKDIR/joins.jsonl: one line, one write."""
    line = json.dumps({"incarnation": sampler.incarnation, "generation": sampler.generation, "rank": rank, "world": world,
                       "pid": os.getpid(), "t": time.time()}) + "\n"
    # One O_APPEND write of a short line: the ranks' lines never interleave.
    fd = os.open(work / "joins.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _sampler_and_loader(cfg: dict[str, Any], world: int) -> tuple[DistributedSampler | DistributedBatchSampler,
                                                                  DataLoader[Any]]:
    """The sampler the settings ask for (``batching``: fixed, tokens or dynamic) and a loader over it."""
    data = synthetic(cfg["n"])
    extra = {"lease_ahead": cfg["lease_ahead"]} if "lease_ahead" in cfg else {}
    batching = cfg.get("batching", "fixed")
    # The embedded coordinator (or CROUPIER_ADDRESS's), job from CROUPIER_JOB.
    sampler: DistributedSampler | DistributedBatchSampler
    if batching == "tokens":  # batches of up to max_tokens by each sample's (synthetic) length
        sampler = DistributedBatchSampler(data, lengths=lengths(cfg["n"]), max_tokens=cfg["max_tokens"], seed=1234,
                                          token_window=cfg.get("token_window", 256))
        loader = DataLoader(data, batch_sampler=sampler, num_workers=0)
    elif batching == "dynamic":  # batches go to whichever rank asks; ranks may end an epoch apart (Join)
        sampler = DistributedBatchSampler(data, cfg["batch_size"], seed=1234, dealing="dynamic")
        loader = DataLoader(data, batch_sampler=sampler, num_workers=0)
    else:
        if cfg.get("mixture"):  # croupier chaos --mixture: the n samples as three sources (mixture_of)
            extra.update(cfg["mixture"])
        # a step is one loader batch of every rank: the coordinator's step ledger counts it so (the
        # index sampler's batch is one index)
        sampler = DistributedSampler(data, shuffle=True, seed=1234, global_batch=cfg["batch_size"] * world, **extra)
        loader = DataLoader(data, batch_size=cfg["batch_size"], sampler=sampler, num_workers=0)
    return sampler, loader


def _resume(cfg: dict[str, Any], work: pathlib.Path, model: DDP, opt: torch.optim.Optimizer,
            sampler: DistributedSampler | DistributedBatchSampler) -> tuple[int, int]:
    """Loads the checkpoint to resume from (``resume_from``, else WORKDIR/ckpt.pt, if any) into the model, the
    optimizer and the sampler; returns (the epoch, the step) to go on from: (0, 0) without one."""
    resume = work / cfg["resume_from"] if cfg.get("resume_from") else work / "ckpt.pt"  # an absolute path stays
    if cfg.get("resume_from") and not resume.exists():
        raise FileNotFoundError(f"resume_from={cfg['resume_from']!r}: no such checkpoint ({resume})")
    if not resume.exists():
        return 0, 0
    state = torch.load(resume, weights_only=False)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])  # topology-free: any world size resumes from it
    # the sampler's state names the trainer's step it was taken at (saved with step=)
    return state["epoch"], state["sampler"].get("step", state["step"])


def main() -> None:
    cfg = json.loads(os.environ["DEMO"])
    work = pathlib.Path(cfg["workdir"])
    torch.set_num_threads(1)
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    node = settings.get("CROUPIER_DEMO_NODE") or ""

    batching = cfg.get("batching", "fixed")
    sampler, loader = _sampler_and_loader(cfg, world)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    ckpt = work / "ckpt.pt"
    history = work / "ckpts" if cfg.get("keep_checkpoints") else None
    start_epoch, step = _resume(cfg, work, model, opt, sampler)

    status = work / "status"
    status.mkdir(exist_ok=True)
    joined = False
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        # This epoch's batches: taken so far (after a resume, those before the checkpoint) and in all.
        k = sampler.items_done // (cfg["batch_size"] if batching == "fixed" else 1)
        of = len(loader)
        # NOTE: with dynamic dealing ranks end an epoch a few steps apart: DDP's Join lets the
        # ranks that ran out shadow the others' gradient all-reduces (and no barrier in the loop).
        with Join([model], enable=batching == "dynamic"):
            for x, y in loader:
                k += 1
                if not joined:  # the sampler's first batch: its join was acknowledged
                    _record_join(work, sampler, rank, world)
                    joined = True
                t_step = time.monotonic()
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                if cfg.get("step_ms"):  # simulated compute, see the module docstring
                    time.sleep(max(0.0, cfg["step_ms"] / 1000 - (time.monotonic() - t_step)))
                _write_json(status / f"r{rank}.json", {"t": time.time(), "pid": os.getpid(), "rank": rank,
                                                       "world": world, "epoch": epoch,
                                                       "step": step, "k": k, "of": of, "loss": loss.item(),
                                                       "restart": restart, "node": node})
                if step % cfg["ckpt_every"] == 0:
                    # Every rank's sampler state is the same (lockstep); rank 0 saves it with the model.
                    # NOTE: with dynamic dealing the ranks save one after the other (no barrier), each
                    # credited by the coordinator with what it was dealt by then: the same step could
                    # name two cursors, which the coordinator refuses; those states name no step.
                    named = step if batching != "dynamic" else None
                    state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                             "sampler": sampler.state_dict(step=named), "epoch": epoch, "step": step}
                    if rank == 0:
                        if history is not None:
                            history.mkdir(exist_ok=True)
                            _save(state, history / f"step-{step:06d}.pt")
                        _save(state, ckpt)
                    if batching != "dynamic":  # a rank that ran out is not in this loop to meet a barrier
                        dist.barrier()
    _write_json(status / f"r{rank}.json", {"pid": os.getpid(), "rank": rank, "world": world, "epoch": cfg["epochs"],
                                           "step": step, "loss": None, "restart": restart, "node": node,
                                           "done": True})
    sampler.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
