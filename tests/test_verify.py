"""`kvtrace diff --verify`: kvtrace's per-kernel totals against `nsys stats` and `nsys recipe` (issue 13 item 6).

With the real Nsight Systems 2023.4.4 the fixtures agree to the nanosecond; a stand-in nsys whose
cuda_gpu_kern_sum reports other totals must be reported as a disagreement, kernel by kernel, not hidden.
The recipe checks replay the real output of `nsys recipe cuda_gpu_kern_sum` 2025.3.1 on these traces
(fixtures/nsys-recipe-2025.3), since the recipe does not run with Debian's 2023.4.4.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import os
import shutil
import stat
import sqlite3
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, NSYS2023_DIR, NSYS2025_DIR, REPEATS2, fingerprint
from kvtrace.analyzer import export_tables, verify

PAIR = [NSYS2025_DIR / "fp8.sqlite", NSYS2025_DIR / "nvfp4.sqlite"]
RECORDED_RECIPE = FIXTURES / "nsys-recipe-2025.3"  # nsys recipe's real output on PAIR's .nsys-rep files


def _sql_totals(path, name_column: str = "demangledName") -> dict[str, tuple[int, int]]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT s.value, count(*), sum(k.end - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                            f"JOIN StringIds s ON s.id = k.{name_column} GROUP BY s.value").fetchall()
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


@pytest.mark.slow
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


def _stand_in(tmp_path, shift_ns: int, drop: bool = False, recipe_outputs=None, meet: int = 0):
    """An nsys whose `stats` prints the real kernels' table with the first kernel's total moved by shift_ns
    (and the last kernel left out when `drop`); with `meet`, only once that many `stats` runs have started
    (it prints nothing if they do not within 20 s, as when they run one after the other). Its `recipe` fails as Debian's does; with `recipe_outputs`
    (a folder of recorded outputs per report stem) it behaves as 2025.3.1 did: exports `<stem>_pqtdir` beside
    its --input, then writes the recorded files into --output. Each recipe call's arguments are logged."""
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
    recipe = "print(\"ERROR: No module named 'psutil'\")\n    sys.exit(1)" if recipe_outputs is None else f"""\
log = open({str(tmp_path / "recipe-calls")!r}, "a")
    log.write(repr(sys.argv[1:]) + "\\n")
    if "--help" in sys.argv:
        print("usage: cuda_gpu_kern_sum [-h] [--output OUTPUT] [--force-overwrite] --input INPUT")
        sys.exit(0)
    given = sys.argv[sys.argv.index("--input") + 1]
    stem = os.path.basename(given).removesuffix(".nsys-rep")
    os.mkdir(os.path.join(os.path.dirname(given), stem + "_pqtdir"))
    shutil.copytree(os.path.join({str(recipe_outputs)!r}, stem), sys.argv[sys.argv.index("--output") + 1])
    print("Generated:")"""
    script.write_text(f"""#!{sys.executable}
import sys, os, shutil
TABLES = {table!r}
MEET, MET = {meet}, {str(tmp_path / "stats-started")!r}
if sys.argv[1] == "stats" and MEET:
    import time
    os.makedirs(MET, exist_ok=True)
    open(os.path.join(MET, os.path.basename(sys.argv[-1])), "w").close()
    deadline = time.monotonic() + 20
    while len(os.listdir(MET)) < MEET and time.monotonic() < deadline:
        time.sleep(0.02)
    if len(os.listdir(MET)) < MEET:
        sys.exit(0)
if sys.argv[1] == "--version":
    print("NVIDIA Nsight Systems version 0.0-stand-in")
elif sys.argv[1] == "recipe":
    {recipe}
else:
    sys.stdout.write(TABLES[os.path.basename(sys.argv[-1])])
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_nsys_runs_side_by_side(tmp_path, run_kvtrace, monkeypatch):
    """Each input's nsys stats is a whole export of its report: the two run at once (the stand-in answers only
    once both have started), as many at once as the process has cores (two here)."""
    monkeypatch.setattr(export_tables, "workers", lambda: 2)
    nsys = _stand_in(tmp_path, shift_ns=0, meet=2)
    code, out, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["verification"]
    assert checked["agrees"] is True, checked
    assert sorted(p.name for p in (tmp_path / "stats-started").iterdir()) == sorted(p.name for p in PAIR)


@pytest.mark.slow
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


# ---- kvtrace report --verify: the same check on every trace the report diffs --------------------------------



def test_report_agrees_with_nsys_stats_on_every_repeat(nsys, run_kvtrace):
    code, out, err = run_kvtrace("report", REPEATS2, "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["diff"]["verification"]
    runs = [REPEATS2 / f"{arm}.r{k}.sqlite" for arm in ("fp8", "nvfp4") for k in (1, 2)]
    assert checked["agrees"] is True and [c["source"] for c in checked["inputs"]] == [p.name for p in runs]
    for c, path in zip(checked["inputs"], runs):
        totals = _sql_totals(path)
        assert (c["kernels"], c["calls"], c["mismatches"]) == (len(totals), sum(n for n, _ in totals.values()), [])


@pytest.mark.slow
def test_report_states_agreement_once_in_every_format(nsys, run_kvtrace):
    line = "nsys stats -r cuda_gpu_kern_sum (Nsight Systems version 2023.4.4"
    code, out, err = run_kvtrace("report", NSYS2025_DIR, "--verify", "--nsys", nsys, "--format", "markdown")
    assert code == 0, err
    head, rest = out.split("<details>", 1)
    assert f"✅ {line}" in head and "to the nanosecond on fp8.sqlite" in head
    assert rest.count(f"✅ {line}") == 1 and f"- ✅ {line}" in rest.split("#### Comparability")[1]  # the finding
    code, out, err = run_kvtrace("report", NSYS2025_DIR, "--verify", "--nsys", nsys)
    assert code == 0, err
    head, rest = out.split("everything else", 1)
    assert head.count(f"ok  {line}") == 1 and rest.count(f"ok  {line}") == 1  # the head's line, the finding
    code, out, err = run_kvtrace("report", NSYS2025_DIR, "--verify", "--nsys", nsys, "--format", "csv")
    assert code == 0, err
    rows = [r for r in csv.DictReader(io.StringIO(out)) if r["section"] == "verify"]
    assert {(r["key"], r["metric"]): r["value"] for r in rows if r["metric"] == "agrees"} == {
        ("", "agrees"): "True", ("fp8.sqlite", "agrees"): "True", ("nvfp4.sqlite", "agrees"): "True"}


@pytest.mark.slow
def test_report_disagreement_is_reported_in_every_format(tmp_path, run_kvtrace):
    nsys = _stand_in(tmp_path, shift_ns=7)
    out_file = tmp_path / "report.md"
    code, _, err = run_kvtrace("report", NSYS2025_DIR, "--verify", "--nsys", nsys, "-o", out_file)
    assert code == 0, err
    head = out_file.read_text().split("<details>")[0]
    assert "❌ nsys stats -r cuda_gpu_kern_sum (Nsight Systems version 0.0-stand-in) disagrees" in head
    assert "disagrees" in err  # -o: the error finding still reaches the terminal
    code, out, err = run_kvtrace("report", NSYS2025_DIR, "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["diff"]["verification"]
    assert checked["agrees"] is False
    for c, path in zip(checked["inputs"], PAIR):
        name, (calls, total) = sorted(_sql_totals(path).items())[0]
        assert c["mismatches"] == [{"kernel": name, "kvtrace_calls": calls, "kvtrace_total_ns": total,
                                    "nsys_calls": calls, "nsys_total_ns": total + 7}]
    code, out, err = run_kvtrace("report", NSYS2025_DIR, "--verify", "--nsys", nsys, "--format", "csv")
    assert code == 0, err
    mismatched = {(r["key"], r["metric"]): r["value"] for r in csv.DictReader(io.StringIO(out))
                  if r["section"] == "verify_mismatch"}
    for path in PAIR:
        name, (_, total) = sorted(_sql_totals(path).items())[0]
        assert mismatched[(f"{path.name}: {name}", "nsys_total_ns")] == str(total + 7)
        assert mismatched[(f"{path.name}: {name}", "kvtrace_total_ns")] == str(total)
    code, out, err = run_kvtrace("report", NSYS2025_DIR, "--verify", "--nsys", nsys)
    assert code == 0, err
    assert "MISMATCH  nsys stats -r cuda_gpu_kern_sum" in out.split("everything else")[0]


# ---- nsys recipe cuda_gpu_kern_sum: the real 2025.3.1 output, per short kernel name ------------------------


def _listing(folder):
    return sorted((p.name, fingerprint(p)) for p in folder.iterdir())


def test_recipe_agrees_per_short_name_and_runs_away_from_the_input(tmp_path, run_kvtrace):
    nsys = _stand_in(tmp_path, shift_ns=0, recipe_outputs=RECORDED_RECIPE)
    before = _listing(NSYS2025_DIR)
    code, out, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["verification"]
    assert checked["agrees"] is True
    assert [c["source"] for c in checked["recipe_inputs"]] == ["fp8.nsys-rep", "nvfp4.nsys-rep"]
    for c, path in zip(checked["recipe_inputs"], PAIR):
        short = _sql_totals(path, "shortName")
        assert (c["kernels"], c["calls"], c["mismatches"], c["agrees"]) == (
            len(short), sum(n for n, _ in short.values()), [], True)
    assert checked["recipe"] == "nsys recipe cuda_gpu_kern_sum ran on fp8.nsys-rep, nvfp4.nsys-rep (per short " \
                                "kernel name)"
    # The stand-in, like the real recipe, exported <stem>_pqtdir beside the report it was given: a copy in a
    # temporary folder that is gone, never the user's folder.
    assert _listing(NSYS2025_DIR) == before
    runs = [ast.literal_eval(line) for line in (tmp_path / "recipe-calls").read_text().splitlines() if "--input" in line]
    given = [Path(args[args.index("--input") + 1]) for args in runs]
    assert sorted(p.name for p in given) == ["fp8.nsys-rep", "nvfp4.nsys-rep"]  # run side by side, in any order
    assert all(p.parent != NSYS2025_DIR and not p.parent.exists() for p in given)
    findings = [f["message"] for f in json.loads(out)["findings"] if f["check"] == "verify" and f["level"] == "ok"]
    assert any(m.startswith("nsys recipe cuda_gpu_kern_sum (Nsight Systems version 0.0-stand-in) agrees with "
                            "kvtrace's per-short-name calls and totals to the nanosecond on fp8.nsys-rep")
               for m in findings)


@pytest.mark.slow
def test_recipe_agreement_stated_in_the_head_of_every_format(tmp_path, run_kvtrace):
    nsys = _stand_in(tmp_path, shift_ns=0, recipe_outputs=RECORDED_RECIPE)
    short = _sql_totals(PAIR[0], "shortName")
    line = (f"nsys recipe cuda_gpu_kern_sum (Nsight Systems version 0.0-stand-in) agrees with kvtrace's "
            f"per-short-name calls and totals to the nanosecond on fp8.nsys-rep ({len(short)} short names, "
            f"{sum(n for n, _ in short.values()):,} calls)")
    code, out, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, "--format", "markdown")
    assert code == 0, err
    assert f"✅ {line}" in out.split("<details>")[0]
    code, out, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, env={"COLUMNS": "400"})
    assert code == 0, err
    assert f"ok  {line}" in out.split("everything else")[0]
    code, out, err = run_kvtrace("report", NSYS2025_DIR, "--verify", "--nsys", nsys, "--format", "csv")
    assert code == 0, err
    rows = {(r["section"], r["key"], r["metric"]): r["value"] for r in csv.DictReader(io.StringIO(out))}
    assert rows[("verify_recipe", "", "agrees")] == "True" and rows[("verify", "", "agrees")] == "True"
    assert rows[("verify_recipe", "", "summary")].startswith(line)


def _altered_recipe_outputs(tmp_path):
    """The recorded outputs with fp8's first Sum raised by 5 ns and nvfp4's first Count by 1."""
    folder = tmp_path / "recorded"
    shutil.copytree(RECORDED_RECIPE, folder)
    altered = {}
    for stem, column, by in (("fp8", "Sum", 5), ("nvfp4", "Count", 1)):
        path = folder / stem / "all_stats.csv"
        rows = list(csv.DictReader(io.StringIO(path.read_text())))
        rows[0][column] = str(int(rows[0][column]) + by)
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        altered[f"{stem}.nsys-rep"] = (rows[0]["Name"], int(rows[0]["Count"]), int(rows[0]["Sum"]))
    return folder, altered


@pytest.mark.slow
def test_recipe_disagreement_is_reported_in_every_format(tmp_path, run_kvtrace):
    outputs, altered = _altered_recipe_outputs(tmp_path)
    nsys = _stand_in(tmp_path, shift_ns=0, recipe_outputs=outputs)
    code, out, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["verification"]
    assert checked["agrees"] is False and all(c["agrees"] for c in checked["inputs"])  # nsys stats agrees
    for c, path in zip(checked["recipe_inputs"], PAIR):
        name, calls, total = altered[c["source"]]
        ours = _sql_totals(path, "shortName")[name]
        assert ours != (calls, total)
        assert c["mismatches"] == [{"kernel": name, "kvtrace_calls": ours[0], "kvtrace_total_ns": ours[1],
                                    "nsys_calls": calls, "nsys_total_ns": total}]
    errors = [f["message"] for f in json.loads(out)["findings"] if f["level"] == "error"]
    assert errors == ["nsys recipe cuda_gpu_kern_sum (Nsight Systems version 0.0-stand-in) disagrees with kvtrace: "
                      "fp8.nsys-rep: 1 of 6 short names differ; nvfp4.nsys-rep: 1 of 5 short names differ"]
    name, calls, total = altered["fp8.nsys-rep"]
    mismatch = f"fp8.nsys-rep: {name}: kvtrace {calls:,} calls, {total - 5:,} ns, nsys recipe {calls:,} calls, " \
               f"{total:,} ns"
    report = tmp_path / "diff.md"
    code, _, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, "-o", report)
    assert code == 0, err
    head = report.read_text().split("<details>")[0]
    assert "❌ nsys recipe cuda_gpu_kern_sum (Nsight Systems version 0.0-stand-in) disagrees" in head
    assert f"  - {mismatch}" in head and "✅ nsys stats -r cuda_gpu_kern_sum" in head
    assert "nsys recipe cuda_gpu_kern_sum (Nsight Systems version 0.0-stand-in) disagrees" in err
    code, out, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, env={"COLUMNS": "400"})
    assert code == 0, err
    head = out.split("everything else")[0]
    assert "MISMATCH  nsys recipe cuda_gpu_kern_sum" in head and f"    {mismatch}" in head
    code, out, err = run_kvtrace("report", NSYS2025_DIR, "--verify", "--nsys", nsys, "--format", "csv")
    assert code == 0, err
    rows = {(r["section"], r["key"], r["metric"]): r["value"] for r in csv.DictReader(io.StringIO(out))}
    assert rows[("verify", "", "agrees")] == "False" and rows[("verify_recipe", "", "agrees")] == "False"
    assert rows[("verify_recipe_mismatch", f"fp8.nsys-rep: {name}", "nsys_total_ns")] == str(total)
    assert rows[("verify_recipe_mismatch", f"fp8.nsys-rep: {name}", "kvtrace_total_ns")] == str(total - 5)


def test_sqlite_without_its_report_gets_one_line_and_the_other_input_the_recipe(tmp_path, run_kvtrace):
    nsys = _stand_in(tmp_path, shift_ns=0, recipe_outputs=RECORDED_RECIPE)
    alone = tmp_path / "alone" / "fp8.sqlite"
    alone.parent.mkdir()
    shutil.copyfile(PAIR[0], alone)
    code, out, err = run_kvtrace("diff", alone, PAIR[1], "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["verification"]
    assert checked["agrees"] is True and [c["source"] for c in checked["recipe_inputs"]] == ["nvfp4.nsys-rep"]
    assert checked["recipe"] == (
        "nsys recipe cuda_gpu_kern_sum ran on nvfp4.nsys-rep (per short kernel name); needs the .nsys-rep and was "
        "not run for fp8.sqlite (no .nsys-rep of the same name beside it); checked with nsys stats")
    assert sorted(p.name for p in alone.parent.iterdir()) == ["fp8.sqlite"]


def test_recipe_that_fails_on_a_report_leaves_the_check_to_nsys_stats(tmp_path, run_kvtrace):
    """As 2023.4.4 fails on a report that 2025.3 recorded: one line, and nsys stats still checks it."""
    empty = tmp_path / "no-outputs"
    empty.mkdir()
    nsys = _stand_in(tmp_path, shift_ns=0, recipe_outputs=empty)
    code, out, err = run_kvtrace("diff", *PAIR, "--verify", "--nsys", nsys, "--format", "json")
    assert code == 0, err
    checked = json.loads(out)["verification"]
    assert checked["agrees"] is True and checked["recipe_inputs"] == []
    assert checked["recipe"].startswith("nsys recipe cuda_gpu_kern_sum failed on fp8.nsys-rep (exit 1, no "
                                        "all_stats.csv: ")
    assert "; nvfp4.nsys-rep (exit 1" in checked["recipe"] and checked["recipe"].endswith("; checked with nsys stats")
    assert "\n" not in checked["recipe"]
