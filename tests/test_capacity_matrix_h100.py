"""Issue 46's done-when, on the recording that closes it: fixtures/vllm033-h100-matrix, one `kvtrace capture
vllm-matrix` of the Llama-3.1-8B-shaped model (dummy weights) on an NVIDIA H100 80GB HBM3 (vLLM 0.33.0, FlashInfer
0.7.2.post1, a 1 GiB KV pool per arm): one server per arm, both up at once, three interleaved rounds, and in every
point of every run a window of 8 engine steps around a traced pass of the point's shape, closed before its timed
traffic. And issue 47's counterfactual arm nvfp4-validate-once (capture/patches/validate-once.py), with the
co-residence check, from the first matrix recording (fixtures/vllm033-h100-counterfactual).

Expectations come from the recordings' own files, read here without kvtrace: the manifests and matrix.json as the
capture wrote them, the bench client's JSON, the relay's per-request files, vLLM's metrics, the servers' startup
logs and plain SQL over the exports.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import sqlite3
from pathlib import Path

import pytest

from conftest import COUNTERFACTUAL, MATRIX, MATRIX_RUNS, NSYS2025_DIR, REPO

PLAN = json.loads((MATRIX / "matrix.json").read_text())
FIRST_PLAN = json.loads((COUNTERFACTUAL / "matrix.json").read_text())
PATCHED_RUNS = {Path(p).name: COUNTERFACTUAL / p for p in FIRST_PLAN["counterfactual"]}
PATCHED = "nvfp4-validate-once"
PATCH_FILE = REPO / "capture" / "patches" / "validate-once.py"
STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
# The stock capture's budget for the whole matrix (issue 46): servers' start to the last export.
MATRIX_BUDGET_S = 15 * 60


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def sql(export: Path, query: str, *args) -> list[tuple]:
    with sqlite3.connect(f"file:{export}?mode=ro", uri=True) as conn:
        return conn.execute(query, args).fetchall()


def steps_of(export: Path) -> list[tuple[int, int, int, int, int]]:
    """(start, end, context requests, context tokens, decoding requests) of each vLLM step range, in order."""
    rows = sql(export, """SELECT n.start, n."end", COALESCE(s.value, n.text) FROM NVTX_EVENTS n
                          LEFT JOIN StringIds s ON s.id = n.textId
                          WHERE COALESCE(s.value, n.text) LIKE 'execute_%context_%generation_%' ORDER BY n.start""")
    return [(start, end, int(m[1]), int(m[2]), int(m[3])) for start, end, name in rows
            if (m := STEP.fullmatch(name))]


def point_numbers(point: str) -> dict[str, int]:
    return {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", point)}


def logged_pool(run_dir: Path, arm: str) -> int:
    """The KV pool in tokens as the arm's server logged it at startup."""
    (log,) = {entry["log"] for entry in manifest(run_dir)["arms"].values() if entry["arm"] == arm}
    found = re.search(r"GPU KV cache size: ([\d,]+) tokens", (run_dir / log).read_text(errors="replace"))
    return int(found.group(1).replace(",", ""))


