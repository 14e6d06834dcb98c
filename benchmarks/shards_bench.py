"""Benchmark: reading parquet shards end to end, beside HF datasets streaming, MosaicML streaming and litdata.

The same rows (an int ``id``, the row's global index, and ~1 kB of text) are read by each system from
local disk and from an S3-API server on loopback (moto's server mode, started here, in a process of its
own that counts the bytes of every GET it answers). Every system runs, per storage:

* a steady epoch on `--ranks` ranks x `--workers` DataLoader workers (torchrun: real processes with the
  torch.distributed environment, gloo);
* the same epoch stopped with a checkpoint at `--stop-at` of it (each system's own state), and resumed on
  `--resume-ranks` ranks with fresh caches (another set of nodes), to the epoch's end.

Measured: samples/s of the steady epoch (rows over the time from the ranks' start of building their
loader to the last rank's last batch); bytes read per epoch relative to the data as that system stores
it (S3: the response bytes of the server's GETs; local disk: the block reads of the ranks and their
workers, ``getrusage(RUSAGE_CHILDREN).ru_inblock``, the sum of ``/proc/<pid>/io`` read_bytes of every
reaped descendant, with the data files dropped from the page cache before each run); the time from a
resumed rank's start of building its loader to its first batch (the slowest rank); duplicates and
missing rows of the resumed epoch, counted by the ids of the rows the ranks received.

Each peer lives in a virtual environment of its own (``--peers-dir``/shards-NAME, made on first use:
torch from constraints.txt, the peer's package; MosaicML streaming gets a stand-in ``torchvision``,
whose real build does not load beside the CPU torch). Peers' formats are written in their own
environments: MDS (``MDSWriter``) and litdata (``litdata.optimize``), one shard per parquet file.

    python benchmarks/shards_bench.py                 # the full run, every peer (results/shards_e2e.md)
    python benchmarks/shards_bench.py --quick         # croupier alone at a tiny scale (tests/benchmarks)
    python benchmarks/shards_bench.py --peers hf      # croupier and one peer
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "shards"
PEERS: dict[str, dict[str, Any]] = {
    "hf": {"title": "HF datasets streaming", "packages": ["datasets==5.2.0", "torchdata==0.11.0", "s3fs"],
           "show": ["datasets", "torchdata"]},
    "mosaic": {"title": "MosaicML streaming", "packages": ["mosaicml-streaming==0.13.0", "pyarrow"],
               "show": ["mosaicml-streaming"]},
    "litdata": {"title": "litdata", "packages": ["litdata==0.2.76", "boto3", "pyarrow"], "show": ["litdata"]},
}
FORMAT = {"croupier": "parquet", "hf": "parquet", "mosaic": "mds", "litdata": "litdata"}
PEER_NOTES = (
    "HF datasets: a resume on another world size raises no error; each new rank takes the state of one old rank, "
    "whose shard list was split for the old world, and the rows of the old ranks 2 and 3 have no rank to go to. "
    "(At 8 shards the same resume raised `IndexError` in `datasets`' `_inner_load_state_dict`: the states' "
    "per-worker shard lists do not fit the new split.)",
    "MosaicML streaming: `import streaming` imports torchvision, whose build does not load beside the CPU torch "
    "(`operator torchvision::nms does not exist`): its environment has a stand-in `torchvision` first on the path. "
    "S3 through its `S3_ENDPOINT_URL`.",
    "litdata: on S3 its chunk prefetch goes through obstore, which refuses an `http://` endpoint (reqwest "
    "`BadScheme`); `storage_options` reach only its boto3 client, so the run adds `allow_http` to its obstore "
    "client options. Its `drop_last` is on under torch.distributed: the last incomplete batches of an epoch "
    "are dropped (the 64 rows missing from its steady epochs too), as its docs say.",
)
WARM = {"croupier": "croupier.client, croupier.data, pyarrow.parquet, s3fs",
        "hf": "datasets, torchdata.stateful_dataloader, s3fs", "mosaic": "streaming", "litdata": "litdata"}
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _log(msg: str) -> None:
    print(f"[shards_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- data


def make_parquet(folder: Path, shards: int, rows: int, text_bytes: int, row_group: int) -> None:
    """`shards` parquet files of `rows` rows: ``id`` (the global index) and ``text`` (random letters and spaces)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    stamp = folder / "_config.json"
    config = {"shards": shards, "rows": rows, "text_bytes": text_bytes, "row_group": row_group}
    if stamp.exists() and json.loads(stamp.read_text()) == config:
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      ", dtype=np.uint8)
    for s in range(shards):
        text = letters[rng.integers(0, len(letters), size=(rows, text_bytes))]
        table = pa.table({"id": pa.array(np.arange(s * rows, (s + 1) * rows), pa.int64()),
                          "text": [r.tobytes().decode() for r in text]})
        pq.write_table(table, folder / f"part-{s:05d}.parquet", row_group_size=row_group)
    stamp.write_text(json.dumps(config))


