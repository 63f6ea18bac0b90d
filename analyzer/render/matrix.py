"""Markdown and terminal for the matrix decision (analyzer.matrix.Matrix; JSON is json_out's): the serving table
of scenarios and traffic points with their intervals, the decision worded from its claims (what the rows measured
first), then, inside <details>, the kernel rows per scenario and the rest of each point's serving numbers. Nothing
here decides anything: the cells and sentences pick and format the Matrix's fields."""

from __future__ import annotations

from typing import Callable

from rich.console import Console

from kvtrace.analyzer import matrix as mx
from kvtrace.analyzer import budget as budget_lib, claims as claims_lib
from kvtrace.analyzer.render import budget as budget_words, markdown as markdown_lib, quality as quality_render
from kvtrace.analyzer.render import repro as repro_render
from kvtrace.analyzer.render.escape import md_code, md_prose, md_text, visible
from kvtrace.analyzer.render.report_tables import _cached, _count, _ms, _peak, _rich_table
from kvtrace.analyzer.render.statements import held_text
from kvtrace.analyzer.render.units import (MARK, duration, estimate_ratio, interval, markdown_table, percent, ratio,
                                          rows_text)
from kvtrace.analyzer.statements import APPEND_PHASE
from kvtrace.analyzer.stats.serving_intervals import (DECIDING_RUN_PAIRS, MOMENTS, NO_INTERVAL, PAIRED_REQUESTS,
                                                       RUN_MEANS)
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.analyzer.steps import HELD_BY_WAIT
from kvtrace.text import plural

Name = Callable[[str], str]

# A GitHub issue or comment body holds this many characters: the markdown keeps under it (its head always).
ISSUE_CHARS = 65_536
# The kernel rows of the head, in its order: (words, statement subject).
KERNEL_COLUMNS = (("prefill attention", "prefill_attention"), ("decode attention", "decode_attention"),
                  ("KV append kernel", "kv_append"), ("KV append phase", APPEND_PHASE))
_SUBJECT_WORDS = dict((subject, words) for words, subject in KERNEL_COLUMNS)
_SEGMENT_WORDS = {"prefill_attention": "prefill attention", "decode_attention": "decode attention"}
# The causes a point's TTFT budget gives (analyzer.budget), worded with the budget itself.
_BUDGET_CAUSES = (budget_lib.CAPACITY, budget_lib.FASTER_KERNEL, budget_lib.HOST_TIME, budget_lib.PREFILL_TIME,
                  budget_lib.REST_TIME)
_CAUSE_WORDS = {budget_lib.CAPACITY: "a capacity effect, its requests queued less",
                budget_lib.PREFILL_TIME: "a shorter prefill time", budget_lib.FASTER_KERNEL: "faster prefill kernels",
                budget_lib.HOST_TIME: "less host-held time in its prefill steps",
                budget_lib.REST_TIME: "less time outside the engine core"}
_OBJECTIVE_WORDS = {"ttft": "TTFT", "itl": "ITL", "throughput": "output tokens/s"}
_METHOD_WORDS = {PAIRED_REQUESTS: "paired requests", RUN_MEANS: "run pairs' means",
                 MOMENTS: "per-request mean and std", NO_INTERVAL: "none"}
# The serving columns of the table: (header, ServingRow.estimates' key, unit).
SERVING_COLUMNS = (("TTFT ms", "ttft_ms", "ms"), ("ITL ms (per request: TPOT)", "tpot_ms", "ms"),
                   ("output tok/s", "output_tokens_per_s", "tok/s"))


def _plain(text: str) -> str:
    return text


def _band(estimate, pooled_with=(), directories: int = 0) -> str:
    """The no-change band an estimate's verdict used, and what it rests on (a decided point has run pairs enough to
    put the drift inside its interval)."""
    return (f"the threshold; {estimate.runs} run pairs{_pooled(pooled_with, directories)} put the drift inside the "
            "interval")


def _pooled(pooled_with, directories: int) -> str:
    """", pooled with R7 (2 run directories)": the other rows whose run pairs a point's estimate pools."""
    if not pooled_with:
        return ""
    return f", pooled with {rows_text(pooled_with)} ({directories} run directories)"


# ---- cells -----------------------------------------------------------------------------------------------

def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    return f"{value:,.1f}" if unit == "ms" else f"{value:,.0f}"


def estimate_cell(estimate, unit: str, pooled: mx.MatrixPoint | None = None) -> str:
    """baseline → candidate (means over every run), then candidate / baseline with its interval; `pooled`: a point
    whose objective is judged on this measurement pooled with others, a third line with that pooled estimate."""
    if estimate is None:
        return "–"
    cell = f"{_number(estimate.baseline, unit)} → {_number(estimate.candidate, unit)}<br>{estimate_ratio(estimate)}"
    if pooled is not None and pooled.pooled_with:
        cell += (f"<br>all run pairs: {estimate_ratio(pooled.estimate)}"
                 f"{_pooled(pooled.pooled_with, pooled.pooled_directories)}")
    return cell


