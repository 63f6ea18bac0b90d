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
from kvtrace.analyzer import headline, report as report_lib
from kvtrace.analyzer.classify import RecipeSet
from kvtrace.analyzer.report import PlotFile, Report
from kvtrace.analyzer.serving import ServingRow
from kvtrace.analyzer.statements import APPEND_PHASE, KernelStatement, segment_verdict
from kvtrace.analyzer.stats import serving_intervals, verdicts
from kvtrace.analyzer.stats.serving_intervals import ServingEstimate
from kvtrace.errors import KvtraceError
from kvtrace.manifest import MANIFEST, Manifest, Point, read_manifest

MATRIX_SCHEMA = "kvtrace.matrix/2"
# objective -> (the serving estimate that decides it: ServingRow.estimates' key and ServingMetrics' field, lower is
# better, the segments whose kernels serve it). ITL is each request's mean inter-token gap (TPOT): one sample per
# request, since a request's gaps share its batches.
OBJECTIVES = {"ttft": ("ttft_ms", True, ("prefill_attention",)),
              "itl": ("tpot_ms", True, ("decode_attention",)),
              "throughput": ("output_tokens_per_s", False, ("prefill_attention", "decode_attention"))}
# What wins a point (MatrixPoint.causes): one of these, or several, which then share the credit.
FASTER_KERNEL = "faster kernel"
PREFIX_HITS = "more prefix hits"
# The loser was capacity-bound there (preemption, queueing) and the winner was not, or was bound less: it ran more
# requests at once, as the server observed.
CAPACITY = "avoided capacity limits"
# What the server measured of the capacity mechanism, per arm (analyzer.serving.ServingMetrics' names).
SERVER_MEASURES = ("preemptions", "peak_running", "peak_kv_usage", "queue_ms")
# MatrixPoint.winner besides an arm's side: the interval reaches into the no-change band; or a win beyond it that
# nothing kvtrace measured accounts for (no kernel of the objective faster for the winner, no prefix hits, no
# capacity reason), which is no choice.
NO_CLEAR_WINNER = "no significant difference"
NOT_EXPLAINED = "not explained"


@dataclass
class Environment:
    """What a scenario's decision holds for."""

    gpu: str
    flashinfer: str | None
    vllm: str | None
    attention_backend: str | None
    engine: str | None


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
    # The objective's kernels over all calls of the run, as the TTFT guard rail reads them: segment, ratio, interval,
    # verdict of the matched calls (what FASTER_KERNEL rests on).
    kernel_verdicts: list[dict] = field(default_factory=list)
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


@dataclass
class Claim:
    """One sentence of the decision paragraph, with its numbers and the rows it cites."""

    kind: str  # environment, capacity, cold-prefill, decode, prefix, point, kernels, choice, quality
    rows: tuple[int, ...]
    scenario: str | None = None
    values: dict = field(default_factory=dict)


