"""The serving report: the kernel diff of two arms beside the serving metrics their run directories recorded.

Choosing a KV format needs both kinds of number side by side, kept apart: prefill pays the conversion and
may gain prefix hits, decode repeatedly saves bytes, append pays the packing bill, and capacity is not
latency. `build()` resolves two arms (analyzer/runs), classifies and windows their traces once
(compare.Sides: every run of each arm) for the diff and the ECDF durations, reads their serving metrics
(analyzer/serving), adds bandwidth, prefill compute (analyzer/roofline), capacity, findings about the runs and
what the numbers say (analyzer/statements), and returns one Report that every renderer and the plots read.

Nothing here re-reads SQL: kernel numbers come from the Diff, per-call durations (for the ECDF plots) from
analyzer.compare/align, serving numbers from the manifests as the capture engines wrote them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtrace import __version__
from kvtrace.analyzer import align, budget_trace, capacity, compare, pairing, quality as quality_lib, roofline, steps, verify
from kvtrace.analyzer import repro as repro_lib
from kvtrace.analyzer.classify import RecipeSet
from kvtrace.analyzer.results import Diff, Finding
from kvtrace.analyzer.load import open_traces
from kvtrace.analyzer.runs import ArmInput, RunArm, left_out_note, resolve_inputs, run_arm
from kvtrace.analyzer.serving import ServingRow, serving_rows
from kvtrace.analyzer.statements import Statement, statements
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.errors import KvtraceError
from kvtrace.manifest import Phase, parse_phase_name

REPORT_SCHEMA = "kvtrace.report/4"
# Segments whose per-call durations the report keeps for the ECDF plots.
DISTRIBUTION_SEGMENTS = ("prefill_attention", "decode_attention")
# FlashInfer workload phases (kvtrace.manifest.phase_name) bound by memory bandwidth; prefill is compute-bound
# (analyzer/roofline). pairing.PHASE_SEGMENTS names the segment whose kernels do each phase's KV work.
BANDWIDTH_PHASES = ("decode", "append")


# ---- result --------------------------------------------------------------------------------------------

@dataclass
class SegmentTime:
    """Each arm's GPU time in a segment's paired calls, with the diff's bootstrap interval, and the per-call
    mean where the segment's cells cost the same per call (else None: a pooled mean of different work)."""

    segment: str
    compared_calls: int
    cells: int
    baseline_total_ns: float | None
    baseline_ci_low: float | None
    baseline_ci_high: float | None
    baseline_mean_ns: float | None
    candidate_total_ns: float | None
    candidate_ci_low: float | None
    candidate_ci_high: float | None
    candidate_mean_ns: float | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    band: float | None  # the row's no-change band (DiffRow.band)
    verdict: Verdict


@dataclass
class BandwidthRow:
    """KV bytes one workload call moves / the GPU time of its segment's kernels per call, per arm."""

    phase: str  # the NVTX range
    kind: str  # prefill, decode, append
    segment: str
    context: int | None
    baseline_calls: int | None
    candidate_calls: int | None
    baseline_bytes_per_call: int | None
    candidate_bytes_per_call: int | None
    baseline_ns_per_call: float | None
    candidate_ns_per_call: float | None
    baseline_bytes_per_s: float | None
    candidate_bytes_per_s: float | None
    baseline_fraction_of_ceiling: float | None
    candidate_fraction_of_ceiling: float | None


@dataclass
class Ceiling:
    gpu: str
    bytes_per_s: int
    source: str


@dataclass
class PlotFile:
    kind: str  # summary, forest, context, ecdf, segment-times, segment-ratios, bandwidth, sweep
    title: str  # what the plot shows
    path: str  # as written
    link: str  # relative to the report file (or the working directory when printed)
    heading: str = ""  # the figure's own title: the arms, the GPU and the versions
    panels: tuple[str, ...] = ()  # its panels' titles


