"""--verify: kvtrace's per-kernel totals checked against NVIDIA's own tools, to the nanosecond.

`nsys stats -r cuda_gpu_kern_sum -f csv:noconv` groups kernels by their full demangled name (the report's
kernel view names each kernel by its demangledName string; no `:base`/`:mangled` option is passed) and
prints Total Time as integer nanoseconds (`:noconv`), in CSV, which keeps long names whole. kvtrace's
kernel list (kernels.list_kernels) groups by the same string, so instances and totals must be equal.
`nsys stats` exits 0 even when it skips a report, so its output is checked rather than its exit code.
nsys reads a copy of each export: it may add tables to the file it is given, and a user's trace is never
modified. It reads SQLite or a report, not Parquet: a Parquet export is checked through the report it came from.

`nsys recipe cuda_gpu_kern_sum --csv`, where the installed nsys runs it, is a second check: it reads only
an .nsys-rep and writes `all_stats.csv` (Name: the short kernel name, Count, Sum in ns; the columns of
Nsight Systems 2025.3.1, recorded in fixtures/nsys-recipe-2025.3), compared with kvtrace's totals per
short name. It exports `<report>_pqtdir` beside the report it is given, so it is given a copy inside a
temporary folder. Debian's 2023.4.4 cannot run its recipes (Python packages missing); then, or where the
recipe fails on a report, one line says so and nsys stats remains the check.
"""

from __future__ import annotations

import csv
import io
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from kvtrace.analyzer import export_tables
from kvtrace.analyzer.classify import RecipeSet
from kvtrace.analyzer.results import Diff, Finding
from kvtrace.analyzer.kernels import list_kernels
from kvtrace.analyzer.load import Trace
from kvtrace.nsys import TimedOut, last_line, nsys_version, run_step

REPORT = "cuda_gpu_kern_sum"
STATS = f"nsys stats -r {REPORT}"
RECIPE = f"nsys recipe {REPORT}"
HEADER = ["Time (%)", "Total Time (ns)", "Instances", "Avg (ns)", "Med (ns)", "Min (ns)", "Max (ns)", "StdDev (ns)",
          "Name"]
RECIPE_HEADER = ["Name", "Count", "Mean", "Std (approx)", "Min", "Q1 (approx)", "Median (approx)", "Q3 (approx)",
                 "Max", "Sum"]
TIMEOUT_S = 600
# Mismatching kernels listed in the head of a report, per check; JSON has them all.
MISMATCHES_SHOWN = 20


@dataclass(frozen=True)
class Mismatch:
    kernel: str
    kvtrace_calls: int | None  # None: the kernel is missing on that side
    kvtrace_total_ns: int | None
    nsys_calls: int | None
    nsys_total_ns: int | None


@dataclass(frozen=True)
class Checked:
    """One input: how many kernels both sides listed, and where they differ (empty: equal to the ns)."""

    source: str  # the file's name
    kernels: int
    calls: int
    mismatches: list[Mismatch] = field(default_factory=list)
    problem: str | None = None  # nsys stats could not be read: the check did not happen
    agrees: bool = False  # no problem and no mismatch


@dataclass(frozen=True)
class Outcome:
    """One tool's check as every format states it: a summary line, then one line per differing kernel."""

    agrees: bool
    summary: str
    mismatches: list[str]


@dataclass(frozen=True)
class Verification:
    tool: str  # the nsys version line
    recipe: str  # what became of `nsys recipe`: where it ran, and why not elsewhere
    inputs: list[Checked]  # nsys stats, per full kernel name, one per trace
    agrees: bool  # nsys stats on every input, and the recipe on every report it read
    recipe_inputs: list[Checked] = field(default_factory=list)  # nsys recipe, per short name, per report read

    def outcomes(self) -> list[Outcome]:
        """nsys stats, then nsys recipe where it read a report."""
        checks = [(STATS, "nsys stats", "per-kernel", "kernels", self.inputs)]
        if self.recipe_inputs:
            checks.append((RECIPE, "nsys recipe", "per-short-name", "short names", self.recipe_inputs))
        return [_outcome(self.tool, *check) for check in checks]


def _outcome(tool: str, command: str, said_by: str, grouping: str, unit: str, inputs: list[Checked]) -> Outcome:
    def side(calls: int | None, total: int | None) -> str:
        return "absent" if calls is None else f"{calls:,} calls, {total:,} ns"

    mismatches = [f"{c.source}: {m.kernel}: kvtrace {side(m.kvtrace_calls, m.kvtrace_total_ns)}, {said_by} "
                  f"{side(m.nsys_calls, m.nsys_total_ns)}" for c in inputs for m in c.mismatches]
    if all(c.agrees for c in inputs):
        names = ", ".join(f"{c.source} ({c.kernels:,} {unit}, {c.calls:,} calls)" for c in inputs)
        return Outcome(True, f"{command} ({tool}) agrees with kvtrace's {grouping} calls and totals to the "
                             f"nanosecond on {names}", mismatches)
    parts = []
    for c in inputs:
        if c.problem:
            parts.append(f"{c.source}: not checked ({c.problem})")
        elif c.mismatches:
            parts.append(f"{c.source}: {len(c.mismatches)} of {c.kernels:,} {unit} differ")
    return Outcome(False, f"{command} ({tool}) disagrees with kvtrace: " + "; ".join(parts), mismatches)


