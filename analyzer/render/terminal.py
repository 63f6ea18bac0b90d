"""Terminal tables (rich). Colour only on a TTY; plain text when piped."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvtrace.analyzer.results import Diff, Summary
from kvtrace.analyzer.findings import read_first
from kvtrace.analyzer.kernels import KernelList
from kvtrace.analyzer.headline import APPEND_PHASE, CONTROL, Headline
from kvtrace.analyzer.render.escape import rich, visible
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.render.units import (HEAD_TIMES, LEVEL, PART, arm_time, calls, duration, head_time,
                                          no_change_band, numbered_notes, per_call, percent, ratio, row_interval,
                                          run_ratios, signed_duration, summary_part)
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.analyzer.verify import MISMATCHES_SHOWN

_STYLE = {Verdict.REGRESSION: "red", Verdict.IMPROVEMENT: "green"}


def kernels(kernels: KernelList, console: Console) -> None:
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


def summary(summary: Summary, console: Console) -> None:
    arm = summary.arm
    console.print(f"[bold]{rich(arm.label)}[/]: {rich(arm.info.gpu_label)}, Nsight Systems "
                  f"{rich(arm.info.product_version)}, {arm.info.kernel_count:,} kernels, {duration(arm.total_ns)} "
                  "GPU kernel time")
    parted = any(r.launch or r.nvtx_range for r in summary.families)
    for title, rows, with_family in (("Segments", summary.segments, False),
                                     ("Kernel families", summary.families, True)):
        table = Table(title=title, title_justify="left")
        family = (["family"] + ([PART] if parted else [])) if with_family else []
        for column in ["segment", *family, "calls", "total", "share", "per call", "median", "p90", "KV dtype"]:
            table.add_column(column, justify="left" if column in ("segment", "family", PART, "KV dtype") else "right")
        for r in rows:
            family = ([rich(r.family_label)] + ([rich(summary_part(r))] if parted else [])) if with_family else []
            table.add_row(r.segment, *family, f"{r.stats.calls:,}", duration(r.stats.total_ns), percent(r.stats.share),
                          per_call(r.stats, r.cells), duration(r.stats.median_ns), duration(r.stats.p90_ns),
                          rich(", ".join(r.kv_dtypes) or "–"))
        console.print(table)


def head(diff: Diff, console: Console, *, statements: bool = True) -> None:
    """The answer first, in 100 columns: one table per question, its families in the title; `statements`: the
    head's own statements (the report lists them among its statements)."""
    head = diff.headline or Headline.of(diff)
    b, c = diff.baseline, diff.candidate
    for finding in read_first(diff.findings):
        console.print(f"{LEVEL[finding.level]}  {rich(finding.message)}", highlight=False)
    console.print(f"baseline [bold]{rich(b.label)}[/] → candidate [bold]{rich(c.label)}[/] on {rich(b.info.gpu_label)}: "
                  f"{HEAD_TIMES}, ratio {rich(c.label)}/{rich(b.label)} with its {100 * diff.confidence:.0f}% interval "
                  "and the no-change band its verdict used", highlight=False)
    # One table per question and kernel (decode attention apart from its merge kernel); the controls in one.
    tables = list(dict.fromkeys((r.question, None if r.question == CONTROL else r.family) for r in head.rows))
    for question, family in tables:
        rows = [r for r in head.rows if r.question == question and family in (None, r.family)]
        families = " | ".join(dict.fromkeys(r.family for r in rows))
        table = Table(title=f"{question} · {rich(families)}", title_justify="left", box=None, padding=(0, 1),
                      title_style="bold")
        for column in ("point", rich(b.label), rich(c.label), "ratio", "interval", "band", "verdict", "pairs"):
            table.add_column(column, justify="left" if column in ("point", "verdict") else "right", overflow="fold")
        for r in rows:
            row = r.row
            style = _STYLE.get(row.verdict)
            table.add_row(rich(r.point), head_time(r.baseline_ns, r.mixed), head_time(r.candidate_ns, r.mixed),
                          ratio(row.ratio), row_interval(row), no_change_band(row, diff.threshold),
                          f"[{style}]{row.verdict}[/]" if style else row.verdict, f"{row.compared_calls:,}")
        console.print(table)
    if any(r.question == APPEND_PHASE for r in head.rows):
        console.print("  KV append phase: one call is one append with the kernels launched since the previous one "
                      "(FP8's cast and copy, NVFP4's fused quantize-append)", highlight=False)
    for statement in head.query_quantize if statements else ():
        console.print(f"  {statement_text(statement, visible)}", markup=False, highlight=False)
    if head.drift:
        console.print(f"  drift: {visible(head.drift)}", markup=False, highlight=False)
    for outcome in diff.verification.outcomes() if diff.verification is not None else []:
        console.print(f"  {'ok' if outcome.agrees else 'MISMATCH'}  {visible(outcome.summary)}", markup=False,
                      highlight=False)
        for line in outcome.mismatches[:MISMATCHES_SHOWN]:
            console.print(f"    {visible(line)}", markup=False, highlight=False)
    console.rule("everything else", style="dim")


def diff(diff: Diff, console: Console) -> None:
    head(diff, console)
    body(diff, console)


def body(diff: Diff, console: Console) -> None:
    """Everything after the head: totals, findings, every table with its notes."""
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
            # Segment and verdict whole, whatever the width; the other cells fold rather than lose their end.
            table.add_column(rich(column), justify="left" if column in ("segment", "family", "phase", "verdict")
                             else "right", overflow="fold", no_wrap=column in ("segment", "verdict"))
        verdicts, notes = numbered_notes(rows)
        for r, verdict in zip(rows, verdicts):
            style = _STYLE.get(r.verdict)
            table.add_row(*lead(r), " / ".join(calls(r)), arm_time(r.baseline, r.cells),
                          arm_time(r.candidate, r.cells), ratio(r.ratio), row_interval(r),
                          *([run_ratios(r)] if diff.runs > 1 else []),
                          f"[{style}]{rich(verdict)}[/]" if style else rich(verdict), signed_duration(r.total_delta_ns),
                          percent(r.abs_delta_share))
        console.print(table)
        for i, text in enumerate(notes, 1):
            console.print(f"  [{i}] {visible(text)}", markup=False, highlight=False)
