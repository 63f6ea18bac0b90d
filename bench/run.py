"""Time kvtrace against the SQLite floor and `nsys stats` on grown vLLM traces, side by side.

    python bench/run.py --sizes 1000000 10000000

Per workload and size, two arms (the auto and fp8 arms of a vLLM fixture, grown to about the same kernel
count by make_large_trace.py into bench/out/, reused when present) are measured with the same files for every tool:
wall time and peak RSS of `kvtrace summary` and `kvtrace diff` (first runs, which read the SQLite exports
and fill kvtrace's trace cache in bench/out/cache, and repeat runs, which read the cache), the floor query
and `nsys stats`. Prints a markdown table with the machine description, for docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_large_trace  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
FLOOR = 'SELECT shortName, count(*), sum("end" - start) FROM CUPTI_ACTIVITY_KIND_KERNEL GROUP BY shortName'
# Two real vLLM H200 pairs: cold-prefill arms batched their steps differently (most rows "not comparable"),
# decode-heavy arms ran the same steps (every row paired and bootstrapped).
WORKLOADS = {"cold-prefill": ("vllm", "vllm-fp8"), "decode-heavy": ("vllm-decode", "vllm-decode-fp8")}


def measure(command: list[str], env: dict | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one command, whose output is discarded."""
    gnu_time = Path("/usr/bin/time")
    if gnu_time.exists():
        command = [str(gnu_time), "-v", *command]
    start = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wall = time.perf_counter() - start
    if result.returncode not in (0, 1):  # kvtrace diff exits 1 only for --fail-on, which is not used
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)
    if found:
        return wall, int(found.group(1)) / 1024
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # max over children so far


def floor_command(path: Path) -> list[str]:
    if shutil.which("sqlite3"):
        return ["sqlite3", "-readonly", str(path), FLOOR]
    return [sys.executable, "-c", "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchall()",
            str(path), FLOOR]


def find_nsys() -> str | None:
    if os.environ.get("NSYS"):
        return os.environ["NSYS"]
    installer = Path(__file__).resolve().parents[2] / "shared/ci/install-nsys-cli.sh"
    if installer.exists():
        return subprocess.run(["bash", str(installer)], capture_output=True, text=True).stdout.strip() or None
    return shutil.which("nsys")


def machine() -> list[str]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    memory = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("polars", "adbc-driver-sqlite", "numpy", "rich"))
    sqlite_cli = subprocess.run(["sqlite3", "--version"], capture_output=True, text=True).stdout.split()[:1] \
        if shutil.which("sqlite3") else []
    return [f"CPU: {cpu}, {os.cpu_count()} cores (nproc); memory {memory / 2**20:.1f} GiB",
            f"Python {platform.python_version()} ({platform.system()} {platform.release()}); {versions}; "
            f"SQLite {(sqlite_cli or ['(python) ' + __import__('sqlite3').sqlite_version])[0]}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--no-nsys", action="store_true", help="skip `nsys stats`")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    args = parser.parse_args(argv)
    nsys = None if args.no_nsys else find_nsys()
    kvtrace = [sys.executable, "-m", "kvtrace"]
    print("\n".join(f"- {line}" for line in machine()) + "\n")
    print("| workload | kernels/file | kvtrace run | kvtrace summary | kvtrace diff | floor (both files) "
          "| nsys stats (both files) | diff / floor | nsys stats / diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    cache = OUT / "cache"
    for workload, size in ((w, n) for w in args.workloads for n in args.sizes):
        files = []
        for arm in WORKLOADS[workload]:
            path = OUT / f"{arm}-{size}.sqlite"
            if not path.exists():
                OUT.mkdir(parents=True, exist_ok=True)
                make_large_trace.grow(make_large_trace.FIXTURES[arm], path, size)
            files.append(path)
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL)  # every tool starts from a warm cache
        floors = [measure(floor_command(f)) for f in files]
        floor = (sum(t for t, _ in floors), max(m for _, m in floors))
        stats = None
        if nsys:
            runs = [measure([nsys, "stats", "-r", "cuda_gpu_kern_sum", "-f", "csv:noconv", str(f)]) for f in files]
            stats = (sum(t for t, _ in runs), max(m for _, m in runs))
        # First runs read the SQLite exports and fill kvtrace's trace cache; repeat runs read the cache.
        shutil.rmtree(cache, ignore_errors=True)
        env = {**os.environ, "KVTRACE_CACHE_DIR": str(cache)}
        rows = []
        for run in ("first", "repeat"):
            measured = []
            for command in (["summary", str(files[0])], ["diff", *map(str, files)]):
                if run == "first":
                    shutil.rmtree(cache, ignore_errors=True)
                measured.append(measure([*kvtrace, *command], env))
            rows.append((run, *measured))
        kernels = sum(make_large_trace.kernel_count(f) for f in files) // 2

        def cell(result):
            return "n/a" if result is None else f"{result[0]:.2f} s, {result[1]:.0f} MiB"

        for run, summary, diff in rows:
            print(f"| {workload} | {kernels:,} | {run} | {cell(summary)} | {cell(diff)} | {cell(floor)} | {cell(stats)} "
                  f"| {diff[0] / floor[0]:.2f}× | {'n/a' if stats is None else f'{stats[0] / diff[0]:.2f}×'} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
