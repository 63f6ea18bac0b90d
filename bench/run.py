"""Time kvtrace against two floors and `nsys stats` on grown vLLM traces, side by side.

    python bench/run.py --sizes 10000000 30000000 100000000

Per workload and size, two arms (the auto and fp8 arms of a vLLM fixture, grown to about the same kernel
count by make_large_trace.py into bench/out/, reused when present) are measured with the same files for every
tool: wall time, CPU time and peak RSS of `kvtrace summary` and `kvtrace diff` (first runs, which read the
SQLite exports and fill kvtrace's trace cache in bench/out/cache, and repeat runs, which read the cache); the
first diff again on 1, 2, … cores (taskset); the floor query (`sqlite3` GROUP BY); the kvtrace-job floor
(bench/floor.c: one C pass over exactly the values kvtrace reads); and `nsys stats`. With --baseline, the
first diff of another kvtrace version on the same cores beside. A pair is skipped, and says so, when the disk
cannot hold it. Prints markdown tables with the machine description, for
docs/performance.md, and the 1-minute load average beside each measurement.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_large_trace  # noqa: E402

BENCH = Path(__file__).resolve().parent
OUT = BENCH / "out"
FLOOR = 'SELECT shortName, count(*), sum("end" - start) FROM CUPTI_ACTIVITY_KIND_KERNEL GROUP BY shortName'
JOB_FLOOR_SOURCE = BENCH / "floor.c"
JOB_FLOOR = OUT / "kvtrace-floor"
# Two real vLLM H200 pairs: cold-prefill arms batched their steps differently (most rows "not comparable"),
# decode-heavy arms ran the same steps (every row paired and bootstrapped).
WORKLOADS = {"cold-prefill": ("vllm", "vllm-fp8"), "decode-heavy": ("vllm-decode", "vllm-decode-fp8")}
SPARE_DISK = 4 << 30  # left free for everyone else on the machine
# kvtrace's trace cache, which first runs write beside the grown files (20 bytes per kernel), and as much again
# while a first run lays a large trace out.
CACHE_BYTES_PER_KERNEL = 40


@dataclass(frozen=True)
class Measured:
    wall: float  # seconds
    cpu: float  # user + system seconds
    rss: float  # peak resident set, MiB
    load: float  # the 1-minute load average when it started

    def cell(self) -> str:
        return f"{self.wall:.2f} s, {self.rss:.0f} MiB"

    def __add__(self, other: Measured) -> Measured:
        """Two commands one after the other."""
        return Measured(self.wall + other.wall, self.cpu + other.cpu, max(self.rss, other.rss),
                        max(self.load, other.load))


def measure(command: list[str], env: dict | None = None, cores: int | None = None) -> Measured:
    """Wall and CPU seconds and peak RSS of one command, whose output is discarded; on the first `cores`
    CPUs (taskset) when given."""
    load = os.getloadavg()[0]
    if cores is not None:
        command = ["taskset", "-c", f"0-{cores - 1}", *command]
    start = time.perf_counter()
    # Run from bench/out: from the checkout, `python -m kvtrace` would find the checkout's kvtrace/ first.
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=OUT)
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own usage, peak RSS included
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode not in (0, 1):  # kvtrace diff exits 1 only for --fail-on, which is not used
        raise SystemExit(f"{' '.join(command)} failed ({child.returncode}):\n{stderr.decode()[-2000:]}")
    return Measured(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, load)


def warm(files: list[Path]) -> None:
    """Read the files once, so that every tool starts from the page cache, as far as it holds them."""
    buffer = bytearray(16 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def floor_command(path: Path) -> list[str]:
    if shutil.which("sqlite3"):
        return ["sqlite3", "-readonly", str(path), FLOOR]
    return [sys.executable, "-c", "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchall()",
            str(path), FLOOR]


def job_floor() -> Path:
    """bench/floor.c, compiled when missing or older than its source."""
    if JOB_FLOOR.exists() and JOB_FLOOR.stat().st_mtime >= JOB_FLOOR_SOURCE.stat().st_mtime:
        return JOB_FLOOR
    OUT.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "cc")
    built = subprocess.run([compiler, "-O2", "-o", str(JOB_FLOOR), str(JOB_FLOOR_SOURCE), "-lsqlite3"],
                           capture_output=True, text=True)
    if built.returncode != 0:
        last = (built.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"cannot build {JOB_FLOOR_SOURCE.name} ({last}): it needs a C compiler and the SQLite "
                         "headers and library (Debian/Ubuntu: apt-get install gcc libsqlite3-dev)")
    return JOB_FLOOR


def find_nsys() -> str | None:
    if os.environ.get("NSYS"):
        return os.environ["NSYS"]
    installer = BENCH.parents[1] / "shared/ci/install-nsys-cli.sh"
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
    return [f"CPU: {cpu}, {os.cpu_count()} cores (nproc); memory {memory / 2**20:.1f} GiB; "
            f"{shutil.disk_usage(OUT).free / 2**30:.0f} GiB free on the disk of bench/out",
            f"Python {platform.python_version()} ({platform.system()} {platform.release()}); {versions}; "
            f"SQLite {(sqlite_cli or ['(python) ' + __import__('sqlite3').sqlite_version])[0]} "
            f"(sqlite3 and the kvtrace-job floor)"]


def grown_pair(workload: str, size: int) -> tuple[list[Path], str | None]:
    """The pair's grown files, built when missing; or the reason they cannot be built."""
    files = [OUT / f"{arm}-{size}.sqlite" for arm in WORKLOADS[workload]]
    missing = [(arm, f) for arm, f in zip(WORKLOADS[workload], files) if not f.exists()]
    needed = sum(make_large_trace.estimate_bytes(make_large_trace.fixture(arm), size) for arm, _ in missing) \
        + len(files) * size * CACHE_BYTES_PER_KERNEL
    free = shutil.disk_usage(OUT).free
    if needed + SPARE_DISK > free:
        return files, (f"not run: the pair needs about {needed / 1e9:.0f} GB of disk, {free / 1e9:.0f} GB are "
                       f"free and {SPARE_DISK / 2**30:.0f} GiB stay spare")
    for arm, path in missing:
        print(f"building {path.name} …", file=sys.stderr, flush=True)
        make_large_trace.grow(make_large_trace.fixture(arm), path, size)
    return files, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 30_000_000])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    parser.add_argument("--cores", type=int, nargs="+",
                        help="also time the first diff on this many cores (default: 1, 2 and all of them)")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="another kvtrace to time beside on the first diff, installed into DIR with `pip install "
                             "--no-deps --target DIR CHECKOUT`")
    parser.add_argument("--baseline-up-to", type=int, default=30_000_000, metavar="KERNELS",
                        help="time the baseline up to this size only (kvtrace before issue 16 held 45 bytes per kernel)")
    parser.add_argument("--no-nsys", action="store_true", help="skip `nsys stats`")
    parser.add_argument("--nsys-up-to", type=int, default=30_000_000, metavar="KERNELS",
                        help="run `nsys stats` up to this size only (it holds about 190 bytes per kernel)")
    parser.add_argument("--keep-up-to", type=int, default=30_000_000, metavar="KERNELS",
                        help="remove grown files larger than this once measured (default: 30M kernels)")
    args = parser.parse_args(argv)
    available = len(os.sched_getaffinity(0))
    cores = sorted({c for c in (args.cores or [1, 2, available]) if c <= available})
    if not shutil.which("taskset"):
        cores = []
    nsys = None if args.no_nsys else find_nsys()
    floor_binary = job_floor()
    kvtrace = [sys.executable, "-m", "kvtrace"]
    OUT.mkdir(parents=True, exist_ok=True)
    cache = OUT / "cache"
    env = {**os.environ, "KVTRACE_CACHE_DIR": str(cache)}
    results, parallel, skipped = [], [], []
    for workload, size in ((w, n) for w in args.workloads for n in args.sizes):
        files, reason = grown_pair(workload, size)
        if reason:
            skipped.append(f"{workload}, {size:,} kernels per file: {reason}")
            print(skipped[-1], file=sys.stderr, flush=True)
            continue
        print(f"measuring {workload} at {size:,} kernels per file …", file=sys.stderr, flush=True)
        warm(files)

        def both(command) -> Measured:
            first, second = (measure(command(f)) for f in files)
            return first + second

        floor = both(floor_command)
        job = both(lambda f: [str(floor_binary), str(f)])
        stats = None
        if nsys and size <= args.nsys_up_to:
            stats = both(lambda f: [nsys, "stats", "-r", "cuda_gpu_kern_sum", "-f", "csv:noconv", str(f)])
        rows = {}
        for run in ("first", "repeat"):  # first runs read the SQLite exports and fill the cache
            measured = []
            for command in (["summary", str(files[0])], ["diff", *map(str, files)]):
                if run == "first":
                    shutil.rmtree(cache, ignore_errors=True)
                measured.append(measure([*kvtrace, *command], env))
            rows[run] = measured
        by_cores, baseline = {}, {}
        for count in cores:
            shutil.rmtree(cache, ignore_errors=True)
            by_cores[count] = measure([*kvtrace, "diff", *map(str, files)], env, cores=count)
            if args.baseline and size <= args.baseline_up_to:
                shutil.rmtree(cache, ignore_errors=True)
                baseline[count] = measure([*kvtrace, "diff", *map(str, files)],
                                          {**env, "PYTHONPATH": str(args.baseline.resolve())}, cores=count)
        kernels = sum(make_large_trace.kernel_count(f) for f in files) // 2
        results.append((workload, kernels, rows, floor, job, stats))
        parallel.append((workload, kernels, by_cores, baseline, job))
        if size > args.keep_up_to:
            for path in files:
                path.unlink()
    shutil.rmtree(cache, ignore_errors=True)
    print_tables(results, parallel, skipped, cores)
    return 0


