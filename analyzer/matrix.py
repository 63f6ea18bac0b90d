"""The decision over a matrix of scenarios: one serving report per scenario (analyzer/report), set side by side
point by point, which arm wins each point on the user's objective and what wins it, where a sweep's crossover
lies, and the claims of the decision paragraph with the rows they rest on.

Nothing here re-reads a trace or a manifest's numbers: every cell is a field of a scenario's Report (its
kernel statements, the rows of the diff's head, and its serving rows); this module only decides which points
count, who wins them and why. analyzer/render/matrix.py words the claims.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path

from kvtrace import __version__, kv_formats
from kvtrace.analyzer import budget, claims as claims_lib, kv_pool, report as report_lib
from kvtrace.analyzer import runs as runs_lib
from kvtrace.analyzer.budget import CAPACITY, FASTER_KERNEL, Reason
from kvtrace.analyzer.claims import NO_CLEAR_WINNER, NOT_EXPLAINED, PREFIX_HITS, KernelVerdict
from kvtrace.analyzer.classify import RecipeSet
from kvtrace.analyzer.kv_pool import ArmPool
from kvtrace.analyzer.report import PlotFile, Report
from kvtrace.analyzer.serving import ServingRow
from kvtrace.analyzer.statements import KernelStatement, segment_verdict
from kvtrace.analyzer.stats import serving_intervals
from kvtrace.analyzer.stats.serving_intervals import ServingEstimate
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.errors import KvtraceError
from kvtrace.manifest import MANIFEST, Manifest, Point, read_manifest

MATRIX_SCHEMA = "kvtrace.matrix/3"
# objective -> (the serving estimate that decides it: ServingRow.estimates' key and ServingMetrics' field, lower is
# better, the segments whose kernels serve it). ITL is each request's mean inter-token gap (TPOT): one sample per
# request, since a request's gaps share its batches.
OBJECTIVES = {"ttft": ("ttft_ms", True, ("prefill_attention",)),
              "itl": ("tpot_ms", True, ("decode_attention",)),
              "throughput": ("output_tokens_per_s", False, ("prefill_attention", "decode_attention"))}
# What wins a point (MatrixPoint.causes): on TTFT, the part of its budget that carries the difference
# (analyzer.budget: CAPACITY where queue time does, FASTER_KERNEL or HOST_TIME only where the traced steps of that very
# point say so); on ITL and throughput, a faster kernel of the objective where the kernel diff read the point's own
# traffic, or the loser capacity-bound and the winner not, or bound less (it ran more requests at once, as the
# server observed); and more prefix hits. Several share the credit.


@dataclass(frozen=True)
class Environment:
    """What a scenario's decision holds for."""

    gpu: str
    flashinfer: str | None
    vllm: str | None
    attention_backend: str | None
    engine: str | None
    patched: tuple[str, ...] = ()  # RunArm.patch_words of each patched arm: never presented as a stock release


@dataclass
class MatrixPoint:
    """One row of the matrix: a scenario at one traffic point (or the scenario itself, with no serving)."""

    row: int  # R1, R2, …: what the decision's claims cite
    scenario: str
    point: str | None
    context: int | None
    concurrency: int | None
    serving: ServingRow | None
    excluded: str | None  # why the point does not count towards the decision (different work, one arm only)
    baseline_capacity: str | None  # why the arm is capacity-bound there, counted on observed evidence only
    candidate_capacity: str | None
    capacity_notes: list[str] = field(default_factory=list)  # a capacity reason resting on unobserved peaks
    stat: str | None = None  # "mean": what the objective's estimate compares
    # The objective per arm, its mean over every run (pooled: every pooled run pair's), and candidate / baseline,
    # as `estimate` holds them.
    baseline_value: float | None = None
    candidate_value: float | None = None
    ratio: float | None = None
    estimate: ServingEstimate | None = None  # the objective's ratio with its interval, band and verdict
    # baseline, candidate, NO_CLEAR_WINNER, NOT_EXPLAINED (`apparent`: the side it favours); None: not decided
    # (`undecided` says why)
    winner: str | None = None
    undecided: str | None = None
    apparent: str | None = None
    disagrees_with: tuple[int, ...] = ()  # other rows that measured the same point and disagree with this one
    # Other rows that measured the same point and agree with this one: `estimate` pools all their run pairs
    # (serving_intervals.pool_serving); the row's own measurement stays in `serving.estimates`.
    pooled_with: tuple[int, ...] = ()
    pooled_directories: int = 0  # the run directories whose run pairs `estimate` pools (0: not pooled)
    causes: tuple[str, ...] = ()
    # The objective's kernels where the report's kernel diff read this point's own traffic; empty elsewhere.
    kernel_verdicts: list[KernelVerdict] = field(default_factory=list)
    # The TTFT budget and what carries its difference (the point's own, or pooled over the rows in `pooled_with`).
    reason: Reason | None = None
    crossover: bool = False  # first point of a sweep where the baseline is capacity-bound and the candidate not
    cold_prefill: bool = False  # prefill-only traffic (one output token) or a cold-prefill scenario
    decode_heavy: bool = False  # a decode-heavy scenario


