"""Words for a point's TTFT budget and what carries its difference (analyzer.budget.Reason), as the serving report and
the matrix both give them: one reason for one point, whichever output shows it; and the matrix's pool and budget
claims (analyzer.claims.PoolClaim, BudgetClaim)."""

from __future__ import annotations

from typing import Callable

from kvtrace.analyzer import budget as budget_lib, claims as claims_lib, kv_pool
from kvtrace.analyzer.budget import PART_WORDS, PartDelta, Reason
from kvtrace.analyzer.budget_trace import SEGMENT_WORDS
from kvtrace.analyzer.render.units import rows_text
from kvtrace.text import plural

Name = Callable[[str], str]


def signed_ms(value: float) -> str:
    return ("+" if value >= 0.05 else "−" if value <= -0.05 else "±") + f"{abs(value):,.1f} ms"


def _number(value: float) -> str:
    """One decimal, with a minus sign; never "-0.0"."""
    text = f"{abs(value):,.1f}"
    return f"−{text}" if value < 0 and text.strip("0.,") else text


def delta(part: PartDelta) -> str:
    """"+97.1 ms [60.2, 134.0]": candidate − baseline, with its interval over run pairs where there is one."""
    text = signed_ms(part.delta_ms)
    if part.low_ms is not None:
        text += f" [{_number(part.low_ms)}, {_number(part.high_ms)}]"
    return text


def parts_text(why: Reason, baseline: str, candidate: str) -> str:
    """Each arm's TTFT and its parts: "fp8 162.0 = 0.0 queue + 129.2 prefill + 32.4 rest ms" (the labels as the
    caller escaped them)."""
    arms = []
    for label, side in ((baseline, "baseline_ms"), (candidate, "candidate_ms")):
        values = [getattr(why.budget.part(p), side) for p in ("ttft", *budget_lib.TTFT_PARTS)]
        arms.append(f"{label} {values[0]:,.1f} = {values[1]:,.1f} queue + {values[2]:,.1f} prefill + "
                    f"{values[3]:,.1f} rest ms")
    return "; ".join(arms)


def steps_text(why: Reason) -> str:
    """What the traced prefill steps say, or that no trace covers the point."""
    if why.steps is None:
        return why.trace_note or budget_lib.PREFILL_TIME
    steps = why.steps
    parts = [f"{SEGMENT_WORDS[c]} {signed_ms(steps.delta_ns(c) / 1e6)}" for c in steps.components
             if abs(steps.delta_ns(c)) >= 0.05e6][:3]
    waits = ""
    if steps.baseline.host_waits is not None and steps.candidate.host_waits is not None:
        waits = (f"; synchronizing host calls per step {steps.baseline.host_waits:,.1f} against "
                 f"{steps.candidate.host_waits:,.1f}")
    return (f"in the traced prefill and mixed steps both arms ran alike ({steps.baseline.steps} "
            f"{plural(steps.baseline.steps, 'step')} each), "
            f"the GPU span per step {signed_ms(steps.delta_ns('span') / 1e6)}: " + ", ".join(parts) + waits)


def reason_text(why: Reason) -> str:
    """"prefill time +97.1 ms of +65.3 ms TTFT (queue time −49.5 ms, the rest +17.7 ms); kernels not traced at this
    point": the part that carries the difference first, then the other parts, then the traced steps."""
    carrier = why.carrier
    others = ", ".join(f"{PART_WORDS[p]} {delta(why.budget.part(p))}" for p in budget_lib.TTFT_PARTS
                       if p != carrier.part)
    runs = f", {why.budget.runs} run pairs" if why.budget.runs > 1 else ", one run pair"
    text = f"{PART_WORDS[carrier.part]} {delta(carrier)} of {delta(why.budget.ttft)} TTFT ({others}{runs})"
    if not why.budget.carrier_measured:
        return f"{budget_lib.UNMEASURED} (the largest move: {text})"
    if carrier.part == "prefill":
        text += f"; {steps_text(why)}"
    return text


def cell(why: Reason | None) -> str:
    """The table's short form: "prefill +97.1 of +65.3 ms · not traced"."""
    if why is None:
        return "–"
    carrier = why.carrier
    text = f"{carrier.part} {signed_ms(carrier.delta_ms)} of {signed_ms(why.budget.ttft.delta_ms)}"
    if not why.budget.carrier_measured:
        return f"{budget_lib.UNMEASURED} (largest: {text})"
    if carrier.part == "prefill":
        text += (" · not traced" if why.steps is None else
                 f" · traced: {SEGMENT_WORDS[why.step_carrier]}" if why.step_carrier else " · traced: no one part")
    return text


def pool_text(claim: claims_lib.PoolClaim, name: Name) -> str:
    """Each scenario's pools, grouped where they are the same, then the projection of the capped runs' capacity-bound
    points to the default pool."""
    b, c = name(claim.baseline), name(claim.candidate)
    alike: dict[tuple, list] = {}
    for pool in claim.pools:
        key = (pool.baseline.tokens, pool.candidate.tokens, kv_pool.size_words(pool.baseline),
               kv_pool.size_words(pool.candidate))
        alike.setdefault(key, []).extend(pool.rows)
    parts = []
    for (tokens_b, tokens_c, how_b, how_c), rows in alike.items():
        how = how_b if how_b == how_c else f"{how_b} for {b}, {how_c} for {c}"
        parts.append(f"{_tokens(tokens_b)} for {b} and {_tokens(tokens_c)} for {c} at {rows_text(rows)} "
                     f"({name(how)})")
    text = f"KV pool per arm: {'; '.join(parts)}."
    if claim.projections:
        default = claim.default_tokens
        by_arm: dict[str, dict[tuple, list[int]]] = {}
        for found in claim.projections:
            at = (found.projection.binds_near, found.projection.tokens_per_request)
            by_arm.setdefault(found.projection.arm, {}).setdefault(at, []).append(found.row)
        projected = "; ".join(
            f"{name(arm)} would bind near concurrency " + " and near ".join(
                f"{near:,} at {per:,} tokens per request ({rows_text(rows)})" for (near, per), rows in shapes.items())
            for arm, shapes in by_arm.items())
        text += (f" The capacity-bound points bind only under that cap: with vLLM's default pool, as "
                 f"{name(claim.default_from)} reported it on the same GPU ({_tokens(default[0])} for {b}, "
                 f"{_tokens(default[1])} for {c}), {projected}.")
    elif any(not p.baseline.default for p in claim.pools):
        text += (" No run here reported vLLM's default pool on this GPU and model shape, so where the capacity-bound "
                 "points would bind without the cap is not projected (`kvtrace capacity` gives the tokens per GiB).")
    return text


def _tokens(tokens: int | None) -> str:
    return "not recorded" if tokens is None else f"{tokens:,} tokens"


def claim_text(claim: claims_lib.BudgetClaim, name: Name) -> str:
    why = claim.reason
    return (f"TTFT budget at {name(claim.point)} ({rows_text(claim.rows)}), {name(claim.candidate)} − "
            f"{name(claim.baseline)}: {reason_text(why)} "
            f"({parts_text(why, name(claim.baseline), name(claim.candidate))}).")
