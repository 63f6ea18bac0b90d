"""What the numbers of a report say, one topic at a time (prefill, decode, append, capacity, TTFT), kept apart;
the TTFT guard rail that tells a capacity / prefix-hit effect from a faster prefill kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvtrace.analyzer import capacity, headline
from kvtrace.analyzer.budget import Reason
from kvtrace.analyzer.results import Diff
from kvtrace.analyzer.reuse import Evictions, PrefixReuse
from kvtrace.analyzer.runs import RunArm
from kvtrace.analyzer.serving import ServingRow
from kvtrace.analyzer.stats import serving_intervals, verdicts
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.analyzer.steps import StepPhase
from kvtrace.manifest import Point, parse_phase_name


# How a TTFT change reads beside the prefill kernels and the prefix cache (TtftStatement.reading).
PREFIX_HIT = "prefix-hit effect"  # more cached prompt tokens, prefill kernels not faster
PREFIX_HIT_AND_FASTER = "prefix-hit effect and faster kernels"  # both: TTFT credits neither alone
PREFIX_HIT_SLOWER = "prefix-hit effect against slower kernels"  # more hits, slower prefill kernels, no TTFT gain
CAPACITY_EFFECT = "capacity effect"  # the baseline was capacity-bound there, the candidate not
OUTSIDE_KERNELS = "outside the prefill kernels"  # same cached tokens, prefill kernels not faster
PREFILLED_DIFFERENT = "different prefill amounts"  # cached tokens differ: TTFT mixes kernel speed and hits
PLAIN = "plain"  # nothing to qualify
# A profile window closed inside the timed traffic: the timings hold nsys' stall, nothing to read (serving.window_stalls)
WINDOW_STALL = "stalled by a profile window"
BUDGET = "budget"  # same cached tokens: the server's TTFT budget says which part carries the change (analyzer.budget)


@dataclass(frozen=True)
class Statement:
    """What the numbers say on one topic (prefill, decode, append, capacity, ttft), kept apart from the others;
    a Finding, by contrast, says whether the two runs can be compared at all. Each kind carries its numbers
    (ns, ms, ratios, counts) and names; analyzer/render/statements.py words them."""

    level: str  # ok, info, warning (verdicts.level_of)
    check: str  # the topic
    kind: ClassVar[str]


@dataclass(frozen=True)
class KernelStatement(Statement):
    """One row of the diff's head at one workload point: a segment's (prefill, decode, KV append kernels) or the
    append phase's (the diff's phase_totals row, every kernel of the phase)."""

    kind: ClassVar[str] = "kernels"
    subject: str  # a segment (prefill_attention, decode_attention, kv_append) or APPEND_PHASE
    point: str  # the workload point as the head names it: ctx=N, a vLLM step kind, "all calls"
    phase: str | None  # the row's NVTX range (None: all calls)
    context: int | None  # its context length, for a kvtrace workload range
    baseline: str  # arm labels
    candidate: str
    verdict: Verdict
    ratio: float | None  # None: not compared (reason says why)
    ci_low: float | None
    ci_high: float | None
    compared_calls: int
    per_call: bool  # the row's cells cost the same per call: the times are per call, else totals over `cells`
    baseline_ns: float | None
    candidate_ns: float | None
    cells: int
    reason: str | None  # why there is no ratio
    kernels: str = ""  # the kernel families compared, baseline's first ('→' where the arms run different ones)
    # The query dtype each arm's attention kernels ran with (vLLM's log), or None: unknown or not attention.
    baseline_query: str | None = None
    candidate_query: str | None = None
    no_interval: str | None = None  # why a compared row has no interval (DiffRow.no_interval)


APPEND_PHASE = "append_phase"


@dataclass(frozen=True)
class QueryQuantizeStatement(Statement):
    """The quantize kernels that only one arm runs in a phase where, by vLLM's log, that arm's prefill queries
    are FP8 (vLLM >= 0.33 quantizes them for FA3's FP8 prefill): part of that arm's prefill cost, which the
    prefill attention row leaves out. Calls and times are one run's, the mean per run when `runs` > 1 (the
    diff sums its runs); the ratio only where both arms ran as many prefill attention calls there. `kvtrace
    diff` states it too, in its head (headline.Headline.query_quantize)."""

    kind: ClassVar[str] = "query_quantize"
    arm: str  # the arm that quantizes
    other: str
    query: str  # its prefill query dtype
    phase: str
    calls: float  # per run
    quantize_ns: float  # per run
    attention_ns: float  # its prefill attention in the phase, per run
    other_attention_ns: float
    ratio: float | None  # baseline-to-candidate, prefill attention with the quantization against without
    runs: int = 1  # the run pairs the means are over

    @property
    def with_quantize_ns(self) -> float:
        """The quantizing arm's prefill attention and query quantization together, per run."""
        return self.attention_ns + self.quantize_ns


