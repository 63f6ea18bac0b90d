"""Summaries of one trace and diffs of two, as plain result objects that every renderer reads.

Kernels are classified once per distinct signature (name, grid, block) and joined back; the window
(analyzer.align) picks which calls count; calls are paired across arms per kernel family and launch shape
before any ratio is formed. Per-call statistics, ratio intervals and verdicts come from analyzer.stats; this
module itself only adds up times and counts (totals, shares, the total-time ratio, the kernel list's means).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import polars as pl

from kvtrace import __version__
from kvtrace.analyzer import align, stats
from kvtrace.analyzer.classify import SEGMENTS, RecipeSet
from kvtrace.analyzer.load import Trace, TraceInfo
from kvtrace.errors import KvtraceError
from kvtrace.kv_formats import claimed_dtypes

SUMMARY_SCHEMA = "kvtrace.summary/1"
DIFF_SCHEMA = "kvtrace.diff/2"
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


def classify_signatures(trace: Trace, recipes: RecipeSet) -> pl.DataFrame:
    """The trace's distinct signatures with segment, family, family_label, kv_dtype and recipe."""
    return recipes.classify(trace.signatures)  # a few hundred rows: cheap to redo per analysis


@dataclass
class _Side:
    """One arm in the window: its calls grouped into cells (align.Cells) whose table carries codes of a
    vocabulary shared with the other arm, the classified signatures behind them, and the NVTX ranges the
    window's calls were launched in."""

    trace: Trace
    classes: pl.DataFrame
    cells: align.Cells
    ranges: pl.Series

    def sigs(self, cells: align.Cells) -> pl.DataFrame:
        """The classified signatures that a group of cells uses."""
        return self.classes.filter(pl.col("sig").is_in(cells.table["sig"].unique().implode()))

    def first(self, cells: align.Cells, column: str) -> str:
        """A classification column of the group's earliest call."""
        sig = cells.table.sort("first")["sig"][0]
        return self.classes.filter(pl.col("sig") == sig)[column][0]

    def info(self, cells: align.Cells) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The KV dtypes and demangled names of a group of cells."""
        if cells.table.height == 0:
            return (), ()
        sigs = self.sigs(cells)
        return tuple(sigs["kv_dtype"].drop_nulls().unique().sort()), tuple(sigs["demangled"].unique().sort())


@dataclass(frozen=True)
class _Codes:
    """Vocabulary for a comparison: match-key codes (align.Vocabulary) plus family, segment and phase codes."""

    vocabulary: align.Vocabulary
    families: tuple[str, ...]
    segments: tuple[str, ...]
    phases: tuple[str, ...]  # the last code (len(phases)) stands for calls outside every range
    phase_of_nvtx: np.ndarray

    @classmethod
    def of(cls, traces: list[Trace], classes: list[pl.DataFrame]) -> _Codes:
        families = sorted(set().union(*(set(c["family"]) for c in classes)))
        segments = sorted(set().union(*(set(c["segment"]) for c in classes)), key=_segment_order)
        vocabulary = align.Vocabulary.of(classes, [t.ranges["name"] for t in traces])
        phase_names = _phase_names(vocabulary.names)
        phases = tuple(sorted(set(phase_names)))
        phase_of_nvtx = np.array([phases.index(p) for p in phase_names] + [len(phases)], dtype=np.uint32)
        return cls(vocabulary, tuple(families), tuple(segments), phases, phase_of_nvtx)

    def side(self, trace: Trace, classes: pl.DataFrame, window: align.Window) -> _Side:
        by_sig = classes.sort("sig")
        family = np.searchsorted(self.families, by_sig["family"].to_numpy()).astype(np.uint32)
        segment = np.array([self.segments.index(s) for s in by_sig["segment"]], dtype=np.uint32)
        shape = self.vocabulary.shape_codes(by_sig)
        nvtx_of_range = self.vocabulary.name_codes(trace.ranges["name"])  # last entry: outside every range
        calls = trace.kernels.with_columns(pl.Series("nvtx", nvtx_of_range[trace.kernels["range"].to_numpy()]))
        if window.skip_warmup or window.last is not None:  # trimming counts calls per family and match key
            sig = calls["sig"].to_numpy()
            calls = calls.with_columns(pl.Series("family", family[sig]), pl.Series("shape", shape[sig]))
        calls = align.apply_window(trace, calls, window)
        if calls.height == 0:
            raise KvtraceError(f"{trace.info.source}: no kernels inside the window "
                               f"({'; '.join(window.describe())}); widen --window/--time/--phase")
        cells = align.Cells.of(calls)
        sig, nvtx = cells.table["sig"].to_numpy(), cells.table["nvtx"].to_numpy()
        cells = replace(cells, table=cells.table.with_columns(
            pl.Series("family", family[sig]), pl.Series("segment", segment[sig]), pl.Series("shape", shape[sig]),
            pl.Series("phase", self.phase_of_nvtx[nvtx])))
        return _Side(trace, classes, cells, calls["range"].unique())


def _phase_names(names: tuple[str, ...]) -> list[str]:
    """Per range name, its phase: the name itself, or for vLLM's per-step ranges their step kind."""
    named = pl.DataFrame({"nvtx": pl.Series(names, dtype=pl.Utf8)})
    step = pl.col("nvtx").str.extract_groups(align.VLLM_STEP.pattern)
    context, generation = step.struct.field("1").cast(pl.Int64), step.struct.field("3").cast(pl.Int64)
    kind = pl.format("vLLM {} steps", align.step_kind(context, generation))
    return named.select(pl.when(context.is_null()).then(pl.col("nvtx")).otherwise(kind))["nvtx"].to_list()


