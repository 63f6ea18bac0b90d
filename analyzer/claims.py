"""The claims of a matrix's decision: one frozen result per kind of sentence, with the numbers it states and the rows it
cites, built from the point table (analyzer/matrix) and worded by analyzer/render/matrix.py; the markdown, the
terminal and the JSON read the same objects.

Per pair of KV formats, in order: what the decision holds for (EnvironmentClaim), the KV pool each arm ran with and
its projection (PoolClaim), each point's TTFT budget (BudgetClaim), what the kernel rows measured (MeasuredClaim),
each decided point (CapacityClaim, ColdPrefillClaim, DecodeClaim, PrefixClaim, PointClaim, all over one
PointOutcome), residency (ResidencyClaim), host-held steps (StepsClaim), the kernel costs of runs without serving
(KernelsClaim), points whose measurements disagree (DisagreeClaim), the choice (ChoiceClaim) and quality
(QualityClaim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvtrace import kv_formats
from kvtrace.analyzer import kv_pool
from kvtrace.analyzer.budget import Reason
from kvtrace.analyzer.kv_pool import ArmPool, Projection
from kvtrace.analyzer.reuse import Evictions, PrefixReuse
from kvtrace.analyzer.statements import APPEND_PHASE, KernelStatement
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.analyzer.steps import StepPhase
from kvtrace.errors import KvtraceError

if TYPE_CHECKING:
    from kvtrace.analyzer.matrix import Environment, MatrixPoint, Scenario
    from kvtrace.analyzer.report import Report

# MatrixPoint.winner besides an arm's side: the interval holds no change or the ratio is within the threshold; or
# a win beyond it that nothing kvtrace measured accounts for, which is no choice.
NO_CLEAR_WINNER = "no significant difference"
NOT_EXPLAINED = "not explained"
PREFIX_HITS = "more prefix hits"
# What the server measured of the capacity mechanism, per arm (analyzer.serving.ServingMetrics' names).
SERVER_MEASURES = ("preemptions", "peak_running", "peak_kv_usage", "queue_ms")
# The split-KV merge kernel's family name (recipes/flashinfer.toml, split-kv-merge): it reads no KV cache.
SPLIT_KV_MERGE = "MergeStates"
# The head's rows the measured summary walks through, in the head's order.
MEASURED_SUBJECTS = ("prefill_attention", "decode_attention", "kv_append", APPEND_PHASE)


@dataclass(frozen=True)
class KernelVerdict:
    """An objective's kernels over the calls of the traces that cover a point (what a faster kernel rests on off TTFT):
    candidate / baseline per matched call, its interval and the segment's paired verdict."""

    segment: str
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    no_interval: str | None
    verdict: Verdict
    compared_calls: int


@dataclass(frozen=True)
class KernelCost:
    """A row of a scenario's head as a claim states it: what it is (subject, workload point), its ratio and interval,
    its verdict, and why it has no ratio; `row`: the matrix row it is cited by, where that is not the claim's own."""

    subject: str
    point: str
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    no_interval: str | None
    verdict: Verdict
    reason: str | None
    row: int | None = None

    @classmethod
    def of(cls, k: KernelStatement, row: int | None = None) -> KernelCost:
        return cls(k.subject, k.point, k.ratio, k.ci_low, k.ci_high, k.no_interval, k.verdict, k.reason, row)


def point_kernels(result: Report, segment: str) -> list[KernelStatement]:
    """The report's kernel statements of a segment (one per workload point of the diff's head)."""
    return [s for s in result.statements if isinstance(s, KernelStatement) and s.subject == segment]


@dataclass(frozen=True)
class EnvironmentClaim:
    kind: ClassVar[str] = "environment"
    rows: tuple[int, ...]
    baseline: str
    candidate: str
    environments: tuple[Environment, ...]  # each distinct one once


@dataclass(frozen=True)
class ScenarioPool:
    scenario: str
    rows: tuple[int, ...]
    baseline: ArmPool
    candidate: ArmPool


@dataclass(frozen=True)
class PointProjection:
    row: int
    point: str
    projection: Projection


