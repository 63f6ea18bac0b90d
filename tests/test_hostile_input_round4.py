"""Hostile input, round 4 (issue 48): per-request counts, quality answers and prompts, `.safetensors` inputs,
host-wait tables, tensor-parallel ranks, pooling and repeats, the markdown budget, and the capture plumbing.
tests/test_hostile_input.py holds round 1 and the helpers, round 2 and 3 their own files.

Every CLI run goes through `kv` (no traceback, the inputs on the command line unchanged); every hostile input is
a copy of a real fixture edited in tmp_path. docs/reliability.md has a row per kind.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import sqlite3
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from conftest import (FI_QUALITY, MATRIX_RUNS, NSYS2025_DIR, REPEAT, REPO, TORCH_H100X2, VLLM033_8B_RUNS,
                      VLLM033_RUNS, fingerprint)
from test_bad_input import assert_one_line_error
from kvtrace.analyzer.render.markdown import ISSUE_LIMIT
from test_hostile_input import NVFP4, SMALL, json_of, kv  # noqa: F401 (kv: a fixture)
from test_hostile_input_round3 import _exports, _report, standin_nsys

PREEMPTION = VLLM033_8B_RUNS["capacity-preemption"]  # fp8 and nvfp4, two repeats each, with requests and answers
SWEEP = MATRIX_RUNS["sweep"]  # the H100 matrix's sweep: three rounds, a window per point, copies and syncs kept
NVFP4_REPEAT = REPEAT / "nvfp4.sqlite"  # fi-h200-sm90's nvfp4 recorded again
QUALITY_PROMPTS = REPO / "fixtures" / "quality" / "arithmetic-8.jsonl"


def run_copy(tmp_path: Path, source: Path = PREEMPTION, name: str = "run") -> Path:
    """A writable copy of a real run directory."""
    run = tmp_path / name
    shutil.copytree(source, run)
    for path in [run, *run.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return run


def fingerprints(folder: Path) -> dict:
    return {p.name: fingerprint(p) for p in sorted(folder.iterdir()) if p.is_file()}


# ==== 1. every file of a run directory is an input ================================================================

@pytest.mark.parametrize("name", ["nvfp4.r1.requests.json", "fp8.r2.bench.json", "fp8.r1.quality.json"])
def test_no_output_replaces_a_file_of_the_run_directory(name, tmp_path, kv):
    run = run_copy(tmp_path)
    before = fingerprints(run)
    code, out, err = kv("report", run, "-q", "-o", run / name)
    assert_one_line_error(code, out, err, str(run / name), "never overwrites its inputs", "choose another output")
    assert fingerprints(run) == before


def test_no_output_replaces_a_run_file_through_a_link(tmp_path, kv):
    run = run_copy(tmp_path)
    before = fingerprints(run)
    (tmp_path / "latest.md").symlink_to(run / "nvfp4.r1.requests.json")
    code, out, err = kv("report", run, "-q", "-o", tmp_path / "latest.md")
    assert_one_line_error(code, out, err, "latest.md", "never overwrites its inputs")
    assert fingerprints(run) == before


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# ==== 2. tracebacks become one line ===============================================================================

def _first_context(data: dict, arm: str = "fp8") -> dict:
    return data["arms"][arm]["workload"]["contexts"][0]["quality"]


@pytest.mark.parametrize("value", [-1.0, -0.25, 1.5])
def test_a_recorded_error_out_of_its_range_shows_as_missing(value, tmp_path, kv):
    """As a damaged (NaN) value does: -1 divided by zero (1 + rel_l2), -0.25 was reported as a measured error, and a
    cosine of 1.5 is none."""
    run = run_copy(tmp_path, FI_QUALITY)
    metric = "cosine" if value > 1 else "rel_l2"
    edit_json(run / "manifest.json", lambda d: _first_context(d)["format"]["prefill"].update({metric: value}))
    rows = json_of(kv, "report", run, "-q")["quality"]["errors"]
    first = next(row for row in rows if row["context"] == 2048 and row["what"] == "prefill")
    assert first["baseline_format"] is None and first["candidate_format"] is not None
    assert all(row["baseline_format"] is not None for row in rows if row is not first and row["what"] != "cache k"
               and row["what"] != "cache v")


@pytest.mark.parametrize("command", ["capacity", "report"])
def test_a_fraction_of_a_token_of_capacity_is_one_line(command, tmp_path, kv):
    run = run_copy(tmp_path, SWEEP)
    edit_json(run / "manifest.json", lambda d: d["arms"]["fp8.r1"]["kv_cache"].update(tokens=0.5))
    code, out, err = kv(command, run, *(["-q"] if command == "report" else []))
    assert_one_line_error(code, out, err, str(run / "manifest.json"),
                          re.escape("arms.fp8.r1.kv_cache.tokens is not a whole number of at least 1"))


HOST_WAIT_TABLES = {
    "copy-without-bytes": ("ALTER TABLE CUPTI_ACTIVITY_KIND_MEMCPY DROP COLUMN bytes",
                           "CUPTI_ACTIVITY_KIND_MEMCPY lacks column bytes"),
    "sync-without-correlation": ("ALTER TABLE CUPTI_ACTIVITY_KIND_SYNCHRONIZATION DROP COLUMN correlationId",
                                 "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION lacks column correlationId"),
    "null-bytes": ("UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET bytes = NULL",
                   "CUPTI_ACTIVITY_KIND_MEMCPY has NULL values in bytes"),
    "null-sync-process": ("UPDATE CUPTI_ACTIVITY_KIND_SYNCHRONIZATION SET globalPid = NULL",
                          "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION has NULL values in globalPid"),
    # Silently wrong before: "32 device-to-host copies of -8 bytes", and host waits of negative time.
    "negative-bytes": ("UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET bytes = -8",
                       "CUPTI_ACTIVITY_KIND_MEMCPY has negative values in bytes"),
    "call-ends-before-it-starts": ('UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET start = "end" + 5 WHERE correlationId IN '
                                   "(SELECT correlationId FROM CUPTI_ACTIVITY_KIND_SYNCHRONIZATION)",
                                   "CUPTI_ACTIVITY_KIND_RUNTIME has calls that end before they start"),
}


def _without_constraints(export: Path, table: str) -> None:
    """nsys writes these tables NOT NULL; an edited export need not be."""
    with sqlite3.connect(export) as conn:
        conn.execute(f"CREATE TABLE rebuilt AS SELECT * FROM {table}")
        conn.execute(f"DROP TABLE {table}")
        conn.execute(f"ALTER TABLE rebuilt RENAME TO {table}")
    conn.close()


@pytest.mark.parametrize("kind", sorted(HOST_WAIT_TABLES))
def test_copy_and_synchronization_tables_as_nsys_never_writes_them_are_one_line(kind, tmp_path, kv):
    statement, problem = HOST_WAIT_TABLES[kind]
    run = run_copy(tmp_path, SWEEP)
    export = run / "nvfp4.r1.p0.sqlite"  # the run's manifest export, its first point's window
    if "NULL" in statement:
        _without_constraints(export, statement.split()[1])
    with sqlite3.connect(export) as conn:
        conn.execute(statement)
    conn.close()
    code, out, err = kv("report", run / "fp8.r1", run / "nvfp4.r1", "-q")
    assert_one_line_error(code, out, err, str(export), re.escape(problem), "export the report again")


def _bench_ttfts(run: Path, ttfts) -> None:
    edit_json(run / "nvfp4.r1.bench.json", lambda d: d.update(ttfts=ttfts(d["ttfts"])))


def test_a_ttft_past_floating_point_in_milliseconds_is_left_out_not_written_as_infinity(tmp_path, kv):
    run = run_copy(tmp_path)
    _bench_ttfts(run, lambda ttfts: [1e306] + ttfts[1:])  # seconds: 1e309 ms is inf
    code, out, err = kv("report", run, "-q", "--format", "json")
    assert code == 0, err
    json.loads(out)  # strict JSON: no Infinity


def test_boolean_ttfts_are_no_per_request_times(tmp_path):
    from kvtrace.analyzer import serving
    from kvtrace.manifest import read_manifest

    run = run_copy(tmp_path)
    record = read_manifest(run).runs["nvfp4.r1"].points[0]
    assert serving.request_samples(record, run).ttft_ms is not None
    _bench_ttfts(run, lambda ttfts: [i % 2 == 0 for i in range(len(ttfts))])  # were read as 1,000 ms and 0 ms
    assert serving.request_samples(record, run).ttft_ms is None


def test_more_cached_tokens_than_prompt_tokens_is_one_line(tmp_path, kv):
    """It read "prefilled -104,448 prompt tokens" and a 150.0% cached share."""
    run = run_copy(tmp_path)
    edit_json(run / "manifest.json", lambda d: d["arms"]["nvfp4.r1"]["points"][0].update(cached_tokens=49152))
    code, out, err = kv("report", run, "-q")
    assert_one_line_error(code, out, err, str(run / "manifest.json"),
                          "served 49,152 prompt tokens from the prefix cache of 32,768 sent", "capture the run again")


def _safetensors(path: Path, header: bytes | dict, data: bytes = b"") -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _tensor_table(q_offsets) -> tuple[dict, bytes]:
    """q [100, 4, 32], k and v [100, 2, 32] in BF16, q at `q_offsets`."""
    q, kv_size = 100 * 4 * 32 * 2, 100 * 2 * 32 * 2
    return ({"q": {"dtype": "BF16", "shape": [100, 4, 32], "data_offsets": q_offsets},
             "k": {"dtype": "BF16", "shape": [100, 2, 32], "data_offsets": [q, q + kv_size]},
             "v": {"dtype": "BF16", "shape": [100, 2, 32], "data_offsets": [q + kv_size, q + 2 * kv_size]}},
            bytes(q + 2 * kv_size))


INPUTS = {
    "nested-header": (lambda p: _safetensors(p, b"[" * 100_000 + b"]" * 100_000), "header is nested too deeply"),
    "float-offsets": (lambda p: _safetensors(p, *_tensor_table([0.0, 25600.0])), "q's data offsets [0.0, 25600.0]"),
    "fifo": (lambda p: (os.mkfifo(p), p)[1], "not a regular file"),
}


def _small_memory() -> None:
    """A child's address space of 4 GiB: /dev/zero read whole ends in MemoryError, not in the machine's memory."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _waits(kind: str) -> dict:
    """What may wait for ever or fill memory when unfixed runs in a child with a time limit, never in pytest."""
    return {"preexec_fn": _small_memory, "timeout": 60} if kind in ("fifo", "dev-zero") else {}