def _parquet_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.parquet"))


def prepare(kind: str, src: str, dst: str) -> int:
    """Writes the parquet rows of `src` in a peer's format into `dst` (run in the peer's environment)."""
    import pyarrow.parquet as pq

    files = _parquet_files(Path(src))
    out = Path(dst)
    shutil.rmtree(out, ignore_errors=True)
    rows = pq.ParquetFile(files[0]).metadata.num_rows
    if kind == "mosaic":
        from streaming import MDSWriter

        size = max(f.stat().st_size for f in files)
        first = pq.read_table(files[0])
        raw = sum(len(t) for t in first.column("text").to_pylist()) + 64 * rows
        with MDSWriter(out=str(out), columns={"id": "int64", "text": "str"}, size_limit=int(raw * 1.01) + size // 100) as w:
            for f in files:
                for row in pq.read_table(f).to_pylist():
                    w.write(row)
    elif kind == "litdata":
        import litdata

        litdata.optimize(fn=_litdata_rows, inputs=[str(f) for f in files], output_dir=str(out), chunk_size=rows,
                         num_workers=1, mode="overwrite")
    else:
        raise SystemExit(f"unknown format {kind}")
    return 0


def _litdata_rows(path: str) -> Any:
    import pyarrow.parquet as pq

    yield from pq.read_table(path).to_pylist()


def _bytes_of(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.name.startswith("_"))


def _drop_page_cache(folder: Path) -> None:
    """Drops `folder`'s files from the page cache, so that the next reads of them reach the disk."""
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --------------------------------------------------------------------------- the S3-API server


def serve_s3(port_file: str) -> int:
    """moto's S3-API server on a free loopback port, counting the response bytes of every GET
    (``GET /__bytes__`` answers the counts so far); writes its port to `port_file`."""
    import threading

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()
    counts = {"bytes": 0, "gets": 0}

    def counted(result: Any) -> Any:
        try:
            for chunk in result:
                with lock:
                    counts["bytes"] += len(chunk)
                yield chunk
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()

    def wsgi(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == "/__bytes__":
            with lock:
                body = json.dumps(counts).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        result = app(environ, start_response)
        if environ.get("REQUEST_METHOD") != "GET":
            return result
        with lock:
            counts["gets"] += 1
        return counted(result)

    server = make_server("127.0.0.1", 0, wsgi, threaded=True)
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()
    return 0


class S3Server:
    def __init__(self, folder: Path) -> None:
        port_file = folder / "s3.port"
        port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, __file__, "_s3", str(port_file)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the S3-API server did not start")
            time.sleep(0.1)
        self.endpoint = f"http://127.0.0.1:{int(port_file.read_text())}"
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                                   aws_secret_access_key="testing", region_name="us-east-1")
        self.client.create_bucket(Bucket=BUCKET)

    def put(self, folder: Path, prefix: str) -> None:
        for f in sorted(folder.rglob("*")):
            if f.is_file() and not f.name.startswith("_"):  # not the stamp, nor a manifest kept for the local files
                self.client.upload_file(str(f), BUCKET, f"{prefix}/{f.relative_to(folder).as_posix()}")

    def counts(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.endpoint}/__bytes__", timeout=30) as r:
            return dict(json.loads(r.read()))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


# --------------------------------------------------------------------------- peer environments


def ensure_env(name: str, peers_dir: Path) -> Path:
    """The peer's virtual environment (made on first use); its python."""
    env = (peers_dir / f"shards-{name}").resolve()
    py = env / "bin" / "python"
    packages = PEERS[name]["packages"]
    marker = env / ".shards-bench"
    want = json.dumps(packages)
    if marker.exists() and marker.read_text() == want:
        return py
    _log(f"making {env} ({', '.join(packages)})")
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), "torch", *packages],
                   check=True)
    if name == "mosaic":
        # `import streaming` imports torchvision (its vision datasets), whose build does not load beside the CPU
        # torch: a stand-in package, first on the path, with the names streaming imports
        standin = env / "standin" / "torchvision"
        (standin / "transforms").mkdir(parents=True, exist_ok=True)
        (standin / "datasets").mkdir(parents=True, exist_ok=True)
        (standin / "__init__.py").write_text("__version__ = '0.0.0+standin'\n")
        (standin / "transforms" / "__init__.py").write_text("")
        (standin / "transforms" / "functional.py").write_text("def to_tensor(x):\n    raise NotImplementedError\n")
        (standin / "datasets" / "__init__.py").write_text("class VisionDataset:\n    pass\n\n\n"
                                                          "class CIFAR10(VisionDataset):\n    pass\n")
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (Path(site) / "00-shards-bench-standin.pth").write_text(
            f"import sys; sys.path.insert(0, {str(env / 'standin')!r})\n")
    marker.write_text(want)
    return py


