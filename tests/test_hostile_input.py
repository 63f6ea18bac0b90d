"""Hostile input (issue 14): what a careless user or an attacker can hand kvtrace, mostly through the real CLI
on the real fixtures. docs/reliability.md lists the classes and the promised behaviour of each.

Every CLI run here goes through `kv`, which also asserts that no traceback was printed and that every input
file named on the command line kept its bytes and mtime. Cache cases compare against a fresh read of the
export (`--no-cache`), so a stale or wrong cached result fails. Hostile traces are real exports with one value
edited in tmp_path (synthetic by construction; nsys never writes them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from conftest import GOOD_SQLITE, NSYS2023_REPORTS, NSYS2025_DIR, REPEATS2, REPO, VLLM_COLD_PREFILL, fingerprint
import kvtrace.nsys
from kvtrace.analyzer import kernels, load, render
from kvtrace.analyzer.render import escape
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.kernel_names import parse_kernel_name
from kvtrace.capture import runner
from kvtrace.errors import KvtraceError
from test_bad_input import _drop_dac_capabilities, _kvtrace_runs, assert_one_line_error

FP8, NVFP4 = NSYS2025_DIR / "fp8.sqlite", NSYS2025_DIR / "nvfp4.sqlite"
SMALL = GOOD_SQLITE  # 176 kernels
KERNEL = "CUPTI_ACTIVITY_KIND_KERNEL"
_OUTPUT_OPTIONS = {"-o", "--output", "--plots"}


@pytest.fixture
def kv(run_kvtrace):
    """run_kvtrace, plus: no traceback anywhere, and the input files on the command line left untouched."""

    def run(*args, **options):
        words = [str(a) for a in args]
        inputs = [Path(w) for i, w in enumerate(words)
                  if Path(w).is_absolute() and Path(w).is_file() and (i == 0 or words[i - 1] not in _OUTPUT_OPTIONS)]
        before = {p: fingerprint(p) for p in inputs}
        code, out, err = run_kvtrace(*args, **options)
        assert "Traceback" not in out + err, err
        assert {p: fingerprint(p) for p in inputs} == before, "an input was modified"
        return code, out, err

    return run


def edited(tmp: Path, name: str, *statements: str, source: Path = SMALL, unconstrained: str | None = None) -> Path:
    """A copy of a real export with SQL applied; `unconstrained` rebuilds that table without its NOT NULLs."""
    path = tmp / name
    shutil.copyfile(source, path)  # bytes only: the unpacked fixtures are read-only
    with sqlite3.connect(path) as conn:
        if unconstrained:
            conn.execute(f"CREATE TABLE rebuilt AS SELECT * FROM {unconstrained}")
            conn.execute(f"DROP TABLE {unconstrained}")
            conn.execute(f"ALTER TABLE rebuilt RENAME TO {unconstrained}")
        for statement in statements:
            conn.execute(statement)
    conn.close()
    return path


def named(tmp: Path, text: str, name: str = "hostile.sqlite", source: Path = SMALL) -> Path:
    """A real export whose earliest kernel (and every launch of the same kernel) is called `text`."""
    return edited(tmp, name, f"UPDATE StringIds SET value = {_sql_text(text)} WHERE id = (SELECT demangledName "
                  f"FROM {KERNEL} ORDER BY start LIMIT 1)", source=source)


def _sql_text(text: str) -> str:
    return "CAST(X'" + text.encode().hex() + "' AS TEXT)"


def json_of(kv, *args, **options) -> dict:
    code, out, err = kv(*args, "--format", "json", **options)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def without_dac():
    """preexec_fn under which file modes bind (root drops CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH), or None."""
    if os.geteuid() != 0:
        return None
    if not _kvtrace_runs(_drop_dac_capabilities):
        message = "cannot drop the DAC capabilities here"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return _drop_dac_capabilities


# ==== 1. the cache removes only what kvtrace made ========================================================

def _old(path: Path) -> None:
    month_ago = time.time() - 30 * 86400
    os.utime(path, (month_ago, month_ago))


def _user_folder(folder: Path) -> Path:
    """A month-old folder of the user's with a file in it."""
    folder.mkdir(parents=True)
    (folder / "result.txt").write_text("x\n")
    _old(folder)
    return folder


