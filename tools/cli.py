"""The `croupier` command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from croupier.core import settings
from croupier.core.checks import check_int
from croupier.core.order import fixed_plan, fresh
from croupier.core.spec import PARTITIONS, PERMUTATIONS, TAILS, Spec
from croupier.server import ServerOptions, StoreError
from croupier.tools import data as data_tool
from croupier.tools.provenance import SHOWN
from croupier.tools.status import DEFAULT_WATCH_S, watch_seconds


def _order_cmd(args: argparse.Namespace) -> int:
    spec = Spec(
        n=args.n,
        seed=args.seed,
        permutation=args.permutation,
        partition=args.partition,
        tail=args.tail,
        batch_size=args.batch_size,
    )
    p = fixed_plan(spec, fresh(spec, args.epoch), args.world)
    np.set_printoptions(threshold=64, linewidth=120)
    print(f"spec {spec.fingerprint}: {spec.describe()}")
    print(f"epoch {args.epoch}, world {args.world}: rank {args.rank} gets {p.samples(args.rank)} indices")
    for j in range(args.batches):
        b = p.batch_indices(args.rank, j)
        if b is None:
            print(f"batch {j}: (end of epoch)")
            break
        print(f"batch {j}: {b}")
    return 0


def _serve_cmd(args: argparse.Namespace) -> int:
    from croupier.server import configure_logging, serve

    try:
        options = ServerOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions)})
    except ValueError as e:
        print(f"croupier serve: error: {e}", file=sys.stderr)
        return 2
    configure_logging(options.log_format, logging.INFO if args.verbose else logging.WARNING)
    return serve(args.host, args.port, args.store, grace=args.grace, options=options)


def _audit_cmd(args: argparse.Namespace) -> int:
    from croupier.tools.audit import audit, by_source, render, render_sources, verdict

    if not args.by_step and (args.logdir is None or args.address is not None or args.job):
        raise ValueError("croupier audit takes LOGDIR; --address and --job go with --by-step (without LOGDIR it "
                         "audits the coordinator's ledger alone)")
    ok = True
    try:
        if args.logdir is not None:
            reports = audit(args.logdir)  # every kind of job (``croupier.tools.audit_log``: one reader)
            print(render(reports))
            for job in sorted({r.job for r in reports if r.sources}):
                print(f"\n{job}: by source and source epoch")
                print(render_sources(by_source(r for r in reports if r.job == job)))
            fine, summary = verdict(reports, allow_unfinished=args.allow_unfinished, allow_cut=args.allow_cut)
            ok = fine and ok
            print(f"\n{summary}\n" if args.by_step else f"\n{summary}")
        if args.by_step:
            from croupier.tools.audit_steps import main as by_step

            ok = by_step(args.address, args.logdir, args.job or (), allow_unfinished=args.allow_unfinished) and ok
    except FileNotFoundError as e:
        print(f"croupier: error: {e}", file=sys.stderr)
        return 2
    return 0 if ok else 1


def _demo_cmd(args: argparse.Namespace) -> int:
    from croupier.demos.demo import main as demo

    return demo(args.workdir, n=args.n, epochs=args.epochs, coordinator=args.coordinator)


def _chaos_cmd(args: argparse.Namespace) -> int:
    from croupier.harness.chaos import main as chaos

    # NOTE: no database control from the command line: it cannot restart a server it does not own.
    return chaos(args.workdir, faults=args.faults, epochs=args.epochs, n=args.n, seed=args.seed, store=args.store,
                 replicas=args.replicas, batching=args.batching, mixture=args.mixture, datacenter=args.datacenter,
                 step_ms=args.step_ms)


def _infer_demo_cmd(args: argparse.Namespace) -> int:
    from croupier.demos.infer_demo import run as infer_demo

    return infer_demo(args.workdir, n=args.n, batch=args.batch_size, faults=args.faults, seed=args.seed,
                      batch_ms=args.batch_ms, world=args.world)


def _status_cmd(args: argparse.Namespace) -> int:
    from croupier.tools.status import main as status

    return status(args.address, args.job, args.watch, limit=check_int("--limit", args.limit, 1), after=args.after)


def _amend_cmd(args: argparse.Namespace) -> int:
    from croupier.tools.amend import main as amend

    if args.kind == "skip":
        if not args.indices and args.from_file is None:
            raise ValueError("croupier skip needs the indices to skip: INDEX ... or --from FILE")
        return amend(args.address, args.job, "skip", args.indices, from_file=args.from_file)
    if (args.weights is None) == (args.grow is None):
        raise ValueError("croupier amend takes one change: --weights W,W,... or --grow SOURCE SIZE")
    if args.weights is not None:
        return amend(args.address, args.job, "weights", [args.weights])
    return amend(args.address, args.job, "grow", args.grow)


def _provenance_cmd(args: argparse.Namespace) -> int:
    from croupier.tools.provenance import main as provenance

    return provenance(args.address, args.job, step=args.step, steps=args.steps, index=args.index, source=args.source,
                      as_json=args.json, full=args.full, export_to=args.export, logdir=args.logdir)


def _health_cmd(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from croupier.client import CHANNEL_OPTIONS, Security

    try:
        channel = Security.from_env().channel(args.address, CHANNEL_OPTIONS)
    except (OSError, ValueError) as e:
        print(f"croupier health: error: {e}", file=sys.stderr)
        return 2
    with channel:
        try:
            stub: Any = health_pb2_grpc.HealthStub(channel)  # the stub's methods are set at run time
            r = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"croupier health: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    print(status)
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


def _add_serve(sub: Any) -> None:
    """`croupier serve`: a coordinator and every setting of ServerOptions."""
    s = sub.add_parser("serve", help="run a coordinator (first line on stdout: 'listening on HOST:PORT')")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one (default 50051)")
    # NOTE: the store's URL may carry a password: $CROUPIER_STORE keeps it out of the command line
    # (and out of a pod spec's args; a Kubernetes Secret fills the variable).
    s.add_argument("--store", default=settings.get("CROUPIER_STORE"),
                   help="memory://, sqlite:///relative.db, sqlite:////absolute.db or "
                        "postgresql://USER:PASSWORD@HOST:PORT/DB (shared by several replicas) "
                        "(default $CROUPIER_STORE, else sqlite:///croupier.db)")
    s.add_argument("--grace", type=float, default=5.0, help="seconds in-flight calls get on SIGTERM (default 5)")
    s.add_argument("-v", "--verbose", action="store_true", help="log at INFO level on stderr")
    # NOTE: every default below is ServerOptions' own (`opt`), so that it is written once.
    opt = ServerOptions()
    s.add_argument("--log-format", default=opt.log_format, metavar="{text,json}",
                   help=f"stderr log lines as text or as JSON objects carrying job, generation and rank "
                        f"(default {opt.log_format})")
    s.add_argument("--tls-cert", default=opt.tls_cert, help="PEM certificate chain: serve TLS only (with --tls-key)")
    s.add_argument("--tls-key", default=opt.tls_key, help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", default=opt.tls_client_ca,
                   help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    s.add_argument("--auth-file", default=opt.auth_file,
                   help="credentials file: every call needs a credential for its job and role (reloaded on SIGHUP "
                        "and on change)")
    s.add_argument("--max-jobs", type=int, default=opt.max_jobs, help=f"jobs held at most (default {opt.max_jobs})")
    s.add_argument("--max-world", type=int, default=opt.max_world,
                   help=f"largest world size a join may name (default {opt.max_world})")
    s.add_argument("--max-request-bytes", type=int, default=opt.max_request_bytes,
                   help=f"largest request accepted, in bytes (default {opt.max_request_bytes})")
    s.add_argument("--max-concurrent-joins", type=int, default=opt.max_concurrent_joins,
                   help=f"joins waiting at once for their generation's other ranks (default {opt.max_concurrent_joins}; "
                        "a waiting join holds no thread)")
    s.add_argument("--max-calls", type=int, default=opt.max_calls,
                   help=f"calls in progress at once, all jobs together; one more is refused at once with a retry hint "
                        f"(default {opt.max_calls})")
    s.add_argument("--max-job-calls", type=int, default=opt.max_job_calls,
                   help=f"calls of one job in progress at once (default {opt.max_job_calls})")
    s.add_argument("--metrics-port", type=int, default=opt.metrics_port,
                   help="serve /metrics (Prometheus) and the status page over HTTP on this port (default: off)")
    s.add_argument("--metrics-host", default=opt.metrics_host,
                   help=f"interface of the metrics port (default {opt.metrics_host})")
    s.add_argument("--snapshot-every", type=int, default=opt.snapshot_every,
                   help="journal records between two snapshots of the state: recovery replays at most this many "
                        f"(default {opt.snapshot_every})")
    s.add_argument("--max-staleness-ms", type=int, default=opt.max_staleness_ms,
                   help="replicas on PostgreSQL: answer grants from what the replica knows while it confirmed the "
                        "journal's end within this many ms (it listens for appends); 0 asks the database on every "
                        f"grant (default {opt.max_staleness_ms})")
    s.set_defaults(func=_serve_cmd)


def _add_health(sub: Any) -> None:
    """`croupier health`: a probe of a coordinator's health service."""
    h = sub.add_parser("health", help="check a coordinator's health service (for probes); TLS settings from "
                                      "CROUPIER_TLS_CA, CROUPIER_TLS_CERT, CROUPIER_TLS_KEY; exit 0 when SERVING")
    h.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT (default 127.0.0.1:50051)")
    h.add_argument("--service", default="croupier.v1.Coordinator", help="service to check ('' for the server)")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    h.set_defaults(func=_health_cmd)