def _versions(py: Path, names: list[str]) -> str:
    code = ("import importlib.metadata as m, sys; "
            "print(', '.join(f'{n} {m.version(n)}' for n in sys.argv[1:]))")
    out = subprocess.run([str(py), "-c", code, "torch", *names], capture_output=True, text=True, check=False)
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1]


# --------------------------------------------------------------------------- a rank


def _collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch: its ids, and the text's total length (every row's text is decoded and touched)."""
    return {"id": [int(r["id"]) for r in rows], "chars": sum(len(r["text"]) for r in rows)}


def _rank_main(cfg_json: str) -> int:
    """One rank under torchrun: builds the system's loader, trains one epoch (or up to `stop`), writes what it saw."""
    import torch.distributed as dist

    cfg = json.loads(cfg_json)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(cfg["run_dir"])
    result: dict[str, Any] = {"rank": rank, "world": world}
    try:
        dist.barrier()
        t0 = time.time()
        loader, save = _make_loader(cfg, rank, world)
        built = time.time()  # the loader built: the rest of the wait for the first batch is the loop's
        ids: list[int] = []
        first = None
        steps = 0
        for batch in loader:
            if first is None:
                first = time.time()
            ids += batch["id"]
            steps += 1
            if cfg["stop"] is not None and steps == cfg["stop"]:
                save(steps)
                break
        result.update(t0=t0, built=built, first=first, end=time.time(), steps=steps, ids=ids)
        closer = getattr(loader, "close", None)
        if closer is not None:
            closer()
    except Exception as e:  # noqa: BLE001 - the peer's failure is what the table reports
        import traceback

        result["traceback"] = tb = traceback.format_exc()
        result["error"] = _where(tb) or f"{type(e).__name__}: {e}".splitlines()[0][:300]
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # no barrier: a rank that failed must not hang the others
    os._exit(0)


def _where(tb: str) -> str:
    """A traceback's last line and the function it came from (a DataLoader worker's, when it came from one)."""
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1].strip()
    frames = [line.strip() for line in lines if line.strip().startswith('File "')]
    if not frames:
        return last[:300]
    parts = frames[-1].split('"')
    where = f"{Path(parts[1]).parent.name}/{Path(parts[1]).name}, {parts[2].split(' in ')[-1].strip()}"
    return f"{last[:240]} (in {where})"


