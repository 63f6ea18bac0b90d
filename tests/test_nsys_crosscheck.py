"""Cross-check: kvtrace's per-kernel totals equal NVIDIA's own `nsys stats` report, to the nanosecond.

For every real fixture export, `kvtrace kernels X --format json` (one row per demangled kernel name, with
calls and total_ns) is compared with `nsys stats -r cuda_gpu_kern_sum -f csv:noconv` from Nsight Systems
2023.4.4 (CI installs it from Debian; locally the test skips without it).

What the report's Name column is, and why it matches kvtrace's rows exactly:
- cuda_gpu_kern_sum without options reads a view built by kernel_helper.create_kernel_view that names each
  kernel `StringIds.value` for `coalesce(kernel.demangledName, kernel.demangledName)`, i.e. the full
  demangled name with template arguments, and GROUPs BY that string. `:base` would group by shortName and
  `:mangled` by mangledName; `:nvtx-name` would prefix the innermost NVTX range. We pass no option, so the
  grouping key is the same demangled string kvtrace groups by.
- The `column`/`table` console formats wrap and shorten long names; the CSV format prints the whole name
  (quoted when it contains commas), so names are compared whole, not truncated.
- `:noconv` keeps times as integer nanoseconds (Total Time is sum(end - start), an integer), so totals
  compare exactly; Avg/Med/StdDev are rounded to 0.1 ns by the report and are not compared here.
- `nsys stats` exits 0 even when it skips a report, so the output is checked, not the exit code.

nsys runs on a copy in tmp_path, so the committed fixture is never opened by it; the original's bytes and
mtime are checked afterwards anyway.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import sqlite3
import subprocess

import pytest

from conftest import NSYS2025_DIR, REAL_SQLITE, fingerprint

HEADER = ["Time (%)", "Total Time (ns)", "Instances", "Avg (ns)", "Med (ns)", "Min (ns)", "Max (ns)",
          "StdDev (ns)", "Name"]


def nsys_kern_sum(nsys: str, sqlite_path) -> dict[str, tuple[int, int]]:
    """Name -> (instances, total ns) from the real `nsys stats` report."""
    result = subprocess.run([nsys, "stats", "-q", "-r", "cuda_gpu_kern_sum", "-f", "csv:noconv", "-o", "-",
                             str(sqlite_path)], capture_output=True, text=True, timeout=600, check=False)
    output = result.stdout
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SKIPPED" not in output + result.stderr, output + result.stderr
    assert "ERROR" not in result.stderr.upper(), result.stderr
    rows = [row for row in csv.reader(io.StringIO(output)) if row]
    assert rows and rows[0] == HEADER, output[:500]
    totals: dict[str, tuple[int, int]] = {}
    for row in rows[1:]:
        assert len(row) == len(HEADER), row
        record = dict(zip(HEADER, row))
        name = record["Name"]
        assert name not in totals, f"nsys stats listed {name!r} twice"
        # Integers, not "1.2 ms" or "1234.0": exact nanoseconds.
        assert record["Total Time (ns)"].isdigit() and record["Instances"].isdigit(), row
        totals[name] = (int(record["Instances"]), int(record["Total Time (ns)"]))
    return totals


def kvtrace_kernel_totals(run_kvtrace, sqlite_path) -> tuple[dict[str, tuple[int, int]], dict]:
    code, out, err = run_kvtrace("kernels", sqlite_path, "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    totals = {}
    for row in data["rows"]:
        assert row["demangled"] not in totals
        totals[row["demangled"]] = (row["calls"], row["total_ns"])
    return totals, data


@pytest.mark.parametrize("fixture_id", sorted(REAL_SQLITE))
def test_kernel_totals_equal_nsys_stats(fixture_id, nsys, tmp_path, run_kvtrace):
    original = REAL_SQLITE[fixture_id]
    before = fingerprint(original)
    copy = tmp_path / "nsys-stats" / original.name
    copy.parent.mkdir()
    shutil.copy2(original, copy)

    expected = nsys_kern_sum(nsys, copy)
    got, data = kvtrace_kernel_totals(run_kvtrace, original)

    assert fingerprint(original) == before
    assert len(expected) > 1
    # Same kernel names, and per name the same instance count and total, to the nanosecond.
    assert sorted(got) == sorted(expected)
    mismatches = {name: (got[name], expected[name]) for name in expected if got[name] != expected[name]}
    assert not mismatches, mismatches
    # And the whole: every launch counted once.
    assert sum(c for c, _ in got.values()) == data["arm"]["info"]["kernel_count"]
    assert sum(t for _, t in got.values()) == sum(t for _, t in expected.values()) == data["arm"]["total_ns"]


def test_nsys_stats_groups_by_full_demangled_name(nsys, tmp_path):
    """Guards the semantics the cross-check relies on: the report's names are exactly the distinct
    StringIds values behind CUPTI_ACTIVITY_KIND_KERNEL.demangledName (not shortName, not truncated)."""
    original = NSYS2025_DIR / "fp8.sqlite"
    copy = tmp_path / original.name
    shutil.copy2(original, copy)
    names = set(nsys_kern_sum(nsys, copy))
    conn = sqlite3.connect(f"{original.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
    try:
        demangled = {v for (v,) in conn.execute("SELECT DISTINCT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                                                 "JOIN StringIds s ON s.id = k.demangledName")}
        short = {v for (v,) in conn.execute("SELECT DISTINCT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                                             "JOIN StringIds s ON s.id = k.shortName")}
    finally:
        conn.close()
    assert names == demangled
    assert names != short  # the fixture has templated kernels, so this test can tell the two apart
    assert max(map(len, names)) > 200  # long template names come through whole
