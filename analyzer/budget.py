"""The TTFT budget of a traffic point, from the server: each arm's mean time to first token split into the time a
request queued, the time it was prefilled, and the rest, from vLLM's own request histograms; the difference between
the arms per part, over run pairs; and which part carries the TTFT difference (the reason a point is won).

vLLM 0.33 observes the histograms at these moments (vllm/v1/metrics/stats.py, loggers.py):
- time_to_first_token: in the API server (the frontend), wall clock from the request's arrival there to the
  frontend's processing of the engine output that holds its first token;
- request_queue_time: in the engine core, from the request's QUEUED event to its first SCHEDULED event;
- request_prefill_time: in the engine core, from the first SCHEDULED event to the timestamp of the engine output
  that holds the first token (made after the step's GPU work returned): the prefill steps, preemptions during
  prefill and any wait between chunks;
- request_decode_time and request_inference_time: first token to last, and first SCHEDULED to last token.
So the rest, TTFT − queue − prefill, is what happens outside the engine core's two intervals: the frontend's input
processing and tokenization, the hand-over to the engine core, and the first token's way back to the frontend.

Every number is a mean per request over the point's requests (Δsum / Δcount between the scrapes before and after
the point's traffic, as the capture recorded them); a difference is candidate − baseline per run pair, averaged over
run pairs, with a t interval over them where there are two or more (the run pair is the unit, as for the serving
intervals). Where a trace covers the point's own traffic, analyzer/budget_trace splits the prefill steps further.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvtrace.analyzer.stats import distributions

if TYPE_CHECKING:  # budget_trace reads its traces and calls reason(): an annotation only here
    from kvtrace.analyzer.budget_trace import TracedSteps

# vLLM's request histograms (seconds) that make the budget: its part -> histogram.
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
              "prefill": "vllm:request_prefill_time_seconds", "decode": "vllm:request_decode_time_seconds",
              "inference": "vllm:request_inference_time_seconds"}
# TTFT = queue + prefill + rest, per request on average.
TTFT_PARTS = ("queue", "prefill", "rest")
PART_WORDS = {"ttft": "TTFT", "queue": "queue time", "prefill": "prefill time",
              "rest": "the rest (frontend and hand-over)", "decode": "decode time", "inference": "inference time"}


@dataclass(frozen=True)
class ArmBudget:
    """One arm at one point in one run: means per request, milliseconds."""

    requests: int
    ttft_ms: float
    queue_ms: float
    prefill_ms: float
    decode_ms: float | None
    inference_ms: float | None

    @property
    def rest_ms(self) -> float:
        return self.ttft_ms - self.queue_ms - self.prefill_ms

    def value(self, part: str) -> float | None:
        return self.rest_ms if part == "rest" else getattr(self, f"{part}_ms")


def arm_budget(histograms: dict) -> ArmBudget | None:
    """The budget of one point's histogram deltas ({name: {count, sum}}); None where TTFT, queue or prefill time is
    missing, or where they counted different requests (a request that had its first token but did not finish
    inside the scrapes)."""
    means, counts = {}, {}
    for part, name in HISTOGRAMS.items():
        entry = histograms.get(name) or {}
        count, total = entry.get("count"), entry.get("sum")
        if isinstance(count, (int, float)) and isinstance(total, (int, float)) and count > 0 \
                and math.isfinite(total):
            means[part], counts[part] = 1000.0 * total / count, count
    if any(part not in means for part in ("ttft", "queue", "prefill")):
        return None
    if len({counts[part] for part in ("ttft", "queue", "prefill")}) != 1:
        return None
    return ArmBudget(requests=int(counts["ttft"]), ttft_ms=means["ttft"], queue_ms=means["queue"],
                     prefill_ms=means["prefill"], decode_ms=means.get("decode"), inference_ms=means.get("inference"))


@dataclass(frozen=True)
class PartDelta:
    """One part of the budget, both arms' means over their runs and candidate − baseline over run pairs."""

    part: str  # ttft, queue, prefill, rest, decode, inference
    baseline_ms: float
    candidate_ms: float
    delta_ms: float
    low_ms: float | None  # the t interval over run pairs; None with one run pair
    high_ms: float | None


