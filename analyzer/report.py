"""The serving report: the kernel diff of two arms beside the serving metrics their run directories recorded.

Choosing a KV format needs both kinds of number side by side, kept apart: prefill pays the conversion and
may gain prefix hits, decode repeatedly saves bytes, append pays the packing bill, and capacity is not
latency. `build()` reads two arms' manifests (kvtrace.manifest's format: `arms.{run}.{arm, repeat, status,
sqlite, workload, ...}`; the vLLM engine adds `kv_cache` and per-point `bench` and `metrics`), diffs their
traces (every run of each arm) with analyzer.compare, and returns one Report that every renderer and the
plots read.

Nothing here re-reads SQL: kernel numbers come from the Diff, per-call durations (for the ECDF plots) from
analyzer.compare/align, serving numbers from the manifests as the capture engines wrote them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtrace import __version__, kv_formats
from kvtrace.analyzer import align, capacity, compare, pairing, stats
from kvtrace.analyzer.classify import RecipeSet
from kvtrace.analyzer.compare import Diff, Finding
from kvtrace.analyzer.load import open_traces
from kvtrace.errors import KvtraceError
from kvtrace.manifest import Manifest, Phase, Point, RunRecord, capacity_reason, parse_phase_name, read_manifest

REPORT_SCHEMA = "kvtrace.report/2"
# Segments whose per-call durations the report keeps for the ECDF plots.
DISTRIBUTION_SEGMENTS = ("prefill_attention", "decode_attention")
# FlashInfer workload phases (kvtrace.manifest.phase_name) and the segment whose kernels do their KV work.
PHASE_SEGMENTS = {"prefill": "prefill_attention", "decode": "decode_attention", "append": "kv_append"}
_LATENCIES = ("ttft", "itl", "tpot", "e2el")
# vLLM histograms (seconds) that stand in for the bench client's latencies in offline runs: means only.
_HISTOGRAMS = {"ttft": ("vllm:time_to_first_token_seconds",),
               "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
               "tpot": ("vllm:request_time_per_output_token_seconds",),
               "e2el": ("vllm:e2e_request_latency_seconds",)}


# ---- inputs ------------------------------------------------------------------------------------------

@dataclass
class RunArm:
    """One side of the report: an arm of a run directory."""

    label: str
    run: str  # the run directory
    arm: str  # the arm's name in its manifest
    engine: str | None
    kv_cache_dtype: str | None  # as the engine names it (vLLM --kv-cache-dtype, FlashInfer kv_format)
    kv_format: str | None  # fp8, nvfp4, bf16 or fp16 (None when unknown)
    scenario: str | None
    mode: str | None
    sqlite: str  # the first run's export
    runs: tuple[str, ...]  # every run's export, in repeat order
    kv_cache_tokens: int | None  # vLLM's "GPU KV cache size: N tokens"
    kv_cache_line: str | None


@dataclass
class _Input:
    run: Path
    manifest: Manifest
    arm: str  # the arm's name, or the run's name when one run of an arm was picked
    runs: tuple[str, ...]  # the names of its runs in the manifest, in repeat order

    @classmethod
    def of(cls, run: Path, manifest: Manifest, name: str) -> _Input:
        """An arm by name (all its runs) or one run by its name (ARM.rK)."""
        by_arm = manifest.runs_by_arm
        if name in by_arm:
            return cls(run, manifest, name, tuple(by_arm[name]))
        if name in manifest.runs:
            return cls(run, manifest, name, (name,))
        raise KvtraceError(f"{run} has no arm {name!r} (it has {', '.join(by_arm)}): check --arm")

    @property
    def record(self) -> RunRecord:
        """The first run's record (what every run of the arm shares: format, workload, serving points)."""
        return self.manifest.runs[self.runs[0]]


def _locate(path: Path) -> tuple[Path, Manifest, str | None]:
    """A run directory, its manifest.json or an ARM.manifest.json in it, or RUNDIR/ARM (an arm or a run by name)."""
    if path.is_file() and path.name.endswith("manifest.json"):
        manifest = read_manifest(path)
        arms = list(manifest.runs_by_arm)
        return path.parent, manifest, arms[0] if path.name != "manifest.json" and len(arms) == 1 else None
    if not path.exists() and (path.parent / "manifest.json").is_file():
        manifest = read_manifest(path.parent)
        if path.name in manifest.runs_by_arm or path.name in manifest.runs:
            return path.parent, manifest, path.name
        raise KvtraceError(f"{path}: no such run directory, and {path.parent} has no arm {path.name!r} (it has "
                           f"{', '.join(manifest.runs_by_arm)}): pass RUNDIR or RUNDIR/ARM")
    if path.exists() and not path.is_dir():
        raise KvtraceError(f"{path} is a file: pass a run directory written by `kvtrace capture` (it holds "
                           "manifest.json), not a trace; `kvtrace diff` compares traces")
    return path, read_manifest(path), None


