"""Plots of a serving report (matplotlib, Agg, no pyplot state): readable without the text.

- summary: the one to drag into an upstream issue: the forest plot beside the ratio against context length;
- forest: candidate / baseline per workload point (context, or vLLM step kind) of prefill attention, decode
  attention and KV append, with intervals, the drift control and each row's no-change band;
- context: the same ratios against context length, one line per phase, each point with its no-change band
  (FlashInfer's context sweep);
- ecdf: cumulative distribution of per-call durations per cell (one context or step kind, one kernel family:
  never pooled, so decode's ~3 µs merge-states kernel has its own panel), both arms;
- segment-times: GPU time of each segment's paired calls for both arms, with the bootstrap interval of each;
- segment-ratios: candidate / baseline per segment with its bootstrap interval and its no-change band;
- bandwidth: achieved KV bandwidth per workload phase against the GPU's HBM ceiling (FlashInfer runs);
- sweep: TTFT, ITL and preemptions against concurrency, one line per arm and context length (sweeps);
- crossover (kvtrace matrix): a sweep's objective for both arms against context and concurrency, capacity-bound
  points and the crossover marked.

Every function takes the Report and returns a matplotlib Figure (or None when the report has nothing to
draw), whose lines, bars and collections carry the series labels, titled with the GPU and the versions the
workload recorded; `write_plots` saves them (tight bounding box: no clipped labels) and returns their files. Importing this
module imports matplotlib, so only the plotting path imports it (never `kvtrace diff`).
"""

from __future__ import annotations

import io
import os
import re
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg", force=False)  # no display; harmless when a backend is already chosen
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.ticker import FixedFormatter, FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from kvtrace import files  # noqa: E402
from kvtrace.analyzer.headline import CONTROL, head_rows, shared_points  # noqa: E402
from kvtrace.analyzer.matrix import OBJECTIVES, Matrix, Scenario  # noqa: E402
from kvtrace.analyzer.render import escape  # noqa: E402
from kvtrace.analyzer.report import PlotFile, Report  # noqa: E402
from kvtrace.analyzer.stats.verdicts import Verdict, no_change_half_width  # noqa: E402
from kvtrace.errors import KvtraceError  # noqa: E402
from kvtrace.manifest import parse_phase_name  # noqa: E402

FORMATS = ("png", "svg")
_COLORS = ("#1f77b4", "#d62728")  # baseline, candidate
# "different work" apart from "no significant change": its pairs are not matched work, whatever their ratio.
_VERDICT_COLORS = {Verdict.REGRESSION: "#d62728", Verdict.IMPROVEMENT: "#2ca02c", Verdict.DIFFERENT_WORK: "#9467bd"}
_DEFAULT_COLOR = "#7f7f7f"
_TITLES = {"prefill_attention": "prefill attention", "decode_attention": "decode attention", "kv_append": "KV append"}
_VERSION_NAMES = {"torch": "torch", "cuda_runtime": "CUDA", "flashinfer": "FlashInfer", "vllm": "vLLM"}
_DPI = 110
_BAND_COLOR = "#bbbbbb"
_BAND_LABEL = "no-change band of each row (its drift band or the threshold)"


def new_figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _labels(report: Report) -> tuple[str, str]:
    return report.baseline.label, report.candidate.label


def heading(report: Report, what: str) -> str:
    """A figure's title: what it shows, the arms, the GPU and the versions the workloads recorded."""
    b, c = report.baseline.versions, report.candidate.versions
    versions = []
    for key, name in _VERSION_NAMES.items():
        values = list(dict.fromkeys(v for v in (b.get(key), c.get(key)) if v))
        if values:
            versions.append(f"{name} {' / '.join(values)}")
    lines = [f"{what}: {_labels(report)[1]} vs {_labels(report)[0]}",
             " · ".join([report.diff.baseline.info.gpu_label, *versions])]
    return "\n".join(lines)


def _where(phase: str | None) -> str:
    """A workload point's short name: the context of a FlashInfer phase, or the phase (vLLM step kind) itself."""
    parsed = parse_phase_name(phase or "")
    return f"ctx {parsed[1]:,}" if parsed else (phase or "all calls").removeprefix("vLLM ")


