"""The read-only HTTP endpoint next to the gRPC port: ``/metrics``, the status page, ``/api/jobs``, ``/healthz``."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from croupier.core import api
from croupier.server._standing import JobView, view_json

log = logging.getLogger("croupier.server")

#: A page of jobs: (after, limit) -> (the page's jobs, how many jobs there are).
Views = Callable[[str, int], tuple[list[JobView], int]]

#: Jobs one ``/api/jobs`` answer names unless asked (``?limit=``), and at most.
PAGE_JOBS, MAX_PAGE_JOBS = 50, 10_000
#: The Prometheus text format.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT = "text/plain; charset=utf-8"


class Endpoint:
    """An HTTP server in a daemon thread that only reads: every answer is computed from the callables it is given."""

    def __init__(self, host: str, port: int, metrics: Callable[[], bytes], views: Views,
                 failed: Callable[[], str | None]) -> None:
        """Binds `host`:`port` (0: a free port) and serves until :meth:`stop`.

        Args:
            host: Interface to listen on (an IPv6 address with or without brackets).
            port: Port to listen on; 0 picks a free one.
            metrics: The Prometheus exposition of the server's registry.
            views: A page of jobs, summarised, from the name after which it starts and its length, and
                how many jobs there are (``/api/jobs`` and the status page).
            failed: Why the coordinator stopped acknowledging, or None (``/healthz``).

        Raises:
            OSError: If the address cannot be bound; the message names it.
        """
        host = host.strip("[]")
        cls = _Server6 if ":" in host else _Server
        try:
            self._httpd = cls((host, port), _handler(metrics, views, failed))
        except OSError as e:
            raise OSError(e.errno, f"could not bind the metrics endpoint {host}:{port}: {e.strerror}") from None
        self.host, self.port = host, int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="croupier-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """HOST:PORT the endpoint listens on."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def stop(self) -> None:
        """Stops serving and closes the socket (requests in flight finish in their daemon threads)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def _handler(metrics: Callable[[], bytes], views: Views,
             failed: Callable[[], str | None]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "croupier"

        def do_GET(self) -> None:  # the name the http.server protocol calls
            try:
                url = urlsplit(self.path)
                self._get(url.path, parse_qs(url.query))
            except Exception:
                log.exception("metrics endpoint: GET %s failed", self.path)
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, TEXT, b"internal error (see the coordinator's log)\n")

        def _get(self, path: str, query: dict[str, list[str]]) -> None:
            if path == "/metrics":
                self._send(HTTPStatus.OK, METRICS_CONTENT_TYPE, metrics())
            elif path == "/":
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", PAGE.encode(), {"Content-Security-Policy": PAGE_CSP})
            elif path == "/api/jobs":
                try:
                    after, limit = _page(query)
                except ValueError as e:
                    self._send(HTTPStatus.BAD_REQUEST, TEXT, f"{e}\n".encode())
                    return
                now_ms = api.now_ms()
                why = failed()
                body: dict[str, Any] = {"now_unix_ms": now_ms, "coordinator_failed": why, "jobs": [], "total": 0,
                                        "next_after": None}
                if why is None:
                    page, total = views(after, limit)
                    body["jobs"] = [view_json(v, now_ms) for v in page]
                    body["total"] = total
                    # the page's last name: the next page starts after it (None on the last page)
                    if page and len(page) == limit:
                        body["next_after"] = page[-1].name
                self._send(HTTPStatus.OK, "application/json", json.dumps(body).encode())
            elif path == "/healthz":
                why = failed()
                if why is None:
                    self._send(HTTPStatus.OK, TEXT, b"ok\n")
                else:
                    self._send(HTTPStatus.SERVICE_UNAVAILABLE, TEXT, f"failed: {why}\n".encode())
            else:
                self._send(HTTPStatus.NOT_FOUND, TEXT, b"not found: try /, /metrics, /api/jobs, /healthz\n")

        def _send(self, status: HTTPStatus, kind: str, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics endpoint: %s - %s", self.address_string(), format % args)

    return Handler


def _page(query: dict[str, list[str]]) -> tuple[str, int]:
    """``/api/jobs``'s page from its query: ``after`` (a job name: the page starts after it) and ``limit``."""
    after = query.get("after", [""])[-1]
    raw = query.get("limit", [str(PAGE_JOBS)])[-1]
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE_JOBS:
        raise ValueError(f"limit must be an int in [1, {MAX_PAGE_JOBS}] (got limit={raw!r})")
    return after, limit


