"""Plots of `kvtrace report`: the files are written and hold the expected series (checked on the matplotlib
Figure objects and in the SVG text, not in pixels); matplotlib stays out of `kvtrace diff`."""

from __future__ import annotations

import io
import re
import json
import sqlite3
import subprocess
import sys
from types import SimpleNamespace

import matplotlib.image
import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.container import BarContainer

from conftest import NSYS2025_DIR, RECORDED_REPORT, VLLM_COLD_PREFILL, sql_durations
from kvtrace.analyzer import headline, report
from kvtrace.analyzer.render import plots
from kvtrace.analyzer.stats import verdicts
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.cli import cli

SWEEP = RECORDED_REPORT / "sweep"
PREFILL = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)1%"


@pytest.fixture(scope="module")
def fi(fi_h200_report):
    return fi_h200_report


@pytest.fixture(scope="module")
def sweep(sweep_report):
    return sweep_report


def by_gid(figure, prefix: str) -> dict:
    return {artist.get_gid(): artist for artist in figure.findobj(lambda a: (a.get_gid() or "").startswith(prefix))}


def test_segment_times_show_both_arms_with_intervals(fi):
    figure = plots.segment_times_figure(fi)
    ax = figure.axes[0]
    assert ax.get_legend_handles_labels()[1] == ["fp8", "nvfp4"]
    rows = [r for r in fi.segment_times if r.baseline_total_ns or r.candidate_total_ns]
    assert [t.get_text() for t in ax.get_yticklabels()] == [r.segment for r in rows]
    with sqlite3.connect(f"file:{NSYS2025_DIR / 'fp8.sqlite'}?mode=ro", uri=True) as conn:
        prefill_total = conn.execute("SELECT sum(k.end - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
                                     "ON s.id = k.demangledName WHERE s.value LIKE ?", (PREFILL,)).fetchone()[0]
    bars = by_gid(figure, "times-")
    assert bars["times-baseline-prefill_attention"].get_width() == pytest.approx(prefill_total / 1e6)
    assert {gid.split("-")[1] for gid in bars} == {"baseline", "candidate"}
    bar_containers = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(bar_containers) == 2 and all(c.errorbar is not None for c in bar_containers)  # whiskers: intervals


def shades(figure, gid: str) -> dict[int, tuple[float, float]]:
    """The grey band behind each row of a ratio plot, by the row's position (gid `{gid}-{position}`)."""
    return {int(name.rsplit("-", 1)[1]): (bar.get_x(), bar.get_x() + bar.get_width())
            for name, bar in by_gid(figure, f"{gid}-").items()}


def assert_each_row_has_its_own_band(shaded: dict, rows: dict, threshold: float) -> None:
    """Every compared row is shaded 1 ± the larger of its own band and the threshold, and its verdict reads off that
    picture as the table says: verdicts.verdict given the row's band gives the row's verdict (for `different work`, the
    pairs' own), a `no significant change` row's interval touches its shade, a change has its ratio beyond the shade
    and its whole interval beyond 1 ± band. The rows' shades differ, so one band for all could not pass."""
    assert sorted(shaded) == sorted(rows)
    for position, row in rows.items():
        half = max(threshold, row.band)
        assert shaded[position] == pytest.approx((1 - half, 1 + half)), row
        verdict = row.paired_verdict or row.verdict
        assert verdicts.verdict(SimpleNamespace(ratio=row.ratio, low=row.ci_low, high=row.ci_high), threshold=threshold,
                                drift=row.band) == verdict, row
        if verdict == Verdict.NO_CHANGE:
            assert (row.ci_low or row.ratio) <= 1 + half and (row.ci_high or row.ratio) >= 1 - half, row
        elif verdict == Verdict.REGRESSION:
            assert row.ratio > 1 + half and row.ci_low > 1 + row.band, row
        elif verdict == Verdict.IMPROVEMENT:
            assert row.ratio < 1 - half and row.ci_high < 1 - row.band, row
    assert len({max(threshold, r.band) for r in rows.values()}) > 1


