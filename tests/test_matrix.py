"""`kvtrace matrix`: one decision over the shipped real matrices (serve auto vs fp8: cold-prefill, prefix-reuse,
sweep; offline cold-prefill and decode-heavy; the FlashInfer fp8 vs nvfp4 run). Each cell is checked against the
per-scenario report built on its own, and the serving cells against the runs' own bench JSON and /metrics pages;
winners and the crossover are recomputed from those files; the decision's wording is checked where a win is a
capacity effect and where a faster prefill kernel and more prefix hits both lower TTFT."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from conftest import (NSYS2025_DIR, SERVE_RUNS, VLLM033_RUNS, VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY,
                      deciding_on_any_run_pairs)
from kvtrace.analyzer import budget, budget_trace, claims as claims_lib, drift_band, matrix, report
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render import render_table, render_text
from kvtrace.analyzer.render import markdown as markdown_render, matrix as matrix_render
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.manifest import Point
from test_report import manifest, recorded_point, run_main
from test_upstream_report import balanced, read_parts, rejoins

OFFLINE = [VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY]
FLASHINFER = NSYS2025_DIR
SERVE = [SERVE_RUNS[f"{scenario}-{arm}"] for scenario in ("cold-prefill", "prefix-reuse", "sweep")
         for arm in ("auto", "fp8")]
ALL = [*SERVE, *OFFLINE, FLASHINFER]


@pytest.fixture(scope="module")
def recipes():
    return load_recipes()


@pytest.fixture(scope="module")
def ttft(recipes):
    return matrix.build(ALL, recipes)


def scenario(result: matrix.Matrix, name: str) -> matrix.Scenario:
    return next(s for s in result.scenarios if s.name == name)


def table_rows(result: matrix.Matrix) -> dict[str, dict[str, str]]:
    header, body = matrix_render.table(result, str)
    return {row[0]: dict(zip(header, row)) for row in body}


def detail_rows(result: matrix.Matrix) -> dict[str, dict[str, str]]:
    header, body = matrix_render.detail_table(result, str)
    return {row[0]: dict(zip(header, row)) for row in body}


def claim(result: matrix.Matrix, row: int) -> str:
    found = [c for c in result.claims if c.rows == (row,) and c.kind in ("capacity", "cold-prefill", "decode",
                                                                        "prefix", "point")]
    assert len(found) == 1
    return matrix_render.claim_text(found[0], result)


def test_scenarios_pair_one_arm_run_directories_and_keep_two_arm_ones(ttft):
    names = [s.name for s in ttft.scenarios]
    assert names == ["cold-prefill (serve)", "prefix-reuse (serve)", "sweep (serve)", "cold-prefill (offline)",
                     "decode-heavy (offline)", "fi-h200-sm90"]
    for s in ttft.scenarios[:3]:  # the wider format is the baseline, whatever order the directories came in
        assert (s.baseline, s.candidate) == ("auto", "fp8") and "-auto-" in Path(s.runs[0]).name
    assert (scenario(ttft, "fi-h200-sm90").baseline, scenario(ttft, "fi-h200-sm90").candidate) == ("fp8", "nvfp4")
    assert [p.row for p in ttft.points] == list(range(1, len(ttft.points) + 1))


def test_reversed_and_folder_inputs_give_the_same_matrix(recipes, ttft, tmp_path):
    folder = tmp_path / "matrix"
    folder.mkdir()
    for run in reversed(ALL):
        (folder / run.name).symlink_to(run)
    result = matrix.build([folder], recipes)
    by_name = sorted((s.name, s.baseline, s.candidate, [p.ratio for p in s.points]) for s in result.scenarios)
    assert by_name == sorted((s.name, s.baseline, s.candidate, [p.ratio for p in s.points]) for s in ttft.scenarios)


def test_each_cell_matches_the_per_scenario_report(shared, ttft):
    rows = table_rows(ttft)
    header, kernel_rows = matrix_render.kernel_table(ttft, str)
    for s in ttft.scenarios:
        alone = shared.report([Path(r) for r in s.runs])  # built on its own, not the matrix's
        kernels = [k for k in alone.statements if k.kind == "kernels"]
        assert [(k.subject, k.point, k.ratio, k.ci_low, k.ci_high, k.verdict) for k in s.kernels] == \
            [(k.subject, k.point, k.ratio, k.ci_low, k.ci_high, k.verdict) for k in kernels]
        cited = matrix_render.rows_text([p.row for p in s.points])
        mine = [dict(zip(header, row)) for row in kernel_rows if row[0] == cited]
        assert len(mine) == len(kernels)
        for k, row in zip(kernels, mine):
            assert row["phase"] == dict((b, a) for a, b in matrix_render.KERNEL_COLUMNS)[k.subject]
            assert row["candidate / baseline per call"] == (f"{k.ratio:.3f}× [{k.ci_low:.3f}, {k.ci_high:.3f}]"
                                                            if k.ratio is not None else "–")
            assert row["verdict"].startswith(k.verdict) and row["kernels (query dtype)"].startswith(k.kernels or "–")
        for point, row in zip(s.points, alone.serving):
            b, c = row.baseline, row.candidate
            assert point.point == row.point
            if b is not None and c is not None:
                assert (point.serving.baseline.ttft_ms, point.serving.candidate.ttft_ms) == (b.ttft_ms, c.ttft_ms)
                assert point.serving.estimates == row.estimates
                assert rows[f"R{point.row}"]["cached prompt tokens"].count("→") == 1


def test_serving_cells_match_the_runs_own_bench_json_and_metrics(ttft):
    rows = table_rows(ttft)
    for name, runs in (("cold-prefill (serve)", "cold-prefill"), ("prefix-reuse (serve)", "prefix-reuse"),
                       ("sweep (serve)", "sweep")):
        s = scenario(ttft, name)
        for point in s.points:
            own = {}
            for arm in ("auto", "fp8"):
                run = SERVE_RUNS[f"{runs}-{arm}"]
                specs = [p["point"] for p in manifest(run)["arms"][arm]["points"]]
                if point.point in specs:
                    own[arm] = recorded_point(run, arm, specs.index(point.point))
            cells = rows[f"R{point.row}"]
            details = detail_rows(ttft)
            if len(own) < 2:  # the sweep's 2048 × 16: auto stopped that context at its capacity
                assert point.excluded == f"different work: only {next(iter(own))} ran this point"
                assert point.winner is None and point.excluded in cells["wins on TTFT"]
                continue
            bench = {arm: own[arm]["bench"] for arm in own}
            delta = {arm: own[arm]["delta"] for arm in own}
            means = [bench[a]["mean_ttft_ms"] for a in ("auto", "fp8")]
            low, high = moments_interval(*(bench[a] for a in ("auto", "fp8")), "ttft")
            assert cells["TTFT ms"] == (f"{means[0]:,.1f} → {means[1]:,.1f}<br>{means[1] / means[0]:.3f}× "
                                        f"[{low:.3f}, {high:.3f}]")
            assert bench["auto"]["completed"] == delta["auto"]["vllm:request_success_total"]
            cached = [delta[arm]["vllm:prompt_tokens_cached_total"] for arm in ("auto", "fp8")]
            prompt = [delta[arm]["vllm:prompt_tokens_total"] for arm in ("auto", "fp8")]
            assert cells["cached prompt tokens"] == " → ".join(
                f"{c:,.0f} of {p:,.0f} ({100 * c / p:.1f}%)" for c, p in zip(cached, prompt))
            assert cells["output tok/s"].startswith(" → ".join(f"{round(bench[a]['output_throughput']):,}"
                                                               for a in ("auto", "fp8")))
            assert cells["output tok/s"].endswith("no interval")  # one run per arm: one throughput each
            detail = details[f"R{point.row}"]
            assert detail["completed"] == f"{bench['auto']['completed']:,} → {bench['fp8']['completed']:,}"
            assert detail["preemptions"] == (f"{delta['auto']['vllm:num_preemptions_total']:,.0f} → "
                                             f"{delta['fp8']['vllm:num_preemptions_total']:,.0f}")
            # Sub-second points against 0.5 s polling: the peaks are not observations, and the cells say so.
            assert detail["peak KV usage"] == "not observed → not observed"
            # One run per arm decides nothing; whether its interval, recomputed from the bench JSON alone, clears
            # the band assumed for one run per arm is what the cell says of it.
            band = drift_band.ASSUMED_SERVING_BAND
            seen = "clears" if low > 1 + band or high < 1 - band else "reaches into"
            assert point.winner is None and cells["wins on TTFT"] == (
                f"too few runs to decide (one run pair, 3 needed; its interval {seen} the ±25% assumed for one run "
                "per arm): record --repeats 3")


def moments_interval(base: dict, cand: dict, name: str) -> tuple[float, float]:
    """The log-ratio t interval of two arms' mean latencies from the bench client's mean, std (ddof 0) and count,
    computed here with scipy."""
    from scipy import stats as sp

    parts = []
    for bench in (base, cand):
        n = bench["completed"]
        sd = bench[f"std_{name}_ms"] * (n / (n - 1)) ** 0.5
        parts.append((sd ** 2 / (n * bench[f"mean_{name}_ms"] ** 2), n - 1))
    var = sum(v for v, _ in parts)
    df = var ** 2 / sum(v ** 2 / d for v, d in parts)
    r = cand[f"mean_{name}_ms"] / base[f"mean_{name}_ms"]
    half = sp.t.ppf(0.975, df) * var ** 0.5
    import math
    return r * math.exp(-half), r * math.exp(half)


def test_offline_cells_match_the_manifests_histograms(ttft):
    rows = table_rows(ttft)
    for run, name in zip(OFFLINE, ("cold-prefill (offline)", "decode-heavy (offline)")):
        (point,) = scenario(ttft, name).points
        means = []
        for arm in ("auto", "fp8"):
            record = manifest(run)["arms"][arm]["points"][0]
            histogram = record["metrics"]["deltas"]["histograms"]["vllm:time_to_first_token_seconds"]
            means.append(1000 * histogram["sum"] / histogram["count"])
        # One run per arm, means only: no interval, and no winner beyond the threshold.
        assert rows[f"R{point.row}"]["TTFT ms"] == (f"{means[0]:,.1f} → {means[1]:,.1f}<br>"
                                                   f"{means[1] / means[0]:.3f}× no interval")
        assert point.ratio == pytest.approx(means[1] / means[0])
        assert point.winner is None if abs(point.ratio - 1) > 0.02 else point.winner == matrix.NO_CLEAR_WINNER
        # Offline runs poll no peaks: nothing is claimed about them.
        assert detail_rows(ttft)[f"R{point.row}"]["peak running"] == "– → –"


def test_the_sweep_crossover_is_the_first_point_only_the_narrower_format_fits(ttft):
    s = scenario(ttft, "sweep (serve)")
    pools = {}
    for arm in ("auto", "fp8"):
        log = (SERVE_RUNS[f"sweep-{arm}"] / f"{arm}.log").read_text()
        pools[arm] = int(re.search(r"GPU KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    both = [spec for spec in manifest(SERVE_RUNS["sweep-auto"])["settings"]["points"]
            if spec in manifest(SERVE_RUNS["sweep-fp8"])["settings"]["points"]]
    fits = {arm: {spec: Point.parse(spec).kv_tokens() < 0.95 * pools[arm] for spec in both} for arm in pools}
    ordered = sorted(both, key=lambda spec: (Point.parse(spec).input_len, Point.parse(spec).concurrency))
    expected = next(spec for spec in ordered if not fits["auto"][spec] and fits["fp8"][spec])
    assert [p.point for p in s.points if p.crossover] == [expected]
    assert expected == "input=1024,output=16,prompts=32,concurrency=16"
    assert "◆ crossover" in table_rows(ttft)[f"R{next(p.row for p in s.points if p.crossover)}"]["capacity-bound"]


def test_prefix_reuse_credits_neither_the_faster_kernel_nor_the_prefix_hits_alone(recipes, ttft, tmp_path):
    # The recorded point: fp8's TTFT is lower, but one run per arm decides nothing (and its interval reaches into
    # the assumed band).
    (point,) = scenario(ttft, "prefix-reuse (serve)").points
    assert point.winner is None and point.estimate.band == drift_band.ASSUMED_SERVING_BAND
    assert point.ratio < 1 and point.estimate.high > 1 - drift_band.ASSUMED_SERVING_BAND
    own = {arm: recorded_point(SERVE_RUNS[f"prefix-reuse-{arm}"], arm)["delta"] for arm in ("auto", "fp8")}
    assert own["fp8"]["vllm:prompt_tokens_cached_total"] > own["auto"]["vllm:prompt_tokens_cached_total"]
    prefill = next(r for r in scenario(ttft, "prefix-reuse (serve)").report.diff.segments
                   if r.segment == "prefill_attention")
    judged = prefill.paired_verdict if prefill.verdict == Verdict.DIFFERENT_WORK else prefill.verdict
    assert judged == Verdict.IMPROVEMENT

    # The same runs with fp8's mean TTFT halved: now beyond the band; the server's TTFT budget (untouched) moved the
    # same way, but one run pair gives none of its parts an interval, so none is measured apart from zero.
    result = _halved_prefix_reuse(tmp_path, recipes)
    (point,) = result.points
    assert point.winner == matrix.NOT_EXPLAINED and point.apparent == "candidate"
    assert point.estimate.high < 1 - drift_band.ASSUMED_SERVING_BAND
    moved = _budget_moved()
    assert moved["queue"] + moved["prefill"] + moved["rest"] < 0  # the server's TTFT fell too
    assert point.reason.budget.carrier == min(moved, key=moved.get)
    assert point.reason.budget.runs == 1 and point.reason.carrier.low_ms is None
    assert not point.reason.budget.carrier_measured and point.reason.cause == budget.UNMEASURED


def _halved_prefix_reuse(tmp_path: Path, recipes) -> matrix.Matrix:
    """The vLLM 0.26 prefix-reuse pair (one run per arm) with fp8's mean TTFT halved, decided on one run pair."""
    def halve(run, arm):
        data = manifest(run)
        if arm == "fp8":
            bench = data["arms"]["fp8"]["points"][0]["bench"]
            bench["mean_ttft_ms"] /= 2
            bench["std_ttft_ms"] /= 2
        return data

    runs = copied_runs(tmp_path, [SERVE_RUNS[f"prefix-reuse-{arm}"] for arm in ("auto", "fp8")], halve)
    with deciding_on_any_run_pairs():
        return matrix.build(runs, recipes)


