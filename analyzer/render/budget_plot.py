"""The TTFT budget of every point of a matrix as stacked bars (kvtrace matrix --plots): per point, one bar per arm,
queue time, prefill time and the rest, each arm's mean per request over the point's run pairs (the numbers of the
matrix's budget claims); where a trace covers the point's own traffic, the prefill part is split by the traced
prefill steps into their kernels, the GPU waiting on the host inside them, and the prefill time outside the traced
step spans. Above each pair: who wins the point and why, as the table says. One look shows where FP8 stops fitting
(queue time) and why NVFP4 loses at low load (prefill time)."""

from __future__ import annotations

import os
from pathlib import Path

from kvtrace.analyzer import matrix as mx
from kvtrace.analyzer.render.plots import new_figure, plot_folder, save_figure
from kvtrace.analyzer.report import PlotFile

# Parts from the bottom: queue, then prefill (or its traced split), then the rest.
_PARTS = (("queue", "queue time", "#8c564b"), ("prefill", "prefill time", "#1f77b4"),
          ("kernels", "prefill: kernels of the traced steps", "#17becf"),
          ("host", "prefill: GPU waiting on the host (traced steps)", "#d62728"),
          ("untraced", "prefill: outside the traced step spans", "#aec7e8"),
          ("rest", "the rest (frontend and hand-over)", "#bcbd22"))
_COLORS = {key: color for key, _, color in _PARTS}
_WORDS = {key: words for key, words, _ in _PARTS}


def _mark(point: mx.MatrixPoint, scenario: mx.Scenario) -> str:
    if point.winner in ("baseline", "candidate"):
        label = scenario.candidate if point.winner == "candidate" else scenario.baseline
        return f"{label}: {' + '.join(point.causes)}"
    if point.winner == mx.NO_CLEAR_WINNER:
        return "no significant difference"
    if point.winner == mx.NOT_EXPLAINED:
        return "not explained"
    return "not decided"


def budget_figure(matrix: mx.Matrix):
    """The figure, or None where no point has a budget."""
    shown = [(s, p) for s in matrix.scenarios for p in s.points if p.reason is not None and not p.excluded]
    if not shown:
        return None
    figure = new_figure(max(7.0, 1.05 * len(shown) + 2.5), 5.8)
    ax = figure.subplots()
    width, drawn = 0.38, set()
    ticks, labels = [], []
    for place, (scenario, point) in enumerate(shown):
        why = point.reason
        for offset, side, name in ((-width / 2, "baseline", scenario.baseline),
                                   (width / 2, "candidate", scenario.candidate)):
            stack = why.stack(side)
            for part in stack.parts:
                bar = ax.bar(place + offset, part.ms, width * 0.95, bottom=part.bottom_ms, color=_COLORS[part.part],
                             edgecolor="white", linewidth=0.5, label=None if part.part in drawn else _WORDS[part.part])
                bar.patches[0].set_gid(f"budget-R{point.row}-{side}-{part.part}")
                drawn.add(part.part)
            ax.text(place + offset, stack.top_ms, name, ha="center", va="bottom", fontsize=6, rotation=90)
        ax.annotate(_mark(point, scenario), (place, why.stack_top_ms), xytext=(0, 26), textcoords="offset points",
                    ha="center", va="bottom", fontsize=6.5, rotation=20,
                    color="#2ca02c" if point.winner in ("baseline", "candidate") else "#555555")
        ticks.append(place)
        concurrency = f"c={point.concurrency}" if point.concurrency is not None else ""
        traced = "traced" if why.steps is not None else "not traced"
        labels.append(f"R{point.row}\n{concurrency}\n{traced}")
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("mean per request (ms), vLLM's histograms")
    ax.margins(y=0.25)
    ax.grid(axis="y", alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    order = sorted(range(len(names)), key=lambda i: [words for _, words, _ in _PARTS].index(names[i]))
    ax.legend([handles[i] for i in order], [names[i] for i in order], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    env = matrix.scenarios[0].environment
    ax.set_title("TTFT = queue + prefill + the rest, per point and arm; the verdict and what carries it above")
    figure.suptitle(f"The TTFT budget per point: {matrix.scenarios[0].candidate} vs {matrix.scenarios[0].baseline}\n"
                    + " · ".join(v for v in (env.gpu, env.vllm and f"vLLM {env.vllm}",
                                             env.flashinfer and f"FlashInfer {env.flashinfer}") if v))
    return figure


def write_budget_plot(matrix: mx.Matrix, folder: Path, fmt: str = "png", link_base: Path | None = None,
                      inputs=()) -> list[PlotFile]:
    """budget.FMT in folder, as write_matrix_plots writes the crossover plots; [] where nothing has a budget."""
    figure = budget_figure(matrix)
    if figure is None:
        return []
    folder = plot_folder(folder, fmt, inputs)
    path = folder / f"budget.{fmt}"
    save_figure(figure, path, fmt, inputs)
    base = Path(link_base) if link_base is not None else Path.cwd()
    link = Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()
    return [PlotFile(kind="budget", title="the TTFT budget of every point, both arms stacked: queue, prefill (split by "
                     "the traced steps where a trace covers the point) and the rest, with the verdict and what "
                     "carries it", path=str(path), link=link, heading=figure.get_suptitle(),
                     panels=tuple(ax.get_title() for ax in figure.axes if ax.get_visible()))]