@dataclass
class Scenario:
    name: str
    runs: tuple[str, ...]
    baseline: str  # arm labels
    candidate: str
    baseline_format: str | None
    candidate_format: str | None
    environment: Environment
    kernels: list[KernelStatement]  # the report's kernel statements: the rows of the diff's head
    points: list[MatrixPoint]
    sweep: bool
    report: Report = field(repr=False)
    # The server's setup that its points' numbers depend on besides formats and environment (_setup).
    setup: str = field(default="", repr=False)
    pools: tuple[ArmPool, ...] = ()  # the baseline's and the candidate's KV pool (vLLM runs)


@dataclass
class Matrix:
    objective: str
    threshold: float
    scenarios: list[Scenario]
    claims: list[claims_lib.Claim]
    plots: list[PlotFile] = field(default_factory=list)
    # The file beside the markdown that took its <details> part (set by the caller that wrote it); not in the JSON.
    rest_file: str | None = None
    schema: str = MATRIX_SCHEMA
    kvtrace_version: str = __version__

    @property
    def points(self) -> list[MatrixPoint]:
        return [p for s in self.scenarios for p in s.points]

    def to_dict(self) -> dict:
        scenarios = []
        for s in self.scenarios:
            data = {"name": s.name, "runs": list(s.runs), "baseline": s.baseline, "candidate": s.candidate,
                    "baseline_format": s.baseline_format, "candidate_format": s.candidate_format,
                    "environment": asdict(s.environment), "sweep": s.sweep,
                    "kernels": [{"kind": k.kind, **asdict(k)} for k in s.kernels],
                    "pools": [asdict(p) for p in s.pools],
                    "points": [asdict(p) for p in s.points]}
            scenarios.append(data)
        return {"schema": self.schema, "kvtrace_version": self.kvtrace_version, "objective": self.objective,
                "threshold": self.threshold, "scenarios": scenarios, "claims": [{"kind": c.kind, **asdict(c)} for c in self.claims],
                "plots": [asdict(p) for p in self.plots]}


# ---- scenarios from run directories ---------------------------------------------------------------------

def group_runs(paths: list[Path]) -> list[tuple[str, list[Path]]]:
    """(name, run directories) per scenario: a run directory holding two arms is one scenario; run directories
    of one arm each pair by engine, mode and scenario (the wider KV format first). A folder without a
    manifest stands for the run directories inside it."""
    runs: list[Path] = []
    for path in map(Path, paths):
        if (path / MANIFEST).is_file():
            runs.append(path)
        elif path.is_dir():
            inside = sorted(p for p in path.iterdir() if (p / MANIFEST).is_file())
            if not inside:
                raise KvtraceError(f"{path} holds no run directory (no {MANIFEST} in it or in its folders): pass "
                                   "run directories written by `kvtrace capture`, or a folder holding them")
            runs += inside
        else:
            raise KvtraceError(f"{path}: no such run directory; pass run directories written by `kvtrace capture`")
    groups: dict[tuple, list] = {}
    for run in dict.fromkeys(runs):
        manifest = read_manifest(run)
        arms = manifest.runs_by_arm
        if len(arms) >= 2:
            groups[("run", str(run))] = [(run, manifest)]
        else:
            groups.setdefault((manifest.engine, manifest.mode, manifest.scenario), []).append((run, manifest))
    out = []
    for key, members in groups.items():
        if key[0] == "run":
            run, manifest = members[0]
            name = _scenario_name(manifest, run)
        else:
            if len(members) != 2:
                listed = ", ".join(str(run) for run, _ in members)
                raise KvtraceError(f"scenario {key[2] or '?'} ({key[1] or '?'}) has {len(members)} run directories of "
                                   f"one arm ({listed}): it needs two, one per KV format")
            members.sort(key=lambda m: -_width(m[1]))
            name = _scenario_name(members[0][1], members[0][0])
        out.append((name, [run for run, _ in members]))
    names = [name for name, _ in out]
    return [(name if names.count(name) == 1 else f"{name} ({runs[0].name})", runs) for name, runs in out]


