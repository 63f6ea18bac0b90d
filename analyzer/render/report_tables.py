"""Markdown, terminal and CSV for the serving report and the capacity calculation (JSON is json_out's).

Both read a result object (analyzer.report.Report, analyzer.capacity.Capacity) and compute nothing new: the
tables below only pick and format its fields. analyzer.render dispatches these types here.
"""

from __future__ import annotations

import io
from dataclasses import asdict, fields

from rich.console import Console
from rich.table import Table

from kvtrace.analyzer.capacity import Capacity
from kvtrace.analyzer.render import markdown as diff_markdown
from kvtrace.analyzer.render import quality as quality_render
from kvtrace.analyzer.render import terminal as diff_terminal
from kvtrace.analyzer.render.escape import csv_writer, md_code, md_prose, md_text, rich, visible
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.render.units import (LEVEL, MARK, duration, estimate_ratio, interval, markdown_table, percent, ratio,
                                          shown_path)
from kvtrace.analyzer.report import Report
from kvtrace.analyzer.serving import MIN_PEAK_POLLS, Latency, ServingMetrics, SourceCheck
from kvtrace.analyzer.roofline import CAUSAL_CONVENTION

# ---- cell formatting -----------------------------------------------------------------------------------

def _count(value) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def _bytes(value) -> str:
    if value is None:
        return "–"
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if value >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,.0f} B"


def _exact_bytes(value) -> str:
    return "–" if value is None else (f"{value:,.0f} B" if float(value).is_integer() else f"{value:,.2f} B")


def _rate(bytes_per_s) -> str:
    if bytes_per_s is None:
        return "–"
    for scale, unit in ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s")):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.2f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def _ms(value) -> str:
    return "–" if value is None else f"{value:,.1f} ms"


def _latency(lat: Latency | None) -> str:
    """p50 / p90 / p99 when the client measured them, else the mean (offline: vLLM's histogram mean)."""
    if lat is None:
        return "–"
    if lat.p50 is not None:
        return " / ".join(_ms(v).removesuffix(" ms") for v in (lat.p50, lat.p90, lat.p99)) + " ms"
    return f"mean {_ms(lat.mean)}" if lat.mean is not None else "–"


def _cached(m: ServingMetrics | None) -> str:
    if m is None or m.cached_prompt_tokens is None:
        return "–"
    if m.prompt_tokens:
        share = percent(m.cached_prompt_tokens / m.prompt_tokens)
        return f"{_count(m.cached_prompt_tokens)} of {_count(m.prompt_tokens)} ({share})"
    return _count(m.cached_prompt_tokens)


def _peak(m: ServingMetrics | None, name: str, fmt) -> str:
    if m is not None and m.peaks_note:
        return "not observed"
    return fmt(getattr(m, name) if m is not None else None)


def _capacity_bound(m: ServingMetrics | None) -> str:
    """The capacity cell: the observed reason, "cannot tell" where a reason rested on peaks that were not
    observed (capacity_note), else "no"."""
    if m is None:
        return "no"
    return m.capacity or ("cannot tell" if m.capacity_note else "no")


def _check_value(check: SourceCheck, value) -> str:
    return percent(value) if check.unit == "fraction" else _count(value)


def _serving_notes(report: Report) -> list[tuple[str, str]]:
    """(level, text) lines under the serving table: per arm, the quantities whose two sources agree, each
    disagreement with its reason, and the points whose polled peaks are not observations."""
    lines = []
    for side, label in (("baseline", report.baseline.label), ("candidate", report.candidate.label)):
        agreed: dict[str, int] = {}
        rows = [(row, getattr(row, side)) for row in report.serving if getattr(row, side)]
        warnings = []
        for row, metrics in rows:
            where = f" at {row.point}" if len(report.serving) > 1 else ""
            # A point counts once per quantity (two pairs of sources can check one, as cached prompt tokens), and
            # only where every check of it agrees.
            for quantity in dict.fromkeys(c.quantity for c in metrics.checks):
                if all(c.agree for c in metrics.checks if c.quantity == quantity):
                    agreed[quantity] = agreed.get(quantity, 0) + 1
            for check in metrics.checks:
                if not check.agree:
                    warnings.append(("warning", f"{label}{where}: {check.quantity} disagrees: "
                                     f"{_check_value(check, check.first_value)} ({check.first}) against "
                                     f"{_check_value(check, check.second_value)} ({check.second})"
                                     + (f"; {check.note}" if check.note else "")))
            if metrics.peaks_note:
                warnings.append(("warning", f"{label}{where}: {metrics.peaks_note}"))
            if metrics.capacity_note:
                warnings.append(("warning", f"{label}{where}: capacity-bound: cannot tell ({metrics.capacity_note})"))
        if agreed:
            everywhere = all(n == len(rows) for n in agreed.values())
            lines.append(("ok", f"{label}: two sources agree on " + ", ".join(
                quantity + ("" if n == len(rows) else f" ({n} of {len(rows)} points)") for quantity, n in agreed.items())
                + (f" at all {len(rows)} points" if len(rows) > 1 and everywhere else "")))
        lines += warnings
    return lines


