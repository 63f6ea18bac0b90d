"""CSV: one row per segment and per family, raw nanoseconds, for spreadsheets and scripts."""

from __future__ import annotations

import io

from kvtrace.analyzer.compare import Diff, KernelList, Summary
from kvtrace.analyzer.render.escape import csv_writer

STAT_FIELDS = ("calls", "total_ns", "mean_ns", "median_ns", "p90_ns", "p99_ns", "min_ns", "max_ns", "cv", "share")


def render(result: Summary | Diff | KernelList) -> str:
    if not isinstance(result, (Summary, Diff, KernelList)):
        from kvtrace.analyzer.render import report_tables  # kvtrace report / capacity results

        return report_tables.csv_text(result)
    buffer = io.StringIO()
    writer = csv_writer(buffer)
    if isinstance(result, KernelList):
        columns = list(result.rows[0]) if result.rows else ["segment", "demangled"]
        writer.writerow(columns)
        writer.writerows([row[c] if row[c] is not None else "" for c in columns] for row in result.rows)
    elif isinstance(result, Summary):
        writer.writerow(["level", "segment", "family_label", "family", *STAT_FIELDS, "kv_dtypes"])
        for level, rows in (("segment", result.segments), ("family", result.families)):
            for row in rows:
                writer.writerow([level, row.segment, row.family_label or "", row.family or "",
                                 *(getattr(row.stats, f) for f in STAT_FIELDS), " ".join(row.kv_dtypes)])
    else:
        # baseline_*/candidate_* statistics describe the compared (paired) calls; *_calls and *_total_ns all
        # calls in the window.
        writer.writerow(["level", "segment", "phase", "family_label", "family", "baseline_calls", "candidate_calls",
                         "compared_calls", "baseline_total_ns", "candidate_total_ns",
                         *(f"baseline_{f}" for f in STAT_FIELDS), *(f"candidate_{f}" for f in STAT_FIELDS),
                         "ratio", "ci_low", "ci_high", "verdict", "note", "reason", "total_delta_ns", "delta_share",
                         "baseline_kv_dtypes", "candidate_kv_dtypes"])
        for level, rows in (("segment", result.segments), ("phase", result.phases), ("family", result.families)):
            for row in rows:
                writer.writerow([
                    level, row.segment, row.phase or "", row.family_label or "", row.family or "",
                    row.baseline_calls, row.candidate_calls, row.compared_calls, row.baseline_total_ns,
                    row.candidate_total_ns,
                    *(getattr(row.baseline, f) if row.baseline else "" for f in STAT_FIELDS),
                    *(getattr(row.candidate, f) if row.candidate else "" for f in STAT_FIELDS),
                    _blank(row.ratio), _blank(row.ci_low), _blank(row.ci_high), row.verdict, row.note or "",
                    row.reason or "", row.total_delta_ns, _blank(row.delta_share),
                    " ".join(row.baseline_kv_dtypes), " ".join(row.candidate_kv_dtypes)])
    return buffer.getvalue()


def _blank(value):
    return "" if value is None else value