def _width(manifest) -> float:
    record = next(iter(manifest.runs.values()))
    return kv_formats.bytes_per_value(record.kv_dtype or "", manifest.model_dtype)


def _scenario_name(manifest, run: Path) -> str:
    if manifest.scenario:
        return f"{manifest.scenario} ({manifest.mode})" if manifest.mode else manifest.scenario
    return run.name


def _environment(result: Report, manifest: Manifest) -> Environment:
    packages = manifest.packages
    flashinfer = packages.get("flashinfer") or packages.get("flashinfer-python")
    backend = manifest.settings.get("attention_backend")
    if backend is None and manifest.engine == "flashinfer":
        backend = "FlashInfer kernels called directly"
    return Environment(gpu=result.diff.baseline.info.gpu_label, flashinfer=flashinfer, vllm=packages.get("vllm"),
                       attention_backend=backend, engine=manifest.engine,
                       patched=tuple(w for w in (result.baseline.patch_words(), result.candidate.patch_words()) if w))


# ---- points ----------------------------------------------------------------------------------------------

def _different_work(row: ServingRow, result: Report) -> str | None:
    b, c = row.baseline, row.candidate
    if b is None or c is None:
        only = result.baseline.label if b else result.candidate.label
        return f"different work: only {only} ran this point"
    requests = next((f for f in result.findings if f.check == "requests"), None)
    if requests is not None and requests.level != "ok":
        return f"different work: {requests.message}"
    for name, words in (("requests", "completed requests"), ("prompt_tokens", "prompt tokens"),
                        ("output_tokens", "output tokens")):
        if getattr(b, name) != getattr(c, name):
            return f"different work: {words} {getattr(b, name)} ({result.baseline.label}) vs {getattr(c, name)} " \
                   f"({result.candidate.label})"
    if b.failed or c.failed:
        return f"different work: failed requests {b.failed or 0} ({result.baseline.label}) vs {c.failed or 0} " \
               f"({result.candidate.label})"
    return _window_stall(row)


def _window_stall(row: ServingRow) -> str | None:
    """Timings that include nsys' stall at a window's close measure the profiler, not the KV format."""
    stalled = row.window_stalls
    if not stalled:
        return None
    return (f"not comparable: a profile window closed inside the timed traffic of {len(stalled)} of "
            f"{2 * len(row.run_pairs)} runs ({stalled[0]}), so their timings include nsys' stall at the close; "
            "`kvtrace capture vllm-matrix` now closes each window before the timed traffic")


def _no_interval(objective: str) -> str:
    """Why a change beyond the threshold has no verdict: nothing gave it an interval."""
    if objective == "throughput":
        return "no interval: throughput is one number per run, and there is one run per arm"
    return "no interval: one run per arm and no per-request samples"