def _segment_order(segment: str) -> int:
    return SEGMENTS.index(segment) if segment in SEGMENTS else len(SEGMENTS)


def _arm(side: _Side, label: str) -> Arm:
    kv = side.sigs(side.cells).filter(pl.col("segment").is_in(KV_SEGMENTS))["kv_dtype"].drop_nulls().unique().sort()
    return Arm(label=label, info=side.trace.info, total_ns=side.cells.total_ns, kv_dtypes=tuple(kv))


def _codes_in(cells: align.Cells, *columns: str) -> set:
    return set(cells.table.select(columns).unique().iter_rows())


def summarize(trace: Trace, recipes: RecipeSet, label: str | None = None,
              window: align.Window = align.Window()) -> Summary:
    classes = classify_signatures(trace, recipes)
    codes = _Codes.of([trace], [classes])
    side = codes.side(trace, classes, window)
    arm = _arm(side, label or _default_label(trace))
    segments, families = [], []
    for (code,) in _codes_in(side.cells, "segment"):
        cells = side.cells.where(pl.col("segment") == code)
        kv, names = side.info(cells)
        segments.append(SummaryRow(segment=codes.segments[code], stats=ArmStats.of(cells.values(), arm.total_ns),
                                   kv_dtypes=kv, names=names))
    for (code,) in _codes_in(side.cells, "family"):
        cells = side.cells.where(pl.col("family") == code)
        kv, names = side.info(cells)
        families.append(SummaryRow(segment=side.first(cells, "segment"), family=codes.families[code],
                                   family_label=side.first(cells, "family_label"),
                                   stats=ArmStats.of(cells.values(), arm.total_ns), kv_dtypes=kv, names=names))
    segments.sort(key=lambda r: -r.stats.total_ns)
    families.sort(key=lambda r: -r.stats.total_ns)
    return Summary(arm=arm, recipes=tuple(recipes.files), segments=segments, families=families)


def segment_durations(trace: Trace, recipes: RecipeSet, window: align.Window, segments: tuple[str, ...]
                      ) -> dict[str, np.ndarray]:
    """Per-call durations of the given segments in the window, sorted (for ECDFs)."""
    classes = classify_signatures(trace, recipes)
    codes = _Codes.of([trace], [classes])
    cells = codes.side(trace, classes, window).cells
    out = {}
    for segment in segments:
        if segment in codes.segments:
            values = cells.where(pl.col("segment") == codes.segments.index(segment)).values()
            if values.size:
                out[segment] = np.sort(values.astype(np.int64))
    return out