def _per_s(value) -> str:
    return "–" if value is None else f"{value:,.0f}/s"


def _seconds(value) -> str:
    return "–" if value is None else f"{value:,.1f} s"


def _wall_time(row) -> list[str]:
    """The point's wall time (the bench's `duration`) per arm, the mean over every run, with candidate / baseline and
    the interval the serving estimate gives one-number-per-run values: over run pairs with --repeats, else none."""
    estimate = row.estimates.get("duration_s")
    if estimate is None:
        return ["–", "–", ""]
    return [_seconds(estimate.baseline), _seconds(estimate.candidate), estimate_ratio(estimate)]


# ---- table models shared by markdown and terminal ----------------------------------------------------

def _serving_point_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """One traffic point: metric rows, one column per arm."""
    row = report.serving[0]
    b, c = row.baseline, row.candidate
    bl, cl = report.baseline.label, report.candidate.label
    header = ["metric", bl, cl, f"{cl} / {bl}"]

    def get(m, name):
        return getattr(m, name) if m is not None else None

    def lat(name: str, stat: str):
        lb, lc = get(b, name), get(c, name)
        return getattr(lb, stat) if lb else None, getattr(lc, stat) if lc else None

    rows = [["traffic", row.point, row.point, ""],
            ["source", get(b, "source") or "–", get(c, "source") or "–", ""],
            ["completed requests", _count(get(b, "requests")), _count(get(c, "requests")), ""]]
    for name, title in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2E latency")):
        for stat in ("p50", "p90", "p99", "mean"):
            vb, vc = lat(name, stat)
            if vb is None and vc is None:
                continue
            rows.append([f"{title} {stat}", _ms(vb), _ms(vc), ratio(row.ratios.get(f"{name}.{stat}"))])
        if name == "ttft_ms":  # cached prompt tokens belong beside TTFT: they are prefill that did not run
            rows.append(["cached prompt tokens", _cached(b), _cached(c), ""])
            rows.append(["prefix-cache hit rate", percent(get(b, "prefix_hit_rate")),
                         percent(get(c, "prefix_hit_rate")), ""])
            rows.append(["mean time queued", _ms(get(b, "queue_ms")), _ms(get(c, "queue_ms")), ""])
    rows += [["input tokens/s", _per_s(get(b, "input_tokens_per_s")), _per_s(get(c, "input_tokens_per_s")),
              ratio(row.ratios.get("input_tokens_per_s"))],
             ["output tokens/s", _per_s(get(b, "output_tokens_per_s")), _per_s(get(c, "output_tokens_per_s")),
              ratio(row.ratios.get("output_tokens_per_s"))],
             ["wall time", *_wall_time(row)],
             ["preemptions", _count(get(b, "preemptions")), _count(get(c, "preemptions")), ""],
             ["peak running requests", _peak(b, "peak_running", _count), _peak(c, "peak_running", _count), ""],
             ["peak KV-cache usage", _peak(b, "peak_kv_usage", percent), _peak(c, "peak_kv_usage", percent), ""],
             ["capacity-bound", _capacity_bound(b), _capacity_bound(c), ""]]
    return header, rows