def _judge(point: MatrixPoint, result: Report, objective: str, estimate: ServingEstimate | None = None) -> None:
    """Who wins the point on the objective: only an estimate whose interval excludes no change, its ratio beyond the
    threshold, names a winner, and only what kvtrace measured (a faster kernel, prefix hits, a capacity effect)
    makes it a choice. `estimate`: the objective's estimate pooled over several measurements of the point, else the
    point's own; the causes are always the point's own run's."""
    row = point.serving
    name, _, segments = OBJECTIVES[objective]
    if estimate is None:
        estimate = row.estimates.get(name)
    point.winner = point.undecided = point.apparent = None
    point.causes, point.kernel_verdicts = (), []
    if estimate is None:
        point.undecided = ("no ITL: one output token per request leaves no inter-token gaps"
                           if objective == "itl" and (row.baseline.output_tokens or 0) <= (row.baseline.requests or 0)
                           else f"no {objective.upper() if objective != 'throughput' else objective} recorded for "
                           "both arms")
        return
    point.estimate, point.stat, point.ratio = estimate, "mean", estimate.ratio
    point.baseline_value, point.candidate_value = estimate.baseline, estimate.candidate
    if row.diff_covers:  # the kernel diff measured this point's own traffic
        for segment in segments:
            diff_row, verdict = segment_verdict(result.diff, segment)
            if verdict is not None:
                point.kernel_verdicts.append(KernelVerdict(segment, diff_row.ratio, diff_row.ci_low, diff_row.ci_high,
                                                           diff_row.no_interval, verdict, diff_row.compared_calls))
    if estimate.verdict == Verdict.NO_CHANGE:
        point.winner = NO_CLEAR_WINNER
        return
    if estimate.verdict == Verdict.TOO_FEW_RUNS:
        point.undecided = serving_intervals.too_few_runs(estimate)
        return
    if estimate.verdict not in (Verdict.IMPROVEMENT, Verdict.REGRESSION):
        point.undecided = _no_interval(objective)
        return
    candidate_better = estimate.verdict == Verdict.IMPROVEMENT
    b, c = row.baseline, row.candidate
    winner, loser = (c, b) if candidate_better else (b, c)
    why = point.reason
    loser_bound = point.baseline_capacity if candidate_better else point.candidate_capacity
    won = 1 if candidate_better else 0
    pairs = row.run_pairs or ((b, c),)
    # Capacity explains a win only where the loser ran out of room in every run and the winner in none, or the
    # winner held more requests at once in every run pair.
    more_room = bool(loser_bound) and (not any(pair[won].capacity for pair in pairs) or _ran_more(pairs, won))
    if objective == "ttft" and why is not None:
        # The budget's part that carries the TTFT difference, measured apart from zero, where the server's TTFT moved
        # the winner's way; queue time is a capacity effect only where the winner had more room (else the loser's
        # requests queued behind slower work).
        causes = [why.cause] if (why.budget.ttft.delta_ms < 0) == candidate_better and why.budget.carrier_measured \
            and (why.cause != CAPACITY or more_room) else []
    else:
        causes = [FASTER_KERNEL for k in point.kernel_verdicts
                  if k.verdict == (Verdict.IMPROVEMENT if candidate_better else Verdict.REGRESSION)]
        if more_room:
            causes.append(CAPACITY)
    # Where the TTFT budget measured no part apart from zero, prefix hits explain no measured share either.
    unmeasured = objective == "ttft" and why is not None and not why.budget.carrier_measured
    if objective != "itl" and not unmeasured and None not in (winner.cached_prompt_tokens, loser.cached_prompt_tokens) \
            and winner.cached_prompt_tokens > loser.cached_prompt_tokens:
        causes.append(PREFIX_HITS)
    point.causes = tuple(dict.fromkeys(causes))
    side = "candidate" if candidate_better else "baseline"
    if point.causes:
        point.winner = side
    else:
        point.winner, point.apparent = NOT_EXPLAINED, side


def _ran_more(pairs, won: int) -> bool:
    """Both arms capacity-bound, the winner (side `won` of each run pair) less so: in every run pair the server
    observed it running more requests at once."""
    return all(None not in (pair[won].peak_running, pair[1 - won].peak_running)
               and pair[won].peak_running > pair[1 - won].peak_running for pair in pairs)


def _capacity_over_runs(reasons: list[str | None]) -> tuple[str | None, str | None]:
    """An arm's capacity reason at a point over every run (each on its own observed evidence), and a note: bound
    only where every run was, with each run's reason where they differ; bound in some runs only is not counted, and
    the note says in how many (one run's evidence is not the point's)."""
    bound = [r for r in reasons if r]
    if not bound:
        return None, None
    each = f"{', '.join(r or 'not bound' for r in reasons[:-1])} and {reasons[-1] or 'not bound'}"
    if len(bound) == len(reasons):
        return (reasons[0], None) if len(set(reasons)) == 1 else (f"{each} in its {len(reasons)} runs", None)
    return None, f"capacity-bound in {len(bound)} of {len(reasons)} runs ({each}): not counted as capacity-bound"


