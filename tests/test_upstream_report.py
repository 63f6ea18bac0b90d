"""Reports sized for an upstream issue (issue 34): the markdown of `kvtrace report` and `kvtrace diff` fits a GitHub
issue body with the answer, the serving line and the guard rail before <details> (checked through a CommonMark
renderer with GitHub's tables), and the whole report beside it is written in parts that each fit one (issue 48);
a regression never reads "ok"; the head gives each kernel's own time per call (what nsys stats shows, checked in
plain SQL); summary.png carries the head's rows; the arms' order is said first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from conftest import (MATRIX_RUNS, NSYS2025_DIR, RECORDED_REPORT, REPEAT, REPEATS2, SERVE_RUNS, VLLM033_8B_RUNS,
                      VLLM033_RUNS, VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY, sql_durations)
from kvtrace.analyzer import headline, report
from kvtrace.analyzer.render import markdown as diff_markdown
from kvtrace.analyzer.render import plots
from kvtrace.analyzer.render.units import AVG

# Every shipped run directory `kvtrace report` reads, as its arguments: the serve runs are one arm each; the recorded
# manifests name fi-h200-sm90's exports (--exports-from).
REPORTS = {**{f"vllm033/{name}": [run] for name, run in VLLM033_RUNS.items()},
           **{f"vllm033-8b/{name}": [run] for name, run in VLLM033_8B_RUNS.items()},
           **{f"vllm033-h100-matrix/{name}": [run] for name, run in MATRIX_RUNS.items()},
           "fi-h200-sm90": [NSYS2025_DIR], "fi-h200-sm90-repeat": [REPEAT], "fi-h200-sm90-repeats2": [REPEATS2],
           "vllm-h200-cold-prefill": [VLLM_COLD_PREFILL], "vllm-h200-decode-heavy": [VLLM_DECODE_HEAVY],
           **{f"recorded/{name}": [RECORDED_REPORT / name, "--exports-from", NSYS2025_DIR]
              for name in ("sweep", "capacity-win")},
           **{f"serve/{scenario}": [SERVE_RUNS[f"{scenario}-auto"], SERVE_RUNS[f"{scenario}-fp8"]]
              for scenario in ("cold-prefill", "prefix-reuse", "sweep")}}
DECODE_ATTENTION = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)0%"
MERGE = "%PersistentVariableLengthMergeStatesKernel%"


def build(name: str, shared) -> report.Report:
    """The Report `kvtrace report` makes of REPORTS[name], built once per worker (conftest.shared)."""
    args = REPORTS[name]
    runs = args[:args.index("--exports-from")] if "--exports-from" in args else args
    return shared.report(runs)  # a test vouches for the manifests it reads (runs.resolve_inputs)


def shipped(name: str, shipped_output):
    """`kvtrace report REPORTS[name] --format markdown -o report.NAME.md`, written once per session
    (tests/shipped_outputs.py names it after REPORTS[name], "/" as "-")."""
    return shipped_output(f"report.{name.replace('/', '-')}")


# The line at the bottom of a part that names the next one (analyzer.render.markdown.parts), and at the top of every
# part after the first; a line of the part itself: a fence, a <details> line or a blank one.
NEXT_PART = re.compile(r"This is part (\d+) of (\d+); it continues in `([^`]+)`")
PART_TOP = re.compile(r"Part (\d+) of (\d+), continued from `([^`]+)`")
_FRAME = re.compile(r"`{3,}\S*|\s*|.*</?details>.*")


def read_parts(first: Path) -> list[str]:
    """The parts of a whole document from its first file on, each naming the next at its bottom; checks that each
    says which part of how many it is, and from the second on, at its top, which part it continues."""
    paths, texts, counts = [first], [first.read_text()], set()
    while found := NEXT_PART.match(texts[-1].rstrip("\n").rsplit("\n", 1)[-1]):
        assert int(found.group(1)) == len(texts)
        counts.add(int(found.group(2)))
        paths.append(first.with_name(found.group(3)))
        texts.append(paths[-1].read_text())
    for number, text in enumerate(texts[1:], 2):
        top = PART_TOP.match(text)
        assert int(top.group(1)) == number and top.group(3) == paths[number - 2].name
        counts.add(int(top.group(2)))
    assert counts <= {len(texts)}
    return texts


def rejoins(texts: list[str], whole: str) -> bool:
    """Whether the parts, each less its part lines and the fence and <details> lines it opens again at its top and
    closes at its bottom, are `whole` in order: nothing lost, nothing added (a line cut to fit goes on in the next
    part without a line break)."""
    bodies = []
    for number, text in enumerate(texts, 1):
        lines = text.removesuffix("\n").split("\n")
        last = number == len(texts)
        bodies.append((lines[2 if number > 1 else 0:None if last else -2], not last and "cut to fit" in lines[-1]))

    def frames(lines: list[str]) -> int:
        return next((i for i, line in enumerate(lines) if not _FRAME.fullmatch(line)), len(lines))

    def search(number: int, at: int) -> bool:
        if number == len(bodies):
            return at == len(whole)
        lines, cut = bodies[number]
        for top in range(frames(lines) + 1):
            for bottom in range(frames(lines[top:][::-1]) + 1):
                content = "\n".join(lines[top:len(lines) - bottom]) + ("" if cut else "\n")
                if whole.startswith(content, at) and search(number + 1, at + len(content)):
                    return True
        return False

    return search(0, 0)


def balanced(text: str) -> bool:
    """Whether every code fence and <details> that `text` opens it also closes, as CommonMark reads fences: a closing
    fence is a run of backticks at least as long as the opening one, alone on its line."""
    fence, details = None, 0
    for line in text.split("\n"):
        opening = re.match(r"`{3,}", line)
        if fence:
            fence = None if re.fullmatch(r"`{%d,}\s*" % len(fence), line) else fence
        elif opening:
            fence = opening.group()
        else:
            details += line.count("<details>") - line.count("</details>")
            if details < 0:
                return False
    return fence is None and details == 0


def github(text: str) -> str:
    """HTML as GitHub would render the markdown: CommonMark with tables, raw HTML (<details>) passed through."""
    return MarkdownIt("commonmark", {"html": True}).enable("table").render(text)


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_report_markdown_fits_an_issue_with_the_answer_and_serving_before_details(name, shipped_output, shared):
    output = shipped(name, shipped_output)
    assert output.code == 0, output.err
    text = output.path.read_text()
    assert len(text) < diff_markdown.ISSUE_LIMIT
    html = github(text)
    visible = html[:html.index("<details>")]
    assert "The answer:" in visible and visible.count("<table>") >= 1
    result = build(name, shared)
    if any(row.ttft_ratio is not None for row in result.serving):  # the serving line and the guard rail
        assert "TTFT" in visible and "cached prompt tokens" in visible
        assert all(f"{s.ratio:.3f}×" in visible for s in result.statements if s.kind == "ttft")
    first = output.path.with_suffix(".full.md")
    if first.exists():  # what did not fit is named, and the whole report is beside it, in parts that each fit
        parts = read_parts(first)
        assert f"{len(parts)} parts (`{first.name}` first" in text[:text.index("<details>")]
        assert "Kernel families" in "".join(parts) and all(len(part) <= diff_markdown.ISSUE_LIMIT for part in parts)
        assert f"the whole report is in {len(parts)} parts: {first}, " in output.err
        assert all(str(output.path.with_suffix(f".full-{n}.md")) in output.err for n in range(2, len(parts) + 1))
    else:
        assert "Kernel families" in text


@pytest.mark.parametrize("name", ["cold-prefill", "preemption"])
def test_the_large_vllm033_reports_leave_their_long_tables_to_the_whole_file(name, run_kvtrace, tmp_path):
    """Reports longer than an issue body (the H100 matrix's cold prefill and preemption runs, as the H200 serve
    sweep's and prefix reuse's were before their traces were cut to 8 steps): the head and the segment tables stay,
    the files beside hold everything, starting as the head does."""
    code, _, err = run_kvtrace("report", MATRIX_RUNS[name], "-o", tmp_path / "r.md")
    assert code == 0, err
    text, whole = (tmp_path / "r.md").read_text(), (tmp_path / "r.full.md").read_text()
    assert len(text) < diff_markdown.ISSUE_LIMIT and len(whole) <= diff_markdown.ISSUE_LIMIT
    assert "#### Segments\n" in text and "### Serving" in text
    assert whole.startswith(text[:text.index("This report leaves out")].rstrip())
    code, out, _ = run_kvtrace("report", MATRIX_RUNS[name], "--format", "markdown")  # no file beside stdout
    assert code == 0 and len(out) < diff_markdown.ISSUE_LIMIT and "`-o FILE.md`" in out


@pytest.mark.parametrize("name", ["vllm033-h100-matrix/cold-prefill", "vllm033-h100-matrix/preemption"])
def test_a_whole_report_past_an_issue_body_is_written_in_parts_that_each_fit(name, run_kvtrace, tmp_path,
                                                                              monkeypatch, shipped_output):
    """Issue 48: no markdown file kvtrace writes exceeds 65,536 characters. These reports' whole documents are
    longer (70k and 85k characters): written in parts, each of which fits, renders on its own (every fence and
    <details> it opens closed) and names the next; together they are the whole document, nothing lost."""
    output = shipped(name, shipped_output)
    assert output.code == 0, output.err
    stem = output.path.stem
    parts = read_parts(output.path.with_suffix(".full.md"))
    assert len(parts) >= 2 and all(balanced(part) for part in parts)
    written = list(output.path.parent.glob(f"{stem}.*md"))  # the folder holds every shipped output
    assert {path.name for path in written} == {f"{stem}.md", f"{stem}.full.md", *(
        f"{stem}.full-{number}.md" for number in range(2, len(parts) + 1))}
    assert all(len(path.read_text()) <= diff_markdown.ISSUE_LIMIT for path in written)
    # The whole document: what kvtrace writes where an issue body holds any length (the same command and file name).
    monkeypatch.setattr(diff_markdown, "ISSUE_LIMIT", 10 ** 9)
    (tmp_path / "whole").mkdir()
    code, _, err = run_kvtrace("report", *REPORTS[name], "--format", "markdown", "-o", tmp_path / "whole" /
                               output.path.name)
    assert code == 0, err
    whole = (tmp_path / "whole" / output.path.name).read_text()
    assert len(whole) > 65_536 and not (tmp_path / "whole" / f"{stem}.full.md").exists()
    assert rejoins(parts, whole)
    assert not rejoins(parts[:1] + parts[2:], whole)  # a part left out is found


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_a_slower_ttft_or_kernel_never_reads_ok(name, run_kvtrace, shipped_output, shared):
    result = build(name, shared)
    slower = [s for s in result.statements if (s.kind == "ttft" and s.ratio > 1 + result.diff.threshold)
              or (s.kind == "kernels" and s.verdict == "regression")]
    assert all(s.level != "ok" for s in slower)
    code, out, _ = run_kvtrace("report", *REPORTS[name], env={"COLUMNS": "200"})
    assert code == 0
    for line in out.splitlines():  # the terminal: "ok  ttft: … 1.093×" was a regression marked ok
        found = re.search(r"\bok\s+ttft: TTFT \S+ [\d.]+ ms \(.*?\) → [\d.]+ ms \(.*?\), ([\d.]+)×", line)
        assert not found or float(found.group(1)) <= 1 + result.diff.threshold, line
    for line in shipped(name, shipped_output).path.read_text().splitlines():
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
    """Prefix reuse (vLLM 0.26): steps whose sizes differ between the arms pair no attention call (such a row was
    once "4.54 ms Σ0")."""
    code, _, err = run_kvtrace("report", SERVE_RUNS["prefix-reuse-auto"], SERVE_RUNS["prefix-reuse-fp8"], "-o",
                               tmp_path / "r.md")
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
def test_summary_png_carries_every_row_of_the_head_and_no_legend_covers_the_bands(name, shared):
    result = build(name, shared)
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