@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_inputs_that_are_no_tensor_file_are_one_line(kind, tmp_path, kv):
    """RecursionError, float offsets accepted (a buffer slice then fails on the GPU box), a FIFO waited on."""
    make, problem = INPUTS[kind]
    path = make(tmp_path / "layer.safetensors")
    code, out, err = kv("capture", "flashinfer", "--out", tmp_path / "out", "--inputs", path, "--context", "32",
                        "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32", **_waits(kind))
    assert_one_line_error(code, out, err, f"--inputs {path}", re.escape(problem))
    assert not (tmp_path / "out").exists()


PROMPTS = {
    "dev-zero": (lambda p: Path("/dev/zero"), "not a regular file"),
    "fifo": (lambda p: (os.mkfifo(p), p)[1], "not a regular file"),
    "nested": (lambda p: (p.write_text("[" * 100_000 + "]" * 100_000 + "\n"), p)[1], "line 1 is not JSON"),
    # U+2028, U+2029 and U+0085 are text inside a JSON string; splitlines() broke the line there
    "line-separators": (lambda p: (p.write_text(QUALITY_PROMPTS.read_text().split("\n", 1)[0].replace(
        '"prompt": "', '"prompt": "\u2028\u2029\u0085', 1) + "\n{not json\n"), p)[1], "line 2 is not JSON"),
}