def print_tables(results, parallel, skipped, cores) -> None:
    def cell(result: Measured | None) -> str:
        return "not run" if result is None else result.cell()

    print("\n".join(f"- {line}" for line in machine()) + "\n")
    print("| workload | kernels/file | kvtrace run | kvtrace summary | kvtrace diff | floor: GROUP BY (both files) "
          "| floor: kvtrace's job (both files) | nsys stats (both files) | diff / GROUP BY floor | diff / job floor "
          "| nsys stats / diff | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for workload, kernels, rows, floor, job, stats in results:
        for run, (summary, diff) in rows.items():
            load = max(summary.load, diff.load, floor.load, job.load, stats.load if stats else 0)
            print(f"| {workload} | {kernels:,} | {run} | {summary.cell()} | {diff.cell()} | {floor.cell()} "
                  f"| {job.cell()} | {cell(stats)} | {diff.wall / floor.wall:.2f}× | {diff.wall / job.wall:.2f}× "
                  f"| {'n/a' if stats is None else f'{stats.wall / diff.wall:.2f}×'} | {load:.1f} |")
    for line in skipped:
        print(f"\n{line}")
    if not cores:
        return
    print("\nFirst `kvtrace diff` (empty cache) on the first N cores (taskset), against the kvtrace-job floor "
          "(one core, both files one after the other) divided by N:\n")
    with_baseline = any(baseline for *_, baseline, _ in parallel)
    print("| workload | kernels/file | " + " | ".join(f"{n} core{'s' * (n > 1)}" for n in cores)
          + "".join(f" | {n} core{'s' * (n > 1)}, baseline" for n in cores if with_baseline)
          + " | job floor | " + " | ".join(f"{n}-core diff / (floor / {n})" for n in cores) + " | load |")
    print("|---|---|" + "---|" * ((3 if with_baseline else 2) * len(cores) + 2))

    def timing(m: Measured) -> str:
        return f"{m.wall:.2f} s ({m.cpu:.2f} s CPU), {m.rss:.0f} MiB"

    for workload, kernels, by_cores, baseline, job in parallel:
        load = max(m.load for m in (*by_cores.values(), *baseline.values(), job))
        print(f"| {workload} | {kernels:,} | " + " | ".join(timing(m) for m in by_cores.values())
              + "".join(f" | {timing(baseline[n]) if n in baseline else 'not run'}" for n in cores if with_baseline)
              + f" | {job.wall:.2f} s ({job.cpu:.2f} s CPU) | "
              + " | ".join(f"{m.wall / (job.wall / n):.2f}×" for n, m in by_cores.items()) + f" | {load:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