def _arms(point: mx.MatrixPoint, fmt) -> str:
    row = point.serving
    return f"{fmt(row.baseline)} → {fmt(row.candidate)}"


def _capacity(point: mx.MatrixPoint, scenario: mx.Scenario) -> str:
    parts = [f"{label}: {reason}" for label, reason in ((scenario.baseline, point.baseline_capacity),
                                                        (scenario.candidate, point.candidate_capacity)) if reason]
    parts += point.capacity_notes
    text = "; ".join(parts) or "neither arm"
    return ("◆ crossover · " + text) if point.crossover else text


def winner_cell(point: mx.MatrixPoint, scenario: mx.Scenario) -> str:
    if point.winner is None:
        return point.undecided or "not decided"
    if point.winner == mx.NO_CLEAR_WINNER:
        return f"{mx.NO_CLEAR_WINNER} (band: {_band(point.estimate, point.pooled_with, point.pooled_directories)})"
    if point.winner == mx.NOT_EXPLAINED:
        label = scenario.candidate if point.apparent == "candidate" else scenario.baseline
        return f"{mx.NOT_EXPLAINED}: {label} looks better, and nothing kvtrace measured says why"
    label = scenario.candidate if point.winner == "candidate" else scenario.baseline
    return (f"{label} ({ratio(point.ratio)} {interval(point.estimate.low, point.estimate.high)}"
            f"{_pooled(point.pooled_with, point.pooled_directories)})")


def causes_cell(point: mx.MatrixPoint) -> str:
    if point.winner in (None, mx.NO_CLEAR_WINNER, mx.NOT_EXPLAINED):
        return "–"
    return " + ".join(point.causes) + (" (neither alone)" if len(point.causes) == 2 else
                                       " (none alone)" if len(point.causes) > 2 else "")


def _where(scenario: mx.Scenario, point: mx.MatrixPoint, name: Name, br: str) -> str:
    return name(scenario.name) + (f"{br}{name(point.point)}" if point.point else "")


def table(result: mx.Matrix, name: Name, br: str = "<br>") -> tuple[list[str], list[list[str]]]:
    """The visible table: one row per scenario and traffic point, serving means with their intervals (TTFT beside
    the cached prompt tokens), whether an arm is capacity-bound, and who wins. `br` stacks a cell's lines."""
    objective = _OBJECTIVE_WORDS[result.objective]
    header = ["row", "scenario · traffic point", "arms", SERVING_COLUMNS[0][0], "cached prompt tokens",
              *(h for h, _, _ in SERVING_COLUMNS[1:]), "capacity-bound", f"wins on {objective}", "what wins it"]
    body = []
    objective_key = mx.OBJECTIVES[result.objective][0]
    for scenario in result.scenarios:
        arms = f"{name(scenario.baseline)} → {name(scenario.candidate)}"
        for point in scenario.points:
            where = _where(scenario, point, name, br)
            if point.serving is None:
                body.append([f"R{point.row}", where, arms, *["–"] * 5, name(winner_cell(point, scenario)), "–"])
                continue
            estimates = point.serving.estimates
            cells = [estimate_cell(estimates.get(key), unit, point if key == objective_key else None).replace(
                "<br>", br) for _, key, unit in SERVING_COLUMNS]
            body.append([f"R{point.row}", where, arms, cells[0], _arms(point, _cached), *cells[1:],
                         name(_capacity(point, scenario)), name(winner_cell(point, scenario)), causes_cell(point)])
    return header, body


def rest_table(result: mx.Matrix, name: Name, br: str = "<br>") -> tuple[list[str], list[list[str]]]:
    """The serving columns the short table leaves out, per point: the arms, their cached prompt tokens, ITL and
    throughput with their intervals."""
    header, body = table(result, name, br)
    keep = [header.index(h) for h in ("row", "arms", "cached prompt tokens", *(h for h, _, _ in SERVING_COLUMNS[1:]))]
    return [header[i] for i in keep], [[line[i] for i in keep] for line in body]


def kernel_table(result: mx.Matrix, name: Name) -> tuple[list[str], list[list[str]]]:
    """The rows of each scenario's head (candidate / baseline per call), one per phase and workload point, with the
    kernels compared and their query dtypes; the scenario is its rows' (the tables above name it)."""
    header = ["rows", "phase", "where", "candidate / baseline per call", "verdict", "kernels (query dtype)"]
    body = []
    for scenario in result.scenarios:
        rows = rows_text([p.row for p in scenario.points])
        for k in scenario.kernels:
            queries = (f" ({k.baseline_query} → {k.candidate_query} queries)"
                       if k.baseline_query or k.candidate_query else "")
            body.append([rows, _SUBJECT_WORDS.get(k.subject, k.subject), name(k.point),
                         f"{ratio(k.ratio)} {interval(k.ci_low, k.ci_high, k.no_interval)}"
                         if k.ratio is not None else "–",
                         name(k.verdict if k.ratio is not None else f"{k.verdict} ({k.reason or ''})"),
                         name((k.kernels or "–") + queries)])
    return header, body