def attach(diff: Diff, traces: list[Trace], recipes: RecipeSet, nsys: str) -> None:
    """Check every trace `diff` compared (each run of both arms) and record the result on it: its
    `verification` for the head and the JSON, and findings that reach every format (and standard error)."""
    diff.verification = verify(traces, recipes, nsys)
    diff.findings += [Finding("ok" if outcome.agrees else "error", "verify", outcome.summary)
                      for outcome in diff.verification.outcomes()]
    diff.findings.append(Finding("ok", "verify", diff.verification.recipe))


def verify(traces: list[Trace], recipes: RecipeSet, nsys: str) -> Verification:
    # Each nsys run is a whole export of its report (about 100 s at 10M kernels, docs/performance.md): all of
    # them side by side, as many at once as this process has cores, as the exports themselves run.
    broken = _recipe_broken(nsys)
    reports = [None if broken else _report_of(Path(trace.info.source)) for trace in traces]
    runs = len(traces) + sum(report is not None for report in reports)
    with ThreadPoolExecutor(max_workers=max(1, min(runs, export_tables.workers()))) as pool:
        checks = [pool.submit(_check, trace, recipes, nsys) for trace in traces]
        recipe_runs = [None if report is None else pool.submit(_recipe_totals, nsys, report) for report in reports]
        inputs = [check.result() for check in checks]
        recipe_totals = [None if run is None else run.result() for run in recipe_runs]
    recipe, recipe_inputs = _recipe_checks(traces, broken, reports, recipe_totals)
    return Verification(tool=nsys_version(nsys).removeprefix("NVIDIA ") or Path(nsys).name, recipe=recipe,
                        inputs=inputs, agrees=all(c.agrees for c in inputs + recipe_inputs),
                        recipe_inputs=recipe_inputs)


def _compare(source: str, ours: dict[str, tuple[int, int]], theirs: dict[str, tuple[int, int]]) -> Checked:
    mismatches = [Mismatch(name, *ours.get(name, (None, None)), *theirs.get(name, (None, None)))
                  for name in sorted(set(ours) | set(theirs)) if ours.get(name) != theirs.get(name)]
    return Checked(source, len(ours), sum(c for c, _ in ours.values()), mismatches, agrees=not mismatches)


def _check(trace: Trace, recipes: RecipeSet, nsys: str) -> Checked:
    source = Path(trace.info.source).name
    ours = {row["demangled"]: (row["calls"], row["total_ns"]) for row in list_kernels(trace, recipes).rows}
    export = Path(trace.info.sqlite)
    # nsys stats reads SQLite or a report, not Parquet: a Parquet export is checked through its report.
    stats_input = _report_of(Path(trace.info.source)) if export.is_dir() else export
    if stats_input is None:
        return Checked(source, len(ours), sum(c for c, _ in ours.values()),
                       problem=f"{STATS} reads an .sqlite or .nsys-rep, and no .nsys-rep of the same name is beside "
                               "this Parquet export")
    theirs, problem = _nsys_totals(nsys, stats_input)
    if problem:
        return Checked(source, len(ours), sum(c for c, _ in ours.values()), problem=problem)
    return _compare(source, ours, theirs)


def _nsys_totals(nsys: str, export: Path) -> tuple[dict[str, tuple[int, int]], str | None]:
    """Name -> (instances, total ns) from `nsys stats` on an SQLite export or a report (which it exports to
    SQLite beside the copy), or a problem that kept it from answering."""
    with tempfile.TemporaryDirectory(prefix="kvtrace-verify-") as folder:
        copy = Path(folder) / export.name
        shutil.copyfile(export, copy)
        try:
            result = run_step([nsys, "stats", "-q", "-r", REPORT, "-f", "csv:noconv", "-o", "-", str(copy)],
                              f"nsys stats on {export.name}", TIMEOUT_S)
        except (OSError, TimedOut) as error:
            return {}, f"nsys stats did not run: {error}"
    rows = [row for row in csv.reader(io.StringIO(result.stdout)) if row]
    if result.returncode or not rows or rows[0] != HEADER:
        said = next((line for line in (result.stderr + result.stdout).splitlines() if line.strip()), "no output")
        return {}, f"nsys stats printed no {REPORT} table (exit {result.returncode}: {said[:200]})"
    return _totals(rows, HEADER, "Name", "Instances", "Total Time (ns)", "nsys stats")


