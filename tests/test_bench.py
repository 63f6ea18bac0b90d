"""bench/make_large_trace.py grows a real export by whole copies, keeping its schema and relations."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from conftest import VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY, sha256
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


def test_grown_trace_keeps_the_schema_and_multiplies_rows_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(make_large_trace, "UNPACKED", tmp_path / "fixtures")
    source = make_large_trace.fixture("vllm")  # unpacked from its pack: the shipped bytes
    assert sha256(source) == sha256(VLLM_COLD_PREFILL / "auto.sqlite")
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


def test_disk_estimate_covers_a_grown_file(tmp_path, monkeypatch):
    """bench/run.py checks the free disk against this estimate before growing a pair."""
    monkeypatch.setattr(make_large_trace, "UNPACKED", tmp_path / "fixtures")
    source = make_large_trace.fixture("vllm-decode")
    kernels = _facts(source)["kernels"] * 20
    target = tmp_path / "grown.sqlite"
    make_large_trace.grow(source, target, kernels)
    size = target.stat().st_size
    assert size <= make_large_trace.estimate_bytes(source, kernels) <= 2 * size


def test_job_floor_reads_what_kvtrace_reads(tmp_path, monkeypatch):
    """bench/floor.c, the kvtrace-job floor: the kernels, the launch calls and the NVTX ranges kvtrace loads."""
    import run

    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(run, "JOB_FLOOR", tmp_path / "kvtrace-floor")
    path = VLLM_DECODE_HEAVY / "auto.sqlite"
    out = subprocess.run([str(run.job_floor()), str(path)], capture_output=True, text=True, check=True).stdout
    kernels, launches, ranges = (int(n) for n in re.findall(r"(\d+) (?:kernels|launch calls|NVTX ranges) in", out))
    trace = open_trace(path, cache=False)
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        launch_calls = conn.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s "
                                    "ON s.id = r.nameId WHERE s.value GLOB '*Launch*'").fetchone()[0]
    assert (kernels, launches, ranges) == (trace.info.kernel_count, launch_calls, trace.ranges.height)