def resolve_inputs(paths: list[Path], arms: tuple[str, ...] = ()) -> list[_Input]:
    """Baseline and candidate from one run directory (its two arms) or two (one arm each), each with its runs."""
    if not 1 <= len(paths) <= 2:
        raise KvtraceError(f"report takes one run directory (compares its two arms) or two (one arm each), "
                           f"got {len(paths)}")
    if len(arms) > 2:
        raise KvtraceError("--arm takes at most two names, baseline first")
    located = [_locate(Path(p)) for p in paths]
    if len(located) == 1:
        run, manifest, named = located[0]
        if named is not None:
            raise KvtraceError(f"{paths[0]} names one arm: give a second run directory or arm to compare it with, "
                               f"e.g. `kvtrace report {run}` compares all of {run}'s arms")
        if len(arms) == 1:
            raise KvtraceError(f"one run directory and one --arm: name two arms, baseline first "
                               f"(--arm {arms[0]} --arm OTHER), or give a second run directory")
        if arms:
            names = list(arms)
        else:
            by_arm = manifest.runs_by_arm
            if len(by_arm) != 2:
                raise KvtraceError(f"{run} holds {len(by_arm)} arm(s) ({', '.join(by_arm) or 'none'}): pick two "
                                   "with --arm BASELINE --arm CANDIDATE")
            names = [manifest.runs[first].arm for first in manifest.widest_first([runs[0] for runs in by_arm.values()])]
        inputs = [_Input.of(run, manifest, name) for name in names]
    else:
        inputs = []
        for index, (run, manifest, named) in enumerate(located):
            name = named
            if name is None and arms:
                name = arms[index] if len(arms) == 2 else arms[0]
            if name is None:
                arms_here = list(manifest.runs_by_arm)
                if len(arms_here) != 1:
                    raise KvtraceError(f"{run} holds arms {', '.join(arms_here)}: pick one with --arm NAME "
                                       "(once for both run directories, twice for one each) or pass RUNDIR/ARM")
                name = arms_here[0]
            inputs.append(_Input.of(run, manifest, name))
    for item in inputs:
        _check_arm(item)
    base, cand = inputs
    if len(base.runs) != len(cand.runs):
        raise KvtraceError(f"arm {base.arm} has {len(base.runs)} run(s) and arm {cand.arm} {len(cand.runs)}: "
                           "runs pair in repeat order, so both arms need as many; name single runs as RUNDIR/ARM.rK")
    return inputs


def _check_arm(item: _Input) -> None:
    for name in item.runs:
        record = item.manifest.runs[name]
        if record.status != "ok":
            state = "failed" if record.status == "failed" else f"is {record.status}"
            detail = f": {record.error}" if record.error else ""
            raise KvtraceError(f"arm {name} in {item.run} {state}{detail}; capture it again or report on another arm")
        if not record.sqlite:
            raise KvtraceError(f"arm {name} in {item.run} lists no SQLite export: export its report with "
                               "`nsys export --type sqlite` and capture again")
        path = item.run / record.sqlite
        if not path.is_file():
            raise KvtraceError(f"{path}, the export that arm {name} lists, is missing: copy the run directory whole "
                               f"or re-export {name}.nsys-rep with `nsys export --type sqlite`")


def _run_arm(item: _Input, label: str) -> RunArm:
    arm, manifest = item.record, item.manifest
    try:
        fmt = kv_formats.canonical_format(arm.kv_dtype, manifest.model_dtype)
    except KvtraceError:
        fmt = None
    return RunArm(label=label, run=str(item.run), arm=item.arm, engine=manifest.engine, kv_cache_dtype=arm.kv_dtype,
                  kv_format=fmt, scenario=manifest.scenario, mode=manifest.mode, sqlite=str(item.run / arm.sqlite),
                  runs=tuple(str(item.run / manifest.runs[name].sqlite) for name in item.runs),
                  kv_cache_tokens=arm.kv_cache_tokens, kv_cache_line=arm.kv_cache.get("line"))