def _totals(rows: list[list[str]], header: list[str], name: str, count: str, total: str,
            tool: str) -> tuple[dict[str, tuple[int, int]], str | None]:
    """Name -> (calls, total ns), summed over rows of one name, from a table whose first row is `header`."""
    totals: dict[str, tuple[int, int]] = {}
    for row in rows[1:]:
        record = dict(zip(header, row))
        if len(row) != len(header) or not record[total].isdigit() or not record[count].isdigit():
            return {}, f"{tool} printed a row kvtrace cannot read: {','.join(row)[:200]}"
        calls, sum_ns = totals.get(record[name], (0, 0))
        totals[record[name]] = (calls + int(record[count]), sum_ns + int(record[total]))
    return totals, None


def _recipe_checks(traces: list[Trace], broken: str | None, reports: list[Path | None],
                   recipe_totals: list[tuple[dict[str, tuple[int, int]], str | None] | None]
                   ) -> tuple[str, list[Checked]]:
    """What became of `nsys recipe` in one line, and its check of each input's .nsys-rep that it read (`reports`
    and the recipe's totals on each, None where an input has no report beside it)."""
    if broken:
        return f"{RECIPE} {broken}; checked with nsys stats", []
    checked, no_report, failed = [], [], []
    for trace, report, totals in zip(traces, reports, recipe_totals):
        if report is None:
            no_report.append(Path(trace.info.source).name)
            continue
        theirs, problem = totals
        if problem:
            failed.append(f"{report.name} ({problem})")
        else:
            checked.append(_compare(report.name, _short_totals(trace), theirs))
    notes = [f"ran on {', '.join(c.source for c in checked)} (per short kernel name)"] if checked else []
    if no_report:
        notes.append(f"needs the .nsys-rep and was not run for {', '.join(no_report)} (no .nsys-rep of the same "
                     "name beside it)")
    if failed:
        notes.append(f"failed on {'; '.join(failed)}")
    return f"{RECIPE} " + "; ".join(notes) + ("; checked with nsys stats" if no_report or failed else ""), checked


def _recipe_broken(nsys: str) -> str | None:
    """Why `nsys recipe` does not run here, or None; Debian's 2023.4.4 lacks the Python packages its recipes
    import."""
    try:
        probe = run_step([nsys, "recipe", REPORT, "--help"], "nsys recipe --help", TIMEOUT_S)
    except (OSError, TimedOut) as error:
        return f"did not run ({error})"
    output = probe.stdout + probe.stderr
    error = next((line.strip() for line in output.splitlines() if line.strip().startswith("ERROR")), None)
    if probe.returncode or error:
        return f"does not run with this nsys ({error or f'exit {probe.returncode}'})"
    return None


def _report_of(source: Path) -> Path | None:
    """The .nsys-rep the recipe reads (it refuses an .sqlite): the input, or the report of the same name
    beside an .sqlite or a Parquet folder (`X/`, or `X_pqtdir/` as 2025.3's recipe names it)."""
    if source.suffix == ".nsys-rep":
        return source
    beside = source.with_name(source.name.removesuffix("_pqtdir")).with_suffix(".nsys-rep") if source.is_dir() \
        else source.with_suffix(".nsys-rep")
    return beside if beside.is_file() else None


def _recipe_totals(nsys: str, report: Path) -> tuple[dict[str, tuple[int, int]], str | None]:
    """Short name -> (count, sum ns) from the recipe's all_stats.csv, or why it gave none."""
    with tempfile.TemporaryDirectory(prefix="kvtrace-recipe-") as folder:
        copy, output = Path(folder) / report.name, Path(folder) / "recipe"
        shutil.copyfile(report, copy)
        try:
            result = run_step([nsys, "recipe", REPORT, "--input", str(copy), "--output", str(output), "--csv"],
                              f"nsys recipe on {report.name}", TIMEOUT_S, cwd=folder)
        except (OSError, TimedOut) as error:
            return {}, f"did not run: {error}"
        stats = output / "all_stats.csv"
        if result.returncode or not stats.is_file():
            said = last_line(result.stdout + result.stderr)
            return {}, f"exit {result.returncode}, no all_stats.csv: {said[:200]}"
        rows = [row for row in csv.reader(io.StringIO(stats.read_text(errors="replace"))) if row]
    if not rows or rows[0] != RECIPE_HEADER:
        return {}, f"all_stats.csv has columns kvtrace does not know: {','.join(rows[0] if rows else [])[:200]}"
    return _totals(rows, RECIPE_HEADER, "Name", "Count", "Sum", "nsys recipe")


def _short_totals(trace: Trace) -> dict[str, tuple[int, int]]:
    """kvtrace's calls and total ns per short kernel name, as the recipe groups them: the per-cell totals the
    layout holds (as list_kernels sums them per full name), never the calls one by one."""
    per_short = (trace.calls.cells.join(trace.signatures.select("sig", "short"), on="sig")
                 .group_by("short").agg(pl.col("calls").sum(), pl.col("total_ns").sum()))
    return {row["short"]: (row["calls"], row["total_ns"]) for row in per_short.to_dicts()}