def _serving_sweep_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """A sweep: one row per grid point; ◆ marks where an arm first hits capacity at that context length."""
    bl, cl = report.baseline.label, report.candidate.label
    header = ["point", f"TTFT {bl}", f"TTFT {cl}", f"cached {bl}", f"cached {cl}", f"ITL {bl}", f"ITL {cl}",
              f"out tok/s {bl}", f"out tok/s {cl}", f"wall {bl}", f"wall {cl}", f"queued {bl}", f"queued {cl}", f"preempt. {bl}",
              f"preempt. {cl}", f"peak KV {bl}", f"peak KV {cl}", "capacity"]
    rows = []
    for row in report.serving:
        b, c = row.baseline, row.candidate
        marks = []
        for label, metrics, first in ((bl, b, row.baseline_first_capacity), (cl, c, row.candidate_first_capacity)):
            if metrics and (metrics.capacity or metrics.capacity_note):
                marks.append(f"{'◆ ' if first else ''}{label}: {_capacity_bound(metrics)}")
        rows.append([row.point, _latency(b.ttft_ms if b else None), _latency(c.ttft_ms if c else None),
                     _cached(b), _cached(c), _latency(b.itl_ms if b else None), _latency(c.itl_ms if c else None),
                     _per_s(b.output_tokens_per_s if b else None), _per_s(c.output_tokens_per_s if c else None),
                     *_wall_time(row)[:2],
                     _ms(b.queue_ms if b else None), _ms(c.queue_ms if c else None),
                     _count(b.preemptions if b else None), _count(c.preemptions if c else None),
                     _peak(b, "peak_kv_usage", percent), _peak(c, "peak_kv_usage", percent),
                     "; ".join(marks) or "–"])
    return header, rows


def _tflops(value: float | None) -> str:
    return "–" if value is None else f"{value / 1e12:,.1f} TFLOP/s"


def _compute_table(report: Report) -> tuple[list[str], list[list[str]]]:
    bl, cl = report.baseline.label, report.candidate.label
    header = ["phase", "TFLOP/call", f"time/call {bl}", f"time/call {cl}", f"achieved {bl}", f"achieved {cl}",
              f"of peak {bl}", f"of peak {cl}"]
    rows = [[r.phase, "not derivable" if r.flops_per_call is None else f"{r.flops_per_call / 1e12:,.3f}",
             duration(r.baseline_ns_per_call), duration(r.candidate_ns_per_call), _tflops(r.baseline_flops_per_s),
             _tflops(r.candidate_flops_per_s), percent(r.baseline_fraction_of_peak),
             percent(r.candidate_fraction_of_peak)] for r in report.prefill_compute]
    return header, rows


def _compute_lead(report: Report) -> str:
    ceiling = report.compute_ceiling
    peak = (f"peak {_tflops(ceiling.flops_per_s)} dense BF16 ({ceiling.gpu}; {ceiling.source})"
            if ceiling and ceiling.flops_per_s else "peak unknown" + (f" for {ceiling.gpu}" if ceiling else ""))
    how = "; ".join(dict.fromkeys(r.derivation for r in report.prefill_compute))
    return (f"Prefill attention is compute-bound: FLOPs per call / the prefill-attention kernels' GPU time per call, "
            f"against the {peak}. {CAUSAL_CONVENTION}. Shapes: {how}.")


STEP_LEAD = ("The vLLM steps both arms ran (same step name, paired in order), per step: the step's kernel time "
             "(overlaps once), its span on the GPU from first kernel start to last kernel end, the time inside that "
             "span with no kernel of the step running, the host's time in the step's NVTX range, and in how many "
             "steps the host stayed in the range until the step's GPU work was nearly done (host held: it left less "
             "than a tenth of the span before the last kernel ended), and the host's waits in the step: runtime "
             "calls inside its range in which the host waited for the GPU (a copy that returned only once done, "
             "a …Synchronize call), how many and the host's time in them (not recorded: the export lacks the copy "
             "and synchronization tables). Ratios are of paired sums, "
             "with 95% intervals over steps (strata by step name and run pair).")