# ---- result --------------------------------------------------------------------------------------------

@dataclass
class Latency:
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


@dataclass
class ServingMetrics:
    """One arm at one traffic point, as the capture recorded it. Latencies in milliseconds."""

    source: str  # "vllm bench serve" or "vLLM metrics (offline)"
    requests: int | None
    failed: int | None
    duration_s: float | None
    ttft_ms: Latency
    itl_ms: Latency
    tpot_ms: Latency
    e2el_ms: Latency
    prompt_tokens: int | None
    cached_prompt_tokens: int | None  # served from the prefix cache
    prefix_cache_queries: int | None
    prefix_cache_hits: int | None
    prefix_hit_rate: float | None
    output_tokens: int | None
    input_tokens_per_s: float | None
    output_tokens_per_s: float | None
    preemptions: int | None
    peak_running: float | None
    peak_waiting: float | None
    peak_kv_usage: float | None  # fraction of the KV cache
    capacity: str | None  # why this point is capacity-bound (preemptions, KV usage, KV demand), or None


@dataclass
class ServingRow:
    point: str  # the traffic shape, e.g. input=1024,output=1,prompts=32,concurrency=16
    context: int | None  # prompt tokens per request (prefix + input)
    concurrency: int | None
    baseline: ServingMetrics | None
    candidate: ServingMetrics | None
    baseline_first_capacity: bool = False  # the first point of its context length that is capacity-bound
    candidate_first_capacity: bool = False
    ttft_stat: str | None = None  # p50, else mean: the statistic both arms have
    ttft_ratio: float | None = None  # candidate / baseline
    ratios: dict = field(default_factory=dict)  # candidate / baseline per metric (`ttft_ms.p50`, `output_tokens_per_s`)


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
    verdict: str


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
class Statement:
    """What the numbers say on one topic (prefill, decode, append, capacity, ttft), kept apart from the others;
    a Finding, by contrast, says whether the two runs can be compared at all."""

    level: str  # ok, warning
    check: str  # the topic
    message: str


@dataclass
class Ceiling:
    gpu: str
    bytes_per_s: int
    source: str


@dataclass
class PlotFile:
    kind: str  # segment-times, segment-ratios, ecdf, bandwidth, sweep
    title: str
    path: str  # as written
    link: str  # relative to the report file (or the working directory when printed)


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
    capacity: capacity.Capacity | None
    notes: list[str] = field(default_factory=list)
    plots: list[PlotFile] = field(default_factory=list)
    # Per-call durations (ns, sorted) per segment and arm, for the ECDF plots; not in the JSON.
    durations: dict = field(default_factory=dict, repr=False)
    schema: str = REPORT_SCHEMA
    kvtrace_version: str = __version__

    def to_dict(self) -> dict:
        data = {"schema": self.schema, "kvtrace_version": self.kvtrace_version}
        for name in ("baseline", "candidate"):
            data[name] = asdict(getattr(self, name))
        data["diff"] = self.diff.to_dict()
        for name in ("statements", "findings", "segment_times", "serving"):
            data[name] = [asdict(row) for row in getattr(self, name)]
        data["sweep"] = self.sweep
        data["bandwidth"] = [asdict(row) for row in self.bandwidth]
        data["hbm_ceiling"] = asdict(self.hbm_ceiling) if self.hbm_ceiling else None
        data["capacity"] = self.capacity.to_dict() if self.capacity else None
        data["notes"] = list(self.notes)
        data["plots"] = [asdict(p) for p in self.plots]
        return data


# ---- serving metrics ----------------------------------------------------------------------------------

def _number(value):
    return None if value is None else (int(value) if float(value).is_integer() else float(value))


def _latency(bench: dict, histograms: dict, name: str) -> Latency:
    if bench and any(key.endswith(f"_{name}_ms") for key in bench):
        return Latency(mean=bench.get(f"mean_{name}_ms"), p50=bench.get(f"p50_{name}_ms", bench.get(f"median_{name}_ms")),
                       p90=bench.get(f"p90_{name}_ms"), p99=bench.get(f"p99_{name}_ms"))
    for metric in _HISTOGRAMS[name]:
        entry = histograms.get(metric)
        if entry and entry.get("count"):
            return Latency(mean=1000.0 * entry["sum"] / entry["count"])
    return Latency()