def detail_table(result: mx.Matrix, name: Name) -> tuple[list[str], list[list[str]]]:
    """The rest of each point's serving numbers (baseline → candidate, the first run's) and how its intervals
    were made."""
    header = ["row", "E2E latency ms", "input tok/s", "completed", "preemptions", "peak running", "peak KV usage",
              "interval from"]
    body = []
    for scenario in result.scenarios:
        for point in scenario.points:
            if point.serving is None:
                continue
            estimates = point.serving.estimates
            made = next((e for e in (estimates.get(k) for _, k, _ in SERVING_COLUMNS) if e is not None), None)
            how = "–" if made is None else "; ".join(dict.fromkeys(
                _METHOD_WORDS[e.method] for e in estimates.values() if e is not None))
            body.append([f"R{point.row}", estimate_cell(estimates.get("e2el_ms"), "ms").replace("<br>", " · "),
                         _arms(point, lambda m: _count(m and m.input_tokens_per_s and round(m.input_tokens_per_s))),
                         _arms(point, lambda m: _count(m and m.requests)),
                         _arms(point, lambda m: _count(m and m.preemptions)),
                         _arms(point, lambda m: _peak(m, "peak_running", _count)),
                         _arms(point, lambda m: _peak(m, "peak_kv_usage", percent)), name(how)])
    return header, body


# ---- the decision paragraph --------------------------------------------------------------------------------

def _kernel_words(k: mx.KernelVerdict, winner: str, b: str, c: str) -> str:
    return (f"a faster {_SEGMENT_WORDS[k.segment]} kernel ({winner}'s; {c} / {b} per matched call "
            f"{k.ratio:.3f}× {interval(k.ci_low, k.ci_high, k.no_interval)} over "
            f"{k.compared_calls:,} {plural(k.compared_calls, 'pair')})")


def _why(v: claims_lib.PointOutcome, name: Name) -> str:
    """What wins a point, in words; a capacity or prefix-hit win is never called kernel speed."""
    b, c = name(v.baseline), name(v.candidate)
    winner, loser = (c, b) if v.winner == "candidate" else (b, c)
    w, l_ = (1, 0) if v.winner == "candidate" else (0, 1)
    parts = []
    why = v.reason
    budgeted = [cause for cause in v.causes if cause in _BUDGET_CAUSES] if v.objective == "ttft" else []
    if why is not None and budgeted:
        parts.append(f"{_CAUSE_WORDS[budgeted[0]]} ({budget_words.reason_text(why)})")
    elif mx.FASTER_KERNEL in v.causes:
        faster = [k for k in v.kernels if (k.verdict == Verdict.IMPROVEMENT) == (v.winner == "candidate")
                  and k.verdict in (Verdict.IMPROVEMENT, Verdict.REGRESSION)]
        parts += [_kernel_words(k, winner, b, c) for k in faster]
    if mx.PREFIX_HITS in v.causes:
        cached = v.cached_prompt_tokens
        parts.append(f"more prefix hits ({cached[w]:,} cached prompt tokens against {cached[l_]:,})")
    if mx.CAPACITY in v.causes and not budgeted:
        reason = v.baseline_capacity if v.winner == "candidate" else v.candidate_capacity
        queue = v.queue_ms
        queued = (f", requests queued {queue[w]:.1f} ms on average against {queue[l_]:.1f} ms"
                  if None not in queue else "")
        bound = v.candidate_capacity if v.winner == "candidate" else v.baseline_capacity
        running = v.peak_running
        less = (f"was bound less ({name(bound)}), running up to {running[w]:,.0f} requests at once against "
                f"{running[l_]:,.0f}" if bound else "was not")
        parts.append(f"a capacity effect ({loser} was capacity-bound: {name(reason)}; {winner} {less}{queued})")
    if len(parts) == 1:
        # "not kernel speed" where it is measured so, or no kernel is credited; a prefill time no trace split says
        # nothing of kernels either way.
        kernel = mx.FASTER_KERNEL in v.causes or budget_lib.PREFILL_TIME in budgeted
        tail = "" if kernel else ", not kernel speed"
        return f"{winner} wins, by {parts[0]}{tail}"
    alone = "neither alone" if len(parts) == 2 else "none of them alone"
    return f"{winner} wins; {', '.join(parts[:-1])} and {parts[-1]} all favour it, so the gain credits {alone}"


def _objective(v: claims_lib.PointOutcome, name: Name) -> str:
    runs = f", {v.runs} run pairs" if v.runs > 1 else ""
    if v.pooled_rows:
        runs += f" pooled over {rows_text(v.pooled_rows)} ({v.pooled_directories} run directories)"
    return (f"{_OBJECTIVE_WORDS[v.objective]} mean {ratio(v.ratio)} {interval(v.ci_low, v.ci_high)} "
            f"({name(v.candidate)} / {name(v.baseline)}{runs})")