@dataclass(frozen=True)
class MeasuredCapacityStatement(Statement):
    """vLLM's own KV-token count of an arm against the first arm's."""

    kind: ClassVar[str] = "capacity-measured"
    arm: str
    tokens: int
    reference_arm: str
    reference_tokens: int
    multiplier: float
    ideal_multiplier: float


@dataclass(frozen=True)
class IdealCapacityStatement(Statement):
    """Tokens per memory from bytes per token alone, when no run measured capacity."""

    kind: ClassVar[str] = "capacity-ideal"
    format: str  # the candidate format's label
    reference_format: str
    multiplier: float
    ratio: float  # bytes per token, candidate / reference


@dataclass(frozen=True)
class FirstCapacity:
    point: str
    reason: str  # why the point is capacity-bound


@dataclass(frozen=True)
class SweepArm:
    label: str
    points: int  # points the arm ran
    first: tuple[FirstCapacity, ...]  # per context length, its first capacity-bound point


@dataclass(frozen=True)
class SweepCapacityStatement(Statement):
    """Where each arm of a sweep first reaches capacity, per context length."""

    kind: ClassVar[str] = "sweep-capacity"
    arms: tuple[SweepArm, ...]


@dataclass(frozen=True)
class PrefixFit:
    """The shared prefixes fit the candidate's KV cache and not the baseline's."""

    prefixes: int
    tokens: int
    baseline_kv_tokens: int
    candidate_kv_tokens: int


@dataclass(frozen=True)
class TtftStatement(Statement):
    """TTFT at one traffic point, read beside the prefill kernels' verdict and the prefix cache (the guard rail)."""

    kind: ClassVar[str] = "ttft"
    reading: str  # PREFIX_HIT, PREFIX_HIT_AND_FASTER, CAPACITY_EFFECT, OUTSIDE_KERNELS, PREFILLED_DIFFERENT, PLAIN,
    # WINDOW_STALL
    baseline: str
    candidate: str
    point: str | None  # None when the run has one traffic point
    stat: str  # p50 or mean
    baseline_ms: float
    candidate_ms: float
    ratio: float
    prefill_verdict: Verdict | None  # the prefill-attention kernels' (paired) verdict, ratio and pairs
    prefill_ratio: float | None
    prefill_compared_calls: int | None
    baseline_cached_tokens: int | None
    candidate_cached_tokens: int | None
    baseline_prefilled_tokens: int | None  # prompt tokens not served from the prefix cache
    candidate_prefilled_tokens: int | None
    baseline_queue_ms: float | None
    candidate_queue_ms: float | None
    prefix_fit: PrefixFit | None
    baseline_capacity: str | None  # why the baseline was capacity-bound at the point
    # The server's own per-request counts and KV-cache events, where the capture recorded them.
    baseline_reuse: PrefixReuse | None = None
    candidate_reuse: PrefixReuse | None = None
    baseline_evictions: Evictions | None = None
    candidate_evictions: Evictions | None = None
    # TTFT's mean over every run pair with its interval and verdict (ServingRow.estimates), where the point has one:
    # the reading names a mechanism, and only this estimate says whether the change is one.
    estimate: serving_intervals.ServingEstimate | None = None
    # The TTFT budget and the part that carries its difference, the same result the matrix words for this point.
    reason: Reason | None = None
    window_stall: str | None = None  # the first run whose timings hold a profile window's close (WINDOW_STALL)


