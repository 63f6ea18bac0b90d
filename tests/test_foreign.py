"""Traces kvtrace did not make (issue 22): PyTorch programs annotated by PyTorch itself, whose operator and step
ranges number every instance (`op_id = N`, `step N`), and one process running both KV formats. The fixtures
are real H200 recordings (fixtures/torch-h200); every count below is checked against plain SQL."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3

import pytest

from conftest import REAL_SQLITE, TORCH_H200
from kvtrace.analyzer import align, compare
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.names import INSTANCE, NameKey
from kvtrace.analyzer.stats.verdicts import Verdict

BLOCK_A, BLOCK_B, BLOCK_TANH = (TORCH_H200 / f"{name}.sqlite" for name in ("block-a", "block-b", "block-tanh"))
BOTH = TORCH_H200 / "both-formats.sqlite"
GELU = "%GeluCUDAKernelImpl%"


def sql(path, query: str, *args) -> list[tuple]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute(query, args).fetchall()


def range_names(path) -> list[str]:
    return [row[0] for row in sql(path, "SELECT text FROM NVTX_EVENTS WHERE text IS NOT NULL")]


def kernels_in(path, name_regex: str | None = None) -> int:
    """Kernels whose launch call lies inside an NVTX range (on its thread) whose name matches the regex;
    all kernels without one. Plain SQL and Python's re, no kvtrace code."""
    if name_regex is None:
        return sql(path, "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL")[0][0]
    rows = sql(path, """
        SELECT DISTINCT k.rowid, n.text FROM CUPTI_ACTIVITY_KIND_KERNEL k
        JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = k.correlationId
             AND (r.globalTid & 0xFFFFFFFFFF000000) = k.globalPid
        JOIN NVTX_EVENTS n ON n.globalTid = r.globalTid AND n.start <= r.start AND n."end" >= r."end"
             AND n.text IS NOT NULL""")
    return len({kernel for kernel, text in rows if re.search(name_regex, text)})


@pytest.fixture(scope="module")
def recipes():
    return load_recipes()


# ---- the pairing key ---------------------------------------------------------------------------------------

def test_pytorch_operator_names_lose_their_instance_numbers_and_keep_their_shapes():
    names = range_names(BLOCK_A)
    assert sum("op_id = " in n for n in names) > 700  # emit_nvtx(record_shapes=True) ranges, one per operator call
    keys = NameKey().of(names)
    for name, key in zip(names, keys):
        if "op_id = " in name:
            assert re.search(r"op_id = \d", key) is None and "input_op_ids = *" in key
            assert re.search(r"sizes = \[.*?\]\]", name).group() in key  # tensor shapes stay
    # Every step ran the same operators: one step's keys are another's.
    by_step = {}
    for (start, end, text) in sql(BLOCK_A, "SELECT start, \"end\", text FROM NVTX_EVENTS WHERE text LIKE 'step %'"):
        inside = [row[0] for row in sql(BLOCK_A, "SELECT text FROM NVTX_EVENTS WHERE start > ? AND \"end\" <= ? "
                                                 "AND text LIKE 'aten::%' ORDER BY start", start, end)]
        by_step[text] = NameKey().of(inside)
    assert len(by_step) == 12 and len(set(map(tuple, by_step.values()))) == 1
    assert NameKey().of([f"step {i}" for i in range(12)]) == [f"step {INSTANCE}"] * 12


def test_kvtrace_and_vllm_names_are_their_own_keys():
    """Token counts and contexts are not counters: every range name of every other shipped fixture is kept."""
    names = sorted({n for path in REAL_SQLITE.values() for n in range_names(path)})
    assert any(n.startswith("execute_context_") for n in names) and any(n.startswith("kvtrace:") for n in names)
    assert NameKey().of(names) == names
    assert NameKey().of(["execute_context_8(16384)_generation_0(0)", "kvtrace:prefill ctx=2048 batch=8"]) == \
        ["execute_context_8(16384)_generation_0(0)", "kvtrace:prefill ctx=2048 batch=8"]


def test_other_loop_counters_and_the_users_choices():
    key = NameKey()
    assert key.of(["ProfilerStep#5", "iteration 3", "aten::mm, seq = 12, op_id = 40, sizes = [[2, 3]]"]) == \
        ["ProfilerStep#*", "iteration *", "aten::mm, seq = *, op_id = *, sizes = [[2, 3]]"]
    assert NameKey(keep=(r"step \d+",)).of(["step 17", "ProfilerStep#5"]) == ["step 17", "ProfilerStep#*"]
    assert NameKey(keep=(".*",)).of(["aten::mm, op_id = 40"]) == ["aten::mm, op_id = 40"]
    assert NameKey(ignore=(r"_(fp8|nvfp4)$",)).of(["prefill_fp8", "prefill_nvfp4"]) == ["prefill_*", "prefill_*"]
    assert NameKey(ignore=(r"layer\d+",)).of(["layer3.attn"]) == ["*.attn"]


