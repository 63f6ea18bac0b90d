"""What the numbers of a report say, one topic at a time (prefill, decode, append, capacity, TTFT), kept apart;
the TTFT guard rail that tells a capacity / prefix-hit effect from a faster prefill kernel."""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.analyzer import capacity, stats
from kvtrace.analyzer.compare import Diff
from kvtrace.analyzer.runs import RunArm
from kvtrace.analyzer.serving import ServingRow
from kvtrace.manifest import Point, parse_phase_name


@dataclass
class Statement:
    """What the numbers say on one topic (prefill, decode, append, capacity, ttft), kept apart from the others;
    a Finding, by contrast, says whether the two runs can be compared at all."""

    level: str  # ok, warning
    check: str  # the topic
    message: str


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


def _append_phase_statement(diff: Diff) -> Statement | None:
    """FlashInfer's append ranges hold the whole append path (FP8: a cast in separate kernels; NVFP4: one
    fused quantize-append), so the phase's GPU time per workload call is the fair comparison. A workload call
    launches one KV append kernel, so the append kernels the window kept count the calls whose time it kept
    (--skip-warmup, --last and --time trim every family alike)."""
    rows = [r for r in diff.phases if r.phase and (parsed := parse_phase_name(r.phase)) and parsed[0] == "append"]
    base = sum(r.baseline_total_ns for r in rows)
    cand = sum(r.candidate_total_ns for r in rows)
    calls = tuple(sum(getattr(r, f"{side}_calls") for r in rows if r.segment == "kv_append")
                  for side in ("baseline", "candidate"))
    if not rows or not base or not all(calls):
        return None
    b, c = base / calls[0], cand / calls[1]
    ratio = stats.ratio(b, c)
    return Statement("warning" if ratio > 1 + diff.threshold else "ok", "append",
                     f"append phase, every kernel in the kvtrace:append ranges (the FP8 cast and the NVFP4 packing "
                     f"included): {_fmt_ns(b)} ({diff.baseline.label}) → {_fmt_ns(c)} ({diff.candidate.label}) per "
                     f"append call over {calls[0]:,} and {calls[1]:,} calls, {ratio:.3f}×")


def statements(diff: Diff, serving: list[ServingRow], cap: capacity.Capacity | None, base: RunArm,
               cand: RunArm) -> list[Statement]:
    out = [s for s in (
        _segment_statement(diff, "prefill_attention", "prefill", "prefill attention kernels"),
        _segment_statement(diff, "decode_attention", "decode", "decode attention kernels"),
        _segment_statement(diff, "kv_append", "append", "KV append kernels"),
        _append_phase_statement(diff)) if s is not None]
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
    sweep = sweep_capacity_statement(serving, base, cand)
    if sweep is not None:
        out.append(sweep)
    out += ttft_guard_rail(diff, serving, base, cand)
    return out


def _prefix_evidence(row: ServingRow, base: RunArm, cand: RunArm) -> str:
    """What made the candidate prefill less: its KV pool holding the shared prefixes the baseline's could not,
    the prompt tokens each arm prefilled, and the time requests waited in vLLM's queue."""
    b, c = row.baseline, row.candidate
    cause, effects = "", []
    try:
        point = Point.parse(row.point)
    except (ValueError, TypeError):
        point = None
    pools = (base.kv_cache_tokens, cand.kv_cache_tokens)
    if point is not None and point.prefix_len and point.num_prefixes and all(pools):
        shared = point.prefix_len * point.num_prefixes
        if pools[1] >= shared > pools[0]:
            cause = (f"the {point.num_prefixes} shared prefixes ({shared:,} tokens) fit {cand.label}'s "
                     f"{pools[1]:,}-token KV cache and not {base.label}'s {pools[0]:,}, so ")
    if None not in (b.prompt_tokens, c.prompt_tokens, b.cached_prompt_tokens, c.cached_prompt_tokens):
        effects.append(f"{cand.label} prefilled {c.prompt_tokens - c.cached_prompt_tokens:,} prompt tokens against "
                       f"{b.prompt_tokens - b.cached_prompt_tokens:,}")
    if b.queue_ms is not None and c.queue_ms is not None:
        effects.append(f"{cand.label}'s requests waited {c.queue_ms:.1f} ms in vLLM's queue on average against "
                       f"{b.queue_ms:.1f} ms")
    return f": {cause}{' and '.join(effects)}" if effects else ""