@dataclass(frozen=True)
class StepTimelineStatement(Statement):
    """A phase whose vLLM steps lasted longer on the GPU in the candidate mostly by time with no kernel running
    (analyzer.steps.host_bound): host-side time, stated apart from the kernels; or whose candidate steps held the
    host by a kind of wait the baseline's did not make (analyzer.steps.host_held); row.host_reading says which.
    Either names that wait where the exports recorded it (row.held_by)."""

    kind: ClassVar[str] = "step-timeline"
    baseline: str
    candidate: str
    row: StepPhase


# The head's questions that kernel statements answer, with their topic.
_KERNEL_CHECKS = {headline.PREFILL: "prefill", headline.DECODE: "decode", headline.APPEND_KERNEL: "append",
                  headline.APPEND_PHASE: "append"}


# The attention phase whose query dtype a segment's kernels ran with (RunArm.query_dtypes).
_QUERY_PHASE = {"prefill_attention": "prefill", "decode_attention": "decode"}


def _kernel_statement(diff: Diff, head: headline.HeadRow, base: RunArm | None, cand: RunArm | None) -> KernelStatement:
    row = head.row
    subject = APPEND_PHASE if head.question == headline.APPEND_PHASE else row.segment
    parsed = parse_phase_name(row.phase) if row.phase else None
    phase = _QUERY_PHASE.get(subject)
    compared = row.ratio is not None
    times = [None, None]
    if compared:  # cells of different cost per call: the totals, since a pooled mean describes no call that ran
        times = [getattr(arm, "mean_ns" if row.same_work else "total_ns") for arm in (row.baseline, row.candidate)]
    return KernelStatement(
        level=verdicts.level_of(row.verdict, row.ratio, verdicts.no_change_half_width(row.band, diff.threshold)),
        check=_KERNEL_CHECKS[head.question], subject=subject, point=head.point, phase=row.phase,
        context=parsed[1] if parsed else None,
        baseline=diff.baseline.label, candidate=diff.candidate.label, verdict=row.verdict, ratio=row.ratio,
        ci_low=row.ci_low, ci_high=row.ci_high, compared_calls=row.compared_calls, per_call=row.same_work,
        baseline_ns=times[0], candidate_ns=times[1], cells=row.cells,
        reason=None if compared else row.reason or row.note, kernels=head.family,
        baseline_query=base.query_dtypes.get(phase) if base and phase else None,
        candidate_query=cand.query_dtypes.get(phase) if cand and phase else None, no_interval=row.no_interval)


def _kernel_statements(diff: Diff, base: RunArm | None = None, cand: RunArm | None = None) -> list[KernelStatement]:
    """Prefill, decode and KV append kernels, then the append phase (FlashInfer's append ranges hold the whole
    append path: FP8's cast in separate kernels, NVFP4's one fused quantize-append), one statement per workload
    point: the rows of the diff's head, so that report and diff say the same and no ratio pooled across
    contexts poses as one answer."""
    return [_kernel_statement(diff, head, base, cand) for head in headline.head_rows(diff)
            if head.question in _KERNEL_CHECKS]


def statements(diff: Diff, serving: list[ServingRow], cap: capacity.Capacity | None, base: RunArm,
               cand: RunArm, step_rows: list[StepPhase] = ()) -> list[Statement]:
    out: list[Statement] = list(_kernel_statements(diff, base, cand))
    if cap is not None and cap.measured:
        reference = cap.measured[0]
        out += [MeasuredCapacityStatement("ok", "capacity", row.arm, row.tokens, reference.arm, reference.tokens,
                                          row.multiplier, row.ideal_multiplier) for row in cap.measured[1:]]
    elif cap is not None and cap.ideal_multiplier is not None and cap.formats[0].format != cap.formats[-1].format:
        out.append(IdealCapacityStatement("ok", "capacity", cap.formats[-1].label, cap.formats[0].label,
                                          cap.ideal_multiplier, cap.ideal_ratio))
    out += query_quantize_statements(diff, (base.query_dtypes.get("prefill"), cand.query_dtypes.get("prefill")))
    sweep = sweep_capacity_statement(serving, base, cand)
    if sweep is not None:
        out.append(sweep)
    out += [StepTimelineStatement("warning", "steps", base.label, cand.label, row) for row in step_rows
            if row.host_reading]
    out += ttft_guard_rail(diff, serving, base, cand)
    return out


