"""From .nsys-rep reports to kvtrace's answer: each nsys export path, its read, and a whole diff, side by side.

    python bench/export.py A.nsys-rep B.nsys-rep [--nsys PATH] [--repeat 3]

Per report and for the pair, with the same nsys: `nsys export --type=sqlite` of every table (kvtrace before
issue 24); the same of only the tables kvtrace reads (`--tables`, kvtrace's export where nsys gives no exact
Parquet, such as 2023.4.4), with and without `--lazy=false`; `--type=arrowdir` and `--type=parquetdir` of those
tables (Parquet is kvtrace's export where nsys gives an exact one); `nsys stats -r cuda_gpu_kern_sum` on the
.nsys-rep; the read of each result, timed inside its process (kvtrace's load without the cache of an SQLite
file or a Parquet folder; for Arrow, which kvtrace does not read, and for Parquet beside kvtrace's load, a
polars read of the columns kvtrace reads, labelled so), and Python's start with kvtrace's imports; and a whole
first `kvtrace diff A B` (empty cache: kvtrace's own export, Parquet or SQLite as this nsys allows) and a
repeat. The pair's exports run both at once, as kvtrace runs them
where there are cores for both. Each command runs on a fresh copy of the report in its own folder (nsys stats
writes an export beside its input); the best of `--repeat` runs is kept. Every path's per-kernel totals are
checked against the full SQLite export's, to the nanosecond, and whether it holds META_DATA_CAPTURE (2023.4.4's
Arrow and Parquet output does not). Prints markdown for docs/performance.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import OUT, Measured, find_nsys, machine, measure, warm  # noqa: E402
from stages import LOAD  # noqa: E402

import kvtrace.nsys  # noqa: E402
from kvtrace.analyzer.load import EXPORT_TABLES  # noqa: E402

# key -> (label, export type, only the tables kvtrace reads, further options, output name for report stem S)
EXPORTS = {
    "sqlite-all": ("sqlite, every table (before issue 24)", "sqlite", False, [], "{}.sqlite"),
    "sqlite-tables": ("sqlite, --tables (kvtrace: a large report, or no exact Parquet)", "sqlite", True, [],
                      "{}.sqlite"),
    "sqlite-tables-eager": ("sqlite, --tables --lazy=false", "sqlite", True, ["--lazy=false"], "{}.sqlite"),
    "arrowdir": ("arrowdir, --tables", "arrowdir", True, [], "{}_arwdir"),
    "parquetdir": (f"parquetdir, --tables (kvtrace: under {kvtrace.nsys.PARQUET_MAX_REPORT_BYTES >> 20} MiB, "
                   "where exact)", "parquetdir", True, [], "{}_pqtdir"),
}
FULL = "sqlite-all"  # always run: the exactness check and the kernel counts read it
# What kvtrace reads of each table (analyzer/parquet_tables.py), for the polars read of Arrow and Parquet exports.
COLUMNS = {
    "CUPTI_ACTIVITY_KIND_KERNEL": ["start", "end", "deviceId", "correlationId", "globalPid", "demangledName",
                                   "shortName", "gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ"],
    "CUPTI_ACTIVITY_KIND_RUNTIME": ["correlationId", "globalTid", "start", "nameId"],
    "NVTX_EVENTS": ["start", "end", "eventType", "text", "textId", "globalTid", "endGlobalTid", "domainId"],
    "StringIds": ["id", "value"],
}
POLARS_READ = """
import sys, time, polars as pl
folder, suffix = sys.argv[1], sys.argv[2]
start = time.perf_counter()
for table, columns in {columns!r}.items():
    path = f"{{folder}}/{{table}}.{{suffix}}"
    try:
        frame = pl.read_parquet(path, columns=columns) if suffix == "parquet" else \\
            pl.read_ipc_stream(path, columns=columns)
    except FileNotFoundError:
        continue
    if table == "CUPTI_ACTIVITY_KIND_KERNEL":
        frame.group_by("demangledName").agg(pl.len(), (pl.col("end") - pl.col("start")).sum())