def test_ratio_plot_shades_each_segment_with_its_own_band(fi):
    figure = plots.segment_ratios_figure(fi)
    ax = figure.axes[0]
    compared = [r for r in fi.segment_times if r.ratio is not None]
    segments = {r.segment: r for r in fi.diff.segments}
    assert [r.band for r in compared] == [segments[r.segment].band for r in compared]  # the diff row's band
    assert_each_row_has_its_own_band(shades(figure, "no-change-band"),
                                     {p: segments[r.segment] for p, r in enumerate(compared)}, fi.diff.threshold)
    points = []
    for line in figure.findobj(lambda a: (a.get_gid() or "").startswith("ratios-")):
        points += list(zip(line.get_xdata(), line.get_ydata()))
    assert sorted(x for x, _ in points) == pytest.approx(sorted(r.ratio for r in compared))
    assert ax.get_legend_handles_labels()[1].count(plots._BAND_LABEL) == 1
    svg = io.StringIO()
    figure.savefig(svg, format="svg")
    assert all(f'id="no-change-band-{p}"' in svg.getvalue() for p in range(len(compared)))
    # Ticks read as ratios (1×, 2×, 5×), as on the forest, never 2×10⁰.
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels and all(re.fullmatch(r"[0-9.]+×", label) for label in labels), labels
    # Each verdict drawn has its own colour: "different work" is not "no significant change".
    colours = {gid: line.get_color() for gid, line in by_gid(figure, "ratios-").items()}
    assert len(set(colours.values())) == len(colours) > 1, colours


def context_series(fi) -> dict[str, list]:
    """The head's rows by the context plot's series (SVG id): a question, and a kernel where the head splits its
    points by kernel (decode attention and the merge kernel), each with its rows by context."""
    heads = headline.head_rows(fi.diff)
    out: dict[str, list] = {}
    for r in heads:
        if r.question != headline.CONTROL:
            split = sum((o.question, o.point) == (r.question, r.point) for o in heads) > 1
            name = r.question + (f" {r.family.split('[')[0][:22]} {r.family.partition('[')[2]}" if split else "")
            out.setdefault(re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-"), []).append(
                (int(r.row.phase.split("ctx=")[1].split()[0]), r.row))
    return out


def test_forest_and_context_shade_each_workload_point_with_its_own_band(fi):
    rows = [r.row for r in headline.head_rows(fi.diff)]
    figure = plots.forest_figure(fi)
    assert_each_row_has_its_own_band(shades(figure, "forest-band"), dict(enumerate(rows)), fi.diff.threshold)
    assert plots._BAND_LABEL in figure.axes[0].get_legend_handles_labels()[1]
    figure = plots.context_figure(fi)
    for series, points in context_series(fi).items():
        drawn = by_gid(figure, f"context-band-{series}")[f"context-band-{series}"].get_segments()
        halves = [max(fi.diff.threshold, r.band) for _, r in points]
        assert [tuple(s[:, 0]) for s in drawn] == [(c, c) for c, _ in points]
        assert np.allclose([s[:, 1] for s in drawn], [(1 - h, 1 + h) for h in halves])
    assert any(label.startswith(plots._BAND_LABEL) for label in figure.axes[0].get_legend_handles_labels()[1])


def test_ecdf_has_one_panel_per_cell_never_pooled(fi):
    figure = plots.ecdf_figure(fi)
    lines = by_gid(figure, "ecdf-")
    assert set(lines) == {f"ecdf-{segment}-{phase}-{family}-{side}" for segment, phase, family in fi.durations
                          for side in ("baseline", "candidate")}
    contexts = json.loads((NSYS2025_DIR / "manifest.json").read_text())["settings"]["spec"]["contexts"]
    prefill = [cell for cell in fi.durations if cell[0] == "prefill_attention"]
    # One context and one family each: the ~3 µs merge-states kernel never joins prefill or decode attention.
    assert len(prefill) == len(contexts) and not [c for c in fi.durations if c[0] == "prefill_attention"
                                                  and "MergeStates" in c[2]]
    merge = [cell for cell in fi.durations if "MergeStates" in cell[2]]
    assert merge and all(cell[0] == "decode_attention" for cell in merge)
    phase = "kvtrace:prefill ctx=2048 batch=8"
    expected = sorted(sql_durations(NSYS2025_DIR / "nvfp4.sqlite", PREFILL, nvtx=phase))
    (cell,) = [c for c in prefill if c[1] == phase]
    line = lines[f"ecdf-{cell[0]}-{cell[1]}-{cell[2]}-candidate"]
    assert np.allclose(line.get_xdata(), np.array(expected) / 1e3)
    assert line.get_ydata()[-1] == 1.0 and line.get_ydata()[0] == pytest.approx(1 / len(expected))
    titles = [ax.get_title() for ax in figure.axes if ax.get_visible()]
    assert len(titles) == len(fi.durations) and titles[0].startswith("prefill attention · ctx 2,048")