def _budget_moved() -> dict[str, float]:
    """fp8 − auto per part of the TTFT budget, from the manifests' histogram deltas (seconds)."""
    means = {arm: {name: h["sum"] / h["count"] for name, h in
                   manifest(SERVE_RUNS[f"prefix-reuse-{arm}"])["arms"][arm]["points"][0]["metrics"]["deltas"][
                       "histograms"].items() if h["count"]} for arm in ("auto", "fp8")}
    moved = {part: means["fp8"][f"vllm:request_{part}_time_seconds"] - means["auto"][f"vllm:request_{part}_time_seconds"]
             for part in ("queue", "prefill")}
    moved["rest"] = means["fp8"]["vllm:time_to_first_token_seconds"] - means["auto"][
        "vllm:time_to_first_token_seconds"] - moved["queue"] - moved["prefill"]
    return moved


def test_prefix_hits_are_not_credited_alone_where_the_budget_measured_nothing(recipes, tmp_path):
    """Where the budget measured no part (one run pair), more prefix hits do not win the point on their own: fp8 served
    more of its prompts from the cache (the server's counts), but no measured share of the TTFT difference says they
    made it, so the point is not explained. Before the budget's carrier had to clear zero, this point was credited to
    the queueing and the prefix hits together ("credits neither alone")."""
    result = _halved_prefix_reuse(tmp_path, recipes)
    (point,) = result.points
    assert point.reason.cause == budget.UNMEASURED
    assert point.serving.candidate.cached_prompt_tokens > point.serving.baseline.cached_prompt_tokens
    assert point.causes == () and point.winner == matrix.NOT_EXPLAINED
    text = claim(result, point.row)
    assert "no part of its TTFT budget measured apart from zero holds most of the difference" in text
    assert "not explained, so no choice" in text and not re.search(r"wins, by more prefix hits", text)