def _points(name: str, result: Report, objective: str, start: int) -> list[MatrixPoint]:
    if not result.serving:
        return [MatrixPoint(row=start, scenario=name, point=None, context=None, concurrency=None, serving=None,
                            excluded=None, baseline_capacity=None, candidate_capacity=None,
                            undecided="no serving metrics: " + next((n.removeprefix("no serving metrics: ")
                                                                    for n in result.notes
                                                                    if n.startswith("no serving metrics")), "none"))]
    points = []
    scenario = (result.baseline.scenario or "")
    for index, row in enumerate(result.serving):
        notes = []
        caps = []
        for position, side in enumerate(("baseline", "candidate")):
            metrics = getattr(row, side)  # its capacity rests on observed evidence only (analyzer.serving)
            label = getattr(result, side).label
            runs = [pair[position] for pair in row.run_pairs] or ([metrics] if metrics else [])
            bound, note = _capacity_over_runs([m.capacity for m in runs])
            caps.append(bound)
            notes += [f"{label}: {n}" for n in (metrics.capacity_note if metrics else None, note) if n]
        try:
            single = Point.parse(row.point).output_len <= 1
        except (ValueError, TypeError):
            single = False
        point = MatrixPoint(row=start + index, scenario=name, point=row.point, context=row.context,
                            concurrency=row.concurrency, serving=row, excluded=_different_work(row, result),
                            baseline_capacity=caps[0], candidate_capacity=caps[1], capacity_notes=notes,
                            cold_prefill=single or scenario == "cold-prefill",
                            decode_heavy=not single and scenario == "decode-heavy")
        point.reason = row.reason
        if point.excluded is None:
            _judge(point, result, objective)
        else:
            point.undecided = point.excluded
        points.append(point)
    if result.sweep:
        ordered = sorted((p for p in points if p.excluded is None), key=lambda p: (p.context or 0, p.concurrency or 0))
        first = next((p for p in ordered if p.baseline_capacity and not p.candidate_capacity), None)
        if first is not None:
            first.crossover = True
    return points


# ---- points measured more than once ------------------------------------------------------------------------

def _same_point_key(s: Scenario) -> tuple:
    """What makes two scenarios' points the same point: formats, engine, mode, scenario, environment and the
    server's setup (their run pairs are pooled: a sweep run again with another KV-cache size is another point)."""
    arm = s.report.baseline
    return (s.baseline_format, s.candidate_format, arm.engine, arm.mode, arm.scenario,
            tuple(asdict(s.environment).items()), s.setup)


def _setup(manifest: Manifest) -> str:
    """The manifest's settings that shape serving besides the KV format: the model's shape (not where it was read
    from), the server's extra arguments (KV-cache size, batch limits), weights and prefix caching."""
    model = {k: v for k, v in manifest.model.items() if k != "source"}
    return json.dumps([model, *(manifest.settings.get(k) for k in ("extra_vllm_args", "load_format",
                                                                    "prefix_caching"))], sort_keys=True, default=str)


def _disagree(a: MatrixPoint, b: MatrixPoint, threshold: float) -> bool:
    """Two measurements of one point disagree when either ratio lies outside the other's interval, or, where
    neither has one, when they lie beyond the threshold on opposite sides of 1."""
    for x, y in ((a, b), (b, a)):
        if y.estimate.low is not None and not y.estimate.low <= x.ratio <= y.estimate.high:
            return True
    return (a.ratio - 1) * (b.ratio - 1) < 0 and min(abs(a.ratio - 1), abs(b.ratio - 1)) > threshold