def _add_demo(sub: Any) -> None:
    """`croupier demo`: the elastic job of croupier.demos.demo."""
    d = sub.add_parser("demo", help="the main job: an elastic job on several torchrun nodes, resized in place and preempted, "
                                   "then audited")
    d.add_argument("--workdir", default="out/demo", help="where checkpoints, logs and the audit log go (default out/demo)")
    d.add_argument("--n", type=int, default=6000, help="samples in the synthetic dataset (default 6000)")
    d.add_argument("--epochs", type=int, default=5, help="epochs (default 5)")
    d.add_argument("--coordinator", choices=("embedded", "standalone"), default="embedded",
                   help="rank 0 of each world hosts the coordinator (default), or one `croupier serve` process")
    d.set_defaults(func=_demo_cmd)


def _add_chaos(sub: Any) -> None:
    """`croupier chaos`: the harness's faults (croupier.harness.chaos)."""
    c = sub.add_parser("chaos", help="the demo's trainer under random kills of ranks and of a standalone coordinator, "
                                     "rollbacks and resizes 1-4, audited after every launch")
    c.add_argument("--workdir", default="out/chaos",
                   help="where the store, checkpoints, logs and audit log go (default out/chaos)")
    c.add_argument("--faults", type=int, default=100, help="kills to inject: ranks, coordinator, whole job (default 100)")
    c.add_argument("--epochs", type=int, default=6, help="epochs (default 6)")
    c.add_argument("--n", type=int, default=3600, help="samples, best a multiple of 12 (default 3600)")
    c.add_argument("--seed", type=int, default=None, help="seed of the random choices (default: random, printed)")
    c.add_argument("--store", default=None,
                   help="postgresql://... URL of an empty database: run --replicas croupier serve replicas on it, kill "
                        "them instead of the coordinator, and check the journal's history at the end (default: one "
                        "coordinator on a sqlite store in the workdir)")
    c.add_argument("--replicas", type=int, default=1,
                   help="replicas on --store, or with --datacenter on a PostgreSQL server the run starts (default 1)")
    c.add_argument("--batching", choices=("fixed", "tokens", "dynamic"), default="fixed",
                   help="fixed batches (default), token-budget batches, or batches dealt dynamically (DDP's Join)")
    c.add_argument("--mixture", action="store_true",
                   help="deal the samples as a mixture of 3 sources, weights changed halfway, one capped; audited by "
                        "source epoch (with --batching fixed)")
    c.add_argument("--step-ms", type=int, default=40,
                   help="simulated compute per training step, ms (default 40; longer leaves more steps for faults)")
    c.add_argument("--datacenter", action="store_true",
                   help="also stop (SIGSTOP) the coordinator and workers for a while, jump the coordinator's wall clock "
                        "an hour, fill its store's file system, and cut or slow (200 ms, 10%% loss) the network between "
                        "the job and the coordinator, each on a host (network namespace) of its own (root, "
                        "libfaketime); with --replicas K (no --store): a PostgreSQL server of the run's own, the K "
                        "replicas and the job each on a host of its own, with replica kills and pauses, PostgreSQL "
                        "restarts, a replica cut from the database or the job, or its link to either slowed (200 ms, "
                        "1%% loss to the database, 10%% to the job), instead of the clock and disk faults (root, "
                        "PostgreSQL's server binaries)")
    c.set_defaults(func=_chaos_cmd)