def _step_table(report: Report) -> tuple[list[str], list[list[str]]]:
    b, c = report.baseline.label, report.candidate.label
    header = ["phase", "steps", f"kernels {b}", f"kernels {c}", "ratio", f"span {b}", f"span {c}", "ratio",
              "verdict", f"no kernel {b}", f"no kernel {c}", f"host {b}", f"host {c}", f"host held {b}",
              f"host held {c}", f"host waits {b}", f"host waits {c}"]
    rows = [[r.phase, f"{r.steps:,}", duration(r.baseline_kernel_ns), duration(r.candidate_kernel_ns),
             f"{ratio(r.kernel_ratio)} {interval(r.kernel_low, r.kernel_high)}", duration(r.baseline_span_ns),
             duration(r.candidate_span_ns), f"{ratio(r.span_ratio)} {interval(r.span_low, r.span_high)}",
             r.span_verdict, duration(r.baseline_idle_ns), duration(r.candidate_idle_ns), duration(r.baseline_host_ns),
             duration(r.candidate_host_ns), f"{r.baseline_waited_steps:,}", f"{r.candidate_waited_steps:,}",
             _host_waits(r.baseline_host_waits, r.baseline_host_wait_ns),
             _host_waits(r.candidate_host_waits, r.candidate_host_wait_ns)]
            for r in report.step_timeline]
    return header, rows


def _host_waits(calls: float | None, ns: float | None) -> str:
    """Host waits per step and the host's time in them."""
    return "not recorded" if calls is None else f"{calls:,.1f} ({duration(ns)})"


def _bandwidth_table(report: Report) -> tuple[list[str], list[list[str]]]:
    bl, cl = report.baseline.label, report.candidate.label
    header = ["phase", f"KV bytes/call {bl}", f"KV bytes/call {cl}", f"time/call {bl}", f"time/call {cl}",
              f"achieved {bl}", f"achieved {cl}", f"of ceiling {bl}", f"of ceiling {cl}"]
    rows = [[r.phase, _bytes(r.baseline_bytes_per_call), _bytes(r.candidate_bytes_per_call),
             duration(r.baseline_ns_per_call), duration(r.candidate_ns_per_call), _rate(r.baseline_bytes_per_s),
             _rate(r.candidate_bytes_per_s), percent(r.baseline_fraction_of_ceiling),
             percent(r.candidate_fraction_of_ceiling)] for r in report.bandwidth]
    return header, rows


def _capacity_tables(cap: Capacity) -> list[tuple[str, list[str], list[list[str]]]]:
    per_gpu = "per GPU" if cap.tp > 1 else ""
    header = ["format", "stored as", f"bytes/token{' ' + per_gpu if per_gpu else ''}", "ratio", "capacity"]
    if cap.tokens_per_sequence is not None:
        header += [f"{_count(cap.formats[0].tokens)} tokens"]
    if cap.memory_gib is not None:
        header += [f"tokens in {cap.memory_gib:g} GiB"]
    rows = []
    for f in cap.formats:
        row = [f.label, f.format, _exact_bytes(f.bytes_per_token), f"{f.ratio:.4g}", f"{f.capacity_multiplier:.2f}×"]
        if cap.tokens_per_sequence is not None:
            row.append(f"{f.gib_for_tokens:,.4g} GiB ({f.bytes_for_tokens:,} B)")
        if cap.memory_gib is not None:
            row.append(_count(f.tokens_in_memory))
        rows.append(row)
    tables = [("Bytes per token", header, rows)]
    if cap.groups:
        group_header = ["format", "layer group", "layers", f"bytes/token{' ' + per_gpu if per_gpu else ''}"]
        if cap.tokens_per_sequence is not None:
            group_header += ["pages per sequence", f"{_count(cap.formats[0].tokens)} tokens"]
        group_rows = []
        for g in cap.groups:
            row = [g.label, f"sliding window {g.window:,}" if g.window else g.kind, str(g.layers),
                   _exact_bytes(g.bytes_per_token)]
            if cap.tokens_per_sequence is not None:
                row += [_count(g.pages_per_sequence), f"{_bytes(g.bytes_for_tokens)} ({g.bytes_for_tokens:,} B)"]
            group_rows.append(row)
        tables.append(("Per layer group", group_header, group_rows))
    if cap.measured:
        measured = [[m.arm, m.kv_cache_dtype, _count(m.tokens),
                     "–" if m.available_gib is None else f"{m.available_gib:g} GiB",
                     _count(m.ideal_tokens), percent(m.measured_over_ideal),
                     "–" if m.multiplier is None else f"{m.multiplier:.3f}×",
                     "–" if m.ideal_multiplier is None else f"{m.ideal_multiplier:.3f}×"] for m in cap.measured]
        tables.append(("Measured by vLLM (\"GPU KV cache size\") against the ideal",
                       ["arm", "KV dtype", "tokens", "available KV memory", "ideal tokens", "measured / ideal",
                        "tokens vs first arm", "ideal vs first arm"], measured))
    return tables


