"""The table models of the serving report, shared by its markdown and terminal renderers, and the cell formats
they and analyzer/render/matrix.py use.

Both read a result object (analyzer.report.Report) and compute nothing new: the tables below only pick and format
its fields. The report's markdown is report_markdown.py's, its terminal tables report_terminal.py's, its CSV
report_csv.py's; the capacity calculation's are capacity.py's.
"""

from __future__ import annotations

from rich.table import Table

from kvtrace.analyzer.render.escape import rich
from kvtrace.analyzer.render.units import duration, estimate_ratio, interval, percent, ratio
from kvtrace.analyzer.report import Report
from kvtrace.analyzer.serving import Latency, ServingMetrics, SourceCheck
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


def _rich_table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=rich(title), title_justify="left")
    for index, column in enumerate(header):
        table.add_column(rich(column), justify="left" if index == 0 else "right", overflow="fold")
    for row in rows:
        table.add_row(*[rich(cell) for cell in row])
    return table