@dataclass(frozen=True)
class PoolClaim:
    kind: ClassVar[str] = "pool"
    rows: tuple[int, ...]
    baseline: str
    candidate: str
    pools: tuple[ScenarioPool, ...]
    # The default pool's tokens per arm, and the scenario that reported them (None: no run here had one).
    default_tokens: tuple[int | None, int | None]
    default_from: str | None
    projections: tuple[PointProjection, ...]  # capacity-bound points of capped runs


@dataclass(frozen=True)
class BudgetClaim:
    kind: ClassVar[str] = "budget"
    rows: tuple[int, ...]
    scenario: str
    baseline: str
    candidate: str
    point: str
    reason: Reason


@dataclass(frozen=True)
class MeasuredPhase:
    """One row of the head over every scenario of a pair of formats."""

    subject: str
    low: float
    high: float
    verdicts: tuple[tuple[Verdict, int], ...]  # (verdict, rows with it), in first-seen order
    kernels: tuple[str, ...]
    queries: tuple[tuple[str | None, str | None], ...]  # (baseline's, candidate's query dtype)
    different_kernels: bool
    rows: tuple[int, ...]

    @property
    def one_ratio(self) -> bool:
        """Whether its scenarios' ratios agree to the three decimals a ratio is printed with (half a last digit)."""
        return abs(self.high - self.low) < 5e-4


@dataclass(frozen=True)
class MeasuredClaim:
    kind: ClassVar[str] = "measured"
    rows: tuple[int, ...]
    baseline: str
    candidate: str
    narrower: str | None  # "baseline", "candidate" or None: which format moves fewer bytes
    phases: tuple[MeasuredPhase, ...]
    decode_expectation: str | None  # "held", "did not hold", "held at some rows only", None


@dataclass(frozen=True)
class ServerRuns:
    """SERVER_MEASURES per run, (baseline's values, candidate's values), in row then repeat order."""

    preemptions: tuple[tuple, tuple]
    peak_running: tuple[tuple, tuple]
    peak_kv_usage: tuple[tuple, tuple]
    queue_ms: tuple[tuple, tuple]


def server_runs(points: list[MatrixPoint]) -> ServerRuns:
    return ServerRuns(**{key: tuple(tuple(getattr(pair[side], key) for q in points for pair in q.serving.run_pairs)
                                    for side in (0, 1)) for key in SERVER_MEASURES})


@dataclass(frozen=True)
class PointOutcome:
    """A decided point's numbers: the objective's estimate (pooled where the point was measured more than once), who
    wins and why, and what its own run's server measured (the first run's, per arm)."""

    baseline: str
    candidate: str
    point: str
    objective: str
    ratio: float
    ci_low: float | None
    ci_high: float | None
    band: float
    band_basis: str
    runs: int
    threshold: float
    winner: str
    apparent: str | None
    causes: tuple[str, ...]
    baseline_capacity: str | None
    candidate_capacity: str | None
    crossover: bool
    kernels: tuple[KernelVerdict, ...]
    reason: Reason | None
    cached_prompt_tokens: tuple[int | None, int | None]
    queue_ms: tuple[float | None, float | None]
    preemptions: tuple[int | None, int | None]
    peak_running: tuple[float | None, float | None]
    peak_kv_usage: tuple[float | None, float | None]
    server_runs: ServerRuns  # every run's measures: the point's own, or every pooled row's
    server_rows: tuple[int, ...] = ()  # a pooled point: the row of each run in server_runs
    pooled_rows: tuple[int, ...] = ()  # a pooled point: every row it pools
    pooled_directories: int = 0
    own_runs: int | None = None  # a pooled point: the run pairs of the row whose first-run numbers these are
    differing: tuple[tuple[int, PointOutcome], ...] = ()  # other pooled rows whose own run credits the win otherwise


