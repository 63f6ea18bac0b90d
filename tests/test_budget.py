"""The TTFT budget per point (analyzer/budget, budget_trace), the why that follows it, the KV pool with its projection,
and the matrix's first screen, on the vLLM 0.33 runs of the Llama-3.1-8B-shaped model (fixtures/vllm033-h200-8b).

Expectations come from what kvtrace did not compute: the /metrics scrapes (.prom text) parsed here with a regular
expression, the startup log's "GPU KV cache size" line, the run directories' file names and the manifests' flags.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import MATRIX_RUNS, VLLM033_8B_RUNS
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
def decision(capacity_matrix):
    return capacity_matrix


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
    """Every part of every sweep point's budget, both arms, against the .prom text; the rest is TTFT − queue −
    prefill, so the parts add up to TTFT exactly."""
    scenario = next(s for s in decision.scenarios if s.runs == (str(SWEEP),))
    checked = 0
    for index, point in enumerate(scenario.points):
        why = point.serving.reason  # the point's own run pair; point.reason pools it with the repeats' row
        assert why is not None and why.budget.runs == 1
        for side, arm in (("baseline", "fp8"), ("candidate", "nvfp4")):
            expected = {part: prom_mean_ms(SWEEP, f"{arm}.p{index}", name) for part, name in PARTS.items()}
            expected["rest"] = expected["ttft"] - expected["queue"] - expected["prefill"]
            for part, value in expected.items():
                assert getattr(why.budget.part(part), f"{side}_ms") == pytest.approx(value, rel=1e-9)
                checked += 1
    assert checked == 4 * 2 * len(scenario.points) >= 40


def test_the_why_follows_the_budget_at_each_point(decision):
    """Concurrency 4 and 8 are carried by prefill time (4 traced: host time named; 8 not traced), 14 by queueing,
    in each sweep recording and in their pooled claim; a point no trace covers says so and carries no kernel
    verdicts."""
    sweeps = [p for s in decision.scenarios if s.report.baseline.scenario == "sweep" for p in s.points]
    by_concurrency = {}
    for p in sweeps:
        by_concurrency.setdefault(concurrency(p.point), []).append(p)
    for p in by_concurrency[4] + by_concurrency[8]:
        assert p.reason.budget.carrier == "prefill" and p.reason.cause == budget.PREFILL_TIME
    for p in by_concurrency[14]:
        assert p.reason.budget.carrier == "queue" and p.reason.cause == budget.CAPACITY
    traced = [p for p in by_concurrency[4] if p.serving.trace_note is None]
    assert traced and all(p.reason.steps is not None and p.kernel_verdicts for p in traced)
    for p in sweeps:
        if concurrency(p.point) != 4:
            assert p.serving.trace_note == budget_trace.NOT_TRACED and not p.kernel_verdicts
    # A steps claim cites only the points its traces cover.
    covered = {p.row for s in decision.scenarios for p in s.points if p.serving is not None and p.serving.diff_covers}
    steps = [c for c in decision.claims if c.kind == "steps"]
    assert steps and all(set(c.rows) <= covered for c in steps)
    head, rest = markdown_parts(decision)
    claims = re.findall(r"^TTFT budget at (\S+) \((R[^)]*)\), nvfp4 − fp8: (.*)$", head + rest, re.MULTILINE)
    words = {concurrency(point): text for point, _, text in claims if "output=128" in point}
    assert words[4].startswith("prefill time +") and "GPU waiting on the host +" in words[4]
    assert words[8].startswith("prefill time +") and budget_trace.NOT_TRACED in words[8]
    assert words[14].startswith("queue time −")


def test_the_pool_is_stated_and_projected_to_the_default_pool(decision):
    """The 1 GiB cap per arm, its tokens as each startup log says, and where FP8 would bind with the default pool
    the cold-prefill run reported on the same GPU."""
    head, _ = markdown_parts(decision)
    logged = {}
    for name in ("capacity-sweep", "capacity-cold-prefill"):
        for arm in ("fp8", "nvfp4"):
            text = (VLLM033_8B_RUNS[name] / f"{arm}.log").read_text(errors="replace")
            logged[name, arm] = int(re.search(r"GPU KV cache size: ([\d,]+) tokens", text).group(1).replace(",", ""))
    flags = json.loads((SWEEP / "manifest.json").read_text())["settings"]["extra_vllm_args"]
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    assert f"{logged['capacity-sweep', 'fp8']:,} tokens for fp8 and {logged['capacity-sweep', 'nvfp4']:,} tokens " \
           "for nvfp4" in head and "--kv-cache-memory-bytes 1 GiB" in head
    per_request = 2048 + 128
    near = logged["capacity-cold-prefill", "fp8"] // per_request + 1
    assert re.search(rf"fp8 would bind near concurrency [^;]*\b{near:,} at {per_request:,} tokens per request", head)


def test_the_first_screen_opens_with_the_decision(decision):
    head, rest = markdown_parts(decision)
    lines = head.splitlines()
    assert any(line.startswith("On TTFT, nvfp4 against fp8:") for line in lines[:15])
    assert len(head) < 8000 and rest.startswith("<details>")
    assert not re.search(r"\bNone\b|\bnan\b", head + rest)


def test_a_point_traced_in_its_own_window_is_split_and_the_others_are_not(tmp_path, recipes):
    """A run directory whose first run's trace stands as point 2's own window (ARM.rK.p2.sqlite): point 2 is traced
    and split, point 0 no longer borrows the run's one trace."""
    source = MATRIX_RUNS["sweep"]
    run = tmp_path / source.name
    shutil.copytree(source, run)
    for arm in ("fp8.r1", "nvfp4.r1", "nvfp4.r2"):
        shutil.copy(source / f"{arm}.sqlite", run / f"{arm}.p2.sqlite")
    result = matrix.build([run], recipes)
    by_index = {index: p for index, p in enumerate(result.scenarios[0].points)}
    assert by_index[2].serving.trace_note is None and by_index[2].reason.steps is not None
    assert by_index[0].serving.trace_note == budget_trace.NOT_TRACED and by_index[0].reason.steps is None
    assert by_index[0].kernel_verdicts == [] and by_index[2].kernel_verdicts == []  # the diff read no such window


