"""Summaries of one trace and diffs of two, as plain result objects that every renderer reads.

Kernels are classified once per distinct signature (name, grid, block) and joined back; the window
(analyzer.align) picks which calls count; calls are paired across arms per kernel family and launch shape
before any ratio is formed. Numbers come from analyzer.stats only.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import numpy as np
import polars as pl

from kvtrace import __version__
from kvtrace.analyzer import align, stats
from kvtrace.analyzer.classify import SEGMENTS, RecipeSet
from kvtrace.analyzer.load import Trace, TraceInfo
from kvtrace.errors import KvtraceError

SUMMARY_SCHEMA = "kvtrace.summary/1"
DIFF_SCHEMA = "kvtrace.diff/2"
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
        return _schema_first(asdict(self))


@dataclass
class DiffRow:
    segment: str
    baseline: ArmStats | None  # of the compared calls; of all calls when nothing could be compared
    candidate: ArmStats | None
    baseline_calls: int  # in the window, matched or not
    candidate_calls: int
    baseline_total_ns: int  # all calls in the window
    candidate_total_ns: int
    compared_calls: int  # paired calls per arm (0 when not comparable)
    ratio: float | None  # candidate mean / baseline mean over the compared calls
    ci_low: float | None
    ci_high: float | None
    verdict: str
    note: str | None  # how calls were paired when not one-to-one
    reason: str | None  # why the row is not comparable
    total_delta_ns: int  # candidate total - baseline total, all calls in the window
    delta_share: float | None  # fraction of the whole delta this row explains
    family: str | None = None
    family_label: str | None = None
    phase: str | None = None
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
    phases: list[DiffRow] = field(default_factory=list)  # per segment and NVTX phase, when ranges exist
    window: list[str] = field(default_factory=list)
    schema: str = DIFF_SCHEMA
    kvtrace_version: str = __version__

    @property
    def total_ratio(self) -> float | None:
        return self.candidate.total_ns / self.baseline.total_ns if self.baseline.total_ns else None

    def to_dict(self) -> dict:
        data = _schema_first(asdict(self))
        data["total_ratio"] = self.total_ratio
        return data


def _schema_first(data: dict) -> dict:
    return {"schema": data.pop("schema"), "kvtrace_version": data.pop("kvtrace_version"), **data}


def classified_kernels(trace: Trace, recipes: RecipeSet) -> pl.DataFrame:
    """Kernel rows with segment, family, family_label, kv_dtype and demangled name attached."""
    signatures = trace.kernels.select(SIGNATURE).unique()
    names = trace.names.rename({"id": "name_id", "value": "demangled"})
    shorts = trace.names.rename({"id": "short_id", "value": "short"})
    signatures = (signatures.join(names, on="name_id", how="left").join(shorts, on="short_id", how="left")
                  .with_columns(pl.col(c).cast(pl.Int64) for c in SIGNATURE))
    classified = recipes.classify(signatures).with_columns(pl.col(c).cast(pl.Int32) for c in SIGNATURE[2:])
    keep = SIGNATURE + ["demangled", "segment", "family", "family_label", "kv_dtype", "recipe"]
    # kernel_row ties a launch back to trace.kernels (NVTX projection) whatever order the join returns.
    return trace.kernels.with_row_index("kernel_row").join(classified.select(keep), on=SIGNATURE, how="left")


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


def summarize(trace: Trace, recipes: RecipeSet, label: str | None = None,
              window: align.Window = align.Window()) -> Summary:
    kernels = _windowed(trace, recipes, window)
    arm = _arm(trace, kernels, label or _default_label(trace))
    segments = [SummaryRow(segment=key[0], stats=ArmStats.of(g["durations"], arm.total_ns), kv_dtypes=g["kv"],
                           names=g["names"]) for key, g in _groups(kernels, ["segment"]).items()]
    families = [SummaryRow(segment=g["segment"], family=key[0], family_label=g["label"],
                           stats=ArmStats.of(g["durations"], arm.total_ns), kv_dtypes=g["kv"], names=g["names"])
                for key, g in _groups(kernels, ["family"]).items()]
    segments.sort(key=lambda r: -r.stats.total_ns)
    families.sort(key=lambda r: -r.stats.total_ns)
    return Summary(arm=arm, recipes=tuple(recipes.files), segments=segments, families=families)


def _windowed(trace: Trace, recipes: RecipeSet, window: align.Window) -> pl.DataFrame:
    kernels = align.apply_window(trace, align.with_innermost_range(trace, classified_kernels(trace, recipes)), window)
    if kernels.height == 0:
        raise KvtraceError(f"{trace.info.source}: no kernels inside the window ({'; '.join(window.describe())}); "
                           "widen --window/--time/--phase")
    return kernels


def diff(baseline: Trace, candidate: Trace, recipes: RecipeSet, *, labels: tuple[str | None, str | None] = (None, None),
         threshold: float = 0.02, confidence: float = 0.95, seed: int = 0,
         window: align.Window = align.Window()) -> Diff:
    base_kernels = _windowed(baseline, recipes, window)
    cand_kernels = _windowed(candidate, recipes, window)
    base_arm = _arm(baseline, base_kernels, labels[0] or _default_label(baseline))
    cand_arm = _arm(candidate, cand_kernels, labels[1] or _default_label(candidate))
    context = _RowContext(base_arm.total_ns, cand_arm.total_ns, threshold, confidence, seed)

    family_matches = {}
    families = []
    for key in sorted(set(base_kernels["family"].unique()) | set(cand_kernels["family"].unique()), key=str):
        b = base_kernels.filter(pl.col("family") == key)
        c = cand_kernels.filter(pl.col("family") == key)
        family_matches[key] = match = align.match_family(b, c)
        row = context.row(b, c, match)
        row.family, row.family_label = key, (b if b.height else c)["family_label"][0]
        families.append(row)
    segments = []
    for segment in sorted(set(base_kernels["segment"].unique()) | set(cand_kernels["segment"].unique()),
                          key=_segment_order):
        b = base_kernels.filter(pl.col("segment") == segment)
        c = cand_kernels.filter(pl.col("segment") == segment)
        segments.append(context.row(b, c, _match_segment(b, c, lambda: _pooled(b, c, family_matches))))
    phases = []
    base_phased, cand_phased = _with_phase(base_kernels), _with_phase(cand_kernels)
    keys = set(base_phased.select("segment", "phase").drop_nulls().iter_rows()) | \
        set(cand_phased.select("segment", "phase").drop_nulls().iter_rows())
    for segment, phase in keys:
        b = base_phased.filter((pl.col("segment") == segment) & (pl.col("phase") == phase))
        c = cand_phased.filter((pl.col("segment") == segment) & (pl.col("phase") == phase))
        row = context.row(b, c, _match_segment(b, c, lambda: align.match_family(b, c)))
        row.phase = phase
        phases.append(row)
    for rows in (segments, families, phases):
        total = sum(r.total_delta_ns for r in rows)
        for r in rows:
            r.delta_share = stats.share(r.total_delta_ns, total)
        rows.sort(key=lambda r: (-abs(r.total_delta_ns), _segment_order(r.segment)))

    findings = comparability(base_arm, cand_arm) + _window_findings(window, families)
    findings += _step_findings(baseline, candidate, base_kernels, cand_kernels, base_arm, cand_arm)
    phases.sort(key=lambda r: (_segment_order(r.segment), _natural(r.phase)))
    return Diff(baseline=base_arm, candidate=cand_arm, recipes=tuple(recipes.files), threshold=threshold,
                confidence=confidence, findings=findings, segments=segments, families=families, phases=phases,
                window=window.describe())


def _natural(text: str) -> list:
    """Sort key that puts ctx=8192 before ctx=32768."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _with_phase(kernels: pl.DataFrame) -> pl.DataFrame:
    """`phase`: the innermost NVTX range, with vLLM's per-step ranges folded into their step kind."""
    # Parsed once per distinct range name, not per kernel.
    names = kernels.select("nvtx").unique()
    step = pl.col("nvtx").str.extract_groups(align.VLLM_STEP.pattern)
    context_requests, generation_requests = step.struct.field("1").cast(pl.Int64), step.struct.field("3").cast(pl.Int64)
    kind = (pl.when((generation_requests == 0) & (context_requests == 0)).then(pl.lit(f"vLLM {align.IDLE} steps"))
            .when(generation_requests == 0).then(pl.lit(f"vLLM {align.PREFILL} steps"))
            .when(context_requests == 0).then(pl.lit(f"vLLM {align.DECODE} steps"))
            .otherwise(pl.lit(f"vLLM {align.MIXED} steps")))
    names = names.with_columns(pl.when(context_requests.is_null()).then(pl.col("nvtx")).otherwise(kind).alias("phase"))
    return kernels.join(names, on="nvtx", how="left", nulls_equal=True, maintain_order="left")