@dataclass
class Report:
    baseline: RunArm
    candidate: RunArm
    diff: Diff
    statements: list[Statement]
    findings: list[Finding]  # comparability of the two runs beyond the kernel diff's own findings
    segment_times: list[SegmentTime]
    serving: list[ServingRow]
    sweep: bool
    bandwidth: list[BandwidthRow]
    hbm_ceiling: Ceiling | None
    prefill_compute: list[roofline.PrefillCompute]
    compute_ceiling: roofline.ComputeCeiling | None
    capacity: capacity.Capacity | None
    # The arms' identical vLLM steps per phase on the GPU: kernel time, span, time with no kernel running (steps).
    step_timeline: list[steps.StepPhase] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    left_out: str | None = None  # a --repeats capture cut short: the runs left out (analyzer.runs.left_out_note)
    plots: list[PlotFile] = field(default_factory=list)  # set by the caller that wrote them (render.plots)
    # Per-call durations (ns, sorted) per cell (segment, phase, family label) and arm, for the ECDF plots; not in
    # the JSON.
    durations: dict = field(default_factory=dict, repr=False)
    quality: quality_lib.Quality | None = None  # quality beside speed (analyzer/quality)
    # The run directories' `kvtrace repro` results: the traced ratio split into route x format (analyzer/repro)
    repro: list[repro_lib.ReproSplit] = field(default_factory=list)
    schema: str = REPORT_SCHEMA
    kvtrace_version: str = __version__

    def to_dict(self) -> dict:
        data = {"schema": self.schema, "kvtrace_version": self.kvtrace_version}
        for name in ("baseline", "candidate"):
            data[name] = asdict(getattr(self, name))
        data["diff"] = self.diff.to_dict()
        data["statements"] = [{"kind": s.kind, **asdict(s)} for s in self.statements]
        for name in ("findings", "segment_times", "serving"):
            data[name] = [asdict(row) for row in getattr(self, name)]
        data["sweep"] = self.sweep
        data["bandwidth"] = [asdict(row) for row in self.bandwidth]
        data["hbm_ceiling"] = asdict(self.hbm_ceiling) if self.hbm_ceiling else None
        data["prefill_compute"] = [asdict(row) for row in self.prefill_compute]
        data["compute_ceiling"] = asdict(self.compute_ceiling) if self.compute_ceiling else None
        data["flops_convention"] = roofline.CAUSAL_CONVENTION
        data["capacity"] = self.capacity.to_dict() if self.capacity else None
        data["step_timeline"] = [asdict(row) for row in self.step_timeline]
        data["notes"] = list(self.notes)
        data["left_out"] = self.left_out
        data["plots"] = [asdict(p) for p in self.plots]
        data["quality"] = self.quality.to_dict() if self.quality else None
        data["repro"] = [asdict(split) for split in self.repro]
        return data


# ---- kernels: means, distributions, bandwidth ---------------------------------------------------------

def segment_times(diff: Diff) -> list[SegmentTime]:
    """The diff's segment rows as paired time per arm (the intervals come from analyzer.stats through the diff)."""
    rows = []
    for row in sorted(diff.segments, key=lambda r: pairing.segment_order(r.segment)):
        base, cand = (row.baseline, row.candidate) if row.ratio is not None else (None, None)
        rows.append(SegmentTime(
            segment=row.segment, compared_calls=row.compared_calls, cells=row.cells,
            baseline_total_ns=base and base.total_ns, baseline_ci_low=base and base.total_low_ns,
            baseline_ci_high=base and base.total_high_ns, baseline_mean_ns=base and base.mean_ns,
            candidate_total_ns=cand and cand.total_ns, candidate_ci_low=cand and cand.total_low_ns,
            candidate_ci_high=cand and cand.total_high_ns, candidate_mean_ns=cand and cand.mean_ns,
            ratio=row.ratio, ci_low=row.ci_low, ci_high=row.ci_high, band=row.band, verdict=row.verdict))
    return rows