def _capacity_lead(cap: Capacity) -> str:
    m = cap.model
    parts = [m.describe()]
    if m.source:
        parts.append(f"from {m.source}")
    if m.groups[0].kind == "mla":
        parts.append(f"TP {cap.tp} (the whole latent on every GPU)")
    else:
        parts.append(f"TP {cap.tp} ({cap.kv_heads_per_rank} KV head{'s' if cap.kv_heads_per_rank != 1 else ''} per GPU"
                     + (f", each replicated on {cap.replicas} GPUs" if cap.replicas > 1 else "") + ")")
    parts.append(f"pages of {cap.page_size} tokens")
    if cap.tokens_per_sequence is not None:
        parts.append(f"{_count(cap.tokens_per_sequence)} tokens × {cap.sequences} sequence"
                     + ("s" if cap.sequences != 1 else ""))
    if m.groups[0].kind == "mla":
        math = "Bytes per token count one latent of D values per layer: FP8 = L·D, BF16 = 2·L·D."
    else:
        math = ("Bytes per token count K and V of every " + ("attention " if m.kv_layers != m.layers else "")
                + "layer" + (" (windowed ones until their window is full)" if len(m.groups) > 1 else "")
                + ": FP8 = 2·L·H·D, NVFP4 = 2·L·H·(D/2 + D/16), BF16 = 2·L·H·2D.")
    lead = "Model: " + ", ".join(parts) + ". " + math
    if cap.ideal_ratio is not None:
        lead += (f" {cap.formats[-1].label} / {cap.formats[0].label}: ratio {cap.ideal_ratio:.4g}, capacity "
                 f"{cap.ideal_multiplier:.2f}×.")
    return lead


# ---- markdown -----------------------------------------------------------------------------------------

def capacity_markdown(cap: Capacity, level: str = "##") -> str:
    lines = [f"{level} kvtrace capacity" + (f": {md_text(shown_path(cap.run))}" if cap.run else ""), "",
             md_prose(_capacity_lead(cap)), ""]
    for title, header, rows in _capacity_tables(cap):
        # Labels and the model's source name sit among the numbers: every cell as plain text.
        lines += [f"{level}# {title}", ""] + markdown_table([md_text(h) for h in header],
                                                            [[md_text(c) for c in row] for row in rows]) + [""]
    lines += [f"- {md_prose(note)}" for note in cap.notes]
    return "\n".join(lines).rstrip() + "\n"


