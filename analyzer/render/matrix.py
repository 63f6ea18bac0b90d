"""Markdown and terminal for the matrix decision (analyzer.matrix.Matrix; JSON is json_out's): the table of
scenarios and traffic points, the decision paragraph worded from its claims, the crossover plots. Nothing
here decides anything: the cells and sentences pick and format the Matrix's fields."""

from __future__ import annotations

from typing import Callable

from rich.console import Console

from kvtrace.analyzer import matrix as mx
from kvtrace.analyzer.render import quality as quality_render
from kvtrace.analyzer.render.escape import md_code, md_text, visible
from kvtrace.analyzer.render.report_tables import _cached, _count, _peak, _rich_table
from kvtrace.analyzer.render.units import interval, markdown_table, percent, ratio
from kvtrace.analyzer.statements import APPEND_PHASE, KernelStatement

Name = Callable[[str], str]

# The kernel columns: (header, statement subject), in the head's order.
KERNEL_COLUMNS = (("prefill attention", "prefill_attention"), ("decode attention", "decode_attention"),
                  ("KV append kernel", "kv_append"), ("KV append phase", APPEND_PHASE))
_SEGMENT_WORDS = {"prefill_attention": "prefill attention", "decode_attention": "decode attention"}
_OBJECTIVE_WORDS = {"ttft": "TTFT", "itl": "ITL", "throughput": "output tokens/s"}


# The rule the decision applies to the measured rows.
RULE = ("The rule: the narrower format pays for conversion in cold prefill and for packing in append, saves bytes in "
        "decode, and wins TTFT only by fitting more of the working set; so choose it where capacity or decode "
        "bandwidth binds, and keep the wider format where cold prefill dominates and its cache still holds the working "
        "set.")


def _plain(text: str) -> str:
    return text


