"""The answer first (issue 13 items 1-3): the head of `kvtrace diff`, paste-ready markdown and JSON, the
conventions on swapped arms, --repeat labels and capacity of repeated runs."""

from __future__ import annotations

import itertools
import json
import re
from html.parser import HTMLParser

import pytest

from conftest import NSYS2025_DIR, REPEATS2, VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY, sql_durations
from kvtrace.analyzer import compare, headline, results
from kvtrace.analyzer.stats import bootstrap
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.render import markdown

VLLM = [VLLM_DECODE_HEAVY, VLLM_COLD_PREFILL]
CONTEXTS = (2048, 8192, 32768)


@pytest.fixture(scope="module")
def fi_diff(fi_h200_diff):
    return fi_h200_diff


def test_head_has_one_row_per_context_and_question(fi_diff):
    head = headline.Headline.of(fi_diff)
    for question in (headline.PREFILL, headline.APPEND_KERNEL, headline.APPEND_PHASE):
        assert [r.point for r in head.rows if r.question == question] == [f"ctx={c}" for c in CONTEXTS]
    # Decode per kernel: the attention kernel, then the split-KV merge kernel, at each context.
    assert [(r.point, r.family) for r in head.rows if r.question == headline.DECODE] == [
        (f"ctx={c}", family) for c in CONTEXTS for family in ("BatchPrefillWithPagedKVCacheKernel[MaskMode=0]",
                                                              "PersistentVariableLengthMergeStatesKernel")]
    control = [r for r in head.rows if r.question == headline.CONTROL]
    assert [r.row.segment for r in control] == ["gemm"]
    assert head.drift and "KV-independent" in head.drift
    # Selected, not recomputed: the prefill rows are the Diff's phase rows themselves.
    prefill = [r.row for r in head.rows if r.question == headline.PREFILL]
    assert prefill == [r for r in fi_diff.phases if r.segment == "prefill_attention"]
    assert {r.family for r in head.rows if r.question == headline.APPEND_KERNEL} == \
        {"AppendPagedKVCacheKernel → NVFP4QuantizeAppendPagedKVCacheKernel"}


def test_head_shows_the_band_each_verdict_used(fi_diff):
    """Each row of the answer gives the no-change band its verdict used (± the larger of its band and the
    threshold, as the plots shade it): here the assumed ±20% of small calls beside the ±2% threshold."""
    head = headline.Headline.of(fi_diff)
    lines = markdown.head(fi_diff)
    start = next(i for i, line in enumerate(lines) if line.startswith("| question |"))
    split = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
             for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start:])]
    column = split[0].index("band")
    cells = [row[column] for row in split[2:]]
    assert len(cells) == len(head.rows)
    for cell, r in zip(cells, head.rows):
        half = max(r.row.band, fi_diff.threshold)
        assert cell == f"±{100 * half:.2g}%", (r.question, r.point)
        if r.row.verdict == "regression":
            assert r.row.ci_low > 1 + r.row.band
        elif r.row.verdict == "improvement":
            assert r.row.ci_high < 1 - r.row.band
        else:
            assert r.row.ci_low <= 1 + half and r.row.ci_high >= 1 - half
    assert {"±2%", "±20%"} <= set(cells)