print(time.perf_counter() - start)
""".format(columns=COLUMNS)
TOTALS_SQL = ('SELECT s.value, count(*), sum(k."end" - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k '
              "JOIN StringIds s ON s.id = k.demangledName GROUP BY s.value")


def export_command(nsys: str, report: Path, kind: str, narrow: bool, extra: list[str], output: Path) -> list[str]:
    """The command kvtrace runs (kvtrace.nsys.export_command), in another type or with further options."""
    command = kvtrace.nsys.export_command(nsys, report, output, EXPORT_TABLES if narrow else ())
    return [*command[:2], f"--type={kind}", *extra, *command[3:]]


def fresh(report: Path, work: Path, label: str) -> Path:
    """A copy of the report alone in a new folder under `work`."""
    folder = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=work))
    copy = folder / report.name
    shutil.copy2(report, copy)
    return copy


def together(commands: list[list[str]]) -> tuple[Measured, list[Measured]]:
    """Commands started at once: wall time until the last ends, CPU time of all and the largest peak RSS; and
    each command's own wall time, CPU time and peak RSS within that run, in the order given."""
    load, start = os.getloadavg()[0], time.perf_counter()
    children = {subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=OUT).pid: i
                for i, c in enumerate(commands)}
    each: dict[int, Measured] = {}
    while children:
        pid, status, usage = os.wait4(-1, 0)
        index = children.pop(pid, None)
        if index is None:
            continue
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(commands[index])} failed ({os.waitstatus_to_exitcode(status)})")
        each[index] = Measured(time.perf_counter() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
                               load)
    alone = [each[i] for i in range(len(commands))]
    return Measured(max(m.wall for m in alone), sum(m.cpu for m in alone), max(m.rss for m in alone), load), alone


def inner(command: list[str]) -> Measured:
    """A child that prints its own seconds of work (Python's start and imports excluded) as its last line."""
    load = os.getloadavg()[0]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=OUT)
    printed = child.stdout.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed ({os.waitstatus_to_exitcode(status)})")
    return Measured(float(printed.split()[-1]), usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, load)


def best(runs: list[Measured]) -> Measured:
    return min(runs, key=lambda m: m.wall)


@functools.cache
def sql_totals(path: Path) -> dict[str, tuple[int, int]]:
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return {name: (calls, total) for name, calls, total in conn.execute(TOTALS_SQL)}


def sql_tables(path: Path) -> set[str]:
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def polars_totals(folder: Path, suffix: str) -> dict[str, tuple[int, int]]:
    import polars as pl

    def read(table: str) -> pl.DataFrame:
        path = folder / f"{table}.{suffix}"
        return pl.read_parquet(path) if suffix == "parquet" else pl.read_ipc_stream(path)

    kernels = read("CUPTI_ACTIVITY_KIND_KERNEL").select(pl.col("demangledName").cast(pl.Int64),
                                                        (pl.col("end") - pl.col("start")).alias("d"))
    names = read("StringIds").select(pl.col("id").cast(pl.Int64).alias("demangledName"), "value")
    grouped = kernels.join(names, on="demangledName").group_by("value").agg(pl.len(), pl.col("d").sum())
    return {row["value"]: (row["len"], row["d"]) for row in grouped.to_dicts()}


def totals(output: Path, suffix: str) -> dict[str, tuple[int, int]]:
    return sql_totals(output) if suffix == "sqlite" else polars_totals(output, suffix)


def holds_capture(output: Path, suffix: str) -> bool:
    return "META_DATA_CAPTURE" in sql_tables(output) if suffix == "sqlite" else \
        (output / f"META_DATA_CAPTURE.{suffix}").exists()


