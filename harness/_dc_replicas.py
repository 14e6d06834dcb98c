"""The replicated data-center chaos run (``croupier chaos --datacenter --replicas K``): PostgreSQL, each replica
and the job on hosts of their own, with replica pauses, partitions and slow links between them.

The run starts a throwaway PostgreSQL server of its own (:class:`HostedDatabase`, Debian's binaries run as
the ``postgres`` OS user) on host "db", K ``croupier serve`` replicas on it on hosts "r0".."rK-1" and the
job (torchrun and its workers, every rank given every replica) on host "job", each a network namespace
behind one router (:mod:`croupier.harness._netns`). Beside the replicated run's faults (rank kills, replica
kills, PostgreSQL restarts, preemptions) and a worker's pause, it injects, each for a while, then undone:

* ``replica-pause``: one replica stopped (SIGSTOP), then woken (SIGCONT), as a long GC pause or a frozen VM;
* ``db-partition``: one replica's host cut from the database's (the replica answers UNAVAILABLE or from
  what it confirmed within its staleness bound; the ranks move on to another);
* ``job-partition``: the job's host cut from one replica's (the ranks' calls to it get no answer at all);
* ``db-slow-link``: the link between one replica and the database delayed 200 ms each way with 1 % of its
  packets lost (at 10 % a replica's connection to PostgreSQL is lost and remade without end);
* ``job-slow-link``: the link between the job and one replica delayed 200 ms each way with a tenth of its
  packets lost.

The single coordinator's clock jumps and full disk (:mod:`croupier.harness._faults`) are faults of its SQLite
store's file system and of libfaketime under one process: this mode has no such store and injects the
faults above instead. The replica a fault hits is, as for a kill, half the time the one the ranks are using
(the most connections with recent traffic), else one at random.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pwd
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
from typing import Any

from croupier.demos.cluster import runs_trainer
from croupier.harness import _faults, _netns
from croupier.harness.history import Tally
from croupier.tools.serve import ServeGroup, ServeProcess, active_clients

#: The faults this module injects beside the replicated run's kills, restarts and preemptions.
KINDS = ("replica-pause", "rank-pause", "db-partition", "job-partition", "db-slow-link", "job-slow-link")
#: Each link's delay each way, and the share of its packets lost: the database's link, the job's.
SLOW_DELAY_MS, DB_LOSS, JOB_LOSS = 200.0, 0.01, 0.1
#: The database's port on its host, and its superuser.
DB_PORT, DB_USER = 5432, "croupier"
_OS_USER = "postgres"  # PostgreSQL refuses to run as root


def _bindir() -> pathlib.Path | None:
    """Where initdb and pg_ctl are: ``pg_config --bindir``."""
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        return None
    out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
    return pathlib.Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def available() -> str | None:
    """None when this mode can run here (root, network namespaces, /dev/net/tun, PostgreSQL), else why not."""
    if os.geteuid() != 0:
        return "the replicated data-center mode makes network namespaces: run as root"
    if not os.path.exists("/dev/net/tun"):
        return "the slow-link faults need /dev/net/tun"
    bindir = _bindir()
    if bindir is None or not all((bindir / b).is_file() for b in ("initdb", "pg_ctl", "postgres")):
        return "it runs a PostgreSQL server of its own: no initdb/pg_ctl (apt-get install postgresql)"
    try:
        pwd.getpwnam(_OS_USER)
    except KeyError:
        return f"there is no {_OS_USER!r} OS user to run PostgreSQL as"
    if shutil.which("runuser") is None:
        return f"runuser is needed to run PostgreSQL as {_OS_USER!r}"
    return _netns.unavailable_reason()


class HostedDatabase:
    """A throwaway PostgreSQL cluster on one host of `hosts`: started, restarted (:meth:`restart`, the run's
    ``DatabaseControl``), stopped and removed (:meth:`close`, its log copied to `log` first)."""

    def __init__(self, hosts: _netns.Hosts, name: str, log: pathlib.Path) -> None:
        bindir = _bindir()
        assert bindir is not None, "check available() first"
        self.hosts, self.name, self.bindir, self.saved_log = hosts, name, bindir, log
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="croupier-chaos-pg-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.password = f"pw-{secrets.token_hex(8)}"
        uid, gid = pwd.getpwnam(_OS_USER)[2:4]
        os.chown(self.root, uid, gid)
        self.root.chmod(0o700)
        pwfile = self.root / "pwfile"
        pwfile.write_text(self.password + "\n")
        os.chown(pwfile, uid, gid)
        self._pg("initdb", "-D", str(self.data), "-U", DB_USER, f"--pwfile={pwfile}", "--auth-local=trust",
                 "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions")
        pwfile.unlink()
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(f"\n# croupier chaos\nlisten_addresses = '{hosts.addr[name]}'\nport = {DB_PORT}\n"
                       f"unix_socket_directories = '{self.root}'\nfsync = on\nmax_connections = 100\n"
                       "shared_buffers = 32MB\nlogging_collector = off\n")
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {_netns.SUBNET}.0.0/16 scram-sha-256\n")

    def _pg(self, binary: str, *args: str) -> None:
        cmd = ["runuser", "-u", _OS_USER, "--", str(self.bindir / binary), *args]
        if binary == "pg_ctl":  # the server runs on its host; initdb needs no network
            cmd = self.hosts.run(self.name, cmd)
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{binary} {' '.join(args[:1])} failed ({out.returncode}): {out.stdout}{out.stderr}{tail}")

    def start(self) -> None:
        """Starts the server and makes the run's database; returns once it accepts connections."""
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True, connect_timeout=10) as conn:
            conn.execute("CREATE DATABASE croupier")

    def restart(self, mode: str) -> None:
        """Stops the server with shutdown mode `mode` ("fast" or "immediate") and starts it again; returns once
        it accepts connections."""
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-m", mode, "-w", "-t", "60", "restart")

    def url(self, dbname: str = "croupier") -> str:
        """The database's URL from this host, over the server's Unix socket (which crosses namespaces)."""
        return f"postgresql://{DB_USER}:{self.password}@/{dbname}?host={self.root}&port={DB_PORT}"

    def hosted_url(self) -> str:
        """The database's URL from the other hosts."""
        return f"postgresql://{DB_USER}:{self.password}@{self.hosts.addr[self.name]}:{DB_PORT}/croupier"

    def close(self) -> None:
        """Stops the server (immediate) and removes its directory, its log saved first; idempotent."""
        if not self.root.exists():
            return
        with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
            self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30", "stop")
        with contextlib.suppress(OSError):
            shutil.copyfile(self.log, self.saved_log)
        with contextlib.suppress(OSError, ValueError, IndexError):  # pg_ctl could not stop it: the postmaster we started
            os.kill(int((self.data / "postmaster.pid").read_text().splitlines()[0]), signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


class ReplicatedDatacenter(_faults.Faults):
    """The hosts, the database and the faults of one replicated data-center run of `replicas` replicas."""

    def __init__(self, work: pathlib.Path, rng: random.Random, replicas: int) -> None:
        super().__init__(work, rng)
        self.work = work
        self.names = [f"r{i}" for i in range(replicas)]
        self.database: HostedDatabase | None = None

    def env(self) -> dict[str, str]:
        return {}  # the replicas' clocks are the machine's: no libfaketime

    def __enter__(self) -> ReplicatedDatacenter:
        self.hosts = _netns.Hosts(["db", *self.names, "job"])
        try:
            self.database = HostedDatabase(self.hosts, "db", self.work / "postgres.log")
            self.database.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.database is not None:
            self.database.close()
            self.database = None
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None

    def db(self) -> tuple[str, HostedDatabase]:
        """The database's URL from this host (for the checks), and its control (for its restarts)."""
        assert self.database is not None, "outside the with block"
        return self.database.url(), self.database

    def replicas(self, logs: contextlib.ExitStack, error: type[Exception]) -> list[ServeProcess]:
        """The replicas, one on each replica host, on the database (not started), each logging to
        WORKDIR/replica-I.log (a file `logs` closes)."""
        assert self.database is not None, "outside the with block"
        return [ServeProcess(self.database.hosted_url(), logs.enter_context(open(self.work / f"replica-{i}.log", "a")),
                             f"replica {i}", error, verbose=True, host=self.address(name), prefix=self.prefix(name))
                for i, name in enumerate(self.names)]

    def _replica(self, servers: ServeGroup) -> tuple[int, str]:
        """The replica a fault hits, and why that one (see the module)."""
        members = servers.members
        # Both drawn every time so that a seed replays the same choices whatever the traffic.
        busiest, other = self.rng.random() < 0.5, self.rng.randrange(len(members))
        active = [active_clients(m.port, prefix=m.prefix) for m in members]
        if busiest and max(active) > 0:
            i = active.index(max(active))
            return i, f"the one the ranks are using, {active[i]} client connections active"
        return other, "at random"

    def inject(self, kind: str, servers: ServeGroup, t: Tally, time_left: float, st: list[dict[str, Any]],
               at: str) -> str | None:
        """Injects fault `kind` (one of KINDS) into the replicas `servers`, the job (whose workers' statuses are
        `st`, furthest at `at`, `time_left` seconds from its end) or a link; counts it in `t`.

        Returns:
            What was injected, or None when there was nothing to inject it into (the fault comes again).
        """
        hosts = self.hosts
        assert hosts is not None, "outside the with block"
        within = max(0.2, time_left / 2)  # it ends while the job still runs, for the faults still due
        if kind == "rank-pause":
            live = [s for s in st if not s.get("done") and runs_trainer(s["pid"])]
            if not live:
                return None  # the launch is ending: nothing to pause
            victim = live[self.rng.randrange(len(live))]
            took = self.pause(victim["pid"], within)
            t.rank_pauses += 1
            servers.check()
            return f"rank {victim['rank']} stopped (SIGSTOP) for {took:.1f} s at {at}, then woken"
        i, why = self._replica(servers)
        r, name = servers.members[i], self.names[i]
        if kind == "replica-pause":
            assert r.proc is not None
            took = self.pause(r.proc.pid, within)
            t.replica_pauses += 1
            said = f"replica {i} stopped (SIGSTOP) for {took:.1f} s ({why}) at {at}, then woken"
        elif kind in ("db-partition", "job-partition"):
            other = "db" if kind == "db-partition" else "job"
            took = self._lasting(within, lambda: hosts.cut(name, other), lambda: hosts.heal(name, other))[0]
            if other == "db":
                t.db_partitions += 1
            else:
                t.job_partitions += 1
            said = (f"replica {i} ({why}) cut from the {'database' if other == 'db' else 'job'} for {took:.1f} s "
                    f"at {at}, then healed")
        else:
            other, loss = ("db", DB_LOSS) if kind == "db-slow-link" else ("job", JOB_LOSS)
            seed = self.rng.randrange(2**31)
            took, (passed, dropped) = self._lasting(
                within, lambda: hosts.impair(name, other, SLOW_DELAY_MS, loss, seed=seed),
                lambda: hosts.restore(name, other))
            if other == "db":
                t.db_slow_links += 1
            else:
                t.job_slow_links += 1
            said = (f"the link between replica {i} ({why}) and the {'database' if other == 'db' else 'job'} "
                    f"{SLOW_DELAY_MS:.0f} ms slow each way, {loss:.0%} of its packets lost, for {took:.1f} s at {at} "
                    f"({passed} packets passed, {dropped} dropped)")
        servers.check()  # every replica outlives each of them
        return said
