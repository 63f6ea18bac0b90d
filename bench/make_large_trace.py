"""Grow a real Nsight Systems export to millions of kernels, for benchmarks.

The fixture is copied, then its kernel, runtime and NVTX range rows are replicated inside SQLite
(INSERT … SELECT, no Python rows): copy k shifts every timestamp by k periods of the trace and every
correlationId by k strides, so launches, graph replays and per-step NVTX ranges keep their real
relations. The schema, StringIds and all other tables stay as in the fixture. The fixture is never written; a packed
one (fixtures/RUN/RUN.tar.xz) is unpacked once into bench/out/fixtures/.

    python bench/make_large_trace.py --kernels 1000000 -o bench/out/auto-1M.sqlite
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import tarfile
import tempfile
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Fixture exports by name: (run folder under fixtures/, export).
FIXTURES = {
    "vllm": ("vllm-h200-cold-prefill", "auto.sqlite"),
    "vllm-fp8": ("vllm-h200-cold-prefill", "fp8.sqlite"),
    "vllm-decode": ("vllm-h200-decode-heavy", "auto.sqlite"),
    "vllm-decode-fp8": ("vllm-h200-decode-heavy", "fp8.sqlite"),
    "flashinfer": ("fi-h200-sm90", "fp8.sqlite"),
    "flashinfer-nvfp4": ("fi-h200-sm90", "nvfp4.sqlite"),
}
UNPACKED = ROOT / "bench" / "out" / "fixtures"  # where packed runs are unpacked, once
KERNEL, RUNTIME, NVTX = "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS"
# Closed ranges and marks are replicated; domain and string registrations (eventType 75 and others without
# an end) are one-off events, and duplicating them would duplicate every range's domain prefix.
NVTX_REPLICATED = 'eventType IN (59, 60, 70, 71) AND "end" IS NOT NULL'


def fixture(name: str) -> Path:
    """A fixture export by name; a run packed as fixtures/RUN/RUN.tar.xz is unpacked into UNPACKED first."""
    run, export = FIXTURES[name]
    pack = ROOT / "fixtures" / run / f"{run}.tar.xz"
    if not pack.is_file():
        return ROOT / "fixtures" / run / export
    if not (UNPACKED / run).is_dir():
        UNPACKED.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=UNPACKED, prefix=".unpacking-") as scratch:
            with tarfile.open(pack, "r:xz") as tar:
                tar.extractall(scratch, filter="data")
            Path(scratch, run).rename(UNPACKED / run)  # the pack holds RUN/, as fixtures/README.md says
    return UNPACKED / run / export


def grow(source: Path, target: Path, kernels: int) -> int:
    """Write `target` with about `kernels` kernel rows (whole copies of the source); returns the copy count."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.copyfile(source, partial)
    try:
        with sqlite3.connect(partial, isolation_level=None) as conn:
            copies = _replicate(conn, kernels)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return copies


def _replicate(conn: sqlite3.Connection, kernels: int) -> int:
    conn.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; PRAGMA temp_store=MEMORY;")
    base = conn.execute(f"SELECT count(*) FROM {KERNEL}").fetchone()[0]
    copies = max(1, round(kernels / base))
    tables = {KERNEL: "1", RUNTIME: "1", NVTX: NVTX_REPLICATED}
    spans = " UNION ALL ".join(f'SELECT min(start) AS s, max("end") AS e FROM {t} WHERE {w}'
                               for t, w in tables.items())
    first, last = conn.execute(f"SELECT min(s), max(e) FROM ({spans})").fetchone()
    period = last - first + 1_000_000  # 1 ms idle between copies, as between serving windows
    stride = conn.execute(f"SELECT max(m) FROM (SELECT max(correlationId) AS m FROM {KERNEL} UNION ALL "
                          f"SELECT max(correlationId) FROM {RUNTIME})").fetchone()[0] + 1
    conn.execute("BEGIN")
    conn.execute("CREATE TEMP TABLE copies(k INTEGER PRIMARY KEY)")
    conn.execute("WITH RECURSIVE n(k) AS (SELECT 1 UNION ALL SELECT k + 1 FROM n WHERE k < ?) "
                 "INSERT INTO copies SELECT k FROM n", (copies - 1,))
    for table, where in tables.items():
        columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
        shifted = {"start": f"b.start + c.k * {period}", "end": f'b."end" + c.k * {period}',
                   "correlationId": f"b.correlationId + c.k * {stride}"}
        if table == NVTX:
            del shifted["correlationId"]
        conn.execute(f"CREATE TEMP TABLE base AS SELECT * FROM {table} WHERE {where}")
        # copies first: CROSS JOIN keeps it the outer loop, so rows are written copy by copy, in time order.
        conn.execute(f"INSERT INTO {table} ({', '.join(_q(c) for c in columns)}) SELECT "
                     + ", ".join(shifted.get(c, f"b.{_q(c)}") for c in columns)
                     + " FROM copies AS c CROSS JOIN base AS b")
        conn.execute("DROP TABLE base")
    conn.execute("DROP TABLE copies")
    conn.execute("COMMIT")
    return copies


def estimate_bytes(source: Path, kernels: int) -> int:
    """About how large `grow(source, target, kernels)` makes the target: a few copies are grown in memory
    and measured, with a quarter on top (pages of a grown file hold fewer rows than pages grown in memory)."""
    with closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True)) as conn, \
            closing(sqlite3.connect(":memory:", isolation_level=None)) as memory:
        conn.backup(memory)
        page_size, before = (memory.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_size", "page_count"))
        base = memory.execute(f"SELECT count(*) FROM {KERNEL}").fetchone()[0]
        copies = _replicate(memory, base * 9)
        per_copy = (memory.execute("PRAGMA page_count").fetchone()[0] - before) * page_size / (copies - 1)
    return int(source.stat().st_size + per_copy * max(0, round(kernels / base) - 1) * 1.25)


def kernel_count(path: Path) -> int:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute(f"SELECT count(*) FROM {KERNEL}").fetchone()[0]


def _q(name: str) -> str:
    return f'"{name}"'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, required=True, help="target kernel rows (rounded to whole copies)")
    parser.add_argument("--source", default="vllm",
                        help=f"fixture ({', '.join(FIXTURES)}) or path to an export (default: vllm)")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    source = fixture(args.source) if args.source in FIXTURES else Path(args.source)
    if source.resolve() == args.output.resolve():
        parser.error("the output must be a new file, not the source")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    copies = grow(source, args.output, args.kernels)
    print(f"{args.output}: {copies} copies of {source.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
