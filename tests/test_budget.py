"""The TTFT budget per point (analyzer/budget, budget_trace), the why that follows it, the KV pool with its projection,
and the matrix's first screen, on the vLLM 0.33 runs of the Llama-3.1-8B-shaped model: the H100 capacity matrix
(fixtures/vllm033-h100-matrix: three interleaved rounds, a traced pass in every point) and, for the projection to
vLLM's default pool, the H200 runs that remain (fixtures/vllm033-h200-8b).

Expectations come from what kvtrace did not compute: the /metrics scrapes (.prom text) parsed here with a regular
expression, the startup log's "GPU KV cache size" line, the run directories' file names and the manifests' flags.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from conftest import MATRIX_RUNS, VLLM033_8B_RUNS, edited_exports
from kvtrace.analyzer import budget, budget_trace, matrix
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render.matrix import markdown_parts
from kvtrace.errors import KvtraceError

SWEEP = MATRIX_RUNS["sweep"]
PARTS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
         "prefill": "vllm:request_prefill_time_seconds"}


@pytest.fixture(scope="module")
def recipes():
    return load_recipes()


@pytest.fixture(scope="module")
def decision(shared):
    """`matrix` over the H100 matrix's four scenarios."""
    return shared.matrix([MATRIX_RUNS[name] for name in sorted(MATRIX_RUNS)])


def runs_of(run_dir: Path, arm: str) -> list[str]:
    return [name for name, entry in json.loads((run_dir / "manifest.json").read_text())["arms"].items()
            if entry["arm"] == arm]


def pair_deltas(point: int) -> dict[str, list[tuple[float, float]]]:
    """Per budget part: (fp8, nvfp4) means of each round's run pair at a sweep point, from the scrapes."""
    pairs = list(zip(runs_of(SWEEP, "fp8"), runs_of(SWEEP, "nvfp4")))
    found = {}
    for base, cand in pairs:
        means = [{part: prom_mean_ms(SWEEP, f"{run}.p{point}", name) for part, name in PARTS.items()}
                 for run in (base, cand)]
        for side in means:
            side["rest"] = side["ttft"] - side["queue"] - side["prefill"]
        for part in means[0]:
            found.setdefault(part, []).append((means[0][part], means[1][part]))
    return found


def t_interval(deltas: list[float]) -> tuple[float, float]:
    scipy_stats = pytest.importorskip("scipy.stats")
    mean, n = sum(deltas) / len(deltas), len(deltas)
    sd = (sum((d - mean) ** 2 for d in deltas) / (n - 1)) ** 0.5
    spread = scipy_stats.t.ppf(0.975, n - 1) * sd / n ** 0.5
    return mean - spread, mean + spread


def prom_mean_ms(run: Path, stem: str, histogram: str) -> float:
    """Δsum / Δcount of a histogram between a point's two scrapes, every label set added up, in ms."""
    totals = {}
    for when in ("before", "after"):
        text = (run / f"{stem}.metrics.{when}.prom").read_text()
        totals[when] = [sum(float(value) for value in re.findall(rf"^{re.escape(histogram)}_{kind}(?:{{[^}}]*}})? "
                                                                  r"(\S+)$", text, re.MULTILINE))
                        for kind in ("sum", "count")]
    delta_sum, delta_count = (a - b for a, b in zip(totals["after"], totals["before"]))
    return 1000 * delta_sum / delta_count


def concurrency(point: str) -> int:
    return int(re.search(r"concurrency=(\d+)", point).group(1))


def test_the_budget_is_the_scrapes_own_means(decision):
    """Every part of every sweep point's budget, both arms, against the .prom text of its three run pairs: each arm's
    mean over its runs, candidate − baseline per run pair averaged, a t interval over the pairs; the rest is TTFT −
    queue − prefill, so the parts add up to TTFT exactly."""
    scenario = next(s for s in decision.scenarios if s.runs == (str(SWEEP),))
    checked = 0
    for index, point in enumerate(scenario.points):
        why = point.serving.reason  # the point's three run pairs; one recording, so the same as point.reason
        assert why is not None and why is point.reason and why.budget.runs == len(runs_of(SWEEP, "fp8")) == 3
        for part, pairs in pair_deltas(index).items():
            got = why.budget.part(part)
            deltas = [c - b for b, c in pairs]
            assert got.baseline_ms == pytest.approx(sum(b for b, _ in pairs) / len(pairs), rel=1e-9)
            assert got.candidate_ms == pytest.approx(sum(c for _, c in pairs) / len(pairs), rel=1e-9)
            assert got.delta_ms == pytest.approx(sum(deltas) / len(deltas), rel=1e-9, abs=1e-9)
            # kvtrace computes the t quantile itself (analyzer/stats/distributions), close to scipy's
            assert (got.low_ms, got.high_ms) == pytest.approx(t_interval(deltas), rel=1e-6)
            checked += 1
    assert checked == 4 * len(scenario.points) == 16


