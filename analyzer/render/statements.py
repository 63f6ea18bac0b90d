"""The words of a report's statements (analyzer.statements), one template per kind, for the terminal, markdown
and CSV; JSON carries their numbers instead. `name` makes trace and user text (labels, points, reasons) inert
for the format at hand (render.escape); numbers and kvtrace's own words pass as they are."""

from __future__ import annotations

from functools import singledispatch
from typing import Callable

from kvtrace.analyzer import statements as st
from kvtrace.analyzer.budget_trace import NOT_TRACED
from kvtrace.analyzer.render import budget as budget_words
from kvtrace.analyzer.render.units import duration, interval
from kvtrace.analyzer.host_waits import WaitKind
from kvtrace.analyzer.stats.serving_intervals import too_few_runs
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.analyzer.steps import HELD_BY_WAIT
from kvtrace.text import plural

Name = Callable[[str], str]

_SUBJECTS = {"prefill_attention": "prefill attention kernels", "decode_attention": "decode attention kernels",
             "kv_append": "KV append kernels"}
_APPEND_PHASE = ("every kernel in the kvtrace:append ranges (the FP8 cast and the NVFP4 packing included)")


def _plain(text: str) -> str:
    return text


@singledispatch
def text(statement: st.Statement, name: Name = _plain) -> str:
    raise TypeError(f"no words for a {type(statement).__name__}")


@text.register
def _kernels(s: st.KernelStatement, name: Name = _plain) -> str:
    if s.subject == st.APPEND_PHASE:
        what = f"append phase at ctx={s.context}, {_APPEND_PHASE}"
    else:
        what = f"{_SUBJECTS[s.subject]} ({name(s.point)})"
    if s.ratio is None:
        return f"{what}: {s.verdict} ({name(s.reason or 'no paired calls')}){_compared(s, name)}"
    b, c = name(s.baseline), name(s.candidate)
    if s.per_call:
        unit = "per append call" if s.subject == st.APPEND_PHASE else "per call"
        times = f"{duration(s.baseline_ns)} ({b}) → {duration(s.candidate_ns)} ({c}) {unit}"
    else:
        times = f"{duration(s.baseline_ns)} ({b}) → {duration(s.candidate_ns)} ({c}) in total over {s.cells:,} cells"
    paired = f"{s.verdict} over {s.compared_calls:,} paired {plural(s.compared_calls, 'call')}"
    spread = interval(s.ci_low, s.ci_high, s.no_interval)
    return f"{what}: {times}, {s.ratio:.3f}× {spread}, {paired}{_compared(s, name)}"


def _compared(s: st.KernelStatement, name: Name) -> str:
    """Which kernels the statement compares and, from vLLM's log, with which query dtype."""
    kernels = f"; kernels {name(s.kernels)}" if s.kernels else ""
    if s.baseline_query is None and s.candidate_query is None:
        return kernels
    return (f"{kernels}, queries {name(s.baseline_query or 'unknown')} ({name(s.baseline)}) → "
            f"{name(s.candidate_query or 'unknown')} ({name(s.candidate)}) per vLLM's log")


@text.register
def _query_quantize(s: st.QueryQuantizeStatement, name: Name = _plain) -> str:
    a, o, phase = name(s.arm), name(s.other), name(s.phase.removeprefix("vLLM "))
    # One run's numbers, or their mean per run: a sum over repeated runs is no run's time.
    calls, each = (f"{s.calls:,} quantize {plural(s.calls, 'call')}", "in total") if s.runs == 1 else \
        (f"{s.calls:,.4g} quantize calls", f"per run (mean of {s.runs} runs)")
    there = "there" if s.runs == 1 else "there per run"
    words = (f"query quantization ({phase}): only {a} quantizes its prefill queries ({name(s.query)}, per vLLM's log), "
             f"{calls}, {duration(s.quantize_ns)} {each}: part of {a}'s prefill cost, which "
             f"the prefill attention row leaves out. With it, {a} spends {duration(s.with_quantize_ns)} "
             f"on prefill attention and query quantization {there} against {duration(s.other_attention_ns)} for {o}")
    return words + (f" ({s.ratio:.3f}×)" if s.ratio is not None else "")


@text.register
def _measured(s: st.MeasuredCapacityStatement, name: Name = _plain) -> str:
    return (f"capacity: vLLM reports {s.tokens:,} KV tokens for {name(s.arm)} against {s.reference_tokens:,} for "
            f"{name(s.reference_arm)} ({s.multiplier:.2f}×; ideal from bytes per token {s.ideal_multiplier:.2f}×). "
            "Capacity is not latency: more tokens fit, no kernel got faster")