@pytest.mark.parametrize("kind", sorted(PROMPTS))
def test_quality_prompts_that_are_no_prompt_file_are_one_line(kind, tmp_path, kv):
    make, problem = PROMPTS[kind]
    path = make(tmp_path / "prompts.jsonl")
    code, out, err = kv("capture", "vllm", "--model", tmp_path / "model", "--quality-prompts", path, "--dry-run",
                        "--out", tmp_path / "out", **_waits(kind))
    assert_one_line_error(code, out, err, f"--quality-prompts {path}", re.escape(problem))


LONG = "x" * 80_000  # one field of 80,000 characters


def _long_gpu_name(run: Path) -> Path:
    for export in run.glob("*.sqlite"):
        with sqlite3.connect(export) as conn:
            conn.execute("UPDATE TARGET_INFO_GPU SET name = ?", (f"NVIDIA {LONG}",))
        conn.close()
    return run


@pytest.mark.parametrize("target", ["/dev/null", "fifo"])
def test_markdown_past_an_issue_body_written_to_a_device_or_fifo(target, tmp_path, kv):
    """It had no file beside it for the whole document: a TypeError."""
    run = _long_gpu_name(run_copy(tmp_path, NSYS2025_DIR))
    if target == "fifo":
        target = tmp_path / "fifo"
        os.mkfifo(target)
        reader = subprocess.Popen(["cat", str(target)], stdout=subprocess.PIPE)
    code, out, err = kv("report", run, "-q", "--format", "markdown", "-o", target)
    assert code == 0, err
    if target != "/dev/null":
        assert len(reader.communicate(timeout=60)[0].decode()) <= ISSUE_LIMIT