def _phase_cells(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """A phase table for markdown: the header (which holds the labels) and the phase names as plain text."""
    return [md_text(h) for h in header], [[md_text(row[0]), *row[1:]] for row in rows]


def _serving_head_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """TTFT per traffic point with each arm's cached prompt tokens beside it: the serving line of the head."""
    bl, cl = report.baseline.label, report.candidate.label
    stats = {row.ttft_stat for row in report.serving if row.ttft_stat}
    stat = stats.pop() if len(stats) == 1 else "p50 or mean"
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
        mean = f"{estimate_ratio(e)}, {e.verdict}" if e else "–"
        rows.append([row.point, *ttft, ratio(row.ttft_ratio), mean, _cached(b), _cached(c), "; ".join(bound) or "no"])
    return header, rows


def _beside_ttft(report: Report, statement) -> bool:
    """The head's serving lines hold the TTFT guard rail and, where serving was measured, what the vLLM steps say
    about it: time the candidate's host spent in its steps, and what held it, is TTFT no kernel row shows."""
    return statement.kind == "ttft" or (statement.kind == "step-timeline" and bool(report.serving))


def _serving_head(report: Report) -> list[str]:
    """The head's serving lines: TTFT beside the cached prompt tokens per traffic point, and the guard rail (the
    TTFT statements, which say when a TTFT change is a prefix-hit or capacity effect rather than kernel speed)."""
    if not report.serving:
        return []
    header, rows = _serving_head_table(report)
    lines = ["", "### Serving: TTFT beside the cached prompt tokens", ""]
    lines += markdown_table([md_text(h) for h in header], [[md_text(cell) for cell in row] for row in rows])
    rail = [s for s in report.statements if _beside_ttft(report, s)]
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
    if report.left_out:  # what the numbers below cover, before any of them
        top += [f"{MARK['warning']} {md_prose(report.left_out)}", ""]
    top += head
    lead = [f"Baseline **{labels[0]}** (arm {md_code(b.arm)} of {md_code(shown_path(b.run))}, {md_text(b.engine)} "
            "engine" + (f", {md_text(b.scenario)}" if b.scenario else "") + f"), candidate **{labels[1]}** (arm "
            f"{md_code(c.arm)} of {md_code(shown_path(c.run))}"
            + (f", {md_text(c.engine)} engine" if c.engine != b.engine else "") + "). Kernel numbers are per call "
            "over the calls both arms ran (the kernel diff below); serving numbers are what the capture recorded. "
            "They answer different questions and are kept apart."]
    sections = [diff_markdown.Section("the report's lead", lead),
                diff_markdown.Section("what the numbers say", ["### What the numbers say", ""] + [
                    f"- {MARK[s.level]} **{s.check}**: {statement_text(s, md_text)}" for s in report.statements
                    if not _beside_ttft(report, s)]),
                diff_markdown.Section("the runs", ["### Runs", ""]
                                      + [f"- {MARK[f.level]} {md_prose(f.message)}" for f in report.findings]
                                      + [f"- {md_prose(note)}" for note in report.notes])]
    if report.serving:
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
        sections.append(diff_markdown.Section("the serving metrics", lines))
    if report.bandwidth:
        ceiling = report.hbm_ceiling
        lines = ["### Achieved bandwidth", "",
                 "KV bytes one workload call reads (append: writes), from the engine's manifest, divided by the GPU "
                 "time of the phase's attention (append) kernels per call in its NVTX range."
                 + (f" Ceiling: {_rate(ceiling.bytes_per_s)}, the {md_prose(ceiling.source)}." if ceiling else
                    " The traces give no HBM bandwidth for the GPU, so no ceiling is stated."), ""]
        sections.append(diff_markdown.Section("the achieved bandwidth",
                                              lines + markdown_table(*_phase_cells(*_bandwidth_table(report)))))
    if report.step_timeline:
        lines = ["### vLLM steps on the GPU", "", STEP_LEAD, ""]
        sections.append(diff_markdown.Section("the vLLM steps", lines + markdown_table(*_step_table(report))))
    if report.prefill_compute:
        lines = ["### Achieved compute (prefill)", "", md_text(_compute_lead(report)), ""]
        sections.append(diff_markdown.Section("the achieved compute",
                                              lines + markdown_table(*_phase_cells(*_compute_table(report)))))
    if report.capacity is not None:
        sections.append(diff_markdown.Section("the capacity", [capacity_markdown(report.capacity, level="###").rstrip()]))
    if report.plots:
        summary = next((p for p in report.plots if p.kind == "summary"), None)
        lines = ["### Plots", ""]
        if summary is not None:
            lines += [f"Drag {md_code(summary.link)} into the issue or pull request: GitHub renders uploaded images, not "
                      "images linked by a relative path. It holds the ratio per workload point with intervals and "
                      "the ratio against context length.", ""]
        sections.append(diff_markdown.Section("the plots", lines + [f"- {md_code(p.link)}: {p.title}"
                                                                   for p in report.plots if p is not summary]))
    if report.quality is not None:
        sections.append(diff_markdown.Section("quality", quality_render.markdown(report.quality, b.label, c.label)))
    kernel = diff_markdown.body(report.diff, 4)
    kernel[0] = diff_markdown.Section(kernel[0].name, ["### Kernel diff", "", *kernel[0].lines])
    sections += kernel
    return diff_markdown.sized(top, "Everything else: statements, runs, serving, bandwidth, capacity, the whole "
                                    "kernel diff", sections,
                               [diff_markdown.footer(report.diff.kvtrace_version, report.diff.recipes)], rest, "report")


# ---- terminal -----------------------------------------------------------------------------------------

def _rich_table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=rich(title), title_justify="left")
    for index, column in enumerate(header):
        table.add_column(rich(column), justify="left" if index == 0 else "right", overflow="fold")
    for row in rows:
        table.add_row(*[rich(cell) for cell in row])
    return table


def capacity_terminal(cap: Capacity, console: Console) -> None:
    console.print(rich(_capacity_lead(cap)), highlight=False)
    for title, header, rows in _capacity_tables(cap):
        console.print(_rich_table(title, header, rows))
    for note in cap.notes:
        console.print(f"  {visible(note)}", markup=False, highlight=False)


