"""--verify: kvtrace's per-kernel totals checked against NVIDIA's own `nsys stats` report, to the nanosecond.

`nsys stats -r cuda_gpu_kern_sum -f csv:noconv` groups kernels by their full demangled name (the report's
kernel view names each kernel by its demangledName string; no `:base`/`:mangled` option is passed) and
prints Total Time as integer nanoseconds (`:noconv`), in CSV, which keeps long names whole. kvtrace's
kernel list (compare.list_kernels) groups by the same string, so instances and totals must be equal.
`nsys stats` exits 0 even when it skips a report, so its output is checked rather than its exit code.
nsys reads a copy of each export: it may add tables to the file it is given, and a user's trace is never
modified.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvtrace.analyzer.classify import RecipeSet
from kvtrace.analyzer.compare import list_kernels
from kvtrace.analyzer.load import Trace
from kvtrace.nsys import nsys_version

REPORT = "cuda_gpu_kern_sum"
HEADER = ["Time (%)", "Total Time (ns)", "Instances", "Avg (ns)", "Med (ns)", "Min (ns)", "Max (ns)", "StdDev (ns)",
          "Name"]
TIMEOUT_S = 600
# Mismatching kernels listed in the head of a report; JSON has them all.
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
class Verification:
    tool: str  # the nsys version line
    recipe: str  # what became of `nsys recipe`
    inputs: list[Checked]
    agrees: bool

    def summary(self) -> str:
        if self.agrees:
            names = ", ".join(f"{c.source} ({c.kernels:,} kernels, {c.calls:,} calls)" for c in self.inputs)
            return (f"nsys stats -r {REPORT} ({self.tool}) agrees with kvtrace's per-kernel calls and totals to "
                    f"the nanosecond on {names}")
        parts = []
        for c in self.inputs:
            if c.problem:
                parts.append(f"{c.source}: not checked ({c.problem})")
            elif c.mismatches:
                parts.append(f"{c.source}: {len(c.mismatches)} of {c.kernels:,} kernels differ")
        return f"nsys stats -r {REPORT} ({self.tool}) disagrees with kvtrace: " + "; ".join(parts)


def mismatch_lines(verification: Verification) -> list[str]:
    """One line per kernel whose calls or total differ, input by input."""
    def side(calls: int | None, total: int | None) -> str:
        return "absent" if calls is None else f"{calls:,} calls, {total:,} ns"

    return [f"{c.source}: {m.kernel}: kvtrace {side(m.kvtrace_calls, m.kvtrace_total_ns)}, nsys stats "
            f"{side(m.nsys_calls, m.nsys_total_ns)}" for c in verification.inputs for m in c.mismatches]


def verify(traces: list[Trace], recipes: RecipeSet, nsys: str) -> Verification:
    inputs = [_check(trace, recipes, nsys) for trace in traces]
    return Verification(tool=nsys_version(nsys).removeprefix("NVIDIA ") or Path(nsys).name, recipe=_recipe(nsys),
                        inputs=inputs, agrees=all(c.agrees for c in inputs))


def _recipe(nsys: str) -> str:
    """Whether `nsys recipe` runs here; Debian's 2023.4.4 lacks the Python packages its recipes import."""
    try:
        probe = subprocess.run([nsys, "recipe", REPORT, "--help"], capture_output=True, text=True,
                               timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nsys recipe {REPORT} did not run ({error}); checked with nsys stats"
    output = probe.stdout + probe.stderr
    error = next((line.strip() for line in output.splitlines() if line.strip().startswith("ERROR")), None)
    if probe.returncode or error:
        return f"nsys recipe {REPORT} does not run with this nsys ({error or f'exit {probe.returncode}'}); " \
               "checked with nsys stats"
    return f"nsys recipe {REPORT} runs here; its output needs pandas to read, so the check uses nsys stats"


def _check(trace: Trace, recipes: RecipeSet, nsys: str) -> Checked:
    source = Path(trace.info.source).name
    ours = {row["demangled"]: (row["calls"], row["total_ns"]) for row in list_kernels(trace, recipes).rows}
    calls = sum(c for c, _ in ours.values())
    theirs, problem = _nsys_totals(nsys, Path(trace.info.sqlite))
    if problem:
        return Checked(source, len(ours), calls, problem=problem)
    mismatches = [Mismatch(name, *ours.get(name, (None, None)), *theirs.get(name, (None, None)))
                  for name in sorted(set(ours) | set(theirs)) if ours.get(name) != theirs.get(name)]
    return Checked(source, len(ours), calls, mismatches, agrees=not mismatches)


def _nsys_totals(nsys: str, sqlite: Path) -> tuple[dict[str, tuple[int, int]], str | None]:
    """Name -> (instances, total ns) from `nsys stats`, or a problem that kept it from answering."""
    with tempfile.TemporaryDirectory(prefix="kvtrace-verify-") as folder:
        copy = Path(folder) / sqlite.name
        shutil.copyfile(sqlite, copy)
        try:
            result = subprocess.run([nsys, "stats", "-q", "-r", REPORT, "-f", "csv:noconv", "-o", "-", str(copy)],
                                    capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            return {}, f"nsys stats did not run: {error}"
    rows = [row for row in csv.reader(io.StringIO(result.stdout)) if row]
    if result.returncode or not rows or rows[0] != HEADER:
        said = next((line for line in (result.stderr + result.stdout).splitlines() if line.strip()), "no output")
        return {}, f"nsys stats printed no {REPORT} table (exit {result.returncode}: {said[:200]})"
    totals: dict[str, tuple[int, int]] = {}
    for row in rows[1:]:
        record = dict(zip(HEADER, row))
        if len(row) != len(HEADER) or not record["Total Time (ns)"].isdigit() or not record["Instances"].isdigit():
            return {}, f"nsys stats printed a row kvtrace cannot read: {','.join(row)[:200]}"
        name = record["Name"]
        calls, total = totals.get(name, (0, 0))
        totals[name] = (calls + int(record["Instances"]), total + int(record["Total Time (ns)"]))
    return totals, None
