"""The status page's step ledger in a real headless Chromium, driven through chromedriver: a job's timeline (a band per
generation, the resize, the rollback and the new weights marked), its realized mix, and clicking a step lists the
samples the ledger says (a screenshot is kept as a test artifact: out/test-artifacts/status-ledger.png)."""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _ledger_run import JOB, run
from _webdriver import CHROMEDRIVER, CHROMIUM, ELEMENT, Browser, WebDriverError

from croupier.server import Server, ServerOptions
from croupier.server._ledger_view import mix

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "out" / "test-artifacts" / "status-ledger.png"

# Under CI (.ci/run installs chromium and chromium-driver) a missing browser is a failure, not a skip.
pytestmark = pytest.mark.skipif(not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)) and not os.environ.get("CI"),
                                reason=f"no {CHROMIUM} or {CHROMEDRIVER}: apt-get install chromium chromium-driver")

#: The rows of every version the page lists for the step shown: (kept, generation, [(rank, micro, count, indices,
#: sources, source epochs)]), read from the DOM.
READ_STEP = """
return [document.querySelector('#step h3').dataset.step, Array.from(document.querySelectorAll('#step section.version')).map(
  v => [v.classList.contains('kept'), Number(v.dataset.generation), Array.from(v.querySelectorAll('tr.batch')).map(
    r => [Number(r.dataset.rank), Number(r.dataset.micro), Number(r.querySelector('.count').textContent),
          r.querySelector('.indices').textContent, r.querySelector('.sources').textContent,
          r.querySelector('.source-epochs').textContent])])];
"""


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[Server]:
    s = Server(f"sqlite:///{tmp_path}/c.db", options=ServerOptions(metrics_port=0)).start()
    try:
        run(s.core)
        yield s
    finally:
        s.stop(grace=0.5)


@pytest.fixture
def browser(tmp_path: pathlib.Path) -> Iterator[Browser]:
    b = Browser(tmp_path)
    try:
        yield b
    finally:
        b.close()


def _open_timeline(browser: Browser, server: Server) -> None:
    """Opens the page and clicks the job's "timeline" link in the jobs table (drawn again every 2 s: a link
    replaced between finding and clicking it is found again)."""
    browser.get(f"http://{server.metrics_address}/")
    for _ in range(3):
        try:
            browser.click(browser.find("tr.job a.timeline"))
            break
        except WebDriverError as e:
            if e.error != "stale element reference":
                raise
    browser.find("#timeline")
    browser.find("#mix")  # drawn once its own request is answered


def _listed(browser: Browser) -> tuple[int, list[Any]]:
    browser.find("#step h3[data-step]")  # waits for the listing
    step, versions = browser.script(READ_STEP)
    return int(step), versions


def _ledger_says(server: Server, step: int) -> list[Any]:
    rec = server.core.step_ledger(JOB).step(step)
    versions = [v for v in [rec.kept, *rec.abandoned] if v is not None]
    return [[v.kept, v.generation, [[b.rank, b.micro, int(b.indices.size), " ".join(map(str, b.indices.tolist())),
                                     " ".join(map(str, b.sources.tolist())), " ".join(map(str, b.source_epochs.tolist()))]
                                    for b in v.batches]] for v in versions]


def test_the_timeline_shows_a_band_per_generation_and_marks_the_resize_rollback_and_weights(
        server: Server, browser: Browser) -> None:
    _open_timeline(browser, server)
    bands = browser.script("""return Array.from(document.querySelectorAll('#timeline g.band')).map(
        g => [Number(g.dataset.generation), g.querySelectorAll('rect.kept').length, g.querySelectorAll('rect.abandoned').length]);""")
    # four generations; only generation 1 trained steps (11-20) that a rollback abandoned
    assert bands == [[1, 1, 1], [2, 1, 0], [3, 1, 0], [4, 1, 0]]
    marks = browser.script("""return ['resize', 'rollback', 'amendment'].map(
        k => document.querySelectorAll('#timeline .mark.' + k).length);""")
    assert marks == [1, 1, 1]
    items = browser.script("return Array.from(document.querySelectorAll('ul.marks li')).map(li => li.textContent);")
    assert items[:2] == ["step 10, generation 2: the world went from 2 to 3 ranks",
                         "step 10, generation 2: rolled back, below step 20 that generation 1 reached"]
    assert items[2].startswith("step 25, generation 3: deals with weights [") and len(items) == 3
    # the realized mix, fetched once the timeline is drawn: the windows the ledger's mix has, each a stack of
    # the two sources' shares as tall as the share
    windows = browser.script("""return Array.from(document.querySelectorAll('#mix g.window')).map(
        g => [Number(g.dataset.first), Number(g.dataset.last),
              Array.from(g.querySelectorAll('rect.share')).map(r => Number(r.getAttribute('height')) / 100)]);""")
    want = mix(server.core.step_ledger(JOB))
    assert want is not None and len(want["series"]) == len(windows) == 32
    for (first, last, heights), w in zip(windows, want["series"]):
        assert (first, last) == (w["first"], w["last"]) and heights == pytest.approx([x for x in w["shares"] if x > 0])
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.write_bytes(browser.screenshot())


