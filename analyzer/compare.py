"""Summaries of one trace and diffs of two, as plain result objects that every renderer reads.

Kernels are classified once per distinct signature (name, grid, block) and joined back; per-call
statistics are computed per segment and per family from the duration column. Numbers come from
analyzer.stats only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import polars as pl

from kvtrace import __version__
from kvtrace.analyzer import stats
from kvtrace.analyzer.classify import SEGMENTS, RecipeSet
from kvtrace.analyzer.load import Trace, TraceInfo

SUMMARY_SCHEMA = "kvtrace.summary/1"
DIFF_SCHEMA = "kvtrace.diff/1"
SIGNATURE = ["name_id", "short_id", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"]
NOT_COMPARABLE = "not comparable"
# Attention and append kernels carry the KV dtype in their template arguments.
KV_SEGMENTS = ("prefill_attention", "decode_attention", "kv_append")


@dataclass(frozen=True)
class ArmStats:
    calls: int
    total_ns: int
    mean_ns: float
    median_ns: float
    p90_ns: float
    p99_ns: float
    min_ns: float
    max_ns: float
    cv: float
    share: float | None  # of the arm's GPU kernel time

    @classmethod
    def of(cls, durations: np.ndarray, arm_total_ns: int) -> ArmStats:
        d = stats.describe(durations)
        return cls(calls=d.count, total_ns=int(d.total), mean_ns=d.mean, median_ns=d.median, p90_ns=d.p90,
                   p99_ns=d.p99, min_ns=d.min, max_ns=d.max, cv=d.cv, share=stats.share(d.total, arm_total_ns))


@dataclass(frozen=True)
class Arm:
    label: str
    info: TraceInfo
    total_ns: int
    kv_dtypes: tuple[str, ...]  # seen in attention / append kernels


@dataclass
class SummaryRow:
    segment: str
    stats: ArmStats
    family: str | None = None
    family_label: str | None = None
    kv_dtypes: tuple[str, ...] = ()
    names: tuple[str, ...] = ()


@dataclass
class Summary:
    arm: Arm
    recipes: tuple[str, ...]
    segments: list[SummaryRow]
    families: list[SummaryRow]
    schema: str = SUMMARY_SCHEMA
    kvtrace_version: str = __version__

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DiffRow:
    segment: str
    baseline: ArmStats | None
    candidate: ArmStats | None
    ratio: float | None  # candidate mean / baseline mean
    ci_low: float | None
    ci_high: float | None
    verdict: str
    reason: str | None  # why a row is not comparable
    total_delta_ns: int  # candidate total - baseline total
    delta_share: float | None  # fraction of the whole-trace delta this row explains
    family: str | None = None
    family_label: str | None = None
    baseline_kv_dtypes: tuple[str, ...] = ()
    candidate_kv_dtypes: tuple[str, ...] = ()
    baseline_names: tuple[str, ...] = ()
    candidate_names: tuple[str, ...] = ()


@dataclass
class Finding:
    level: str  # "ok", "warning", "error"
    check: str
    message: str


@dataclass
class Diff:
    baseline: Arm
    candidate: Arm
    recipes: tuple[str, ...]
    threshold: float
    confidence: float
    findings: list[Finding]
    segments: list[DiffRow]
    families: list[DiffRow]
    schema: str = DIFF_SCHEMA
    kvtrace_version: str = __version__

    @property
    def total_ratio(self) -> float | None:
        return self.candidate.total_ns / self.baseline.total_ns if self.baseline.total_ns else None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["total_ratio"] = self.total_ratio
        return data


def classified_kernels(trace: Trace, recipes: RecipeSet) -> pl.DataFrame:
    """Kernel rows with segment, family, family_label, kv_dtype and demangled name attached."""
    signatures = trace.kernels.select(SIGNATURE).unique()
    names = trace.names.rename({"id": "name_id", "value": "demangled"})
    shorts = trace.names.rename({"id": "short_id", "value": "short"})
    signatures = (signatures.join(names, on="name_id", how="left").join(shorts, on="short_id", how="left")
                  .with_columns(pl.col(c).cast(pl.Int64) for c in SIGNATURE))
    classified = recipes.classify(signatures).with_columns(pl.col(c).cast(pl.Int32) for c in SIGNATURE[2:])
    keep = SIGNATURE + ["demangled", "segment", "family", "family_label", "kv_dtype", "recipe"]
    return trace.kernels.join(classified.select(keep), on=SIGNATURE, how="left")


def _segment_order(segment: str) -> int:
    return SEGMENTS.index(segment) if segment in SEGMENTS else len(SEGMENTS)


def _groups(kernels: pl.DataFrame, keys: list[str]) -> dict[tuple, dict]:
    """Per group: durations as numpy, the kv dtypes and demangled names seen."""
    grouped = kernels.group_by(keys).agg(
        pl.col("duration"), pl.col("kv_dtype").drop_nulls().unique().sort(),
        pl.col("demangled").unique().sort(), pl.col("segment").first().alias("_segment"),
        pl.col("family_label").first().alias("_label"))
    out = {}
    for row in grouped.iter_rows(named=True):  # one row per group, not per kernel
        key = tuple(row[k] for k in keys)
        out[key] = {"durations": np.asarray(row["duration"], dtype=np.int64), "kv": tuple(row["kv_dtype"]),
                    "names": tuple(row["demangled"]), "segment": row["_segment"], "label": row["_label"]}
    return out


def _arm(trace: Trace, kernels: pl.DataFrame, label: str) -> Arm:
    kv = kernels.filter(pl.col("segment").is_in(KV_SEGMENTS))["kv_dtype"].drop_nulls().unique().sort()
    return Arm(label=label, info=trace.info, total_ns=int(kernels["duration"].sum()), kv_dtypes=tuple(kv))


def summarize(trace: Trace, recipes: RecipeSet, label: str | None = None) -> Summary:
    kernels = classified_kernels(trace, recipes)
    arm = _arm(trace, kernels, label or _default_label(trace))
    segments = [SummaryRow(segment=key[0], stats=ArmStats.of(g["durations"], arm.total_ns), kv_dtypes=g["kv"],
                           names=g["names"]) for key, g in _groups(kernels, ["segment"]).items()]
    families = [SummaryRow(segment=g["segment"], family=key[0], family_label=g["label"],
                           stats=ArmStats.of(g["durations"], arm.total_ns), kv_dtypes=g["kv"], names=g["names"])
                for key, g in _groups(kernels, ["family"]).items()]
    segments.sort(key=lambda r: -r.stats.total_ns)
    families.sort(key=lambda r: -r.stats.total_ns)
    return Summary(arm=arm, recipes=tuple(recipes.files), segments=segments, families=families)


def diff(baseline: Trace, candidate: Trace, recipes: RecipeSet, *, labels: tuple[str | None, str | None] = (None, None),
         threshold: float = 0.02, confidence: float = 0.95, seed: int = 0) -> Diff:
    base_kernels = classified_kernels(baseline, recipes)
    cand_kernels = classified_kernels(candidate, recipes)
    base_arm = _arm(baseline, base_kernels, labels[0] or _default_label(baseline))
    cand_arm = _arm(candidate, cand_kernels, labels[1] or _default_label(candidate))
    total_delta = cand_arm.total_ns - base_arm.total_ns

    def rows(keys: list[str]) -> list[DiffRow]:
        base_groups, cand_groups = _groups(base_kernels, keys), _groups(cand_kernels, keys)
        out = []
        for key in sorted(set(base_groups) | set(cand_groups), key=str):
            b, c = base_groups.get(key), cand_groups.get(key)
            row = _diff_row(b, c, base_arm.total_ns, cand_arm.total_ns, total_delta, threshold, confidence, seed)
            if keys == ["family"]:
                row.family = key[0]
            out.append(row)
        out.sort(key=lambda r: (-abs(r.total_delta_ns), _segment_order(r.segment)))
        return out

    findings = comparability(base_arm, cand_arm)
    return Diff(baseline=base_arm, candidate=cand_arm, recipes=tuple(recipes.files), threshold=threshold,
                confidence=confidence, findings=findings, segments=rows(["segment"]), families=rows(["family"]))


def _diff_row(b: dict | None, c: dict | None, base_total: int, cand_total: int, total_delta: int,
              threshold: float, confidence: float, seed: int) -> DiffRow:
    either = b or c
    base_stats = ArmStats.of(b["durations"], base_total) if b else None
    cand_stats = ArmStats.of(c["durations"], cand_total) if c else None
    delta = (cand_stats.total_ns if cand_stats else 0) - (base_stats.total_ns if base_stats else 0)
    row = DiffRow(segment=either["segment"], baseline=base_stats, candidate=cand_stats, ratio=None, ci_low=None,
                  ci_high=None, verdict=NOT_COMPARABLE, reason=None, total_delta_ns=delta,
                  delta_share=stats.share(delta, total_delta), family_label=either["label"],
                  baseline_kv_dtypes=b["kv"] if b else (), candidate_kv_dtypes=c["kv"] if c else (),
                  baseline_names=b["names"] if b else (), candidate_names=c["names"] if c else ())
    if b is None or c is None:
        row.reason = f"only in the {'candidate' if b is None else 'baseline'}"
        return row
    row.ratio = cand_stats.mean_ns / base_stats.mean_ns if base_stats.mean_ns else None
    if base_stats.calls != cand_stats.calls:
        row.reason = f"call counts differ ({base_stats.calls} vs {cand_stats.calls})"
        return row
    interval = stats.ratio_interval(b["durations"], c["durations"], confidence=confidence, seed=seed)
    row.ci_low, row.ci_high = interval.low, interval.high
    row.verdict = stats.verdict(interval, threshold=threshold)
    return row


def comparability(baseline: Arm, candidate: Arm) -> list[Finding]:
    findings = []
    b_gpu, c_gpu = baseline.info.gpu_label, candidate.info.gpu_label
    findings.append(Finding("ok" if b_gpu == c_gpu else "error", "gpu",
                            f"same GPU: {b_gpu}" if b_gpu == c_gpu else f"different GPUs: {b_gpu} vs {c_gpu}"))
    b_ver, c_ver = baseline.info.product_version or "?", candidate.info.product_version or "?"
    same_family = b_ver.split(".")[:2] == c_ver.split(".")[:2]
    findings.append(Finding("ok" if same_family else "warning", "nsys",
                            f"Nsight Systems {b_ver} and {c_ver}" + ("" if same_family else
                            ": different versions can report kernels differently")))
    for arm in (baseline, candidate):
        if arm.info.graph_trace_mode is not None and arm.info.graph_trace_mode.lower() != "node":
            findings.append(Finding("warning", "graph-trace", f"{arm.label}: CUDA graphs traced as "
                                    f"'{arm.info.graph_trace_mode}', so kernels inside graphs are missing; "
                                    "re-profile with --cuda-graph-trace=node"))
    findings += _dtype_findings(baseline, candidate)
    return findings


_DTYPE_WORDS = {"nvfp4": ("nvfp4", "fp4"), "fp8_e4m3": ("fp8",), "fp8_e5m2": ("fp8",), "bf16": ("bf16", "auto"),
                "fp16": ("fp16", "auto"), "auto": ("auto", "bf16")}


def _dtype_findings(baseline: Arm, candidate: Arm) -> list[Finding]:
    findings = []
    for arm in (baseline, candidate):
        seen = ", ".join(arm.kv_dtypes) or "none detected"
        findings.append(Finding("ok", "kv-dtype", f"{arm.label}: KV cache dtype in kernel names: {seen}"))
    if baseline.kv_dtypes and baseline.kv_dtypes == candidate.kv_dtypes:
        findings.append(Finding("warning", "kv-dtype", "both arms ran the same KV dtype "
                                f"({', '.join(baseline.kv_dtypes)}): this compares runs, not formats"))

    def claims(label: str) -> set[str]:
        lowered = label.lower()
        return {dtype for dtype, words in _DTYPE_WORDS.items() if any(w in lowered for w in words)}

    for arm, other in ((baseline, candidate), (candidate, baseline)):
        claimed = claims(arm.label)
        # "fp8" is a substring of nothing else, "fp4" only of nvfp4; a label naming the other arm's
        # dtype but not its own is the swapped-arms signature.
        if claimed and arm.kv_dtypes and not claimed & set(arm.kv_dtypes):
            swapped = claims(other.label) & set(arm.kv_dtypes)
            findings.append(Finding("error", "kv-dtype",
                                    f"'{arm.label}' ran {', '.join(arm.kv_dtypes)} kernels"
                                    + (f": the arms look swapped (baseline first, candidate second)" if swapped else
                                       ": check that the file and its label match")))
    return findings


def _default_label(trace: Trace) -> str:
    from pathlib import Path

    return Path(trace.info.source).stem


@dataclass
class KernelList:
    """Distinct kernel names with their classification, by share of GPU time."""

    arm: Arm
    recipes: tuple[str, ...]
    only_unclassified: bool
    rows: list[dict] = field(default_factory=list)
    schema: str = "kvtrace.kernels/1"
    kvtrace_version: str = __version__

    def to_dict(self) -> dict:
        return asdict(self)


def list_kernels(trace: Trace, recipes: RecipeSet, *, unclassified: bool = False, segment: str | None = None,
                 label: str | None = None) -> KernelList:
    kernels = classified_kernels(trace, recipes)
    arm = _arm(trace, kernels, label or _default_label(trace))
    if unclassified:
        kernels = kernels.filter(pl.col("recipe").is_null())
    if segment:
        kernels = kernels.filter(pl.col("segment") == segment)
    table = (kernels.group_by("demangled")
             .agg(pl.col("segment").first(), pl.col("recipe").first(), pl.col("family_label").first(),
                  pl.col("kv_dtype").first(), pl.len().alias("calls"), pl.col("duration").sum().alias("total_ns"),
                  pl.col("duration").mean().alias("mean_ns"))
             .with_columns((pl.col("total_ns") / arm.total_ns).alias("share"))
             .sort("total_ns", descending=True)
             .select("segment", "family_label", "kv_dtype", "calls", "total_ns", "mean_ns", "share", "recipe",
                     "demangled"))
    return KernelList(arm=arm, recipes=tuple(recipes.files), only_unclassified=unclassified,
                      rows=table.to_dicts())
