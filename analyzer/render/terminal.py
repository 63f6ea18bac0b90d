"""Terminal tables (rich). Colour only on a TTY; plain text when piped."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvtrace.analyzer.compare import Diff, KernelList, Summary
from kvtrace.analyzer.render.escape import rich, visible
from kvtrace.analyzer.render.units import (LEVEL, arm_time, calls, duration, interval, numbered_notes, per_call, percent,
                                          ratio, run_ratios, signed_duration)
from kvtrace.analyzer.stats import IMPROVEMENT, REGRESSION

_STYLE = {REGRESSION: "red", IMPROVEMENT: "green"}


def render(result: Summary | Diff | KernelList, console: Console) -> None:
    if isinstance(result, KernelList):
        _kernels(result, console)
    elif not isinstance(result, (Summary, Diff)):
        from kvtrace.analyzer.render import report_tables  # kvtrace report / capacity results

        report_tables.terminal(result, console)
    else:
        (_summary if isinstance(result, Summary) else _diff)(result, console)


def _kernels(kernels: KernelList, console: Console) -> None:
    title = "Unclassified kernels" if kernels.only_unclassified else "Kernels"
    table = Table(title=f"{title}: {rich(kernels.arm.label)}", title_justify="left")
    for column in ("segment", "calls", "total", "share", "mean", "recipe", "kernel"):
        table.add_column(column, justify="right" if column in ("calls", "total", "share", "mean") else "left",
                         overflow="fold")
    for r in kernels.rows:
        table.add_row(r["segment"], f"{r['calls']:,}", duration(r["total_ns"]), percent(r["share"]),
                      duration(r["mean_ns"]), rich(r["recipe"] or "–"), rich(r["demangled"]))
    console.print(table)
    if not kernels.rows:
        console.print("every kernel matched a recipe" if kernels.only_unclassified else "no kernels")


def _summary(summary: Summary, console: Console) -> None:
    arm = summary.arm
    console.print(f"[bold]{rich(arm.label)}[/]: {rich(arm.info.gpu_label)}, Nsight Systems "
                  f"{rich(arm.info.product_version)}, {arm.info.kernel_count:,} kernels, {duration(arm.total_ns)} "
                  "GPU kernel time")
    for title, rows, with_family in (("Segments", summary.segments, False), ("Kernel families", summary.families, True)):
        table = Table(title=title, title_justify="left")
        for column in ["segment"] + (["family"] if with_family else []) + ["calls", "total", "share", "per call",
                                                                             "median", "p90", "KV dtype"]:
            table.add_column(column, justify="left" if column in ("segment", "family", "KV dtype") else "right")
        for r in rows:
            table.add_row(r.segment, *([rich(r.family_label)] if with_family else []), f"{r.stats.calls:,}",
                          duration(r.stats.total_ns), percent(r.stats.share), per_call(r.stats, r.cells),
                          duration(r.stats.median_ns), duration(r.stats.p90_ns), rich(", ".join(r.kv_dtypes) or "–"))
        console.print(table)


def _diff(diff: Diff, console: Console) -> None:
    b, c = diff.baseline, diff.candidate
    console.print(f"[bold]{rich(b.label)}[/] → [bold]{rich(c.label)}[/]: total GPU kernel time "
                  f"{duration(b.total_ns)} → {duration(c.total_ns)} ({ratio(diff.total_ratio)})")
    for finding in diff.findings:
        console.print(f"  {LEVEL[finding.level]}  {rich(finding.message)}")
    confidence = f"{100 * diff.confidence:.0f}% CI"
    tables = [("Segments", diff.segments, ["segment"], lambda r: [r.segment])]
    if diff.phases:
        tables.append(("Segments by phase (NVTX range)", diff.phases, ["segment", "phase"],
                       lambda r: [r.segment, rich(r.phase)]))
    tables.append(("Kernel families", diff.families, ["segment", "family"],
                   lambda r: [r.segment, rich(r.family_label)]))
    for title, rows, lead_columns, lead in tables:
        table = Table(title=title, title_justify="left")
        for column in lead_columns + ["calls", f"time {b.label}", f"time {c.label}", "ratio", confidence] + \
                (["runs"] if diff.runs > 1 else []) + ["verdict", "Δ total", "share of |Δ|"]:
            table.add_column(rich(column), justify="left" if column in ("segment", "family", "phase", "verdict")
                             else "right")
        verdicts, notes = numbered_notes(rows)
        for r, verdict in zip(rows, verdicts):
            style = _STYLE.get(r.verdict)
            table.add_row(*lead(r), " / ".join(calls(r)), arm_time(r.baseline, r.cells),
                          arm_time(r.candidate, r.cells), ratio(r.ratio), interval(r.ci_low, r.ci_high),
                          *([run_ratios(r.run_ratios)] if diff.runs > 1 else []),
                          f"[{style}]{rich(verdict)}[/]" if style else rich(verdict), signed_duration(r.total_delta_ns),
                          percent(r.abs_delta_share))
        console.print(table)
        for i, text in enumerate(notes, 1):
            console.print(f"  [{i}] {visible(text)}", markup=False, highlight=False)