def carrier_from_scrapes(point: int) -> str:
    """The part of TTFT that carries the TTFT difference, from the scrapes: the largest move in TTFT's direction
    among the parts whose interval clears zero that way, holding at least half of it (docs/statistics.md, the TTFT
    budget)."""
    deltas = {part: [c - b for b, c in pairs] for part, pairs in pair_deltas(point).items()}
    sign = 1 if sum(deltas["ttft"]) >= 0 else -1
    cleared = {part: sum(d) / len(d) for part, d in deltas.items()
               if part in ("queue", "prefill", "rest") and min(sign * v for v in t_interval(d)) > 0}
    assert cleared, f"point {point}: no part clears zero"
    carrier = max(cleared, key=lambda part: sign * cleared[part])
    assert cleared[carrier] / (sum(deltas["ttft"]) / len(deltas["ttft"])) >= 0.5, f"point {point}: under half"
    return carrier


def test_the_why_follows_the_budget_at_each_point(decision):
    """Concurrency 4 and 8 are carried by prefill time, 12 and 16 by queueing, where FP8 ran out of KV pool and NVFP4
    ran more requests at once; every point is traced in its own window (issue 46), its steps split, and the claim
    text says so."""
    sweep = next(s for s in decision.scenarios if s.runs == (str(SWEEP),))
    manifest = json.loads((SWEEP / "manifest.json").read_text())
    by_concurrency = {concurrency(p.point): (index, p) for index, p in enumerate(sweep.points)}
    assert sorted(by_concurrency) == [4, 8, 12, 16]
    for c, (index, p) in by_concurrency.items():
        assert p.reason.budget.carrier == carrier_from_scrapes(index) and p.reason.budget.carrier_measured
        # Peak running requests per run as the server's gauge was polled: the room each arm had.
        peaks = {arm: [manifest["arms"][run]["points"][index]["metrics"]["peaks"]["vllm:num_requests_running"]
                       for run in runs_of(SWEEP, arm)] for arm in ("fp8", "nvfp4")}
        if c in (4, 8):
            assert p.reason.budget.carrier == "prefill" and p.reason.cause == budget.PREFILL_TIME
        else:
            assert p.reason.budget.carrier == "queue" and p.reason.cause == budget.CAPACITY
            fp8_pool = manifest["arms"][runs_of(SWEEP, "fp8")[0]]["kv_cache"]["tokens"]
            assert c * (2048 + 128) > fp8_pool and min(peaks["nvfp4"]) > max(peaks["fp8"])
        assert p.serving.trace_note is None and p.reason.steps is not None
    # The diff reads each run's manifest export, the first point's window: its kernel verdicts are that point's.
    assert by_concurrency[4][1].kernel_verdicts and by_concurrency[4][1].serving.diff_covers
    # A steps claim cites only the points its traces cover.
    covered = {p.row for s in decision.scenarios for p in s.points if p.serving is not None and p.serving.diff_covers}
    steps = [c for c in decision.claims if c.kind == "steps"]
    assert steps and all(set(c.rows) <= covered for c in steps)
    head, rest = markdown_parts(decision)
    claims = re.findall(r"^TTFT budget at (\S+) \((R[^)]*)\), nvfp4 − fp8: (.*)$", head + rest, re.MULTILINE)
    words = {concurrency(point): text for point, _, text in claims if "output=128" in point}
    assert words[4].startswith("prefill time +") and "GPU waiting on the host +" in words[4]
    assert words[8].startswith("prefill time +") and "in the traced prefill and mixed steps" in words[8]
    assert words[12].startswith("queue time −") and words[16].startswith("queue time −")
    assert not any(budget_trace.NOT_TRACED in text for text in words.values())