# ==== 3. the markdown kvtrace writes fits an issue body ===========================================================

def _fits(markdown: str) -> None:
    assert len(markdown) <= ISSUE_LIMIT
    assert re.search(r"\(shortened: 80,\d{3} characters in all\)", markdown)  # the long field, with its length


def test_a_long_gpu_name_is_shortened_and_the_report_fits(tmp_path, kv):
    run = _long_gpu_name(run_copy(tmp_path, NSYS2025_DIR))
    code, out, err = kv("report", run, "-q", "-o", tmp_path / "r.md")
    assert code == 0, err
    _fits((tmp_path / "r.md").read_text())
    code, out, err = kv("report", run, "-q", "--format", "markdown")
    _fits(out)


def test_a_long_scenario_is_shortened_and_the_matrix_fits(tmp_path, kv):
    run = run_copy(tmp_path, VLLM033_RUNS["offline-decode-heavy"])
    edit_json(run / "manifest.json", lambda d: d["settings"].update(scenario=LONG))
    code, out, err = kv("matrix", run, "-q", "-o", tmp_path / "m.md")
    assert code == 0, err
    _fits((tmp_path / "m.md").read_text())


def test_a_long_label_is_shortened_and_drawn_at_once(kv):
    """rich wrapped a 100,000-character label for minutes; the markdown head was past the issue body."""
    labels = ("--label", "y" * 100_000, "--label", "b")
    code, out, err = kv("diff", SMALL, NVFP4, *labels, "--format", "markdown")
    assert code == 0, err
    assert len(out) <= ISSUE_LIMIT and "(shortened: 100,000 characters in all)" in out
    code, out, err = kv("diff", SMALL, NVFP4, *labels, child=True, timeout=120)  # a terminal table
    assert code == 0, err
    assert "(shortened: 100,000 characters in all)" in out


def test_the_head_is_cut_at_a_line_when_it_alone_is_past_its_share():
    from kvtrace.analyzer.render import markdown

    top = ["## title", "", "```sh", *(f"command {i} {'z' * 100}" for i in range(1000)), "```"]
    cut = markdown.cut(top, markdown.HEAD_CHARS, "The rest is in the whole report.")
    assert len("\n".join(cut)) <= markdown.HEAD_CHARS
    assert cut[:3] == top[:3] and cut[-3] == "```"  # the open fence is closed before the note
    assert cut[-1].endswith("are left out here to fit a GitHub issue body. The rest is in the whole report.")


def test_no_part_of_the_whole_report_replaces_a_file_of_the_run_directory(tmp_path, kv):
    """The whole report past an issue body is written in parts (r.full.md, r.full-2.md, …), each refused like the
    -o file where it names an input, here through a link; before any part is written."""
    run = run_copy(tmp_path, MATRIX_RUNS["cold-prefill"])  # its whole report is in two parts
    (tmp_path / "r.full-2.md").symlink_to(run / "manifest.json")
    before = fingerprints(run)
    code, out, err = kv("report", run, "-q", "-o", tmp_path / "r.md")
    assert_one_line_error(code, out, err, str(tmp_path / "r.full-2.md"), "never overwrites its inputs",
                          "choose another output")
    assert fingerprints(run) == before
    assert not (tmp_path / "r.md").exists() and not (tmp_path / "r.full.md").exists()