def _add_infer_demo(sub: Any) -> None:
    """`croupier infer-demo`: the inference demo of croupier.demos.infer_demo."""
    f = sub.add_parser("infer-demo", help="exactly-once batch inference on preemptible workers (dynamic dealing) under "
                                          "worker kills, resizes and coordinator kills, audited against the journal")
    f.add_argument("--workdir", default="out/infer-demo",
                   help="where the store, the outputs and the logs go (default out/infer-demo)")
    f.add_argument("--n", type=int, default=20_000, help="samples in the dataset (default 20000)")
    f.add_argument("--batch-size", type=int, default=16, help="samples per batch (default 16)")
    f.add_argument("--faults", type=int, default=8, help="faults to inject: worker kills, added and removed workers, "
                                                         "coordinator kills (default 8)")
    f.add_argument("--seed", type=int, default=None, help="seed of the random choices (default: random, printed)")
    f.add_argument("--world", type=int, default=2, help="workers of the first launch, 1-4 (default 2)")
    f.add_argument("--batch-ms", type=float, default=5.0, help="simulated model time per batch, in ms (default 5)")
    f.set_defaults(func=_infer_demo_cmd)


def _add_status(sub: Any) -> None:
    """`croupier status`: the jobs a coordinator holds, or one job's ranks."""
    t = sub.add_parser("status", help="every job a coordinator holds (progress, slowest rank), or one job's ranks "
                                      "and checkpoints")
    t.add_argument("job", nargs="?", metavar="JOB", help="show this job's ranks and checkpoints")
    t.add_argument("--address", help="HOST:PORT of the coordinator (default $CROUPIER_ADDRESS, else 127.0.0.1:50051)")
    t.add_argument("--watch", nargs="?", type=watch_seconds, const=DEFAULT_WATCH_S, metavar="SECONDS",
                   help=f"redraw every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C; put it after JOB")
    t.add_argument("--limit", type=int, default=50, help="jobs the table of every job shows, by name (default 50)")
    t.add_argument("--after", default="", metavar="NAME", help="the table of every job starts after this job")
    t.set_defaults(func=_status_cmd)