@pytest.mark.parametrize("layout", ["traces-folder", "traces-link"])
def test_cache_cleanup_removes_only_kvtrace_entries(layout, tmp_path, kv):
    cache = tmp_path / "shared"
    user = tmp_path / "user-data" if layout == "traces-link" else cache / "traces"
    # Plain, and named like an entry or a temporary entry (but without kvtrace's marker).
    keep = [_user_folder(user / "run-old"), _user_folder(user / "run-aaaaaaaaaaaa-bbbbbbbbbbbb"),
            _user_folder(user / ".run-aaaaaaaaaaaa-bbbbbbbbbbbb-x")]
    (user / "link-aaaaaaaaaaaa-bbbbbbbbbbbb").symlink_to(keep[0])  # an entry's name, but a link
    user.chmod(0o700)
    if layout == "traces-link":
        cache.mkdir()
        (cache / "traces").symlink_to(user)
    env = {"KVTRACE_CACHE_DIR": str(cache)}
    # An entry kvtrace made and nobody has read for a month: the clean-up still removes that.
    assert kv("summary", SMALL, "--format", "json", env=env)[0] == 0
    [made] = [p for p in user.iterdir() if p.name.startswith(SMALL.stem + "-")]
    _old(made)

    code, out, err = kv("summary", FP8, "--format", "json", env=env)

    assert code == 0, err
    assert not made.exists()
    for folder in keep:
        assert (folder / "result.txt").read_text() == "x\n"
    assert (user / "link-aaaaaaaaaaaa-bbbbbbbbbbbb").is_symlink()


# ==== 2. -o never replaces an input, writes devices in place, writes through links ======================

@pytest.mark.parametrize("how", ["same-path", "symlink", "hard-link"])
def test_output_onto_an_input_is_refused(how, tmp_path, kv):
    baseline = tmp_path / "fp8.sqlite"
    shutil.copy2(SMALL, baseline)
    target = {"same-path": baseline, "symlink": tmp_path / "out.json", "hard-link": tmp_path / "out.json"}[how]
    if how == "symlink":
        target.symlink_to(baseline)
    elif how == "hard-link":
        os.link(baseline, target)
    before = fingerprint(baseline)
    code, out, err = kv("diff", baseline, NVFP4, "--format", "json", "-o", target)
    assert_one_line_error(code, out, err, str(target), r"is the input", r"choose another output")
    assert fingerprint(baseline) == before


def test_output_onto_a_recipe_is_refused(tmp_path, kv):
    recipe = tmp_path / "mine.toml"
    recipe.write_text('[[rule]]\nid = "x"\nsegment = "gemm"\nmatch = "nvjet"\n')
    code, out, err = kv("summary", SMALL, "--recipe", recipe, "-o", recipe)
    assert_one_line_error(code, out, err, str(recipe), r"is the input")
    assert "[[rule]]" in recipe.read_text()


def test_output_onto_a_repeat_run_is_refused_before_loading(tmp_path, kv):
    """--repeat's pairs are inputs as well; the refusal comes first, before the (here unreadable) run is loaded."""
    repeat = tmp_path / "nvfp4.r2.sqlite"
    repeat.write_text("not yet exported")
    code, out, err = kv("diff", SMALL, NVFP4, "--repeat", SMALL, repeat, "-o", repeat)
    assert_one_line_error(code, out, err, str(repeat), r"is the input", r"choose another output")
    assert repeat.read_text() == "not yet exported"


def test_output_onto_a_later_run_of_a_repeats_capture_is_refused(tmp_path, kv):
    run = tmp_path / "run"
    shutil.copytree(REPEATS2, run, ignore=shutil.ignore_patterns("*.nsys-rep"))
    later = run / "nvfp4.r2.sqlite"
    before = fingerprint(later)
    code, out, err = kv("report", run, "--format", "json", "-o", later)
    assert_one_line_error(code, out, err, str(later), r"is the input", r"choose another output")
    assert fingerprint(later) == before