def _join_measurements(scenarios: list[Scenario], objective: str, threshold: float, confidence: float) -> None:
    """Points measured in more than one scenario (a single run and a --repeats run of the same traffic, or the same
    sweep recorded in two sessions): where the measurements disagree the point is not decided, since which one
    holds is what nobody can tell from them; where they agree, each is judged again on all their run pairs pooled
    (serving_intervals.pool_serving), as one --repeats capture would be, with its own run's causes."""
    groups: dict[tuple, list[tuple[MatrixPoint, Scenario]]] = {}
    for s in scenarios:
        for p in s.points:
            if p.estimate is not None and p.point:
                groups.setdefault((*_same_point_key(s), p.point), []).append((p, s))
    for members in groups.values():
        points = [p for p, _ in members]
        if len(points) < 2:
            continue
        if any(_disagree(a, b, threshold) for a, b in combinations(points, 2)):
            for p in points:
                p.disagrees_with = tuple(q.row for q in points if q is not p)
                p.winner, p.apparent, p.causes = None, None, ()
                p.undecided = (f"measured again at {', '.join(f'R{r}' for r in p.disagrees_with)} with another "
                               "result: the measurements disagree, so this point is not decided")
            continue
        pooled = serving_intervals.pool_serving([p.estimate for p in points], threshold=threshold,
                                                confidence=confidence)
        directories = len({run for _, s in members for run in s.runs})
        why = _pooled_reason(points, confidence)
        for p, s in members:
            p.pooled_with, p.pooled_directories = tuple(q.row for q in points if q is not p), directories
            p.reason = why
            _judge(p, s.report, objective, pooled)


def _pooled_reason(points: list[MatrixPoint], confidence: float) -> Reason | None:
    """The budget over every run pair of a point measured in several rows, with the split of the rows' traced steps
    where one of them has it (the first such row's)."""
    if any(p.reason is None for p in points):
        return None
    pooled = budget.pooled([tuple((b.budget, c.budget) for b, c in p.serving.run_pairs) for p in points], confidence)
    traced = next((p.reason for p in points if p.reason.steps is not None), None)
    return budget.reason(pooled, traced.steps if traced else None,
                         traced.trace_note if traced else points[0].reason.trace_note)


def build(paths: list[Path], recipes: RecipeSet, *, objective: str = "ttft", threshold: float = 0.02,
          confidence: float = 0.95, seed: int = 0, nsys: str | None = None, cache: bool = True) -> Matrix:
    if objective not in OBJECTIVES:
        raise KvtraceError(f"--objective {objective}: choose {', '.join(OBJECTIVES)}")
    grouped = group_runs(paths)
    # A run directory copied is no second recording: pooled with its original it would decide points on nothing.
    # Refused before any scenario is reported.
    runs_lib.check_distinct_recordings(
        [file for _, runs in grouped for item in runs_lib.resolve_inputs(runs, (), ())
         for file in runs_lib.recording_files(item.run, item.manifest, item.manifest.runs_by_arm.get(item.arm,
                                                                                                     [item.arm]))],
        "give each recording once (remove the copy)")
    scenarios = []
    start = 1
    for name, runs in grouped:
        # exports_from=(): a scenario's exports are read inside its run directories, as `kvtrace report` does.
        result = report_lib.build(runs, recipes, threshold=threshold, confidence=confidence, seed=seed, nsys=nsys,
                                  cache=cache, exports_from=())
        points = _points(name, result, objective, start)
        start += len(points)
        manifest = read_manifest(Path(result.baseline.run))
        scenarios.append(Scenario(
            name=name, runs=tuple(str(r) for r in runs), baseline=result.baseline.label,
            candidate=result.candidate.label, baseline_format=result.baseline.kv_format,
            candidate_format=result.candidate.kv_format, environment=_environment(result, manifest),
            kernels=[s for s in result.statements if isinstance(s, KernelStatement)], points=points,
            sweep=result.sweep, report=result, setup=_setup(manifest), pools=tuple(
                kv_pool.arm_pools(read_manifest(Path(arm.run)), [(arm.arm, arm.kv_format)])[0]
                for arm in (result.baseline, result.candidate)) if manifest.engine == "vllm" else ()))
    _join_measurements(scenarios, objective, threshold, confidence)
    return Matrix(objective=objective, threshold=threshold, scenarios=scenarios,
                  claims=claims_lib.claims(scenarios, objective, threshold))