def _outcome(v: claims_lib.PointOutcome, name: Name) -> str:
    text = f"{_objective(v, name)}: {_judgement(v, name)}"
    for row, other in v.differing:
        text += f"; on R{row}'s own run, {_judgement(other, name)}"
    return text


def _judgement(v: claims_lib.PointOutcome, name: Name) -> str:
    """Who wins a point and why, after its objective's estimate."""
    if v.winner == mx.NO_CLEAR_WINNER:
        spread = ("the spread across run directories, and so across sessions," if v.pooled_rows else
                  "the run-to-run spread")
        return (f"no significant difference (the interval holds no change, or the ratio is within ±"
                f"{100 * v.threshold:g}%; {spread} is inside the interval)")
    if v.winner == mx.NOT_EXPLAINED:
        apparent = name(v.candidate if v.apparent == "candidate" else v.baseline)
        kernels = " and ".join(_SEGMENT_WORDS[k.segment] for k in v.kernels)
        traced = v.reason is not None and v.reason.trace_note is None
        measured = (f"its {kernels} kernels are not faster" if kernels else
                    "its own trace names no faster kernel" if traced else
                    "no trace covers this point's own traffic, so its kernels say nothing here,")
        if v.objective == "ttft" and v.reason is not None and not v.reason.budget.carrier_measured:
            return (f"{apparent} looks better beyond the band, but no part of its TTFT budget measured apart from zero "
                    "holds most of the difference, so no kernel, prefix hit or capacity effect explains a measured "
                    "share of it: not explained, so no choice")
        return (f"{apparent} looks better beyond the band, but {measured} and neither prefix hits nor capacity favour "
                "it: not explained, so no choice")
    return _why(v, name)


def _residency(v: claims_lib.ResidencyClaim, cite: str, name: Name) -> str:
    b, c = name(v.baseline), name(v.candidate)
    reuse, shares, evicted = v.reuse, v.cached_share, v.evictions
    # The counts are the point's first run pair's; the objective below is over all of its run pairs.
    first = " in the first run pair" if (v.runs or 1) > 1 else ""
    text = (f"Residency at {name(v.point)} {cite}: by the server's own per-request counts{first} {c} served "
            f"{percent(shares[1])} of its prompt tokens from the prefix cache against {b}'s {percent(shares[0])} "
            f"({reuse[1].reused:,} against {reuse[0].reused:,} of {reuse[1].requests:,} "
            f"{plural(reuse[1].requests, 'request')} had at "
            "least half their prompt cached)")
    if None not in evicted:
        missed = "" if evicted[0].exact and evicted[1].exact else ", at least: some events were missed"
        text += (f" and evicted {evicted[1].blocks_removed:,} cached KV blocks against "
                 f"{evicted[0].blocks_removed:,} (vLLM's KV-cache events{missed})")
    more = shares[1] > shares[0]
    text += (f": {c if more else b}'s larger share is residency, a capacity effect, not a faster kernel."
             if shares[1] != shares[0] else ": the same share.")
    kernel = v.cold_prefill_kernel
    if kernel:
        text += (f" {c}'s prefill attention kernel on the matched cold prefill (R{kernel.row}) is "
                 f"{ratio(kernel.ratio)} {interval(kernel.ci_low, kernel.ci_high, kernel.no_interval)} "
                 f"per call ({kernel.verdict}).")
    objective = _OBJECTIVE_WORDS[v.objective]
    heading = objective[:1].upper() + objective[1:]
    if v.ratio is None:
        return text + f" {heading} there is not compared (its cell says why)."
    spread = (f" {interval(v.ci_low, v.ci_high)}"
              + (f" over {v.runs} run {plural(v.runs, 'pair')}" if v.ci_low is not None else "")
              + _pooled(v.pooled_with, v.pooled_directories))
    outcome = {"candidate": f"{c} wins it", "baseline": f"{b} wins it",
               mx.NO_CLEAR_WINNER: "no significant difference", mx.NOT_EXPLAINED: "not explained"}.get(
        v.winner, f"not decided: {v.undecided}" if v.undecided else "not decided")
    # Only a decided point says what the residency did not buy; an undecided one says what was measured.
    paid = (f": {c}'s residency did not buy a better {objective} here"
            if more and v.winner in ("baseline", mx.NO_CLEAR_WINNER) else "")
    return text + f" {heading} there: {ratio(v.ratio)}{spread} ({c} / {b}), {outcome}{paid}."