def test_forest_has_every_workload_point_with_its_interval_and_the_drift_control(fi):
    figure = plots.forest_figure(fi)
    rows = [r.row for r in headline.head_rows(fi.diff)]
    points = []
    for line in figure.findobj(lambda a: (a.get_gid() or "").startswith("forest-") and hasattr(a, "get_xdata")):
        if line.get_gid() != "forest-drift":
            points += list(line.get_xdata())
    assert sorted(points) == pytest.approx(sorted(r.ratio for r in rows if r.ratio is not None))
    assert by_gid(figure, "forest-drift")["forest-drift"].get_xdata()[0] == pytest.approx(fi.diff.drift.ratio)
    labels = [t.get_text() for t in figure.axes[0].get_yticklabels()]
    contexts = json.loads((NSYS2025_DIR / "manifest.json").read_text())["settings"]["spec"]["contexts"]
    assert labels[:len(contexts)] == [f"prefill attention · ctx {c:,}" for c in contexts]
    assert labels[-1] == "drift: KV-independent kernels"


def test_ratio_against_context_per_phase(shared, fi):
    figure = plots.context_figure(fi)
    contexts = json.loads((NSYS2025_DIR / "manifest.json").read_text())["settings"]["spec"]["contexts"]
    lines = {gid: line for gid, line in by_gid(figure, "context-").items() if not gid.startswith("context-band-")}
    series = context_series(fi)
    assert set(lines) == {f"context-{name}" for name in series} == {
        "context-prefill-attention", "context-decode-attention-BatchPrefillWithPagedK-MaskMode-0",
        "context-decode-attention-PersistentVariableLeng", "context-KV-append-kernel", "context-KV-append-phase"}
    for name, points in series.items():
        line = lines[f"context-{name}"]
        assert list(line.get_xdata()) == contexts == [c for c, _ in points]
        assert list(line.get_ydata()) == pytest.approx([r.ratio for _, r in points])
    vllm = shared.report([VLLM_COLD_PREFILL])
    assert plots.context_figure(vllm) is None  # vLLM step kinds have no context axis


def test_titles_name_the_gpu_and_the_versions(fi):
    versions = json.loads((NSYS2025_DIR / "manifest.json").read_text())["arms"]["fp8"]["workload"]["versions"]
    for kind, figure in plots.figures(fi).items():
        title = figure.get_suptitle()
        assert "NVIDIA H200" in title, kind
        assert f"torch {versions['torch']}" in title and f"FlashInfer {versions['flashinfer']}" in title, kind


def test_bandwidth_plot_against_the_trace_ceiling(fi):
    figure = plots.bandwidth_figure(fi)
    with sqlite3.connect(f"file:{NSYS2025_DIR / 'fp8.sqlite'}?mode=ro", uri=True) as conn:
        ceiling = conn.execute("SELECT memoryBandwidth FROM TARGET_INFO_GPU").fetchone()[0]
    line = by_gid(figure, "hbm-ceiling")["hbm-ceiling"]
    assert line.get_xdata()[0] == pytest.approx(ceiling / 1e12)
    bars = by_gid(figure, "bandwidth-")
    assert len(bars) == 2 * len(fi.bandwidth)