def _match_segment(b: pl.DataFrame, c: pl.DataFrame, fallback) -> align.Match:
    """Pair a segment's calls NVTX range by range, even through different kernels (FP8 and NVFP4 append
    kernels differ by name and grid; so do vLLM's BF16 and FP8 prefill kernels): the calls of a range pair
    when both arms made as many there. Ranges with different counts are left out; when no range pairs,
    `fallback()` decides (the families' own pairing)."""
    if not (b.height and c.height):
        empty = np.zeros(0, dtype=np.int64)
        return align.Match(empty, empty, b.height, c.height, None,
                           f"only in the {'candidate' if b.height == 0 else 'baseline'}")
    counts = (b.group_by("nvtx").len().join(c.group_by("nvtx").len(), on="nvtx", how="full", coalesce=True,
                                            nulls_equal=True, suffix="_candidate")
              .with_columns(pl.col("len", "len_candidate").fill_null(0)))
    equal = counts.filter((pl.col("len") == pl.col("len_candidate")) & (pl.col("len") > 0))
    if equal.height == 0:
        return fallback()
    ranges = equal.select("nvtx")
    paired_b = b.join(ranges, on="nvtx", how="semi", nulls_equal=True)
    paired_c = c.join(ranges, on="nvtx", how="semi", nulls_equal=True)
    notes = []
    families_b, families_c = set(paired_b["family_label"]), set(paired_c["family_label"])
    if families_b != families_c:
        notes.append(f"different kernels: {', '.join(sorted(families_b - families_c))} vs "
                     f"{', '.join(sorted(families_c - families_b))}")
    if equal.height < counts.height:
        notes.append(f"paired the calls of {equal.height} NVTX range(s) both arms ran equally often; "
                     f"{b.height - paired_b.height} baseline and {c.height - paired_c.height} candidate calls in "
                     "other ranges left out")
    return align.Match(align.durations(paired_b), align.durations(paired_c), b.height, c.height,
                       "; ".join(notes) or None, None)


