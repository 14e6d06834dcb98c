"""The status page: its HTML, its one inline script (the jobs, their ranks, a job's step ledger) and its CSP."""

from __future__ import annotations

import base64
import hashlib

#: The jobs table (a page of jobs, refreshed every 2 s) and each shown job's ranks.
_JOBS = r"""
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
  if (!data.jobs.length) jobs.append(el("tr", {}, el("td", {colspan: "8", class: "empty"}, "no jobs yet")));
  for (const j of data.jobs) {
    const epoch = j.started ? (j.epoch === null ? "-" : j.epoch) : "waiting for " + j.waiting_for + " of " + j.world;
    const slow = j.slowest === null ? "-"
      : j.slowest.lag === 0 ? "in step" : "rank " + j.slowest.rank + ", " + j.slowest.lag + " behind";
    jobs.append(el("tr", {class: "job"}, el("td", {class: "name"}, j.name), el("td", {}, j.generation), el("td", {}, j.world),
                   el("td", {}, epoch), el("td", {class: "progress"}, bar(j.progress)), el("td", {class: "slowest"}, slow),
                   el("td", {}, ago(j.last_activity_age_s)),
                   el("td", {}, el("a", {class: "timeline", href: "#ledger=" + encodeURIComponent(j.name)}, "timeline"))));
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
// The credential the page sends, as "Authorization: Bearer" (a coordinator with credentials wants one): asked for
// when an endpoint answers 401, kept in this tab's sessionStorage only. Never in the URL, which servers, proxies and
// the browser's history keep.
const KEY = "croupier-credential";
function credential() {
  try { return sessionStorage.getItem(KEY); } catch (e) { return null; }
}
async function getJSON(url) {
  const secret = credential();
  const r = await fetch(url, {cache: "no-store", headers: secret ? {"Authorization": "Bearer " + secret} : {}});
  if (!r.ok) {
    const why = (await r.text()).trim() || "HTTP " + r.status;
    if (r.status === 401) askCredential(why);
    throw new Error(why);
  }
  return r.json();
}
function askCredential(why) {
  const box = document.getElementById("login"), shown = box.querySelector("p.error");
  if (shown) { shown.textContent = why; return; }  // asked already: the field stays as the user left it
  const input = el("input", {type: "password", id: "credential", autocomplete: "off", size: "40"});
  const form = el("form", {id: "login-form"}, el("p", {class: "error"}, why), "credential: ", input, " ",
                  el("button", {type: "submit"}, "use it"));
  form.addEventListener("submit", ev => {
    ev.preventDefault();
    try { sessionStorage.setItem(KEY, input.value.trim()); } catch (e) { return; }
    box.replaceChildren();
    refresh(false);
    openLedger();
  });
  box.append(form);
  input.focus();
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
    const data = await getJSON("api/jobs?after=" + encodeURIComponent(after));
    render(data);
    pages(data);
    status.textContent = "updated " + new Date().toLocaleTimeString() + " \u00b7 refreshes every 2 s";
  } catch (e) {
    status.textContent = (e instanceof TypeError ? "cannot reach the coordinator (" + e + ")" : e.message) + "; retrying";
  }
  if (again) setTimeout(refresh, 2000);
}
"""

