"""The join storm's and steady training's tables and plot (benchmarks/scale_bench.py), each figure beside its target."""

from __future__ import annotations

import math
import pathlib
from typing import Any

from baseline import CURRENT
from scale_recovery import verdict

#: First batch p99 after the last join at most this many times the bare grpc.aio ceiling's, in the same run.
TARGET_CEILING_RATIO = 1.2
#: CPU-seconds per joining rank may grow at most this much from the smallest world to the largest.
TARGET_FLAT = 1.5
#: The coordinator's cores in steady training of 16,384 ranks at the default lease (256 batches a grant, a step
#: a second), as the threaded server took them (results/scale.md of 2026-11-26): the new serving's bound.
TODAY_STEADY_CORES, TODAY_STEADY_LEASE = 0.054, 256
#: Grant p99 in steady training stays below this (ms).
TARGET_STEADY_P99_MS = 10.0


def _storm_target(r: dict[str, Any]) -> str:
    c = r["ceiling"]
    ratio = r["first_p99_ms"] / c["p99_ms"] if c["p99_ms"] else math.inf
    parts = [f"p99 <= {TARGET_CEILING_RATIO:g}x ceiling: {verdict(ratio <= TARGET_CEILING_RATIO)}",
             f"0 cancelled: {verdict(r['cancelled'] + r['cancelled_grants'] == 0)}",
             f"every first grant within 1 s: {verdict(r['ungranted'] == 0)}"]
    if r["ungranted"] and c["second_over_1s"]:
        parts[-1] += f" (the bare server's own second calls: {c['second_over_1s']:,} over 1 s)"
    return "; ".join(parts)


def render(rows: list[dict[str, Any]]) -> str:
    """The storm's table: a row per world size and serving, with the ceiling of that world size, ratios and targets."""
    head = ("| ranks | serving, join poll | first batch after the last join p50 / p99 / max | ceiling: bare grpc.aio "
            "p50 / p99 | p99 / ceiling's | cancelled by the server: joins (asked again) / first grants "
            "| refused: admission / waits "
            "| ungranted within 1 s (ceiling: second call over 1 s) | coordinator CPU per rank | RSS per rank "
            "| joins/s | target |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        c = r["ceiling"]
        ratio = r["first_p99_ms"] / c["p99_ms"] if c["p99_ms"] else math.inf
        cells = [f"{r['world']:,}", f"{r['serving']}, {r['poll_ms'] / 1000:g} s poll",
                 f"{r['first_p50_ms']:.0f} / {r['first_p99_ms']:.0f} / {r['first_max_ms']:.0f} ms",
                 f"{c['p50_ms']:.0f} / {c['p99_ms']:.0f} ms", f"{ratio:.2f}x", f"{r['cancelled']:,} / {r['cancelled_grants']:,}",
                 f"{r['refused']:,} / {r['refused_waits']:,}", f"{r['ungranted']:,} ({c['second_over_1s']:,})",
                 f"{r['cpu_ms_per_rank']:.2f} ms", f"{r['rss_bytes_per_rank'] / 1024:.1f} KiB", f"{r['joins_per_s']:,.0f}",
                 _storm_target(r)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for serving in dict.fromkeys(r["serving"] for r in rows):
        mine = [r for r in rows if r["serving"] == serving]
        if len(mine) > 1:
            lo, hi = mine[0], mine[-1]
            flat = hi["cpu_ms_per_rank"] / lo["cpu_ms_per_rank"] if lo["cpu_ms_per_rank"] else math.inf
            lines.append(f"- {serving}: CPU per joining rank, {hi['world']:,} ranks / {lo['world']:,} ranks: {flat:.2f} "
                         f"(flat: <= {TARGET_FLAT:g}; {verdict(flat <= TARGET_FLAT)})")
    return "\n".join(lines).rstrip()


def _steady_target(r: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    parts = [f"p99 < {TARGET_STEADY_P99_MS:g} ms: {verdict(r['grant_p99_ms'] < TARGET_STEADY_P99_MS and not r['failed'])}"]
    if r["serving"] == CURRENT.label:  # the targets are this tree's; the baseline's rows are its reference
        if r["lease"] == TODAY_STEADY_LEASE and r["world"] == 16384:
            parts.append(f"<= {TODAY_STEADY_CORES} core (the threaded server's, 2026-11-26): "
                         f"{verdict(r['cores'] <= TODAY_STEADY_CORES)}")
        old = [o for o in rows if o["serving"] != r["serving"] and (o["world"], o["lease"]) == (r["world"], r["lease"])]
        if old:
            o = old[0]["cores"]
            parts.append(f"<= {old[0]['serving']}'s {o:.3f} core in this run ({r['cores'] / o:.2f}x): {verdict(r['cores'] <= o)}")
    return "; ".join(parts)


def render_steady(rows: list[dict[str, Any]]) -> str:
    """Steady training's table: a row per lease and serving."""
    lines = ["| ranks | a grant every | quiet after the storm | grants/s offered (answered) | coordinator cores "
             "| grant p50 / p99 / max | failed | serving | target |", "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['world']:,} | {r['lease']} steps of {r['step_s']:g} s | {r.get('settle_s', math.nan):.1f} s "
            f"| {r['world'] / (r['lease'] * r['step_s']):,.0f} "
            f"({r['grants_per_s']:,.0f}) | {r['cores']:.3f} | {r['grant_p50_ms']:.1f} / {r['grant_p99_ms']:.1f} / "
            f"{r['grant_max_ms']:.1f} ms | {r['failed']} | {r['serving']} | {_steady_target(r, rows)} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    """The storm's figures by world size: first batch p99 of each serving beside the ceiling, and the CPU per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, ScalarFormatter

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    worlds = sorted({r["world"] for r in rows})
    for serving in dict.fromkeys(r["serving"] for r in rows):
        mine = [r for r in rows if r["serving"] == serving]
        w = [r["world"] for r in mine]
        a.plot(w, [r["first_p99_ms"] for r in mine], "o-", label=f"{serving}: first batch p99 after the last join")
        b.plot(w, [r["cpu_ms_per_rank"] for r in mine], "o-", label=f"{serving}")
    ceil = {r["world"]: r["ceiling"]["p99_ms"] for r in rows}
    a.plot(worlds, [ceil[w] for w in worlds], "s--", color="k", label="ceiling here: bare grpc.aio hold and release, p99")
    a.plot(worlds, [ceil[w] * TARGET_CEILING_RATIO for w in worlds], ":", color="k",
           label=f"target: {TARGET_CEILING_RATIO:g}x the ceiling")
    a.set(xscale="log", yscale="log", xlabel="ranks", ylabel="ms", title="time to every rank's first batch")
    a.legend(fontsize=7)
    b.set(xscale="log", xlabel="ranks", ylabel="ms of CPU per rank", title="coordinator CPU per joining rank")
    b.set_ylim(bottom=0)
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.minorticks_off()
        ax.set_xticks(worlds, [f"{w:,}" for w in worlds])
        ax.grid(alpha=0.3)
    a.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    a.yaxis.set_major_formatter(ScalarFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