def test_the_pool_is_stated(decision):
    """The 1 GiB cap per arm and its tokens as each server's startup log says; no run of the matrix reported vLLM's
    default pool, so no projection to it is made."""
    head, _ = markdown_parts(decision)
    manifest = json.loads((SWEEP / "manifest.json").read_text())
    logged = {}
    for arm in ("fp8", "nvfp4"):
        (log,) = {entry["log"] for entry in manifest["arms"].values() if entry["arm"] == arm}
        text = (SWEEP / log).read_text(errors="replace")
        logged[arm] = int(re.search(r"GPU KV cache size: ([\d,]+) tokens", text).group(1).replace(",", ""))
    flags = manifest["settings"]["extra_vllm_args"]
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    assert f"{logged['fp8']:,} tokens for fp8 and {logged['nvfp4']:,} tokens for nvfp4" in head
    assert "--kv-cache-memory-bytes 1 GiB" in head
    assert "No run here reported vLLM's default pool" in head and "would bind near concurrency" not in head


def test_the_pool_is_projected_to_the_default_pool(capacity_matrix):
    """The H200 runs: the preemption run under the 1 GiB cap, and where FP8 would bind with the default pool the
    offline cold-prefill run reported on the same GPU."""
    head, _ = markdown_parts(capacity_matrix)
    logged = {arm: int(re.search(r"GPU KV cache size: ([\d,]+) tokens", (VLLM033_8B_RUNS["capacity-cold-prefill"] /
                                                                         f"{arm}.log").read_text(errors="replace"))
                       .group(1).replace(",", "")) for arm in ("fp8", "nvfp4")}
    settings = json.loads((VLLM033_8B_RUNS["capacity-preemption"] / "manifest.json").read_text())["settings"]
    (point,) = settings["points"]
    per_request = sum(int(re.search(rf"{key}=(\d+)", point).group(1)) for key in ("input", "output"))
    near = logged["fp8"] // per_request + 1
    assert f"{logged['fp8']:,} tokens for fp8, {logged['nvfp4']:,} tokens for nvfp4" in head
    assert re.search(rf"fp8 would bind near concurrency [^;]*\b{near:,} at {per_request:,} tokens per request", head)


def test_the_first_screen_opens_with_the_decision(decision):
    head, rest = markdown_parts(decision)
    lines = head.splitlines()
    assert any(line.startswith("On TTFT, nvfp4 against fp8:") for line in lines[:15])
    assert len(head) < 8000 and rest.startswith("<details>")
    assert not re.search(r"\bNone\b|\bnan\b", head + rest)


def test_a_point_without_its_window_says_not_traced_and_the_others_are_split(tmp_path, recipes):
    """The sweep with every run's window of point 2 gone (ARM.rK.p2.sqlite): point 2 says "not traced" and has no
    split and no kernel verdicts (it borrows no other point's trace); points 1 and 3 keep their own windows' split."""
    run = tmp_path / SWEEP.name
    shutil.copytree(SWEEP, run)
    removed = list(run.glob("*.p2.sqlite"))
    assert len(removed) == 6
    for path in removed:
        path.unlink()
    result = matrix.build([run], recipes)
    by_index = dict(enumerate(result.scenarios[0].points))
    assert by_index[2].serving.trace_note == budget_trace.NOT_TRACED and by_index[2].reason.steps is None
    assert by_index[2].kernel_verdicts == []
    for index in (1, 3):
        assert by_index[index].serving.trace_note is None and by_index[index].reason.steps is not None


@pytest.mark.slow
def test_matrix_plots_draw_the_budget(tmp_path, run_kvtrace):
    code, _, err = run_kvtrace("matrix", *(VLLM033_8B_RUNS[name] for name in sorted(VLLM033_8B_RUNS)),
                               "--format", "markdown", "-o", tmp_path / "m.md", "--plots", tmp_path / "plots")
    assert code == 0, err
    assert (tmp_path / "plots" / "budget.png").stat().st_size > 10_000
    assert "plots/budget.png" in (tmp_path / "m.md").read_text()


@pytest.mark.slow
def test_a_serve_report_keeps_standard_error_short(run_kvtrace, tmp_path):
    code, _, err = run_kvtrace("report", SWEEP, "--format", "markdown", "-o", tmp_path / "r.md")
    assert code == 0 and len(err.splitlines()) <= 10, err
    assert "None" not in err