#: A job's step ledger, opened by the jobs table's "timeline" link (``#ledger=NAME``): its timeline
#: on a step axis (``/api/ledger``), its realized mix of sources (``/api/mix``), and the samples of a
#: step clicked (``/api/step``). Loaded when opened or reloaded, not every 2 s: it computes steps.
_LEDGER = r"""
// ---- one job's step ledger (#ledger=NAME): its timeline on a step axis, its realized mix, a step's samples
const SVG = "http://www.w3.org/2000/svg";
function sv(tag, attrs, ...kids) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
const COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd"];
// The charts' viewBox is W wide: lane labels left of L, the step axis from L to W - R.
const W = 1000, L = 130, R = 12;
function swatch(cls, colour) {
  const s = el("span", {class: "swatch " + cls});
  if (colour) s.style.background = colour;
  return s;
}
function ledgerJob() {
  const m = /^#ledger=(.*)$/.exec(location.hash);
  try { return m ? decodeURIComponent(m[1]) : null; } catch (e) { return null; }
}
function ticks(lo, hi) {
  const raw = (hi - lo) / 6, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const every = Math.max(1, [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw));
  const out = [];
  for (let t = Math.ceil(lo / every) * every; t <= hi; t += every) out.push(t);
  return out;
}
// The job shown, its step axis and the step cursor; `asked` numbers the step requests (the last one wins).
let shown = null, asked = 0;
async function openLedger() {
  const box = document.getElementById("ledger"), job = ledgerJob();
  shown = null;
  box.replaceChildren();
  if (job === null) return;
  const note = el("p", {class: "empty"}, "loading\u2026"), reload = el("button", {type: "button", id: "reload"}, "reload");
  reload.addEventListener("click", openLedger);
  box.append(el("h2", {}, el("span", {class: "name"}, job), " \u00b7 step ledger ", reload, " ", el("a", {href: "#"}, "close")),
             note);
  try {
    const data = await getJSON("api/ledger?job=" + encodeURIComponent(job));
    if (ledgerJob() !== job) return;
    note.remove();
    drawLedger(box, job, data);
  } catch (e) {
    note.className = "error";
    note.textContent = "cannot show the ledger: " + e.message;
  }
}
function markText(m) {
  const where = m.step === null ? "generation " + m.generation + " (no place on the axis)"
    : "step " + m.step + ", generation " + m.generation;
  if (m.kind === "resize") return where + ": the world went from " + m.from_world + " to " + m.to_world + " ranks";
  if (m.kind === "rollback") {
    return where + ": rolled back, below step " + m.from_step + " that generation " + m.previous + " reached";
  }
  const gone = m.removed ? m.removed + " amendment(s) taken back" : "";
  return where + ": deals with " + m.added.concat(gone ? [gone] : []).join("; ");
}
function drawLedger(box, job, data) {
  const placed = data.segments.filter(s => s.from_step !== null);
  const further = data.furthest_step > data.last_step ? " (an abandoned version reached step " + data.furthest_step + ")" : "";
  box.append(el("p", {class: "summary"}, data.segments.length + " generations started \u00b7 the timeline's last step is " +
                                         data.last_step + further));
  for (const s of data.segments.filter(s => s.from_step === null)) {
    box.append(el("p", {class: "empty"}, "generation " + s.generation +
                  " resumed from a checkpoint that named no step: it has no place on the axis"));
  }
  if (!placed.length) {
    if (!data.segments.length) box.append(el("p", {class: "empty"}, "no generation started yet"));
    return;
  }
  const lo = Math.min(...placed.map(s => s.from_step)), hi = Math.max(lo + 1, ...placed.map(s => s.to_step));
  const x = t => L + (t - lo) / (hi - lo) * (W - L - R);
  const lane = Math.max(6, Math.min(22, Math.floor(400 / placed.length))), h = lane - 3, axisY = 8 + placed.length * lane + 4;
  const svg = sv("svg", {id: "timeline", viewBox: "0 0 " + W + " " + (axisY + 22), role: "img",
                         "aria-label": "generations on the step axis; click a step to list its samples"});
  svg.append(sv("defs", {}, sv("pattern", {id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse",
                                           patternTransform: "rotate(45)"},
    sv("rect", {width: 6, height: 6, fill: "#f6dede"}),
    sv("line", {x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#c0392b", "stroke-width": 2}))));
  const laneOf = new Map();
  placed.forEach((s, i) => {
    laneOf.set(s.generation, i);
    const y = 8 + i * lane, keptTo = s.kept_to === null ? s.from_step : Math.min(Math.max(s.kept_to, s.from_step), s.to_step);
    const what = "generation " + s.generation + " (" + s.incarnation + "), world " + s.world + ", steps " +
      (s.from_step + 1) + "\u2013" +
      s.to_step + (s.kept_to === null ? ", abandoned" : keptTo < s.to_step ? ", kept to step " + keptTo : ", kept");
    const g = sv("g", {class: "band", "data-generation": s.generation}, sv("title", {}, what));
    if (keptTo > s.from_step) {
      g.append(sv("rect", {class: "kept", x: x(s.from_step), y: y, width: Math.max(1, x(keptTo) - x(s.from_step)), height: h}));
    }
    if (s.to_step > keptTo) {
      g.append(sv("rect", {class: "abandoned", x: x(keptTo), y: y, width: Math.max(1, x(s.to_step) - x(keptTo)), height: h,
                           fill: "url(#hatch)"}));
    }
    if (s.to_step === s.from_step) g.append(sv("rect", {class: "none", x: x(s.from_step) - 1, y: y, width: 2, height: h}));
    g.append(sv("text", {class: "lane", x: L - 6, y: y + h - 1, "text-anchor": "end", "font-size": Math.max(5, Math.min(12, h))},
                "g" + s.generation + " \u00b7 world " + s.world));
    svg.append(g);
  });
  for (const m of data.marks) {
    if (m.step === null || !laneOf.has(m.generation)) continue;
    const y = 8 + laneOf.get(m.generation) * lane, xm = x(m.step), title = sv("title", {}, markText(m));
    const half = h / 2 + 2;
    if (m.kind === "resize") {
      svg.append(sv("path", {class: "mark resize", d: `M${xm} ${y} l7 ${h / 2} l-7 ${h / 2} z`}, title));
    } else if (m.kind === "amendment") {
      svg.append(sv("path", {class: "mark amendment", d: `M${xm} ${y - 2} l5 ${half} l-5 ${half} l-5 ${-half} z`}, title));
    } else if (laneOf.has(m.previous)) {
      const py = 8 + laneOf.get(m.previous) * lane + h / 2;
      svg.append(sv("path", {class: "mark rollback", d: `M${x(m.from_step)} ${py} L${xm} ${y + h / 2}`}, title));
    }
  }
  svg.append(sv("line", {class: "axis", x1: L, y1: axisY, x2: W - R, y2: axisY}));
  for (const t of ticks(lo, hi)) {
    svg.append(sv("line", {class: "axis", x1: x(t), y1: axisY, x2: x(t), y2: axisY + 4}),
               sv("text", {class: "tick", x: x(t), y: axisY + 16, "text-anchor": "middle"}, t));
  }
  const cursor = sv("line", {class: "cursor", x1: 0, y1: 0, x2: 0, y2: axisY, visibility: "hidden"});
  svg.append(cursor);
  // Step T is the stretch (T - 1, T] of the axis: a click lists the step under it.
  svg.addEventListener("click", ev => {
    const r = svg.getBoundingClientRect(), vx = (ev.clientX - r.left) * W / r.width;
    if (vx >= L && vx <= W - R) showStep(Math.min(hi, Math.max(lo + 1, lo + Math.ceil((vx - L) / (W - L - R) * (hi - lo)))));
  });
  const input = el("input", {type: "text", id: "step-input", size: "10", inputmode: "numeric"});
  const form = el("form", {id: "step-form"}, "click a step, or name one: ", input, " ",
                  el("button", {type: "submit"}, "list its samples"));
  form.addEventListener("submit", ev => { ev.preventDefault(); showStep(input.value.trim()); });
  box.append(svg, el("div", {class: "legend"}, swatch("kept"), "kept", swatch("abandoned"), "abandoned", swatch("resize"),
                     "resize",
                     swatch("rollback"), "rollback", swatch("amendment"), "amendments changed"),
             el("ul", {class: "marks"}, ...data.marks.map(m => el("li", {class: m.kind}, markText(m)))), form);
  const mixed = el("div", {id: "mixed"}, el("p", {class: "empty"}, data.sources === null ? "one source: no mix to show"
                                                                                       : "computing\u2026"));
  box.append(el("h3", {}, "realized mix of sources"), mixed, el("div", {id: "step"}));
  shown = {job: job, x: x, cursor: cursor, mixture: data.sources !== null};
  if (data.sources !== null) drawMix(mixed, job, x);
}
// The mix computes steps (a few a window): it is fetched apart, once the timeline is drawn.
async function drawMix(box, job, x) {
  let mix;
  try {
    mix = await getJSON("api/mix?job=" + encodeURIComponent(job));
  } catch (e) {
    box.replaceChildren(el("p", {class: "error"}, "cannot show the mix: " + e.message));
    return;
  }
  box.replaceChildren();
  if (!mix.series.length) { box.append(el("p", {class: "empty"}, "no kept step yet")); return; }
  const H = 100, svg = sv("svg", {id: "mix", viewBox: "0 0 " + W + " " + (H + 4), role: "img",
                                  "aria-label": "share of each source by window of steps"});
  for (const w of mix.series) {
    const g = sv("g", {class: "window", "data-first": w.first, "data-last": w.last}, sv("title", {},
      "steps " + w.first + "\u2013" + w.last + ", " + w.samples + " samples of steps " + w.steps.join(", ") + ": " +
      w.shares.map((s, k) => "source " + k + " " + pct(s)).join(", ")));
    let y = 2;
    w.shares.forEach((s, k) => {
      if (s <= 0) return;
      g.append(sv("rect", {class: "share", "data-source": k, x: x(w.first - 1), y: y,
                           width: Math.max(1, x(w.last) - x(w.first - 1) - 0.5),
                           height: s * H, fill: COLOURS[k % COLOURS.length]}));
      y += s * H;
    });
    svg.append(g);
  }
  const legend = el("div", {class: "legend"});
  for (let k = 0; k < mix.sources; k++) legend.append(swatch("", COLOURS[k % COLOURS.length]), "source " + k);
  box.append(svg, legend, el("p", {class: "note"}, "The kept steps in at most " + mix.windows + " windows; each window's " +
    "shares are counted over up to " + mix.steps_per_window + " of its steps, spread evenly, until they hold " +
    mix.samples_per_window + " samples (a window's tooltip names its steps)."));
}
async function showStep(step) {
  if (shown === null) return;
  const {job, x, cursor, mixture} = shown, out = document.getElementById("step"), ask = ++asked, t = Number(step);
  cursor.setAttribute("visibility", Number.isInteger(t) ? "visible" : "hidden");
  if (Number.isInteger(t)) for (const a of ["x1", "x2"]) cursor.setAttribute(a, x(t - 0.5));
  out.replaceChildren(el("p", {class: "empty"}, "loading step " + step + "\u2026"));
  try {
    const d = await getJSON("api/step?job=" + encodeURIComponent(job) + "&step=" + encodeURIComponent(step));
    if (ask === asked) drawStep(out, d, mixture);
  } catch (e) {
    if (ask === asked) out.replaceChildren(el("p", {class: "error"}, "step " + step + ": " + e.message));
  }
}
function drawStep(out, d, mixture) {
  out.replaceChildren(el("h3", {"data-step": d.step}, "step " + d.step));
  if (d.kept === null) out.append(el("p", {class: "empty"}, "no kept version: every version of this step was abandoned"));
  const head = ["rank", "micro-batch", "samples", "indices"].concat(mixture ? ["sources", "source epochs"] : []);
  for (const v of (d.kept === null ? [] : [d.kept]).concat(d.abandoned)) {
    const cut = v.batches.some(b => b.count > b.indices.length) ? " (the first " + d.shown + " of each micro-batch shown)" : "";
    const more = v.batch_count > v.batches.length ? "; the first " + v.batches.length + " micro-batches listed" : "";
    const rows = v.batches.map(b => el("tr", {class: "batch", "data-rank": b.rank, "data-micro": b.micro},
      el("td", {}, b.rank), el("td", {}, b.micro), el("td", {class: "count"}, b.count),
      el("td", {class: "indices"}, b.indices.join(" ")),
      ...(mixture ? [el("td", {class: "sources"}, b.sources.join(" ")),
                     el("td", {class: "source-epochs"}, b.source_epochs.join(" "))] : [])));
    out.append(el("section", {class: "version " + (v.kept ? "kept" : "abandoned"), "data-generation": v.generation},
      el("h4", {}, (v.kept ? "kept" : "abandoned") + ": generation " + v.generation + ", world " + v.world +
                   ", epoch " + v.epoch +
                   " \u00b7 " + v.samples + " samples in " + v.batch_count + " micro-batches" + cut + more),
      el("table", {}, el("thead", {}, el("tr", {}, ...head.map(c => el("th", {}, c)))), el("tbody", {}, ...rows))));
  }
}
window.addEventListener("hashchange", openLedger);
openLedger();
refresh();
"""