def _pooled(b: pl.DataFrame, c: pl.DataFrame, family_matches: dict) -> align.Match:
    """The calls a segment's families paired, pooled."""
    paired = [family_matches[k] for k in sorted(set(b["family"]) & set(c["family"])) if family_matches[k].matched]
    if not paired:
        empty = np.zeros(0, dtype=np.int64)
        return align.Match(empty, empty, b.height, c.height, None,
                           f"no calls pair across arms ({b.height} vs {c.height} calls in different NVTX ranges "
                           "or launch shapes)")
    compared = sum(len(m.baseline) for m in paired)
    return align.Match(np.concatenate([m.baseline for m in paired]), np.concatenate([m.candidate for m in paired]),
                       b.height, c.height,
                       f"compared the {compared} calls that {len(paired)} kernel "
                       f"famil{'y' if len(paired) == 1 else 'ies'} paired", None)


@dataclass
class _RowContext:
    base_total: int
    cand_total: int
    threshold: float
    confidence: float
    seed: int

    def row(self, b: pl.DataFrame, c: pl.DataFrame, match: align.Match) -> DiffRow:
        either = b if b.height else c
        info = {side: _group_info(frame) for side, frame in (("b", b), ("c", c))}
        base_total = int(b["duration"].sum()) if b.height else 0
        cand_total = int(c["duration"].sum()) if c.height else 0
        if match.matched:
            base_stats = ArmStats.of(match.baseline, self.base_total)
            cand_stats = ArmStats.of(match.candidate, self.cand_total)
        else:
            base_stats = ArmStats.of(b["duration"].to_numpy(), self.base_total) if b.height else None
            cand_stats = ArmStats.of(c["duration"].to_numpy(), self.cand_total) if c.height else None
        row = DiffRow(segment=either["segment"][0], baseline=base_stats, candidate=cand_stats,
                      baseline_calls=b.height, candidate_calls=c.height, baseline_total_ns=base_total,
                      candidate_total_ns=cand_total,
                      compared_calls=len(match.baseline) if match.matched else 0, ratio=None, ci_low=None,
                      ci_high=None, verdict=NOT_COMPARABLE, note=match.note, reason=match.reason,
                      total_delta_ns=cand_total - base_total, delta_share=None,
                      baseline_kv_dtypes=info["b"][0], candidate_kv_dtypes=info["c"][0],
                      baseline_names=info["b"][1], candidate_names=info["c"][1])
        if not match.matched:
            return row
        interval = stats.ratio_interval(match.baseline, match.candidate, confidence=self.confidence, seed=self.seed)
        row.ratio, row.ci_low, row.ci_high = interval.ratio, interval.low, interval.high
        row.verdict = stats.verdict(interval, threshold=self.threshold)
        return row