def _prefix_fit(row: ServingRow, base: RunArm, cand: RunArm) -> PrefixFit | None:
    """What made the candidate prefill less: its KV pool holding the shared prefixes the baseline's could not."""
    try:
        point = Point.parse(row.point)
    except (ValueError, TypeError):
        return None
    pools = (base.kv_cache_tokens, cand.kv_cache_tokens)
    if point.prefix_len and point.num_prefixes and all(pools):
        shared = point.prefix_len * point.num_prefixes
        if pools[1] >= shared > pools[0]:
            return PrefixFit(point.num_prefixes, shared, pools[0], pools[1])
    return None


def segment_verdict(diff: Diff, segment: str):
    """A segment's row over all calls and whether its kernels are faster per matched call: arms that did
    different amounts of work leave unpaired calls ("different work"); the matched calls still say it."""
    row = next((r for r in diff.segments if r.segment == segment), None)
    if row is None or row.ratio is None:
        return row, None
    return row, row.paired_verdict if row.verdict == Verdict.DIFFERENT_WORK else row.verdict


def ttft_guard_rail(diff: Diff, serving: list[ServingRow], base: RunArm, cand: RunArm) -> list[TtftStatement]:
    """Two prefill statements that can both be true: a TTFT gain while the candidate served more of its prompts
    from the prefix cache is a capacity / prefix-hit effect, not a faster kernel, when its prefill kernels are
    not faster; when they are faster too, TTFT credits neither alone."""
    prefill, whole_verdict = segment_verdict(diff, "prefill_attention")
    out = []
    for row in serving:
        if not (row.baseline and row.candidate and row.ttft_ratio is not None):
            continue
        # The prefill kernels speak for a point only where the kernel diff read that point's own traffic.
        verdict = whole_verdict if row.diff_covers else None
        not_faster = verdict in (Verdict.REGRESSION, Verdict.NO_CHANGE)
        b, c = row.baseline, row.candidate
        cached_differ = b.cached_prompt_tokens is not None and c.cached_prompt_tokens is not None and \
            b.cached_prompt_tokens != c.cached_prompt_tokens
        more_hits = cached_differ and c.cached_prompt_tokens > b.cached_prompt_tokens
        estimate = row.estimates.get("ttft_ms")
        # The reading follows the mean over every run pair where there is one: one run's ratio is not the point's.
        moved = estimate.ratio if estimate is not None and estimate.ratio is not None else row.ttft_ratio
        improved = moved < 1 - diff.threshold
        if row.window_stalls:
            reading = WINDOW_STALL
        elif improved and more_hits and not_faster:
            reading = PREFIX_HIT
        elif improved and more_hits and verdict == Verdict.IMPROVEMENT:
            reading = PREFIX_HIT_AND_FASTER
        elif row.reason is not None and not cached_differ:
            reading = BUDGET
        elif improved and (not_faster or verdict is None) and b.capacity and not c.capacity:
            reading = CAPACITY_EFFECT
        elif improved and not_faster and not cached_differ:
            reading = OUTSIDE_KERNELS
        elif more_hits and verdict == Verdict.REGRESSION and not improved:
            reading = PREFIX_HIT_SLOWER
        elif cached_differ:
            reading = PREFILLED_DIFFERENT
        else:
            reading = PLAIN
        prefilled = (b.prompt_tokens - b.cached_prompt_tokens, c.prompt_tokens - c.cached_prompt_tokens) if None not in (
            b.prompt_tokens, c.prompt_tokens, b.cached_prompt_tokens, c.cached_prompt_tokens) else (None, None)
        queued = (b.queue_ms, c.queue_ms) if b.queue_ms is not None and c.queue_ms is not None else (None, None)
        # A slower TTFT is never marked "ok", whatever reading it has; a faster one is "info" (a change, not all well).
        worse = moved > 1 + diff.threshold
        judged = estimate.verdict if estimate else verdicts.judge(row.ttft_ratio, None, None, threshold=diff.threshold)
        plain = reading == PLAIN or (reading == BUDGET and not improved)
        out.append(TtftStatement(
            level=verdicts.level_of(judged, row.ttft_ratio, diff.threshold) if plain and not worse else "warning",
            check="ttft", reading=reading,
            baseline=base.label, candidate=cand.label, point=row.point if len(serving) > 1 else None, stat=row.ttft_stat,
            baseline_ms=getattr(b.ttft_ms, row.ttft_stat), candidate_ms=getattr(c.ttft_ms, row.ttft_stat),
            ratio=row.ttft_ratio, prefill_verdict=verdict, prefill_ratio=prefill.ratio if verdict else None,
            prefill_compared_calls=prefill.compared_calls if verdict else None,
            baseline_cached_tokens=b.cached_prompt_tokens, candidate_cached_tokens=c.cached_prompt_tokens,
            baseline_prefilled_tokens=prefilled[0], candidate_prefilled_tokens=prefilled[1],
            baseline_queue_ms=queued[0], candidate_queue_ms=queued[1], prefix_fit=_prefix_fit(row, base, cand),
            baseline_capacity=b.capacity, baseline_reuse=b.reuse, candidate_reuse=c.reuse,
            baseline_evictions=b.evictions, candidate_evictions=c.evictions,
            estimate=estimate, reason=row.reason, window_stall=next(iter(row.window_stalls), None)))
    return out