def test_a_line_longer_than_an_issue_body_is_cut_between_parts_that_say_so(shared):
    """The whole document beside an issue-sized file is written in parts that each fit an issue body, ended between
    lines (markdown.parts). One line longer than a part holds must not break that either: it is cut, and the parts
    on both sides of each cut say so. No field kvtrace writes is that long (each is shortened to 2,000 characters),
    so the line is put into a real whole report, inside its Reproduce code block: the fence is closed and opened
    again around every cut."""
    from kvtrace.analyzer.render import markdown, render_text
    from test_upstream_report import balanced, rejoins

    lines = render_text(shared.report([VLLM033_RUNS["serve-sweep"]]), "markdown").split("\n")
    fence = next(i for i, line in enumerate(lines) if line.startswith("```sh"))
    lines.insert(fence + 2, "x" * 200_000)
    whole = "\n".join(lines)
    parts = markdown.parts(whole, "r.full.md")
    assert all(len(part) <= ISSUE_LIMIT and balanced(part) for part in parts)
    said = [part for part in parts if "one line of 200,000 characters cut to fit" in part]
    assert len(said) >= 4 and all(part.split("\n").count("```sh") == 1 for part in said)  # 200,000 / 65,536: 4 parts
    assert rejoins(parts, whole)


# ==== 4. what took for ever ends at once ==========================================================================

@pytest.mark.parametrize("engine", ["vllm", "flashinfer"])
def test_a_huge_repeat_count_is_one_line_before_any_run_is_listed(engine, tmp_path, kv):
    code, out, err = kv("capture", engine, *(["--model", tmp_path / "model", "--dry-run"] if engine == "vllm" else []),
                        "--out", tmp_path / "out", "--repeats", str(10 ** 30), preexec_fn=_small_memory, timeout=120)
    assert_one_line_error(code, out, err, f"--repeats {10 ** 30}", "is more than the 1,000 runs per arm kvtrace "
                          "records", "give fewer")


# ==== 5. a run directory is read inside itself: answers and per-request counts too ================================

@pytest.mark.parametrize("name", ["nvfp4.r1.requests.json", "fp8.r1.quality.json"])
def test_a_run_file_linked_from_outside_the_run_directory_is_not_read(name, tmp_path, kv):
    run = run_copy(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / name).rename(elsewhere / name)
    (run / name).symlink_to(elsewhere / name)
    code, out, err = kv("report", run, "-q")
    assert_one_line_error(code, out, err, repr(name), "leads outside the run directory", "inside it")


# ==== 6. the dry run's plan is text to paste into a shell: nothing in it runs on its own ===========================

def _sweep_manifest(folder: Path, edit=None) -> Path:
    folder.mkdir()
    data = json.loads((VLLM033_RUNS["serve-sweep"] / "manifest.json").read_text())
    if edit:
        edit(data)
    (folder / "manifest.json").write_text(json.dumps(data))
    return folder / "manifest.json"


def _plan(kv, tmp_path, *args):
    return kv("capture", "vllm", "--model", tmp_path / "model", "--scenario", "sweep", "--dry-run", "--out",
              tmp_path / "out", *args)


def test_a_points_from_path_with_a_newline_stays_inside_its_comment(tmp_path, kv):
    source = _sweep_manifest(tmp_path / "runs\ntouch pwned #")
    code, out, err = _plan(kv, tmp_path, "--points-from", source)
    assert code == 0, err
    assert not any(line.startswith("touch") for line in out.splitlines())
    assert "runs\\ntouch pwned #/manifest.json (run fp8) ran" in out


def test_a_host_with_a_newline_is_one_line(tmp_path, kv):
    code, out, err = _plan(kv, tmp_path, "--host", "127.0.0.1\ntouch pwned")
    assert_one_line_error(code, out, err, "--host '127.0.0.1\\ntouch pwned'", "is not a host name or IP address")