def report_terminal(report: Report, console: Console) -> None:
    diff_terminal.head(report.diff, console, statements=False)
    b, c = report.baseline, report.candidate
    if report.quality is not None:
        quality_render.terminal(report.quality, b.label, c.label, console)
    console.print(f"[bold]{rich(b.label)}[/] ({rich(shown_path(b.run))}) → [bold]{rich(c.label)}[/] ({rich(shown_path(c.run))})")
    if report.left_out:
        console.print(f"  {LEVEL['warning']}  ", end="")
        console.print(visible(report.left_out), markup=False, highlight=False)
    for s in report.statements:
        console.print(f"  {LEVEL[s.level]}  {s.check}: ", end="")
        console.print(statement_text(s, visible), markup=False, highlight=False)
    for f in report.findings:
        console.print(f"  {LEVEL[f.level]}  {rich(f.message)}", highlight=False)
    for note in report.notes:
        console.print(f"  {visible(note)}", markup=False, highlight=False)
    if report.serving:
        if len(report.serving) == 1:
            console.print(_rich_table("Serving", *_serving_point_table(report)))
        else:
            console.print(_rich_table("Serving sweep (◆ first capacity-bound point per context length)",
                                      *_serving_sweep_table(report)))
        for level, text in _serving_notes(report):
            console.print(f"  {LEVEL[level]}  ", end="")
            console.print(text, markup=False, highlight=False)
    if report.bandwidth:
        ceiling = report.hbm_ceiling
        title = "Achieved bandwidth" + (f" (ceiling {_rate(ceiling.bytes_per_s)}: {ceiling.gpu} memoryBandwidth "
                                        "from the trace)" if ceiling else "")
        console.print(_rich_table(title, *_bandwidth_table(report)))
    if report.step_timeline:
        console.print(_rich_table("vLLM steps on the GPU (paired steps, per step)", *_step_table(report)))
        console.print(f"  {STEP_LEAD}", markup=False, highlight=False)
    if report.prefill_compute:
        console.print(_rich_table("Achieved compute (prefill)", *_compute_table(report)))
        console.print(f"  {visible(_compute_lead(report))}", markup=False, highlight=False)
    if report.capacity is not None:
        capacity_terminal(report.capacity, console)
    for plot in report.plots:
        console.print(f"  plot: {plot.path}", markup=False, highlight=False)
    if report.quality is not None:
        quality_render.terminal_table(report.quality, b.label, c.label, console)
    console.print("[bold]Kernel diff[/]")
    diff_terminal.body(report.diff, console)


# ---- CSV ----------------------------------------------------------------------------------------------

def capacity_csv(cap: Capacity) -> str:
    buffer = io.StringIO()
    writer = csv_writer(buffer)
    columns = [f.name for f in fields(cap.formats[0])] if cap.formats else ["label"]
    writer.writerow(["section", *columns])
    for row in cap.formats:
        writer.writerow(["format", *("" if v is None else v for v in asdict(row).values())])
    if cap.groups:
        writer.writerow(["section", *(f.name for f in fields(cap.groups[0]))])
        for row in cap.groups:
            writer.writerow(["group", *("" if v is None else v for v in asdict(row).values())])
    if cap.measured:
        measured = [f.name for f in fields(cap.measured[0])]
        writer.writerow(["section", *measured])
        for row in cap.measured:
            writer.writerow(["measured", *("" if v is None else v for v in asdict(row).values())])
    return buffer.getvalue()