def test_clicking_a_step_lists_the_samples_the_ledger_says(server: Server, browser: Browser) -> None:
    _open_timeline(browser, server)
    # generation 1's abandoned steps 11-20: a click in the middle of step 13 (the axis' stretch 12..13, a
    # quarter of the way along the band) lists step 13, kept by generation 2 and abandoned by generation 1
    band = browser.find('#timeline g.band[data-generation="1"] rect.abandoned')
    width = browser.script("return arguments[0].getBoundingClientRect().width;", {ELEMENT: band})
    browser.click_at(band, (2.5 / 10 - 0.5) * width)
    step, versions = _listed(browser)
    assert step == 13
    assert [(kept, gen) for kept, gen, _ in versions] == [(True, 2), (False, 1)]
    assert versions == _ledger_says(server, step)
    # a step named in the form
    field = browser.find("#step-input")
    browser.type(field, "33\ue007")
    browser.find('#step h3[data-step="33"]')  # waits for its listing
    step, versions = _listed(browser)
    assert step == 33 and versions == _ledger_says(server, step)
    # a bad one: the coordinator's message, shown
    browser.clear(field)
    browser.type(field, "41\ue007")
    browser.find("#step p.error")
    assert browser.script("return document.querySelector('#step p.error').textContent;") == (
        f"step 41: step 41 is past the run: job {JOB!r} has trained 40 steps (as far as its ranks reported)")


def test_behind_credentials_the_page_asks_for_one_and_sends_it(tmp_path: pathlib.Path, browser: Browser) -> None:
    """With an auth file, the page's data wants a credential: the page asks for it, keeps it in the tab's
    sessionStorage (not in the URL) and sends it with each request; a wrong one is asked again, saying why."""
    secret = "dash-secret-0123456789"
    creds = tmp_path / "credentials.json"
    creds.write_text(json.dumps({"credentials": [{"name": "dash", "secret": secret, "role": "read", "jobs": [JOB]}]}))
    s = Server(f"sqlite:///{tmp_path}/a.db", options=ServerOptions(metrics_port=0, auth_file=str(creds))).start()
    try:
        run(s.core)
        url = f"http://{s.metrics_address}/"
        browser.get(url)
        why = "return document.querySelector('#login-form p.error').textContent;"
        browser.type(browser.find("#credential"), "not-the-secret-at-all\ue007")
        browser.find("#credential")  # asked again, saying why (a request sent before it may answer first)
        for _ in range(50):
            if "the credential sent is not one this coordinator knows" in browser.script(why):
                break
            time.sleep(0.1)
        assert "the credential sent is not one this coordinator knows" in browser.script(why)
        browser.type(browser.find("#credential"), secret + "\ue007")
        browser.click(browser.find("tr.job a.timeline"))
        browser.find("#timeline")
        browser.find("#mix")
        browser.type(browser.find("#step-input"), "33\ue007")
        step, versions = _listed(browser)
        assert step == 33 and versions == _ledger_says(s, step)
        assert browser.script("return sessionStorage.getItem('croupier-credential');") == secret
        assert secret not in browser.script("return location.href;")
        browser.get(url)  # the same tab: not asked again
        browser.find("tr.job")
        assert browser.script("return document.getElementById('login').childElementCount;") == 0
    finally:
        s.stop(grace=0.5)