@pytest.mark.parametrize("edit,problem", [
    (lambda d: d["arms"]["fp8"]["points"][0].update(point="input=1024,output=16,prompts=0,concurrency=8"),
     "lists the point input=1024,output=16,prompts=0,concurrency=8, which sends no requests"),
    (lambda d: d["arms"]["fp8"]["points"][1].update(point="input=1024,output=-5,prompts=32,concurrency=16"),
     "lists the point input=1024,output=-5,prompts=32,concurrency=16, which sends no requests"),
    (lambda d: d["settings"].update(order=5), None),  # a TypeError; the points stand without the order
    (lambda d: d["settings"].update(order=[["fp8"]]), None),
])
def test_points_from_with_values_of_the_wrong_kind(edit, problem, tmp_path, kv):
    source = _sweep_manifest(tmp_path / "earlier", edit)
    code, out, err = _plan(kv, tmp_path, "--points-from", source, "--repeats", "1")
    if problem is None:
        assert code == 0, err
        assert out.count("bench serve") == 2 * 5  # each arm: a warm-up and the 4 points of the earlier sweep
    else:
        assert_one_line_error(code, out, err, str(source), re.escape(problem), "let this sweep choose its own")


# ==== 7. options that cannot be what they say =====================================================================

@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_a_startup_timeout_that_never_ends_is_one_line(value, tmp_path, kv):
    code, out, err = kv("capture", "vllm", "--model", tmp_path / "model", "--startup-timeout", value, "--dry-run",
                        "--out", tmp_path / "out")
    assert_one_line_error(code, out, err, "--startup-timeout", "is not a finite number of seconds above 0")


# ==== 8. a run is not independent evidence of itself ==============================================================

def test_a_repeat_that_is_a_byte_copy_of_another_is_one_line(tmp_path, kv):
    run = run_copy(tmp_path)
    shutil.copyfile(run / "fp8.r1.sqlite", run / "fp8.r2.sqlite")
    code, out, err = kv("report", run, "-q")
    assert_one_line_error(code, out, err, "fp8.r1.sqlite", "hold the same bytes: a run is not independent evidence "
                          "of itself", "capture it again")


def test_a_bench_result_copied_from_another_repeat_is_one_line(tmp_path, kv):
    run = run_copy(tmp_path)
    shutil.copyfile(run / "nvfp4.r1.bench.json", run / "nvfp4.r2.bench.json")
    code, out, err = kv("report", run, "-q")
    assert_one_line_error(code, out, err, "nvfp4.r1.bench.json", "hold the same bytes")


def test_a_run_directory_copied_is_not_pooled_as_a_second_recording(tmp_path, kv):
    """Two byte-identical copies of one run decided 12 points on zero-width intervals."""
    first = run_copy(tmp_path, SWEEP, "first")
    second = run_copy(tmp_path, SWEEP, "second")
    code, out, err = kv("matrix", first, second, "-q")
    assert_one_line_error(code, out, err, "fp8.r1.p0.sqlite", "hold the same bytes", "give each recording once")


def test_a_repeat_of_diff_that_is_a_byte_copy_is_one_line(tmp_path, kv):
    copy = tmp_path / "fp8-again.sqlite"
    shutil.copyfile(SMALL, copy)
    code, out, err = kv("diff", SMALL, NVFP4, "--repeat", copy, NVFP4_REPEAT)
    assert_one_line_error(code, out, err, str(copy), "hold the same bytes", "pass every run once")


def test_a_rank_count_that_differs_in_a_later_repeat_pair_is_an_error(tmp_path, kv):
    """Only the first pair's counts were compared: the second pair's mismatch was called ok."""
    before, after = TORCH_H100X2 / "before.sqlite", TORCH_H100X2 / "after.sqlite"
    again = {name: tmp_path / f"{name}-again.sqlite" for name in ("before", "after")}
    for name, source in (("before", before), ("after", after)):
        shutil.copyfile(source, again[name])
    with sqlite3.connect(again["after"]) as conn:  # the second candidate ran on one GPU
        conn.execute("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE deviceId = 1")
    conn.close()
    with sqlite3.connect(again["before"]) as conn:  # another recording, not a byte copy
        conn.execute("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE rowid = (SELECT max(rowid) FROM "
                     "CUPTI_ACTIVITY_KIND_KERNEL)")
    conn.close()
    findings = json_of(kv, "diff", before, after, "--repeat", again["before"], again["after"])["findings"]
    errors = [f["message"] for f in findings if f["check"] == "ranks" and f["level"] == "error"]
    assert len(errors) == 1 and errors[0].startswith("r2: ") and "ran on 2 GPU(s)" in errors[0] \
        and "on 1: ranks pair by device order" in errors[0]


