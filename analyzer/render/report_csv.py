"""CSV for the serving report (analyzer.report.Report): long format, one value per line."""

from __future__ import annotations

import io
from dataclasses import asdict

from kvtrace.analyzer.render import quality as quality_render
from kvtrace.analyzer.render.escape import csv_writer
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.report import Report

def report_csv(report: Report) -> str:
    buffer = io.StringIO()
    writer = csv_writer(buffer)
    # Long format: one value per line, so that every section fits one header.
    writer.writerow(["section", "key", "arm", "metric", "value"])
    labels = {"baseline": report.baseline.label, "candidate": report.candidate.label}
    for s in report.statements:
        writer.writerow(["statement", s.check, "", s.level, statement_text(s)])
    checked = report.diff.verification
    if checked is not None:  # --verify: one line per input and per kernel whose calls or total differ
        stats, *recipe = checked.outcomes()
        writer.writerow(["verify", "", "", "agrees", checked.agrees])
        writer.writerow(["verify", "", "", "summary", stats.summary])
        writer.writerow(["verify", "", "", "recipe", checked.recipe])
        for outcome in recipe:
            writer.writerow(["verify_recipe", "", "", "agrees", outcome.agrees])
            writer.writerow(["verify_recipe", "", "", "summary", outcome.summary])
        for section, inputs in (("verify", checked.inputs), ("verify_recipe", checked.recipe_inputs)):
            for item in inputs:
                for metric in ("agrees", "kernels", "calls", "problem"):
                    value = getattr(item, metric)
                    writer.writerow([section, item.source, "", metric, "" if value is None else value])
                for m in item.mismatches:
                    for metric in ("kvtrace_calls", "kvtrace_total_ns", "nsys_calls", "nsys_total_ns"):
                        value = getattr(m, metric)
                        writer.writerow([f"{section}_mismatch", f"{item.source}: {m.kernel}", "", metric,
                                         "" if value is None else value])
    for row in report.serving:
        for side in ("baseline", "candidate"):
            metrics = getattr(row, side)
            if metrics is None:
                continue
            values = asdict(metrics)
            checks = values.pop("checks")
            values.pop("requests_detail")  # per-request lists: the JSON's
            for name, value in _flatten(values):
                writer.writerow(["serving", row.point, labels[side], name, "" if value is None else value])
            for check in checks:  # one line per source and one for the verdict
                for source, value in ((check["first"], check["first_value"]), (check["second"], check["second_value"])):
                    writer.writerow(["serving_check", row.point, labels[side], f"{check['quantity']}: {source}", value])
                writer.writerow(["serving_check", row.point, labels[side], f"{check['quantity']}: agree",
                                 check["agree"]])
            writer.writerow(["serving", row.point, labels[side], "first_capacity", getattr(row, f"{side}_first_capacity")])
    _write_arm_fields(writer, "segment", "segment", report.segment_times, labels)
    _write_arm_fields(writer, "bandwidth", "phase", report.bandwidth, labels)
    if report.hbm_ceiling:
        writer.writerow(["bandwidth", "ceiling", "", "bytes_per_s", report.hbm_ceiling.bytes_per_s])
    _write_arm_fields(writer, "compute", "phase", report.prefill_compute, labels)
    _write_arm_fields(writer, "steps", "phase", report.step_timeline, labels, skip=("held_by",))
    for row in report.step_timeline:  # what held the candidate's host: one line per field of each kind of wait
        for place, kind in enumerate(row.held_by):
            writer.writerows(["steps_held_by", f"{row.phase} {place + 1}", labels["candidate"], name,
                              "" if value is None else value] for name, value in asdict(kind).items())
    if report.compute_ceiling and report.compute_ceiling.flops_per_s:
        writer.writerow(["compute", "ceiling", "", "flops_per_s", report.compute_ceiling.flops_per_s])
    if report.capacity:
        for row in report.capacity.formats:
            for name, value in asdict(row).items():
                if name != "label":
                    writer.writerow(["capacity", row.label, "", name, "" if value is None else value])
        for row in report.capacity.groups:
            for name, value in asdict(row).items():
                if name not in ("label", "kind"):
                    writer.writerow(["capacity_group", f"{row.label} {row.kind}", "", name,
                                     "" if value is None else value])
        for row in report.capacity.measured:
            for name, value in asdict(row).items():
                if name != "arm":
                    writer.writerow(["capacity_measured", row.arm, "", name, "" if value is None else value])
    if report.quality is not None:
        writer.writerows(quality_render.csv_rows(report.quality, report.baseline.label, report.candidate.label))
    for plot in report.plots:
        writer.writerow(["plot", plot.kind, "", "path", plot.path])
    return buffer.getvalue()


def _flatten(data: dict, prefix: str = ""):
    for name, value in data.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def _write_arm_fields(writer, kind: str, key: str, rows, labels, skip: tuple[str, ...] = ()) -> None:
    """One CSV line per field of each row but `skip`, keyed by the row's `key` field; baseline_/candidate_ fields
    name their arm in the label column."""
    for row in rows:
        for name, value in asdict(row).items():
            if name == key or name in skip:
                continue
            side = next((s for s in ("baseline", "candidate") if name.startswith(s + "_")), None)
            writer.writerow([kind, getattr(row, key), labels[side] if side else "",
                             name.removeprefix(f"{side}_") if side else name, "" if value is None else value])