def size_mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs=2, metavar="REPORT.nsys-rep")
    parser.add_argument("--nsys", help="nsys to run (default: $NSYS, shared/ci/install-nsys-cli.sh, PATH)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command; the fastest is kept")
    parser.add_argument("--exports", nargs="+", choices=sorted(EXPORTS), default=sorted(EXPORTS),
                        help=f"export paths to time ({FULL} always runs), to split a large pair over several calls")
    parser.add_argument("--no-diff", action="store_true", help="skip nsys stats and the whole kvtrace diff")
    parser.add_argument("--pair-only", action="store_true",
                        help="export the pair at once only, not each report alone (halves a 10M pair's time)")
    args = parser.parse_args(argv)
    nsys = args.nsys or find_nsys()
    if not nsys:
        raise SystemExit("nsys not found: pass --nsys or set NSYS")
    reports = [r.resolve() for r in args.reports]
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="export-bench-", dir=OUT))
    python = [sys.executable, "-m", "kvtrace"]
    try:
        warm(reports)
        rows: list[tuple[str, list[Measured], Measured | None, str]] = []

        def timed(label: str, per_report, at_once: bool, note=lambda outputs: "", run=measure):
            """per_report(report, copy) -> (command, output); each report alone, then the pair (with --pair-only,
            the pair alone: each report's cell is its own time within the pair's run). Only the last output of
            each report is kept (for the reads), so that a 10M-kernel pair fits the disk."""
            singles, outputs = [], []
            for report in [] if at_once and args.pair_only else reports:
                runs, kept = [], None
                for _ in range(args.repeat):
                    if kept is not None:
                        shutil.rmtree(kept)
                    copy = fresh(report, work, "one")
                    command, output = per_report(report, copy)
                    runs.append(run(command))
                    kept = copy.parent
                    if output is None:  # nothing to read later (nsys stats leaves a full export beside its input)
                        shutil.rmtree(kept)
                        kept = None
                singles.append(best(runs))
                outputs.append(output)
            pair = None
            if at_once:
                runs, kept = [], []
                for _ in range(args.repeat):
                    for folder in kept:
                        shutil.rmtree(folder)
                    copies = [fresh(r, work, "pair") for r in reports]
                    commands, pair_outputs = zip(*(per_report(r, c) for r, c in zip(reports, copies)))
                    runs.append(together(list(commands)))
                    kept = [c.parent for c in copies]
                    if not args.pair_only:
                        for folder in kept:
                            shutil.rmtree(folder)
                        kept = []
                pair, each = min(runs, key=lambda measured: measured[0].wall)
                if args.pair_only:  # the last run's outputs are read; the fastest run's times are reported
                    singles, outputs = each, list(pair_outputs)
            rows.append((label, singles, pair, note(outputs)))
            print(f"  {label}: {', '.join(m.cell() for m in singles)}", file=sys.stderr, flush=True)
            return outputs

        exported = {}
        for label, kind, narrow, extra, name in (EXPORTS[k] for k in EXPORTS if k in {*args.exports, FULL}):
            def per_report(report, copy, kind=kind, narrow=narrow, extra=extra, name=name):
                output = copy.parent / name.format(report.stem)
                return export_command(nsys, copy, kind, narrow, extra, output), output
            exported[label] = timed(f"export: {label}", per_report, True,
                                    lambda outs: ", ".join(f"{size_mib(o):.1f} MiB" for o in outs))
        if not args.no_diff:
            timed("nsys stats -r cuda_gpu_kern_sum (on the .nsys-rep)",
                  lambda report, copy: ([nsys, "stats", "-q", "-r", "cuda_gpu_kern_sum", "-f", "csv:noconv", "-o",
                                         "-", str(copy)], None), False)
        # Per path: totals equal to the full export's, META_DATA_CAPTURE exported. Checked once every command is
        # timed: a child's peak RSS starts at this process's RSS when it forks, which polars' reads would raise.
        checks = {}
        full = exported[EXPORTS[FULL][0]]
        for label, outputs in exported.items():
            if outputs[0].suffix == ".sqlite":
                timed(f"read: kvtrace's load, no cache ({label})",
                      lambda report, copy, outputs=outputs: ([sys.executable, "-c", LOAD,
                                                              str(outputs[reports.index(report)]), "no-cache"], None),
                      False, run=inner)
                checks[label] = outputs, "sqlite"
            else:
                suffix = "parquet" if label.startswith("parquet") else "arrow"
                if suffix == "parquet":
                    timed(f"read: kvtrace's load, no cache ({label})",
                          lambda report, copy, outputs=outputs: ([sys.executable, "-c", LOAD,
                                                                  str(outputs[reports.index(report)]), "no-cache"],
                                                                 None), False, run=inner)
                timed(f"read: polars, the columns kvtrace reads ({label}"
                      f"{'' if suffix == 'parquet' else '; kvtrace does not read it'})",
                      lambda report, copy, outputs=outputs, suffix=suffix: (
                          [sys.executable, "-c", POLARS_READ, str(outputs[reports.index(report)]), suffix], None),
                      False, run=inner)
                checks[label] = outputs, suffix
        timed("Python start and kvtrace's imports", lambda report, copy: (
            [sys.executable, "-c", "import kvtrace.analyzer.cli, kvtrace.analyzer.load"], None), False)
        diffs = {}
        for run in () if args.no_diff else ("first", "repeat"):
            measured = []
            for _ in range(args.repeat):
                folder = Path(tempfile.mkdtemp(prefix="diff-", dir=work))
                copies = [folder / r.name for r in reports]
                if copies[0] == copies[1]:
                    raise SystemExit("the two reports have the same file name: rename one")
                for report, copy in zip(reports, copies):
                    shutil.copy2(report, copy)
                cache = folder / "cache"
                env = {**os.environ, "KVTRACE_CACHE_DIR": str(cache), "NSYS": nsys}
                if run == "repeat":
                    measure([*python, "diff", "-q", *map(str, copies)], env)
                measured.append(measure([*python, "diff", "-q", *map(str, copies)], env))
            diffs[run] = best(measured)
        exact = {label: all(totals(o, suffix) == sql_totals(f) for o, f in zip(outputs, full))
                 for label, (outputs, suffix) in checks.items()}
        capture = {label: all(holds_capture(o, suffix) for o in outputs) for label, (outputs, suffix) in checks.items()}
        kernels = [sum(c for c, _ in sql_totals(f).values()) for f in full]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_tables(reports, nsys, kernels, rows, diffs, exact, capture, args.repeat, kvtrace_export(nsys, reports),
                 args.pair_only)
    return 0