@text.register
def _ideal(s: st.IdealCapacityStatement, name: Name = _plain) -> str:
    return (f"capacity (ideal, from bytes per token): {name(s.format)} fits {s.multiplier:.2f}× the tokens of "
            f"{name(s.reference_format)} in the same memory (ratio {s.ratio:.4g}); no run measured it. Capacity is "
            "not latency")


@text.register
def _sweep(s: st.SweepCapacityStatement, name: Name = _plain) -> str:
    parts = [f"{name(arm.label)} first reaches capacity at "
             + "; ".join(f"{name(f.point)} ({name(f.reason)})" for f in arm.first) if arm.first else
             f"{name(arm.label)} reaches capacity at none of its {arm.points} {plural(arm.points, 'point')}"
             for arm in s.arms]
    return "sweep: " + ". ".join(parts)


def _prefill_kernels(s: st.TtftStatement, name: Name) -> str:
    if s.prefill_verdict is None:
        return ""
    if s.prefill_verdict == Verdict.REGRESSION:
        return f"prefill attention kernels regressed {s.prefill_ratio:.3f}× per call"
    if s.prefill_verdict == Verdict.NO_CHANGE:
        return f"prefill attention kernels showed no significant change per call ({s.prefill_ratio:.3f}×)"
    return (f"{name(s.candidate)}'s prefill attention kernels are also faster per matched call "
            f"({s.prefill_ratio:.3f}× over {s.prefill_compared_calls:,} paired calls)")


def _prefix_evidence(s: st.TtftStatement, name: Name) -> str:
    """Why the candidate prefilled less: the shared prefixes its KV pool held, the prompt tokens each arm
    prefilled, the time requests waited in vLLM's queue."""
    b, c = name(s.baseline), name(s.candidate)
    fit = s.prefix_fit
    cause = (f"the {fit.prefixes} shared prefixes ({fit.tokens:,} tokens) fit {c}'s {fit.candidate_kv_tokens:,}-token "
             f"KV cache and not {b}'s {fit.baseline_kv_tokens:,}, so " if fit else "")
    effects = []
    if s.candidate_prefilled_tokens is not None:
        effects.append(f"{c} prefilled {s.candidate_prefilled_tokens:,} prompt tokens against "
                       f"{s.baseline_prefilled_tokens:,}")
    if s.candidate_reuse is not None and s.baseline_reuse is not None:
        effects.append(f"by the server's own per-request counts, {_reused(s.candidate_reuse, c)} had at least half "
                       f"their prompt served from the cache, against {_reused(s.baseline_reuse, b)}")
    if s.candidate_evictions is not None and s.baseline_evictions is not None:
        exact = "" if s.candidate_evictions.exact and s.baseline_evictions.exact else " (events were missed: at least)"
        effects.append(f"{c} evicted {s.candidate_evictions.blocks_removed:,} cached KV blocks against "
                       f"{s.baseline_evictions.blocks_removed:,}{exact}")
    if s.candidate_queue_ms is not None:
        effects.append(f"{c}'s requests waited {s.candidate_queue_ms:.1f} ms in vLLM's queue on average against "
                       f"{s.baseline_queue_ms:.1f} ms")
    # The counts are the first run pair's; the TTFT beside them may be over every run pair.
    first = "in the first run pair, " if s.estimate is not None and s.estimate.runs > 1 else ""
    return f": {cause}{first}{' and '.join(effects)}" if effects else ""


def _reused(reuse, arm: str) -> str:
    return f"{reuse.reused:,} of {arm}'s {reuse.requests:,} {plural(reuse.requests, 'request')}"


