"""`croupier status`: the jobs a coordinator holds, or one job's ranks and checkpoints, as tables.

The formatting is pure (a :class:`~croupier.core.api.JobStatus` and the time in, lines out);
:func:`main` is the only part that calls the coordinator.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from croupier.core import settings
from croupier.core.amend import sizes_after
from croupier.core.api import JobStatus, now_ms
from croupier.core.errors import CroupierError, NotFound, Unavailable

if TYPE_CHECKING:
    from croupier.client import CoordinatorClient
    from croupier.server import RankView

#: Seconds between two tables of ``--watch`` when it names none.
DEFAULT_WATCH_S = 2.0
#: How long the command retries a coordinator that does not answer, and how long one call may take.
RETRY_FOR_S = 3.0
CALL_TIMEOUT_S = 5.0
#: Moves the cursor home and clears the screen (only written to a terminal).
CLEAR = "\x1b[H\x1b[2J"


@dataclasses.dataclass(frozen=True)
class Summary:
    """Where a job's current generation stands, from the cursors its ranks reported.

    Attributes:
        epoch: The job's current epoch: the highest any rank reported (None before any report).
        done: Batches taken by the ranks reporting in `epoch`.
        total: Batches those ranks have in `epoch`.
        slowest: The rank with the fewest batches in the lowest epoch reported (None before any report).
        behind: Batches `slowest` is behind the rank furthest ahead.
        silent: Ranks of the world that never reported.
        last_ms: The latest report or checkpoint record (Unix ms, the coordinator's clock), or None.
    """

    epoch: int | None
    done: int
    total: int
    slowest: RankView | None
    behind: int
    silent: tuple[int, ...]
    last_ms: int | None


def summarize(st: JobStatus) -> Summary:
    """The :class:`Summary` of a job's status: the coordinator's own arithmetic (``croupier.server.job_view``,
    as its metrics and status page count), and the ranks that never reported."""
    from croupier.server import job_view  # here: `croupier health` and `status` start without the server's imports

    v = job_view("", st)
    reported = {c.rank for c in st.ranks}
    silent = tuple(r for r in range(st.result.world) if r not in reported)
    return Summary(v.epoch, v.done, v.total, v.slowest, v.slowest.lag if v.slowest else 0, silent, v.last_ms)


def ago(ms: int | None, now_ms: int) -> str:
    """How long before `now_ms` the time `ms` was, as "12 s ago" ("-" for None).

    NOTE: `ms` is the coordinator's clock and `now_ms` this machine's; a time slightly in the
    future (clock skew) reads "0 s ago".
    """
    if ms is None:
        return "-"
    s = max(0, now_ms - ms) // 1000
    if s < 120:
        return f"{s} s ago"
    if s < 2 * 3600:
        return f"{s // 60} min ago"
    if s < 2 * 86400:
        return f"{s // 3600} h ago"
    return f"{s // 86400} d ago"


def percent(done: int, total: int) -> str:
    """`done` of `total` as "18.0%" ("-" when `total` is 0)."""
    return f"{100.0 * done / total:.1f}%" if total > 0 else "-"


def rank_list(ranks: Sequence[int], count: int | None = None) -> str:
    """Ranks as "[1, 2]", shortened past 16 (or past what is named, when `count` says there are more)."""
    count = len(ranks) if count is None else count
    shown = ", ".join(map(str, list(ranks)[:16]))
    return f"[{shown}{', ...' if count > min(16, len(ranks)) else ''}]"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart, no trailing spaces."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _progress(st: JobStatus, s: Summary) -> str:
    if st.result.start is None:
        return f"waiting for ranks {rank_list(st.result.waiting_for, st.result.waiting_count)}"
    return percent(s.done, s.total)


def _slowest(s: Summary) -> str:
    if s.slowest is None:
        return "-"
    return f"rank {s.slowest.rank}, {s.behind} batches behind"


JOBS_HEADER = ("JOB", "GEN", "WORLD", "EPOCH", "PROGRESS", "SLOWEST", "REPORTED", "LAST ACTIVITY")


def jobs_lines(statuses: Sequence[tuple[str, JobStatus]], now_ms: int) -> list[str]:
    """The table of every job: one row per (name, status), in the order given.

    Args:
        statuses: Each job's name and status.
        now_ms: The time the ages are counted to (Unix ms).

    Returns:
        The table's lines; one line saying so when there are no jobs.
    """
    if not statuses:
        return ["no jobs"]
    rows = []
    for name, st in statuses:
        s = summarize(st)
        world = st.result.world
        rows.append((name, str(st.result.generation), str(world), "-" if s.epoch is None else str(s.epoch),
                     _progress(st, s), _slowest(s), f"{world - len(s.silent)}/{world}", ago(s.last_ms, now_ms)))
    return table(JOBS_HEADER, rows)


#: Jobs the table of every job shows at most (``croupier status --limit``).
DEFAULT_LIMIT = 50
RANKS_HEADER = ("RANK", "EPOCH", "BATCHES", "%", "LAST REPORT")
CHECKPOINTS_HEADER = ("STEP", "GEN", "RANK", "EPOCH", "WHEN")


def job_lines(name: str, st: JobStatus, now_ms: int) -> list[str]:
    """One job: a header, one row per rank of its world ("-" for a rank that never reported), its checkpoints.

    Args:
        name: The job's name.
        st: Its status.
        now_ms: The time the ages are counted to (Unix ms).
    """
    s = summarize(st)
    r = st.result
    head = f"job {name}: generation {r.generation}, world {r.world}"
    if r.start is None:
        lines = [f"{head}, waiting for ranks {rank_list(r.waiting_for, r.waiting_count)}"]
    else:
        lines = [f"{head}, started at epoch {r.start.epoch}"]
    if s.epoch is not None:
        lines.append(f"epoch {s.epoch}: {percent(s.done, s.total)} ({s.done}/{s.total} batches), slowest {_slowest(s)}, "
                     f"last activity {ago(s.last_ms, now_ms)}")
    if s.silent:
        lines.append(f"never reported: ranks {rank_list(s.silent)}")
    lines.append(f"spec: {st.spec.describe()}")
    lines += sizes_lines(st)
    by_rank = {c.rank: c for c in st.ranks}
    rows = []
    for k in sorted(set(range(r.world)) | set(by_rank)):
        c = by_rank.get(k)
        if c is None:
            rows.append((str(k), "-", "-", "-", "-"))
        else:
            rows.append((str(k), str(c.epoch), f"{c.batches}/{c.batches_in_epoch}", percent(c.batches, c.batches_in_epoch),
                         ago(c.reported_ms, now_ms)))
    lines += ["", *table(RANKS_HEADER, rows), ""]
    if not st.checkpoints:
        lines.append("no checkpoints recorded")
    else:
        lines.append(f"checkpoints ({len(st.checkpoints)}):")
        lines += table(CHECKPOINTS_HEADER, [("-" if c.step is None else str(c.step), str(c.generation), str(c.rank),
                                             str(c.cursor.epoch), ago(c.recorded_ms, now_ms)) for c in st.checkpoints])
    if st.amendments:
        lines += ["", f"amendments ({len(st.amendments)}):", *(f"  {a.describe()}" for a in st.amendments)]
    return lines


def sizes_lines(st: JobStatus) -> list[str]:
    """A mixture's sources as its ranks deal them now (grown by the amendments held), those pending, and its epochs.

    NOTE: an epoch is the ``n`` the job was registered with (``len(dataset)`` then): a grow adds
    samples to its source's epochs, not positions to the sampler's; the spec line shows the sizes
    registered, which a grow does not change either.
    """
    if st.spec.sources is None:
        return []
    now = sizes_after(st.spec.sources, [a for a in st.amendments if a.at is not None])
    later = sizes_after(st.spec.sources, st.amendments)
    line = f"sources: {', '.join(map(str, now))} samples ({sum(now)} indices)"
    if later != now:
        line += f"; {', '.join(map(str, later))} ({sum(later)}) once the pending grows hold"
    return [line, f"epoch: {st.spec.n} positions (len(dataset) when the job was registered; a grow leaves it)"]


def watch_seconds(text: str) -> float:
    """The argument of ``--watch``: seconds, > 0."""
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds must be a number (got {text!r})") from None
    if not s > 0 or s == float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be > 0 (got {text!r})")
    return s


class _UnknownJob(Exception):
    pass


def _render(client: CoordinatorClient, job: str | None, limit: int = DEFAULT_LIMIT, after: str = "") -> list[str]:
    if job is None:
        # NOTE: one GetJob per job shown: a page of them, not every job of a coordinator of thousands.
        names, nxt, total = client.jobs_page(limit, after)
        statuses = []
        for name in names:
            try:
                statuses.append((name, client.status(name)))
            except NotFound:  # gone between the two calls
                continue
        lines = jobs_lines(statuses, now_ms())
        if nxt or after:
            lines.append(f"{len(names)} of {total} jobs{f' after {after!r}' if after else ''}"
                         + (f"; the next ones: croupier status --after {nxt}" if nxt else ""))
        return lines
    try:
        st = client.status(job)
    except NotFound:
        known = client.jobs()
        raise _UnknownJob(f"no job {job!r} at {client.address} (jobs: {', '.join(known) or 'none'})") from None
    return job_lines(job, st, now_ms())


def main(address: str | None, job: str | None = None, watch: float | None = None, out: TextIO | None = None,
         limit: int = DEFAULT_LIMIT, after: str = "") -> int:
    """`croupier status`: prints the table once, or every `watch` seconds until Ctrl-C.

    Args:
        address: HOST:PORT of the coordinator; None for ``CROUPIER_ADDRESS``, else 127.0.0.1:50051.
        job: One job to show in detail, or None for the table of every job.
        watch: Seconds between two tables, or None to print one.
        out: Where tables go (stdout); a terminal is cleared before each table, anything else gets
            successive tables separated by a blank line.
        limit: Jobs in the table of every job, at most (by name).
        after: The table starts after this job's name.

    Returns:
        0, also when Ctrl-C ends ``--watch``; 1 for an unknown job or a coordinator that does not answer.
    """
    from croupier.client import CoordinatorClient

    out = sys.stdout if out is None else out
    address = settings.coordinator_address(address)
    tty = out.isatty()
    client = CoordinatorClient(address, retry_for=RETRY_FOR_S, call_timeout=CALL_TIMEOUT_S)
    # NOTE: Ctrl-C ends --watch between two tables. A KeyboardInterrupt raised inside a gRPC call
    # in flight could leave the channel's threads behind and the process would not exit; the
    # signal only sets an event, which the wait between tables reads.
    stop = threading.Event()
    previous = None
    if watch is not None and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        first = True
        while True:
            lines = _render(client, job, limit, after)
            out.write(CLEAR if tty else "" if first else "\n")
            out.write("\n".join(lines) + "\n")
            out.flush()
            first = False
            if watch is None or stop.wait(watch):
                return 0
    except KeyboardInterrupt:
        return 0
    except _UnknownJob as e:
        print(f"croupier status: {e}", file=sys.stderr)
        return 1
    except Unavailable as e:
        detail = str(e).removeprefix(f"coordinator at {address}: ")
        print(f"croupier status: the coordinator at {address} is unavailable (retried for {RETRY_FOR_S:g} s): {detail}",
              file=sys.stderr)
        return 1
    except (CroupierError, RuntimeError) as e:
        print(f"croupier status: {e}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        client.close()