# ---- diff and summary on two runs of one program -----------------------------------------------------------

@pytest.fixture(scope="module")
def runs():
    return [open_trace(path) for path in (BLOCK_A, BLOCK_B, BLOCK_TANH)]


def test_two_runs_of_one_program_pair_every_call(runs, recipes):
    a, b, _ = runs
    result = compare.diff(a, b, recipes)
    assert kernels_in(BLOCK_A) == kernels_in(BLOCK_B) == 163
    assert sum(r.compared_calls for r in result.segments) == 163
    for row in result.segments + result.families:
        assert row.compared_calls == row.baseline_calls == row.candidate_calls, row
        assert row.verdict == Verdict.NO_CHANGE, row
    # The operator ranges of all 12 steps are one cell per operator and shape: 12 calls, not 12 single calls.
    gelu = [r for r in result.phases if r.segment == "activation" and r.phase.startswith("aten::gelu")]
    assert [r.compared_calls for r in gelu] == [kernels_in(BLOCK_A, r"^aten::gelu, ")] == [12]


def test_instance_numbers_that_differ_still_pair(runs, recipes):
    """Steps 0-5 against steps 6-11 of one trace: the same operators under different op_ids."""
    a = runs[0]
    early, late = (align.Window(arm=arm) for arm in (r"^step [0-5]$", r"^step ([6-9]|1[01])$"))
    inside = kernels_in(BLOCK_A, r"^step [0-5]$")
    # block.py's step: 2 layer norms, 4 GEMMs, 1 attention, 1 GELU, 2 residual adds.
    assert inside == kernels_in(BLOCK_A, r"^step ([6-9]|1[01])$") == 6 * 10
    result = compare.diff(a, a, recipes, window=early, candidate_window=late)
    assert sum(r.compared_calls for r in result.segments) == inside
    assert all(r.baseline_calls == r.candidate_calls == r.compared_calls for r in result.segments)
    # Keyed on full names (the old behaviour, --nvtx-keep '.*'), no operator call meets its twin.
    full = NameKey(keep=(".*",))
    result = compare.diff(a, a, recipes, window=align.Window(arm=early.arm, names=full),
                          candidate_window=align.Window(arm=late.arm, names=full))
    assert sum(r.compared_calls for r in result.segments) == 0


def test_a_changed_kernel_is_found_and_only_it(runs, recipes):
    a, _, tanh = runs
    names = [{n for (n,) in sql(p, "SELECT DISTINCT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
                                   "ON s.id = k.demangledName")} for p in (BLOCK_A, BLOCK_TANH)]
    changed = names[0] ^ names[1]
    assert changed and all("GeluCUDAKernelImpl" in n for n in changed)
    result = compare.diff(a, tanh, recipes)
    moved = [r.segment for r in result.segments if r.verdict not in (Verdict.NO_CHANGE,)]
    assert moved == ["activation"]
    activation = next(r for r in result.segments if r.segment == "activation")
    assert activation.verdict == Verdict.IMPROVEMENT and not activation.kv_independent
    durations = [[e - s for (s, e) in sql(p, "SELECT k.start, k.\"end\" FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN "
                                             "StringIds s ON s.id = k.demangledName WHERE s.value LIKE ?", GELU)]
                 for p in (BLOCK_A, BLOCK_TANH)]
    assert activation.ci_low <= sum(durations[1]) / sum(durations[0]) <= activation.ci_high
    families = {r.family_label: r.verdict for r in result.families if r.family_label != "GeluCUDAKernelImpl"}
    assert set(families.values()) == {Verdict.NO_CHANGE}
    # The changed kernel does not widen the drift band that would hide it.
    assert "gelu" not in (result.drift.widest or "").lower() and result.drift.band < 1 - activation.ci_high


def test_diff_head_fits_the_screen(run_kvtrace):
    code, out, err = run_kvtrace("diff", BLOCK_A, BLOCK_B, env={"COLUMNS": "100"})
    assert code == 0, err
    head = out.split("everything else")[0].splitlines()
    assert 3 <= len(head) <= 60 and "gemm" in out.split("everything else")[0]


def test_summary_gives_per_call_statistics_where_only_instance_numbers_differ(runs, recipes):
    summary = compare.summarize(runs[0], recipes)
    by_family = {r.family_label: r for r in summary.families}
    for label, like in (("vectorized_layer_norm_kernel", "%vectorized_layer_norm_kernel%"),
                        ("CUDAFunctor_add", "%CUDAFunctor_add%")):
        row = by_family[label]
        durations = [e - s for (s, e) in sql(BLOCK_A, "SELECT k.start, k.\"end\" FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                                                      "JOIN StringIds s ON s.id = k.demangledName WHERE s.value LIKE ?",
                                             like)]
        assert row.stats.mean_ns == pytest.approx(sum(durations) / len(durations)) and row.stats.calls == 30