def test_sweep_curves_per_arm_and_context_with_capacity_marks(sweep, fi):
    assert plots.sweep_figure(fi) is None  # no traffic points, no sweep
    figure = plots.sweep_figure(sweep)
    data = json.loads((SWEEP / "manifest.json").read_text())
    contexts = sorted({int(dict(i.split("=") for i in p.split(","))["input"]) for p in data["settings"]["points"]})
    lines = by_gid(figure, "sweep-")
    assert set(lines) == {f"sweep-{panel}-{side}-{context}" for panel in ("ttft", "itl", "preemptions")
                          for side in ("baseline", "candidate") for context in contexts}
    points = {(p["point"]): p for p in data["arms"]["fp8"]["points"]}
    line = lines[f"sweep-preemptions-baseline-{contexts[0]}"]
    expected = sorted((int(dict(i.split("=") for i in spec.split(","))["concurrency"]),
                       p["metrics"]["deltas"]["counters"]["vllm:num_preemptions_total"])
                      for spec, p in points.items() if f"input={contexts[0]}," in spec)
    assert list(zip(line.get_xdata(), line.get_ydata())) == expected
    labels = figure.axes[0].get_legend_handles_labels()[1]
    assert "fp8 first at capacity" in labels
    assert "fp8, context 1,024" in labels and "nvfp4, context 1,024" in labels


@pytest.mark.slow
def test_write_plots_returns_its_files_png_and_svg(fi, sweep, tmp_path):
    folder = tmp_path / "out" / "plots"
    written = plots.write_plots(fi, folder, "png", link_base=tmp_path / "out")
    assert [p.kind for p in written] == ["summary", "forest", "context", "segment-times", "segment-ratios", "ecdf",
                                         "bandwidth"]
    assert fi.plots == []  # the report is left as it was: the caller takes the files
    for plot in written:
        assert plot.link == f"plots/{plot.kind}.png"
        image = matplotlib.image.imread(folder / f"{plot.kind}.png")  # a PNG matplotlib can open
        assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 500, plot.kind
        assert "NVIDIA H200" in plot.heading and plot.panels
    summary = written[0]
    assert summary.panels == ("Ratio per workload point", "Ratio against context length per phase")
    svg = plots.write_plots(sweep, tmp_path / "svg", "svg", link_base=tmp_path)
    text = (tmp_path / "svg" / "sweep.svg").read_text()
    assert "sweep-ttft-baseline-1024" in text and "TTFT (ms) vs concurrency" in text
    assert "first capacity-bound point" in text
    assert {p.kind for p in svg} >= {"sweep", "segment-times", "summary"}
    assert not [p for p in (tmp_path / "svg").iterdir() if p.name.startswith(".")]  # no temporary files left


@pytest.mark.slow
def test_cli_markdown_names_the_summary_to_drag_instead_of_relative_image_links(tmp_path):
    out = tmp_path / "report.md"
    result = CliRunner().invoke(cli, ["report", str(SWEEP), "--exports-from", str(NSYS2025_DIR), "--format", "markdown",
                                      "-o", str(out), "--plots", str(tmp_path / "figs"), "--plot-format", "svg"])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "![" not in text  # GitHub does not render images linked by a relative path
    assert "Drag `figs/summary.svg` into the issue" in text
    for kind in ("summary", "forest", "segment-times", "segment-ratios", "ecdf", "sweep"):
        assert f"`figs/{kind}.svg`" in text and (tmp_path / "figs" / f"{kind}.svg").is_file()
    (tmp_path / "file").write_text("x")
    bad = CliRunner().invoke(cli, ["report", str(SWEEP), "--exports-from", str(NSYS2025_DIR), "--plots",
                                   str(tmp_path / "file")])
    assert bad.exit_code != 0 and "is a file" in str(bad.exception)


def test_matplotlib_and_torch_stay_out_of_diff_and_capacity():
    code = (f"import sys\nfrom kvtrace.cli import main\n"
            f"main(['diff', '{NSYS2025_DIR / 'fp8.sqlite'}', '{NSYS2025_DIR / 'nvfp4.sqlite'}', '--format', 'markdown', "
            f"'-o', '/dev/null'])\n"
            "assert 'matplotlib' not in sys.modules, 'diff imported matplotlib'\n"
            "main(['capacity', '--layers', '64', '--kv-heads', '8', '--head-dim', '128', '--format', 'json', '-o', "
            "'/dev/null'])\n"
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules, 'capacity imported torch/matplotlib'\n"
            "print('clean')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "clean", result.stderr