def serving_metrics(record: dict, kv_cache_tokens: int | None) -> ServingMetrics:
    """One point of a vLLM arm: the bench client's summary (serve) or the worker's counts (offline), with
    vLLM's own counter deltas and polled peaks."""
    bench = record.get("bench") or {}
    metrics = record.get("metrics") or {}
    deltas = metrics.get("deltas") or {}
    counters, histograms = deltas.get("counters") or {}, deltas.get("histograms") or {}
    peaks = metrics.get("peaks") or {}

    def counter(*names):
        return next((_number(counters[n]) for n in names if n in counters), None)

    duration = bench.get("duration", record.get("elapsed_s"))
    prompt = counter("vllm:prompt_tokens_total")
    if prompt is None:
        prompt = bench.get("total_input_tokens", record.get("tokens_in"))
    output = counter("vllm:generation_tokens_total")
    if output is None:
        output = bench.get("total_output_tokens", record.get("tokens_out"))
    cached = record.get("cached_tokens")
    if cached is None:
        cached = counter("vllm:prompt_tokens_cached_total", "vllm:prefix_cache_hits_total")
    queries, hits = counter("vllm:prefix_cache_queries_total"), counter("vllm:prefix_cache_hits_total")
    input_rate = bench.get("input_throughput")
    if input_rate is None and prompt is not None and duration:
        input_rate = prompt / duration
    output_rate = bench.get("output_throughput")
    if output_rate is None and output is not None and duration:
        output_rate = output / duration
    reason = record.get("capacity")
    if reason is None and record.get("point"):
        try:
            reason = capacity_reason(Point.parse(record["point"]), {"counters": counters}, peaks or None,
                                     kv_cache_tokens)
        except (ValueError, TypeError):
            reason = None
    requests = bench.get("completed", record.get("requests"))
    if requests is None:
        requests = counter("vllm:request_success_total")
    return ServingMetrics(
        source="vllm bench serve" if bench else "vLLM metrics (offline)",
        requests=_number(requests), failed=_number(bench.get("failed")), duration_s=duration,
        ttft_ms=_latency(bench, histograms, "ttft"), itl_ms=_latency(bench, histograms, "itl"),
        tpot_ms=_latency(bench, histograms, "tpot"), e2el_ms=_latency(bench, histograms, "e2el"),
        prompt_tokens=_number(prompt), cached_prompt_tokens=_number(cached), prefix_cache_queries=queries,
        prefix_cache_hits=hits, prefix_hit_rate=hits / queries if queries and hits is not None else None,
        output_tokens=_number(output), input_tokens_per_s=input_rate, output_tokens_per_s=output_rate,
        preemptions=counter("vllm:num_preemptions_total"), peak_running=peaks.get("vllm:num_requests_running",
                                                                                  bench.get("max_concurrent_requests")),
        peak_waiting=peaks.get("vllm:num_requests_waiting"), peak_kv_usage=peaks.get("vllm:kv_cache_usage_perc"),
        capacity=reason)


def serving_rows(base: _Input, cand: _Input) -> list[ServingRow]:
    """One row per traffic point either arm ran, in the baseline's order, matched by the point's spec."""
    records = []
    for item in (base, cand):
        kv = item.record.kv_cache_tokens
        records.append({p["point"]: serving_metrics(p, kv) for p in item.record.points if p.get("point")})
    order = list(records[0]) + [p for p in records[1] if p not in records[0]]
    rows = []
    for spec in order:
        try:
            point = Point.parse(spec)
            context, concurrency = point.prefix_len + point.input_len, point.concurrency
        except (ValueError, TypeError):
            context = concurrency = None
        row = ServingRow(point=spec, context=context, concurrency=concurrency, baseline=records[0].get(spec),
                         candidate=records[1].get(spec))
        if row.baseline and row.candidate:
            for stat in ("p50", "mean"):
                b, c = getattr(row.baseline.ttft_ms, stat), getattr(row.candidate.ttft_ms, stat)
                if b and c is not None:
                    row.ttft_stat, row.ttft_ratio = stat, stats.ratio(b, c)
                    break
            row.ratios = _serving_ratios(row.baseline, row.candidate)
        rows.append(row)
    for side in ("baseline", "candidate"):
        seen: set = set()
        for row in sorted(rows, key=lambda r: (r.context or 0, r.concurrency or 0)):
            metrics = getattr(row, side)
            if metrics and metrics.capacity and row.context not in seen:
                seen.add(row.context)
                setattr(row, f"{side}_first_capacity", True)
    return rows


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
            ratio=row.ratio, ci_low=row.ci_low, ci_high=row.ci_high, verdict=row.verdict))
    return rows