@pytest.mark.parametrize("context", CONTEXTS)
def test_append_phase_is_every_kernel_of_the_range_per_append(fi_diff, context):
    """FP8's append phase holds its cast and copy kernels as well as AppendPagedKVCacheKernel: one unit per
    append call, the whole range's kernel time over the append calls, checked in plain SQL."""
    nvtx = f"kvtrace:append ctx={context} batch=8"
    row = next(r for r in fi_diff.phase_totals if r.phase == nvtx)
    for arm, stats, append in (("fp8", row.baseline, "void flashinfer::AppendPagedKVCacheKernel<%"),
                               ("nvfp4", row.candidate, "void flashinfer::NVFP4QuantizeAppendPagedKVCacheKernel<%")):
        path = NSYS2025_DIR / f"{arm}.sqlite"
        every = sql_durations(path, "%", nvtx=nvtx)
        appends = sql_durations(path, append, nvtx=nvtx)
        assert stats.calls == len(appends) == 64
        assert stats.total_ns == sum(every)
        assert stats.mean_ns == pytest.approx(sum(every) / len(appends))
    fp8_kernels = len(sql_durations(NSYS2025_DIR / "fp8.sqlite", "%", nvtx=nvtx))
    assert fp8_kernels > 64  # the cast and copy are inside the unit, not dropped
    assert row.ratio == pytest.approx(row.candidate.total_ns / row.baseline.total_ns)
    assert row.ci_low < row.ratio < row.ci_high


@pytest.mark.parametrize("run_dir", VLLM, ids=lambda p: p.name)
def test_vllm_head_rows_per_step_kind(run_dir):
    traces = [open_trace(run_dir / f"{arm}.sqlite") for arm in ("auto", "fp8")]
    diff = compare.diff(traces[0], traces[1], load_recipes(()))
    head = headline.Headline.of(diff)
    points = {(r.question, r.point) for r in head.rows}
    expected = {(headline.PREFILL if r.segment == "prefill_attention" else headline.DECODE
                 if r.segment == "decode_attention" else headline.APPEND_KERNEL, r.phase.removeprefix("vLLM "))
                for r in diff.phases if r.segment in ("prefill_attention", "decode_attention", "kv_append")}
    assert expected and expected <= points
    assert all(p.endswith("steps") for q, p in points if q != headline.CONTROL)
    assert any(r.question == headline.CONTROL for r in head.rows)


def _head_lines(out: str) -> list[str]:
    return out.split("everything else")[0].splitlines()


def test_terminal_head_fits_100_columns(run_kvtrace):
    code, out, err = run_kvtrace("diff", NSYS2025_DIR / "fp8.sqlite", NSYS2025_DIR / "nvfp4.sqlite",
                                 env={"COLUMNS": "100"})
    assert code == 0, err
    head = _head_lines(out)
    assert 10 < len(head) <= 60
    assert max(len(line) for line in head) <= 100
    assert "…" not in "\n".join(head)
    for verdict in ("regression", "improvement", "no significant change"):
        assert any(verdict in line for line in head), verdict
    for context in CONTEXTS:  # prefill, decode's attention and merge kernels, append kernel, append phase
        assert sum(f"ctx={context}" in line for line in head) == 5
    # The full tables below fold long cells instead of cutting them.
    rest = out.split("everything else")[1]
    assert "prefill_attention" in rest and "prefill_att…" not in rest and "regr…" not in rest


def _markdown_problems(text: str) -> list[str]:
    """What GitHub would not render as meant: ragged tables, unbalanced <details>, links to local files."""
    problems = []
    lines = text.splitlines()
    fence = False
    width = None
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        if line.startswith("|"):
            cells = len(re.findall(r"(?<!\\)\|", line))
            if width is None:
                width = cells
                if not (number < len(lines) and re.fullmatch(r"\|(---\|)+", lines[number])):
                    problems.append(f"line {number}: table without a delimiter row")
            elif cells != width:
                problems.append(f"line {number}: {cells - 1} cells, header has {width - 1}")
        else:
            width = None
        for target in re.findall(r"\]\(([^)]*)\)", line):
            if not re.match(r"https?://|#", target):
                problems.append(f"line {number}: link to {target}")
    if fence:
        problems.append("unclosed code fence")

    class Details(HTMLParser):
        depth = 0

        def handle_starttag(self, tag, attrs):
            self.depth += tag == "details"

        def handle_endtag(self, tag):
            if tag == "details":
                self.depth -= 1
                if self.depth < 0:
                    problems.append("</details> without <details>")

    parser = Details()
    parser.feed(text)
    if parser.depth:
        problems.append(f"{parser.depth} <details> left open")
    return problems


