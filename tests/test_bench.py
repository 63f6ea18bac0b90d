"""bench/make_large_trace.py grows a real export by whole copies, keeping its schema and relations."""

from __future__ import annotations

import hashlib
import sqlite3
import sys
from pathlib import Path

import polars as pl

from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.ranges import NO_RANGE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import make_large_trace  # noqa: E402

RANGES = make_large_trace.NVTX_REPLICATED


def _facts(path: Path) -> dict:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        one = lambda query: conn.execute(query).fetchone()[0]  # noqa: E731
        return {
            "schema": conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall(),
            "kernels": one("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL"),
            "kernel_correlations": one("SELECT count(DISTINCT correlationId) FROM CUPTI_ACTIVITY_KIND_KERNEL"),
            "runtime": one("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME"),
            "ranges": one(f"SELECT count(*) FROM NVTX_EVENTS WHERE {RANGES}"),
            "other_nvtx": one(f"SELECT count(*) FROM NVTX_EVENTS WHERE NOT ({RANGES})"),
            "strings": one("SELECT count(*) FROM StringIds"),
            "launched": one("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN CUPTI_ACTIVITY_KIND_RUNTIME r "
                            "ON r.correlationId = k.correlationId"),
        }


def test_grown_trace_keeps_the_schema_and_multiplies_rows_exactly(tmp_path):
    source = make_large_trace.FIXTURES["vllm"]
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    before = _facts(source)
    target = tmp_path / "grown.sqlite"
    copies = make_large_trace.grow(source, target, before["kernels"] * 3)
    after = _facts(target)
    assert copies == 3
    assert after["schema"] == before["schema"]
    for key in ("kernels", "kernel_correlations", "runtime", "ranges", "launched"):
        assert after[key] == 3 * before[key], key
    assert (after["other_nvtx"], after["strings"]) == (before["other_nvtx"], before["strings"])
    assert hashlib.sha256(source.read_bytes()).hexdigest() == digest  # the fixture is never written
    trace, original = open_trace(target), open_trace(source)
    assert trace.info.kernel_count == 3 * original.info.kernel_count
    assert trace.kernels["start"].is_sorted()
    # Every copy projects onto its own NVTX ranges, as the original does.
    assert trace.ranges.height == 3 * original.ranges.height
    ranges_per_copy = original.ranges.height
    outside = pl.col("range") == NO_RANGE
    assert trace.kernels.filter(outside).height == 3 * original.kernels.filter(outside).height
    per_range = original.kernels.filter(~outside).group_by("range").len().sort("range")
    grown = trace.kernels.filter(~outside).group_by(pl.col("range") % ranges_per_copy).len().sort("range")
    assert grown["range"].to_list() == per_range["range"].to_list()
    assert grown["len"].to_list() == [3 * n for n in per_range["len"]]