def _serving_ratios(base: ServingMetrics, cand: ServingMetrics) -> dict[str, float | None]:
    """candidate / baseline of the latencies (per statistic) and throughputs, keyed like `ttft_ms.p50`."""
    ratios = {}
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms"):
        for stat in ("p50", "p90", "p99", "mean"):
            ratios[f"{name}.{stat}"] = stats.ratio(getattr(getattr(base, name), stat),
                                                   getattr(getattr(cand, name), stat))
    for name in ("input_tokens_per_s", "output_tokens_per_s"):
        ratios[name] = stats.ratio(getattr(base, name), getattr(cand, name))
    return ratios


def _phase_calls(item: _Input, kind: str) -> int | None:
    """Workload calls of one kind of FlashInfer phase (all contexts, all runs), from the arm's manifest."""
    return sum(phase.calls or 0 for phase in item.record.phases if phase.kind == kind) * len(item.runs) or None


def bandwidth_rows(diff: Diff, base: _Input, cand: _Input, ceiling: Ceiling | None) -> list[BandwidthRow]:
    """FlashInfer workload phases with KV bytes per call: achieved bytes/s of the phase's segment kernels."""
    phases: dict[str, dict[str, Phase]] = {}
    for side, item in (("baseline", base), ("candidate", cand)):
        for phase in item.record.phases:
            if phase.kind in PHASE_SEGMENTS and phase.bytes_per_call:
                phases.setdefault(phase.nvtx, {})[side] = phase
    totals = {(r.segment, r.phase): r for r in diff.phases}
    rows = []
    for nvtx, sides in phases.items():
        kind, context = parse_phase_name(nvtx)
        segment = PHASE_SEGMENTS[kind]
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
    order = list(PHASE_SEGMENTS)
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


# ---- statements ---------------------------------------------------------------------------------------

def _fmt_ns(ns: float | None) -> str:
    from kvtrace.analyzer.render.units import duration

    return duration(ns)


def _segment_statement(diff: Diff, segment: str, topic: str, what: str) -> Statement | None:
    row = next((r for r in diff.segments if r.segment == segment), None)
    if row is None:
        return None
    b, c = diff.baseline.label, diff.candidate.label
    if row.ratio is None:
        return Statement("warning", topic, f"{what}: {row.verdict} ({row.reason or row.note or 'no paired calls'})")
    interval = f" [{row.ci_low:.3f}, {row.ci_high:.3f}]" if row.ci_low is not None else ""
    if row.same_work:
        times = f"{_fmt_ns(row.baseline.mean_ns)} ({b}) → {_fmt_ns(row.candidate.mean_ns)} ({c}) per call"
    else:  # cells of different cost per call: a pooled mean would describe no call that ran
        times = (f"{_fmt_ns(row.baseline.total_ns)} ({b}) → {_fmt_ns(row.candidate.total_ns)} ({c}) in total over "
                 f"{row.cells:,} cells")
    return Statement("warning" if row.verdict in (stats.REGRESSION, stats.DIFFERENT_WORK) else "ok", topic,
                     f"{what}: {times}, {row.ratio:.3f}×{interval}, {row.verdict} over {row.compared_calls:,} paired "
                     "calls")


def _append_phase_statement(diff: Diff, calls: tuple[int | None, int | None]) -> Statement | None:
    """FlashInfer's append ranges hold the whole append path (FP8: a cast in separate kernels; NVFP4: one
    fused quantize-append), so the phase's GPU time per workload call is the fair comparison."""
    rows = [r for r in diff.phases if r.phase and (parsed := parse_phase_name(r.phase)) and parsed[0] == "append"]
    base = sum(r.baseline_total_ns for r in rows)
    cand = sum(r.candidate_total_ns for r in rows)
    if not rows or not base or not all(calls):
        return None
    b, c = base / calls[0], cand / calls[1]
    ratio = stats.ratio(b, c)
    return Statement("warning" if ratio > 1 + diff.threshold else "ok", "append",
                     f"append phase, every kernel in the kvtrace:append ranges (the FP8 cast and the NVFP4 packing "
                     f"included): {_fmt_ns(b)} ({diff.baseline.label}) → {_fmt_ns(c)} ({diff.candidate.label}) per "
                     f"append call over {calls[0]:,} and {calls[1]:,} calls, {ratio:.3f}×")