def _server(v: claims_lib.PointOutcome, name: Name) -> str:
    """What the server measured of the capacity mechanism, baseline against candidate, where recorded."""
    b, c = name(v.baseline), name(v.candidate)
    measures = dict(zip(claims_lib.SERVER_MEASURES, ((_count, "preemptions"), (_count, "peak running requests"),
                                             (percent, "peak KV-cache usage"), (_ms, "mean time queued"))))
    recorded = [key for key in measures if None not in getattr(v, key)]  # the first run's, as the row keeps them
    if not recorded:
        return ""
    # With repeats, every run's values where every run recorded them: one run's measure is not the point's.
    per_run = v.server_runs
    runs = len(getattr(per_run, recorded[0])[0])
    every = runs > 1 and all(None not in side for key in recorded for side in getattr(per_run, key))
    parts = []
    for key in recorded:
        fmt, words = measures[key]
        sides = getattr(per_run, key) if every else [[getattr(v, key)[0]], [getattr(v, key)[1]]]
        parts.append(f"{words} {' and '.join(map(fmt, sides[0]))} against {' and '.join(map(fmt, sides[1]))}")
    whose = f"each of its {runs} runs, in order" if every else "its first run" if runs > 1 else ""
    if v.server_rows:  # a pooled point: the runs are its rows' together
        rows = list(dict.fromkeys(v.server_rows))
        whose = (f"each of the {runs} runs of {rows_text(rows)}, row by row in repeat order" if every else
                 f"R{rows[0]}'s first run")
    return f"; the server measured, {b} against {c}: " + ", ".join(parts) + (f" ({whose})" if whose else "")


def _capacity_claim(v: claims_lib.PointOutcome, cite: str, name: Name) -> str:
    """A point where capacity binds for one arm or both: which, why, and what the server measured of it (the
    mechanism that can lower TTFT without a faster kernel), then the objective's outcome."""
    b, c = name(v.baseline), name(v.candidate)
    bound_b, bound_c = v.baseline_capacity, v.candidate_capacity
    where = (" (the sweep's crossover: the first point where only the narrower format fits)"
             if v.crossover else "")
    if bound_b and bound_c:
        return (f"Where capacity binds for both arms, at {name(v.point)} {cite}: {b} is capacity-bound "
                f"({name(bound_b)}) and so is {c} ({name(bound_c)}){_server(v, name)}: {_outcome(v, name)}.")
    if bound_c:
        return (f"Where capacity binds, at {name(v.point)} {cite}: {c} is capacity-bound ({name(bound_c)}) and {b} "
                f"is not{_server(v, name)}: {_outcome(v, name)}.")
    paid = {"candidate": "paid for its kernel costs", "baseline": "did not pay for its kernel costs",
            mx.NOT_EXPLAINED: "is credited with nothing"}.get(v.winner, "neither paid nor lost")
    return (f"Where capacity binds, at {name(v.point)} {cite}{where}: {b} is capacity-bound ({name(bound_b)}) and "
            f"{c} is not{_server(v, name)}; {c}'s extra residency {paid} there: {_outcome(v, name)}.")


def _phase_words(phase: claims_lib.MeasuredPhase, v: claims_lib.MeasuredClaim, name: Name) -> str:
    """One row of the head over every scenario: range, verdicts, the kernels compared and their query dtypes."""
    span = (ratio(phase.low) if phase.one_ratio else
            f"{ratio(phase.low)}–{ratio(phase.high)}")
    verdicts = ", ".join(f"{count} {verdict}" for verdict, count in phase.verdicts)
    queries = "; ".join(f"{name(v.baseline)} on {q[0] or '?'} queries, {name(v.candidate)} on {q[1] or '?'}"
                        for q in phase.queries)
    kernels = "; ".join(name(k) for k in phase.kernels[:3])
    words = f"{_SUBJECT_WORDS[phase.subject]} {span} ({verdicts}; {rows_text(phase.rows)}): {kernels}"
    if queries:
        words += f" ({queries})"
    if phase.different_kernels:
        words += (" — the arms ran different kernels here, so the ratio is one kernel against the other, not the "
                  "cost of converting the cache")
    return words


def _environment_text(claim: claims_lib.EnvironmentClaim, result: mx.Matrix, name: Name) -> str:
    held = "; ".join(
        f"{name(e.gpu)}, FlashInfer {name(e.flashinfer or 'not recorded')}, "
        + (f"vLLM {name(e.vllm)}" if e.vllm else "no vLLM") + ", attention backend "
        + name(e.attention_backend or "not recorded") for e in claim.environments)
    patched = "".join(f" {name(words)}." for words in dict.fromkeys(w for e in claim.environments for w in e.patched))
    return f"{name(claim.candidate)} against {name(claim.baseline)} {_cite(claim)} holds for {held}.{patched}"


def _measured_text(v: claims_lib.MeasuredClaim, result: mx.Matrix, name: Name) -> str:
    b, c = name(v.baseline), name(v.candidate)
    text = (f"What this GPU, engine and kernel route measured, {c} / {b} per call on the rows of each "
            f"scenario's head: " + "; ".join(_phase_words(p, v, name) for p in v.phases) + ".")
    narrower = {"candidate": c, "baseline": b}.get(v.narrower)
    if narrower and v.decode_expectation == "did not hold":
        text += (f" The general expectation that the narrower format ({narrower}) saves time in decode, since it "
                 "moves fewer bytes, did not hold here: no decode attention row is faster with it.")
    elif narrower and v.decode_expectation == "held at some rows only":
        text += (f" The general expectation that the narrower format ({narrower}) saves time in decode held at "
                 "some decode attention rows only.")
    elif narrower and v.decode_expectation == "held":
        text += f" The narrower format ({narrower}) is faster in decode attention here, as it moves fewer bytes."
    return text