def outcome(p: MatrixPoint, base: str, cand: str, objective: str, threshold: float) -> PointOutcome:
    b, c = p.serving.baseline, p.serving.candidate
    return PointOutcome(
        baseline=base, candidate=cand, point=p.point, objective=objective, ratio=p.ratio, ci_low=p.estimate.low,
        ci_high=p.estimate.high, band=p.estimate.band, band_basis=p.estimate.band_basis, runs=p.estimate.runs,
        threshold=threshold, winner=p.winner, apparent=p.apparent, causes=tuple(p.causes),
        baseline_capacity=p.baseline_capacity, candidate_capacity=p.candidate_capacity, crossover=p.crossover,
        kernels=tuple(p.kernel_verdicts), reason=p.reason,
        cached_prompt_tokens=(b.cached_prompt_tokens, c.cached_prompt_tokens), queue_ms=(b.queue_ms, c.queue_ms),
        preemptions=(b.preemptions, c.preemptions), peak_running=(b.peak_running, c.peak_running),
        peak_kv_usage=(b.peak_kv_usage, c.peak_kv_usage), server_runs=server_runs([p]))


@dataclass(frozen=True)
class _PointClaim:
    rows: tuple[int, ...]
    scenario: str
    outcome: PointOutcome


@dataclass(frozen=True)
class CapacityClaim(_PointClaim):
    """A point where capacity binds for one arm or both."""

    kind: ClassVar[str] = "capacity"


@dataclass(frozen=True)
class ColdPrefillClaim(_PointClaim):
    """A point of prefill-only traffic, beside its prefill kernels."""

    kind: ClassVar[str] = "cold-prefill"
    phase_kernels: tuple[KernelCost, ...] = ()


@dataclass(frozen=True)
class DecodeClaim(_PointClaim):
    """A point of a decode-heavy scenario, beside its decode kernels."""

    kind: ClassVar[str] = "decode"
    phase_kernels: tuple[KernelCost, ...] = ()


@dataclass(frozen=True)
class PrefixClaim(_PointClaim):
    kind: ClassVar[str] = "prefix"


@dataclass(frozen=True)
class PointClaim(_PointClaim):
    kind: ClassVar[str] = "point"


POINT_CLAIMS = (CapacityClaim, ColdPrefillClaim, DecodeClaim, PrefixClaim, PointClaim)


@dataclass(frozen=True)
class ResidencyClaim:
    kind: ClassVar[str] = "residency"
    rows: tuple[int, ...]
    scenario: str
    baseline: str
    candidate: str
    point: str
    objective: str
    reuse: tuple[PrefixReuse, PrefixReuse]
    cached_share: tuple[float, float]
    evictions: tuple[Evictions | None, Evictions | None]
    cold_prefill_kernel: KernelCost | None  # the group's matched cold prefill's prefill attention row
    winner: str | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    runs: int | None
    pooled_with: tuple[int, ...]
    pooled_directories: int
    undecided: str | None  # why the point is not decided (MatrixPoint.undecided), else None


@dataclass(frozen=True)
class StepsClaim:
    kind: ClassVar[str] = "steps"
    rows: tuple[int, ...]
    scenario: str
    baseline: str
    candidate: str
    step: StepPhase


@dataclass(frozen=True)
class KernelsClaim:
    kind: ClassVar[str] = "kernels"
    rows: tuple[int, ...]
    scenario: str
    baseline: str
    candidate: str
    costs: tuple[KernelCost, ...]


@dataclass(frozen=True)
class Measurement:
    row: int
    ratio: float
    ci_low: float | None
    ci_high: float | None
    runs: int


@dataclass(frozen=True)
class DisagreeClaim:
    kind: ClassVar[str] = "disagree"
    rows: tuple[int, ...]
    scenario: str
    baseline: str
    candidate: str
    point: str
    objective: str
    measurements: tuple[Measurement, ...]


@dataclass(frozen=True)
class ChoiceClaim:
    kind: ClassVar[str] = "choice"
    rows: tuple[int, ...]
    baseline: str
    candidate: str
    objective: str
    candidate_wins: tuple[int, ...]
    baseline_wins: tuple[int, ...]
    no_clear_winner: tuple[int, ...]
    not_explained: tuple[int, ...]
    disagree: tuple[int, ...]
    undecided: tuple[int, ...]
    one_run: tuple[int, ...]


@dataclass(frozen=True)
class QualityClaim:
    kind: ClassVar[str] = "quality"
    rows: tuple[int, ...]
    baseline: str
    candidate: str
    scenarios: tuple[str, ...]  # the scenarios whose quality the sentence states


