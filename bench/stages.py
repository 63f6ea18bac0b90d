"""Where a first `kvtrace diff` spends its time: each stage alone, on the grown traces.

    python bench/stages.py [--kernels 10000000] [--workload decode-heavy]

Times, per file and one after the other: the floor query; the kvtrace-job floor (bench/floor.c), whole and
per table; the two SQLite reads kvtrace makes (the kernel columns it needs and the launch calls) over one
connection, with the rows thrown away; a whole load without the cache on one core and on every core (taskset,
in a child process, start-up excluded); a load that writes the trace cache; a load from it; and, for the pair,
the comparison itself. Prints a markdown table for docs/performance.md, with the load average. Run
bench/run.py first (it builds the files) or let this build them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_large_trace  # noqa: E402
from run import FLOOR, OUT, WORKLOADS, job_floor, warm  # noqa: E402

from kvtrace.analyzer import compare, load, sqlite_tables  # noqa: E402
from kvtrace.analyzer.classify import load_recipes  # noqa: E402

# Run in a child: the load's own seconds, without Python's start-up.
LOAD = ("import sys, time; from kvtrace.analyzer import load; t = time.perf_counter(); "
        "load.open_trace(sys.argv[1], cache=sys.argv[2] == 'cache'); print(time.perf_counter() - t)")


def timed(work) -> tuple[float, object]:
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def child_load(path: Path, cores: int | None, cache: bool) -> float:
    command = [sys.executable, "-c", LOAD, str(path), "cache" if cache else "no-cache"]
    if cores is not None:
        command = ["taskset", "-c", f"0-{cores - 1}", *command]
    return float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=10_000_000)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cold-prefill")
    args = parser.parse_args(argv)
    files = []
    for arm in WORKLOADS[args.workload]:
        path = OUT / f"{arm}-{args.kernels}.sqlite"
        if not path.exists():
            OUT.mkdir(parents=True, exist_ok=True)
            make_large_trace.grow(make_large_trace.fixture(arm), path, args.kernels)
        files.append(path)
    warm(files)
    cache = tempfile.mkdtemp(prefix="kvtrace-stages-", dir=OUT)
    os.environ["KVTRACE_CACHE_DIR"] = cache
    cores = len(os.sched_getaffinity(0))
    rows: dict[str, list[float]] = {}
    loads: list[float] = []

    def record(stage: str, seconds: float) -> None:
        rows.setdefault(stage, []).append(seconds)
        loads.append(os.getloadavg()[0])

    startup = subprocess.run([sys.executable, "-c", "import time, sys; t = time.perf_counter(); "
                              "import kvtrace.analyzer.compare, kvtrace.analyzer.render.terminal; "
                              "print(time.perf_counter() - t)"], capture_output=True, text=True, check=True)
    traces = []
    floor_binary = job_floor()
    for path in files:
        with closing(sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)) as conn:
            record("floor query (sqlite3, GROUP BY shortName)", timed(lambda: conn.execute(FLOOR).fetchall())[0])
        seconds, job = timed(lambda: subprocess.run([str(floor_binary), str(path)], capture_output=True, text=True,
                                                    check=True).stdout)
        record("kvtrace-job floor (bench/floor.c, one C pass)", seconds)
        for table, part in zip(("kernel columns", "launch calls", "NVTX ranges"), re.findall(r"in ([0-9.]+) s", job)):
            record(f"kvtrace-job floor: {table}", float(part))
        queries = sqlite_tables.stage_queries(path)
        record("ADBC read, one connection: kernel columns kvtrace needs",
               timed(lambda: sqlite_tables.drain(path, queries["kernels"]))[0])
        record("ADBC read, one connection: launch calls (runtime rows named *Launch*)",
               timed(lambda: sqlite_tables.drain(path, queries["launches"]))[0])
        record("whole load, no cache, 1 core", child_load(path, 1, cache=False))
        record(f"whole load, no cache, {cores} cores", child_load(path, None, cache=False))
        record(f"whole load writing the trace cache, {cores} cores", child_load(path, None, cache=True))
        seconds, trace = timed(lambda: load.open_trace(path))
        record("load from the trace cache (checksums included)", seconds)
        traces.append(trace)
    recipes = load_recipes()
    seconds, _ = timed(lambda: compare.diff(*traces, recipes))
    shutil.rmtree(cache, ignore_errors=True)

    kernels = sum(t.info.kernel_count for t in traces) // len(traces)
    print(f"{kernels:,} kernels per file ({args.workload}); seconds; 1-minute load average "
          f"{min(loads):.1f} to {max(loads):.1f}\n")
    print("| stage | per file | both files |")
    print("|---|---|---|")
    for stage, values in rows.items():
        print(f"| {stage} | {' / '.join(f'{v:.2f}' for v in values)} | {sum(values):.2f} |")
    print(f"| diff computation (both arms, cached traces) | | {seconds:.2f} |")
    print(f"| Python start and imports | | {float(startup.stdout):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