#: The page's one script.
SCRIPT = _JOBS + _LEDGER

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
  .error { color: #b00020; }
  #ledger svg { display: block; width: 100%; height: auto; background: #fff; box-shadow: 0 1px 2px #0002; }
  #timeline { cursor: crosshair; }
  .band .kept { fill: #2e8b57; }
  .band .none { fill: #667; }
  .lane, .tick { font-family: system-ui, sans-serif; font-size: 11px; fill: #445; }
  .axis { stroke: #889; }
  .mark.resize { fill: #e0a23d; }
  .mark.amendment { fill: #8a63d2; }
  .mark.rollback { stroke: #c0392b; stroke-width: 2; stroke-dasharray: 5 3; fill: none; }
  .cursor { stroke: #1d2330; stroke-width: 1.5; }
  .legend { margin: 6px 0; color: #445; }
  .swatch { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; vertical-align: -2px; }
  .swatch.kept { background: #2e8b57; }
  .swatch.abandoned { background: repeating-linear-gradient(45deg, #f6dede 0 3px, #c0392b 3px 5px); }
  .swatch.resize { background: #e0a23d; }
  .swatch.rollback { background: #c0392b; height: 3px; vertical-align: 3px; }
  .swatch.amendment { background: #8a63d2; transform: rotate(45deg) scale(0.8); }
  ul.marks { margin: 6px 0; padding-left: 20px; }
  .note { color: #667; }
  td.indices, td.sources, td.source-epochs { font-family: ui-monospace, monospace; white-space: normal; }
</style>
</head>
<body>
<h1>croupier coordinator</h1>
<div id="updated">loading&hellip;</div>
<div id="note"></div>
<div id="login"></div>
<noscript>This page needs JavaScript; the same data is at <a href="api/jobs">api/jobs</a> (and a job's step ledger at
api/ledger?job=NAME, a step's samples at api/step?job=NAME&amp;step=T).</noscript>
<table>
<thead><tr><th>job</th><th>generation</th><th>world</th><th>epoch</th><th>progress</th><th>slowest rank</th>
<th>last activity</th><th>steps</th></tr></thead>
<tbody id="jobs"></tbody>
</table>
<div id="pages"></div>
<div id="ledger"></div>
<div id="ranks"></div>
<script>""" + SCRIPT + """</script>
</body>
</html>
"""

#: Only the page's own inline script may run, and it may only fetch from this endpoint.
PAGE_CSP = ("default-src 'none'; style-src 'unsafe-inline'; connect-src 'self'; "
            f"script-src 'sha256-{base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()}'")