def _answer_rows(report: Report) -> list[tuple[str, str, object]]:
    """Every row of the diff's head (headline.head_rows), in its order, as (series, point, DiffRow): the series
    names the question, and the kernel where the head answers a point kernel by kernel."""
    rows = head_rows(report.diff)
    split = shared_points(rows)
    out = []
    for r in rows:
        if r.question == CONTROL:
            out.append((f"control · {r.point}", "", r.row))
            continue
        series = r.question + (f" · {_short(r.family)}" if (r.question, r.point) in split else "")
        out.append((series, _where(r.row.phase), r.row))
    return out


def _short(family: str) -> str:
    """A kernel family's name short enough for a tick label, its template arguments kept (they tell kernels apart)."""
    base, bracket, rest = family.partition("[")
    return (base if len(base) <= 24 else base[:22] + "…") + bracket + rest


def _legend_below(ax, columns: int = 1) -> None:
    """The legend under the axes, outside them: it never covers a band or a point."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7, ncols=columns, frameon=False)


def _legend_beside(ax) -> None:
    """The legend right of the axes, outside them."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False)


def _row_bands(ax, report: Report, chosen: list, gid: str) -> None:
    """Each (position, row)'s own grey band, one bar at its position, gid `{gid}-{position}`."""
    halves = [no_change_half_width(r.band, report.diff.threshold) for _, r in chosen]
    bars = ax.barh([p for p, _ in chosen], [2 * h for h in halves], left=[1 - h for h in halves], height=0.8,
                   color=_BAND_COLOR, alpha=0.5, label=_BAND_LABEL, zorder=0)
    for patch, (p, _) in zip(bars.patches, chosen):
        patch.set_gid(f"{gid}-{p}")
        patch.sticky_edges.x.clear()  # the band's edge is no data limit: keep the axis margins