# What a report must not carry (the manifest keeps them): absolute paths, GPU UUIDs, the recording host.
_PRIVATE = re.compile(r"(?:^|[\s`'\"(=])/(?:tmp|opt|work|home|root|usr|var|mnt|srv)/|GPU-[0-9a-f]{8}-|"
                      r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _private(text: str, run_dir) -> list[str]:
    found = _PRIVATE.findall(text)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    host = manifest.get("environment", {}).get("hostname")
    if host:
        found += re.findall(rf"\b{re.escape(host)}\b(?!-)", text.replace("kvtrace", ""))
    return found


_DIFFS = [(NSYS2025_DIR, "fp8", "nvfp4"), *((d, "auto", "fp8") for d in VLLM), (REPEATS2, "fp8.r1", "nvfp4.r1")]


@pytest.mark.parametrize("run_dir, base, cand", _DIFFS, ids=lambda v: getattr(v, "name", v))
def test_diff_markdown_is_paste_ready(run_kvtrace, run_dir, base, cand):
    code, out, err = run_kvtrace("diff", run_dir / f"{base}.sqlite", run_dir / f"{cand}.sqlite",
                                 "--format", "markdown")
    assert code == 0, err
    assert _markdown_problems(out) == []
    assert _private(out, run_dir) == []
    head, rest = out.split("<details><summary>Everything else", 1)
    assert "### The answer" in head and "### Environment" in head and "### Reproduce" in head
    assert "### Segments" in rest and "### Segments" not in head
    assert len(head.splitlines()) <= 60
    manifest = json.loads((run_dir / "manifest.json").read_text())
    versions = manifest["arms"][next(iter(manifest["arms"]))]["workload"]["versions"]
    for package in ("torch", "flashinfer"):
        assert f"{package} {versions[package]}" in head
    assert "CUDA runtime | 13.0" in head and "NVIDIA H200" in head and "132 SMs" in head
    assert manifest["environment"]["gpus"][0]["driver_version"] in head
    # The capture commands of the manifest, machine paths shortened, then the diff as run from the run dir.
    commands = head.split("```sh\n")[1].split("```")[0].splitlines()
    assert commands[-1] == f"kvtrace diff {base}.sqlite {cand}.sqlite --format markdown"
    assert sum(c.startswith("nsys profile ") for c in commands) == len(manifest["arms"])
    assert f"--output={base}" in "\n".join(commands)


@pytest.mark.parametrize("command", [["diff", "fp8.sqlite", "nvfp4.nsys-rep"], ["summary", "fp8.sqlite"],
                                     ["kernels", "fp8.sqlite"], ["report", "."], ["capacity", "."]],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("fmt", ["markdown", "json"])
def test_no_private_text_in_reports(run_kvtrace, command, fmt):
    args = [str(NSYS2025_DIR / a) if a.endswith(("sqlite", "nsys-rep")) else str(NSYS2025_DIR) if a == "." else a
            for a in command]
    code, out, err = run_kvtrace(*args, "--format", fmt)
    assert code == 0, err
    assert _private(out, NSYS2025_DIR) == []
    if fmt == "markdown":
        assert _markdown_problems(out) == []


def test_json_carries_the_head(run_kvtrace):
    code, out, err = run_kvtrace("diff", NSYS2025_DIR / "fp8.sqlite", NSYS2025_DIR / "nvfp4.sqlite", "--format",
                                 "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["schema"] == results.DIFF_SCHEMA
    rows = data["headline"]["rows"]
    phases = {(r["segment"], r["phase"]): r for r in data["phases"]}
    prefill = [r for r in rows if r["question"] == headline.PREFILL]
    assert [r["row"] for r in prefill] == [phases[("prefill_attention", f"kvtrace:prefill ctx={c} batch=8")]
                                           for c in CONTEXTS]
    assert any(name == "engine" and "flashinfer" in value for name, value in data["headline"]["environment"])
    assert [r["phase"] for r in data["phase_totals"] if r["phase"].startswith("kvtrace:append")] == \
        [f"kvtrace:append ctx={c} batch=8" for c in CONTEXTS]


def test_swapped_arms_warn(run_kvtrace):
    code, out, err = run_kvtrace("diff", NSYS2025_DIR / "nvfp4.sqlite", NSYS2025_DIR / "fp8.sqlite",
                                 "--format", "json")
    assert code == 0, err
    warned = [f for f in json.loads(out)["findings"] if "narrower KV format" in f["message"]]
    assert [f["level"] for f in warned] == ["warning"]
    code, out, _ = run_kvtrace("diff", NSYS2025_DIR / "fp8.sqlite", NSYS2025_DIR / "nvfp4.sqlite", "--format", "json")
    assert not [f for f in json.loads(out)["findings"] if "narrower KV format" in f["message"]]


def test_repeat_columns_are_labelled_by_arm(run_kvtrace):
    code, out, err = run_kvtrace("diff", REPEATS2 / "fp8.r1.sqlite", REPEATS2 / "nvfp4.r1.sqlite", "--repeat",
                                 REPEATS2 / "fp8.r2.sqlite", REPEATS2 / "nvfp4.r2.sqlite", "--format", "markdown")
    assert code == 0, err
    assert "time fp8 |" in out and "time nvfp4 |" in out
    assert "fp8.r1" not in out.split("### Reproduce")[0]
    code, out, err = run_kvtrace("diff", REPEATS2 / "fp8.r1.sqlite", REPEATS2 / "nvfp4.r1.sqlite", "--format", "json")
    assert json.loads(out)["baseline"]["label"] == "fp8.r1"  # one run: the file's name


def test_capacity_groups_repeated_runs_by_arm(run_kvtrace):
    code, out, err = run_kvtrace("capacity", REPEATS2, "--format", "json")
    assert code == 0, err
    manifest = json.loads((REPEATS2 / "manifest.json").read_text())
    assert len(manifest["arms"]) == 4
    assert [r["label"] for r in json.loads(out)["formats"]] == ["fp8", "nvfp4"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["prefix-reuse", "cold-prefill", "sweep"])
def test_serve_reports_are_paste_ready(run_kvtrace, shipped_output, scenario):
    """The real serve-mode runs: two run directories, one arm each; their report and diff carry no private text."""
    from conftest import SERVE_RUNS

    runs = [SERVE_RUNS[f"{scenario}-{arm}"] for arm in ("auto", "fp8")]
    for args in (["report", *runs], ["diff", runs[0] / "auto.sqlite", runs[1] / "fp8.sqlite"]):
        code, out, err = run_kvtrace(*args, "--format", "markdown")
        assert code == 0, err
        assert _private(out, runs[0]) == [] and _private(out, runs[1]) == []
        assert _markdown_problems(out) == []
        head = out.split("<details>")[0]
        assert "### The answer" in head and "vllm" in head and "### Reproduce" in head
        # Its JSON as written with -o FILE (the shipped output), whose Reproduce command names FILE too.
        output = shipped_output(f"{args[0]}.serve-{scenario}", "json")
        assert output.code == 0, output.err
        assert _private(output.path.read_text(), runs[0]) == [] and _private(output.path.read_text(), runs[1]) == []


def test_a_phase_total_without_an_interval_says_why(fi_diff):
    """A phase of one unit per arm (one GEMM range) has a ratio and no interval; like every other row, it says why."""
    single = [r for r in fi_diff.phase_totals if r.compared_calls == 1]
    assert single, "fi-h200-sm90 has GEMM phases of one range each"
    for row in single:
        assert row.ratio == pytest.approx(row.candidate.total_ns / row.baseline.total_ns)
        assert row.ci_low is None and row.no_interval == bootstrap.NO_INTERVAL_WHY[bootstrap.SINGLE_CALL]
    assert all(r.no_interval is None for r in fi_diff.phase_totals if r.ci_low is not None)