_SCRIPT = r"""
"use strict";
// Built with DOM calls and textContent only: job names are user input and never parsed as HTML.
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
function pct(x) { return (100 * x).toFixed(1) + "%"; }
function bar(x) {
  const fill = el("div", {class: "fill"});
  fill.style.width = pct(Math.max(0, Math.min(1, x)));
  return el("div", {class: "bar"}, fill, el("span", {class: "pct"}, pct(x)));
}
function ago(s) {
  if (s === null || s === undefined) return "-";
  if (s < 1) return "just now";
  if (s < 120) return Math.round(s) + " s ago";
  if (s < 7200) return Math.round(s / 60) + " min ago";
  return Math.round(s / 3600) + " h ago";
}
function render(data) {
  const jobs = document.getElementById("jobs"), ranks = document.getElementById("ranks");
  const note = document.getElementById("note");
  note.textContent = data.coordinator_failed ? "The coordinator failed: " + data.coordinator_failed : "";
  jobs.replaceChildren();
  ranks.replaceChildren();
  if (!data.jobs.length) jobs.append(el("tr", {}, el("td", {colspan: "7", class: "empty"}, "no jobs yet")));
  for (const j of data.jobs) {
    const epoch = j.started ? (j.epoch === null ? "-" : j.epoch) : "waiting for " + j.waiting_for + " of " + j.world;
    const slow = j.slowest === null ? "-"
      : j.slowest.lag === 0 ? "in step" : "rank " + j.slowest.rank + ", " + j.slowest.lag + " behind";
    jobs.append(el("tr", {class: "job"}, el("td", {class: "name"}, j.name), el("td", {}, j.generation), el("td", {}, j.world),
                   el("td", {}, epoch), el("td", {class: "progress"}, bar(j.progress)), el("td", {class: "slowest"}, slow),
                   el("td", {}, ago(j.last_activity_age_s))));
    const body = el("tbody", {});
    for (const r of j.ranks) {
      body.append(el("tr", {class: "rank", "data-rank": r.rank}, el("td", {}, r.rank), el("td", {}, r.epoch),
                     el("td", {class: "batches"}, r.batches + " / " + r.batches_in_epoch),
                     el("td", {class: "progress"}, bar(r.progress)), el("td", {class: "lag"}, r.lag),
                     el("td", {}, ago(r.report_age_s))));
    }
    if (!j.ranks.length) body.append(el("tr", {}, el("td", {colspan: "6", class: "empty"}, "no rank has reported yet")));
    const shown = j.ranks.length < j.reported ? " (the " + j.ranks.length + " slowest shown)" : "";
    ranks.append(el("section", {class: "ranks"},
      el("h2", {}, el("span", {class: "name"}, j.name), " \u00b7 generation " + j.generation + " \u00b7 " + j.reported +
         " of " + j.world + " ranks reported" + shown),
      el("table", {}, el("thead", {}, el("tr", {}, ...["rank", "epoch", "batches", "progress", "batches behind", "last report"]
                                                          .map(h => el("th", {}, h)))), body)));
  }
}
// The page of jobs shown: the name it starts after ("" for the first), as /api/jobs takes it.
let after = "";
function pages(data) {
  const nav = document.getElementById("pages");
  nav.replaceChildren();
  if (data.total <= data.jobs.length && !after) return;
  nav.append(el("span", {}, data.jobs.length + " of " + data.total + " jobs "));
  if (after) {
    const b = el("button", {type: "button", id: "first"}, "first page");
    b.addEventListener("click", () => { after = ""; refresh(false); });
    nav.append(b);
  }
  if (data.next_after !== null) {
    const b = el("button", {type: "button", id: "next"}, "next page");
    b.addEventListener("click", () => { after = data.next_after; refresh(false); });
    nav.append(b);
  }
}
async function refresh(again = true) {
  const status = document.getElementById("updated");
  try {
    const r = await fetch("api/jobs?after=" + encodeURIComponent(after), {cache: "no-store"});
    const data = await r.json();
    render(data);
    pages(data);
    status.textContent = "updated " + new Date().toLocaleTimeString() + " \u00b7 refreshes every 2 s";
  } catch (e) {
    status.textContent = "cannot reach the coordinator (" + e + "); retrying";
  }
  if (again) setTimeout(refresh, 2000);
}
refresh();
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>croupier coordinator</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2330; background: #f7f8fa; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 15px; margin: 24px 0 8px; }
  #updated { color: #667; margin-bottom: 16px; }
  #note { color: #b00020; font-weight: 600; }
  table { border-collapse: collapse; width: 100%; background: #fff; box-shadow: 0 1px 2px #0002; }
  th, td { text-align: left; padding: 6px 10px; border-bottom: 1px solid #e4e6eb; white-space: nowrap; }
  th { background: #eef0f4; font-weight: 600; }
  td.progress { width: 40%; }
  .bar { position: relative; height: 16px; background: #e4e6eb; border-radius: 3px; overflow: hidden; }
  .fill { height: 100%; background: #3d7be0; }
  .pct { position: absolute; top: 0; left: 6px; font-size: 12px; line-height: 16px; }
  .empty { color: #667; font-style: italic; }
  .name { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
</style>
</head>
<body>
<h1>croupier coordinator</h1>
<div id="updated">loading&hellip;</div>
<div id="note"></div>
<noscript>This page needs JavaScript; the same data is at <a href="api/jobs">api/jobs</a>.</noscript>
<table>
<thead><tr><th>job</th><th>generation</th><th>world</th><th>epoch</th><th>progress</th><th>slowest rank</th>
<th>last activity</th></tr></thead>
<tbody id="jobs"></tbody>
</table>
<div id="pages"></div>
<div id="ranks"></div>
<script>""" + _SCRIPT + """</script>
</body>
</html>
"""

#: Only the page's own inline script may run, and it may only fetch from this endpoint.
PAGE_CSP = ("default-src 'none'; style-src 'unsafe-inline'; connect-src 'self'; "
            f"script-src 'sha256-{base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()}'")