Claim = (EnvironmentClaim | PoolClaim | BudgetClaim | MeasuredClaim | CapacityClaim | ColdPrefillClaim | DecodeClaim
         | PrefixClaim | PointClaim | ResidencyClaim | StepsClaim | KernelsClaim | DisagreeClaim | ChoiceClaim
         | QualityClaim)


# ---- builders ------------------------------------------------------------------------------------------------

def claims(scenarios: list[Scenario], objective: str, threshold: float) -> list[Claim]:
    """Every claim, per pair of KV formats in the scenarios' order (the module docstring's order)."""
    out: list[Claim] = []
    pairs: dict[tuple, list[Scenario]] = {}
    for s in scenarios:
        pairs.setdefault((s.baseline, s.candidate), []).append(s)
    for (base, cand), group in pairs.items():
        rows = tuple(p.row for s in group for p in s.points)
        out.append(EnvironmentClaim(rows, base, cand, tuple(dict.fromkeys(s.environment for s in group))))
        pool = pool_claim(group)
        out += [pool] if pool is not None else []
        out += budget_claims(group)
        measured = measured_claim(group)
        out += [measured] if measured.phases else []
        out += point_claims(group, base, cand, objective, threshold)
        out += residency_claims(group, base, cand, objective)
        out += [StepsClaim(_traced_rows(s), s.name, base, cand, statement.row)
                for s in group for statement in s.report.statements if statement.kind == "step-timeline"]
        out += [KernelsClaim((p.row,), s.name, base, cand, tuple(KernelCost.of(k) for k in s.kernels
                                                                   if k.ratio is not None))
                for s in group for p in s.points if p.serving is None]
        disagree = disagree_claims(group, base, cand, objective)
        out += disagree
        out.append(choice_claim(group, rows, base, cand, objective, {r for c in disagree for r in c.rows}))
        out.append(QualityClaim(rows, base, cand, tuple(s.name for s in group if s.report.quality)))
    return out


def _traced_rows(s: Scenario) -> tuple[int, ...]:
    """The rows whose traffic the scenario's kernel diff (and its steps table) read: every row of a run without
    serving, else the points its traces cover (a one-trace run's first point)."""
    covered = tuple(p.row for p in s.points if p.serving is None or p.serving.diff_covers)
    return covered or tuple(p.row for p in s.points)


def _model_shape(s: Scenario) -> str:
    return s.setup.split("]")[0] if s.setup else ""


def pool_claim(group: list[Scenario]) -> PoolClaim | None:
    """The pools of a pair of formats' scenarios; None where no scenario records one (no vLLM serving pool)."""
    pools = [ScenarioPool(s.name, tuple(p.row for p in s.points), *s.pools) for s in group if len(s.pools) == 2]
    if not pools or all(p.baseline.tokens is None and p.candidate.tokens is None for p in pools):
        return None
    capped = [s for s in group if len(s.pools) == 2 and not s.pools[0].default]
    defaults = [s for s in group if len(s.pools) == 2 and s.pools[0].default and s.pools[0].tokens
                and any(c.environment.gpu == s.environment.gpu for c in capped)]
    default = defaults[0] if defaults else None
    default_tokens = (default.pools[0].tokens, default.pools[1].tokens) if default else (None, None)
    projections = []
    for s in capped:
        if default is None or _model_shape(default) != _model_shape(s):
            continue
        for p in s.points:
            for pool, tokens, bound in zip(s.pools, default_tokens, (p.baseline_capacity, p.candidate_capacity)):
                found = kv_pool.project(p.point, pool, tokens) if bound else None
                if found is not None:
                    projections.append(PointProjection(p.row, p.point, found))
    return PoolClaim(rows=tuple(r for p in pools for r in p.rows), baseline=group[0].baseline,
                     candidate=group[0].candidate, pools=tuple(pools), default_tokens=default_tokens,
                     default_from=default.name if default else None, projections=tuple(projections))