def rows_text(rows) -> str:
    """R1, R2, R4–R6."""
    rows = sorted(rows)
    if not rows:
        return "no row"
    spans, start = [], rows[0]
    for prev, cur in zip(rows, rows[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"R{start}" if start == prev else f"R{start}–R{prev}")
            start = cur
    return ", ".join(spans)


# ---- cells -----------------------------------------------------------------------------------------------

def _kernel(statement: KernelStatement) -> str:
    if statement.ratio is None:
        return f"{statement.point}: {statement.verdict}"
    return (f"{statement.point}: {ratio(statement.ratio)} {interval(statement.ci_low, statement.ci_high)} "
            f"{statement.verdict}")


def kernel_cell(scenario: mx.Scenario, subject: str) -> str:
    found = [_kernel(s) for s in scenario.kernels if s.subject == subject]
    return "; ".join(found) or "–"


def _pair(b, c, fmt) -> str:
    return f"{fmt(b)} → {fmt(c)}"


def _ms(value) -> str:
    return "–" if value is None else f"{value:,.1f}"


def _latency(m, name: str) -> str:
    lat = getattr(m, name) if m is not None else None
    if lat is None:
        return "–"
    if lat.p50 is not None:
        return f"p50 {_ms(lat.p50)}"
    return f"mean {_ms(lat.mean)}" if lat.mean is not None else "–"


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
        return f"{mx.NO_CLEAR_WINNER} ({ratio(point.ratio)})"
    label = scenario.candidate if point.winner == "candidate" else scenario.baseline
    return f"{label} ({ratio(point.ratio)})"


def causes_cell(point: mx.MatrixPoint) -> str:
    if point.winner in (None, mx.NO_CLEAR_WINNER):
        return "–"
    if not point.causes:
        return "none measured"
    return " + ".join(point.causes) + (" (neither alone)" if len(point.causes) == 2 else
                                       " (none alone)" if len(point.causes) > 2 else "")


def table(result: mx.Matrix, name: Name) -> tuple[list[str], list[list[str]]]:
    """One row per scenario and traffic point; kernel cells on a scenario's first row (one run, one diff)."""
    objective = _OBJECTIVE_WORDS[result.objective]
    header = ["row", "scenario", "traffic point", "arms", *(h for h, _ in KERNEL_COLUMNS), "TTFT ms",
              "cached prompt tokens", "ITL ms", "TPOT ms", "input tok/s", "output tok/s", "completed", "preemptions",
              "peak running", "peak KV usage", "capacity-bound", f"wins on {objective}", "what wins it"]
    body = []
    for scenario in result.scenarios:
        first = scenario.points[0].row
        for point in scenario.points:
            kernels = [name(kernel_cell(scenario, subject)) if point.row == first else f"as R{first}"
                       for _, subject in KERNEL_COLUMNS]
            arms = f"{name(scenario.baseline)} → {name(scenario.candidate)}"
            if point.serving is None:
                body.append([f"R{point.row}", name(scenario.name), "–", arms, *kernels]
                            + ["–"] * 11 + [name(winner_cell(point, scenario)), "–"])
                continue
            serving = [
                _arms(point, lambda m: _latency(m, "ttft_ms")), _arms(point, _cached),
                _arms(point, lambda m: _latency(m, "itl_ms")), _arms(point, lambda m: _latency(m, "tpot_ms")),
                _arms(point, lambda m: _count(m and m.input_tokens_per_s and round(m.input_tokens_per_s))),
                _arms(point, lambda m: _count(m and m.output_tokens_per_s and round(m.output_tokens_per_s))),
                _arms(point, lambda m: _count(m and m.requests)), _arms(point, lambda m: _count(m and m.preemptions)),
                _arms(point, lambda m: _peak(m, "peak_running", _count)),
                _arms(point, lambda m: _peak(m, "peak_kv_usage", percent))]
            body.append([f"R{point.row}", name(scenario.name), name(point.point or "–"), arms, *kernels, *serving,
                         name(_capacity(point, scenario)), name(winner_cell(point, scenario)),
                         causes_cell(point)])
    return header, body


# ---- the decision paragraph --------------------------------------------------------------------------------

def _kernel_words(k: dict, winner: str, b: str, c: str) -> str:
    return (f"a faster {_SEGMENT_WORDS[k['segment']]} kernel ({winner}'s; {c} / {b} per matched call "
            f"{k['ratio']:.3f}× "
            f"{interval(k['ci_low'], k['ci_high'])} over {k['compared_calls']:,} pairs)")


def _why(v: dict, name: Name) -> str:
    """What wins a point, in words; a capacity or prefix-hit win is never called kernel speed."""
    b, c = name(v["baseline"]), name(v["candidate"])
    winner, loser = (c, b) if v["winner"] == "candidate" else (b, c)
    w, l_ = (1, 0) if v["winner"] == "candidate" else (0, 1)
    parts = []
    if mx.FASTER_KERNEL in v["causes"]:
        faster = [k for k in v["kernels"] if (k["verdict"] == "improvement") == (v["winner"] == "candidate")
                  and k["verdict"] in ("improvement", "regression")]
        parts += [_kernel_words(k, winner, b, c) for k in faster]
    if mx.PREFIX_HITS in v["causes"]:
        cached = v["cached_prompt_tokens"]
        parts.append(f"more prefix hits ({cached[w]:,} cached prompt tokens against {cached[l_]:,})")
    if mx.CAPACITY in v["causes"]:
        reason = v["baseline_capacity"] if v["winner"] == "candidate" else v["candidate_capacity"]
        queue = v["queue_ms"]
        queued = (f", requests queued {queue[w]:.1f} ms on average against {queue[l_]:.1f} ms"
                  if None not in queue else "")
        parts.append(f"a capacity effect ({loser} was capacity-bound: {name(reason)}; {winner} was not{queued})")
    if not parts:
        return (f"{winner} wins, by nothing kvtrace measured here (neither its kernels, nor prefix hits, nor "
                "capacity favour it)")
    if len(parts) == 1:
        tail = "" if mx.FASTER_KERNEL in v["causes"] else ", not kernel speed"
        return f"{winner} wins, by {parts[0]}{tail}"
    alone = "neither alone" if len(parts) == 2 else "none of them alone"
    return f"{winner} wins; {', '.join(parts[:-1])} and {parts[-1]} all favour it, so the gain credits {alone}"


def _objective(v: dict, name: Name) -> str:
    what = _OBJECTIVE_WORDS[v["objective"]] + (f" {v['stat']}" if v["stat"] else "")
    return f"{what} {ratio(v['ratio'])} ({name(v['candidate'])} / {name(v['baseline'])})"


def _outcome(v: dict, name: Name) -> str:
    if v["winner"] == mx.NO_CLEAR_WINNER:
        return f"{_objective(v, name)}: no clear winner"
    return f"{_objective(v, name)}: {_why(v, name)}"


def claim_text(claim: mx.Claim, result: mx.Matrix, name: Name = _plain) -> str:
    v = claim.values
    cite = f"({rows_text(claim.rows)})"
    if claim.kind == "environment":
        held = "; ".join(
            f"{name(e['gpu'])}, FlashInfer {name(e['flashinfer'] or 'not recorded')}, "
            + (f"vLLM {name(e['vllm'])}" if e["vllm"] else "no vLLM") + ", attention backend "
            + name(e["attention_backend"] or "not recorded") for e in v["environments"])
        return f"{name(v['candidate'])} against {name(v['baseline'])} {cite} holds for {held}."
    if claim.kind == "capacity":
        paid = {"candidate": "paid for its kernel costs", "baseline": "did not pay for its kernel costs"}.get(
            v["winner"], "neither paid nor lost")
        where = (" (the sweep's crossover: the first point where only the narrower format fits)"
                 if v["crossover"] else "")
        return (f"Where capacity binds, at {name(v['point'])} {cite}{where}: {name(v['baseline'])} is capacity-bound "
                f"({name(v['baseline_capacity'])}) and {name(v['candidate'])} is not, and {name(v['candidate'])}'s "
                f"extra residency {paid} there: {_outcome(v, name)}.")
    if claim.kind in ("cold-prefill", "decode"):
        kernels = "; ".join(
            f"{name(k['point'])} {ratio(k['ratio'])} {interval(k['ci_low'], k['ci_high'])} {k['verdict']}"
            if k["ratio"] is not None else f"{name(k['point'])} {k['verdict']} ({name(k['reason'] or '')})"
            for k in v["phase_kernels"]) or "not compared"
        where, what = (("cold prefill", "prefill") if claim.kind == "cold-prefill" else ("decode", "decode"))
        return (f"Where {where} dominates, at {name(v['point'])} {cite}, this is what {name(v['candidate'])} costs or "
                f"saves: {what} attention kernels {kernels} ({name(v['candidate'])} / {name(v['baseline'])}); "
                f"{_outcome(v, name)}.")
    if claim.kind in ("prefix", "point"):
        what = "With prefix reuse" if claim.kind == "prefix" else "At"
        return f"{what} {'at ' if claim.kind == 'prefix' else ''}{name(v['point'])} {cite}: {_outcome(v, name)}."
    if claim.kind == "kernels":
        costs = "; ".join(f"{k['subject'].replace('_', ' ')} {name(k['point'])} {ratio(k['ratio'])} "
                          f"{interval(k['ci_low'], k['ci_high'])} {k['verdict']}" for k in v["costs"])
        return (f"{name(claim.scenario)} {cite} has no serving metrics, so no objective decides it; its kernels cost "
                f"({name(v['candidate'])} / {name(v['baseline'])}): {costs}.")
    if claim.kind == "choice":
        objective = _OBJECTIVE_WORDS[v["objective"]]
        parts = [f"choose {name(v['candidate'])} at {rows_text(v['candidate_wins'])}" if v["candidate_wins"] else None,
                 f"keep {name(v['baseline'])} at {rows_text(v['baseline_wins'])}" if v["baseline_wins"] else None,
                 f"no clear winner (within ±{100 * result.threshold:g}%) at {rows_text(v['no_clear_winner'])}"
                 if v["no_clear_winner"] else None,
                 f"not decided at {rows_text(v['undecided'])} (their cells say why)" if v["undecided"] else None]
        measured = v["candidate_wins"] or v["baseline_wins"] or v["no_clear_winner"]
        return (f"On {objective}, {name(v['candidate'])} against {name(v['baseline'])}: "
                + "; ".join(p for p in parts if p) + "."
                + (" Serving numbers are one run per arm, without an interval." if measured else ""))
    if claim.kind == "quality":
        return quality_render.decision({s.name: s.report.quality for s in result.scenarios
                                        if s.name in v["scenarios"] and s.report.quality}, v["candidate"], name)
    raise ValueError(f"no words for a {claim.kind} claim")


def _lead(result: mx.Matrix) -> str:
    return (f"One row per scenario and traffic point (R1, R2, …: what the decision cites). Kernel columns are "
            f"candidate / baseline per call from each scenario's report (the rows of `kvtrace diff`'s head, with "
            f"their intervals and verdicts); serving cells are baseline → candidate as each run recorded them "
            "(latencies p50, or the mean where only vLLM's histograms exist). vLLM reports no eviction counter in "
            "/metrics: preemptions stand for it. The winner beats the other arm by more than "
            f"±{100 * result.threshold:g}% on {_OBJECTIVE_WORDS[result.objective]}; points whose arms did different "
            "work, and capacity reasons that rest on peaks not observed, say so in their cells and do not count.")


def markdown(result: mx.Matrix) -> str:
    lines = [f"## kvtrace matrix: the decision on {_OBJECTIVE_WORDS[result.objective]}", "", md_text(_lead(result)), ""]
    lines += markdown_table(*table(result, md_text))
    lines += [""] + [f"- {md_text(s.name)}: {md_text(quality_render.line(s.report.quality, s.baseline, s.candidate))}"
                     for s in result.scenarios if s.report.quality]
    lines += ["", "### The decision", "", RULE]
    for claim in result.claims:  # one paragraph per pair of formats, opened by what it holds for
        lines += ["", claim_text(claim, result, md_text)] if claim.kind in ("environment", "quality") else \
            [claim_text(claim, result, md_text)]
    if result.plots:
        lines += ["", "### Plots", ""]
        lines += [f"- {md_code(p.link)}: {md_text(p.title)}" for p in result.plots]
    lines += ["", f"<sub>kvtrace {result.kvtrace_version} · {result.schema}</sub>"]
    return "\n".join(lines) + "\n"


def terminal(result: mx.Matrix, console: Console) -> None:
    # The markdown's one table, split in two for a terminal's width: the phase evidence, then serving and who wins.
    header, body = table(result, _plain)
    split = 4 + len(KERNEL_COLUMNS)
    console.print(_rich_table(f"kvtrace matrix: the decision on {_OBJECTIVE_WORDS[result.objective]} · kernels "
                              "(candidate / baseline per call)", header[:split], [row[:split] for row in body]))
    console.print(_rich_table("serving (baseline → candidate) and who wins each point", header[:1] + header[split:],
                              [row[:1] + row[split:] for row in body]))
    for s in result.scenarios:
        if s.report.quality:
            console.print(f"{visible(s.name)}: {visible(quality_render.line(s.report.quality, s.baseline, s.candidate))}",
                          markup=False, highlight=False)
    console.print(visible(_lead(result)), markup=False, highlight=False)
    console.print("The decision", style="bold")
    console.print(f"  {RULE}", markup=False, highlight=False)
    for claim in result.claims:
        console.print(f"  {visible(claim_text(claim, result))}", markup=False, highlight=False)
    for plot in result.plots:
        console.print(f"  plot: {visible(plot.path)}", markup=False, highlight=False)