# ==== 9. child processes: what the user sees while kvtrace waits, and nothing left behind =========================

def test_a_slow_export_says_what_kvtrace_waits_for(tmp_path, kv, monkeypatch):
    import kvtrace.nsys

    monkeypatch.setattr(kvtrace.nsys, "WAIT_NOTICE_S", 0.2)
    report, nsys = _report(tmp_path), standin_nsys(tmp_path)
    nsys.write_text(nsys.read_text().replace("for a in", "sleep 1\nfor a in", 1))
    code, out, err = kv("kernels", report, "--no-cache", "--format", "json", env={"NSYS": str(nsys)})
    assert code == 0, err
    assert re.search(rf"kvtrace: waiting for nsys export of {re.escape(str(report))}: \d+ s so far, stopped at "
                     r"\d+ s\n", err), err


def test_an_export_made_without_a_cache_folder_is_removed_as_kvtrace_exits(tmp_path, kv):
    """Neither the cache folder nor the private fallback can be made: the export went to a temporary folder of its
    own, which stayed behind."""
    report, nsys = _report(tmp_path), standin_nsys(tmp_path)
    temp = tmp_path / "tmp"
    temp.mkdir()
    (temp / f"kvtrace-{os.getuid()}").write_text("not a folder\n")
    (tmp_path / "not-a-folder").write_text("x\n")
    code, out, err = kv("kernels", report, "--format", "json", child=True,
                        env={"NSYS": str(nsys), "TMPDIR": str(temp), "KVTRACE_CACHE_DIR": str(tmp_path / "not-a-folder")})
    assert code == 0, err
    assert json.loads(out)["rows"] and _exports(tmp_path) == 1
    assert sorted(p.name for p in temp.iterdir()) == [f"kvtrace-{os.getuid()}"]


# ==== 10. statistics that divided by zero or summed for ever ======================================================

@pytest.mark.slow
def test_a_candidate_serving_mean_of_zero_over_two_run_pairs_is_no_ratio(tmp_path, kv):
    """Its log-scale interval divided by the ratio 0."""
    run = run_copy(tmp_path)
    for name in ("nvfp4.r1", "nvfp4.r2"):
        edit_json(run / f"{name}.bench.json", lambda d: d.update(ttfts=[0.0] * len(d["ttfts"])))
    edit_json(run / "manifest.json", lambda d: [point["bench"].update({key: 0.0 for key in point["bench"] if "ttft" in key})
                                                for name in ("nvfp4.r1", "nvfp4.r2") for point in d["arms"][name]["points"]])
    for command in ("report", "matrix"):
        code, out, err = kv(command, run, "-q", "--format", "json")
        assert code == 0, err
        json.loads(out)


def _exact_mcnemar(baseline_only: int, candidate_only: int) -> float:
    """The two-sided binomial tail summed in integers, as a fraction: the reference."""
    n = baseline_only + candidate_only
    tail = sum(math.comb(n, i) for i in range(min(baseline_only, candidate_only) + 1))
    return float(min(Fraction(1), Fraction(2 * tail, 2 ** n))) if n else 1.0


@pytest.mark.parametrize("counts", [(0, 0), (0, 7), (3, 12), (30, 10), (250, 300), (1000, 1100)])
def test_mcnemar_summed_in_floating_point_is_the_exact_tail(counts):
    from kvtrace.analyzer.stats.mcnemar import mcnemar_exact

    assert mcnemar_exact(*counts) == pytest.approx(_exact_mcnemar(*counts), rel=1e-10, abs=1e-300)


def test_mcnemar_on_tens_of_thousands_of_discordant_prompts_ends(tmp_path):
    """15,000 binomial terms of thousands of digits each took 23 s for 10,000 pairs; 40,000 took minutes."""
    code = ("from kvtrace.analyzer.stats.mcnemar import mcnemar_exact; "
            "print(mcnemar_exact(19_900, 20_100), mcnemar_exact(10, 39_990))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    middle, far = map(float, done.stdout.split())
    assert 0.3 < middle < 0.4 and far == 0.0  # z = 1.0 by the normal approximation; 2 * C(40000, 10) / 2^40000