def bandwidth_rows(diff: Diff, base: ArmInput, cand: ArmInput, ceiling: Ceiling | None) -> list[BandwidthRow]:
    """FlashInfer workload phases with KV bytes per call: achieved bytes/s of the phase's segment kernels."""
    phases: dict[str, dict[str, Phase]] = {}
    for side, item in (("baseline", base), ("candidate", cand)):
        for phase in item.record.phases:
            if phase.kind in BANDWIDTH_PHASES and phase.bytes_per_call:
                phases.setdefault(phase.nvtx, {})[side] = phase
    totals = {(r.segment, r.phase): r for r in diff.phases}
    rows = []
    for nvtx, sides in phases.items():
        kind, context = parse_phase_name(nvtx)
        segment = pairing.PHASE_SEGMENTS[kind]
        diff_row = totals.get((segment, nvtx))
        values = {}
        for side in ("baseline", "candidate"):
            phase = sides.get(side)
            total = getattr(diff_row, f"{side}_total_ns") if diff_row else 0
            if phase is None or not total or not phase.calls:
                values[side] = (phase and phase.calls, phase and phase.bytes_per_call, None, None, None)
                continue
            per_call = total / (phase.calls * diff.runs)  # the diff sums the runs
            rate = phase.bytes_per_call / (per_call / 1e9)
            values[side] = (phase.calls, phase.bytes_per_call, per_call, rate,
                            rate / ceiling.bytes_per_s if ceiling else None)
        b, c = values["baseline"], values["candidate"]
        rows.append(BandwidthRow(phase=nvtx, kind=kind, segment=segment, context=context, baseline_calls=b[0],
                                 candidate_calls=c[0], baseline_bytes_per_call=b[1], candidate_bytes_per_call=c[1],
                                 baseline_ns_per_call=b[2], candidate_ns_per_call=c[2], baseline_bytes_per_s=b[3],
                                 candidate_bytes_per_s=c[3], baseline_fraction_of_ceiling=b[4],
                                 candidate_fraction_of_ceiling=c[4]))
    order = list(BANDWIDTH_PHASES)
    rows.sort(key=lambda r: (order.index(r.kind), r.context or 0))
    return rows


def hbm_ceiling(diff: Diff) -> Ceiling | None:
    gpus = [g for g in diff.baseline.info.gpus if g.memory_bandwidth]
    if not gpus:
        return None
    gpu = gpus[0]
    return Ceiling(gpu=gpu.name, bytes_per_s=int(gpu.memory_bandwidth),
                   source=f"memoryBandwidth of {gpu.name} in the baseline trace's TARGET_INFO_GPU table, as Nsight "
                          "Systems reports the device's peak DRAM bandwidth (a datasheet ceiling, not a measurement)")


def _points_finding(b: RunArm, c: RunArm, serving: list[ServingRow]) -> Finding:
    """Which traffic points both arms ran. A sweep arm recorded on its own may stop a context length at its own
    capacity before the other arm does."""
    only = {side: [row for row in serving if getattr(row, side) and not getattr(row, other)]
            for side, other in (("baseline", "candidate"), ("candidate", "baseline"))}
    both = len(serving) - len(only["baseline"]) - len(only["candidate"])
    if not only["baseline"] and not only["candidate"]:
        return Finding("ok", "settings", "both arms ran the same traffic point" if both == 1 else
                       f"both arms ran the same {both} traffic points")
    parts = []
    for side, arm, other_side, other in (("baseline", b, "candidate", c), ("candidate", c, "baseline", b)):
        if not only[side]:
            continue
        stopped = [row.point for row in only[side] if any(
            r.context == row.context and (r.concurrency or 0) < (row.concurrency or 0)
            and getattr(r, other_side) and getattr(r, other_side).capacity for r in serving)]
        parts.append(f"only {arm.label} ran {', '.join(row.point for row in only[side])}"
                     + (f" ({other.label} had reached capacity at a lower concurrency of that context length)"
                        if len(stopped) == len(only[side]) else ""))
    return Finding("warning", "settings", f"the arms share {both} traffic point{'s' if both != 1 else ''}; "
                   + "; ".join(parts) + ": those rows have one arm only")


def _request_finding(base: ArmInput, cand: ArmInput) -> Finding | None:
    """Same requests in the same order: per traffic point both arms ran (each point's hash), else per arm."""
    if base.run == cand.run and base.manifest.request_order_matched is not None:
        same = base.manifest.request_order_matched
    else:
        hashes = [{p["point"]: p.get("request_order_sha256") for p in item.record.points if p.get("point")}
                  for item in (base, cand)]
        common = [spec for spec in hashes[0] if spec in hashes[1] and hashes[0][spec] and hashes[1][spec]]
        arms = (base.record.request_order_sha256, cand.record.request_order_sha256)
        if common:
            same = all(hashes[0][spec] == hashes[1][spec] for spec in common)
        elif all(arms):
            same = arms[0] == arms[1]
        else:
            return None
    return Finding("ok" if same else "warning", "requests",
                   "both arms saw the same requests in the same order" if same else
                   "the arms' request orders differ: serving metrics compare different traffic")


