"""`kvtrace diff --verify`: kvtrace's per-kernel totals against `nsys stats` (issue 13 item 6).

With the real Nsight Systems 2023.4.4 the fixtures agree to the nanosecond; a stand-in nsys whose
cuda_gpu_kern_sum reports other totals must be reported as a disagreement, kernel by kernel, not hidden.
"""

from __future__ import annotations

import csv
import io
import json
import os
import stat
import sqlite3

from conftest import NSYS2023_DIR, NSYS2025_DIR, fingerprint
from kvtrace.analyzer import verify

PAIR = [NSYS2025_DIR / "fp8.sqlite", NSYS2025_DIR / "nvfp4.sqlite"]


def _sql_totals(path) -> dict[str, tuple[int, int]]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT s.value, count(*), sum(k.end - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                            "JOIN StringIds s ON s.id = k.demangledName GROUP BY s.value").fetchall()
    return {name: (calls, total) for name, calls, total in rows}


def test_fixtures_agree_with_nsys_stats(nsys, run_kvtrace):
    before = [fingerprint(p) for p in PAIR]
    code, out, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["verification"]
    assert checked["agrees"] is True
    assert [c["source"] for c in checked["inputs"]] == ["fp8.sqlite", "nvfp4.sqlite"]
    for c, path in zip(checked["inputs"], PAIR):
        totals = _sql_totals(path)
        assert (c["kernels"], c["calls"]) == (len(totals), sum(n for n, _ in totals.values()))
        assert c["mismatches"] == [] and c["problem"] is None
    # Debian's 2023.4.4 cannot run its recipes (Python packages missing): one line, then nsys stats.
    assert "nsys stats" in checked["recipe"] and "\n" not in checked["recipe"]
    assert [fingerprint(p) for p in PAIR] == before  # nsys read copies


def test_agreement_stated_in_markdown_and_terminal(nsys, run_kvtrace):
    inputs = [NSYS2023_DIR / "fp8.sqlite", NSYS2023_DIR / "nvfp4.sqlite"]
    code, out, err = run_kvtrace("diff", *inputs, "--verify", "--nsys", nsys, "--format", "markdown")
    assert code == 0, err
    head = out.split("<details>")[0]
    assert "✅ nsys stats -r cuda_gpu_kern_sum (Nsight Systems version 2023.4.4" in head
    assert "to the nanosecond" in head
    code, out, err = run_kvtrace("diff", *inputs, "--verify", "--nsys", nsys)
    assert code == 0, err
    assert "ok  nsys stats -r cuda_gpu_kern_sum" in out.split("everything else")[0]


def _stand_in(tmp_path, shift_ns: int, drop: bool = False):
    """An nsys whose `stats` prints the real kernels' table with the first kernel's total moved by shift_ns
    (and the last kernel left out when `drop`); its `recipe` fails as Debian's does."""
    script = tmp_path / "nsys"
    table = {}
    for path in PAIR:
        rows = sorted(_sql_totals(path).items())
        first = rows[0][0]
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(verify.HEADER)
        for name, (calls, total) in rows[:-1] if drop else rows:
            writer.writerow([0, total + (shift_ns if name == first else 0), calls, 0, 0, 0, 0, 0, name])
        table[path.name] = buffer.getvalue()
    script.write_text(f"""#!/usr/bin/env python3
import sys, os
TABLES = {table!r}
if sys.argv[1] == "--version":
    print("NVIDIA Nsight Systems version 0.0-stand-in")
elif sys.argv[1] == "recipe":
    print("ERROR: No module named 'psutil'")
    sys.exit(1)
else:
    sys.stdout.write(TABLES[os.path.basename(sys.argv[-1])])
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_other_totals_are_reported_kernel_by_kernel(tmp_path, run_kvtrace):
    nsys = _stand_in(tmp_path, shift_ns=7)
    code, out, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["verification"]
    assert checked["agrees"] is False
    for c, path in zip(checked["inputs"], PAIR):
        name, (calls, total) = sorted(_sql_totals(path).items())[0]
        assert c["mismatches"] == [{"kernel": name, "kvtrace_calls": calls, "kvtrace_total_ns": total,
                                    "nsys_calls": calls, "nsys_total_ns": total + 7}]
    assert "does not run with this nsys (ERROR: No module named 'psutil')" in checked["recipe"]
    errors = [f for f in json.loads(out)["findings"] if f["check"] == "verify" and f["level"] == "error"]
    assert len(errors) == 1 and "disagrees" in errors[0]["message"]


def test_disagreement_in_markdown_and_on_stderr_with_output(tmp_path, run_kvtrace):
    nsys = _stand_in(tmp_path, shift_ns=-3, drop=True)
    report = tmp_path / "diff.md"
    code, _, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, "-o", report)
    assert code == 0, err
    head = report.read_text().split("<details>")[0]
    assert "❌ nsys stats -r cuda_gpu_kern_sum (Nsight Systems version 0.0-stand-in) disagrees" in head
    assert "nsys stats absent" in head  # the dropped kernel
    assert "disagrees" in err


def test_nsys_that_prints_no_table_is_not_a_pass(tmp_path, run_kvtrace):
    script = tmp_path / "nsys"
    script.write_text("#!/bin/sh\necho 'SKIPPED: fp8.sqlite does not contain CUDA kernel data.'\n")
    script.chmod(0o755)
    code, out, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", script, "--format", "json",
                                 env={"PATH": os.environ["PATH"]})
    assert code == 0, err
    checked = json.loads(out)["verification"]
    assert checked["agrees"] is False
    assert all(c["problem"] and "SKIPPED" in c["problem"] for c in checked["inputs"])