def copied_runs(tmp_path: Path, runs: list[Path], edit) -> list[Path]:
    """Copies of real run directories whose manifests `edit(run, arm)` returns changed."""
    out = []
    for run in runs:
        arm = next(iter(manifest(run)["arms"]))
        copy = tmp_path / run.name
        shutil.copytree(run, copy)
        copy.chmod(0o755)
        path = copy / "manifest.json"
        path.chmod(0o644)
        path.write_text(json.dumps(edit(run, arm)))
        out.append(copy)
    return out


def test_a_capacity_win_is_never_called_a_faster_kernel(recipes):
    with deciding_on_any_run_pairs():  # the words of a decided point: one run pair decides nothing
        itl = matrix.build([SERVE_RUNS["sweep-auto"], SERVE_RUNS["sweep-fp8"]], recipes, objective="itl")
    # ITL at the sweep's capacity-bound points: fp8's decode kernels are slower (a regression), auto is
    # capacity-bound and fp8 is not, and fp8's ITL is lower: a capacity effect.
    decode = next(r for r in itl.scenarios[0].report.diff.segments if r.segment == "decode_attention")
    assert decode.ratio > 1
    capacity_only = [p for p in itl.points if p.causes == (matrix.CAPACITY,)]
    assert [p.point for p in capacity_only] == ["input=1024,output=16,prompts=32,concurrency=16",
                                                "input=2048,output=16,prompts=32,concurrency=8"]
    for point in capacity_only:
        text = claim(itl, point.row)
        assert "a capacity effect (auto was capacity-bound" in text and "not kernel speed" in text
        assert "faster" not in text
        assert matrix_render.causes_cell(point) == matrix.CAPACITY