def statements(diff: Diff, serving: list[ServingRow], cap: capacity.Capacity | None, base: RunArm,
               cand: RunArm, append_calls: tuple[int | None, int | None] = (None, None)) -> list[Statement]:
    out = [s for s in (
        _segment_statement(diff, "prefill_attention", "prefill", "prefill attention kernels"),
        _segment_statement(diff, "decode_attention", "decode", "decode attention kernels"),
        _segment_statement(diff, "kv_append", "append", "KV append kernels"),
        _append_phase_statement(diff, append_calls)) if s is not None]
    if cap is not None and cap.measured:
        for row in cap.measured[1:]:
            out.append(Statement("ok", "capacity",
                               f"capacity: vLLM reports {row.tokens:,} KV tokens for {row.arm} against "
                               f"{cap.measured[0].tokens:,} for {cap.measured[0].arm} ({row.multiplier:.2f}×; "
                               f"ideal from bytes per token {row.ideal_multiplier:.2f}×). Capacity is not latency: "
                               "more tokens fit, no kernel got faster"))
    elif cap is not None and cap.ideal_multiplier is not None and cap.formats[0].format != cap.formats[-1].format:
        out.append(Statement("ok", "capacity",
                           f"capacity (ideal, from bytes per token): {cap.formats[-1].label} fits "
                           f"{cap.ideal_multiplier:.2f}× the tokens of {cap.formats[0].label} in the same memory "
                           f"(ratio {cap.ideal_ratio:.4g}); no run measured it. Capacity is not latency"))
    out += ttft_guard_rail(diff, serving, base, cand)
    return out


def ttft_guard_rail(diff: Diff, serving: list[ServingRow], base: RunArm, cand: RunArm) -> list[Statement]:
    """Two prefill statements that can both be true: a TTFT gain beside a prefill-kernel regression, with
    different cached prompt tokens, is a capacity / prefix-hit effect, not a faster kernel."""
    prefill = next((r for r in diff.segments if r.segment == "prefill_attention"), None)
    kernel_regressed = prefill is not None and prefill.verdict == stats.REGRESSION
    out = []
    for row in serving:
        if not (row.baseline and row.candidate and row.ttft_ratio is not None):
            continue
        b_cached, c_cached = row.baseline.cached_prompt_tokens, row.candidate.cached_prompt_tokens
        cached_differ = b_cached is not None and c_cached is not None and b_cached != c_cached
        improved = row.ttft_ratio < 1 - diff.threshold
        where = f" at {row.point}" if len(serving) > 1 else ""
        ttft = (f"TTFT {row.ttft_stat} {getattr(row.baseline.ttft_ms, row.ttft_stat):.1f} ms ({base.label}) → "
                f"{getattr(row.candidate.ttft_ms, row.ttft_stat):.1f} ms ({cand.label}), {row.ttft_ratio:.3f}×")
        cached = (f"{c_cached:,} cached prompt tokens ({cand.label}) against {b_cached:,} ({base.label})"
                  if cached_differ else "")
        if improved and kernel_regressed and cached_differ:
            out.append(Statement("warning", "ttft",
                               f"{ttft}{where} while prefill attention kernels regressed {prefill.ratio:.3f}× per "
                               f"call, with {cached}: the TTFT gain is a capacity / prefix-hit effect (more of the "
                               "prompt came from the prefix cache, so less prefill ran), not a faster prefill kernel"))
        elif improved and kernel_regressed and row.baseline.capacity and not row.candidate.capacity:
            out.append(Statement("warning", "ttft",
                               f"{ttft}{where} although prefill attention kernels regressed {prefill.ratio:.3f}× per "
                               f"call: {base.label} was capacity-bound there ({row.baseline.capacity}) and "
                               f"{cand.label} was not, so the TTFT gain is a capacity effect (less queueing and "
                               "recomputation after preemption), not a faster prefill kernel"))
        elif improved and kernel_regressed:
            out.append(Statement("warning", "ttft",
                               f"{ttft}{where} although prefill attention kernels regressed {prefill.ratio:.3f}× per "
                               "call, with the same cached prompt tokens: the gain comes from outside the prefill "
                               "kernels (scheduling, queueing, preemptions), not a faster kernel"))
        elif cached_differ:
            out.append(Statement("warning", "ttft",
                               f"{ttft}{where}, with {cached}: the arms prefilled different amounts, so TTFT "
                               "mixes kernel speed with prefix-cache hits"))
        else:
            out.append(Statement("ok", "ttft", f"{ttft}{where}"
                               + (", same cached prompt tokens" if b_cached is not None and c_cached is not None
                                  else "")))
    return out