def test_a_serve_report_states_its_pool_engine_settings_and_how_to_record_it_again(run_kvtrace, tmp_path):
    """Environment: each arm's pool and the flag that set it, the serve run's engine settings; Reproduce: where the
    matrix's plan is (a scenario of `kvtrace capture vllm-matrix`), the first run's bench commands as the manifest
    has them, and the model's shape."""
    code, _, err = run_kvtrace("report", SWEEP, "--format", "markdown", "-o", tmp_path / "r.md")
    assert code == 0, err
    text = (tmp_path / "r.md").read_text()
    data = json.loads((SWEEP / "manifest.json").read_text())
    order = data["settings"]["arms"]
    tokens = {}
    for arm in order:
        (log,) = {entry["log"] for entry in data["arms"].values() if entry["arm"] == arm}
        tokens[arm] = int(re.search(r"GPU KV cache size: ([\d,]+) tokens", (SWEEP / log).read_text(
            errors="replace")).group(1).replace(",", ""))
    assert (f"| KV pool | {order[0]} {tokens[order[0]]:,} tokens, {order[1]} {tokens[order[1]]:,} tokens "
            "(--kv-cache-memory-bytes 1 GiB) |") in text
    assert "| engine settings | attention_backend=FLASHINFER," in text and "--max-num-seqs 16" in text
    commands = text.split("```sh\n")[1].split("```")[0].splitlines()
    assert data["settings"]["matrix"]["file"] == "../matrix.json" and (SWEEP / "../matrix.json").is_file()
    assert commands[0] == "# recorded by kvtrace capture vllm-matrix: its plan and arms are in ../matrix.json"
    first = data["arms"][data["settings"]["order"][0]]["commands"]
    benches = [c for c in first if "bench" in c and "serve" in c]
    shown = [c for c in commands if " bench serve " in c]
    assert len(benches) == len(data["arms"][data["settings"]["order"][0]]["points"]) == 4
    assert [c.split("--result-filename ")[1] for c in shown[:len(benches)]] == [
        c[c.index("--result-filename") + 1] for c in benches]
    model = {k: v for k, v in data["settings"]["model"].items() if k not in ("source", "kv_config")}
    shown_model = json.loads(text.split("```json\n")[1].split("```")[0])
    assert shown_model == model


def test_a_matrix_scenario_s_reproduce_gives_each_server_s_command(run_kvtrace, tmp_path):
    code, _, err = run_kvtrace("report", SWEEP, "--format", "markdown", "-o", tmp_path / "r.md")
    assert code == 0, err
    commands = (tmp_path / "r.md").read_text().split("```sh\n")[1].split("```")[0].splitlines()
    data = json.loads((SWEEP / "manifest.json").read_text())
    servers = {entry["log"] for entry in data["arms"].values()}
    assert sum(c.startswith("nsys profile ") for c in commands) == len(servers) == 2
    assert sum(" bench serve " in c for c in commands) == len(data["settings"]["points"])


@pytest.mark.parametrize("first_line,expected", [
    ("$ nsys profile --output=/tmp/x/trace python3 -m vllm serve /m --seed 0\n",
     "nsys profile --output=trace python3 -m vllm serve m --seed 0"),
    ("$ nsys profile 'unbalanced quote\n", None),  # no command, rather than a wrong one
    ("nsys profile python3 -m vllm serve /m\n", None),  # not the capture's "$ " line
    ("$ nsys profile " + "x" * (1 << 16), None),  # cut off at the read's limit
    # "/`" is an absolute path to portable(): its last component stays, quoted like every other argument
    ("$ nsys profile `rm -rf /` $(id) --x='a b'\n", "nsys profile '`rm' -rf '`' '$(id)' '--x=a b'"),
], ids=["recorded", "unbalanced-quote", "no-prompt", "cut-off", "shell-text"])
def test_a_server_logs_first_line_is_taken_whole_and_quoted_or_not_at_all(tmp_path, first_line, expected):
    """Reproduce reads a matrix server's command from its log, an input: only a whole "$ " line that parses, every
    argument quoted again for the shell, machine paths made portable (synthetic logs)."""
    from kvtrace.analyzer import reproduce

    (tmp_path / "fp8.server.log").write_text(first_line + "INFO later lines\n")
    assert reproduce._logged_command(tmp_path, "fp8.server.log", "arm fp8.r1") == expected
    assert reproduce._logged_command(tmp_path, "../fp8.server.log", "arm fp8.r1") is None  # only the run directory's