def _phase_point_text(claim: claims_lib.ColdPrefillClaim | claims_lib.DecodeClaim, result: mx.Matrix,
                      name: Name) -> str:
    v = claim.outcome
    kernels = "; ".join(
        f"{name(k.point)} {ratio(k.ratio)} {interval(k.ci_low, k.ci_high, k.no_interval)} {k.verdict}"
        if k.ratio is not None else f"{name(k.point)} {k.verdict} ({name(k.reason or '')})"
        for k in claim.phase_kernels) or "not compared"
    cold = isinstance(claim, claims_lib.ColdPrefillClaim)
    where, what = ("cold prefill", "prefill") if cold else ("decode", "decode")
    return (f"Where {where} dominates, at {name(v.point)} {_cite(claim)}: {what} attention kernels {kernels} "
            f"({name(v.candidate)} / {name(v.baseline)}); {_outcome(v, name)}.")


def _point_text(claim: claims_lib.PointClaim | claims_lib.PrefixClaim, result: mx.Matrix, name: Name) -> str:
    what = "With prefix reuse at" if isinstance(claim, claims_lib.PrefixClaim) else "At"
    return f"{what} {name(claim.outcome.point)} {_cite(claim)}: {_outcome(claim.outcome, name)}."


def _steps_text(claim: claims_lib.StepsClaim, result: mx.Matrix, name: Name) -> str:
    b, c, v, cite = name(claim.baseline), name(claim.candidate), claim.step, _cite(claim)
    held = held_text(v.held_by, v.steps, claim.baseline, claim.candidate, name)
    if v.host_reading == HELD_BY_WAIT:
        return (f"In {name(claim.scenario)}'s {v.phase} steps {cite}, {c}'s host stayed in "
                f"{v.candidate_waited_steps:,} of {v.steps:,} paired steps until their GPU work was nearly "
                f"done ({b}: {v.baseline_waited_steps:,}): {held}; the span on the GPU "
                f"{ratio(v.span_ratio)} {interval(v.span_low, v.span_high)} ({v.span_verdict}) is not "
                "measured as longer: what holds the host, not a slower kernel.")
    return (f"In {name(claim.scenario)}'s {v.phase} steps {cite}, {c}'s kernels took "
            f"{ratio(v.kernel_ratio)} {interval(v.kernel_low, v.kernel_high)} {b}'s time per step, but "
            f"its steps spanned {ratio(v.span_ratio)} {interval(v.span_low, v.span_high)} on the GPU: "
            f"{duration(v.candidate_idle_ns)} per step with no kernel running against "
            f"{duration(v.baseline_idle_ns)}, and {c}'s host stayed in {v.candidate_waited_steps:,} of "
            f"{v.steps:,} paired steps until their GPU work was nearly done ({b}: {v.baseline_waited_steps:,})"
            f": host-side time in {c}'s steps (report's \"vLLM steps on the GPU\"), not a slower kernel"
            + (f"; {held}." if held else "."))


def _disagree_text(v: claims_lib.DisagreeClaim, result: mx.Matrix, name: Name) -> str:
    each = "; ".join(f"R{m.row} {ratio(m.ratio)} " + interval(m.ci_low, m.ci_high)
                     + (f" over {m.runs} run pairs" if m.runs > 1 else " from one run per arm")
                     for m in v.measurements)
    return (f"{name(v.point)} was measured more than once {_cite(v)}, and the measurements disagree on "
            f"{_OBJECTIVE_WORDS[v.objective]} ({name(v.candidate)} / {name(v.baseline)}: {each}): "
            "kvtrace does not decide this point; record it again with --repeats.")


def _kernels_text(v: claims_lib.KernelsClaim, result: mx.Matrix, name: Name) -> str:
    costs = "; ".join(f"{k.subject.replace('_', ' ')} {name(k.point)} {ratio(k.ratio)} "
                      f"{interval(k.ci_low, k.ci_high, k.no_interval)} {k.verdict}" for k in v.costs)
    return (f"{name(v.scenario)} {_cite(v)} has no serving metrics, so no objective decides it; its kernels cost "
            f"({name(v.candidate)} / {name(v.baseline)}): {costs}.")