def report_csv(report: Report) -> str:
    buffer = io.StringIO()
    writer = csv_writer(buffer)
    # Long format: one value per line, so that every section fits one header.
    writer.writerow(["section", "key", "arm", "metric", "value"])
    labels = {"baseline": report.baseline.label, "candidate": report.candidate.label}
    for s in report.statements:
        writer.writerow(["statement", s.check, "", s.level, statement_text(s)])
    checked = report.diff.verification
    if checked is not None:  # --verify: one line per input and per kernel whose calls or total differ
        stats, *recipe = checked.outcomes()
        writer.writerow(["verify", "", "", "agrees", checked.agrees])
        writer.writerow(["verify", "", "", "summary", stats.summary])
        writer.writerow(["verify", "", "", "recipe", checked.recipe])
        for outcome in recipe:
            writer.writerow(["verify_recipe", "", "", "agrees", outcome.agrees])
            writer.writerow(["verify_recipe", "", "", "summary", outcome.summary])
        for section, inputs in (("verify", checked.inputs), ("verify_recipe", checked.recipe_inputs)):
            for item in inputs:
                for metric in ("agrees", "kernels", "calls", "problem"):
                    value = getattr(item, metric)
                    writer.writerow([section, item.source, "", metric, "" if value is None else value])
                for m in item.mismatches:
                    for metric in ("kvtrace_calls", "kvtrace_total_ns", "nsys_calls", "nsys_total_ns"):
                        value = getattr(m, metric)
                        writer.writerow([f"{section}_mismatch", f"{item.source}: {m.kernel}", "", metric,
                                         "" if value is None else value])
    for row in report.serving:
        for side in ("baseline", "candidate"):
            metrics = getattr(row, side)
            if metrics is None:
                continue
            values = asdict(metrics)
            checks = values.pop("checks")
            values.pop("requests_detail")  # per-request lists: the JSON's
            for name, value in _flatten(values):
                writer.writerow(["serving", row.point, labels[side], name, "" if value is None else value])
            for check in checks:  # one line per source and one for the verdict
                for source, value in ((check["first"], check["first_value"]), (check["second"], check["second_value"])):
                    writer.writerow(["serving_check", row.point, labels[side], f"{check['quantity']}: {source}", value])
                writer.writerow(["serving_check", row.point, labels[side], f"{check['quantity']}: agree",
                                 check["agree"]])
            writer.writerow(["serving", row.point, labels[side], "first_capacity", getattr(row, f"{side}_first_capacity")])
    _write_arm_fields(writer, "segment", "segment", report.segment_times, labels)
    _write_arm_fields(writer, "bandwidth", "phase", report.bandwidth, labels)
    if report.hbm_ceiling:
        writer.writerow(["bandwidth", "ceiling", "", "bytes_per_s", report.hbm_ceiling.bytes_per_s])
    _write_arm_fields(writer, "compute", "phase", report.prefill_compute, labels)
    _write_arm_fields(writer, "steps", "phase", report.step_timeline, labels, skip=("held_by",))
    for row in report.step_timeline:  # what held the candidate's host: one line per field of each kind of wait
        for place, kind in enumerate(row.held_by):
            writer.writerows(["steps_held_by", f"{row.phase} {place + 1}", labels["candidate"], name,
                              "" if value is None else value] for name, value in asdict(kind).items())
    if report.compute_ceiling and report.compute_ceiling.flops_per_s:
        writer.writerow(["compute", "ceiling", "", "flops_per_s", report.compute_ceiling.flops_per_s])
    if report.capacity:
        for row in report.capacity.formats:
            for name, value in asdict(row).items():
                if name != "label":
                    writer.writerow(["capacity", row.label, "", name, "" if value is None else value])
        for row in report.capacity.groups:
            for name, value in asdict(row).items():
                if name not in ("label", "kind"):
                    writer.writerow(["capacity_group", f"{row.label} {row.kind}", "", name,
                                     "" if value is None else value])
        for row in report.capacity.measured:
            for name, value in asdict(row).items():
                if name != "arm":
                    writer.writerow(["capacity_measured", row.arm, "", name, "" if value is None else value])
    if report.quality is not None:
        writer.writerows(quality_render.csv_rows(report.quality, report.baseline.label, report.candidate.label))
    for plot in report.plots:
        writer.writerow(["plot", plot.kind, "", "path", plot.path])
    return buffer.getvalue()


def _flatten(data: dict, prefix: str = ""):
    for name, value in data.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def _write_arm_fields(writer, kind: str, key: str, rows, labels, skip: tuple[str, ...] = ()) -> None:
    """One CSV line per field of each row but `skip`, keyed by the row's `key` field; baseline_/candidate_ fields
    name their arm in the label column."""
    for row in rows:
        for name, value in asdict(row).items():
            if name == key or name in skip:
                continue
            side = next((s for s in ("baseline", "candidate") if name.startswith(s + "_")), None)
            writer.writerow([kind, getattr(row, key), labels[side] if side else "",
                             name.removeprefix(f"{side}_") if side else name, "" if value is None else value])