def _add_provenance(sub: Any) -> None:
    """`croupier provenance`: what a job's steps trained."""
    v = sub.add_parser("provenance", help="what a job's training steps trained (kept and abandoned versions), where a "
                                          "sample was trained, or the run as an order file (docs/provenance.md)")
    v.add_argument("job", metavar="JOB")
    v.add_argument("--step", type=int, metavar="T", help="the samples of step T (steps count from 1)")
    v.add_argument("--steps", metavar="A:B", help="the samples of steps A to B, both included (A: to the last step)")
    v.add_argument("--index", type=int, metavar="I", help="every (epoch, step, rank, generation) that trained index I")
    v.add_argument("--source", type=int, metavar="S", help="with --index: I is numbered within source S of a mixture")
    v.add_argument("--json", action="store_true", help="print the answer as JSON (what `croupier skip --from` reads)")
    v.add_argument("--full", action="store_true",
                   help=f"print every sample of a step (default: the first {SHOWN} of each version)")
    v.add_argument("--export", metavar="FILE.npy",
                   help="write the kept timeline's steps as an OLMo-style global_indices.npy (batch N = step N + 1); "
                        "a run whose global batch is constant only")
    v.add_argument("--logdir", metavar="LOGDIR",
                   help="with --index: also the epochs in which I was filtered out, from the job's audit logs under "
                        "LOGDIR (default $CROUPIER_AUDIT_DIR when set)")
    v.add_argument("--address", help="HOST:PORT of the coordinator (default $CROUPIER_ADDRESS, else 127.0.0.1:50051)")
    v.set_defaults(func=_provenance_cmd)


