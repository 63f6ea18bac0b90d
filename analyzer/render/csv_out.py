"""CSV: one row per segment and per family, raw nanoseconds, for spreadsheets and scripts."""

from __future__ import annotations

import io

from kvtrace.analyzer.results import Diff, Summary
from kvtrace.analyzer.kernels import KernelList
from kvtrace.analyzer.render.escape import csv_writer

STAT_FIELDS = ("calls", "total_ns", "mean_ns", "median_ns", "p90_ns", "p99_ns", "min_ns", "max_ns", "cv", "share")
# A diff row per line; every name is unique and documented in docs/json-schema.md. *_window_* count all calls
# in the window; *_stats_* describe the compared calls (all calls of the window when the row is not comparable).
DIFF_STAT_FIELDS = ("calls", "total_ns", "total_low_ns", "total_high_ns", "mean_ns", "median_ns", "p90_ns", "p99_ns",
                    "min_ns", "max_ns", "cv", "share")
DIFF_COLUMNS = ("level", "segment", "phase", "family_label", "family", "kv_independent", "baseline_window_calls",
                "candidate_window_calls", "baseline_window_total_ns", "candidate_window_total_ns", "compared_calls",
                "cells", "single_call_cells", "same_work", *(f"baseline_stats_{f}" for f in DIFF_STAT_FIELDS),
                *(f"candidate_stats_{f}" for f in DIFF_STAT_FIELDS), "ratio", "ci_low", "ci_high", "no_interval",
                "band", "verdict", "paired_verdict", "note", "reason", "total_delta_ns", "paired_delta_ns", "unpaired_share",
                "abs_delta_share", "run_ratios", "baseline_kv_dtypes", "candidate_kv_dtypes")


def kernels(result: KernelList) -> str:
    buffer = io.StringIO()
    writer = csv_writer(buffer)
    columns = list(result.rows[0]) if result.rows else ["segment", "demangled"]
    writer.writerow(columns)
    writer.writerows([row[c] if row[c] is not None else "" for c in columns] for row in result.rows)
    return buffer.getvalue()


def summary(result: Summary) -> str:
    buffer = io.StringIO()
    writer = csv_writer(buffer)
    writer.writerow(["level", "segment", "family_label", "family", "launch", "nvtx_range", *STAT_FIELDS, "kv_dtypes"])
    for level, rows in (("segment", result.segments), ("family", result.families)):
        for row in rows:
            writer.writerow([level, row.segment, row.family_label or "", row.family or "", row.launch or "",
                             row.nvtx_range or "", *(_blank(getattr(row.stats, f)) for f in STAT_FIELDS),
                             " ".join(row.kv_dtypes)])
    return buffer.getvalue()


def diff(result: Diff) -> str:
    buffer = io.StringIO()
    writer = csv_writer(buffer)
    writer.writerow(DIFF_COLUMNS)
    for level, rows in (("segment", result.segments), ("phase", result.phases),
                        ("phase_total", result.phase_totals), ("family", result.families)):
        for row in rows:
            writer.writerow([
                level, row.segment, row.phase or "", row.family_label or "", row.family or "", row.kv_independent,
                row.baseline_calls, row.candidate_calls, row.baseline_total_ns, row.candidate_total_ns,
                row.compared_calls, row.cells, row.single_call_cells, row.same_work,
                *(_blank(getattr(row.baseline, f)) if row.baseline else "" for f in DIFF_STAT_FIELDS),
                *(_blank(getattr(row.candidate, f)) if row.candidate else "" for f in DIFF_STAT_FIELDS),
                _blank(row.ratio), _blank(row.ci_low), _blank(row.ci_high), row.no_interval or "", _blank(row.band),
                row.verdict, row.paired_verdict or "", row.note or "", row.reason or "", row.total_delta_ns,
                row.paired_delta_ns, _blank(row.unpaired_share), _blank(row.abs_delta_share),
                " ".join(f"{r:.6g}" if r is not None else "" for r in row.run_ratios),
                " ".join(row.baseline_kv_dtypes), " ".join(row.candidate_kv_dtypes)])
    return buffer.getvalue()


def _blank(value):
    return "" if value is None else value
