"""Plots of a serving report (matplotlib, Agg, no pyplot state): readable without the text.

- segment-times: GPU time of each segment's paired calls for both arms, with the bootstrap interval of each;
- segment-ratios: candidate / baseline per segment with its bootstrap interval and the no-change band;
- ecdf: cumulative distribution of per-call durations of prefill and decode attention, both arms;
- bandwidth: achieved KV bandwidth per workload phase against the GPU's HBM ceiling (FlashInfer runs);
- sweep: TTFT, ITL and preemptions against concurrency, one line per arm and context length (sweeps).

Every function takes the Report and returns a matplotlib Figure (or None when the report has nothing to
draw), whose lines, bars and collections carry the series labels; `write_plots` saves them. Importing this
module imports matplotlib, so only the plotting path imports it (never `kvtrace diff`).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg", force=False)  # no display; harmless when a backend is already chosen
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvtrace import files  # noqa: E402
from kvtrace.analyzer import stats  # noqa: E402
from kvtrace.analyzer.report import PlotFile, Report  # noqa: E402
from kvtrace.errors import KvtraceError  # noqa: E402

FORMATS = ("png", "svg")
_COLORS = ("#1f77b4", "#d62728")  # baseline, candidate
_VERDICT_COLORS = {stats.REGRESSION: "#d62728", stats.IMPROVEMENT: "#2ca02c"}
_DEFAULT_COLOR = "#7f7f7f"
_TITLES = {"prefill_attention": "prefill attention", "decode_attention": "decode attention"}


def _figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _labels(report: Report) -> tuple[str, str]:
    return report.baseline.label, report.candidate.label


def segment_times_figure(report: Report) -> Figure | None:
    rows = [r for r in report.segment_times if r.baseline_total_ns or r.candidate_total_ns]
    if not rows:
        return None
    figure = _figure(8, 0.55 * len(rows) + 1.8)
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
    ax.set_title(f"Paired time per segment: {_labels(report)[0]} vs {_labels(report)[1]}")
    ax.legend(loc="lower right")
    ax.grid(axis="x", which="both", alpha=0.3)
    return figure


def segment_ratios_figure(report: Report) -> Figure | None:
    rows = [r for r in report.segment_times if r.ratio is not None]
    if not rows:
        return None
    threshold = report.diff.band  # the threshold, widened to the measured drift
    figure = _figure(8, 0.5 * len(rows) + 1.8)
    ax = figure.add_subplot()
    positions = list(range(len(rows)))
    band = ax.axvspan(1 - threshold, 1 + threshold, color="#bbbbbb", alpha=0.5,
                      label=f"no-change band (±{100 * threshold:g}%)")
    band.set_gid("no-change-band")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for verdict in dict.fromkeys(r.verdict for r in rows):
        chosen = [(p, r) for p, r in zip(positions, rows) if r.verdict == verdict]
        xs = [r.ratio for _, r in chosen]
        lows = [r.ratio - r.ci_low if r.ci_low is not None else 0.0 for _, r in chosen]
        highs = [r.ci_high - r.ratio if r.ci_high is not None else 0.0 for _, r in chosen]
        container = ax.errorbar(xs, [p for p, _ in chosen], xerr=[lows, highs], fmt="o", capsize=4,
                                color=_VERDICT_COLORS.get(verdict, _DEFAULT_COLOR), label=verdict)
        container.lines[0].set_gid(f"ratios-{verdict.replace(' ', '-')}")
    for p, r in zip(positions, rows):
        ax.annotate(f"{r.ratio:.3f}×", (r.ratio, p), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_yticks(positions, [r.segment for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"{_labels(report)[1]} / {_labels(report)[0]} paired GPU time (log scale; >1 = slower); "
                  f"whiskers: {100 * report.diff.confidence:.0f}% bootstrap interval")
    ax.set_title("Ratio per segment")
    ax.legend(loc="best", fontsize=8)
    ax.grid(axis="x", which="both", alpha=0.3)
    return figure


def ecdf_figure(report: Report) -> Figure | None:
    segments = [s for s in _TITLES if s in report.durations]
    if not segments:
        return None
    figure = _figure(5.5 * len(segments), 4)
    axes = figure.subplots(1, len(segments), squeeze=False)[0]
    for ax, segment in zip(axes, segments):
        for index, (side, color) in enumerate(zip(("baseline", "candidate"), _COLORS)):
            values = report.durations[segment].get(side)
            if values is None or len(values) == 0:
                continue
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            (line,) = ax.step([v / 1e3 for v in values], fractions, where="post", color=color,
                              label=f"{_labels(report)[index]} ({len(values):,} calls)")
            line.set_gid(f"ecdf-{segment}-{side}")
        ax.set_xscale("log")
        ax.set_xlabel("time per call (µs, log scale)")
        ax.set_ylabel("fraction of calls ≤ x")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{_TITLES[segment]}: per-call durations of its kernels (ECDF)", fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3, which="both")
    return figure


def bandwidth_figure(report: Report) -> Figure | None:
    rows = [r for r in report.bandwidth if r.baseline_bytes_per_s or r.candidate_bytes_per_s]
    if not rows:
        return None
    figure = _figure(8, 0.5 * len(rows) + 1.8)
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
                ax.annotate(f"{100 * fraction:.1f}%", (patch.get_width(), patch.get_y() + patch.get_height() / 2),
                            textcoords="offset points", xytext=(3, 0), va="center", fontsize=7)
    if report.hbm_ceiling:
        line = ax.axvline(report.hbm_ceiling.bytes_per_s / 1e12, color="black", linestyle="--",
                          label=f"HBM ceiling {report.hbm_ceiling.bytes_per_s / 1e12:.2f} TB/s "
                                f"({report.hbm_ceiling.gpu}, from the trace)")
        line.set_gid("hbm-ceiling")
    ax.set_yticks(positions, [r.phase.removeprefix("kvtrace:") for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("achieved KV bandwidth (TB/s; labels: % of the ceiling): KV bytes per call / kernel time per call")
    ax.set_title("Achieved bandwidth per workload phase")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return figure


def sweep_figure(report: Report) -> Figure | None:
    rows = [r for r in report.serving if r.concurrency is not None]
    if not report.sweep or len(rows) < 2:
        return None
    panels = (("TTFT (ms)", lambda m: _stat(m.ttft_ms)), ("ITL (ms)", lambda m: _stat(m.itl_ms)),
              ("preemptions", lambda m: m.preemptions))
    figure = _figure(15, 4.2)
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
    figure.suptitle("Sweep per KV format (◇ = first capacity-bound point)")
    return figure


def _stat(latency) -> float | None:
    return latency.p50 if latency.p50 is not None else latency.mean


PLOTS = (("segment-times", "Paired GPU time per segment, both arms, with intervals", segment_times_figure),
         ("segment-ratios", "Ratio per segment with the no-change band", segment_ratios_figure),
         ("ecdf", "Per-call duration distributions (ECDF) of prefill and decode attention", ecdf_figure),
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


def write_plots(report: Report, folder: Path, fmt: str = "png", link_base: Path | None = None) -> list[PlotFile]:
    """Save every plot into folder (created when missing) and record them on the report, with links relative
    to link_base (the report file's folder; the working directory when None)."""
    if fmt not in FORMATS:
        raise KvtraceError(f"--plot-format {fmt}: choose png or svg")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise KvtraceError(f"--plots {folder} is a file: name a folder for the plots")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KvtraceError(f"cannot create --plots folder {folder}: {error.strerror.lower()}") from None
    titles = {kind: title for kind, title, _ in PLOTS}
    written = []
    base = Path(link_base) if link_base is not None else Path.cwd()
    for kind, figure in figures(report).items():
        path = folder / f"{kind}.{fmt}"
        _save(figure, path, fmt)
        link = Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()
        written.append(PlotFile(kind=kind, title=titles[kind], path=str(path), link=link))
    report.plots = written
    return written


def _save(figure: Figure, path: Path, fmt: str) -> None:
    """Atomic, and reproducible: no creation date in the file; SVG text stays text (searchable)."""
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    image = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvtrace"}):
        figure.savefig(image, format=fmt, dpi=110, metadata=metadata)
    files.write(path, image.getvalue())
