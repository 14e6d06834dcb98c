"""Launchers and parallel layouts: the sampler under each way a PyTorch job starts its ranks.

Every rank is a real process running tests/_launch_worker.py with the embedded coordinator
(no CROUPIER_ADDRESS: global rank 0 hosts it, its SQLite store under CROUPIER_STATE_DIR). A first
run trains a few steps, saves rank 0's ``state_dict()`` and trains on past it (what it trains
after the checkpoint is lost); a second run, of another data-parallel size, loads the state and
runs the epoch to its end. What the loops received up to the checkpoint plus what the second
run received must be every index of the epoch exactly once (tail "pad" with N divisible by every
data-parallel size used and by what is left at the checkpoint: nothing is padded).

Also the resolution of the world without a process group (SLURM's variables, a WORLD_SIZE
without RANK) and the refusal of several ranks that cannot agree on their incarnation.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch.distributed as dist

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.client._resolve import resolve_world

HERE = pathlib.Path(__file__).resolve().parents[1]
WORKER = HERE / "_launch_worker.py"
N = 96  # divisible by 1, 2 and 4, and so is N - SAVE_AT * BATCH * 2
BATCH = 4  # indices per step of one data-parallel rank
SAVE_AT = 3  # the first run checkpoints after this step...
STOP_AFTER = 5  # ...and trains on to this one before it exits
RUN_TIMEOUT = 90.0  # seconds for one run of a job's processes

# Variables of a launcher or of croupier that the test's own environment must not leak into a rank.
_LEAKS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
_LEAK_PREFIXES = ("CROUPIER_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_")

Records = dict[int, list[dict[str, Any]]]  # global rank -> its log records


def free_port() -> int:
    """A TCP port free right now on loopback (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(state_dir: pathlib.Path) -> dict[str, str]:
    """The test's environment without any launcher's or croupier's variables; the embedded coordinator's store dir."""
    env = {k: v for k, v in os.environ.items() if k not in _LEAKS and not k.startswith(_LEAK_PREFIXES)}
    env.update(CROUPIER_STATE_DIR=str(state_dir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_ranks(envs: list[dict[str, str]], args: list[str], outdir: pathlib.Path, name: str) -> None:
    """Starts one worker process per environment, all at once, and waits until every one has exited 0.

    On a failure or a timeout every process still running is killed (each has a session of its
    own, so `mp.spawn`'s children go with their parent) and the assertion shows their stderr.
    """
    procs: list[subprocess.Popen[bytes]] = []
    errs: list[pathlib.Path] = []
    try:
        for i, env in enumerate(envs):
            err = outdir / f"{name}-p{i}.err"
            errs.append(err)
            with open(outdir / f"{name}-p{i}.out", "wb") as out, open(err, "wb") as e:
                procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdout=out, stderr=e,
                                              start_new_session=True))
        deadline = time.monotonic() + RUN_TIMEOUT
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
                break
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    if codes != [0] * len(procs):
        tails = "\n".join(f"--- process {i} (exit {c}):\n{errs[i].read_text()[-3000:]}" for i, c in enumerate(codes))
        raise AssertionError(f"run {name!r} failed: exit codes {codes}\n{tails}")


def read_run(logdir: pathlib.Path, tag: str, world: int) -> Records:
    """The log records of every process of run `tag`, by global rank; each process must have ended its loop."""
    out: Records = {}
    for g in range(world):
        f = logdir / f"{tag}-g{g}.jsonl"
        assert f.exists(), f"process {g} of run {tag!r} wrote no log"
        out[g] = [json.loads(line) for line in f.read_text().splitlines()]
        assert out[g][0]["kind"] == "meta" and out[g][-1]["kind"] == "end", f"log of process {g} is incomplete"
    assert sorted(out) == list(range(world))
    return out


def by_dp_rank(run: Records, dp: int, tp: int) -> dict[int, list[tuple[int, list[int]]]]:
    """The steps (step number, indices) of each data-parallel rank of a `dp` x `tp` run.

    Checks that each process's sampler resolved the data-parallel world (size `dp`, its rank
    the process's dp coordinate, global rank // tp) and that every process of one
    data-parallel rank received the same indices at every step.
    """
    steps: dict[int, list[tuple[int, list[int]]]] = {}
    for g, recs in sorted(run.items()):
        meta = recs[0]
        assert meta["world"] == dp * tp, meta
        assert (meta["num_replicas"], meta["sampler_rank"], meta["dp_rank"]) == (dp, g // tp, g // tp), meta
        mine = [(r["step"], r["indices"]) for r in recs if r["kind"] == "step"]
        assert [s for s, _ in mine] == list(range(1, len(mine) + 1)), f"process {g} skipped steps"
        first = steps.setdefault(g // tp, mine)
        assert mine == first, f"process {g} received other batches than the first process of dp rank {g // tp}"
    assert sorted(steps) == list(range(dp))
    return steps


def checkpoint_of(run: Records) -> dict[str, Any]:
    """Rank 0's checkpoint state, which every process received; each process's own state must be the same."""
    states = {g: [r for r in recs if r["kind"] == "ckpt"] for g, recs in run.items()}
    assert all(len(s) == 1 and s[0]["step"] == SAVE_AT for s in states.values()), states
    state0 = states[0][0]["rank0"]
    for g, s in states.items():
        assert s[0]["rank0"] == state0, f"process {g} received another state than rank 0's"
        assert s[0]["own"] == state0, f"process {g}'s own state_dict differs from rank 0's: {s[0]['own']} != {state0}"
    assert state0["epoch"] == 0
    return state0


def assert_exactly_once(first: dict[int, list[tuple[int, list[int]]]], second: dict[int, list[tuple[int, list[int]]]],
                        dp2: int) -> None:
    """The first run up to the checkpoint plus all of the second run: every index of the epoch once.

    The first run must have trained past its checkpoint (those steps are lost and dealt again),
    and the second must have run exactly the steps the rest of the epoch makes at its size.
    """
    assert all(s[-1][0] == STOP_AFTER for s in first.values()), "the first run must train past its checkpoint"
    trained = [i for steps in first.values() for step, idx in steps if step <= SAVE_AT for i in idx]
    assert len(trained) == SAVE_AT * BATCH * len(first)
    left_per_rank = (N - len(trained)) // dp2
    trained += [i for steps in second.values() for _, idx in steps for i in idx]
    counts = collections.Counter(trained)
    missing = sorted(set(range(N)) - set(counts))
    repeated = sorted(i for i, c in counts.items() if c > 1)
    assert not missing and not repeated and set(counts) <= set(range(N)), (
        f"missing {missing}, repeated {repeated}, foreign {sorted(set(counts) - set(range(N)))}"
    )
    steps2 = {r: len(s) for r, s in second.items()}
    assert set(steps2.values()) == {-(-left_per_rank // BATCH)}, f"steps of the second run by dp rank: {steps2}"


def assert_ended(run: Records) -> None:
    """Every process's loop ended the epoch: its sampler is at the next epoch."""
    assert all(recs[-1]["epoch"] == 1 for recs in run.values()), {g: recs[-1] for g, recs in run.items()}


def torch_env(base: dict[str, str], world: int, port: int, local: bool = True) -> list[dict[str, str]]:
    """The environments of `world` ranks as torchrun (local=True) or a Kubeflow PyTorchJob (local=False) sets them."""
    envs = []
    for r in range(world):
        env = {**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(r)}
        if local:
            env.update(LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world))
        envs.append(env)
    return envs


def common_args(logdir: pathlib.Path, tag: str, job: str | None) -> list[str]:
    """The worker options every run shares."""
    args = ["--n", str(N), "--batch", str(BATCH), "--seed", "11", "--logdir", str(logdir), "--tag", tag]
    return args + (["--job", job] if job else [])


# ------------------------------------------------------------------ tensor x data parallelism


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["mesh", pytest.param("group", marks=pytest.mark.slow)])  # group: make slow
def test_tp_dp_mesh_resumes_with_another_dp_size(tmp_path: pathlib.Path, layout: str) -> None:
    """2 (dp) x 2 (tp) processes checkpoint; 1 x 2 and then 4 x 1 each resume from that checkpoint.

    ``mesh``: ``device_mesh=init_device_mesh(...), mesh_dim="dp"``; ``group``: ``process_group=``
    a ``dist.new_group`` of the processes with the same tensor-parallel coordinate. Both resumes
    use the first run's coordinator store (a restart from the same checkpoint twice).
    """
    base = base_env(tmp_path / "state")
    job = f"tpdp-{layout}"
    ckpt = tmp_path / "ckpt.json"

    def run(tag: str, dp: int, tp: int, *extra: str) -> dict[int, list[tuple[int, list[int]]]]:
        args = ["--launch", "env", "--layout", layout, "--dp", str(dp), "--tp", str(tp),
                *common_args(tmp_path, tag, job), *extra]
        run_ranks(torch_env(base, dp * tp, free_port()), args, tmp_path, tag)
        records = read_run(tmp_path, tag, dp * tp)
        assert all(recs[0]["job"] == job for recs in records.values())
        if "--load" in extra:
            assert_ended(records)
        else:
            assert checkpoint_of(records) == json.loads(ckpt.read_text())
        return by_dp_rank(records, dp, tp)

    first = run("a", 2, 2, "--save-at", str(SAVE_AT), "--save", str(ckpt), "--stop-after", str(STOP_AFTER))
    # The two data-parallel ranks received different indices (the tensor-parallel peers the same).
    assert not set(first[0][0][1]) & set(first[1][0][1])
    assert_exactly_once(first, run("b", 1, 2, "--load", str(ckpt)), dp2=1)
    assert_exactly_once(first, run("c", 4, 1, "--load", str(ckpt)), dp2=4)


# ------------------------------------------------------------------ launchers


def resume_alone(tmp_path: pathlib.Path, base: dict[str, str], ckpt: pathlib.Path,
                 first: dict[int, list[tuple[int, list[int]]]]) -> None:
    """One plain process (no launcher variables, no process group) loads the state and ends the epoch."""
    run_ranks([base], ["--launch", "solo", *common_args(tmp_path, "solo", None), "--load", str(ckpt)], tmp_path, "solo")
    records = read_run(tmp_path, "solo", 1)
    assert_ended(records)
    assert_exactly_once(first, by_dp_rank(records, 1, 1), dp2=1)


@pytest.mark.e2e
def test_kubeflow_pytorchjob_env_then_resume_alone(tmp_path: pathlib.Path) -> None:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT per process (no torchrun, no LOCAL_*), 2 ranks; resume at world 1."""
    base = {**base_env(tmp_path / "state"), "CROUPIER_JOB": "kubeflow"}
    ckpt = tmp_path / "ckpt.json"
    args = ["--launch", "env", *common_args(tmp_path, "a", None), "--save-at", str(SAVE_AT), "--save", str(ckpt),
            "--stop-after", str(STOP_AFTER)]
    run_ranks(torch_env(base, 2, free_port(), local=False), args, tmp_path, "a")
    records = read_run(tmp_path, "a", 2)
    assert all(recs[0]["job"] == "kubeflow" for recs in records.values())
    assert checkpoint_of(records) == json.loads(ckpt.read_text())
    resume_alone(tmp_path, base, ckpt, by_dp_rank(records, 2, 1))


@pytest.mark.e2e
def test_mp_spawn_then_resume_alone(tmp_path: pathlib.Path) -> None:
    """``torch.multiprocessing.spawn`` of 2 processes that each ``init_process_group("gloo", rank, world_size)``."""
    base = {**base_env(tmp_path / "state"), "CROUPIER_JOB": "spawned"}
    ckpt = tmp_path / "ckpt.json"
    args = ["--launch", "spawn", "--world", "2", "--port", str(free_port()), *common_args(tmp_path, "a", None),
            "--save-at", str(SAVE_AT), "--save", str(ckpt), "--stop-after", str(STOP_AFTER)]
    run_ranks([base], args, tmp_path, "a")
    records = read_run(tmp_path, "a", 2)
    assert checkpoint_of(records) == json.loads(ckpt.read_text())
    resume_alone(tmp_path, base, ckpt, by_dp_rank(records, 2, 1))


@pytest.mark.e2e
def test_slurm_env_with_tcp_process_group(tmp_path: pathlib.Path) -> None:
    """SLURM_NTASKS/SLURM_PROCID only, ``init_method="tcp://..."``: the sampler takes its world from the group."""
    base = {**base_env(tmp_path / "state"), "CROUPIER_JOB": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1"}
    envs = [{**base, "SLURM_NTASKS": "2", "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(2)]
    run_ranks(envs, ["--launch", "slurm", "--port", str(free_port()), *common_args(tmp_path, "a", None)], tmp_path, "a")
    records = read_run(tmp_path, "a", 2)
    assert_ended(records)
    steps = by_dp_rank(records, 2, 1)
    epoch = collections.Counter(i for s in steps.values() for _, idx in s for i in idx)
    assert sorted(epoch) == list(range(N)) and set(epoch.values()) == {1}


# ------------------------------------------------------------------ resolution in this process


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> pytest.MonkeyPatch:
    """No launcher's or croupier's variables, and no process group in this process."""
    for k in list(os.environ):
        if k in _LEAKS or k.startswith(_LEAK_PREFIXES):
            monkeypatch.delenv(k)
    monkeypatch.setenv("CROUPIER_STATE_DIR", str(tmp_path / "state"))
    assert not (dist.is_available() and dist.is_initialized()), "a process group was left in the test process"
    return monkeypatch


@pytest.mark.parametrize("ntasks, procid", [(2, 0), (2, 1), (5, 4)])
def test_slurm_variables_alone_resolve_the_world(bare_env: pytest.MonkeyPatch, ntasks: int, procid: int) -> None:
    bare_env.setenv("SLURM_NTASKS", str(ntasks))
    bare_env.setenv("SLURM_PROCID", str(procid))
    assert resolve_world(None, None) == (ntasks, procid)
    s = DistributedSampler(N, job="slurm-alone")
    assert (s.num_replicas, s.rank) == (ntasks, procid)


def test_torch_variables_win_over_slurm(bare_env: pytest.MonkeyPatch) -> None:
    """A torchrun step inside a SLURM allocation: WORLD_SIZE/RANK name the process, not the allocation's task."""
    bare_env.setenv("SLURM_NTASKS", "1")
    bare_env.setenv("SLURM_PROCID", "0")
    bare_env.setenv("WORLD_SIZE", "4")
    bare_env.setenv("RANK", "3")
    assert resolve_world(None, None) == (4, 3)


@pytest.mark.parametrize("sampler", [DistributedSampler, DistributedBatchSampler])
def test_world_size_without_rank_is_refused(bare_env: pytest.MonkeyPatch, sampler: type) -> None:
    bare_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        resolve_world(None, None)
    extra = (BATCH,) if sampler is DistributedBatchSampler else ()
    early = sampler(N, *extra, job="no-rank")  # resolved when first needed, not when built
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        len(early)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        next(iter(early))
    s = sampler(N, *extra, rank=1, job="no-rank")  # the rank given: the world comes from WORLD_SIZE
    assert (s.num_replicas, s.rank) == (2, 1)


def test_process_group_wins_over_launcher_variables(bare_env: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """An initialised group of one process; SLURM's variables say 2 tasks: the group decides."""
    bare_env.setenv("SLURM_NTASKS", "2")
    bare_env.setenv("SLURM_PROCID", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert resolve_world(None, None) == (1, 0)
        assert resolve_world(None, None, dist.group.WORLD) == (1, 0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["env", "args"])
def test_several_ranks_without_group_or_token_fail_at_first_batch(bare_env: pytest.MonkeyPatch, how: str) -> None:
    """Two ranks, no process group, no CROUPIER_INCARNATION: nothing can name the incarnation; the first batch says so."""
    if how == "env":
        bare_env.setenv("WORLD_SIZE", "2")
        bare_env.setenv("RANK", "1")
        s = DistributedSampler(N, job="lonely")
    else:
        s = DistributedSampler(N, num_replicas=2, rank=0, job="lonely")
    try:
        assert (s.num_replicas, s.rank) == ((2, 1) if how == "env" else (2, 0))  # construction is fine
        with pytest.raises(ValueError, match="init_process_group") as e:
            next(iter(s))
        assert "CROUPIER_INCARNATION" in str(e.value)
    finally:
        s.close()