def ttft_guard_rail(diff: Diff, serving: list[ServingRow], base: RunArm, cand: RunArm) -> list[Statement]:
    """Two prefill statements that can both be true: a TTFT gain while the candidate served more of its prompts
    from the prefix cache is a capacity / prefix-hit effect, not a faster kernel, when its prefill kernels are
    not faster; when they are faster too, TTFT credits neither alone."""
    prefill = next((r for r in diff.segments if r.segment == "prefill_attention"), None)
    verdict = None
    if prefill is not None and prefill.ratio is not None:
        # Arms that prefilled different amounts leave unpaired calls ("different work"); the matched calls
        # still say whether the kernel is faster.
        verdict = prefill.paired_verdict if prefill.verdict == stats.DIFFERENT_WORK else prefill.verdict
    not_faster = verdict in (stats.REGRESSION, stats.NO_CHANGE)
    kernels = ("" if verdict is None else
               f"prefill attention kernels regressed {prefill.ratio:.3f}× per call" if verdict == stats.REGRESSION else
               f"prefill attention kernels showed no significant change per call ({prefill.ratio:.3f}×)"
               if verdict == stats.NO_CHANGE else
               f"{cand.label}'s prefill attention kernels are also faster per matched call ({prefill.ratio:.3f}× over "
               f"{prefill.compared_calls:,} paired calls)")
    out = []
    for row in serving:
        if not (row.baseline and row.candidate and row.ttft_ratio is not None):
            continue
        b_cached, c_cached = row.baseline.cached_prompt_tokens, row.candidate.cached_prompt_tokens
        cached_differ = b_cached is not None and c_cached is not None and b_cached != c_cached
        more_hits = cached_differ and c_cached > b_cached
        improved = row.ttft_ratio < 1 - diff.threshold
        where = f" at {row.point}" if len(serving) > 1 else ""
        ttft = (f"TTFT {row.ttft_stat} {getattr(row.baseline.ttft_ms, row.ttft_stat):.1f} ms ({base.label}) → "
                f"{getattr(row.candidate.ttft_ms, row.ttft_stat):.1f} ms ({cand.label}), {row.ttft_ratio:.3f}×")
        cached = (f"{c_cached:,} cached prompt tokens ({cand.label}) against {b_cached:,} ({base.label})"
                  if cached_differ else "")
        if improved and more_hits and not_faster:
            out.append(Statement("warning", "ttft",
                               f"{ttft}{where} while {kernels}, with {cached}"
                               f"{_prefix_evidence(row, base, cand)}. The TTFT gain is a capacity / prefix-hit "
                               "effect (more of the prompt came from the prefix cache, so less prefill ran), not a "
                               "faster prefill kernel"))
        elif improved and more_hits and verdict == stats.IMPROVEMENT:
            out.append(Statement("warning", "ttft",
                               f"{ttft}{where}, with {cached}{_prefix_evidence(row, base, cand)}. Part of the TTFT "
                               f"gain is this capacity / prefix-hit effect, not kernel speed; {kernels}, so TTFT "
                               "credits neither alone"))
        elif improved and not_faster and row.baseline.capacity and not row.candidate.capacity:
            out.append(Statement("warning", "ttft",
                               f"{ttft}{where} although {kernels}: {base.label} was capacity-bound there "
                               f"({row.baseline.capacity}) and {cand.label} was not, so the TTFT gain is a capacity "
                               "effect (less queueing and recomputation after preemption), not a faster prefill "
                               "kernel"))
        elif improved and not_faster and not cached_differ:
            out.append(Statement("warning", "ttft",
                               f"{ttft}{where} although {kernels}, with the same cached prompt tokens: the gain comes "
                               "from outside the prefill kernels (scheduling, queueing, preemptions), not a faster "
                               "kernel"))
        elif cached_differ:
            out.append(Statement("warning", "ttft",
                               f"{ttft}{where}, with {cached}: the arms prefilled different amounts, so TTFT "
                               "mixes kernel speed with prefix-cache hits"))
        else:
            out.append(Statement("ok", "ttft", f"{ttft}{where}"
                               + (", same cached prompt tokens" if b_cached is not None and c_cached is not None
                                  else "")))
    return out


def sweep_capacity_statement(serving: list[ServingRow], base: RunArm, cand: RunArm) -> Statement | None:
    """Where each arm of a sweep first reaches capacity, per context length."""
    if len(serving) < 2:
        return None
    parts = []
    for side, arm in (("baseline", base), ("candidate", cand)):
        ran = [row for row in serving if getattr(row, side)]
        first = [row for row in ran if getattr(row, f"{side}_first_capacity")]
        parts.append(f"{arm.label} first reaches capacity at " + "; ".join(
            f"{row.point} ({getattr(row, side).capacity})" for row in first) if first else
            f"{arm.label} reaches capacity at none of its {len(ran)} points")
    return Statement("ok", "capacity", "sweep: " + ". ".join(parts))