def test_the_decision_names_what_it_holds_for_and_states_quality_as_measured(ttft):
    markdown = render_text(ttft, "markdown")
    decision = markdown.split("### The decision", 1)[1]
    assert "On TTFT, fp8 against auto: not decided at R1–R8 (their cells say why)" in markdown.split("<details>", 1)[0]
    env = manifest(SERVE_RUNS["sweep-fp8"])["environment"]
    assert (f"fp8 against auto (R1–R8) holds for NVIDIA H200, FlashInfer {env['packages']['flashinfer-python']}, "
            f"vLLM {env['packages']['vllm']}, attention backend FLASHINFER") in decision
    assert "nvfp4 against fp8 (R9) holds for NVIDIA H200, FlashInfer 0.6.16.post3, no vLLM" in decision
    # The recorded runs used dummy weights and sent no quality prompts: the decision says so per scenario.
    assert ("Quality, as measured beside speed: " in decision and "not measured: auto and fp8 ran without "
            "--quality-prompts" in decision and "fp8's accuracy is not established: check it before choosing it"
            in decision)
    # Every claim about a point cites it; every decided point is in the choice.
    for c in ttft.claims:
        if c.kind in ("capacity", "cold-prefill", "decode", "prefix", "point"):
            assert f"(R{c.rows[0]})" in matrix_render.claim_text(c, ttft)