def _make_loader(cfg: dict[str, Any], rank: int, world: int) -> tuple[Any, Any]:
    system, storage, b, workers = cfg["system"], cfg["storage"], cfg["batch"], cfg["workers"]
    state_dir, src = Path(cfg["state_dir"]), cfg["source"]
    resume = cfg["resume"]
    cache = cfg["cache_dir"]
    if system == "croupier":
        from torch.utils.data import DataLoader

        from croupier.client import DistributedBatchSampler, Loader
        from croupier.data import ShardedDataset

        opts = ({"key": "testing", "secret": "testing",
                 "client_kwargs": {"endpoint_url": cfg["endpoint"], "region_name": "us-east-1"}}
                if storage == "s3" else None)
        # every run opens the dataset from its folder, as a user would: the first run on the data builds its manifest
        # and keeps it beside the data (docs/data.md), every later one (a resumed job's fresh nodes among them)
        # finds it there in one read after one listing, and reads no footer
        ds = ShardedDataset(src, storage_options=opts, cache_dir=cache)
        batches = DistributedBatchSampler(ds, b, shard_sizes=ds.shard_sizes, reader_group=cfg["reader_group"], seed=0)
        batches.read_ahead = ds.read_ahead  # the sampler's next leases fetched while the current one trains
        loader = Loader(DataLoader(ds, batch_sampler=batches, num_workers=workers, collate_fn=_collate))
        if resume:
            loader.load_state_dict(json.loads((state_dir / "state.json").read_text()))

        def save(step: int) -> None:
            state = loader.state_dict(step=step)
            if rank == 0:
                (state_dir / "state.json").write_text(json.dumps(state))

        class _Closing:
            def __iter__(self) -> Any:
                return iter(loader)

            def close(self) -> None:
                batches.close()

        return _Closing(), save
    if system == "hf":
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node
        from torchdata.stateful_dataloader import StatefulDataLoader

        opts = {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": cfg["endpoint"], "region_name": "us-east-1"}} if storage == "s3" else None
        files = f"{src}/*.parquet"
        ds = load_dataset("parquet", data_files={"train": files}, split="train", streaming=True, storage_options=opts)
        ds = split_dataset_by_node(ds.shuffle(seed=0, buffer_size=1000), rank=rank, world_size=world)
        loader = StatefulDataLoader(ds, batch_size=b, num_workers=workers, collate_fn=_collate)
        if resume:
            # each rank of the new world takes the state of the old rank of its number: the states of the
            # others have no rank to go to
            loader.load_state_dict(_pickle_load(state_dir / f"state{rank}.pkl"))

        def save(step: int) -> None:
            _pickle_dump(loader.state_dict(), state_dir / f"state{rank}.pkl")

        return loader, save
    if system == "mosaic":
        from streaming import StreamingDataLoader, StreamingDataset

        if storage == "s3":
            ds = StreamingDataset(remote=src, local=cache, shuffle=True, shuffle_seed=0, batch_size=b)
        else:
            ds = StreamingDataset(local=src, shuffle=True, shuffle_seed=0, batch_size=b)
        loader = StreamingDataLoader(ds, batch_size=b, num_workers=workers, collate_fn=_collate)
        if resume:
            loader.load_state_dict(json.loads((state_dir / "state.json").read_text()))

        def save(step: int) -> None:
            state = loader.state_dict()
            if rank == 0:
                (state_dir / "state.json").write_text(json.dumps(state))

        return loader, save
    if system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        if storage == "s3":
            # its obstore client (the chunk prefetch) refuses an http:// endpoint unless told to allow it, and
            # `storage_options` reach only its boto3 client
            from litdata.streaming import downloader

            downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}  # type: ignore[assignment]
            ds = StreamingDataset(src, cache_dir=cache, shuffle=True, seed=0,
                                  storage_options={"endpoint_url": cfg["endpoint"]})
        else:
            ds = StreamingDataset(src, shuffle=True, seed=0)
        loader = StreamingDataLoader(ds, batch_size=b, num_workers=workers, collate_fn=_collate)
        if resume:
            loader.load_state_dict(_pickle_load(state_dir / f"state{rank}.pkl"))

        def save(step: int) -> None:
            _pickle_dump(loader.state_dict(), state_dir / f"state{rank}.pkl")

        return loader, save
    raise ValueError(system)


def _pickle_dump(obj: Any, path: Path) -> None:
    import pickle

    path.write_bytes(pickle.dumps(obj))


def _pickle_load(path: Path) -> Any:
    import pickle

    return pickle.loads(path.read_bytes())


# --------------------------------------------------------------------------- a phase


