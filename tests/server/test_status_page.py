"""The status page in a real headless Chromium: a running job's ranks and their progress, job names shown as text,
and a screenshot kept as a test artifact (out/test-artifacts/status-page.png)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
from collections.abc import Iterator

import pytest
from _ranks import Ranks

from croupier.client import DistributedSampler
from croupier.server import Server, ServerOptions

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = ROOT / "out" / "test-artifacts" / "status-page.png"
#: The progress bars' fill colour (``.fill`` in the page's style).
BAR_RGB = (0x3D, 0x7B, 0xE0)

# Under CI (.ci/run installs Chromium) a missing browser is a failure, not a skip.
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM) and not os.environ.get("CI"),
                                reason=f"no {CHROMIUM}: apt-get install chromium (.ci/run installs it)")


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[Server]:
    s = Server(f"sqlite:///{tmp_path}/c.db", options=ServerOptions(metrics_port=0)).start()
    try:
        yield s
    finally:
        s.stop(grace=0.5)


def chromium(tmp_path: pathlib.Path, *args: str) -> str:
    """Runs headless Chromium to completion (5 s of virtual time: the page's first fetches and renders); its stdout."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=5000", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the browser and every helper process it started
        proc.communicate()
        raise
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {err[-2000:]}"
    return out


def job_section(dom: str, name: str) -> str:
    for section in dom.split('<section class="ranks">')[1:]:
        if section.startswith(f'<h2><span class="name">{name}</span>'):
            return section
    raise AssertionError(f"no section of job {name!r} in the page: {dom[:3000]}")


def test_status_page_shows_each_rank_progress(server: Server, tmp_path: pathlib.Path) -> None:
    url = f"http://{server.metrics_address}/"
    ss = [DistributedSampler(1000, num_replicas=3, rank=r, address=server.address, job="train-resnet50", incarnation="t1",
                             lease_ahead=16, prefetch=1) for r in range(3)]
    ranks = Ranks(ss)
    try:
        taken = (100, 60, 20)
        for r, k in enumerate(taken):
            for _ in range(k):
                assert ranks.next(r) is not None
            ss[r].state_dict()
        per_rank = len(ss[0])  # 334

        dom = chromium(tmp_path, "--dump-dom", url)
        assert "<title>croupier coordinator</title>" in dom and "refreshes every 2 s" in dom  # the script ran
        job_row = re.search(r'<tr class="job"><td class="name">train-resnet50</td><td>1</td><td>3</td><td>0</td>'
                            r'.*?class="pct">([\d.]+)%</span>.*?<td class="slowest">([^<]*)</td>', dom)
        assert job_row is not None, dom[-4000:]
        assert float(job_row[1]) == pytest.approx(100 * sum(taken) / (3 * per_rank), abs=0.05)
        assert job_row[2] == "rank 2, 80 behind"
        rows = re.findall(r'<tr class="rank" data-rank="(\d+)"><td>\d+</td><td>(\d+)</td><td class="batches">(\d+) / (\d+)</td>'
                          r'.*?class="pct">([\d.]+)%</span>.*?<td class="lag">(\d+)</td>', job_section(dom, "train-resnet50"))
        assert [(int(r), int(e), int(b), int(n), int(lag)) for r, e, b, n, _, lag in rows] == [
            (0, 0, 100, per_rank, 0), (1, 0, 60, per_rank, 40), (2, 0, 20, per_rank, 80)]
        assert [float(p) for *_, p, _ in rows] == pytest.approx([100 * k / per_rank for k in taken], abs=0.05)

        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        SCREENSHOT.unlink(missing_ok=True)
        chromium(tmp_path, f"--screenshot={SCREENSHOT}", "--window-size=1200,800", url)
    finally:
        ranks.close()
    png = SCREENSHOT.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1200, 800)  # IHDR
    pil = pytest.importorskip("PIL.Image", reason="Pillow (with matplotlib) counts the progress bars' pixels")
    with pil.open(SCREENSHOT) as im:
        bar_pixels = sum(n for n, rgb in im.convert("RGB").getcolors(1200 * 800) if rgb == BAR_RGB)
    assert bar_pixels > 2_000  # four bars (the job's, three ranks') filled in part


def test_job_names_are_shown_as_text(server: Server, tmp_path: pathlib.Path) -> None:
    """A job name is user input: the page shows it, and runs nothing it contains."""
    name = "<img src=x onerror=\"document.title='injected'\">&amp;"
    s = DistributedSampler(100, num_replicas=1, rank=0, address=server.address, job=name, incarnation="t1", lease_ahead=16, prefetch=1)
    try:
        ranks = Ranks([s])
        for _ in range(5):
            assert ranks.next(0) is not None
        s.state_dict()
        dom = chromium(tmp_path, "--dump-dom", f"http://{server.metrics_address}/")
    finally:
        s.close()
    assert "<title>croupier coordinator</title>" in dom and "<img" not in dom
    shown = "&lt;img src=x onerror=\"document.title='injected'\"&gt;&amp;amp;"
    assert dom.count(f'<td class="name">{shown}</td>') == 1
    assert re.search(r'<tr class="rank" data-rank="0">.*?<td class="batches">5 / 100</td>', job_section(dom, shown))


def test_a_coordinator_of_many_jobs_shows_them_by_pages(server: Server, tmp_path: pathlib.Path) -> None:
    from croupier.core.api import JoinRequest
    from croupier.core.spec import Spec

    for i in range(60):
        server.core.join(JoinRequest(f"job-{i:02d}", Spec(n=10), "t", 1, 0))
    dom = chromium(tmp_path, "--dump-dom", f"http://{server.metrics_address}/")
    names = re.findall(r'<tr class="job"><td class="name">([^<]*)</td>', dom)
    assert names == [f"job-{i:02d}" for i in range(50)], dom[-3000:]
    assert "50 of 60 jobs" in dom and 'id="next"' in dom and 'id="first"' not in dom
