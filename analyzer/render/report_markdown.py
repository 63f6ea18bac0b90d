"""Markdown for the serving report (analyzer.report.Report): the head (the answer, the serving line and its guard
rail, the environment) visible, the rest in <details>."""

from __future__ import annotations

from kvtrace.analyzer.render import markdown as diff_markdown
from kvtrace.analyzer.render import quality as quality_render
from kvtrace.analyzer.render import repro as repro_render
from kvtrace.analyzer.render.capacity import capacity_markdown
from kvtrace.analyzer.render.escape import md_code, md_prose, md_text
from kvtrace.analyzer.render.report_tables import (SECTIONS, STEP_LEAD, _bandwidth_table, _cached, _capacity_bound,
                                                  _compute_lead, _compute_table, _ms, _rate, _serving_notes,
                                                  _serving_point_table, _serving_sweep_table, _step_table)
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.render.units import MARK, estimate_ratio, markdown_table, ratio, shown_path
from kvtrace.analyzer.report import Report
from kvtrace.analyzer.serving import MIN_PEAK_POLLS

def _phase_cells(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """A phase table for markdown: the header (which holds the labels) and the phase names as plain text."""
    return [md_text(h) for h in header], [[md_text(row[0]), *row[1:]] for row in rows]


def _serving_head_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """TTFT per traffic point with each arm's cached prompt tokens beside it: the serving line of the head."""
    bl, cl = report.baseline.label, report.candidate.label
    stat = report.ttft_stat or "p50 or mean"
    # The first run's statistic as recorded, then the mean over every run with its interval and verdict: only the
    # latter is a result (docs/statistics.md, serving intervals).
    header = ["point", f"TTFT {stat} {bl}, first run", f"TTFT {stat} {cl}, first run",
              f"{cl} / {bl}, first run (descriptive: no interval)",
              f"TTFT mean {cl} / {bl}, every run",
              f"cached prompt tokens {bl}", f"cached prompt tokens {cl}", "capacity-bound"]
    rows = []
    for row in report.serving:
        b, c = row.baseline, row.candidate
        ttft = [_ms(getattr(m.ttft_ms, row.ttft_stat)) if m and m.ttft_ms and row.ttft_stat else "–" for m in (b, c)]
        bound = [f"{label}: {_capacity_bound(m)}" for label, m in ((bl, b), (cl, c))
                 if m and (m.capacity or m.capacity_note)]
        e = row.estimates.get("ttft_ms")
        mean = f"{estimate_ratio(e)}, {'not comparable (profile window stall)' if row.window_stalls else e.verdict}" \
            if e else "–"
        rows.append([row.point, *ttft, ratio(row.ttft_ratio), mean, _cached(b), _cached(c), "; ".join(bound) or "no"])
    return header, rows


def _serving_head(report: Report) -> list[str]:
    """The head's serving lines: TTFT beside the cached prompt tokens per traffic point, and the guard rail (the
    TTFT statements, which say when a TTFT change is a prefix-hit or capacity effect rather than kernel speed)."""
    if not report.serving:
        return []
    header, rows = _serving_head_table(report)
    lines = ["", "### Serving: TTFT beside the cached prompt tokens", ""]
    lines += markdown_table([md_text(h) for h in header], [[md_text(cell) for cell in row] for row in rows])
    rail = [s for s in report.statements if report.beside_ttft(s)]
    if rail:
        lines += [""] + [f"- {MARK[s.level]} {statement_text(s, md_text)}" for s in rail]
    return lines


def report_markdown(report: Report, rest: str | None = diff_markdown.WHOLE) -> tuple[str, str | None]:
    """The report for an issue: the head (the answer, the serving line and its guard rail, the environment)
    visible, the rest in <details>; `rest` as diff_markdown.sized takes it."""
    b, c = report.baseline, report.candidate
    labels = md_text(b.label), md_text(c.label)
    # The head's statements and those beside TTFT are in the head already.
    head = diff_markdown.head(report.diff, statements=False, serving=_serving_head(report))
    if report.quality is not None:  # quality beside the phase rows: after them, before the environment
        at = next((i for i, text in enumerate(head) if i and text.startswith("### ")), len(head))
        head[at:at] = [md_text(quality_render.line(report.quality, b.label, c.label)), ""]
    top = [f"## kvtrace report: {labels[0]} → {labels[1]}", ""]
    top += [f"{MARK['warning']} {md_prose(words)}." for words in (b.patch_words(), c.patch_words()) if words]
    top += [""] if top[-1] else []
    if report.left_out:  # what the numbers below cover, before any of them
        top += [f"{MARK['warning']} {md_prose(report.left_out)}", ""]
    top += head
    if report.repro:  # the traced ratio split into route and format: an answer, before <details>
        top += [f"- {md_prose(line)}" for line in repro_render.split_lines(report.repro, b.versions.get("flashinfer"))]
        top += [""]
    lead = [f"Baseline **{labels[0]}** (arm {md_code(b.arm)} of {md_code(shown_path(b.run))}, {md_text(b.engine)} "
            "engine" + (f", {md_text(b.scenario)}" if b.scenario else "") + f"), candidate **{labels[1]}** (arm "
            f"{md_code(c.arm)} of {md_code(shown_path(c.run))}"
            + (f", {md_text(c.engine)} engine" if c.engine != b.engine else "") + "). Kernel numbers are per call "
            "over the calls both arms ran (the kernel diff below); serving numbers are what the capture recorded. "
            "They answer different questions and are kept apart."]
    sections = [diff_markdown.Section("the report's lead", lead)]
    sections += [section for name in SECTIONS for section in _SECTIONS[name](report)]
    return diff_markdown.sized(top, "Everything else: statements, runs, serving, bandwidth, capacity, the whole "
                                    "kernel diff", sections,
                               [diff_markdown.footer(report.diff.kvtrace_version, report.diff.recipes)], rest, "report")


# ---- the sections after the head, in report_tables.SECTIONS order ----------------------------------------

def _statements(report: Report) -> list[diff_markdown.Section]:
    return [diff_markdown.Section("what the numbers say", ["### What the numbers say", ""] + [
        f"- {MARK[s.level]} **{s.check}**: {statement_text(s, md_text)}" for s in report.statements
        if not report.beside_ttft(s)])]


def _runs(report: Report) -> list[diff_markdown.Section]:
    return [diff_markdown.Section("the runs", ["### Runs", ""]
                                  + [f"- {MARK[f.level]} {md_prose(f.message)}" for f in report.findings]
                                  + [f"- {md_prose(note)}" for note in report.notes])]


def _serving(report: Report) -> list[diff_markdown.Section]:
    if not report.serving:
        return []
    lines = ["### Serving" + (" (sweep)" if report.sweep and len(report.serving) > 1 else ""), ""]
    if len(report.serving) == 1:
        lines += markdown_table(*_serving_point_table(report))
    else:
        lines += ["Latencies are p50 / p90 / p99 (or the mean where only vLLM's histograms exist); cached = "
                  "prompt tokens served from the prefix cache; ◆ marks the first point of a context length at "
                  "which an arm is capacity-bound.", ""]
        lines += markdown_table(*_serving_sweep_table(report))
    notes = _serving_notes(report)
    if notes:
        lines += ["", f"Sources that measure the same quantity, checked against each other; peaks are maxima of "
                  f"/metrics polled during the traffic, observations only with at least {MIN_PEAK_POLLS} polls "
                  "inside it.", ""]
        lines += [f"- {MARK[level]} {md_prose(text)}" for level, text in notes]
    return [diff_markdown.Section("the serving metrics", lines)]


def _repro(report: Report) -> list[diff_markdown.Section]:
    if not report.repro:
        return []
    header, rows = repro_render.split_table(report.repro)
    lines = ["### Route against format (kvtrace repro)", "",
             *markdown_table(header, [[md_text(cell) for cell in row] for row in rows]), ""]
    lines += [f"- {md_prose(note)}" for note in repro_render.split_notes(report.repro)]
    return [diff_markdown.Section("the route against format", lines)]


def _bandwidth(report: Report) -> list[diff_markdown.Section]:
    if not report.bandwidth:
        return []
    ceiling = report.hbm_ceiling
    lines = ["### Achieved bandwidth", "",
             "KV bytes one workload call reads (append: writes), from the engine's manifest, divided by the GPU "
             "time of the phase's attention (append) kernels per call in its NVTX range."
             + (f" Ceiling: {_rate(ceiling.bytes_per_s)}, the {md_prose(ceiling.source)}." if ceiling else
                " The traces give no HBM bandwidth for the GPU, so no ceiling is stated."), ""]
    return [diff_markdown.Section("the achieved bandwidth",
                                  lines + markdown_table(*_phase_cells(*_bandwidth_table(report))))]


def _steps(report: Report) -> list[diff_markdown.Section]:
    if not report.step_timeline:
        return []
    lines = ["### vLLM steps on the GPU", "", STEP_LEAD, ""]
    return [diff_markdown.Section("the vLLM steps", lines + markdown_table(*_step_table(report)))]


def _compute(report: Report) -> list[diff_markdown.Section]:
    if not report.prefill_compute:
        return []
    lines = ["### Achieved compute (prefill)", "", md_text(_compute_lead(report)), ""]
    return [diff_markdown.Section("the achieved compute",
                                  lines + markdown_table(*_phase_cells(*_compute_table(report))))]


def _capacity(report: Report) -> list[diff_markdown.Section]:
    if report.capacity is None:
        return []
    return [diff_markdown.Section("the capacity", [capacity_markdown(report.capacity, level="###").rstrip()])]


def _plots(report: Report) -> list[diff_markdown.Section]:
    if not report.plots:
        return []
    summary = next((p for p in report.plots if p.kind == "summary"), None)
    lines = ["### Plots", ""]
    if summary is not None:
        lines += [f"Drag {md_code(summary.link)} into the issue or pull request: GitHub renders uploaded images, not "
                  "images linked by a relative path. It holds the ratio per workload point with intervals and "
                  "the ratio against context length.", ""]
    return [diff_markdown.Section("the plots", lines + [f"- {md_code(p.link)}: {p.title}"
                                                       for p in report.plots if p is not summary])]


def _quality(report: Report) -> list[diff_markdown.Section]:
    if report.quality is None:
        return []
    return [diff_markdown.Section("quality", quality_render.markdown(report.quality, report.baseline.label,
                                                                     report.candidate.label))]


def _kernels(report: Report) -> list[diff_markdown.Section]:
    kernel = diff_markdown.body(report.diff, 4)
    kernel[0] = diff_markdown.Section(kernel[0].name, ["### Kernel diff", "", *kernel[0].lines])
    return kernel


_SECTIONS = {"statements": _statements, "runs": _runs, "serving": _serving, "repro": _repro,
             "bandwidth": _bandwidth, "steps": _steps, "compute": _compute, "capacity": _capacity, "plots": _plots,
             "quality": _quality, "kernels": _kernels}