def diff(baseline: Trace, candidate: Trace, recipes: RecipeSet, *, labels: tuple[str | None, str | None] = (None, None),
         threshold: float = 0.02, confidence: float = 0.95, seed: int = 0,
         window: align.Window = align.Window()) -> Diff:
    classes = [classify_signatures(t, recipes) for t in (baseline, candidate)]
    codes = _Codes.of([baseline, candidate], classes)
    base, cand = (codes.side(t, c, window) for t, c in zip((baseline, candidate), classes))
    base_arm = _arm(base, labels[0] or _default_label(baseline))
    cand_arm = _arm(cand, labels[1] or _default_label(candidate))
    context = _RowContext(base, cand, base_arm.total_ns, cand_arm.total_ns, threshold, confidence, seed)

    family_matches = {}
    families = []
    for (code,) in sorted(_codes_in(base.cells, "family") | _codes_in(cand.cells, "family"),
                          key=lambda k: codes.families[k[0]]):
        b, c = (side.cells.where(pl.col("family") == code) for side in (base, cand))
        family_matches[code] = match = align.match_family(b, c, codes.vocabulary)
        row = context.row(b, c, match)
        row.family, row.family_label = codes.families[code], context.first(b, c, "family_label")
        families.append(row)
    segments = []
    for (code,) in sorted(_codes_in(base.cells, "segment") | _codes_in(cand.cells, "segment")):
        b, c = (side.cells.where(pl.col("segment") == code) for side in (base, cand))
        segments.append(context.row(b, c, context.match_segment(b, c, lambda: _pooled(b, c, family_matches))))
    phases = []
    outside = len(codes.phases)
    for segment, phase in sorted(k for k in _codes_in(base.cells, "segment", "phase") |
                                 _codes_in(cand.cells, "segment", "phase") if k[1] != outside):
        b, c = (side.cells.where((pl.col("segment") == segment) & (pl.col("phase") == phase)) for side in (base, cand))
        row = context.row(b, c, context.match_segment(b, c, lambda: align.match_family(b, c, codes.vocabulary)))
        row.phase = codes.phases[phase]
        phases.append(row)
    for rows in (segments, families, phases):
        total = sum(r.total_delta_ns for r in rows)
        for r in rows:
            r.delta_share = stats.share(r.total_delta_ns, total)
        rows.sort(key=lambda r: (-abs(r.total_delta_ns), _segment_order(r.segment)))

    findings = comparability(base_arm, cand_arm) + _window_findings(window, families)
    findings += _step_findings(base, cand, base_arm, cand_arm)
    phases.sort(key=lambda r: (_segment_order(r.segment), _natural(r.phase)))
    return Diff(baseline=base_arm, candidate=cand_arm, recipes=tuple(recipes.files), threshold=threshold,
                confidence=confidence, findings=findings, segments=segments, families=families, phases=phases,
                window=window.describe())


def _natural(text: str) -> list:
    """Sort key that puts ctx=8192 before ctx=32768."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _pooled(b: align.Cells, c: align.Cells, family_matches: dict) -> align.Match:
    """The calls a segment's families paired, pooled."""
    shared = sorted(_codes_in(b, "family") & _codes_in(c, "family"))
    paired = [family_matches[k] for (k,) in shared if family_matches[k].matched]
    if not paired:
        empty = np.zeros(0, dtype=np.int64)
        return align.Match(empty, empty, b.calls, c.calls, None,
                           f"no calls pair across arms ({b.calls} vs {c.calls} calls in different NVTX ranges "
                           "or launch shapes)")
    compared = sum(len(m.baseline) for m in paired)
    return align.Match(np.concatenate([m.baseline for m in paired]), np.concatenate([m.candidate for m in paired]),
                       b.calls, c.calls,
                       f"compared the {compared} calls that {len(paired)} kernel "
                       f"famil{'y' if len(paired) == 1 else 'ies'} paired", None)


@dataclass
class _RowContext:
    base: _Side
    cand: _Side
    base_total: int  # all calls of the arm in the window
    cand_total: int
    threshold: float
    confidence: float
    seed: int

    def first(self, b: align.Cells, c: align.Cells, column: str) -> str:
        return self.base.first(b, column) if b.table.height else self.cand.first(c, column)

    def match_segment(self, b: align.Cells, c: align.Cells, fallback) -> align.Match:
        """Pair a segment's calls NVTX range by range, even through different kernels (FP8 and NVFP4 append
        kernels differ by name and grid; so do vLLM's BF16 and FP8 prefill kernels): the calls of a range
        pair when both arms made as many there. Ranges with different counts are left out; when no range
        pairs, `fallback()` decides (the families' own pairing)."""
        nb, nc = b.calls, c.calls
        if not (nb and nc):
            empty = np.zeros(0, dtype=np.int64)
            return align.Match(empty, empty, nb, nc, None, f"only in the {'candidate' if nb == 0 else 'baseline'}")
        counts = (b.counts(["nvtx"]).join(c.counts(["nvtx"]), on="nvtx", how="full", coalesce=True,
                                          suffix="_candidate")
                  .with_columns(pl.col("len", "len_candidate").fill_null(0)))
        equal = counts.filter((pl.col("len") == pl.col("len_candidate")) & (pl.col("len") > 0))
        if equal.height == 0:
            return fallback()
        paired_b, paired_c = (cells.where(pl.col("nvtx").is_in(equal["nvtx"].implode())) for cells in (b, c))
        notes = []
        families_b = set(self.base.sigs(paired_b)["family_label"])
        families_c = set(self.cand.sigs(paired_c)["family_label"])
        if families_b != families_c:
            notes.append(f"different kernels: {', '.join(sorted(families_b - families_c))} vs "
                         f"{', '.join(sorted(families_c - families_b))}")
        if equal.height < counts.height:
            notes.append(f"paired the calls of {equal.height} NVTX range(s) both arms ran equally often; "
                         f"{nb - paired_b.calls} baseline and {nc - paired_c.calls} candidate calls "
                         "in other ranges left out")
        return align.Match(paired_b.values(), paired_c.values(), nb, nc, "; ".join(notes) or None, None)

    def row(self, b: align.Cells, c: align.Cells, match: align.Match) -> DiffRow:
        info_b, info_c = self.base.info(b), self.cand.info(c)
        base_calls, cand_calls = b.calls, c.calls
        base_total, cand_total = b.total_ns, c.total_ns
        if match.matched:
            base_stats = ArmStats.of(match.baseline, self.base_total)
            cand_stats = ArmStats.of(match.candidate, self.cand_total)
        else:
            base_stats = ArmStats.of(b.values(), self.base_total) if base_calls else None
            cand_stats = ArmStats.of(c.values(), self.cand_total) if cand_calls else None
        row = DiffRow(segment=self.first(b, c, "segment"), baseline=base_stats, candidate=cand_stats,
                      baseline_calls=base_calls, candidate_calls=cand_calls, baseline_total_ns=base_total,
                      candidate_total_ns=cand_total,
                      compared_calls=len(match.baseline) if match.matched else 0, ratio=None, ci_low=None,
                      ci_high=None, verdict=NOT_COMPARABLE, note=match.note, reason=match.reason,
                      total_delta_ns=cand_total - base_total, delta_share=None,
                      baseline_kv_dtypes=info_b[0], candidate_kv_dtypes=info_c[0],
                      baseline_names=info_b[1], candidate_names=info_c[1])
        if not match.matched:
            return row
        interval = stats.ratio_interval(match.baseline, match.candidate, confidence=self.confidence, seed=self.seed)
        row.ratio, row.ci_low, row.ci_high = interval.ratio, interval.low, interval.high
        row.verdict = stats.verdict(interval, threshold=self.threshold)
        return row


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