def utc(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


# ---- kvtrace matrix over the recording ---------------------------------------------------------------------------

def test_kvtrace_matrix_decides_every_point_on_three_run_pairs_and_traces_every_point(shipped_output):
    """`kvtrace matrix MATRIX` as shipped outputs ran it (tests/shipped_outputs.py), JSON and markdown: every point's
    TTFT estimate is the bench client's own means of three run pairs, no point is set aside (no window stalled its
    timed traffic, no arm did other work) and none is "not traced"."""
    outputs = {fmt: shipped_output("matrix.vllm033-h100-matrix", fmt) for fmt in ("json", "markdown")}
    assert all(o.code == 0 for o in outputs.values()), [o.err for o in outputs.values()]
    data = json.loads(outputs["json"].path.read_text())
    assert sorted(s["runs"] for s in data["scenarios"]) == sorted([n] for n in PLAN["scenarios"])
    points = 0
    for scenario in data["scenarios"]:
        run_dir = MATRIX_RUNS[scenario["runs"][0]]
        recorded = manifest(run_dir)
        rounds = [(f"{scenario['baseline']}.r{r}", f"{scenario['candidate']}.r{r}")
                  for r in range(1, recorded["settings"]["repeats"] + 1)]
        assert len(rounds) == PLAN["repeats"] == 3
        for point in scenario["points"]:
            index = recorded["settings"]["points"].index(point["point"])
            estimate = point["serving"]["estimates"]["ttft_ms"]
            assert estimate["runs"] == 3 and estimate["method"] == "run pairs' means, t interval over run pairs"
            bench = [[json.loads((run_dir / f"{run}.p{index}.bench.json").read_text())["mean_ttft_ms"] for run in pair]
                     for pair in rounds]
            assert [m for pair in estimate["run_means"] for m in pair] == pytest.approx(
                [m for pair in bench for m in pair], rel=1e-9)
            assert point["excluded"] is None and not (point["undecided"] or "").startswith("too few runs")
            assert point["serving"]["baseline"]["window_stall"] is None is point["serving"]["candidate"]["window_stall"]
            assert point["serving"]["trace_note"] is None
            points += 1
    assert points == sum(len(manifest(MATRIX_RUNS[n])["settings"]["points"]) for n in PLAN["scenarios"]) == 7
    assert all("not traced" not in o.path.read_text() for o in outputs.values())


# ---- a window around every point's own traced pass, closed before its timed traffic -----------------------------

@pytest.mark.parametrize("name", sorted(MATRIX_RUNS))
def test_every_point_of_every_run_has_its_own_window_around_a_traced_pass_of_its_shape(name):
    """Each run's window of each point: exported as RUN.pN.sqlite with the 8 engine steps it asked for, around a
    traced pass of the point's own prompt shape and concurrency (two waves, at most 8 output tokens): its steps
    prefill prompts of that length, hold no more requests than the concurrency, and ran no other point's work.
    vLLM's own counters then show the pass outside the timed traffic: the traffic's prompt tokens and requests are
    exactly the point's."""
    run_dir = MATRIX_RUNS[name]
    recorded = manifest(run_dir)
    assert recorded["settings"]["profile_steps"] == 8
    windows = 0
    for run_name, run in recorded["arms"].items():
        assert [w["point"] for w in run["windows"]] == [p["index"] for p in run["points"]]
        for window, point in zip(run["windows"], run["points"]):
            export = run_dir / f"{run_name}.p{point['index']}.sqlite"
            assert window["status"] == "exported" and window["sqlite"] == export.name and export.is_file()
            shape, traced = point_numbers(point["point"]), point["traced_pass"]
            pass_shape = point_numbers(traced["point"])
            prompt = shape["input"] + shape.get("prefix", 0)
            assert {k: v for k, v in pass_shape.items() if k not in ("output", "prompts")} == {
                k: v for k, v in shape.items() if k not in ("output", "prompts")}
            assert pass_shape["output"] == min(shape["output"], 8)
            assert traced["requests"] == pass_shape["prompts"] == min(2 * shape["concurrency"], shape["prompts"])
            steps = steps_of(export)
            assert window["steps"] == len(steps) == 8
            assert steps[0][3] > 0 and all(tokens <= context * prompt for _, _, context, tokens, _ in steps)
            assert all(1 <= context + decoding <= shape["concurrency"] for _, _, context, _, decoding in steps)
            assert sum(tokens for _, _, _, tokens, _ in steps) <= traced["requests"] * prompt
            counters = point["metrics"]["deltas"]["counters"]
            assert counters["vllm:prompt_tokens_total"] == shape["prompts"] * prompt
            assert counters["vllm:request_success_total"] == shape["prompts"]
            windows += 1
    assert windows == sum(len(run["points"]) for run in recorded["arms"].values())


def test_every_sweep_point_carries_at_least_32_requests():
    for run_dir in (MATRIX_RUNS["sweep"], PATCHED_RUNS["sweep"]):
        for name, run in manifest(run_dir)["arms"].items():
            for point in run["points"]:
                stem = f"{name}.p{point['index']}"
                served = [r for r in json.loads((run_dir / f"{stem}.requests.json").read_text()) if r["status"] == 200]
                bench = json.loads((run_dir / f"{stem}.bench.json").read_text())
                assert len(served) == bench["completed"] == point_numbers(point["point"])["prompts"] >= 32
                assert bench["failed"] == 0


def test_the_sweep_reaches_past_fp8s_pool():
    """From inside FP8's pool to past it, by its server's logged size: the smallest concurrency's requests fit it
    whole, the largest's do not (nor do they fit NVFP4's); the server ran fewer of them at once than were sent."""
    sweep = MATRIX_RUNS["sweep"]
    recorded = manifest(sweep)
    pools = {arm: logged_pool(sweep, arm) for arm in ("fp8", "nvfp4")}
    assert pools["fp8"] < pools["nvfp4"]
    shapes = [point_numbers(p) for p in recorded["settings"]["points"]]
    demand = [s["concurrency"] * (s["input"] + s["output"]) for s in shapes]
    assert demand[0] < pools["fp8"] < demand[-1] and demand == sorted(demand)
    last = len(shapes) - 1
    for name, run in recorded["arms"].items():
        if run["arm"] == "fp8":
            running = run["points"][last]["metrics"]["peaks"]["vllm:num_requests_running"]
            assert running < shapes[last]["concurrency"]


# ---- the timeline ---------------------------------------------------------------------------------------------------

def _traffic_inside_phases() -> list[tuple[str, str, int, float, float]]:
    """(scenario, run, point, seconds from its traffic phase's start in matrix.json's timeline to the point's start
    as its manifest stamps it, seconds from the point's end (that start plus its traffic seconds) to the phase's
    end), the phases counted from the servers' start."""
    (start,) = {utc(server["started_utc"]) for server in PLAN["servers"].values()}  # they started together
    elapsed, found = 0.0, []
    for phase in PLAN["timeline"]:
        elapsed += phase["seconds"]
        if phase["phase"] != "traffic":
            continue
        run_dir = MATRIX / phase["scenario"]
        point = next(p for p in manifest(run_dir)["arms"][phase["run"]]["points"] if p["index"] == phase["point"])
        began = utc(point["started_utc"]) - start
        found.append((phase["scenario"], phase["run"], phase["point"],
                      began - (elapsed - phase["seconds"]), elapsed - (began + point["seconds"])))
    return found


# The points' starts are stamped to the second, and the timeline leaves the moments between its phases out.
SLACK_S = 2


def test_the_timeline_sums_to_the_recorded_wall_time_inside_the_budget():
    """matrix.json's seconds are its phases' sum, at most 15 minutes from the servers' start to the last export,
    and the phases keep to the wall clock through all three rounds: every point, as its own manifest times it, lies
    inside its traffic phase counted from the servers' start; the servers lived through the whole timeline."""
    total = sum(phase["seconds"] for phase in PLAN["timeline"])
    assert PLAN["seconds"] == pytest.approx(total, abs=0.05) and total <= MATRIX_BUDGET_S
    found = _traffic_inside_phases()
    recorded = sum(len(run["points"]) for d in MATRIX_RUNS.values() for run in manifest(d)["arms"].values())
    assert len(found) == recorded == sum(1 for p in PLAN["timeline"] if p["phase"] == "traffic") == 42
    assert all(after > -SLACK_S and before > -SLACK_S for *_, after, before in found), found
    assert total <= min(server["lifetime_s"] for server in PLAN["servers"].values())
    exports = [p for p in PLAN["timeline"] if p["phase"] == "export"]
    assert len(exports) == 1 and PLAN["timeline"][-1] is exports[0]


# ---- the counterfactual arm --------------------------------------------------------------------------------------

def test_the_patched_arm_carries_its_patch_name_and_sha256_in_every_manifest():
    sha = hashlib.sha256(PATCH_FILE.read_bytes()).hexdigest()
    patch = {"name": "validate-once", "file": str(PATCH_FILE.relative_to(REPO)), "sha256": sha}
    (arm,) = [a for a in FIRST_PLAN["arms"] if a["patch"]]
    assert arm["label"] == PATCHED and {k: arm["patch"][k] for k in patch} == patch
    assert {k: FIRST_PLAN["servers"][PATCHED]["patch"][k] for k in patch} == patch
    for run_dir in PATCHED_RUNS.values():
        recorded = manifest(run_dir)
        assert {k: recorded["settings"]["patches"][PATCHED][k] for k in patch} == patch
        for name, run in recorded["arms"].items():
            own = json.loads((run_dir / f"{name}.manifest.json").read_text())["arms"][name]
            for entry in (run, own):
                if entry["arm"] == PATCHED:
                    assert {k: entry["patch"][k] for k in patch} == patch and "copied_from" not in entry
                else:  # stock nvfp4, the scenario's own runs copied beside it
                    assert entry["patch"] is None and entry["copied_from"] == f"../../{run_dir.name}/{name}"
    # The scenario's own directory keeps the two stock arms only; its settings list the plan's patch.
    for run_dir in (COUNTERFACTUAL / "sweep",):
        recorded = manifest(run_dir)
        assert {r["arm"] for r in recorded["arms"].values()} == {"fp8", "nvfp4"}
        for listed in recorded["settings"]["patches"].values():
            assert {k: listed[k] for k in patch} == patch


def test_a_report_of_the_patched_arm_names_its_patch_and_sha256(run_kvtrace, tmp_path):
    sha = hashlib.sha256(PATCH_FILE.read_bytes()).hexdigest()
    for fmt in ("markdown", "json"):
        code, _, err = run_kvtrace("report", PATCHED_RUNS["sweep"], "--format", fmt, "-o", tmp_path / f"r.{fmt}")
        assert code == 0, err
        assert sha in (tmp_path / f"r.{fmt}").read_text()


def test_a_matrix_of_the_patched_arm_names_its_patch_and_sha256(shipped_output):
    """`kvtrace matrix ROOT/counterfactual` (a shipped output): the patch and its SHA-256 before <details>, and that
    the arm is no stock release."""
    sha = hashlib.sha256(PATCH_FILE.read_bytes()).hexdigest()
    for fmt in ("markdown", "json"):
        output = shipped_output("matrix.vllm033-h100-counterfactual", fmt)
        assert output.code == 0, output.err
        assert sha in output.path.read_text()
    head = shipped_output("matrix.vllm033-h100-counterfactual").path.read_text().split("<details>")[0]
    assert f"with the patch validate-once (SHA-256 {sha})" in head and "not a stock release" in head


@pytest.mark.parametrize("scenario", sorted(PATCHED_RUNS))
def test_the_patched_arms_eager_steps_make_no_pageable_8_byte_device_to_host_copy(scenario):
    """Counted in plain SQL within each window's kept steps that carry prompt tokens: stock NVFP4 copies 8 bytes from
    the device into pageable memory once per layer (32) in each, the patched arm never, in every run and point."""
    run_dir = PATCHED_RUNS[scenario]
    (pageable,) = sql(NSYS2025_DIR / "fp8.sqlite", "SELECT id FROM ENUM_CUDA_MEM_KIND WHERE label = 'Pageable'")[0]
    layers = manifest(run_dir)["settings"]["model"]["num_hidden_layers"]
    counted = {PATCHED: [], "nvfp4": []}
    for name, run in manifest(run_dir)["arms"].items():
        for point in run["points"]:
            export = run_dir / f"{name}.p{point['index']}.sqlite"
            (d2h,) = sql(export, "SELECT id FROM ENUM_CUDA_MEMCPY_OPER WHERE label = 'Device-to-Host'")[0]
            eager = [(start, end) for start, end, context, _, _ in steps_of(export) if context]
            copies = [sql(export, """SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY m
                                     JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = m.correlationId
                                     WHERE m.copyKind = ? AND m.bytes = 8 AND m.dstKind = ?
                                     AND r.start >= ? AND r.start < ?""", d2h, pageable, start, end)[0][0]
                      for start, end in eager]
            assert eager
            counted[run["arm"]].append(copies)
    assert counted[PATCHED] and all(c == 0 for copies in counted[PATCHED] for c in copies)
    assert counted["nvfp4"] and all(c == layers for copies in counted["nvfp4"] for c in copies)