def _capture_finding(base: ArmInput, cand: ArmInput, b: RunArm, c: RunArm) -> Finding | None:
    """Two run directories are two captures: whatever drifted between them (clocks, temperature, the machine)
    rides on the arm."""
    if base.run == cand.run:
        return None
    times = [item.manifest.raw.get("created_utc") for item in (base, cand)]
    gpus = [[g.get("uuid") for g in (item.manifest.raw.get("environment") or {}).get("gpus") or []
             if isinstance(g, dict)] for item in (base, cand)]
    when = f" ({times[0]} and {times[1]})" if all(isinstance(t, str) for t in times) else ""
    where = (" on the same GPU" if gpus[0] and gpus[0] == gpus[1] else
             " on different GPUs" if gpus[0] and gpus[1] else "")
    return Finding("warning", "capture", f"{b.label} and {c.label} come from separate captures{when}{where}: drift "
                   "between the captures is not separated from the arm (record both arms in one capture, with "
                   "--repeats, to separate them)")


def _run_findings(base: ArmInput, cand: ArmInput, report_base: RunArm, report_cand: RunArm,
                  serving: list[ServingRow]) -> list[Finding]:
    findings = []
    engines = (report_base.engine, report_cand.engine)
    findings.append(Finding("ok" if engines[0] == engines[1] else "warning", "engine",
                            f"engine {engines[0]}" if engines[0] == engines[1] else
                            f"different capture engines: {engines[0]} vs {engines[1]}"))
    if base.run != cand.run:
        b_set, c_set = base.manifest.settings, cand.manifest.settings
        for key in ("scenario", "mode", "spec"):
            if key in b_set or key in c_set:
                same = b_set.get(key) == c_set.get(key)
                findings.append(Finding("ok" if same else "warning", "settings",
                                        f"same {key} in both runs" if same else
                                        f"{key} differs between the runs: {b_set.get(key)} vs {c_set.get(key)}"))
    if serving:
        findings.append(_points_finding(report_base, report_cand, serving))
    findings += [f for f in (_request_finding(base, cand), _capture_finding(base, cand, report_base, report_cand))
                 if f is not None]
    return findings


def _capacity(base: ArmInput, cand: ArmInput, b: RunArm, c: RunArm, notes: list[str]) -> capacity.Capacity | None:
    try:
        layout, tp, page = capacity.run_shape(base.manifest, str(base.run))
    except KvtraceError as error:
        notes.append(f"capacity: {error}")
        return None
    try:
        result = capacity.capacity(layout, [(b.label, b.kv_cache_dtype or b.arm), (c.label, c.kv_cache_dtype or c.arm)],
                                   tp=tp, page_size=page)
    except KvtraceError as error:
        notes.append(f"capacity: {error}")
        return None
    rows = [capacity.measured_arm(item.arm, item.record, layout, tp, page) for item in (base, cand)]
    if all(rows):
        for row, label in zip(rows, (b.label, c.label)):
            row.arm = label
        result.measured = rows
        result.notes += capacity.link_measured(rows, layout, tp)
    elif base.manifest.engine != "vllm":
        result.notes.append(f"no measured capacity: the {base.manifest.engine} engine allocates no serving "
                            "KV pool")
    result.run = str(base.run)
    return result