def part_delta(part: str, pairs: Sequence[tuple[ArmBudget, ArmBudget]], confidence: float = 0.95) -> PartDelta | None:
    values = [(b.value(part), c.value(part)) for b, c in pairs]
    if not values or any(v is None for pair in values for v in pair):
        return None
    base, cand = (np.array(side, dtype=np.float64) for side in zip(*values))
    deltas = cand - base
    low = high = None
    if deltas.size >= 2:
        spread = distributions.t_quantile(0.5 + confidence / 2, deltas.size - 1) * float(deltas.std(ddof=1)) \
            / math.sqrt(deltas.size)
        low, high = float(deltas.mean()) - spread, float(deltas.mean()) + spread
    return PartDelta(part, float(base.mean()), float(cand.mean()), float(deltas.mean()), low, high)


@dataclass(frozen=True)
class PointBudget:
    """The TTFT budget of one traffic point over its run pairs: TTFT and its parts (queue, prefill, rest), then decode
    and inference time where recorded; `carrier`: the part of TTFT that carries the TTFT difference (the largest
    move in its direction among the parts whose interval clears zero that way, else the largest move, unmeasured),
    with its share of it."""

    runs: int
    parts: tuple[PartDelta, ...]
    carrier: str
    share: float | None  # carrier's delta / TTFT's delta (above 1 where other parts moved the other way)
    # Whether the carrier's interval clears zero in TTFT's direction and it holds at least MOST of the TTFT difference:
    # a move inside its interval explains nothing, a sure move of a small share little.
    carrier_measured: bool = True

    def part(self, name: str) -> PartDelta | None:
        return next((p for p in self.parts if p.part == name), None)

    @property
    def ttft(self) -> PartDelta:
        return self.part("ttft")


def point_budget(pairs: Sequence[tuple[ArmBudget | None, ArmBudget | None]],
                 confidence: float = 0.95) -> PointBudget | None:
    """A point's budget over its run pairs (baseline's, candidate's per run pair); None where a run pair lacks one."""
    if not pairs or any(None in pair for pair in pairs):
        return None
    parts = tuple(p for p in (part_delta(name, pairs, confidence) for name in ("ttft", *TTFT_PARTS, "decode",
                                                                                 "inference")) if p is not None)
    ttft = next(p for p in parts if p.part == "ttft")
    sign = 1.0 if ttft.delta_ms >= 0 else -1.0
    candidates = [p for p in parts if p.part in TTFT_PARTS]
    # On real runs (H100, the capacity matrix's cold prefill) queue time moved most with an interval across zero
    # while prefill time moved less but surely: the sure move is the one that explains.
    measured = [p for p in candidates if p.low_ms is not None and min(sign * p.low_ms, sign * p.high_ms) > 0]
    # The carrier must hold most of the difference by itself: a sure move of a tenth of it explains a tenth.
    largest = max(measured, key=lambda p: sign * p.delta_ms) if measured else None
    explained = largest is not None and bool(ttft.delta_ms) and largest.delta_ms / ttft.delta_ms >= MOST
    carrier = largest if explained else max(candidates, key=lambda p: sign * p.delta_ms)
    share = carrier.delta_ms / ttft.delta_ms if ttft.delta_ms else None
    return PointBudget(runs=len(pairs), parts=parts, carrier=carrier.part, share=share, carrier_measured=explained)


def pooled(budgets: Sequence[tuple[tuple[ArmBudget, ArmBudget], ...]], confidence: float = 0.95) -> PointBudget | None:
    """One budget over the run pairs of several measurements of one point (each a tuple of run pairs)."""
    return point_budget([pair for pairs in budgets for pair in pairs], confidence)


# What carries a point's TTFT difference (Reason.cause), the words a won point's cause is given in.
CAPACITY = "avoided capacity limits"  # queue time carries it: the loser's requests waited for room
FASTER_KERNEL = "faster kernel"  # prefill time carries it, and in the traced steps one segment's kernels do
HOST_TIME = "less host-held time"  # prefill time carries it, and in the traced steps the GPU waiting on the host does
PREFILL_TIME = "shorter prefill time"  # prefill time carries it; the traces do not say which component, or none cover
REST_TIME = "less time outside the engine core"  # the rest carries it: frontend processing and hand-over
UNMEASURED = "no measured part holds most of it"  # no part clears zero and holds MOST of the move
_CAUSE_OF_PART = {"queue": CAPACITY, "prefill": PREFILL_TIME, "rest": REST_TIME}
# A part of the budget, or a component of the traced steps, carries a difference when it holds at least this share.
MOST = 0.5