def run_phase(py: Path, cfg: dict[str, Any], ranks: int, data: Path | None, s3: S3Server | None,
              timeout: float) -> dict[str, Any]:
    """One torchrun of `ranks` ranks; the ranks' results, the bytes read, the wall time."""
    run_dir = Path(cfg["run_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    shutil.rmtree(cfg["cache_dir"], ignore_errors=True)  # fresh nodes: nothing cached
    Path(cfg["cache_dir"]).mkdir(parents=True)
    env = {**os.environ, **CREDENTIALS, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    if s3 is not None:
        env.update(S3_ENDPOINT_URL=s3.endpoint, AWS_ENDPOINT_URL=s3.endpoint)
    for var in ("CROUPIER_ADDRESS", "CROUPIER_JOB", "CROUPIER_INCARNATION"):
        env.pop(var, None)
    if data is not None:
        _drop_page_cache(data)
    before_blocks = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    before_s3 = s3.counts() if s3 is not None else None
    t = time.time()
    cmd = [str(py), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), __file__, "_rank",
           json.dumps(cfg)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        log += f"\n(timed out after {timeout:.0f} s)"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    wall = time.time() - t
    read = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - before_blocks) * 512
    if s3 is not None and before_s3 is not None:
        after = s3.counts()
        read, gets = after["bytes"] - before_s3["bytes"], after["gets"] - before_s3["gets"]
    else:
        gets = 0
    results = [json.loads(f.read_text()) for f in sorted(run_dir.glob("rank*.json"))]
    errors = [r["error"] for r in results if "error" in r]
    if len(results) < ranks and not errors:
        errors.append("ranks ended without a result: " + " / ".join(log.strip().splitlines()[-3:])[:300])
    (run_dir / "torchrun.log").write_text(log)
    return {"results": results, "errors": errors, "bytes": read, "gets": gets, "wall": wall}


def _ids(phase: dict[str, Any]) -> list[int]:
    return [i for r in phase["results"] for i in r.get("ids", [])]


def dup_missing(ids: list[int], n: int) -> tuple[int, int]:
    counts = collections.Counter(ids)
    dups = sum(c - 1 for c in counts.values() if c > 1)
    missing = n - sum(1 for i in counts if 0 <= i < n)
    return dups, missing


def run_system(system: str, py: Path, storage: str, source: str, data_bytes: int, local_data: Path | None,
               s3: S3Server | None, a: argparse.Namespace, n: int, work: Path) -> dict[str, Any]:
    """Steady epoch, then the stopped epoch and its resume, for one system on one storage."""
    name = f"{system}-{storage}"
    steps_per_epoch = n // (a.ranks * a.batch)
    stop = max(1, int(a.stop_at * steps_per_epoch))
    base = {"system": system, "storage": storage, "source": source, "batch": a.batch, "workers": a.workers,
            "endpoint": s3.endpoint if s3 else None, "reader_group": a.reader_group,
            "state_dir": str(work / "state" / name), "resume": False, "stop": None}
    shutil.rmtree(base["state_dir"], ignore_errors=True)
    Path(base["state_dir"]).mkdir(parents=True)
    row: dict[str, Any] = {"system": system, "storage": storage, "data_bytes": data_bytes, "stop": stop, "notes": []}

    def cfg(phase: str, **kw: Any) -> dict[str, Any]:
        return {**base, "run_dir": str(work / "runs" / name / phase), "cache_dir": str(work / "cache" / name), **kw}

    # the system's modules from the page cache, so that a run's block reads are its data's
    subprocess.run([str(py), "-c", f"import torch.distributed.run, {WARM[system]}"], check=False, capture_output=True)
    _log(f"{name}: steady epoch on {a.ranks} ranks")
    steady = run_phase(py, cfg("steady"), a.ranks, local_data, s3, a.timeout)
    if steady["errors"]:
        row["steady_error"] = steady["errors"][0]
    else:
        rs = steady["results"]
        got = _ids(steady)
        row["samples_per_s"] = len(got) / (max(r["end"] for r in rs) - min(r["t0"] for r in rs))
        row["steady_bytes"] = steady["bytes"]
        row["steady_dup_missing"] = dup_missing(got, n)
    _log(f"{name}: epoch stopped at step {stop} of {steps_per_epoch} on {a.ranks} ranks")
    first = run_phase(py, cfg("first", stop=stop), a.ranks, local_data, s3, a.timeout)
    if first["errors"]:
        row["resume_error"] = "before the stop: " + first["errors"][0]
        return row
    _log(f"{name}: resume on {a.resume_ranks} ranks")
    second = run_phase(py, cfg("resume", resume=True), a.resume_ranks, local_data, s3, a.timeout)
    if second["errors"]:
        row["resume_error"] = second["errors"][0]
        return row
    row["resume_bytes"] = first["bytes"] + second["bytes"]
    row["resume_first_batch_s"] = max(r["first"] - r["t0"] for r in second["results"] if r["first"] is not None) \
        if any(r["first"] is not None for r in second["results"]) else None
    row["resume_dup_missing"] = dup_missing(_ids(first) + _ids(second), n)
    row["resume_rows"] = (len(_ids(first)), len(_ids(second)))
    return row


# --------------------------------------------------------------------------- the table


def _mb(x: float) -> str:
    return f"{x / 2**20:,.1f} MiB"


def _ratio(read: int, data: int) -> str:
    return f"{read / data:.3f}x ({_mb(read)})"


def render(rows: list[dict[str, Any]], a: argparse.Namespace, n: int, sizes: dict[str, int], versions: dict[str, str],
           skipped: dict[str, str], took: float, command: str, load: tuple[float, float]) -> str:
    titles = {"croupier": "croupier", **{k: v["title"] for k, v in PEERS.items()}}
    storage_name = {"local": "local disk", "s3": "S3 on loopback (moto)"}
    lines = [
        "# Shards end to end: croupier beside HF datasets streaming, MosaicML streaming and litdata",
        "",
        f"Scale: {a.shards} parquet shards x {a.rows:,} rows = {n:,} rows of {a.text_bytes:,} bytes of text and an "
        f"int `id` (the row's global index), row groups of {a.row_group} rows; {a.ranks} ranks x {a.workers} DataLoader "
        f"workers (torchrun, gloo), batch {a.batch} per rank; one epoch; the stopped run ends at step "
        f"{rows[0]['stop'] if rows else '?'} of {n // (a.ranks * a.batch)} ({a.stop_at:.0%}) with each system's checkpoint "
        f"and resumes on {a.resume_ranks} ranks with empty caches. croupier: shard-local order, `reader_group="
        f"{a.reader_group}`, its defaults otherwise.",
        "",
        "Data as each system stores it: " + ", ".join(f"{k} {_mb(v)}" for k, v in sizes.items()) + ".",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"command: `{command}`; took {took / 60:.1f} min; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
        "(the cores are shared: other work ran beside this run).",
        "",
        "| system | storage | samples/s (steady epoch) | bytes read / data, steady epoch | bytes read / data, "
        "stop + resume | first batch after resume | duplicates / missing, resumed epoch (steady) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        data = r["data_bytes"]
        sps = f"{r['samples_per_s']:,.0f}" if "samples_per_s" in r else f"could not run: {r.get('steady_error')}"
        steady = _ratio(r["steady_bytes"], data) if "steady_bytes" in r else "-"
        if "resume_bytes" in r:
            res = _ratio(r["resume_bytes"], data)
            fb = f"{r['resume_first_batch_s']:.2f} s" if r["resume_first_batch_s"] is not None else "no batch"
            d, m = r["resume_dup_missing"]
            dm = f"{d:,} / {m:,}"
        else:
            res = fb = "-"
            dm = f"could not resume: {r.get('resume_error')}"
        if "steady_dup_missing" in r:
            dm += " ({:,} / {:,})".format(*r["steady_dup_missing"])
        lines.append(f"| {titles[r['system']]} | {storage_name[r['storage']]} | {sps} | {steady} | {res} | {fb} | {dm} |")
    for name, why in skipped.items():
        lines.append(f"| {titles[name]} | - | not run: {why} | | | | |")
    lines += ["", "Versions: " + "; ".join(f"{k}: {v}" for k, v in versions.items()) + ".", ""]
    lines += _targets(rows)
    lines += [
        "",
        "## Method",
        "",
        "- **samples/s**: rows received by all ranks in the steady epoch over the time from the earliest rank's start "
        "of building its dataset and loader (after `init_process_group`) to the last rank's last batch. Each batch is "
        "collated to its ids and its text's total length (every row decoded); no model.",
        "- **bytes read**: S3: the response bytes of every GET the server answered during the run (a WSGI layer "
        "around moto's server counts them: footers, ranges and whole objects alike). Local disk: the block reads "
        "of the ranks and their DataLoader workers, `getrusage(RUSAGE_CHILDREN).ru_inblock` x 512 around the "
        "torchrun, which the kernel sums from `/proc/<pid>/io` read_bytes of every reaped descendant; the data "
        "files are dropped from the page cache (`posix_fadvise(DONTNEED)`) before each run, so a run counts what the "
        "node fetched from disk (reads of one shard by several ranks of the node while it stays in the page "
        "cache count once). Relative to the data as that system stores it (MDS and litdata chunks are not "
        "compressed; parquet is, with snappy).",
        "- **stop + resume**: the bytes of the stopped run and of the resume, over the data. Each run starts with "
        "empty caches, as on new nodes.",
        "- **first batch after resume**: per resumed rank, from its start of building its dataset and loader "
        "(loading the checkpoint included) to its first batch; the slowest rank.",
        "- **duplicates / missing**: over the ids of the rows received before the stop and after the resume "
        "(in parentheses: the steady epoch's), a duplicate is a receipt of an id beyond its first, a missing id "
        "one of the epoch's that no rank received.",
        "- HF datasets: `load_dataset('parquet', streaming=True)`, `.shuffle(seed=0, buffer_size=1000)`, "
        "`split_dataset_by_node`, torchdata `StatefulDataLoader`, a state per rank; on the resume each rank loads the "
        "state of the old rank of its number (the old ranks 2 and 3 have no rank to go to). MosaicML: "
        "`StreamingDataset(shuffle=True)` + `StreamingDataLoader`, rank 0's state loaded by every rank. litdata: "
        "`StreamingDataset(shuffle=True)` + `StreamingDataLoader`, a state per rank loaded as HF's.",
    ]
    lines += ["", "## Peers: what they needed here", ""] + [f"- {note}" for note in PEER_NOTES]
    return "\n".join(lines) + "\n"


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    out = ["## Targets", ""]
    mine = {r["storage"]: r for r in rows if r["system"] == "croupier"}
    peers = [r for r in rows if r["system"] != "croupier"]

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    for storage, label, fb_limit in (("local", "local disk", 1.0), ("s3", "loopback S3", 2.0)):
        r = mine.get(storage)
        if r is None:
            continue
        ps = [p for p in peers if p["storage"] == storage and "samples_per_s" in p]
        if "samples_per_s" in r and ps:
            best = max(ps, key=lambda p: p["samples_per_s"])
            ratio = r["samples_per_s"] / best["samples_per_s"]
            out.append(f"- throughput >= 1.0x the best peer, {label}: {r['samples_per_s']:,.0f}/s beside "
                       f"{best['samples_per_s']:,.0f}/s ({PEERS[best['system']]['title']}): {ratio:.2f}x, "
                       f"{verdict(ratio >= 1.0)}")
        elif "samples_per_s" in r:
            out.append(f"- throughput >= 1.0x the best peer, {label}: {r['samples_per_s']:,.0f}/s; no peer ran here")
        if "steady_bytes" in r:
            x = r["steady_bytes"] / r["data_bytes"]
            out.append(f"- bytes read per steady epoch <= 1.05x the dataset, {label}: {x:.3f}x, {verdict(x <= 1.05)}")
        if "resume_bytes" in r:
            x = r["resume_bytes"] / r["data_bytes"]
            out.append(f"- bytes read with the stop and resume <= 1.25x, {label}: {x:.3f}x, {verdict(x <= 1.25)}")
            fb = r["resume_first_batch_s"]
            out.append(f"- first batch after resume <= {fb_limit:.0f} s, {label}: "
                       + (f"{fb:.2f} s, {verdict(fb <= fb_limit)}" if fb is not None else "no batch, **missed**"))
        counts = [r[k] for k in ("steady_dup_missing", "resume_dup_missing") if k in r]
        if counts:
            ok = all(d == 0 and m == 0 for d, m in counts) and "resume_dup_missing" in r
            shown = ", ".join(f"{d} / {m}" for d, m in counts)
            out.append(f"- 0 duplicates / 0 missing, {label} (steady, resumed): {shown}, {verdict(ok)}")
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"]:
        return _rank_main(argv[1])
    if argv[:1] == ["_s3"]:
        return serve_s3(argv[1])
    if argv[:1] == ["_prepare"]:
        return prepare(argv[1], argv[2], argv[3])
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="croupier alone, tiny shards on local disk, 2 ranks resumed on 1 (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "shards_bench", help="data, runs and the table")
    ap.add_argument("--results", type=Path, default=None, help="also write the table here")
    ap.add_argument("--peers", default="hf,mosaic,litdata", help="comma-separated peers, or 'none'")
    ap.add_argument("--peers-dir", type=Path, default=ROOT / "out" / "peers")
    ap.add_argument("--storages", default="local,s3")
    ap.add_argument("--shards", type=int, default=200)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--text-bytes", type=int, default=1000)
    ap.add_argument("--row-group", type=int, default=500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--resume-ranks", type=int, default=2)
    ap.add_argument("--reader-group", type=int, default=2)
    ap.add_argument("--stop-at", type=float, default=0.4)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds a run may take before it is killed")
    a = ap.parse_args(argv)
    if a.quick:
        a.shards, a.rows, a.text_bytes, a.row_group, a.batch, a.peers = 8, 200, 200, 50, 16, "none"
        a.storages, a.ranks, a.resume_ranks, a.workers = "local", 2, 1, 1
        a.out = a.out.with_name(a.out.name + "_quick") if a.out == ROOT / "out" / "shards_bench" else a.out
        a.timeout = min(a.timeout, 120.0)
    started = time.time()
    load_start = os.getloadavg()[0]
    peers = [p for p in a.peers.split(",") if p and p != "none"]
    storages = [s for s in a.storages.split(",") if s]
    n = a.shards * a.rows
    work = a.out.resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the clean-up below: the server, a torchrun
    work.mkdir(parents=True, exist_ok=True)
    parquet = work / "data" / "parquet"
    _log(f"data: {a.shards} shards x {a.rows} rows")
    make_parquet(parquet, a.shards, a.rows, a.text_bytes, a.row_group)
    folders = {"parquet": parquet}
    pys: dict[str, Path] = {"croupier": Path(sys.executable)}
    versions = {"croupier": _versions(Path(sys.executable), ["pyarrow", "fsspec", "s3fs"])}
    skipped: dict[str, str] = {}
    for p in peers:
        try:
            pys[p] = ensure_env(p, a.peers_dir)
            versions[PEERS[p]["title"]] = _versions(pys[p], PEERS[p]["show"])
            fmt = FORMAT[p]
            if fmt != "parquet" and fmt not in folders:
                dst = work / "data" / fmt
                stamp = dst / "_config.json"
                config = (parquet / "_config.json").read_text()
                if not (stamp.exists() and stamp.read_text() == config):
                    _log(f"writing the rows as {fmt}")
                    subprocess.run([str(pys[p]), __file__, "_prepare", p, str(parquet), str(dst)], check=True)
                    stamp.write_text(config)
                folders[fmt] = dst
        except subprocess.CalledProcessError as e:
            skipped[p] = f"its environment or format could not be made ({e})"
            pys.pop(p, None)
    sizes = {fmt: _bytes_of(folder) for fmt, folder in folders.items()}
    s3 = None
    if "s3" in storages:
        s3 = S3Server(work)
        for fmt, folder in folders.items():
            s3.put(folder, fmt)
    # the files just written reach the disk before any run: writeback must not slow the first system's reads
    os.sync()
    rows: list[dict[str, Any]] = []
    try:
        for storage in storages:
            for system in ["croupier", *[p for p in peers if p in pys]]:
                fmt = FORMAT[system]
                source = f"s3://{BUCKET}/{fmt}" if storage == "s3" else str(folders[fmt])
                t = time.time()
                row = run_system(system, pys[system], storage, source, sizes[fmt],
                                 folders[fmt] if storage == "local" else None, s3 if storage == "s3" else None,
                                 a, n, work)
                _log(f"{system} on {storage}: {time.time() - t:.0f} s: " +
                     json.dumps({k: v for k, v in row.items() if k not in ("notes",)}))
                rows.append(row)
    finally:
        if s3 is not None:
            s3.stop()
    command = "python benchmarks/shards_bench.py " + " ".join(argv)
    text = render(rows, a, n, {f"{k}": v for k, v in sizes.items()}, versions, skipped, time.time() - started,
                  command.strip(), (load_start, os.getloadavg()[0]))
    (work / "shards_e2e.md").write_text(text)
    if a.results is not None:
        a.results.parent.mkdir(parents=True, exist_ok=True)
        a.results.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