@dataclass
class Matrix:
    objective: str
    threshold: float
    scenarios: list[Scenario]
    claims: list[Claim]
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
                    "points": [asdict(p) for p in s.points]}
            scenarios.append(data)
        return {"schema": self.schema, "kvtrace_version": self.kvtrace_version, "objective": self.objective,
                "threshold": self.threshold, "scenarios": scenarios, "claims": [asdict(c) for c in self.claims],
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
    packages = headline.package_versions(manifest)
    flashinfer = packages.get("flashinfer") or packages.get("flashinfer-python")
    backend = manifest.settings.get("attention_backend")
    if backend is None and manifest.engine == "flashinfer":
        backend = "FlashInfer kernels called directly"
    return Environment(gpu=result.diff.baseline.info.gpu_label, flashinfer=flashinfer, vllm=packages.get("vllm"),
                       attention_backend=backend, engine=manifest.engine)


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
    return None


def _no_interval(objective: str) -> str:
    """Why a change beyond the threshold has no verdict: nothing gave it an interval."""
    if objective == "throughput":
        return "no interval: throughput is one number per run, and there is one run per arm"
    return "no interval: one run per arm and no per-request samples"


def _judge(point: MatrixPoint, result: Report, objective: str, estimate: ServingEstimate | None = None) -> None:
    """Who wins the point on the objective: only an estimate whose interval clears the no-change band names a
    winner, and only what kvtrace measured (a faster kernel, prefix hits, a capacity effect) makes it a choice.
    `estimate`: the objective's estimate pooled over several measurements of the point, else the point's own; the
    causes are always the point's own run's."""
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
    for segment in segments:
        diff_row, verdict = segment_verdict(result.diff, segment)
        if verdict is not None:
            point.kernel_verdicts.append({**_kernel_verdict(diff_row, verdict=verdict, segment=segment),
                                          "compared_calls": diff_row.compared_calls})
    if estimate.verdict == verdicts.NO_CHANGE:
        point.winner = NO_CLEAR_WINNER
        return
    if estimate.verdict not in (verdicts.IMPROVEMENT, verdicts.REGRESSION):
        point.undecided = _no_interval(objective)
        return
    candidate_better = estimate.verdict == verdicts.IMPROVEMENT
    b, c = row.baseline, row.candidate
    winner, loser = (c, b) if candidate_better else (b, c)
    causes = [FASTER_KERNEL for k in point.kernel_verdicts
              if k["verdict"] == (verdicts.IMPROVEMENT if candidate_better else verdicts.REGRESSION)]
    if objective != "itl" and None not in (winner.cached_prompt_tokens, loser.cached_prompt_tokens) \
            and winner.cached_prompt_tokens > loser.cached_prompt_tokens:
        causes.append(PREFIX_HITS)
    bound = (point.baseline_capacity, point.candidate_capacity)
    loser_bound, winner_bound = (bound[0], bound[1]) if candidate_better else (bound[1], bound[0])
    if loser_bound and (not winner_bound or _ran_more(winner, loser)):
        causes.append(CAPACITY)
    point.causes = tuple(dict.fromkeys(causes))
    side = "candidate" if candidate_better else "baseline"
    if point.causes:
        point.winner = side
    else:
        point.winner, point.apparent = NOT_EXPLAINED, side


def _kernel_verdict(kernel, *, verdict: str | None = None, **named) -> dict:
    """A kernel row's or statement's ratio, interval and verdict as a claim holds them, after what names it (its
    segment, subject, point or row); `verdict` where the claim's is not the kernel's own (a segment's paired one)."""
    return {**named, "ratio": kernel.ratio, "ci_low": kernel.ci_low, "ci_high": kernel.ci_high,
            "no_interval": kernel.no_interval, "verdict": kernel.verdict if verdict is None else verdict}


def _ran_more(winner, loser) -> bool:
    """Both arms capacity-bound, the winner less so: the server observed it running more requests at once."""
    return None not in (winner.peak_running, loser.peak_running) and winner.peak_running > loser.peak_running


def point_kernels(result: Report, segment: str) -> list[KernelStatement]:
    """The report's kernel statements of a segment (one per workload point of the diff's head)."""
    return [s for s in result.statements if isinstance(s, KernelStatement) and s.subject == segment]


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
        for side in ("baseline", "candidate"):
            metrics = getattr(row, side)  # its capacity rests on observed evidence only (analyzer.serving)
            caps.append(metrics.capacity if metrics else None)
            if metrics and metrics.capacity_note:
                notes.append(f"{getattr(result, side).label}: {metrics.capacity_note}")
        try:
            single = Point.parse(row.point).output_len <= 1
        except (ValueError, TypeError):
            single = False
        point = MatrixPoint(row=start + index, scenario=name, point=row.point, context=row.context,
                            concurrency=row.concurrency, serving=row, excluded=_different_work(row, result),
                            baseline_capacity=caps[0], candidate_capacity=caps[1], capacity_notes=notes,
                            cold_prefill=single or scenario == "cold-prefill",
                            decode_heavy=not single and scenario == "decode-heavy")
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
        for p, s in members:
            p.pooled_with, p.pooled_directories = tuple(q.row for q in points if q is not p), directories
            _judge(p, s.report, objective, pooled)


# ---- the decision ----------------------------------------------------------------------------------------

# The split-KV merge kernel's family name (recipes/flashinfer.toml, split-kv-merge): it reads no KV cache.
SPLIT_KV_MERGE = "MergeStates"
# The head's rows the measured summary walks through, in the head's order.
MEASURED_SUBJECTS = ("prefill_attention", "decode_attention", "kv_append", APPEND_PHASE)


def _measured(group: list[Scenario]) -> dict:
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
        kernels = list(dict.fromkeys(k.kernels for _, k in found if k.kernels))
        queries = list(dict.fromkeys((k.baseline_query, k.candidate_query) for _, k in found
                                     if k.baseline_query or k.candidate_query))
        counts: dict[str, int] = {}
        for _, k in found:
            counts[k.verdict] = counts.get(k.verdict, 0) + 1
        phases.append({"subject": subject, "low": min(k.ratio for _, k in found),
                       "high": max(k.ratio for _, k in found), "verdicts": counts, "kernels": kernels,
                       "queries": [list(q) for q in queries], "different_kernels": any("→" in k for k in kernels),
                       "rows": sorted({s.points[0].row for s, _ in found})})
    expectation = None
    # The expectation is about the kernels that read the cache: the split-KV merge kernel beside them (its own head
    # row) reads only their partial outputs.
    decode = [k.verdict for s in group for k in s.kernels if k.subject == "decode_attention" and k.ratio is not None
              and SPLIT_KV_MERGE not in (k.kernels or "")]
    if narrower and decode:
        faster = verdicts.IMPROVEMENT if narrower == "candidate" else verdicts.REGRESSION
        slower = verdicts.REGRESSION if narrower == "candidate" else verdicts.IMPROVEMENT
        favour, against = decode.count(faster), decode.count(slower)
        expectation = ("held" if favour and not against else "did not hold" if against and not favour else
                       "held at some rows only" if favour else None)
    return {"narrower": narrower, "phases": phases, "decode_expectation": expectation}


def _judged(p: MatrixPoint) -> tuple:
    """What a point's judgement rests on besides its estimate: who wins and why."""
    return p.winner, p.apparent, p.causes


def _point_values(p: MatrixPoint, base: str, cand: str, objective: str, threshold: float) -> dict:
    """A decided point's numbers as its claim holds them: the objective's estimate (pooled where the point was
    measured more than once), who wins and why, and what its own run's server measured."""
    return {"baseline": base, "candidate": cand, "point": p.point, "objective": objective, "stat": p.stat,
            "ratio": p.ratio, "ci_low": p.estimate.low, "ci_high": p.estimate.high,
            "band": p.estimate.band, "band_basis": p.estimate.band_basis, "runs": p.estimate.runs,
            "threshold": threshold,
            "winner": p.winner, "apparent": p.apparent, "causes": list(p.causes),
            "baseline_capacity": p.baseline_capacity, "candidate_capacity": p.candidate_capacity,
            "crossover": p.crossover, "baseline_value": p.baseline_value,
            "candidate_value": p.candidate_value, "kernels": p.kernel_verdicts,
            "cached_prompt_tokens": [p.serving.baseline.cached_prompt_tokens,
                                     p.serving.candidate.cached_prompt_tokens],
            "queue_ms": [p.serving.baseline.queue_ms, p.serving.candidate.queue_ms],
            # What the server measured of the mechanism (the first run's; None where not recorded or the
            # peaks were not observed): how a capacity-bound arm's requests waited or were preempted.
            "preemptions": [p.serving.baseline.preemptions, p.serving.candidate.preemptions],
            "peak_running": [p.serving.baseline.peak_running, p.serving.candidate.peak_running],
            "peak_kv_usage": [p.serving.baseline.peak_kv_usage, p.serving.candidate.peak_kv_usage],
            # The same measures per run of the point's own run pairs: [baseline's, candidate's], in repeat order.
            "server_runs": _server_runs([p])}


def _server_runs(points: list[MatrixPoint]) -> dict:
    """SERVER_MEASURES per run pair of the points' serving rows, in their order then repeat order:
    {measure: [baseline's values, candidate's values]}."""
    return {key: [[getattr(pair[side], key) for q in points for pair in q.serving.run_pairs] for side in (0, 1)]
            for key in SERVER_MEASURES}


def _claims(scenarios: list[Scenario], objective: str, threshold: float) -> list[Claim]:
    """Per pair of KV formats: what the decision holds for and what its rows measured, then capacity, cold
    prefill, prefix hits and the other points, points measured twice that disagree, the kernel costs of runs
    without serving, the choice per point, and quality as each scenario measured it (analyzer/quality)."""
    claims = []
    pairs: dict[tuple, list[Scenario]] = {}
    for s in scenarios:
        pairs.setdefault((s.baseline, s.candidate), []).append(s)
    for (base, cand), group in pairs.items():
        rows = tuple(p.row for s in group for p in s.points)
        environments = [asdict(s.environment) for s in group]
        claims.append(Claim("environment", rows, None, {"baseline": base, "candidate": cand,
                                                        "environments": [dict(t) for t in dict.fromkeys(
                                                            tuple(e.items()) for e in environments)]}))
        measured = _measured(group)
        if measured["phases"]:
            claims.append(Claim("measured", tuple(sorted({r for p in measured["phases"] for r in p["rows"]})), None,
                                {"baseline": base, "candidate": cand, **measured}))
        decided = [p for s in group for p in s.points if p.winner is not None and p.serving is not None]
        by_row = {p.row: p for p in decided}
        for p in decided:
            if any(r < p.row for r in p.pooled_with if r in by_row):
                continue  # one pooled estimate, one claim: its lowest row states it, citing every row
            values = _point_values(p, base, cand, objective, threshold)
            cited = (p.row,)
            if p.pooled_with:
                cited = tuple(sorted((p.row, *p.pooled_with)))
                values["pooled_rows"], values["pooled_directories"] = list(cited), p.pooled_directories
                values["own_runs"] = p.serving.runs  # the run pairs of the row whose first-run numbers these are
                # Every pooled row's run pairs, so that the words give each run's server measures, not one row's.
                pooled = [by_row[r] for r in cited if r in by_row]
                values["server_runs"] = _server_runs(pooled)
                values["server_rows"] = [q.row for q in pooled for _ in q.serving.run_pairs]
                # The pooled point's other rows whose own run credits the win otherwise (causes are each run's own).
                values["differing"] = [{"row": q.row, **_point_values(q, base, cand, objective, threshold)}
                                       for q in (by_row[r] for r in p.pooled_with if r in by_row)
                                       if _judged(q) != _judged(p)]
            if p.baseline_capacity or p.candidate_capacity:
                claims.append(Claim("capacity", cited, p.scenario, values))
            elif p.cold_prefill or p.decode_heavy:
                segment = "prefill_attention" if p.cold_prefill else "decode_attention"
                kernels = point_kernels(next(s.report for s in group if s.name == p.scenario), segment)
                values["phase_kernels"] = [{**_kernel_verdict(k, point=k.point), "reason": k.reason} for k in kernels]
                claims.append(Claim("cold-prefill" if p.cold_prefill else "decode", cited, p.scenario, values))
            elif PREFIX_HITS in p.causes:
                claims.append(Claim("prefix", cited, p.scenario, values))
            else:
                claims.append(Claim("point", cited, p.scenario, values))
        claims += _residency_claims(group, base, cand, objective)
        claims += _step_claims(group, base, cand)
        for s in group:
            for p in s.points:
                if p.serving is None:
                    costs = [_kernel_verdict(k, subject=k.subject, point=k.point)
                             for k in s.kernels if k.ratio is not None]
                    claims.append(Claim("kernels", (p.row,), s.name, {"baseline": base, "candidate": cand,
                                                                     "costs": costs}))
        seen: set = set()
        for s in group:
            for p in s.points:
                if p.disagrees_with and p.row not in seen:
                    same = (p.row, *p.disagrees_with)
                    seen.update(same)
                    measured_at = [q for q in (x for t in group for x in t.points) if q.row in same]
                    claims.append(Claim("disagree", tuple(sorted(same)), p.scenario, {
                        "baseline": base, "candidate": cand, "point": p.point, "objective": objective,
                        "measurements": [{"row": q.row, "ratio": q.ratio, "ci_low": q.estimate.low,
                                          "ci_high": q.estimate.high, "runs": q.estimate.runs}
                                         for q in sorted(measured_at, key=lambda q: q.row)]}))
        choice = {"candidate": [], "baseline": [], NO_CLEAR_WINNER: [], NOT_EXPLAINED: [], None: []}
        for s in group:
            for p in s.points:
                choice[p.winner].append(p.row)
        one_run = [p.row for s in group for p in s.points if p.estimate is not None and p.estimate.runs == 1]
        claims.append(Claim("choice", rows, None, {"baseline": base, "candidate": cand, "objective": objective,
                                                   "candidate_wins": choice["candidate"],
                                                   "baseline_wins": choice["baseline"],
                                                   "no_clear_winner": choice[NO_CLEAR_WINNER],
                                                   "not_explained": choice[NOT_EXPLAINED],
                                                   "disagree": sorted(seen),
                                                   "undecided": [r for r in choice[None] if r not in seen],
                                                   "one_run": one_run}))
        claims.append(Claim("quality", rows, None, {"baseline": base, "candidate": cand, "scenarios": {
            s.name: (s.report.quality.state, s.report.quality.level) for s in group if s.report.quality}}))
    return claims


def _step_claims(group: list[Scenario], base: str, cand: str) -> list[Claim]:
    """Per scenario and vLLM step kind whose report states its candidate steps waiting on the host (its step-timeline
    statements): time the kernel rows cannot show, named as the host's so that it is neither blamed on nor hidden
    behind a kernel."""
    return [Claim("steps", tuple(p.row for p in s.points), s.name, {"baseline": base, "candidate": cand,
                                                                   **asdict(statement.row)})
            for s in group for statement in s.report.statements if statement.kind == "step-timeline"]


def _residency_claims(group: list[Scenario], base: str, cand: str, objective: str) -> list[Claim]:
    """Per point whose server counted each request's cached tokens, and where either arm served prompt tokens from
    its prefix cache or evicted cached blocks: how much more of the prompts each arm's pool
    served from its prefix cache and how many cached blocks it evicted (residency, a capacity effect), beside the
    prefill attention kernel's cost on the group's matched cold prefill and the objective's outcome there; stated
    whichever way the objective fell, so that a residency win never reads as a faster kernel, nor a slower kernel
    hide one."""
    cold = next(((s, p) for s in group for p in s.points if p.cold_prefill), None)
    kernel = None
    if cold is not None:
        kernel = next((_kernel_verdict(k, row=cold[1].row) for k in point_kernels(cold[0].report, "prefill_attention")
                       if k.ratio is not None), None)
    claims = []
    for s in group:
        for p in s.points:
            arms = (p.serving.baseline, p.serving.candidate) if p.serving else (None, None)
            if None in arms or None in (arms[0].reuse, arms[1].reuse) \
                    or None in (arms[0].reuse.cached_share, arms[1].reuse.cached_share):  # no prompt tokens counted
                continue
            if not any(m.reuse.cached_tokens or (m.evictions and m.evictions.blocks_removed) for m in arms):
                continue  # no prefix caching happened at the point: residency has nothing to say there
            estimate = p.estimate
            claims.append(Claim("residency", (p.row,) + ((kernel["row"],) if kernel else ()), p.scenario, {
                "baseline": base, "candidate": cand, "point": p.point, "objective": objective,
                "reuse": [asdict(m.reuse) for m in arms],
                "cached_share": [m.reuse.cached_share for m in arms],
                "evictions": [asdict(m.evictions) if m.evictions else None for m in arms],
                "cold_prefill_kernel": kernel, "winner": p.winner, "ratio": p.ratio,
                "ci_low": estimate.low if estimate else None, "ci_high": estimate.high if estimate else None,
                "runs": estimate.runs if estimate else None, "pooled_with": list(p.pooled_with),
                "pooled_directories": p.pooled_directories}))
    return claims


def build(paths: list[Path], recipes: RecipeSet, *, objective: str = "ttft", threshold: float = 0.02,
          confidence: float = 0.95, seed: int = 0, nsys: str | None = None, cache: bool = True) -> Matrix:
    if objective not in OBJECTIVES:
        raise KvtraceError(f"--objective {objective}: choose {', '.join(OBJECTIVES)}")
    scenarios = []
    start = 1
    for name, runs in group_runs(paths):
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
            sweep=result.sweep, report=result, setup=_setup(manifest)))
    _join_measurements(scenarios, objective, threshold, confidence)
    return Matrix(objective=objective, threshold=threshold, scenarios=scenarios,
                  claims=_claims(scenarios, objective, threshold))
