"""Reports sized for an upstream issue (issue 34): the markdown of `kvtrace report` and `kvtrace diff` fits a GitHub
issue body with the answer, the serving line and the guard rail before <details> (checked through a CommonMark
renderer with GitHub's tables); a regression never reads "ok"; the head gives each kernel's own time per call (what
nsys stats shows, checked in plain SQL); summary.png carries the head's rows; the arms' order is said first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from conftest import (NSYS2025_DIR, RECORDED_REPORT, REPEAT, REPEATS2, SERVE_RUNS, VLLM033_8B_RUNS, VLLM033_RUNS,
                      VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY, sql_durations)
from kvtrace.analyzer import headline, report
from kvtrace.analyzer.render import markdown as diff_markdown
from kvtrace.analyzer.render import plots
from kvtrace.analyzer.render.units import AVG

# Every shipped run directory `kvtrace report` reads, as its arguments: the serve runs are one arm each; the recorded
# manifests name fi-h200-sm90's exports (--exports-from).
REPORTS = {**{f"vllm033/{name}": [run] for name, run in VLLM033_RUNS.items()},
           **{f"vllm033-8b/{name}": [run] for name, run in VLLM033_8B_RUNS.items()},
           "fi-h200-sm90": [NSYS2025_DIR], "fi-h200-sm90-repeat": [REPEAT], "fi-h200-sm90-repeats2": [REPEATS2],
           "vllm-h200-cold-prefill": [VLLM_COLD_PREFILL], "vllm-h200-decode-heavy": [VLLM_DECODE_HEAVY],
           **{f"recorded/{name}": [RECORDED_REPORT / name, "--exports-from", NSYS2025_DIR]
              for name in ("sweep", "capacity-win")},
           **{f"serve/{scenario}": [SERVE_RUNS[f"{scenario}-auto"], SERVE_RUNS[f"{scenario}-fp8"]]
              for scenario in ("cold-prefill", "prefix-reuse", "sweep")}}
DECODE_ATTENTION = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)0%"
MERGE = "%PersistentVariableLengthMergeStatesKernel%"


def build(name: str, recipes) -> report.Report:
    """The Report `kvtrace report` makes of REPORTS[name]."""
    args = REPORTS[name]
    runs = args[:args.index("--exports-from")] if "--exports-from" in args else args
    return report.build(runs, recipes)  # a test vouches for the manifests it reads (runs.resolve_inputs)


def github(text: str) -> str:
    """HTML as GitHub would render the markdown: CommonMark with tables, raw HTML (<details>) passed through."""
    return MarkdownIt("commonmark", {"html": True}).enable("table").render(text)


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_report_markdown_fits_an_issue_with_the_answer_and_serving_before_details(name, run_kvtrace, tmp_path,
                                                                                 shipped_recipes):
    code, _, err = run_kvtrace("report", *REPORTS[name], "-o", tmp_path / "report.md")
    assert code == 0, err
    text = (tmp_path / "report.md").read_text()
    assert len(text) < diff_markdown.ISSUE_LIMIT
    html = github(text)
    visible = html[:html.index("<details>")]
    assert "The answer:" in visible and visible.count("<table>") >= 1
    result = build(name, shipped_recipes)
    if any(row.ttft_ratio is not None for row in result.serving):  # the serving line and the guard rail
        assert "TTFT" in visible and "cached prompt tokens" in visible
        assert all(f"{s.ratio:.3f}×" in visible for s in result.statements if s.kind == "ttft")
    whole = tmp_path / "report.full.md"
    if whole.exists():  # what did not fit is named, and the whole report is beside it
        assert "`report.full.md`" in text[:text.index("<details>")]
        assert len(whole.read_text()) > diff_markdown.ISSUE_LIMIT and "Kernel families" in whole.read_text()
        assert str(whole) in err
    else:
        assert "Kernel families" in text


@pytest.mark.parametrize("name", ["serve-sweep", "serve-prefix-reuse"])
def test_the_large_vllm033_reports_leave_their_long_tables_to_the_whole_file(name, run_kvtrace, tmp_path):
    """The two reports of the issue (146,926 and 122,355 characters before): the head and the segment tables stay,
    the file beside holds everything."""
    code, _, err = run_kvtrace("report", VLLM033_RUNS[name], "-o", tmp_path / "r.md")
    assert code == 0, err
    text, whole = (tmp_path / "r.md").read_text(), (tmp_path / "r.full.md").read_text()
    assert len(text) < diff_markdown.ISSUE_LIMIT < len(whole)
    assert "#### Segments\n" in text and "### Serving" in text
    assert whole.startswith(text[:text.index("This report leaves out")].rstrip())
    code, out, _ = run_kvtrace("report", VLLM033_RUNS[name], "--format", "markdown")  # no file beside stdout
    assert code == 0 and len(out) < diff_markdown.ISSUE_LIMIT and "`-o FILE.md`" in out


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_a_slower_ttft_or_kernel_never_reads_ok(name, run_kvtrace, tmp_path, shipped_recipes):
    result = build(name, shipped_recipes)
    slower = [s for s in result.statements if (s.kind == "ttft" and s.ratio > 1 + result.diff.threshold)
              or (s.kind == "kernels" and s.verdict == "regression")]
    assert all(s.level != "ok" for s in slower)
    code, out, _ = run_kvtrace("report", *REPORTS[name], env={"COLUMNS": "200"})
    assert code == 0
    for line in out.splitlines():  # the terminal: "ok  ttft: … 1.093×" was a regression marked ok
        found = re.search(r"\bok\s+ttft: TTFT \S+ [\d.]+ ms \(.*?\) → [\d.]+ ms \(.*?\), ([\d.]+)×", line)
        assert not found or float(found.group(1)) <= 1 + result.diff.threshold, line
    code, _, _ = run_kvtrace("report", *REPORTS[name], "-o", tmp_path / "r.md")
    for line in (tmp_path / "r.md").read_text().splitlines():
        found = re.search(r"✅.*TTFT \S+ [\d.]+ ms .*?, ([\d.]+)×", line)
        assert not found or float(found.group(1)) <= 1 + result.diff.threshold, line
        assert not ("✅" in line and "regression" in line), line


def test_head_gives_the_decode_kernel_and_the_merge_kernel_their_own_per_call_rows(fi_h200_diff):
    """nsys stats' Avg per kernel name: the FlashInfer decode attention kernel and the split-KV merge kernel, each
    at each context, per call and with the ratio of their own totals, from plain SQL."""
    rows = [r for r in headline.head_rows(fi_h200_diff) if r.question == headline.DECODE]
    assert {r.family for r in rows} == {"BatchPrefillWithPagedKVCacheKernel[MaskMode=0]",
                                        "PersistentVariableLengthMergeStatesKernel"}
    for r in rows:
        like = MERGE if r.family.startswith("Persistent") else DECODE_ATTENTION
        times = [sql_durations(NSYS2025_DIR / f"{arm}.sqlite", like, nvtx=r.row.phase) for arm in ("fp8", "nvfp4")]
        assert len(times[0]) == len(times[1]) == r.row.compared_calls > 0
        assert (r.baseline_ns, r.candidate_ns) == (pytest.approx(sum(times[0]) / len(times[0])),
                                                   pytest.approx(sum(times[1]) / len(times[1])))
        assert r.row.ratio == pytest.approx(sum(times[1]) / sum(times[0])) and not r.mixed
    attention = [r for r in rows if r.family.startswith("Batch")]
    assert all(r.row.verdict == "regression" for r in attention)
    assert any(r.row.verdict != "regression" for r in rows if r.family.startswith("Persistent"))


def test_vllm_head_gives_decode_attention_alone_per_call(run_kvtrace):
    """The vLLM 0.33 decode-heavy pair: decode attention alone (its own per-call mean over the decode steps, as nsys
    stats shows it), its merge kernel apart, no Σ total anywhere in the head."""
    run = VLLM033_RUNS["offline-decode-heavy"]
    code, out, err = run_kvtrace("diff", run / "fp8.sqlite", run / "nvfp4.sqlite", "--format", "markdown")
    assert code == 0, err
    head = out[:out.index("<details>")]
    assert "Σ" not in head and "Baseline **fp8**, candidate **nvfp4**" in head
    times = [sql_durations(run / f"{arm}.sqlite", DECODE_ATTENTION) for arm in ("fp8", "nvfp4")]
    row = next(line for line in head.splitlines() if "decode attention" in line and "MaskMode=0" in line
               and "Merge" not in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == f"{sum(times[0]) / len(times[0]) / 1e3:.2f} µs"
    assert cells[5] == f"{sum(times[1]) / sum(times[0]):.3f}×"
    assert any("PersistentVariableLengthMergeStatesKernel" in line for line in head.splitlines())
    # Over steps of different batch sizes, a control's time is the mean per call, marked as such.
    control = next(line for line in head.splitlines() if line.startswith("| control"))
    assert f" {AVG} |" in control


def test_head_rows_without_pairs_show_no_number(run_kvtrace, tmp_path):
    """vLLM 0.33 prefix reuse: its prefill steps pair no prefill attention call (it was "4.54 ms Σ0")."""
    code, _, err = run_kvtrace("report", VLLM033_RUNS["serve-prefix-reuse"], "-o", tmp_path / "r.md")
    assert code == 0, err
    text = (tmp_path / "r.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text[:text.index("<details>")].splitlines()
            if line.startswith("| prefill attention") or line.startswith("| decode attention")]
    unpaired = [row for row in rows if row[8] == "not comparable"]
    assert unpaired and all(row[3:8] == ["–"] * 5 and row[9] == "0" for row in unpaired)
    assert all("Σ" not in cell for row in rows for cell in row)


def test_narrower_format_as_baseline_is_said_first_on_stderr_and_in_the_head(run_kvtrace, tmp_path):
    run = VLLM033_RUNS["offline-decode-heavy"]
    code, out, err = run_kvtrace("diff", run / "nvfp4.sqlite", run / "fp8.sqlite")
    assert code == 0
    assert err.splitlines()[0].startswith("kvtrace: warning: the baseline ran the narrower KV format")
    first = out.splitlines()[:3]
    assert "the baseline ran the narrower KV format" in first[0] and "baseline nvfp4" in " ".join(first)
    code, _, err = run_kvtrace("diff", run / "nvfp4.sqlite", run / "fp8.sqlite", "-o", tmp_path / "d.md")
    text = (tmp_path / "d.md").read_text()
    assert err.splitlines()[0].startswith("kvtrace: warning: the baseline ran the narrower KV format")
    assert err.count("the baseline ran the narrower KV format") == 1
    answer = text[text.index("The answer"):]
    assert answer.index("the baseline ran the narrower KV format") < answer.index("| question")
    assert "Baseline **nvfp4**, candidate **fp8**" in answer


def _rows_of(figure) -> list[str]:
    return [t.get_text() for t in figure.axes[0].get_yticklabels()]


@pytest.mark.parametrize("name", ["fi-h200-sm90", "vllm033/serve-sweep"])
def test_summary_png_carries_every_row_of_the_head_and_no_legend_covers_the_bands(name, shipped_recipes):
    result = build(name, shipped_recipes)
    figure = plots.summary_figure(result)
    head = headline.head_rows(result.diff)
    labels = _rows_of(figure)
    assert len(labels) == len(head) + (result.diff.drift.ratio is not None)
    for label, row in zip(labels, head):
        assert label.startswith(row.question if row.question != headline.CONTROL else "control")
        assert row.point.replace("ctx=", "") in label.replace(",", "").replace("ctx ", "")
    if name.startswith("fi"):
        assert sum("KV append phase" in label for label in labels) == 3
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    for ax in figure.axes:
        legend = ax.get_legend()
        if legend is not None:
            box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
            assert not box.overlaps(area), ax.get_title()


def test_every_bandwidth_bar_is_visible(fi_h200_report):
    """The append phase moves a fraction of a percent of the HBM ceiling (0.2%, 0.04%): on the log axis its bars
    are as visible as decode's."""
    figure = plots.bandwidth_figure(fi_h200_report)
    figure.canvas.draw()
    bars = [a for a in figure.findobj(lambda a: (a.get_gid() or "").startswith("bandwidth-"))]
    assert len(bars) == 2 * len(fi_h200_report.bandwidth)
    assert min(r.candidate_fraction_of_ceiling for r in fi_h200_report.bandwidth) < 0.001
    renderer = figure.canvas.get_renderer()
    assert all(bar.get_window_extent(renderer).width >= 5 for bar in bars)