def _step_findings(base: _Side, cand: _Side, base_arm: Arm, cand_arm: Arm) -> list[Finding]:
    """vLLM step token counts must agree, or per-step kernel times describe different work (kekzl/imp#1816)."""
    steps = []
    for side in (base, cand):
        found = align.steps(side.trace).filter(pl.col("range").is_in(side.ranges.implode()))
        steps.append(found.unique("step_range").sort("step_start", "step_range")["step"].to_list())
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


def _dtype_findings(baseline: Arm, candidate: Arm) -> list[Finding]:
    findings = []
    for arm in (baseline, candidate):
        seen = ", ".join(arm.kv_dtypes) or "none detected"
        findings.append(Finding("ok", "kv-dtype", f"{arm.label}: KV cache dtype in kernel names: {seen}"))
    if baseline.kv_dtypes and baseline.kv_dtypes == candidate.kv_dtypes:
        findings.append(Finding("warning", "kv-dtype", "both arms ran the same KV dtype "
                                f"({', '.join(baseline.kv_dtypes)}): this compares runs, not formats"))

    for arm, other in ((baseline, candidate), (candidate, baseline)):
        claimed = claimed_dtypes(arm.label)
        # A label naming the other arm's dtype but not its own is the swapped-arms signature.
        if claimed and arm.kv_dtypes and not claimed & set(arm.kv_dtypes):
            swapped = claimed_dtypes(other.label) & set(arm.kv_dtypes)
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
    classes = classify_signatures(trace, recipes)
    per_sig = trace.kernels.group_by("sig").agg(pl.len().alias("calls"), pl.col("duration").sum().alias("total_ns"))
    total_ns = int(per_sig["total_ns"].sum())
    kv = classes.filter(pl.col("segment").is_in(KV_SEGMENTS))["kv_dtype"].drop_nulls().unique().sort()
    arm = Arm(label=label or _default_label(trace), info=trace.info, total_ns=total_ns, kv_dtypes=tuple(kv))
    kernels = per_sig.join(classes, on="sig")
    if unclassified:
        kernels = kernels.filter(pl.col("recipe").is_null())
    if segment:
        kernels = kernels.filter(pl.col("segment") == segment)
    table = (kernels.sort("sig").group_by("demangled", maintain_order=True)
             .agg(pl.col("segment").first(), pl.col("recipe").first(), pl.col("family_label").first(),
                  pl.col("kv_dtype").first(), pl.col("calls").sum(), pl.col("total_ns").sum())
             .with_columns((pl.col("total_ns") / pl.col("calls")).alias("mean_ns"),
                           (pl.col("total_ns") / arm.total_ns).alias("share"))
             .sort("total_ns", descending=True, maintain_order=True)
             .select("segment", "family_label", "kv_dtype", "calls", "total_ns", "mean_ns", "share", "recipe",
                     "demangled"))
    return KernelList(arm=arm, recipes=tuple(recipes.files), only_unclassified=unclassified,
                      rows=table.to_dicts())