@text.register
def _ttft(s: st.TtftStatement, name: Name = _plain) -> str:
    b, c = name(s.baseline), name(s.candidate)
    ttft = f"TTFT {s.stat} {s.baseline_ms:.1f} ms ({b}) → {s.candidate_ms:.1f} ms ({c}), {s.ratio:.3f}×"
    where = f" at {name(s.point)}" if s.point else ""
    if s.reading == st.WINDOW_STALL:
        return (f"{ttft}{where}: not comparable: {name(s.window_stall)}, and closing a profile window holds the engine "
                "while nsys stops collecting, so these timings include that stall (`kvtrace capture` now closes its "
                "windows before the timed traffic)")
    kernels = _prefill_kernels(s, name)
    e = s.estimate
    if e is not None:
        runs = f"over {e.runs} run pairs" if e.runs > 1 else "with one run per arm"
        verdict = {Verdict.NO_CHANGE: "no significant difference",
                   Verdict.TOO_FEW_RUNS: too_few_runs(e)}.get(e.verdict, e.verdict)
        ttft += (f" in the first run (descriptive: no interval); the mean {runs} {e.ratio:.3f}× "
                 f"{interval(e.low, e.high)}, {verdict}")
        if e.verdict == Verdict.TOO_FEW_RUNS and s.reading in _GAINS + (st.PREFIX_HIT_SLOWER,):
            return f"{ttft}{where}. What the arms differ in: {_mechanism(s, name, kernels)}{_budget(s, name)}"
        if e.verdict != Verdict.IMPROVEMENT and s.reading in _GAINS:
            return (f"{ttft}{where}: not a significant gain. What the arms differ in: {_mechanism(s, name, kernels)}"
                    f"{_budget(s, name)}")
    cached = (f"{s.candidate_cached_tokens:,} cached prompt tokens ({c}) against {s.baseline_cached_tokens:,} ({b})"
              if s.reading in (st.PREFIX_HIT, st.PREFIX_HIT_AND_FASTER, st.PREFIX_HIT_SLOWER, st.PREFILLED_DIFFERENT)
              else "")
    if s.reading == st.PREFIX_HIT:
        return (f"{ttft}{where} while {kernels}, with {cached}{_prefix_evidence(s, name)}. The TTFT gain is a "
                "capacity / prefix-hit effect (more of the prompt came from the prefix cache, so less prefill ran), "
                f"not a faster prefill kernel{_budget(s, name)}")
    if s.reading == st.PREFIX_HIT_AND_FASTER:
        return (f"{ttft}{where}, with {cached}{_prefix_evidence(s, name)}. Part of the TTFT gain is this capacity / "
                f"prefix-hit effect, not kernel speed; {kernels}, so TTFT credits neither alone{_budget(s, name)}")
    if s.reading == st.PREFIX_HIT_SLOWER:
        return (f"{ttft}{where}, with {cached}{_prefix_evidence(s, name)}. The extra prefix hits are a capacity / "
                f"prefix-hit win for {c}, not a faster kernel: its {kernels} over {s.prefill_compared_calls:,} paired "
                "calls, and the prefix hits did not make up for them: its TTFT is not measurably lower"
                f"{_budget(s, name)}")
    if s.reading == st.CAPACITY_EFFECT:
        although = f" although {kernels}" if kernels else ""
        return (f"{ttft}{where}{although}: {b} was capacity-bound there ({name(s.baseline_capacity)}) and "
                f"{c} was not, so the TTFT gain is a capacity effect (less queueing and recomputation after "
                "preemption)" + (", not a faster prefill kernel" if kernels else
                                 f"; {NOT_TRACED}, so the prefill kernels say nothing here"))
    if s.reading == st.OUTSIDE_KERNELS:
        return (f"{ttft}{where} although {kernels}, with the same cached prompt tokens: the gain comes from outside "
                "the prefill kernels (scheduling, queueing, preemptions), not a faster kernel")
    if s.reading == st.PREFILLED_DIFFERENT:
        return (f"{ttft}{where}, with {cached}: the arms prefilled different amounts, so TTFT mixes kernel speed "
                f"with prefix-cache hits{_budget(s, name)}")
    if s.reading == st.BUDGET:
        return f"{ttft}{where}; by vLLM's TTFT budget, {c} − {b}: {budget_words.reason_text(s.reason)}"
    same = s.baseline_cached_tokens is not None and s.candidate_cached_tokens is not None
    return f"{ttft}{where}" + (", same cached prompt tokens" if same else "")


def _budget(s: st.TtftStatement, name: Name) -> str:
    """The TTFT budget after a reading that names another mechanism: what carries the difference, measured."""
    if s.reason is None:
        return ""
    return (f"; by vLLM's TTFT budget, {name(s.candidate)} − {name(s.baseline)}: "
            f"{budget_words.reason_text(s.reason)}")


# The readings that explain a TTFT gain; where the estimate over every run finds none, only their mechanism is said.
_GAINS = (st.PREFIX_HIT, st.PREFIX_HIT_AND_FASTER, st.CAPACITY_EFFECT, st.OUTSIDE_KERNELS)


def _mechanism(s: st.TtftStatement, name: Name, kernels: str) -> str:
    """What a TTFT gain would be credited to, without claiming one."""
    b, c = name(s.baseline), name(s.candidate)
    if s.reading == st.CAPACITY_EFFECT:
        while_ = f", while {kernels}" if kernels else f" ({NOT_TRACED})"
        return (f"{b} was capacity-bound there ({name(s.baseline_capacity)}) and {c} was not{while_}: a "
                "capacity effect" + (", not a faster prefill kernel" if kernels else ""))
    if s.reading == st.OUTSIDE_KERNELS:
        return f"{kernels}, with the same cached prompt tokens: whatever changed is outside the prefill kernels"
    cached = (f"{s.candidate_cached_tokens:,} cached prompt tokens ({c}) against {s.baseline_cached_tokens:,} ({b})"
              f"{_prefix_evidence(s, name)}")
    if s.reading == st.PREFIX_HIT_AND_FASTER:
        return (f"{cached}, and {kernels}: a capacity / prefix-hit effect, not kernel speed, beside faster kernels, "
                "so TTFT credits neither alone")
    return f"{cached}, while {kernels}: a capacity / prefix-hit effect, not a faster prefill kernel"