def test_a_server_log_that_is_a_fifo_or_a_link_out_is_refused_not_waited_on(tmp_path):
    """The log is read as runs reads a run's log: a FIFO would wait for a writer, a link would read elsewhere
    (synthetic run directory)."""
    import os

    from kvtrace.analyzer import reproduce
    from kvtrace.errors import KvtraceError

    os.mkfifo(tmp_path / "fp8.server.log")
    with pytest.raises(KvtraceError, match="not a regular file"):
        reproduce._logged_command(tmp_path, "fp8.server.log", "arm fp8.r1")
    (tmp_path / "outside.log").write_text("$ nsys profile vllm serve m\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "nvfp4.server.log").symlink_to(tmp_path / "outside.log")
    with pytest.raises(KvtraceError, match="leads outside the run directory"):
        reproduce._logged_command(tmp_path / "run", "nvfp4.server.log", "arm nvfp4.r1")


def test_a_point_trace_linked_out_of_its_run_directory_is_refused(tmp_path, recipes):
    source = SWEEP
    run = tmp_path / source.name
    shutil.copytree(source, run)
    (run / "fp8.r1.p1.sqlite").unlink()
    (run / "fp8.r1.p1.sqlite").symlink_to(source / "fp8.r1.p1.sqlite")
    with pytest.raises(KvtraceError, match="fp8.r1.p1.sqlite leads outside the run directory"):
        matrix.build([run], recipes)


def _eager_step_names(export: Path) -> Counter:
    """vLLM's prefill and mixed step ranges in an export (context requests above 0), by name, in plain SQL."""
    with sqlite3.connect(f"file:{export}?mode=ro", uri=True) as conn:
        names = [name for (name,) in conn.execute(
            "SELECT COALESCE(s.value, n.text) FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId")]
    return Counter(name for name in names
                   if (m := re.fullmatch(r"execute_context_(\d+)\(\d+\)_generation_\d+\(\d+\)", name or ""))
                   and m.group(1) != "0")


def test_the_traced_split_compares_only_the_steps_both_arms_ran_alike(decision):
    """The arms batch the same prompts differently (a traced pass's requests arrive as they will), so the split's
    means are over the steps both ran alike: per step name (context requests and tokens, decoding requests), as many
    as both arms ran over the point's windows of every run, counted here in plain SQL."""
    checked = 0
    for scenario in decision.scenarios:
        run = Path(scenario.report.baseline.run)
        recorded = json.loads((run / "manifest.json").read_text())
        for point in scenario.points:
            split = point.reason.steps if point.reason else None
            if split is None:
                continue
            index = recorded["settings"]["points"].index(point.point)
            names = {arm: sum((_eager_step_names(run / f"{name}.p{index}.sqlite")
                               for name, entry in recorded["arms"].items() if entry["arm"] == arm), Counter())
                     for arm in ("fp8", "nvfp4")}
            alike = sum((names["fp8"] & names["nvfp4"]).values())
            assert split.baseline.steps == split.candidate.steps == alike > 0
            checked += 1
    assert checked >= 4


def test_a_point_whose_arms_ran_no_step_alike_has_no_split(tmp_path, recipes):
    """The sweep with NVFP4's step names at its first point changed to a context count FP8 never ran (a constructed
    copy): no step pairs, so that point has no split and says why, and the others keep theirs."""
    run = edited_exports(SWEEP, tmp_path, "nvfp4.r*.p0.sqlite",
                         "UPDATE StringIds SET value = replace(value, 'execute_context_', 'execute_context_9')",
                         "UPDATE NVTX_EVENTS SET text = replace(text, 'execute_context_', 'execute_context_9') "
                         "WHERE text IS NOT NULL")
    result = matrix.build([run], recipes)
    first, *others = result.scenarios[0].points
    assert first.serving.trace_note == budget_trace.NO_MATCHED_STEPS and first.reason.steps is None
    assert all(p.serving.trace_note is None for p in others)
