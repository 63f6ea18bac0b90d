"""Human units and table pieces shared by the terminal and markdown renderers."""

from __future__ import annotations

import math
from pathlib import PurePath

from kvtrace.analyzer.render.escape import visible
from kvtrace.analyzer.results import OUTSIDE_RANGES
from kvtrace.analyzer.stats.verdicts import no_change_half_width


def shown_path(path) -> str:
    """A file or run directory as reports show it: its name. Full paths name the machine and user; the
    manifest keeps them, reports do not."""
    return PurePath(str(path)).name or str(path)


def duration(ns: float | None) -> str:
    if ns is None or (isinstance(ns, float) and math.isnan(ns)):
        return "–"
    for scale, unit in ((1e9, "s"), (1e6, "ms"), (1e3, "µs")):
        if abs(ns) >= scale:
            return f"{ns / scale:.2f} {unit}"
    return f"{ns:.0f} ns"


def signed_duration(ns: float) -> str:
    return ("+" if ns > 0 else "−" if ns < 0 else "±") + duration(abs(ns))


def ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}×"


NO_INTERVAL = "no interval"


def interval(low: float | None, high: float | None, why: str | None = None) -> str:
    """An interval as every output prints it: [low, high], else "no interval" (with `why`, where the result says
    why: bootstrap.NO_INTERVAL_WHY). Never nan: an end that is not a finite number is no interval."""
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return f"{NO_INTERVAL} ({why})" if why else NO_INTERVAL
    return f"[{low:.3f}, {high:.3f}]"


def estimate_ratio(estimate) -> str:
    """A serving estimate's candidate / baseline with its interval, and its run pairs where there are several."""
    runs = f", {estimate.runs} runs" if estimate.runs > 1 else ""
    return f"{ratio(estimate.ratio)} {interval(estimate.low, estimate.high)}{runs}"


def row_interval(row) -> str:
    """A table's interval cell of a diff row: "–" where the row has no ratio (not compared), else interval()."""
    return "–" if row.ratio is None else interval(row.ci_low, row.ci_high)


def no_change_band(row, threshold: float) -> str:
    """The row's no-change half-width as the tables print it and the plots shade it; "–" for a row not compared."""
    return "–" if row.band is None else f"±{100 * no_change_half_width(row.band, threshold):.2g}%"


def percent(fraction: float | None) -> str:
    if fraction is None:
        return "–"
    text = f"{100 * fraction:.1f}%"
    return "0.0%" if text == "-0.0%" else text


def arm_time(arm, cells: int) -> str:
    """One arm's time in a row: per call when the row's cells cost the same per call, else the total (a
    pooled mean over different work would describe no call that ran)."""
    if arm is None:
        return "–"
    if arm.mean_ns is not None:
        return f"{duration(arm.mean_ns)}/call"
    return f"{duration(arm.total_ns)} total" + (f", {cells:,} cells" if cells > 1 else "")


# How the head marks a time per call that is the mean over calls of different cost (headline.HeadRow.mixed).
AVG = "avg"
HEAD_TIMES = (f"time per call ({AVG}: the mean over calls of different launch shapes or ranges, as nsys stats' Avg "
              "is, not one call's time; none where no call paired)")


def head_time(ns: float | None, mixed: bool) -> str:
    """One arm's time per call in a head row (headline.HeadRow), marked where it is a mean over different work."""
    return "–" if ns is None else duration(ns) + (f" {AVG}" if mixed else "")


# The column of a summary's family rows that names each row's part of its family (SummaryRow.launch, .nvtx_range).
PART = "launch shape / range"


def summary_part(row) -> str:
    """Which calls of its family a summary row counts: its launch shape and range, or all of them."""
    where = row.nvtx_range if row.nvtx_range in (None, OUTSIDE_RANGES) else f"in {row.nvtx_range}"
    return " ".join(filter(None, [row.launch, where])) or "all"


def per_call(stats, cells: int) -> str:
    """A summary row's mean per call, or that its cells cost different amounts per call."""
    return duration(stats.mean_ns) if stats.mean_ns is not None else f"mixed ({cells:,} cells)"


def run_ratios(row) -> str:
    """A diff row's ratios of its run pairs, lowest to highest (repeated runs)."""
    span = row.run_ratio_range
    if not span:
        return "–"
    return ratio(span[0]) if len(span) == 1 else f"{span[0]:.3f}–{span[1]:.3f}×"


def numbered_notes(rows) -> tuple[list[str], list[str]]:
    """Per diff row, the verdict with references to numbered notes (reasons, pairing notes), and the notes;
    identical texts share one number."""
    notes: list[str] = []
    verdicts = []
    for row in rows:
        refs = []
        for text in (row.reason, row.note):
            if text:
                if text not in notes:
                    notes.append(text)
                refs.append(f"[{notes.index(text) + 1}]")
        verdicts.append(" ".join([row.verdict, *refs]))
    return verdicts, notes


def calls(row) -> tuple[str, str]:
    """Call cells for the two arms: 'compared of total' when only part of an arm's calls were paired."""
    def one(total: int) -> str:
        if row.reason is None and row.compared_calls != total:
            return f"{row.compared_calls:,} of {total:,}"
        return f"{total:,}"
    return one(row.baseline_calls), one(row.candidate_calls)


# How a finding's level shows: a mark in markdown, rich markup on the terminal.
MARK = {"ok": "✅", "info": "ℹ️", "warning": "⚠️", "error": "❌"}
LEVEL = {"ok": "[green]ok[/]", "info": "[cyan]info[/]", "warning": "[yellow]warning[/]", "error": "[bold red]error[/]"}


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """GitHub table lines; pipes and control characters (CR and LF among them) in cells are escaped so that a
    cell never splits the row or ends the table."""
    def cell(text) -> str:
        return visible(text).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def rows_text(rows) -> str:
    """R1, R2, R4–R6."""
    rows = sorted(rows)
    if not rows:
        return "no row"
    spans, start = [], rows[0]
    for prev, cur in zip(rows, rows[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"R{start}" if start == prev else f"R{start}–R{prev}")
            start = cur
    return ", ".join(spans)