def _forest(ax, report: Report) -> None:
    answer = _answer_rows(report)
    rows = [row for _, _, row in answer]
    drift = report.diff.drift
    labels = [" · ".join(filter(None, (series, point))) + ("" if r.ratio is not None else f" ({r.verdict})")
              for series, point, r in answer]
    if drift is not None and drift.ratio is not None:
        labels.append("drift: KV-independent kernels")
    positions = list(range(len(labels)))
    _row_bands(ax, report, [(p, r) for p, r in zip(positions, rows) if r.ratio is not None], "forest-band")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for verdict in dict.fromkeys(r.verdict for r in rows if r.ratio is not None):
        chosen = [(p, r) for p, r in zip(positions, rows) if r.ratio is not None and r.verdict == verdict]
        container = ax.errorbar([r.ratio for _, r in chosen], [p for p, _ in chosen], xerr=_whiskers(chosen),
                                fmt="o", capsize=4, color=_VERDICT_COLORS.get(verdict, _DEFAULT_COLOR), label=verdict)
        container.lines[0].set_gid(f"forest-{verdict.replace(' ', '-')}")
    if drift is not None and drift.ratio is not None:
        container = ax.errorbar([drift.ratio], [positions[-1]], xerr=_whiskers([(0, drift)]), fmt="s", capsize=4,
                                color="black", label="drift control")
        container.lines[0].set_gid("forest-drift")
    for p, r in zip(positions, rows):
        if r.ratio is not None:
            ax.annotate(f"{r.ratio:.3f}×", (r.ratio, p), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_yticks(positions, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    _ratio_ticks(ax.xaxis)
    ax.set_xlabel(f"{_labels(report)[1]} / {_labels(report)[0]} GPU time of the paired calls (log; >1 = slower); "
                  f"whiskers: {100 * report.diff.confidence:.0f}% interval", fontsize=8)
    ax.set_title("Ratio per workload point", fontsize=10)
    _legend_below(ax)
    ax.grid(axis="x", which="both", alpha=0.3)


def _ratio_ticks(axis) -> None:
    """Ratios on a log axis read as 0.5×, 1×, 2×, 5× (no 2×10⁰ labels, no crowded minor labels)."""
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}×"))
    axis.set_minor_formatter(NullFormatter())


def _whiskers(chosen) -> list[list[float]]:
    return [[r.ratio - r.ci_low if r.ci_low is not None else 0.0 for _, r in chosen],
            [r.ci_high - r.ratio if r.ci_high is not None else 0.0 for _, r in chosen]]


def _context_rows(report: Report) -> dict[str, list]:
    """Per series of the head (_answer_rows), its rows with a ratio at each context length (FlashInfer phases)."""
    out: dict[str, list] = {}
    for series, _, row in _answer_rows(report):
        parsed = parse_phase_name(row.phase or "")
        if parsed and row.ratio is not None:
            out.setdefault(series, []).append((parsed[1], row))
    return {series: sorted(points, key=lambda p: p[0]) for series, points in out.items()
            if len({c for c, _ in points}) >= 2}


def _by_context(ax, report: Report, series: dict[str, list]) -> None:
    ax.axhline(1.0, color="black", linewidth=0.8)
    for index, (name, points) in enumerate(series.items()):
        container = ax.errorbar([c for c, _ in points], [r.ratio for _, r in points],
                                yerr=_whiskers(points),
                                marker="o", capsize=4, label=name)
        segment = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")  # an SVG id of the series' name
        container.lines[0].set_gid(f"context-{segment}")
        # Each point's own band behind it, in its line's colour: the lines' bands differ at one context.
        halves = [no_change_half_width(r.band, report.diff.threshold) for _, r in points]
        bands = ax.vlines([c for c, _ in points], [1 - h for h in halves], [1 + h for h in halves], linewidth=10,
                          colors=container.lines[0].get_color(), alpha=0.25, zorder=0,
                          label=f"{_BAND_LABEL}, in its line's colour" if index == 0 else "_nolegend_")
        bands.set_gid(f"context-band-{segment}")
    contexts = sorted({c for points in series.values() for c, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c:,}" for c in contexts])
    ax.minorticks_off()
    ax.set_yscale("log")
    _ratio_ticks(ax.yaxis)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"{_labels(report)[1]} / {_labels(report)[0]} (log)")
    ax.set_title("Ratio against context length per phase", fontsize=10)
    _legend_beside(ax)
    ax.grid(alpha=0.3, which="both")


def forest_figure(report: Report) -> Figure | None:
    if not _answer_rows(report):
        return None
    figure = new_figure(9, 0.38 * len(_answer_rows(report)) + 3.2)
    _forest(figure.add_subplot(), report)
    figure.suptitle(heading(report, "Ratio per workload point"), fontsize=10)
    return figure


def context_figure(report: Report) -> Figure | None:
    series = _context_rows(report)
    if not series:
        return None
    figure = new_figure(7, 4.5)
    _by_context(figure.add_subplot(), report, series)
    figure.suptitle(heading(report, "Ratio against context length"), fontsize=10)
    return figure


def summary_figure(report: Report) -> Figure | None:
    """The forest plot, beside the ratio against context length where the run swept contexts."""
    if not _answer_rows(report):
        return None
    series = _context_rows(report)
    figure = new_figure(15 if series else 9, 0.38 * len(_answer_rows(report)) + 3.4)
    axes = figure.subplots(1, 2 if series else 1, squeeze=False)[0]
    _forest(axes[0], report)
    if series:
        _by_context(axes[1], report, series)
    figure.suptitle(heading(report, "kvtrace summary"), fontsize=11)
    return figure


def segment_times_figure(report: Report) -> Figure | None:
    rows = [r for r in report.segment_times if r.baseline_total_ns or r.candidate_total_ns]
    if not rows:
        return None
    figure = new_figure(8, 0.55 * len(rows) + 1.8)
    ax = figure.add_subplot()
    height = 0.38
    positions = list(range(len(rows)))
    confidence = f"{100 * report.diff.confidence:.0f}%"
    for index, (side, color) in enumerate(zip(("baseline", "candidate"), _COLORS)):
        label = _labels(report)[index]
        totals = [getattr(r, f"{side}_total_ns") or 0.0 for r in rows]
        lows = [getattr(r, f"{side}_ci_low") for r in rows]
        highs = [getattr(r, f"{side}_ci_high") for r in rows]
        errors = [[m - lo if lo is not None else 0.0 for m, lo in zip(totals, lows)],
                  [hi - m if hi is not None else 0.0 for m, hi in zip(totals, highs)]]
        offset = [p + (index - 0.5) * height for p in positions]
        bars = ax.barh(offset, [m / 1e6 for m in totals], height=height, color=color, label=label,
                       xerr=[[e / 1e6 for e in errors[0]], [e / 1e6 for e in errors[1]]], capsize=3,
                       error_kw={"elinewidth": 1})
        for patch, row in zip(bars.patches, rows):
            patch.set_gid(f"times-{side}-{row.segment}")
    ax.set_yticks(positions, [r.segment for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"GPU time of the paired calls (ms, log scale); whiskers: {confidence} bootstrap interval")
    ax.set_title("Paired time per segment", fontsize=10)
    figure.suptitle(heading(report, "Paired GPU time per segment"), fontsize=10)
    ax.legend(loc="lower right")
    ax.grid(axis="x", which="both", alpha=0.3)
    return figure


def segment_ratios_figure(report: Report) -> Figure | None:
    rows = [r for r in report.segment_times if r.ratio is not None]
    if not rows:
        return None
    figure = new_figure(8, 0.5 * len(rows) + 1.8)
    ax = figure.add_subplot()
    positions = list(range(len(rows)))
    _row_bands(ax, report, list(zip(positions, rows)), "no-change-band")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for verdict in dict.fromkeys(r.verdict for r in rows):
        chosen = [(p, r) for p, r in zip(positions, rows) if r.verdict == verdict]
        container = ax.errorbar([r.ratio for _, r in chosen], [p for p, _ in chosen], xerr=_whiskers(chosen),
                                fmt="o", capsize=4, color=_VERDICT_COLORS.get(verdict, _DEFAULT_COLOR), label=verdict)
        container.lines[0].set_gid(f"ratios-{verdict.replace(' ', '-')}")
    for p, r in zip(positions, rows):
        ax.annotate(f"{r.ratio:.3f}×", (r.ratio, p), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_yticks(positions, [r.segment for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    _ratio_ticks(ax.xaxis)
    ax.set_xlabel(f"{_labels(report)[1]} / {_labels(report)[0]} paired GPU time (log scale; >1 = slower); "
                  f"whiskers: {100 * report.diff.confidence:.0f}% bootstrap interval")
    ax.set_title("Ratio per segment", fontsize=10)
    figure.suptitle(heading(report, "Ratio per segment"), fontsize=10)
    _legend_below(ax, 2)
    ax.grid(axis="x", which="both", alpha=0.3)
    return figure


def ecdf_figure(report: Report) -> Figure | None:
    """One panel per cell (segment, context or step kind, kernel family), both arms in each."""
    cells = list(report.durations)
    if not cells:
        return None
    columns = min(3, len(cells))
    rows = -(-len(cells) // columns)
    figure = new_figure(5.2 * columns, 3.6 * rows + 0.8)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, cell in zip(axes, cells):
        segment, phase, family = cell
        for index, (side, color) in enumerate(zip(("baseline", "candidate"), _COLORS)):
            values = report.durations[cell].get(side)
            if values is None or len(values) == 0:
                continue
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            (line,) = ax.step([v / 1e3 for v in values], fractions, where="post", color=color,
                              label=f"{_labels(report)[index]} ({len(values):,} calls)")
            line.set_gid(f"ecdf-{segment}-{phase}-{family}-{side}")
        ax.set_xlabel("time per call (µs)", fontsize=8)
        ax.set_ylabel("fraction of calls ≤ x", fontsize=8)
        ax.set_ylim(0, 1.02)
        where = f"ctx {parse_phase_name(phase)[1]:,}" if parse_phase_name(phase or "") else (phase or "outside ranges")
        ax.set_title(textwrap.fill(f"{_TITLES[segment]} · {where} · {family}", 48), fontsize=8)
        ax.legend(loc="lower right", fontsize=7)
        ax.grid(alpha=0.3, which="both")
    for ax in axes[len(cells):]:
        ax.set_visible(False)
    figure.suptitle(heading(report, "Per-call durations per cell (ECDF)"), fontsize=10)
    return figure


def bandwidth_figure(report: Report) -> Figure | None:
    rows = [r for r in report.bandwidth if r.baseline_bytes_per_s or r.candidate_bytes_per_s]
    if not rows:
        return None
    figure = new_figure(8, 0.5 * len(rows) + 1.8)
    ax = figure.add_subplot()
    height = 0.38
    positions = list(range(len(rows)))
    for index, (side, color) in enumerate(zip(("baseline", "candidate"), _COLORS)):
        rates = [(getattr(r, f"{side}_bytes_per_s") or 0.0) / 1e12 for r in rows]
        bars = ax.barh([p + (index - 0.5) * height for p in positions], rates, height=height, color=color,
                       label=_labels(report)[index])
        for patch, row in zip(bars.patches, rows):
            patch.set_gid(f"bandwidth-{side}-{row.phase.removeprefix('kvtrace:').replace(' ', '-')}")
        for patch, row in zip(bars.patches, rows):
            fraction = getattr(row, f"{side}_fraction_of_ceiling")
            if fraction is not None:
                ax.annotate(f"{100 * fraction:.2g}%", (patch.get_width(), patch.get_y() + patch.get_height() / 2),
                            textcoords="offset points", xytext=(3, 0), va="center", fontsize=7)
    if report.hbm_ceiling:
        line = ax.axvline(report.hbm_ceiling.bytes_per_s / 1e12, color="black", linestyle="--",
                          label=f"HBM ceiling {report.hbm_ceiling.bytes_per_s / 1e12:.2f} TB/s "
                                f"({report.hbm_ceiling.gpu}, from the trace)")
        line.set_gid("hbm-ceiling")
    ax.set_yticks(positions, [r.phase.removeprefix("kvtrace:") for r in rows])
    ax.invert_yaxis()
    # Log: an append phase at a fraction of a percent of the ceiling is a bar as visible as decode's.
    ax.set_xscale("log")
    ax.set_xlabel("achieved KV bandwidth (TB/s, log scale; labels: % of the ceiling): KV bytes per call / kernel "
                  "time per call")
    ax.set_title("Achieved bandwidth per workload phase (decode, append)", fontsize=10)
    figure.suptitle(heading(report, "Achieved KV bandwidth"), fontsize=10)
    _legend_below(ax, 2)
    ax.grid(axis="x", which="both", alpha=0.3)
    return figure


def sweep_figure(report: Report) -> Figure | None:
    rows = [r for r in report.serving if r.concurrency is not None]
    if not report.sweep or len(rows) < 2:
        return None
    panels = (("TTFT (ms)", lambda m: _stat(m.ttft_ms)), ("ITL (ms)", lambda m: _stat(m.itl_ms)),
              ("preemptions", lambda m: m.preemptions))
    figure = new_figure(15, 4.2)
    axes = figure.subplots(1, len(panels))
    contexts = sorted({r.context for r in rows})
    styles = ("-", "--", ":", "-.")
    for ax, (title, value) in zip(axes, panels):
        for index, (side, color) in enumerate(zip(("baseline", "candidate"), _COLORS)):
            for number, context in enumerate(contexts):
                points = sorted((r for r in rows if r.context == context and getattr(r, side) is not None),
                                key=lambda r: r.concurrency)
                xs = [r.concurrency for r in points]
                ys = [value(getattr(r, side)) for r in points]
                if not any(y is not None for y in ys):
                    continue
                (line,) = ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", color=color,
                                  linestyle=styles[number % len(styles)],
                                  label=f"{_labels(report)[index]}, context {context:,}")
                line.set_gid(f"sweep-{title.split()[0].lower()}-{side}-{context}")
                capped = [(r.concurrency, value(getattr(r, side))) for r in points
                          if getattr(r, f"{side}_first_capacity") and value(getattr(r, side)) is not None]
                if capped:
                    ax.scatter(*zip(*capped), marker="D", s=80, facecolors="none", edgecolors=color, zorder=3,
                               label=f"{_labels(report)[index]} first at capacity" if number == 0 else None)
        ax.set_xscale("log", base=2)
        ticks = sorted({r.concurrency for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_title(f"{title} vs concurrency")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle(heading(report, "Sweep per KV format (◇ = first capacity-bound point)"))
    return figure


def _stat(latency) -> float | None:
    return latency.p50 if latency.p50 is not None else latency.mean


PLOTS = (("summary", "Summary to drag into the issue: ratio per workload point and against context length",
          summary_figure),
         ("forest", "Ratio per workload point with intervals and the drift control", forest_figure),
         ("context", "Ratio against context length per phase", context_figure),
         ("segment-times", "Paired GPU time per segment, both arms, with intervals", segment_times_figure),
         ("segment-ratios", "Ratio per segment with each row's no-change band", segment_ratios_figure),
         ("ecdf", "Per-call duration distributions (ECDF), one panel per context and kernel family", ecdf_figure),
         ("bandwidth", "Achieved KV bandwidth per phase against the HBM ceiling", bandwidth_figure),
         ("sweep", "TTFT, ITL and preemptions against concurrency per KV format", sweep_figure))


def figures(report: Report) -> dict[str, Figure]:
    """Every plot the report has data for, by kind."""
    out = {}
    for kind, _, make in PLOTS:
        figure = make(report)
        if figure is not None:
            out[kind] = figure
    return out


def crossover_figure(matrix: Matrix, scenario: Scenario) -> Figure | None:
    """A sweep's objective against concurrency, one line per arm and context length, with each arm's
    capacity-bound points and the crossover (the first point where only the candidate fits) marked."""
    points = [p for p in scenario.points if p.serving is not None and p.concurrency is not None]
    if not scenario.sweep or len(points) < 2:
        return None
    name, lower_better, _ = OBJECTIVES[matrix.objective]
    unit = "ms" if name.endswith("_ms") else "tokens/s"
    figure = new_figure(7.5, 4.6)
    ax = figure.subplots()
    contexts = sorted({p.context for p in points if p.context is not None})
    styles = ("-", "--", ":", "-.")
    labels = (scenario.baseline, scenario.candidate)
    for index, (side, color) in enumerate(zip(("baseline", "candidate"), _COLORS)):
        marked = False
        for number, context in enumerate(contexts):
            chosen = sorted((p for p in points if p.context == context and getattr(p.serving, side) is not None),
                            key=lambda p: p.concurrency)
            values = [_objective_value(getattr(p.serving, side), name) for p in chosen]
            if not any(v is not None for v in values):
                continue
            (line,) = ax.plot([p.concurrency for p in chosen], [float("nan") if v is None else v for v in values],
                              marker="o", color=color, linestyle=styles[number % len(styles)],
                              label=f"{labels[index]}, context {context:,}")
            line.set_gid(f"crossover-{side}-{context}")
            bound = [(p.concurrency, v) for p, v in zip(chosen, values)
                     if v is not None and getattr(p, f"{side}_capacity")]
            if bound:
                ax.scatter(*zip(*bound), marker="D", s=80, facecolors="none", edgecolors=color, zorder=3,
                           label=None if marked else f"{labels[index]} capacity-bound")
                marked = True
    crossover = next((p for p in points if p.crossover), None)
    if crossover is not None:
        ax.axvline(crossover.concurrency, color=_DEFAULT_COLOR, linestyle=":", linewidth=1.2,
                   label=f"crossover: context {crossover.context:,}, concurrency {crossover.concurrency}")
    ax.set_xscale("log", base=2)
    ticks = sorted({p.concurrency for p in points})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel(f"{matrix.objective.upper() if unit == 'ms' else 'output throughput'} ({unit}, "
                  f"{'lower' if lower_better else 'higher'} is better)")
    ax.set_title(f"{scenario.name}: {matrix.objective} against context and concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    env = scenario.environment
    built = [env.gpu, *(f"{name} {value}" for name, value in (("FlashInfer", env.flashinfer), ("vLLM", env.vllm),
                                                               ("attention backend", env.attention_backend)) if value)]
    figure.suptitle(f"Where the crossover lies (◇ = capacity-bound): {scenario.candidate} vs {scenario.baseline}\n"
                    + " · ".join(built))
    return figure


def _objective_value(metrics, name: str) -> float | None:
    value = getattr(metrics, name)
    return _stat(value) if name.endswith("_ms") else value


def write_matrix_plots(matrix: Matrix, folder: Path, fmt: str = "png", link_base: Path | None = None,
                       inputs=()) -> list[PlotFile]:
    """Each sweep's crossover plot in folder, as write_plots writes a report's."""
    folder = plot_folder(folder, fmt, inputs)
    written = []
    base = Path(link_base) if link_base is not None else Path.cwd()
    for number, scenario in enumerate(matrix.scenarios, 1):
        figure = crossover_figure(matrix, scenario)
        if figure is None:
            continue
        path = folder / f"crossover-{number}.{fmt}"
        save_figure(figure, path, fmt, inputs)
        link = Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()
        written.append(PlotFile(kind="crossover", title=f"{scenario.name}: {matrix.objective} of both arms against "
                                f"context and concurrency, with the crossover", path=str(path), link=link,
                                heading=figure.get_suptitle(),
                                panels=tuple(ax.get_title() for ax in figure.axes if ax.get_visible())))
    return written


def plot_folder(folder: Path, fmt: str, inputs) -> Path:
    if fmt not in FORMATS:
        raise KvtraceError(f"--plot-format {fmt}: choose png or svg")
    folder = Path(folder)
    files.check_folder(folder, inputs)
    if folder.exists() and not folder.is_dir():
        raise KvtraceError(f"--plots {folder} is a file: name a folder for the plots")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KvtraceError(f"cannot create --plots folder {folder}: {error.strerror.lower()}") from None
    return folder


def write_plots(report: Report, folder: Path, fmt: str = "png", link_base: Path | None = None,
                inputs=()) -> list[PlotFile]:
    """Save every plot into folder (created when missing), never onto one of `inputs` (a plot's name may be a
    link to one); its files, with paths relative to link_base (the report file's folder; the working directory
    when None), the figure's title and its panels' titles."""
    folder = plot_folder(folder, fmt, inputs)
    titles = {kind: title for kind, title, _ in PLOTS}
    written = []
    base = Path(link_base) if link_base is not None else Path.cwd()
    for kind, figure in figures(report).items():
        path = folder / f"{kind}.{fmt}"
        save_figure(figure, path, fmt, inputs)
        link = Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()
        written.append(PlotFile(kind=kind, title=titles[kind], path=str(path), link=link, heading=figure.get_suptitle(),
                                panels=tuple(ax.get_title() for ax in figure.axes if ax.get_visible())))
    return written


def _inert(figure: Figure) -> None:
    """Every text drawn as written: never read as mathtext (`$…$` in a GPU or scenario name, a label or a kernel
    family would end the plot with a parse error), control characters as visible escapes (SVG is XML, which has
    no place for them). Tick labels are set again from their formatter at each draw, so its strings are escaped."""
    for text in figure.findobj(Text):
        text.set_parse_math(False)
        text.set_text(escape.plot_text(text.get_text()))
    for axis in (axis for ax in figure.axes for axis in (ax.xaxis, ax.yaxis)):
        formatter = axis.get_major_formatter()
        if isinstance(formatter, FixedFormatter):
            formatter.seq = [escape.plot_text(label) for label in formatter.seq]


def save_figure(figure: Figure, path: Path, fmt: str, inputs) -> None:
    """Atomic, and reproducible: no creation date in the file; SVG text stays text (searchable)."""
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    image = io.BytesIO()
    _inert(figure)
    # Ticks made while drawing take parse_math from here.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvtrace", "text.parse_math": False}):
        figure.savefig(image, format=fmt, dpi=_DPI, metadata=metadata, bbox_inches="tight")
    files.write(path, image.getvalue(), inputs)