@text.register
def _step_timeline(s: st.StepTimelineStatement, name: Name = _plain) -> str:
    r, b, c = s.row, name(s.baseline), name(s.candidate)
    kernels = f"{r.kernel_ratio:.3f}× {interval(r.kernel_low, r.kernel_high)}"
    span = f"{r.span_ratio:.3f}× {interval(r.span_low, r.span_high)}, {r.span_verdict}"
    held = held_text(r.held_by, r.steps, s.baseline, s.candidate, name)
    if r.host_reading == HELD_BY_WAIT:  # the span not measured as longer
        return (f"{r.phase} steps ({r.steps:,} paired): {c}'s host stayed in {r.candidate_waited_steps:,} of "
                f"{r.steps:,} steps until their GPU work was nearly done ({b}: {r.baseline_waited_steps:,}): {held}. "
                f"On the GPU its steps spanned {r.span_ratio:.3f}× {b}'s ({interval(r.span_low, r.span_high)}, "
                f"{r.span_verdict}) and its kernels ran {kernels}: what holds the host, not a slower kernel; how much "
                "time it adds needs more paired steps")
    why = (held if r.held_by else "something in them waits for the GPU, such as a synchronizing copy"
           if r.candidate_host_waits is None else "no copy or synchronization that only it made was recorded")
    return (f"{r.phase} steps ({r.steps:,} paired): {c}'s kernels ran {duration(r.candidate_kernel_ns)} per step "
            f"against {duration(r.baseline_kernel_ns)} ({b}), {kernels}, but its steps took "
            f"{duration(r.candidate_span_ns)} on the GPU from first kernel to last against "
            f"{duration(r.baseline_span_ns)} ({span}): {duration(r.candidate_idle_ns)} per step with no kernel of the "
            f"step running against {duration(r.baseline_idle_ns)}, and its host stayed in {r.candidate_waited_steps:,} "
            f"of {r.steps:,} steps until their GPU work was nearly done ({b}: {r.baseline_waited_steps:,}). The host no "
            f"longer launched ahead of the GPU in {c}'s steps ({why}): host-side time, not a slower kernel")


def held_text(kinds: tuple[WaitKind, ...], steps: int, baseline: str, candidate: str, name: Name = _plain) -> str:
    """What held the candidate's host (steps.StepPhase.held_by): the first kind of wait in full (count,
    what it is, host time, how many per step, the kernels launched around it, the baseline's count), the others
    in short. Empty without kinds."""
    if not kinds:
        return ""
    first, b = kinds[0], name(baseline)
    per_step = (f"{first.per_step_low:,}" if first.per_step_low == first.per_step_high
                else f"{first.per_step_low:,}–{first.per_step_high:,}")
    words = (f"{name(candidate)}'s host waited in {_wait(first, name)} ({name(first.call)}, "
             f"{duration(first.candidate_mean_ns)} each, {duration(first.candidate_ns)} in all), {per_step} per "
             f"step in {first.steps:,} of {steps:,} paired steps{_around(first, name)}; {b}: "
             + ("none" if not first.baseline_calls else
                f"{first.baseline_calls:,} ({duration(first.baseline_ns)} in all)"))
    others = [f"{_wait(k, name)} ({duration(k.candidate_mean_ns)} each; {b}: {k.baseline_calls:,})"
              for k in kinds[1:]]
    return words + (f"; also {', '.join(others)}" if others else "")


def _wait(kind: WaitKind, name: Name) -> str:
    """So many calls of a kind of wait: copies by direction, size and memory, synchronizations by their call."""
    calls = kind.candidate_calls
    if kind.copy_kind is None:
        return f"{calls:,} {name(kind.call)} {plural(calls, 'call')}"
    size = (f"{kind.bytes_low:,} bytes" if kind.bytes_low == kind.bytes_high
            else f"{kind.bytes_low:,}–{kind.bytes_high:,} bytes")
    return (f"{calls:,} {name(kind.copy_kind)} {plural(calls, 'copy', 'copies')} of {size} from "
            f"{name(kind.src_kind or 'unknown')} into {name(kind.dst_kind or 'unknown')} memory")


def _around(kind: WaitKind, name: Name) -> str:
    """The kernels launched just before and after most of these calls on their thread."""
    before, after = kind.before, kind.after
    if before is None and after is None:
        return ""
    which = "" if kind.around == kind.candidate_calls else f" ({kind.around:,} of them)"
    if before is None:
        return f", before a launch of {name(after)}{which}"
    if after is None:
        return f", after a launch of {name(before)}{which}"
    return f", between launches of {name(before)} and {name(after)}{which}"