def budget_claims(group: list[Scenario]) -> list[BudgetClaim]:
    """One per point with a TTFT budget: the pooled one once, cited with every row it pools."""
    out, seen = [], set()
    for s in group:
        for p in s.points:
            if p.reason is None or p.row in seen or p.excluded:
                continue
            rows = tuple(sorted((p.row, *p.pooled_with)))
            seen.update(rows)
            out.append(BudgetClaim(rows, s.name, s.baseline, s.candidate, p.point, p.reason))
    return out


def measured_claim(group: list[Scenario]) -> MeasuredClaim:
    """What this GPU, engine and kernel route measured, per row of the head over every scenario of a pair of
    formats: the range of ratios, the verdicts, the kernels compared and their query dtypes; and whether the
    general expectation that the narrower format saves time in decode (it moves fewer bytes) held here."""
    formats = [group[0].baseline_format, group[0].candidate_format]
    try:
        widths = [kv_formats.bytes_per_value(f or "") for f in formats]
        narrower = None if widths[0] == widths[1] else "candidate" if widths[1] < widths[0] else "baseline"
    except KvtraceError:
        narrower = None
    phases = []
    for subject in MEASURED_SUBJECTS:
        found = [(s, k) for s in group for k in s.kernels if k.subject == subject and k.ratio is not None]
        if not found:
            continue
        kernels = tuple(dict.fromkeys(k.kernels for _, k in found if k.kernels))
        counts: dict[str, int] = {}
        for _, k in found:
            counts[k.verdict] = counts.get(k.verdict, 0) + 1
        phases.append(MeasuredPhase(
            subject, min(k.ratio for _, k in found), max(k.ratio for _, k in found), tuple(counts.items()), kernels,
            tuple(dict.fromkeys((k.baseline_query, k.candidate_query) for _, k in found
                                if k.baseline_query or k.candidate_query)),
            any("→" in k for k in kernels), tuple(sorted({s.points[0].row for s, _ in found}))))
    expectation = None
    # The expectation is about the kernels that read the cache: the split-KV merge kernel beside them (its own head
    # row) reads only their partial outputs.
    decode = [k.verdict for s in group for k in s.kernels if k.subject == "decode_attention" and k.ratio is not None
              and SPLIT_KV_MERGE not in (k.kernels or "")]
    if narrower and decode:
        faster = Verdict.IMPROVEMENT if narrower == "candidate" else Verdict.REGRESSION
        slower = Verdict.REGRESSION if narrower == "candidate" else Verdict.IMPROVEMENT
        favour, against = decode.count(faster), decode.count(slower)
        expectation = ("held" if favour and not against else "did not hold" if against and not favour else
                       "held at some rows only" if favour else None)
    return MeasuredClaim(tuple(sorted({r for p in phases for r in p.rows})), group[0].baseline, group[0].candidate,
                         narrower, tuple(phases), expectation)


def _judged(p: MatrixPoint) -> tuple:
    """What a point's judgement rests on besides its estimate: who wins and why."""
    return p.winner, p.apparent, p.causes


def point_claims(group: list[Scenario], base: str, cand: str, objective: str, threshold: float) -> list[Claim]:
    """A claim per decided point (a pooled point once, by its lowest row, citing every row): capacity, cold
    prefill, decode-heavy, prefix hits, or a plain point."""
    out: list[Claim] = []
    decided = [p for s in group for p in s.points if p.winner is not None and p.serving is not None]
    by_row = {p.row: p for p in decided}
    for p in decided:
        if any(r < p.row for r in p.pooled_with if r in by_row):
            continue
        found = outcome(p, base, cand, objective, threshold)
        cited = (p.row,)
        if p.pooled_with:
            cited = tuple(sorted((p.row, *p.pooled_with)))
            pooled = [by_row[r] for r in cited if r in by_row]
            found = PointOutcome(**{
                **found.__dict__, "pooled_rows": cited, "pooled_directories": p.pooled_directories,
                "own_runs": p.serving.runs, "server_runs": server_runs(pooled),
                "server_rows": tuple(q.row for q in pooled for _ in q.serving.run_pairs),
                "differing": tuple((q.row, outcome(q, base, cand, objective, threshold))
                                   for q in (by_row[r] for r in p.pooled_with if r in by_row)
                                   if _judged(q) != _judged(p))})
        if p.baseline_capacity or p.candidate_capacity:
            out.append(CapacityClaim(cited, p.scenario, found))
        elif p.cold_prefill or p.decode_heavy:
            segment = "prefill_attention" if p.cold_prefill else "decode_attention"
            kernels = tuple(KernelCost.of(k) for k in point_kernels(
                next(s.report for s in group if s.name == p.scenario), segment))
            kind = ColdPrefillClaim if p.cold_prefill else DecodeClaim
            out.append(kind(cited, p.scenario, found, kernels))
        elif PREFIX_HITS in p.causes:
            out.append(PrefixClaim(cited, p.scenario, found))
        else:
            out.append(PointClaim(cited, p.scenario, found))
    return out