def _choice_text(v: claims_lib.ChoiceClaim, result: mx.Matrix, name: Name) -> str:
    objective = _OBJECTIVE_WORDS[v.objective]
    parts = [f"choose {name(v.candidate)} at {rows_text(v.candidate_wins)}" if v.candidate_wins else None,
             f"keep {name(v.baseline)} at {rows_text(v.baseline_wins)}" if v.baseline_wins else None,
             f"no significant difference at {rows_text(v.no_clear_winner)}" if v.no_clear_winner else None,
             f"not explained (no choice) at {rows_text(v.not_explained)}" if v.not_explained else None,
             f"measurements disagree at {rows_text(v.disagree)}" if v.disagree else None,
             f"not decided at {rows_text(v.undecided)} (their cells say why)" if v.undecided else None]
    text = f"On {objective}, {name(v.candidate)} against {name(v.baseline)}: " + "; ".join(p for p in parts if p) + "."
    if v.one_run:
        text += (f" {rows_text(v.one_run)} rest on one run per arm: run-to-run drift is not measured there "
                 f"(`kvtrace capture --repeats {DECIDING_RUN_PAIRS}` measures it; per-request times, which `vllm bench "
                 "serve --save-detailed` keeps, give TTFT and ITL an interval within a run).")
    return text


def _quality_text(v: claims_lib.QualityClaim, result: mx.Matrix, name: Name) -> str:
    return quality_render.decision({s.name: s.report.quality for s in result.scenarios
                                    if s.name in v.scenarios and s.report.quality}, v.candidate, name)


def _cite(claim) -> str:
    return f"({rows_text(claim.rows)})"


# Each claim's words by its type.
_WORDS = {claims_lib.EnvironmentClaim: _environment_text,
          claims_lib.PoolClaim: lambda claim, result, name: budget_words.pool_text(claim, name),
          claims_lib.BudgetClaim: lambda claim, result, name: budget_words.claim_text(claim, name),
          claims_lib.MeasuredClaim: _measured_text,
          claims_lib.CapacityClaim: lambda claim, result, name: _capacity_claim(claim.outcome, _cite(claim), name),
          claims_lib.ColdPrefillClaim: _phase_point_text, claims_lib.DecodeClaim: _phase_point_text,
          claims_lib.PrefixClaim: _point_text, claims_lib.PointClaim: _point_text,
          claims_lib.ResidencyClaim: lambda claim, result, name: _residency(claim, _cite(claim), name),
          claims_lib.StepsClaim: _steps_text, claims_lib.DisagreeClaim: _disagree_text,
          claims_lib.KernelsClaim: _kernels_text, claims_lib.ChoiceClaim: _choice_text,
          claims_lib.QualityClaim: _quality_text}


def claim_text(claim: claims_lib.Claim, result: mx.Matrix, name: Name = _plain) -> str:
    return _WORDS[type(claim)](claim, result, name)


def _lead(result: mx.Matrix) -> str:
    return (f"One row per scenario and traffic point (R1, R2, …: what the decision cites). Serving cells are "
            "baseline → candidate, each arm's mean over every run, then candidate / baseline with its 95% interval "
            f"(docs/statistics.md, serving intervals). A point is decided only on {DECIDING_RUN_PAIRS} run pairs or "
            "more (one run per arm leaves the run-to-run drift unmeasured, two measure it by one difference), and is "
            f"won on {_OBJECTIVE_WORDS[result.objective]} only where the interval excludes no change (the run pairs' "
            f"spread is inside it) and the ratio is beyond ±{100 * result.threshold:g}%, and is a choice only where "
            "something measured at that point explains it: on TTFT, the part of the server's TTFT budget that carries "
            "the difference (queue time: a capacity effect; prefill time, split by that point's own traced steps "
            "where a trace covers it; the rest), else a faster kernel where the kernel diff read the point's "
            "traffic, prefix hits or a capacity effect. Points whose arms did different work, or that two "
            "measurements disagree on, are not decided. A point measured in several run directories whose "
            "measurements agree is judged once on all their run pairs pooled (each run pair a unit, its requests "
            "never mixed with another run's): the interval over the run pairs' means then holds the drift between "
            "sessions, and the band is the threshold.")


def _split_lines(scenario: mx.Scenario) -> list[str]:
    """The scenario's traced prefill ratio split into route x format, where its run directories hold repro results."""
    report = scenario.report
    return repro_render.split_lines(report.repro, report.baseline.versions.get("flashinfer"))


def markdown(result: mx.Matrix) -> str:
    """The answer (serving table, decision) ahead of <details> with the kernel rows and the rest; where the whole
    would not fit an issue body (ISSUE_CHARS), the <details> part is left to the file `result.rest_file` names
    (`kvtrace matrix -o FILE.md` writes it), or, on standard output, to a run with -o."""
    head, rest = markdown_parts(result)
    if len(head) + len(rest) <= ISSUE_CHARS:
        return head + rest
    where = (f"are in {markdown_lib.whole_named(rest, result.rest_file)} beside this file" if result.rest_file else
             "are left out: write the markdown with -o FILE.md to get them in a file beside it")
    return head + f"\nThe kernel rows and the rest of the serving numbers {where} (with them it would not fit an " \
        "issue body).\n"


def _first(result: mx.Matrix) -> list:
    """The claims the first screen states, in this order: the choice, then the pools it holds for."""
    return [c for kind in (claims_lib.ChoiceClaim, claims_lib.PoolClaim) for c in result.claims
            if isinstance(c, kind)]