@dataclass(frozen=True)
class Reason:
    """Why a point's TTFT differs, measured at that very point: the budget's part that carries the difference, and,
    where a trace covers the point's own traffic, which component of the traced prefill steps carries the span's
    difference (`step_carrier`: "host" or a segment, None where none holds most of it). `cause` names a kernel or
    the host only where that component also holds most of the prefill part's difference."""

    budget: PointBudget
    steps: TracedSteps | None
    trace_note: str | None  # why no split: budget_trace.NOT_TRACED, NO_PREFILL_STEPS, NO_MATCHED_STEPS, MIXED_TRACE
    step_carrier: str | None
    cause: str

    @property
    def carrier(self) -> PartDelta:
        return self.budget.part(self.budget.carrier)

    def stack(self, side: str) -> ArmStack:
        """One arm's ("baseline" or "candidate") TTFT as stacked parts: queue, prefill, the rest; where traces cover
        the point, prefill split into the traced steps' kernels, the GPU waiting on the host in them, and the
        prefill time outside the traced step spans."""
        value = {p: getattr(self.budget.part(p), f"{side}_ms") for p in TTFT_PARTS}
        if self.steps is None:
            return _stacked([("queue", value["queue"]), ("prefill", value["prefill"]), ("rest", value["rest"])])
        arm = getattr(self.steps, side)
        kernels = sum(arm.kernel_ns.values()) / 1e6
        host = arm.host_ns / 1e6
        scale = min(1.0, value["prefill"] / (kernels + host)) if kernels + host > 0 else 0.0
        kernels, host = kernels * scale, host * scale  # a step span longer than the prefill time fits within it
        return _stacked([("queue", value["queue"]), ("kernels", kernels), ("host", host),
                         ("untraced", value["prefill"] - kernels - host), ("rest", value["rest"])])

    @property
    def stack_top_ms(self) -> float:
        """The taller arm's stack."""
        return max(self.stack("baseline").top_ms, self.stack("candidate").top_ms)


@dataclass(frozen=True)
class StackPart:
    part: str  # queue, prefill, rest; or, in traced prefill's place: kernels, host, untraced
    ms: float
    bottom_ms: float  # the parts below it together


@dataclass(frozen=True)
class ArmStack:
    """One arm's TTFT budget as parts from the bottom (Reason.stack)."""

    parts: tuple[StackPart, ...]
    top_ms: float


def _stacked(parts: list[tuple[str, float]]) -> ArmStack:
    stacked, bottom = [], 0.0
    for part, ms in parts:
        stacked.append(StackPart(part, ms, bottom))
        bottom += ms
    return ArmStack(tuple(stacked), bottom)


def reason(point_budget_: PointBudget | None, steps: TracedSteps | None, trace_note: str | None) -> Reason | None:
    if point_budget_ is None:
        return None
    part = point_budget_.part(point_budget_.carrier)
    cause = _CAUSE_OF_PART[part.part] if point_budget_.carrier_measured else UNMEASURED
    step_carrier = None
    if steps is not None and part.part == "prefill" and point_budget_.carrier_measured:
        sign = 1.0 if part.delta_ms >= 0 else -1.0
        span = sign * steps.delta_ns("span") / 1e6
        top = max(steps.components, key=lambda c: sign * steps.delta_ns(c))
        moved = sign * steps.delta_ns(top) / 1e6
        if span > 0 and moved >= MOST * span:
            step_carrier = top
            if moved >= MOST * abs(part.delta_ms):
                cause = HOST_TIME if top == "host" else FASTER_KERNEL if top != "other" else PREFILL_TIME
    return Reason(budget=point_budget_, steps=steps, trace_note=trace_note, step_carrier=step_carrier, cause=cause)