def sweep_capacity_statement(serving: list[ServingRow], base: RunArm, cand: RunArm) -> SweepCapacityStatement | None:
    """Where each arm of a sweep first reaches capacity, per context length."""
    if len(serving) < 2:
        return None
    arms = []
    for side, arm in (("baseline", base), ("candidate", cand)):
        ran = [row for row in serving if getattr(row, side)]
        arms.append(SweepArm(arm.label, len(ran), tuple(
            FirstCapacity(row.point, getattr(row, side).capacity) for row in ran
            if getattr(row, f"{side}_first_capacity"))))
    return SweepCapacityStatement("ok", "capacity", tuple(arms))


def query_quantize_statements(diff: Diff, queries: tuple[str | None, str | None]) -> list[QueryQuantizeStatement]:
    """`queries`: each arm's prefill query dtype from vLLM's log (runs.query_dtypes), baseline first; None when
    unknown. One home for `kvtrace report` and `kvtrace diff`."""
    out = []
    labels = (diff.baseline.label, diff.candidate.label)

    def per_run(total: int) -> float:
        return total if diff.runs == 1 else total / diff.runs

    for row in diff.phases:
        if row.segment != "quantize" or (row.baseline_calls == 0) == (row.candidate_calls == 0):
            continue
        index = 0 if row.baseline_calls else 1
        side = ("baseline", "candidate")[index]
        query = queries[index] or ""
        attention = next((r for r in diff.phases if r.segment == "prefill_attention" and r.phase == row.phase), None)
        if not query.startswith("float8") or attention is None:
            continue
        own, theirs = ((attention.baseline_total_ns, attention.candidate_total_ns) if side == "baseline"
                       else (attention.candidate_total_ns, attention.baseline_total_ns))
        quantize = getattr(row, f"{side}_total_ns")
        with_quantize = own + quantize
        ratio = None
        if attention.baseline_calls == attention.candidate_calls and with_quantize and theirs:
            ratio = theirs / with_quantize if side == "baseline" else with_quantize / theirs
        out.append(QueryQuantizeStatement(  # a cost beyond the threshold is a change: never "ok"
            "ok" if ratio is None or abs(ratio - 1) <= diff.threshold else "info", "prefill", labels[index], labels[1 - index], query, row.phase, per_run(getattr(row, f"{side}_calls")),
            per_run(quantize), per_run(own), per_run(theirs), ratio, diff.runs))
    return out