def short_table(result: mx.Matrix, name: Name, br: str = "<br>") -> tuple[list[str], list[list[str]]]:
    """The first screen's table: per point, TTFT with its interval, where the TTFT difference sits in the server's
    budget, whether an arm is capacity-bound, who wins and why."""
    objective = _OBJECTIVE_WORDS[result.objective]
    header = ["row", "scenario · traffic point", "TTFT ms", "TTFT difference sits in", "capacity-bound",
              f"wins on {objective}", "what wins it"]
    body = []
    for scenario in result.scenarios:
        for point in scenario.points:
            where = _where(scenario, point, name, br)
            if point.serving is None:
                body.append([f"R{point.row}", where, "–", "–", "–", name(winner_cell(point, scenario)), "–"])
                continue
            ttft = estimate_cell(point.serving.estimates.get("ttft_ms"), "ms",
                                 point if result.objective == "ttft" else None).replace("<br>", br)
            body.append([f"R{point.row}", where, ttft, budget_words.cell(point.reason),
                         name(_capacity(point, scenario)), name(winner_cell(point, scenario)), causes_cell(point)])
    return header, body


def markdown_parts(result: mx.Matrix) -> tuple[str, str]:
    """(the visible part: the decision, the pools, the short table; the <details> part: the rest)."""
    first = _first(result)
    lines = [f"## kvtrace matrix: the decision on {_OBJECTIVE_WORDS[result.objective]}", ""]
    for claim in first:
        lines += [claim_text(claim, result, md_text), ""]
    patched = dict.fromkeys(w for c in result.claims if isinstance(c, claims_lib.EnvironmentClaim)
                            for e in c.environments for w in e.patched)
    lines += [line for words in patched for line in (f"{MARK['warning']} {md_text(words)}.", "")]
    lines += [md_text("Serving cells are baseline → candidate, then candidate / baseline with its 95% interval; the "
                      "TTFT difference sits in the part of vLLM's own TTFT budget (queue, prefill, the rest) that "
                      "carries it, candidate − baseline (docs/statistics.md, the TTFT budget). The decision point by "
                      "point is below."), ""]
    lines += markdown_table(*short_table(result, md_text))
    split = [f"- {md_text(s.name)}: {md_prose(line)}" for s in result.scenarios for line in _split_lines(s)]
    lines += [""] + split if split else []
    if result.plots:
        lines += ["", "### Plots", ""]
        lines += [f"- {md_code(p.link)}: {md_text(p.title)}" for p in result.plots]
    lines += ["", f"<sub>kvtrace {result.kvtrace_version} · {result.schema}</sub>", ""]
    rest = ["<details><summary>The decision point by point, every serving number, and the kernel rows</summary>", "",
            md_text(_lead(result)), ""]
    rest += markdown_table(*rest_table(result, md_text))
    rest += [""] + [f"- {md_text(s.name)}: {md_text(quality_render.line(s.report.quality, s.baseline, s.candidate))}"
                    for s in result.scenarios if s.report.quality]
    rest += ["", "### The decision"]
    for claim in result.claims:  # a paragraph each, a pair of formats opened by what it holds for
        if claim not in first:
            rest += ["", claim_text(claim, result, md_text)]
    rest += ["", "### Kernel rows", "", "Kernel rows are candidate / baseline per call, the rows of each scenario's "
             "`kvtrace diff` head with their intervals and verdicts.", ""]
    rest += markdown_table(*kernel_table(result, md_text))
    rest += ["", "Serving numbers not in the table above: baseline → candidate, the first run's (E2E latency: means "
             "over every run, with its interval). vLLM reports no eviction counter in /metrics: preemptions stand "
             "for it.", ""]
    rest += markdown_table(*detail_table(result, md_text))
    rest += ["", "</details>", ""]
    return "\n".join(lines), "\n".join(rest)


def terminal(result: mx.Matrix, console: Console) -> None:
    header, body = table(result, _plain, br=" · ")
    console.print(_rich_table(f"kvtrace matrix: the decision on {_OBJECTIVE_WORDS[result.objective]} (serving: "
                              "baseline → candidate, candidate / baseline [interval])", header, body))
    for s in result.scenarios:
        if s.report.quality:
            console.print(f"{visible(s.name)}: {visible(quality_render.line(s.report.quality, s.baseline, s.candidate))}",
                          markup=False, highlight=False)
        for line in _split_lines(s):
            console.print(f"{visible(s.name)}: {visible(line)}", markup=False, highlight=False)
    console.print(visible(_lead(result)), markup=False, highlight=False)
    console.print("The decision", style="bold")
    first = _first(result)
    for claim in first + [c for c in result.claims if c not in first]:
        console.print(f"  {visible(claim_text(claim, result))}", markup=False, highlight=False)
    console.print(_rich_table("kernels (candidate / baseline per call)", *kernel_table(result, _plain)))
    for plot in result.plots:
        console.print(f"  plot: {visible(plot.path)}", markup=False, highlight=False)
