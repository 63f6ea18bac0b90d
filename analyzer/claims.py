"""The matrix's typed claims about where each point's TTFT difference sits and what pool it ran with: one frozen
result per claim, which the markdown, the terminal and the JSON all read (analyzer/render/matrix.py words them).

- PoolClaim: each arm's KV pool per scenario and how it was set, and, where the runs capped it, where each
  capacity-bound point would bind with vLLM's default pool on the same GPU and model shape.
- BudgetClaim: a point's TTFT budget and the part that carries its difference (analyzer.budget.Reason), the same
  object the serving report words for that point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtrace.analyzer import kv_pool
from kvtrace.analyzer.budget import Reason
from kvtrace.analyzer.kv_pool import ArmPool, Projection

if TYPE_CHECKING:
    from kvtrace.analyzer.matrix import Scenario


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
    kind = "pool"
    rows: tuple[int, ...]
    baseline: str
    candidate: str
    pools: tuple[ScenarioPool, ...]
    # The default pool's tokens per arm label, and the scenario that reported them (None: no run here had one).
    default_tokens: tuple[int | None, int | None]
    default_from: str | None
    projections: tuple[PointProjection, ...]  # capacity-bound points of capped runs


@dataclass(frozen=True)
class BudgetClaim:
    kind = "budget"
    rows: tuple[int, ...]
    scenario: str
    baseline: str
    candidate: str
    point: str
    reason: Reason


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
            bound = [(pool, tokens) for pool, tokens, reason in zip(s.pools, default_tokens,
                                                                   (p.baseline_capacity, p.candidate_capacity))
                     if reason]
            for pool, tokens in bound:
                found = kv_pool.project(p.point, pool, tokens)
                if found is not None:
                    projections.append(PointProjection(p.row, p.point, found))
    rows = tuple(r for p in pools for r in p.rows)
    return PoolClaim(rows=rows, baseline=group[0].baseline, candidate=group[0].candidate, pools=tuple(pools),
                     default_tokens=default_tokens, default_from=default.name if default else None,
                     projections=tuple(projections))


def budget_claims(group: list[Scenario]) -> list[BudgetClaim]:
    """One per point with a TTFT budget: the pooled one once, cited with every row it pools."""
    claims, seen = [], set()
    for s in group:
        for p in s.points:
            if p.reason is None or p.row in seen or p.excluded:
                continue
            rows = tuple(sorted((p.row, *p.pooled_with)))
            seen.update(rows)
            claims.append(BudgetClaim(rows=rows, scenario=s.name, baseline=s.baseline, candidate=s.candidate,
                                      point=p.point, reason=p.reason))
    return claims