def test_output_to_a_character_device_is_written_in_place(tmp_path, kv):
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null of the test's own
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    code, out, err = kv("summary", SMALL, "-o", device)
    assert code == 0, err
    assert stat.S_ISCHR(device.lstat().st_mode)


def test_output_to_a_fifo_is_written_in_place(tmp_path, kv):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    code, out, err = kv("summary", SMALL, "--format", "csv", "-o", fifo, timeout=120)
    if code != 0:  # the reader waits for a writer that never came
        with open(fifo, "w"):
            pass
    reader.join(30)
    assert code == 0, err
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert received and received[0].startswith("level,segment,")


def test_output_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path, kv):
    (tmp_path / "reports").mkdir()
    target = tmp_path / "reports" / "latest.md"
    target.write_text("old report\n")
    link = tmp_path / "latest.md"
    link.symlink_to(target)
    code, out, err = kv("summary", SMALL, "-o", link)
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == target
    assert target.read_text().startswith("## kvtrace summary")
    assert sorted(p.name for p in target.parent.iterdir()) == ["latest.md"]  # no temporary file left


def test_output_through_a_descriptor_appends_as_a_redirect_would(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("earlier line\n")
    with open(log, "a") as handle:
        result = subprocess.run([sys.executable, "-m", "kvtrace", "summary", str(SMALL), "--format", "csv", "-o",
                                 "/proc/self/fd/1"], stdout=handle, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "KVTRACE_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    text = log.read_text()
    assert text.startswith("earlier line\nlevel,segment,")


def test_output_dash_is_standard_output(tmp_path, kv):
    code, out, err = kv("summary", SMALL, "--format", "csv", "-o", "-")
    assert code == 0, err
    assert out.startswith("level,segment,")
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("suffix,starts", [(".md", "## kvtrace summary"), (".json", "{"), (".csv", "level,"),
                                           (".txt", "fp8: NVIDIA H200")])
def test_output_suffix_picks_the_format(suffix, starts, tmp_path, kv):
    target = tmp_path / f"summary{suffix}"
    code, out, err = kv("summary", SMALL, "-o", target)
    assert code == 0, err
    assert out == "" and target.read_text().startswith(starts)
    code, out, err = kv("summary", SMALL, "--format", "json", "-o", target)  # --format wins
    assert code == 0, err
    assert target.read_text().startswith("{")


def test_findings_reach_standard_error_when_writing_a_file(tmp_path, kv):
    folder = VLLM_COLD_PREFILL
    target = tmp_path / "diff.md"
    code, out, err = kv("diff", folder / "auto.sqlite", folder / "fp8.sqlite", "-o", target)
    assert code == 0, err
    assert out == ""
    warnings = [line for line in err.splitlines() if line.startswith("kvtrace: warning: ")]
    assert any("different vLLM steps" in line for line in warnings)
    # The same findings, as markdown prose writes them (`<` of "< 4 µs" escaped, analyzer.render.escape.md_prose).
    markdown = target.read_text()
    assert all(escape.md_prose(line.split("kvtrace: warning: ", 1)[1]) in markdown for line in warnings)


@pytest.mark.slow
def test_output_errors_are_one_line(tmp_path, kv, without_dac):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        code, out, err = kv("summary", SMALL, "-o", folder / "report.md", preexec_fn=without_dac)
    finally:
        folder.chmod(0o755)
    assert_one_line_error(code, out, err, str(folder / "report.md"), r"permission denied", r"folder you can write")
    assert list(folder.iterdir()) == []
    code, out, err = kv("summary", SMALL, "-o", "/proc/x")
    assert_one_line_error(code, out, err, "/proc/x", r"cannot write")


# ==== 3 and 4. the cache: never stale, never wrong =========================================================

def _double_durations(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(f'UPDATE {KERNEL} SET "end" = "end" + ("end" - start)')
    conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["in-place", "renamed-over"])
def test_an_export_edited_with_size_and_mtime_kept_is_read_again(how, tmp_path, kv):
    export = tmp_path / "fp8.sqlite"
    shutil.copy2(FP8, export)
    first = json_of(kv, "summary", export)
    other = tmp_path / "other.sqlite"
    shutil.copy2(FP8, other)
    _double_durations(other)
    status = export.stat()
    assert other.stat().st_size == status.st_size  # precondition: the edit keeps the size
    if how == "in-place":  # `cp -p`
        with open(export, "r+b") as handle:
            handle.write(other.read_bytes())
    else:  # `rsync -t`: a new file renamed over the old one
        os.replace(other, export)
    os.utime(export, ns=(status.st_atime_ns, status.st_mtime_ns))

    again = json_of(kv, "summary", export)
    fresh = json_of(kv, "summary", export, "--no-cache")
    assert again == fresh
    assert again["segments"] != first["segments"]


def test_a_report_renamed_over_with_its_mtime_kept_is_exported_again(tmp_path, cache_dir, nsys, kv):
    """The .nsys-rep export cache keys on the same identity as the trace cache: a new file under the old name
    (`rsync -t`) is another export, even with the same size and mtime."""
    report = tmp_path / "fp8.nsys-rep"
    shutil.copy2(NSYS2023_REPORTS / "fp8.nsys-rep", report)
    first = json_of(kv, "kernels", report, env={"NSYS": nsys})
    replacement = tmp_path / "replacement.nsys-rep"
    shutil.copy2(report, replacement)
    status = report.stat()
    os.replace(replacement, report)
    os.utime(report, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert (report.stat().st_size, report.stat().st_mtime_ns) == (status.st_size, status.st_mtime_ns)

    again = json_of(kv, "kernels", report, env={"NSYS": nsys})
    assert again["arm"]["info"]["sqlite"] != first["arm"]["info"]["sqlite"]
    assert (cache_dir / "exports" / again["arm"]["info"]["sqlite"]).is_file()  # reports name files, no paths
    assert again["rows"] == first["rows"]


def _entry(cache: Path, stem: str) -> Path:
    [entry] = [p for p in (cache / "traces").iterdir() if p.name.startswith(stem + "-")]
    return entry


def _flip(path: Path, at: int, length: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + length] = bytes(b ^ 0xFF for b in data[at:at + length])
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cells.arrow", "signatures.arrow", "ranges.arrow", "duration.npy", "rank.npy",
                                  "range.npy", "start.npy"])
def test_flipped_bytes_in_a_cache_entry_are_detected_and_the_entry_repaired(name, tmp_path, cache_dir, kv):
    export = tmp_path / "fp8.sqlite"
    shutil.copy2(FP8, export)
    fresh = json_of(kv, "summary", export)
    entry = _entry(cache_dir, "fp8")
    sound = (entry / name).read_bytes()
    _flip(entry / name, len(sound) // 2)

    assert json_of(kv, "summary", export) == fresh
    assert (_entry(cache_dir, "fp8") / name).read_bytes() == sound  # rewritten, not re-read forever


def test_a_structurally_bad_entry_is_replaced(tmp_path, cache_dir, kv):
    export = tmp_path / "fp8.sqlite"
    shutil.copy2(SMALL, export)
    fresh = json_of(kv, "summary", export)
    entry = _entry(cache_dir, "fp8")
    sound = (entry / "duration.npy").read_bytes()
    (entry / "duration.npy").write_bytes(b"not npy")
    assert json_of(kv, "summary", export) == fresh
    assert (_entry(cache_dir, "fp8") / "duration.npy").read_bytes() == sound


@pytest.mark.slow
@pytest.mark.parametrize("how", ["symlink", "copy"])
def test_an_entry_planted_for_another_export_is_not_served(how, tmp_path, cache_dir, kv):
    fp8, nvfp4 = tmp_path / "fp8.sqlite", tmp_path / "nvfp4.sqlite"
    shutil.copy2(FP8, fp8)
    shutil.copy2(NVFP4, nvfp4)
    fresh = json_of(kv, "summary", fp8)
    json_of(kv, "summary", nvfp4)
    mine, theirs = _entry(cache_dir, "fp8"), _entry(cache_dir, "nvfp4")
    shutil.rmtree(mine)
    if how == "symlink":
        mine.symlink_to(theirs)
    else:
        shutil.copytree(theirs, mine)
    assert json_of(kv, "summary", fp8) == fresh
    assert (theirs / "cells.arrow").exists()  # the link was removed, not what it pointed to


def test_a_cache_folder_others_can_write_to_is_not_used(tmp_path, cache_dir, kv):
    (cache_dir / "traces").mkdir(mode=0o700)
    (cache_dir / "traces").chmod(0o777)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    # A child process: the interpreter reads TMPDIR once (tempfile.gettempdir), so this one would not see it.
    code, out, err = kv("summary", SMALL, "--format", "json", env={"TMPDIR": str(temporary)}, child=True)
    assert code == 0, err
    assert list((cache_dir / "traces").iterdir()) == []
    assert err.startswith("kvtrace: warning: cache folder") and len(err.splitlines()) == 1
    assert list((temporary / f"kvtrace-{os.getuid()}" / "traces").iterdir())  # the private fallback instead


# ==== 5 and 6. damaged values: one line, exit 2 ==============================================================

FIRST_KERNEL = f"(SELECT rowid FROM {KERNEL} ORDER BY start LIMIT 1)"
FIRST_NAME = f"(SELECT demangledName FROM {KERNEL} ORDER BY start LIMIT 1)"
DAMAGED = {
    "null-shortName": ([f"UPDATE {KERNEL} SET shortName = NULL WHERE rowid = {FIRST_KERNEL}"], KERNEL,
                       r"NULL values in demangledName or shortName"),
    "null-demangledName": ([f"UPDATE {KERNEL} SET demangledName = NULL WHERE rowid = {FIRST_KERNEL}"], KERNEL,
                           r"NULL values in demangledName or shortName"),
    "null-start": ([f"UPDATE {KERNEL} SET start = NULL WHERE rowid = {FIRST_KERNEL}"], KERNEL, r"NULL values in start"),
    "text-start": ([f"UPDATE {KERNEL} SET start = 'soon' WHERE rowid = {FIRST_KERNEL}"], KERNEL,
                   r"not integer\) values in start"),
    "null-deviceId": ([f"UPDATE {KERNEL} SET deviceId = NULL WHERE rowid = {FIRST_KERNEL}"], KERNEL,
                      r"NULL values in .*deviceId"),
    "zero-duration-trace": ([f'UPDATE {KERNEL} SET "end" = start'], None, r"176 of 176 kernel rows do not end after"),
    "zero-duration-family": ([f'UPDATE {KERNEL} SET "end" = start WHERE demangledName = {FIRST_NAME}'], None,
                             r"kernel rows do not end after they start"),
    "negative-duration": ([f'UPDATE {KERNEL} SET "end" = start - 5 WHERE rowid = {FIRST_KERNEL}'], None,
                          r"1 of 176 kernel rows do not end after"),
    "dangling-name-id": ([f"UPDATE {KERNEL} SET demangledName = 987654 WHERE rowid = {FIRST_KERNEL}"], None,
                         r"string ids that StringIds lacks \(987654\)"),
    "null-nvtx-start": (["UPDATE NVTX_EVENTS SET start = NULL WHERE rowid = 2"], "NVTX_EVENTS",
                        r"NVTX_EVENTS has NULL values in start"),
    "null-launch-correlationId": (["UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET correlationId = NULL WHERE rowid = (SELECT "
                                   "r.rowid FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON s.id = r.nameId "
                                   "WHERE s.value GLOB '*Launch*' LIMIT 1)"], "CUPTI_ACTIVITY_KIND_RUNTIME",
                                  r"NULL values in correlationId"),
}


@pytest.mark.parametrize("command", ["summary", "diff"])
@pytest.mark.parametrize("kind", sorted(DAMAGED))
def test_damaged_values_are_one_line(kind, command, tmp_path, kv):
    statements, table, problem = DAMAGED[kind]
    source = FP8 if "nvtx" in kind or "launch" in kind else SMALL  # the 2023.4 export has no NVTX ranges
    bad = edited(tmp_path, f"{kind}.sqlite", *statements, source=source, unconstrained=table)
    args = ["summary", bad] if command == "summary" else ["diff", bad, NVFP4]
    code, out, err = kv(*args, "--no-cache")
    assert_one_line_error(code, out, err, str(bad), problem, r"export the report again")


def test_a_trace_in_a_folder_that_cannot_be_searched(tmp_path, kv, without_dac):
    folder = tmp_path / "locked"
    folder.mkdir()
    shutil.copy2(SMALL, folder / "fp8.sqlite")
    folder.chmod(0o600)  # readable listing, but no x: nothing inside can be opened
    try:
        code, out, err = kv("summary", folder / "fp8.sqlite", preexec_fn=without_dac)
    finally:
        folder.chmod(0o755)
    assert_one_line_error(code, out, err, str(folder / "fp8.sqlite"), r"permission denied", r"permissions of the folders")


@pytest.mark.parametrize("args,names,problem", [
    (["diff", SMALL, NVFP4, "--seed", "-1"], "--seed", r"-1 is not in the range"),
    (["summary", SMALL, "--nsys", "/usr"], "--nsys /usr", r"is a directory"),
])
def test_bad_options_are_one_line(args, names, problem, kv):
    code, out, err = kv(*args)
    assert_one_line_error(code, out, err, names, problem)


def test_an_nsys_setting_that_names_a_directory_is_refused(tmp_path, monkeypatch):
    """--nsys and $NSYS naming a folder (the usual slip: its bin/) are refused, not run nor skipped for another nsys."""
    monkeypatch.setenv("NSYS", str(tmp_path))
    with pytest.raises(KvtraceError, match=rf"^NSYS={re.escape(str(tmp_path))} is a directory: point NSYS at"):
        kvtrace.nsys.find_nsys()
    with pytest.raises(KvtraceError, match=rf"^--nsys {re.escape(str(tmp_path))} is a directory: point it at"):
        kvtrace.nsys.find_nsys(str(tmp_path))


def test_an_nsys_rep_with_nsys_a_directory_is_one_line(tmp_path, kv):
    report = tmp_path / "fp8.nsys-rep"
    shutil.copy2(NSYS2023_REPORTS / "fp8.nsys-rep", report)
    code, out, err = kv("summary", report, env={"NSYS": "/usr"})
    assert_one_line_error(code, out, err, "NSYS=/usr is a directory", r"\.\.\./bin/nsys", r"pass the \.sqlite")


@pytest.mark.parametrize("edit,where,wanted", [
    (lambda m: m["arms"].update(fp8=None), "arms.fp8", "an object"),
    (lambda m: m["arms"]["fp8"].update(repeat="2"), "arms.fp8.repeat", "a whole number"),
    (lambda m: m.update(request_order_matched="yes"), "request_order_matched", "true or false"),
    (lambda m: m["arms"]["nvfp4"].update(workload="oops"), "arms.nvfp4.workload", "an object"),
    (lambda m: m["arms"]["fp8"]["workload"].update(phases=[1]), r"arms.fp8.workload.phases\[0\]", "an object"),
    (lambda m: m["arms"]["fp8"].update(sqlite=5), "arms.fp8.sqlite", "a string"),
])
@pytest.mark.parametrize("command", ["report", "capacity"])
def test_malformed_manifests_are_one_line(edit, where, wanted, command, tmp_path, kv):
    run = tmp_path / "run"
    shutil.copytree(NSYS2025_DIR, run, ignore=shutil.ignore_patterns("*.nsys-rep"))
    manifest = json.loads((run / "manifest.json").read_text())
    edit(manifest)
    (run / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = kv(command, run)
    assert_one_line_error(code, out, err, str(run / "manifest.json"), rf"{where} is not {wanted}", r"capture the run")


# ==== 7. FIFOs, pipes and devices as input ==================================================================

def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path, kv):
    fifo = tmp_path / "trace.sqlite"
    os.mkfifo(fifo)
    code, out, err = kv("summary", fifo, timeout=120)  # opening it would wait for a writer forever
    assert_one_line_error(code, out, err, str(fifo), r"not a regular file", r"save the stream to a \.sqlite file")


def test_a_device_is_refused(kv):
    code, out, err = kv("summary", "/dev/zero", timeout=120)
    assert_one_line_error(code, out, err, "/dev/zero", r"not a regular file")


def test_a_piped_standard_input_is_refused(tmp_path):
    with open(SMALL, "rb") as data:
        cat = subprocess.Popen(["cat"], stdin=data, stdout=subprocess.PIPE)
        result = subprocess.run([sys.executable, "-m", "kvtrace", "summary", "/dev/stdin"], stdin=cat.stdout,
                                capture_output=True, text=True, timeout=120,
                                env={**os.environ, "KVTRACE_CACHE_DIR": str(tmp_path)})
        cat.stdout.close()
        cat.wait()
    assert_one_line_error(result.returncode, result.stdout, result.stderr, "/dev/stdin", r"not a regular file")


# ==== 8, 9 and 10. hostile names in every output ===========================================================

def test_bracketed_parts_of_real_names_survive_the_terminal_table(kv):
    code, table, err = kv("kernels", FP8)
    assert code == 0, err
    code, csv_text, err = kv("kernels", FP8, "--format", "csv")
    assert table.count("(instance") == csv_text.count("(instance") > 0


HOSTILE = ("void k<int>::[lambda() (instance 3)] [/] [link=https://evil.example]click[/link] \x1b[2J\x1b]0;owned\x07"
           " a\rb\nc `tick` ``two`` |pipe| <img src=x> \u202eevil\x9b")


@pytest.mark.parametrize("fmt", ["table", "markdown", "csv"])
@pytest.mark.parametrize("command", ["kernels", "summary", "diff"])
def test_hostile_names_are_inert_in_every_format(command, fmt, tmp_path, kv):
    trace = named(tmp_path, HOSTILE)
    args = {"kernels": ["kernels", trace], "summary": ["summary", trace],
            "diff": ["diff", trace, trace, "--label", "[/]", "--label", "<b>*"]}[command]
    code, out, err = kv(*args, "--format", fmt)
    assert code == 0, err
    for raw in ("\x1b", "\x07", "\r", "\x9b", "\u202e"):
        assert raw not in out
    if command == "kernels" or fmt != "table":  # the summary and diff tables list families, not names
        assert "\\x1b[2J\\x1b]0;owned\\x07" in out
        assert "[link=https://evil.example]click[/link]" in out or fmt == "table"  # (a table folds the name)
    if fmt == "markdown":
        lines = out.splitlines()
        table_rows = [line for line in lines if "\\x1b[2J" in line and line.startswith("|")]
        for line in table_rows:
            assert line.endswith(" |") and "```" in line  # one row, in a code span fenced longer than `` inside
        listed = [line for line in lines if line.startswith("- ") and "\\x1b[2J" in line]
        assert all(line.count("```") == 2 for line in listed)
        assert "\\<b\\>\\*" in out or command != "diff"


def test_hostile_names_make_no_hyperlinks_or_markup_on_a_terminal(tmp_path):
    trace = load.open_trace(named(tmp_path, HOSTILE), cache=False)
    buffer = StringIO()
    render.render_table(kernels.list_kernels(trace, load_recipes()),
                        Console(file=buffer, force_terminal=True, color_system="truecolor", width=400))
    text = buffer.getvalue()
    assert "\x1b]8;" not in text  # OSC 8: a hyperlink
    assert "[link=https://evil.example]click[/link]" in re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_a_label_with_markup_is_shown_as_text(kv):
    code, out, err = kv("diff", SMALL, NVFP4, "--label", "[/]", "--label", "[bold]x")
    assert code == 0, err
    assert out.startswith("baseline [/] → candidate [bold]x on ")  # the head
    assert "\n[/] → [bold]x: total GPU kernel time" in out


# ==== 11. pathological names ================================================================================

def test_deeply_nested_names_parse_in_linear_memory():
    depth = 20_000  # 60 KB of brackets; the old parser held every level's argument text: about 600 MB
    name = "void k<" + "a<" * depth + "int" + ">" * depth + ">(int)"
    tracemalloc.start()
    try:
        kernel = parse_kernel_name(name)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * len(name)
    assert sum(len(arg.text) for arg in kernel.args) <= 32 * len(name)
    assert kernel.base == "k"


@pytest.mark.slow
def test_a_100_kb_name_goes_through_every_command(tmp_path, kv):
    trace = named(tmp_path, "void k<" + "a<" * 33_000 + "int" + ">" * 33_000 + ">(int)")
    for args in (["summary", trace], ["kernels", trace, "--format", "markdown"], ["diff", trace, trace]):
        code, out, err = kv(*args, timeout=600)
        assert code == 0, err


# ==== 12. catastrophic regexes in a user recipe ================================================================

def test_a_catastrophic_recipe_pattern_is_stopped(tmp_path, kv):
    trace = named(tmp_path, "void " + "a" * 40 + "!(int)")
    recipe = tmp_path / "mine.toml"
    recipe.write_text('[[rule]]\nid = "greedy"\nsegment = "gemm"\nmatch = "(a|a)*$"\n')
    code, out, err = kv("summary", trace, "--recipe", recipe, timeout=300)  # Python's re: 2^40 steps
    assert_one_line_error(code, out, err, "mine.toml:greedy", r"took over 1 s", r"simplify the pattern")


# ==== 13 and 14. capture ==========================================================================================

def test_make_capture_runs_no_shell_code_from_its_variables(tmp_path):
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    stub = tmp_path / "kvtrace-stub"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    model = "x'; touch pwned; echo '\"$(touch pwned2)`touch pwned3`/$HOME"
    result = subprocess.run(["make", "-s", "-f", str(REPO / "capture" / "capture.mk"), "capture", f"KVTRACE={stub}",
                             f"MODEL={model}", "SCENARIO=sweep", "OUT=runs/a b", "DRY_RUN=1"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    argv = json.loads(result.stdout.splitlines()[-1])
    assert argv[argv.index("--model") + 1] == model
    assert argv[argv.index("--out") + 1] == "runs/a b"
    assert "--dry-run" in argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvtrace-stub"]


@pytest.mark.parametrize("force", [False, True])
def test_capture_out_that_is_a_symlink_is_refused(force, tmp_path):
    real = tmp_path / "real-run"
    shutil.copytree(NSYS2025_DIR, real, ignore=shutil.ignore_patterns("*.nsys-rep", "*.sqlite"))
    link = tmp_path / "run"
    link.symlink_to(real)
    before = sorted(p.name for p in real.iterdir())
    with pytest.raises(KvtraceError, match=r"is a symbolic link .*name the run directory itself"):
        runner.prepare_run_dir(link, force=force)
    assert sorted(p.name for p in real.iterdir()) == before and link.is_symlink()


def test_sigterm_while_writing_a_manifest_leaves_no_temporary_file(tmp_path):
    """The signal arrives between writing the temporary file and renaming it: it waits until the rename."""
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from kvtrace.capture import runner\n"
        "rename = os.replace\n"
        "def interrupted(a, b):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    rename(a, b)\n"
        "os.replace = interrupted\n"
        "runner.write_json_atomic(Path(sys.argv[1]), {'kvtrace_manifest': 1})\n"
        "print('survived the signal')\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "manifest.json")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == -signal.SIGTERM and "survived" not in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"kvtrace_manifest": 1}


# ==== CLI conventions (issue 13, item 5) ==========================================================================

@pytest.mark.slow
def test_a_broken_pipe_exits_0(tmp_path):
    for fmt in ("table", "csv"):
        read, write = os.pipe()
        os.close(read)  # `| head` that has already gone
        result = subprocess.run([sys.executable, "-m", "kvtrace", "diff", str(SMALL), str(NVFP4), "--format", fmt],
                                stdout=write, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "KVTRACE_CACHE_DIR": str(tmp_path)})
        os.close(write)
        assert result.returncode == 0 and result.stderr == "", result.stderr


def test_bare_kvtrace_prints_help(kv):
    code, out, err = kv()
    assert code == 0 and err == ""
    assert out.startswith("Usage: kvtrace") and "diff" in out


def test_a_misspelt_command_suggests_the_closest(kv):
    code, out, err = kv("dif", SMALL, NVFP4)
    assert_one_line_error(code, out, err, "'dif'", r"no such command", r"did you mean `kvtrace diff`")