def residency_claims(group: list[Scenario], base: str, cand: str, objective: str) -> list[ResidencyClaim]:
    """Per point whose server counted each request's cached tokens, and where either arm served prompt tokens from
    its prefix cache (evictions alone are the pool turning over, which every busy point does): how much more of the
    prompts each arm's pool served from its prefix cache and how many cached blocks it evicted (residency, a
    capacity effect), beside the prefill attention kernel's cost on the group's matched cold prefill and the
    objective's outcome there; stated whichever way the objective fell, so that a residency win never reads as a
    faster kernel, nor a slower kernel hide one."""
    cold = next(((s, p) for s in group for p in s.points if p.cold_prefill), None)
    kernel = None
    if cold is not None:
        kernel = next((KernelCost.of(k, row=cold[1].row) for k in point_kernels(cold[0].report, "prefill_attention")
                       if k.ratio is not None), None)
    out = []
    for s in group:
        for p in s.points:
            arms = (p.serving.baseline, p.serving.candidate) if p.serving else (None, None)
            if None in arms or None in (arms[0].reuse, arms[1].reuse) \
                    or None in (arms[0].reuse.cached_share, arms[1].reuse.cached_share):  # no prompt tokens counted
                continue
            if not any(m.reuse.cached_tokens for m in arms):
                continue  # no prompt token came from a prefix cache there: residency has nothing to say
            e = p.estimate
            out.append(ResidencyClaim(
                (p.row,) + ((kernel.row,) if kernel else ()), p.scenario, base, cand, p.point, objective,
                (arms[0].reuse, arms[1].reuse), (arms[0].reuse.cached_share, arms[1].reuse.cached_share),
                (arms[0].evictions, arms[1].evictions), kernel, p.winner, p.ratio, e.low if e else None,
                e.high if e else None, e.runs if e else None, tuple(p.pooled_with), p.pooled_directories,
                p.undecided))
    return out


def disagree_claims(group: list[Scenario], base: str, cand: str, objective: str) -> list[DisagreeClaim]:
    out, seen = [], set()
    points = [p for s in group for p in s.points]
    for p in points:
        if p.disagrees_with and p.row not in seen:
            same = (p.row, *p.disagrees_with)
            seen.update(same)
            out.append(DisagreeClaim(tuple(sorted(same)), p.scenario, base, cand, p.point, objective, tuple(
                Measurement(q.row, q.ratio, q.estimate.low, q.estimate.high, q.estimate.runs)
                for q in sorted((q for q in points if q.row in same), key=lambda q: q.row))))
    return out


def choice_claim(group: list[Scenario], rows: tuple[int, ...], base: str, cand: str, objective: str,
                 disagree: set[int]) -> ChoiceClaim:
    choice: dict = {"candidate": [], "baseline": [], NO_CLEAR_WINNER: [], NOT_EXPLAINED: [], None: []}
    for s in group:
        for p in s.points:
            choice[p.winner].append(p.row)
    one_run = tuple(p.row for s in group for p in s.points if p.estimate is not None and p.estimate.runs == 1)
    return ChoiceClaim(rows, base, cand, objective, tuple(choice["candidate"]), tuple(choice["baseline"]),
                       tuple(choice[NO_CLEAR_WINNER]), tuple(choice[NOT_EXPLAINED]), tuple(sorted(disagree)),
                       tuple(r for r in choice[None] if r not in disagree), one_run)