# ---- both arms in one trace ----------------------------------------------------------------------------------

def test_one_trace_holds_both_arms(run_kvtrace):
    code, out, err = run_kvtrace("diff", BOTH, "--arms", "bench fp8", "bench nvfp4", "--format", "json")
    assert code == 0, err
    result = json.loads(out)
    assert (result["baseline"]["label"], result["candidate"]["label"]) == ("bench fp8", "bench nvfp4")
    calls = [sum(r[f"{side}_calls"] for r in result["segments"]) for side in ("baseline", "candidate")]
    assert calls == [kernels_in(BOTH, "bench fp8"), kernels_in(BOTH, "bench nvfp4")]
    neither = kernels_in(BOTH) - kernels_in(BOTH, "^bench ")
    messages = [f["message"] for f in result["findings"]]
    assert any(f"{neither:,} of its {kernels_in(BOTH):,} calls fall in neither arm's window" in m for m in messages)
    assert {r["phase"] for r in result["phases"]} == {"append", "decode"}
    assert any(f["check"] == "gpu" and f["level"] == "ok" for f in result["findings"])
    # Windows that nest: the calls of `bench nvfp4` are in both arms, and the output says so.
    code, out, err = run_kvtrace("diff", BOTH, "--arms", "bench fp8", "bench nvfp4", "--format", "markdown")
    assert code == 0 and "kvtrace diff both-formats.sqlite --arms 'bench fp8' 'bench nvfp4' --format markdown" in out
    code, out, err = run_kvtrace("diff", BOTH, "--arms", "bench", "bench nvfp4", "--format", "json")
    both = kernels_in(BOTH, "bench nvfp4")
    assert code == 0 and any(f"{both:,} calls fall in both arms' windows" in f["message"]
                             for f in json.loads(out)["findings"])


def test_one_trace_without_arms_is_refused(run_kvtrace):
    code, out, err = run_kvtrace("diff", BOTH)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--arms" in err and "Traceback" not in err
    code, out, err = run_kvtrace("diff", BOTH, "--arms", "bench fp8", "bench nvfp4", "--nvtx-ignore", "(")
    assert code == 2 and "--nvtx-ignore" in err and "Traceback" not in err


# ---- exports without the tables kvtrace reads for the environment ---------------------------------------------

def test_an_export_without_gpu_table_says_unknown(tmp_path, run_kvtrace):
    copy = tmp_path / "no-gpu.sqlite"
    shutil.copyfile(BLOCK_A, copy)
    with sqlite3.connect(copy) as conn:
        conn.execute("DROP TABLE TARGET_INFO_GPU")
    code, out, err = run_kvtrace("diff", copy, BLOCK_B, "--format", "json")
    assert code == 0, err
    gpu = [f for f in json.loads(out)["findings"] if f["check"] == "gpu"]
    assert [f["level"] for f in gpu] == ["warning"] and "GPU unknown for no-gpu" in gpu[0]["message"]
    code, out, err = run_kvtrace("summary", copy)
    assert code == 0 and "unknown GPU" in out.splitlines()[0]
    assert "NVIDIA H200" in run_kvtrace("summary", BLOCK_A)[1].splitlines()[0]


def test_a_newer_schema_reads_the_same(tmp_path, run_kvtrace):
    """Synthetic, from the real block-a export: the columns that Nsight Systems' 2026.4 schema reference (3.28.1,
    /work/shared/reference/nsys-sqlite.md §1.3) appends to the kernel table, and its version strings. kvtrace
    reads tables and columns by name, so the summary is the same but for the version it reports."""
    copy = tmp_path / "newer.sqlite"
    shutil.copyfile(BLOCK_A, copy)
    with sqlite3.connect(copy) as conn:
        for column in ("qmdBulkReleaseDone INT", "graphId INT", "clusterX INT", "clusterY INT", "clusterZ INT",
                       "sharedMemoryRequestedPercentage INT", "tensorSizeMinusOneElements TEXT NOT NULL DEFAULT ''"):
            conn.execute(f"ALTER TABLE CUPTI_ACTIVITY_KIND_KERNEL ADD COLUMN {column}")
        conn.execute("UPDATE META_DATA_EXPORT SET value = '3.28.1' WHERE name = 'EXPORT_SCHEMA_VERSION'")
        conn.execute("UPDATE META_DATA_EXPORT SET value = '2026.4.1.0' WHERE name = 'EXPORT_PRODUCT_VERSION'")
    summaries = []
    for path in (BLOCK_A, copy):
        code, out, err = run_kvtrace("summary", path, "--format", "json")
        assert code == 0, err
        summaries.append(json.loads(out))
    assert summaries[1]["arm"]["info"]["schema_version"] == "3.28.1"
    assert summaries[0]["segments"] == summaries[1]["segments"] and summaries[0]["families"] == summaries[1]["families"]