@pytest.mark.slow
def test_matrix_plots_draw_the_budget(tmp_path, run_kvtrace):
    code, _, err = run_kvtrace("matrix", *(VLLM033_8B_RUNS[name] for name in sorted(VLLM033_8B_RUNS)),
                               "--format", "markdown", "-o", tmp_path / "m.md", "--plots", tmp_path / "plots")
    assert code == 0, err
    assert (tmp_path / "plots" / "budget.png").stat().st_size > 10_000
    assert "plots/budget.png" in (tmp_path / "m.md").read_text()


@pytest.mark.slow
def test_a_serve_report_keeps_standard_error_short(shipped_output):
    output = shipped_output("report.vllm033-8b-capacity-sweep-repeats")  # report RUN --format markdown -o FILE.md
    assert output.code == 0 and len(output.err.splitlines()) <= 10, output.err
    assert "None" not in output.err


def test_a_serve_report_states_its_pool_engine_settings_and_how_to_record_it_again(shipped_output):
    """Environment: each arm's pool and the flag that set it, the serve run's engine settings; Reproduce: the capture
    command its settings give, every server command and the first run's bench commands as the manifest has them, and
    the model's shape."""
    output = shipped_output("report.vllm033-8b-capacity-sweep")  # report SWEEP --format markdown -o FILE.md
    assert output.code == 0, output.err
    text = output.path.read_text()
    data = json.loads((SWEEP / "manifest.json").read_text())
    tokens = {arm: int(re.search(r"GPU KV cache size: ([\d,]+) tokens", (SWEEP / f"{arm}.log").read_text(
        errors="replace")).group(1).replace(",", "")) for arm in ("fp8", "nvfp4")}
    order = data["settings"]["arms"]
    assert (f"| KV pool | {order[0]} {tokens[order[0]]:,} tokens, {order[1]} {tokens[order[1]]:,} tokens "
            "(--kv-cache-memory-bytes 1 GiB) |") in text
    assert "| engine settings | attention_backend=FLASHINFER," in text and "--max-num-seqs 16" in text
    commands = text.split("```sh\n")[1].split("```")[0].splitlines()
    assert commands[0].startswith("kvtrace capture vllm --model llama-8b-shape --scenario sweep --mode serve")
    assert "--points-from . " in commands[0] and commands[0].endswith("-- --kv-cache-memory-bytes 1073741824 "
                                                                      "--max-num-seqs 16 --max-model-len 4096")
    first = data["arms"][order[0]]["commands"]
    benches = [c for c in first if "bench" in c and "serve" in c]
    assert sum(" bench serve " in c for c in commands) == len(benches) == len(data["arms"][order[0]]["points"]) + 1
    assert sum(c.startswith("nsys profile ") for c in commands) == len(data["arms"])
    model = {k: v for k, v in data["settings"]["model"].items() if k not in ("source", "kv_config")}
    shown = json.loads(text.split("```json\n")[1].split("```")[0])
    assert shown == model


def test_a_point_trace_linked_out_of_its_run_directory_is_refused(tmp_path, recipes):
    source = MATRIX_RUNS["sweep"]
    run = tmp_path / source.name
    shutil.copytree(source, run)
    (run / "fp8.r1.p1.sqlite").symlink_to(source / "fp8.r1.sqlite")
    with pytest.raises(KvtraceError, match="fp8.r1.p1.sqlite leads outside the run directory"):
        matrix.build([run], recipes)
