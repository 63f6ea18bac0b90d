"""Terminal tables for the serving report (analyzer.report.Report)."""

from __future__ import annotations

from rich.console import Console

from kvtrace.analyzer.render import quality as quality_render
from kvtrace.analyzer.render import repro as repro_render
from kvtrace.analyzer.render import terminal as diff_terminal
from kvtrace.analyzer.render.capacity import capacity_terminal
from kvtrace.analyzer.render.escape import rich, visible
from kvtrace.analyzer.render.report_tables import (SECTIONS, STEP_LEAD, _bandwidth_table, _compute_lead,
                                                  _compute_table, _rate, _rich_table, _serving_notes,
                                                  _serving_point_table, _serving_sweep_table, _step_table)
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.render.units import LEVEL, shown_path
from kvtrace.analyzer.report import Report


def report_terminal(report: Report, console: Console) -> None:
    diff_terminal.head(report.diff, console, statements=False)
    b, c = report.baseline, report.candidate
    if report.quality is not None:
        quality_render.terminal(report.quality, b.label, c.label, console)
    console.print(f"[bold]{rich(b.label)}[/] ({rich(shown_path(b.run))}) → "
                  f"[bold]{rich(c.label)}[/] ({rich(shown_path(c.run))})")
    for words in (b.patch_words(), c.patch_words()):
        if words:
            console.print(f"  {LEVEL['warning']}  ", end="")
            console.print(visible(words), markup=False, highlight=False)
    if report.left_out:
        console.print(f"  {LEVEL['warning']}  ", end="")
        console.print(visible(report.left_out), markup=False, highlight=False)
    for name in SECTIONS:
        _SECTIONS[name](report, console)


# ---- the sections after the head, in report_tables.SECTIONS order ----------------------------------------

def _statements(report: Report, console: Console) -> None:
    for s in report.statements:
        console.print(f"  {LEVEL[s.level]}  {s.check}: ", end="")
        console.print(statement_text(s, visible), markup=False, highlight=False)


def _runs(report: Report, console: Console) -> None:
    for f in report.findings:
        console.print(f"  {LEVEL[f.level]}  {rich(f.message)}", highlight=False)
    for note in report.notes:
        console.print(f"  {visible(note)}", markup=False, highlight=False)


def _serving(report: Report, console: Console) -> None:
    if not report.serving:
        return
    if len(report.serving) == 1:
        console.print(_rich_table("Serving", *_serving_point_table(report)))
    else:
        console.print(_rich_table("Serving sweep (◆ first capacity-bound point per context length)",
                                  *_serving_sweep_table(report)))
    for level, text in _serving_notes(report):
        console.print(f"  {LEVEL[level]}  ", end="")
        console.print(text, markup=False, highlight=False)


def _repro(report: Report, console: Console) -> None:
    if not report.repro:
        return
    for line in repro_render.split_lines(report.repro, report.baseline.versions.get("flashinfer")):
        console.print(f"  {visible(line)}", markup=False, highlight=False)
    console.print(_rich_table("Route against format (kvtrace repro)", *repro_render.split_table(report.repro)))
    for note in repro_render.split_notes(report.repro):
        console.print(f"  {visible(note)}", markup=False, highlight=False)


def _bandwidth(report: Report, console: Console) -> None:
    if not report.bandwidth:
        return
    ceiling = report.hbm_ceiling
    title = "Achieved bandwidth" + (f" (ceiling {_rate(ceiling.bytes_per_s)}: {ceiling.gpu} memoryBandwidth "
                                    "from the trace)" if ceiling else "")
    console.print(_rich_table(title, *_bandwidth_table(report)))


def _steps(report: Report, console: Console) -> None:
    if report.step_timeline:
        console.print(_rich_table("vLLM steps on the GPU (paired steps, per step)", *_step_table(report)))
        console.print(f"  {STEP_LEAD}", markup=False, highlight=False)


def _compute(report: Report, console: Console) -> None:
    if report.prefill_compute:
        console.print(_rich_table("Achieved compute (prefill)", *_compute_table(report)))
        console.print(f"  {visible(_compute_lead(report))}", markup=False, highlight=False)


def _capacity(report: Report, console: Console) -> None:
    if report.capacity is not None:
        capacity_terminal(report.capacity, console)


def _plots(report: Report, console: Console) -> None:
    for plot in report.plots:
        console.print(f"  plot: {plot.path}", markup=False, highlight=False)


def _quality(report: Report, console: Console) -> None:
    if report.quality is not None:
        quality_render.terminal_table(report.quality, report.baseline.label, report.candidate.label, console)


def _kernels(report: Report, console: Console) -> None:
    console.print("[bold]Kernel diff[/]")
    diff_terminal.body(report.diff, console)


_SECTIONS = {"statements": _statements, "runs": _runs, "serving": _serving, "repro": _repro,
             "bandwidth": _bandwidth, "steps": _steps, "compute": _compute, "capacity": _capacity, "plots": _plots,
             "quality": _quality, "kernels": _kernels}