def build(paths: list[Path], recipes: RecipeSet, *, arms: tuple[str, ...] = (), labels: tuple[str, ...] = (),
          threshold: float = 0.02, confidence: float = 0.95, seed: int = 0, window: align.Window = align.Window(),
          nsys: str | None = None, cache: bool = True, verify_with: str | None = None, step=None,
          exports_from: tuple[Path, ...] | None = None) -> Report:
    """`verify_with`: an nsys binary to check every trace's per-kernel totals with (analyzer.verify); `step`
    hears which report and step runs (analyzer.load.open_traces); `exports_from`: analyzer.runs.resolve_inputs'."""
    base, cand = resolve_inputs(paths, arms, exports_from)
    if labels and len(labels) != 2:
        raise KvtraceError("--label takes two names, baseline first: --label fp8 --label nvfp4")
    if not labels:
        labels = (base.arm, cand.arm)
        if base.arm == cand.arm:
            labels = (f"{base.run.name}/{base.arm}", f"{cand.run.name}/{cand.arm}")
            if labels[0] == labels[1]:
                raise KvtraceError(f"baseline and candidate are the same arm ({base.run}/{base.arm}): pick another")
    b_arm, c_arm = run_arm(base, labels[0]), run_arm(cand, labels[1])
    traces = open_traces([*b_arm.runs, *c_arm.runs], nsys=nsys, cache=cache, step=step)
    b_traces, c_traces = traces[:len(b_arm.runs)], traces[len(b_arm.runs):]
    sides = compare.Sides.of(b_traces, c_traces, recipes, window)
    diff = compare.diff_sides(sides, labels=tuple(labels), threshold=threshold, confidence=confidence, seed=seed)
    if verify_with is not None:
        verify.attach(diff, traces, recipes, verify_with)
    durations = {}
    for side, runs in (("baseline", sides.baseline), ("candidate", sides.candidate)):
        for cell, values in compare.cell_durations(sides.vocabulary, runs, DISTRIBUTION_SEGMENTS).items():
            durations.setdefault(cell, {})[side] = values
    notes: list[str] = []
    if len(b_traces) > 1:
        notes.append(f"{len(b_traces)} runs per arm: kernel numbers and serving intervals cover every run; the other "
                     "serving metrics and capacity are the first run's")
    serving = serving_rows(base, cand, threshold=threshold, confidence=confidence, seed=seed)
    read = {Path(run.trace.info.source).resolve(): (run.trace, run.classes) for run in (*sides.baseline, *sides.candidate)}
    budget_trace.cover_points(serving, base, cand, read, recipes, nsys=nsys, cache=cache)
    if not serving:
        engines = {b_arm.engine, c_arm.engine}
        notes.append("no serving metrics: " + ("the FlashInfer engine calls kernels directly (no requests, TTFT or "
                                               "throughput)" if engines == {"flashinfer"} else
                                               "the manifests record no traffic points"))
    sweep = any(item.manifest.scenario == "sweep" for item in (base, cand)) or len(serving) > 1
    ceiling = hbm_ceiling(diff)
    bandwidth = []
    if window.describe():
        notes.append("achieved bandwidth needs whole workload phases: not computed inside a --window/--time/--phase "
                     "or with trimming")
    else:
        bandwidth = bandwidth_rows(diff, base, cand, ceiling)
        if not bandwidth:
            notes.append("no achieved bandwidth: the manifests give no KV bytes per call (the FlashInfer engine's "
                         "workload phases do)")
    gpus = diff.baseline.info.gpus
    compute_ceiling = roofline.compute_ceiling(gpus[0].name) if gpus else None
    prefill_compute = []
    if base.manifest.engine == "vllm":
        row = roofline.vllm_row(sides, base.manifest, compute_ceiling)
        prefill_compute = [row] if row is not None else []
    elif not window.describe():
        prefill_compute = roofline.flashinfer_rows(diff, (base.manifest, cand.manifest),
                                                   (base.record.phases, cand.record.phases), compute_ceiling)
    cap = _capacity(base, cand, b_arm, c_arm, notes)
    # Whole steps only: a window can cut a step's kernels apart.
    step_timeline = [] if window.describe() else steps.compare(sides.baseline, sides.candidate, threshold=threshold,
                                                               confidence=confidence, seed=seed)
    return Report(baseline=b_arm, candidate=c_arm, diff=diff,
                  statements=statements(diff, serving, cap, b_arm, c_arm, step_timeline), step_timeline=step_timeline,
                  findings=_run_findings(base, cand, b_arm, c_arm, serving), segment_times=segment_times(diff),
                  serving=serving, sweep=sweep, bandwidth=bandwidth, hbm_ceiling=ceiling,
                  prefill_compute=prefill_compute, compute_ceiling=compute_ceiling, capacity=cap, notes=notes,
                  left_out=left_out_note(base, cand), durations=durations, quality=quality_lib.build(base, cand, tuple(labels)),
                  repro=repro_lib.splits(sorted({base.run, cand.run}), diff, base.manifest.engine))
