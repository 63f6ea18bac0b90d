"""GitHub-flavoured markdown, ready to paste into an upstream performance issue."""

from __future__ import annotations

from pathlib import Path

from kvtrace.analyzer.compare import Arm, Diff, DiffRow, KernelList, Summary
from kvtrace.analyzer.render.units import duration, interval, percent, ratio, signed_duration

_MARK = {"ok": "✅", "warning": "⚠️", "error": "❌"}


def render(result: Summary | Diff | KernelList) -> str:
    if isinstance(result, KernelList):
        return _kernels(result)
    return _summary(result) if isinstance(result, Summary) else _diff(result)


def _kernels(kernels: KernelList) -> str:
    what = "Unclassified kernels" if kernels.only_unclassified else "Kernels"
    lines = [f"## {what}: {kernels.arm.label}", ""]
    lines += _table(["segment", "calls", "total", "share", "mean", "recipe", "kernel"],
                    [[r["segment"], f"{r['calls']:,}", duration(r["total_ns"]), percent(r["share"]),
                      duration(r["mean_ns"]), r["recipe"] or "–", f"`{r['demangled']}`"] for r in kernels.rows])
    return "\n".join(lines + ["", _footer(kernels.kvtrace_version, kernels.recipes)]) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _environment(arms: list[Arm]) -> list[str]:
    def gpu(arm: Arm) -> str:
        parts = []
        for g in arm.info.gpus:
            extras = [f"{g.sm_count} SMs" if g.sm_count else None,
                      f"SM {g.compute_capability}" if g.compute_capability else None]
            parts.append(g.name + (f" ({', '.join(e for e in extras if e)})" if any(extras) else ""))
        return "; ".join(parts) or "unknown"

    fields = [
        ("file", lambda a: f"`{Path(a.info.source).name}`"),
        ("GPU", gpu),
        ("driver", lambda a: a.info.driver_version or "–"),
        ("Nsight Systems", lambda a: f"{a.info.product_version or '?'} (schema {a.info.schema_version or '?'})"),
        ("CUDA graph trace", lambda a: a.info.graph_trace_mode or "not recorded"),
        ("kernels", lambda a: f"{a.info.kernel_count:,}"),
        ("kernel span", lambda a: duration(a.info.kernel_span_ns)),
        ("GPU kernel time", lambda a: duration(a.total_ns)),
        ("KV dtype (from kernel names)", lambda a: ", ".join(a.kv_dtypes) or "none detected"),
    ]
    return _table([""] + [a.label for a in arms], [[name] + [fn(a) for a in arms] for name, fn in fields])


def _summary(summary: Summary) -> str:
    arm = summary.arm
    lines = [f"## kvtrace summary: {arm.label}", "",
             f"{arm.info.kernel_count:,} kernels, {duration(arm.total_ns)} of GPU kernel time.", "",
             "### Segments", ""]
    lines += _table(["segment", "calls", "total", "share", "mean", "median", "p90", "KV dtype"],
                    [[r.segment, f"{r.stats.calls:,}", duration(r.stats.total_ns), percent(r.stats.share),
                      duration(r.stats.mean_ns), duration(r.stats.median_ns), duration(r.stats.p90_ns),
                      ", ".join(r.kv_dtypes) or "–"] for r in summary.segments])
    lines += ["", "### Kernel families", ""]
    lines += _table(["segment", "family", "calls", "total", "share", "mean", "median", "p90", "KV dtype"],
                    [[r.segment, f"`{r.family_label}`", f"{r.stats.calls:,}", duration(r.stats.total_ns),
                      percent(r.stats.share), duration(r.stats.mean_ns), duration(r.stats.median_ns),
                      duration(r.stats.p90_ns), ", ".join(r.kv_dtypes) or "–"] for r in summary.families])
    lines += ["", "### Environment", ""] + _environment([arm])
    lines += ["", "<details><summary>Kernel names per segment</summary>", ""]
    for r in summary.segments:
        lines += [f"**{r.segment}**", ""] + [f"- `{name}`" for name in r.names] + [""]
    lines += ["</details>", "", _footer(summary.kvtrace_version, summary.recipes)]
    return "\n".join(lines) + "\n"


def _diff_cells(row: DiffRow) -> list[str]:
    b, c = row.baseline, row.candidate
    return [f"{b.calls:,}" if b else "–", f"{c.calls:,}" if c else "–", duration(b.mean_ns if b else None),
            duration(c.mean_ns if c else None), ratio(row.ratio), interval(row.ci_low, row.ci_high),
            row.verdict + (f" ({row.reason})" if row.reason else ""), signed_duration(row.total_delta_ns),
            percent(row.delta_share)]


def _diff(diff: Diff) -> str:
    b, c = diff.baseline, diff.candidate
    confidence = f"{100 * diff.confidence:.0f}%"
    lines = [f"## kvtrace diff: {b.label} → {c.label}", "",
             f"Baseline **{b.label}**, candidate **{c.label}**. Ratio = candidate / baseline mean time per call; "
             f"{confidence} bootstrap interval; a change smaller than ±{100 * diff.threshold:g}% or an interval "
             "that includes 1 is \"no significant change\". Rows whose arms did different work say "
             "\"not comparable\" instead of a verdict.", "",
             f"Total GPU kernel time: {duration(b.total_ns)} → {duration(c.total_ns)} ({ratio(diff.total_ratio)}).",
             "", "### Comparability", ""]
    lines += [f"- {_MARK[f.level]} {f.message}" for f in diff.findings]
    header = ["calls (base)", "calls (cand)", f"mean {b.label}", f"mean {c.label}", "ratio", f"{confidence} CI",
              "verdict", "Δ total", "share of Δ"]
    lines += ["", "### Segments", ""]
    lines += _table(["segment"] + header, [[r.segment] + _diff_cells(r) for r in diff.segments])
    lines += ["", "### Kernel families", ""]
    lines += _table(["segment", "family"] + header,
                    [[r.segment, f"`{r.family_label}`"] + _diff_cells(r) for r in diff.families])
    lines += ["", "### Environment", ""] + _environment([b, c])
    lines += ["", "<details><summary>Kernel names per segment</summary>", ""]
    for r in diff.segments:
        lines += [f"**{r.segment}**", ""]
        lines += [f"- {b.label}: `{name}`" for name in r.baseline_names]
        lines += [f"- {c.label}: `{name}`" for name in r.candidate_names] + [""]
    lines += ["</details>", "", _footer(diff.kvtrace_version, diff.recipes)]
    return "\n".join(lines) + "\n"


def _footer(version: str, recipes: tuple[str, ...]) -> str:
    return f"<sub>kvtrace {version} · recipes: {', '.join(recipes)}</sub>"