def _add_amend(sub: Any) -> None:
    """`croupier amend`: a change of a running mixture's weights or sizes."""
    m = sub.add_parser("amend", help="record a change of a running mixture: new weights, or a source grown; it holds "
                                     "from the job's next generation (docs/mixtures.md)")
    m.add_argument("job", metavar="JOB")
    m.add_argument("--weights", metavar="W,W,...", help="one weight per source (any positive scale)")
    m.add_argument("--grow", nargs=2, metavar=("SOURCE", "SIZE"), help="source SOURCE has SIZE samples now")
    m.add_argument("--address", help="HOST:PORT of the coordinator (default $CROUPIER_ADDRESS, else 127.0.0.1:50051)")
    m.set_defaults(func=_amend_cmd, kind="amend")


def _add_skip(sub: Any) -> None:
    """`croupier skip`: samples taken out of a running mixture."""
    k = sub.add_parser("skip", help="take samples out of a running mixture for good (found corrupt): never dealt again "
                                    "from the job's next generation on, counted by the audit as skipped")
    k.add_argument("job", metavar="JOB")
    k.add_argument("indices", nargs="*", metavar="INDEX", help="dataset indices, as the sampler hands them out")
    k.add_argument("--from", dest="from_file", metavar="FILE",
                   help="skip every sample of the kept versions of `croupier provenance --step/--steps --json`'s "
                        "output saved in FILE, or the indices of a JSON list in FILE (docs/provenance.md)")
    k.add_argument("--address", help="HOST:PORT of the coordinator (default $CROUPIER_ADDRESS, else 127.0.0.1:50051)")
    k.set_defaults(func=_amend_cmd, kind="skip")


def _add_audit(sub: Any) -> None:
    """`croupier audit`: a job's audit log (and step ledger) checked."""
    a = sub.add_parser("audit", help="check a job's audit log for G1: per epoch, expected/trained/duplicates/missing; "
                                     "--by-step: every kept step along the timeline, and the first that diverged")
    a.add_argument("logdir", nargs="?", help="the directory given to the samplers as audit_dir / CROUPIER_AUDIT_DIR "
                                             "(with --by-step it may be left out: the coordinator's ledger alone)")
    a.add_argument("--by-step", action="store_true",
                   help="also check each kept step of the coordinator's step ledger along the job's timeline (each "
                        "sample at most once per epoch) and against LOGDIR, naming the first step that diverged")
    a.add_argument("--address", help="--by-step: HOST:PORT of the coordinator (default $CROUPIER_ADDRESS, else "
                                     "127.0.0.1:50051)")
    a.add_argument("--job", action="append", metavar="JOB",
                   help="--by-step: audit this job (repeatable; default: every job of LOGDIR, or without it every job "
                        "the coordinator holds)")
    a.add_argument("--allow-unfinished", action="store_true",
                   help="pass although the last epoch did not end (a job still running); default: fail")
    a.add_argument("--allow-cut", action="store_true",
                   help="pass although the trainer cut epochs short (a batch limit, a debug run); default: fail")
    a.set_defaults(func=_audit_cmd)


def _add_order(sub: Any) -> None:
    """`croupier order`: the first batches of one rank in one epoch."""
    o = sub.add_parser("order", help="print the first batches one rank gets in one epoch")
    o.add_argument("--n", type=int, required=True, help="dataset size")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--epoch", type=int, default=0)
    o.add_argument("--world", type=int, default=1)
    o.add_argument("--rank", type=int, default=0)
    o.add_argument("--batch-size", type=int, default=8)
    o.add_argument("--batches", type=int, default=3)
    o.add_argument("--permutation", choices=PERMUTATIONS, default="feistel")
    o.add_argument("--partition", choices=PARTITIONS, default="strided")
    o.add_argument("--tail", choices=TAILS, default="pad")
    o.set_defaults(func=_order_cmd)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `croupier` command."""
    parser = argparse.ArgumentParser(prog="croupier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_health(sub)
    _add_demo(sub)
    _add_chaos(sub)
    _add_infer_demo(sub)
    _add_status(sub)
    _add_provenance(sub)
    _add_amend(sub)
    _add_skip(sub)
    _add_audit(sub)
    _add_order(sub)
    data_tool.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `croupier` command."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, OSError, StoreError) as e:
        print(f"croupier: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