def test_json_schema_and_cli(tmp_path):
    out = tmp_path / "matrix.json"
    result = run_main(["matrix", *ALL[:6], "-q", "-o", out, "--plots", tmp_path / "plots"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["schema"] == "kvtrace.matrix/3" and data["objective"] == "ttft"
    sweep = next(s for s in data["scenarios"] if s["name"] == "sweep (serve)")
    assert [p["crossover"] for p in sweep["points"]] == [False, True, False, False]
    assert sweep["points"][0]["serving"]["baseline"]["ttft_ms"]["p50"] == \
        recorded_point(SERVE_RUNS["sweep-auto"], "auto")["bench"]["p50_ttft_ms"]
    assert [p["kind"] for p in data["plots"]] == ["budget", "crossover"]
    assert (tmp_path / "plots" / "crossover-3.png").read_bytes()[:4] == b"\x89PNG"
    assert {c["kind"] for c in data["claims"]} >= {"environment", "choice", "quality"}
    (choice,) = [c for c in data["claims"] if c["kind"] == "choice"]  # one run per arm decides no point
    assert choice["undecided"] == [p["row"] for s in data["scenarios"] for p in s["points"]]


@pytest.mark.parametrize("case", ["empty folder", "unpaired scenario"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    if case == "empty folder":
        args, words = [tmp_path], "holds no run directory"
    else:
        args, words = [SERVE_RUNS["sweep-auto"]], "it needs two, one per KV format"
    result = run_main(["matrix", *args, "-q"])
    assert result.exit_code == 2
    assert words in result.output and "Traceback" not in result.output and result.output.count("\n") == 1


def edited_cold_prefill(tmp_path: Path, edit) -> list[Path]:
    """A copy of the real serve cold-prefill pair whose manifests `edit(arm, manifest)` changed."""
    runs = []
    for arm in ("auto", "fp8"):
        run = tmp_path / SERVE_RUNS[f"cold-prefill-{arm}"].name
        shutil.copytree(SERVE_RUNS[f"cold-prefill-{arm}"], run)
        run.chmod(0o755)
        path = run / "manifest.json"
        data = json.loads(path.read_text())
        edit(arm, data)
        path.chmod(0o644)
        path.write_text(json.dumps(data))
        runs.append(run)
    return runs


def test_synthetic_capacity_resting_on_unobserved_peaks_does_not_count(recipes, tmp_path):
    # The real cold-prefill pair, with auto's polled KV usage raised to 99%: its point is sub-second against
    # 0.5 s polling, so that maximum is no observation, and neither the report nor the matrix (which takes the
    # report's decision) calls auto capacity-bound on it; both say what was not counted.
    def edit(arm, data):
        if arm == "auto":
            data["arms"]["auto"]["points"][0]["metrics"]["peaks"]["vllm:kv_cache_usage_perc"] = 0.99

    runs = edited_cold_prefill(tmp_path, edit)
    alone = report.build(runs, recipes)
    assert alone.serving[0].baseline.capacity is None and alone.serving[0].baseline.peaks_note
    assert alone.serving[0].baseline.capacity_note.startswith("KV cache usage peaked at 99%: not counted")
    (point,) = matrix.build(runs, recipes).points
    assert point.baseline_capacity is None and point.candidate_capacity is None
    note = alone.serving[0].baseline.peaks_note
    assert point.capacity_notes == [f"auto: KV cache usage peaked at 99%: not counted ({note})"]
    assert matrix.CAPACITY not in point.causes


def test_synthetic_hostile_scenario_name_is_inert_in_markdown_and_terminal(recipes, tmp_path):
    hostile = "cold|<img src=x>\x1b[31m"

    def edit(arm, data):
        data["settings"]["scenario"] = hostile

    result = matrix.build(edited_cold_prefill(tmp_path, edit), recipes)
    markdown = render_text(result, "markdown")
    assert not re.search(r"(?<!\\)<img", markdown) and "\x1b" not in markdown
    assert "cold\\|\\<img src=x\\>\\\\x1b\\[31m (serve)" in markdown
    console = Console(record=True, width=400, force_terminal=False)
    render_table(result, console)
    text = console.export_text()
    assert "\x1b" not in text and "cold|<img src=x>\\x1b[31m (serve)" in text


def test_crossover_plot_draws_the_runs_own_numbers(ttft):
    from kvtrace.analyzer.render import plots

    s = scenario(ttft, "sweep (serve)")
    figure = plots.crossover_figure(ttft, s)
    lines = {line.get_gid(): line for ax in figure.axes for line in ax.get_lines() if line.get_gid()}
    for side, arm in (("baseline", "auto"), ("candidate", "fp8")):
        run = SERVE_RUNS[f"sweep-{arm}"]
        points = manifest(run)["arms"][arm]["points"]
        for context in (1024, 2048):
            own = sorted((Point.parse(p["point"]).concurrency, recorded_point(run, arm, i)["bench"]["p50_ttft_ms"])
                         for i, p in enumerate(points) if Point.parse(p["point"]).input_len == context)
            line = lines[f"crossover-{side}-{context}"]
            assert list(zip(line.get_xdata(), line.get_ydata())) == own
    crossover = next(p for p in s.points if p.crossover)
    assert any(f"crossover: context {crossover.context:,}, concurrency {crossover.concurrency}" == line.get_label()
               for ax in figure.axes for line in ax.get_lines())
    assert "NVIDIA H200 · FlashInfer 0.6.14 · vLLM 0.26.0 · attention backend FLASHINFER" in figure.get_suptitle()
    assert plots.crossover_figure(ttft, scenario(ttft, "prefix-reuse (serve)")) is None


# ---- vLLM 0.33, FP8 against NVFP4 on the H200: the decision holds up (issue 34) ----------------------------

VLLM033 = list(VLLM033_RUNS.values())
SAME_POINT = "input=512,output=32,prompts=16,concurrency=16"  # offline decode-heavy, and its --repeats run


@pytest.fixture(scope="module")
def v033(recipes):
    """The matrix per objective. matrix.build reports on each scenario alike whatever the objective (and only reads
    the reports): the three are built over one report per scenario."""
    built, build = {}, report.build

    def once(runs, *args, **options):
        key = (tuple(map(str, runs)), args, tuple(sorted(options.items())))
        if key not in built:
            built[key] = build(runs, *args, **options)
        return built[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matrix.report_lib, "build", once)
        return {objective: matrix.build(VLLM033, recipes, objective=objective) for objective in matrix.OBJECTIVES}


@pytest.mark.parametrize("objective", list(matrix.OBJECTIVES))
def test_one_point_never_gets_two_answers(v033, objective):
    """The decode-heavy point ran twice (one run per arm, and a --repeats 2 run): where the two measurements
    disagree (one ratio outside the other's interval, or on opposite sides of the threshold), neither row is
    decided and the decision says so; where they agree, both rows are decided on the three run pairs pooled
    (tests/test_matrix_pooling.py checks the pooled numbers); no point is ever won by both arms."""
    result = v033[objective]
    name = matrix.OBJECTIVES[objective][0]
    by_point: dict = {}
    for s in result.scenarios:
        for p in s.points:
            by_point.setdefault(p.point, []).append(p)
    for points in by_point.values():
        assert len({p.winner for p in points if p.winner in ("baseline", "candidate")}) <= 1
    twice = sorted(by_point[SAME_POINT], key=lambda p: p.serving.estimates[name].runs)
    own = [p.serving.estimates[name] for p in twice]  # each row's own measurement
    assert [e.runs for e in own] == [1, 2]
    single, repeats = twice
    outside = own[1].low is not None and not own[1].low <= own[0].ratio <= own[1].high
    opposite = (own[0].ratio - 1) * (own[1].ratio - 1) < 0 and min(abs(own[0].ratio - 1), abs(own[1].ratio - 1)) > 0.02
    disagree = outside or opposite
    if disagree:
        assert all(p.winner is None and p.disagrees_with for p in twice)
        text = render_text(result, "markdown")
        assert f"the measurements disagree on {matrix_render._OBJECTIVE_WORDS[objective]}" in text
        low, high = sorted((single.row, repeats.row))
        assert f"measurements disagree at R{low}–R{high}" in text
    else:
        assert single.pooled_with == (repeats.row,) and repeats.pooled_with == (single.row,)
        assert single.estimate is repeats.estimate and single.estimate.runs == 3 and not single.disagrees_with
    if objective == "throughput":  # 1.129× against 0.935×: on opposite sides of the threshold
        assert disagree


@pytest.mark.parametrize("objective", list(matrix.OBJECTIVES))
def test_no_winner_inside_its_band_and_serve_cells_carry_intervals(v033, objective):
    result = v033[objective]
    name = matrix.OBJECTIVES[objective][0]
    for s in result.scenarios:
        for p in s.points:
            if p.winner in ("baseline", "candidate", matrix.NOT_EXPLAINED):
                band = max(p.estimate.band, result.threshold)
                assert p.estimate.low > 1 + band or p.estimate.high < 1 - band
            if p.winner == matrix.NO_CLEAR_WINNER:
                band = max(p.estimate.band, result.threshold)
                assert p.estimate.low is not None and not (p.estimate.low > 1 + band or p.estimate.high < 1 - band)
            if p.estimate is not None and p.estimate.runs == 1:
                assert p.estimate.band == drift_band.ASSUMED_SERVING_BAND
            if s.report.baseline.mode == "serve" and name != "output_tokens_per_s":
                estimate = p.serving.estimates[name]
                assert estimate.low < estimate.ratio < estimate.high
    rows = table_rows(result)
    for p in result.points:
        if p.serving is not None and p.serving.estimates.get("ttft_ms") is not None:
            e = p.serving.estimates["ttft_ms"]
            lines = rows[f"R{p.row}"]["TTFT ms"].split("<br>")
            assert lines[1] == f"{e.ratio:.3f}× " + (
                f"[{e.low:.3f}, {e.high:.3f}]" if e.low is not None else "no interval") \
                + (f", {e.runs} runs" if e.runs > 1 else "")
            assert len(lines) == (3 if p.pooled_with and objective == "ttft" else 2)
    choice = next(c for c in result.claims if c.kind == "choice")
    assert "rest on one run per arm: run-to-run drift is not measured there" in matrix_render.claim_text(choice, result)


def test_the_rule_is_what_the_rows_measured(v033):
    """The decision states this GPU's, engine's and route's rows: each phase's range is its rows' range, the
    kernels and query dtypes come from the rows and the run's log, a kernel-against-kernel ratio is not called a
    conversion cost, and the general expectation for decode is said not to hold where decode rows regressed and none
    improved (a row of different work, the prefix reuse's mixed steps, decides neither way)."""
    result = v033["ttft"]
    (measured,) = [c for c in result.claims if c.kind == "measured"]
    text = matrix_render.claim_text(measured, result)
    for phase in measured.phases:
        rows = [k for s in result.scenarios for k in s.kernels if k.subject == phase.subject and k.ratio]
        assert (phase.low, phase.high) == (min(k.ratio for k in rows), max(k.ratio for k in rows))
        assert f"{phase.low:.3f}×–{phase.high:.3f}×" in text
    # The attention kernel's own rows; the split-KV merge kernel beside it is a row of its own (the head's).
    decode = [k for s in result.scenarios for k in s.kernels if k.subject == "decode_attention" and k.ratio
              and claims_lib.SPLIT_KV_MERGE not in (k.kernels or "")]
    verdicts = {k.verdict for k in decode}
    assert Verdict.REGRESSION in verdicts and Verdict.IMPROVEMENT not in verdicts and Verdict.DIFFERENT_WORK in verdicts
    assert "saves time in decode, since it moves fewer bytes, did not hold here" in text
    logs = {arm: (VLLM033_RUNS["serve-sweep"] / f"{arm}.log").read_text() for arm in ("fp8", "nvfp4")}
    assert "prefill=torch.float8_e4m3fn" in logs["fp8"] and "prefill=torch.bfloat16" in logs["nvfp4"]
    assert "fp8 on float8_e4m3fn queries, nvfp4 on bfloat16" in text
    assert "FP8PrefillWithKVCacheKernel → BatchPrefillWithPagedKVCacheKernel[MaskMode=1]" in text
    assert "not the cost of converting the cache" in text
    markdown = render_text(result, "markdown")
    assert "pays for conversion" not in markdown and "so choose it where" not in markdown


def test_a_win_nothing_measured_explains_is_no_choice(recipes, tmp_path):
    """The real serve sweep with nvfp4's mean TPOT at 1024 × 16 halved: nvfp4 would win ITL far beyond the band
    while neither arm is capacity-bound there and the run's one trace holds every point's steps together, so no kernel
    speaks for this point alone: "not explained", no choice."""
    def faster_decode(run, arm):
        data = manifest(run)
        bench = data["arms"]["nvfp4"]["points"][1]["bench"]
        bench["mean_tpot_ms"] /= 2
        bench["std_tpot_ms"] /= 2
        return data

    (run,) = copied_runs(tmp_path, [VLLM033_RUNS["serve-sweep"]], faster_decode)
    with deciding_on_any_run_pairs():
        result = matrix.build([run], recipes, objective="itl")
    point = result.points[1]
    assert point.point == "input=1024,output=16,prompts=32,concurrency=16"
    assert point.estimate.high < 1 - drift_band.ASSUMED_SERVING_BAND and not point.baseline_capacity
    assert point.winner == matrix.NOT_EXPLAINED and point.apparent == "candidate" and point.causes == ()
    assert point.kernel_verdicts == [] and point.serving.trace_note == budget_trace.MIXED_TRACE
    text = render_text(result, "markdown")
    assert f"not explained (no choice) at R{point.row}" in text and f"choose nvfp4 at R{point.row}" not in text
    assert "nvfp4 looks better beyond the band, but no trace covers this point's own traffic" in text


def _table_lines(text: str) -> list[list[str]]:
    """The markdown's tables as blocks of source lines."""
    blocks, block = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            block.append(line)
        elif block:
            blocks.append(block)
            block = []
    return blocks + ([block] if block else [])


def _cells(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line)) - 1


def check_github_markdown(text: str) -> None:
    """Rendered by a GitHub-flavoured markdown parser (markdown-it-py's gfm-like preset): the short table with TTFT
    beside where its difference sits comes before <details>, every table row has its header's cells, no
    table is wider than ten columns, the whole fits an issue body, and nothing carries a tick or an "ok"."""
    from markdown_it import MarkdownIt

    parser = MarkdownIt("gfm-like", {"linkify": False})
    assert len(text) < matrix_render.ISSUE_CHARS
    tokens = parser.parse(text)
    details = next(i for i, t in enumerate(tokens) if t.type == "html_block" and "<details>" in t.content)
    first = next(i for i, t in enumerate(tokens) if t.type == "table_open")
    assert first < details
    headers = []
    for token in tokens[first:]:
        if token.type == "thead_close":
            break
        if token.type == "inline":
            headers.append(token.content)
    assert headers.index("TTFT difference sits in") == headers.index("TTFT ms") + 1
    assert sum(t.type == "table_open" for t in tokens) == len(_table_lines(text)) == 4
    for block in _table_lines(text):
        width = _cells(block[0])
        assert width <= 10 and all(_cells(line) == width for line in block), block[0]
    html = parser.render(text)
    assert html.count("<table>") == 4 and "✅" not in text and not re.search(r"\bok\b", text)
    assert {t.content.split(">")[0] for t in tokens if t.type == "html_block"} <= {"<details", "<sub", "</details"}


@pytest.mark.parametrize("objective", list(matrix.OBJECTIVES))
def test_markdown_renders_as_github_flavoured_markdown_and_fits_an_issue(v033, ttft, objective):
    for result in (v033[objective], ttft):
        check_github_markdown(render_text(result, "markdown"))


@pytest.mark.slow
def test_one_matrix_over_every_shipped_run_fits_an_issue(tmp_path):
    """Every shipped run directory whose arms both ran (fi-h200-sm90-nsys2023's did not), in one matrix."""
    from conftest import PACKED_RUNS

    runs = [NSYS2025_DIR, *SERVE_RUNS.values(), *VLLM033_RUNS.values(),
            *(run for name, run in PACKED_RUNS.items() if name != "fi-h200-sm90-nsys2023")]
    out = tmp_path / "matrix.md"
    result = run_main(["matrix", *runs, "-q", "-o", out])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "matrix.details.md").exists()
    text = out.read_text()
    first = _table_lines(text)[0][2:]
    assert [line.split(" | ")[0] for line in first] == [f"| R{n}" for n in range(1, len(first) + 1)]
    assert len(first) >= len(runs) - 3  # the one-arm serve directories pair three into one scenario each
    check_github_markdown(text)


def test_a_matrix_too_long_for_an_issue_leaves_its_details_in_a_named_file(v033, tmp_path, monkeypatch):
    monkeypatch.setattr(matrix_render, "ISSUE_CHARS", 12_000)
    out = tmp_path / "matrix.md"
    result = run_main(["matrix", *VLLM033, "-q", "-o", out])
    assert result.exit_code == 0, result.output
    text, rest = out.read_text(), (tmp_path / "matrix.details.md").read_text()
    head, details = matrix_render.markdown_parts(v033["ttft"])
    assert text.startswith(head) and "are in `matrix.details.md` beside this file" in text and "<details>" not in text
    assert rest == details and len(text) < 12_000


def test_matrix_details_past_an_issue_body_are_written_in_parts_that_each_fit(v033, tmp_path, monkeypatch):
    """FILE.details.md holds to an issue body too (issue 48): past one, it is written in parts, FILE.details-2.md
    and on, each naming the next; here parts of 6,000 characters, so that the shipped matrix's details take several."""
    monkeypatch.setattr(matrix_render, "ISSUE_CHARS", 12_000)
    split = markdown_render.parts
    monkeypatch.setattr(markdown_render, "parts", lambda text, first: split(text, first, 6_000))
    out = tmp_path / "matrix.md"
    result = run_main(["matrix", *VLLM033, "-q", "-o", out])
    assert result.exit_code == 0, result.output
    parts = read_parts(tmp_path / "matrix.details.md")
    assert len(parts) >= 2 and all(len(part) <= 6_000 and balanced(part) for part in parts)
    assert f"are in {len(parts)} parts (`matrix.details.md` first, each naming the next) beside this file" \
        in out.read_text()
    assert rejoins(parts, matrix_render.markdown_parts(v033["ttft"])[1])