def _run_findings(base: _Input, cand: _Input, report_base: RunArm, report_cand: RunArm) -> list[Finding]:
    findings = []
    engines = (report_base.engine, report_cand.engine)
    findings.append(Finding("ok" if engines[0] == engines[1] else "warning", "engine",
                            f"engine {engines[0]}" if engines[0] == engines[1] else
                            f"different capture engines: {engines[0]} vs {engines[1]}"))
    if base.run != cand.run:
        b_set, c_set = base.manifest.settings, cand.manifest.settings
        for key in ("scenario", "mode", "points", "spec"):
            if key in b_set or key in c_set:
                same = b_set.get(key) == c_set.get(key)
                findings.append(Finding("ok" if same else "warning", "settings",
                                        f"same {key} in both runs" if same else
                                        f"{key} differs between the runs: {b_set.get(key)} vs {c_set.get(key)}"))
    else:
        matched = base.manifest.request_order_matched
        if matched is not None:
            findings.append(Finding("ok" if matched else "warning", "requests",
                                    "both arms saw the same requests in the same order" if matched else
                                    "the arms' request orders differ: serving metrics compare different traffic"))
    b_hash, c_hash = base.record.request_order_sha256, cand.record.request_order_sha256
    if base.run != cand.run and b_hash and c_hash:
        findings.append(Finding("ok" if b_hash == c_hash else "warning", "requests",
                                "both arms saw the same requests in the same order" if b_hash == c_hash else
                                "the arms' request orders differ: serving metrics compare different traffic"))
    return findings


def _capacity(base: _Input, cand: _Input, b: RunArm, c: RunArm, notes: list[str]) -> capacity.Capacity | None:
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
          nsys: str | None = None, cache: bool = True) -> Report:
    base, cand = resolve_inputs(paths, arms)
    if labels and len(labels) != 2:
        raise KvtraceError("--label takes two names, baseline first: --label fp8 --label nvfp4")
    if not labels:
        labels = (base.arm, cand.arm)
        if base.arm == cand.arm:
            labels = (f"{base.run.name}/{base.arm}", f"{cand.run.name}/{cand.arm}")
            if labels[0] == labels[1]:
                raise KvtraceError(f"baseline and candidate are the same arm ({base.run}/{base.arm}): pick another")
    b_arm, c_arm = _run_arm(base, labels[0]), _run_arm(cand, labels[1])
    traces = open_traces([*b_arm.runs, *c_arm.runs], nsys=nsys, cache=cache)
    b_traces, c_traces = traces[:len(b_arm.runs)], traces[len(b_arm.runs):]
    diff = compare.diff(b_traces, c_traces, recipes, labels=tuple(labels), threshold=threshold, confidence=confidence,
                        seed=seed, window=window)
    durations = {}
    for side, arm_traces in (("baseline", b_traces), ("candidate", c_traces)):
        for segment, values in compare.segment_durations(arm_traces, recipes, window, DISTRIBUTION_SEGMENTS).items():
            durations.setdefault(segment, {})[side] = values
    notes: list[str] = []
    if len(b_traces) > 1:
        notes.append(f"{len(b_traces)} runs per arm: kernel numbers cover every run; serving metrics and capacity are "
                     "the first run's")
    serving = serving_rows(base, cand)
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
    cap = _capacity(base, cand, b_arm, c_arm, notes)
    append_calls = tuple(_phase_calls(item, "append") for item in (base, cand))
    return Report(baseline=b_arm, candidate=c_arm, diff=diff,
                  statements=statements(diff, serving, cap, b_arm, c_arm, append_calls),
                  findings=_run_findings(base, cand, b_arm, c_arm), segment_times=segment_times(diff),
                  serving=serving, sweep=sweep, bandwidth=bandwidth, hbm_ceiling=ceiling, capacity=cap, notes=notes,
                  durations=durations)