def _group_info(frame: pl.DataFrame) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if frame.height == 0:
        return (), ()
    return (tuple(frame["kv_dtype"].drop_nulls().unique().sort()), tuple(frame["demangled"].unique().sort()))


def _window_findings(window: align.Window, families: list[DiffRow]) -> list[Finding]:
    findings = [Finding("ok", "window", "compared " + part) for part in window.describe()]
    if not window.describe():
        findings.append(Finding("ok", "window", "compared whole traces (no --window, --time, --phase or trimming)"))
    realigned = [r for r in families if r.note and r.verdict != NOT_COMPARABLE]
    for r in realigned:
        findings.append(Finding("warning", "alignment", f"{r.family_label}: {r.note}; extra calls at the start "
                                "are usually warm-up (--skip-warmup), missing calls at the end a truncated arm"))
    unmatched = [r.family_label for r in families if r.reason and r.baseline_calls and r.candidate_calls]
    if unmatched:
        examples = ", ".join(unmatched[:3]) + (", …" if len(unmatched) > 3 else "")
        findings.append(Finding("warning", "alignment", f"{len(unmatched)} kernel famil"
                                f"{'y' if len(unmatched) == 1 else 'ies'} ran in both arms but in different NVTX "
                                f"ranges or launch shapes, so no calls pair ({examples}); the notes under the "
                                "tables say where"))
    return findings


def _step_findings(baseline: Trace, candidate: Trace, base_kernels: pl.DataFrame, cand_kernels: pl.DataFrame,
                   base_arm: Arm, cand_arm: Arm) -> list[Finding]:
    """vLLM step token counts must agree, or per-step kernel times describe different work (kekzl/imp#1816)."""
    steps = []
    for trace, kernels in ((baseline, base_kernels), (candidate, cand_kernels)):
        phases = align.step_phases(trace).join(kernels.select("kernel_row"), on="kernel_row", how="semi")
        steps.append(phases.unique("step_start").sort("step_start")["step"].to_list())
    if not steps[0] and not steps[1]:
        return []

    def describe(arm: Arm, names: list[str]) -> str:
        shown = ", ".join(names[:4]) + (f", … ({len(names)} steps)" if len(names) > 4 else "")
        return f"{arm.label}: {shown or 'none'}"

    if sorted(steps[0]) == sorted(steps[1]):
        return [Finding("ok", "steps", f"both arms ran the same {len(steps[0])} vLLM steps (same requests and "
                                       "token counts per step)")]
    return [Finding("warning", "steps", f"the arms scheduled different vLLM steps ({describe(base_arm, steps[0])}; "
                    f"{describe(cand_arm, steps[1])}): kernel times of different steps are not comparable, so "
                    "only calls in identical steps pair; re-record so that both arms schedule the same batches")]


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
                                    + (": the arms look swapped (baseline first, candidate second)" if swapped else
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
        return _schema_first(asdict(self))


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