def kvtrace_export(nsys: str, reports: list[Path]) -> str:
    """Which EXPORTS path kvtrace's own export of these .nsys-rep takes with this nsys (analyzer.cache.export_report):
    Parquet unless this version is known to lack a table there or a report is at least PARQUET_MAX_REPORT_BYTES (one
    that fails the output check falls back too)."""
    large = any(r.stat().st_size >= kvtrace.nsys.PARQUET_MAX_REPORT_BYTES for r in reports)
    return "sqlite-tables" if large or kvtrace.nsys.parquet_known_inexact(kvtrace.nsys.nsys_version(nsys)) \
        else "parquetdir"


def print_tables(reports, nsys, kernels, rows, diffs, exact, capture, repeat, path, pair_only) -> None:
    print("\n".join(f"- {line}" for line in machine()))
    print(f"- {kvtrace.nsys.nsys_version(nsys)}; reports: "
          + ", ".join(f"{r.name} ({k:,} kernels, {r.stat().st_size / 2**20:.1f} MiB)" for r, k in zip(reports, kernels))
          + f"; best of {repeat} runs")
    loads = [m.load for _, singles, pair, _ in rows for m in (*singles, *([pair] if pair else []))]
    loads += [m.load for m in diffs.values()]
    print(f"- 1-minute load average at the start of the kept runs: {min(loads):.1f} to {max(loads):.1f}\n")
    if pair_only:
        print("Exports ran with the pair at once only (--pair-only): each report's cell of an export row is its "
              "own time within that run, and the pair one after the other was not run.\n")
    names = [r.name for r in reports]
    print(f"| step | {names[0]} | {names[1]} | pair, one after the other | pair, both at once | output |")
    print("|---|---|---|---|---|---|")
    for label, singles, pair, note in rows:
        after = "n/a" if pair_only and pair is not None else (singles[0] + singles[1]).cell()
        print(f"| {label} | {singles[0].cell()} | {singles[1].cell()} | {after} "
              f"| {'n/a' if pair is None else pair.cell()} | {note} |")
    for run, measured in diffs.items():
        print(f"| whole `kvtrace diff {names[0]} {names[1]}`, {run} run"
              f"{f' (empty cache; export: {EXPORTS[path][0]})' * (run == 'first')} | | | {measured.cell()} | | |")
    print("\nPer-kernel calls and totals equal to the full SQLite export's, to the nanosecond: "
          + "; ".join(f"{label}: {'yes' if same else 'NO'}" for label, same in exact.items()))
    print("\nMETA_DATA_CAPTURE (the CUDA graph trace mode kvtrace checks) in the output: "
          + "; ".join(f"{label}: {'yes' if held else 'no'}" for label, held in capture.items()))
    by_label = {label: (singles, pair) for label, singles, pair, _ in rows}
    try:
        stats = by_label["nsys stats -r cuda_gpu_kern_sum (on the .nsys-rep)"][0]
        narrow_pair = by_label[f"export: {EXPORTS[path][0]}"][1]
        read = by_label[f"read: kvtrace's load, no cache ({EXPORTS[path][0]})"][0]
        start = by_label["Python start and kvtrace's imports"][0][0]
        first = diffs["first"].wall
    except KeyError:
        return  # a partial run (--exports, --no-diff): no summary line
    floor = narrow_pair.wall + read[0].wall + read[1].wall + start.wall
    print(f"\nFirst diff: {first:.2f} s; nsys stats on both reports / first diff: "
          f"{(stats[0].wall + stats[1].wall) / first:.2f}×; first diff / (kvtrace's export ({path}) of both at once, "
          f"{narrow_pair.wall:.2f} s, + kvtrace's load of both, {read[0].wall + read[1].wall:.2f} s, + one Python "
          f"start, {start.wall:.2f} s): {first / floor:.2f}×")

if __name__ == "__main__":
    sys.exit(main())
