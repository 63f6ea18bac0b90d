"""Quality beside speed (analyzer.quality.Quality), as `report` and `matrix` show it: one line for the head and the
decision, and the per-point tables for the details. Formats fields only; analyzer/quality.py and analyzer/stats/
computed them."""

from __future__ import annotations

from rich.console import Console

from kvtrace.analyzer import quality as q
from kvtrace.analyzer.render.escape import md_text, rich, visible
from kvtrace.analyzer.render.statements import Name, _plain
from kvtrace.analyzer.render.units import markdown_table, percent
from kvtrace.text import plural

def error(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.3g}%"


def _metric(metrics: dict | None, name: str) -> str:
    if metrics is None:
        return "–"
    value = metrics[name]
    if name == "rel_l2":
        return error(value)
    return "–" if value is None else (f"{value:.5f}" if name == "cosine" else f"{value:.3g}")


def _span(bounds: list[float] | None) -> str:
    if not bounds:
        return "–"
    low, high = error(bounds[0]), error(bounds[1])
    return low if low == high else f"{low}–{high}"


def _inputs(inputs: dict | None) -> str:
    if not inputs:
        return "inputs not recorded"
    if inputs.get("kind") == "file":
        return f"Q/K/V from {inputs.get('file')}"
    if "drawn_as" not in inputs:  # drawn before capture/flashinfer_quality.DRAWN_AS was recorded
        return (f"{inputs.get('kind')} Q/K/V drawn before kvtrace recorded how: if by torch 2.7–2.11's BF16 CPU "
                "normal, no value passes |x| = 3.33 (pytorch/pytorch#166853)")
    return f"{inputs.get('kind')} Q/K/V"


def _ran(result: q.Quality) -> str:
    """The plumbing's evidence beside "not a measurement": how many prompts each run answered, no correctness."""
    if not result.answered:
        return ""
    first, *others = result.answered
    runs = (f"{first.run} answered {first.nonempty} of {first.prompts} prompts of "
            f"{result.prompts_file or 'the prompt file'}"
            + "".join(f", {a.run} {a.nonempty} of {a.prompts}" for a in others))
    if result.cut_limit is not None:
        runs += (f"; {result.cut_answers} of {result.answered_prompts} answers stopped at the {result.cut_limit}-token "
                 "limit")
    return f" (the quality step itself ran: {runs})"


def repeats(result: q.Quality) -> list[str]:
    """One sentence per repeat past the first: whether each arm answered as its first run did, and its own paired
    table when the answers are a measurement."""
    lines = []
    for r in result.repeats:
        text = (f"{r.baseline_run} answered {r.baseline_alike} of {r.prompts} prompts token for token as its "
                f"arm's first run, {r.candidate_run} {r.candidate_alike} of {r.prompts}")
        if result.state == q.MEASURED:
            text += (f"; their paired table: {r.baseline_only} prompts only {r.baseline_run} got right, "
                     f"{r.candidate_only} only {r.candidate_run} (the test above is the first repeat's)")
        lines.append(text)
    return lines


def line(result: q.Quality, baseline: str, candidate: str) -> str:
    """The quality line: what was measured and what it says, or why there is nothing to show."""
    if result.state == q.NOT_MEASURED:
        return f"Quality not measured: {result.reason or ''}."
    if result.state == q.MEANINGLESS:
        return f"Quality not a measurement: {result.reason or ''}{_ran(result)}."
    if result.level == q.KERNEL:
        contexts = sorted({row.context for row in result.errors})
        parts = []
        for what in ("prefill", "decode"):
            spans = [_span(result.spans[what][side]) for side in ("baseline", "candidate")]
            parts.append(f"{what} {baseline} {spans[0]} vs {candidate} {spans[1]}")
        where = f"context {contexts[0]}" if len(contexts) == 1 else f"contexts {contexts[0]}–{contexts[-1]}"
        return (f"Quality (kernel error, {_inputs(result.inputs)}): attention output relative L2 error against a "
                f"float64 reference over the BF16 cache, {'; '.join(parts)} ({where}, each context apart below)."
                + "".join(f" {sentence}" for sentence in departures(result, baseline, candidate)))
    acc = result.accuracy
    text = (f"Quality ({acc.prompts} {plural(acc.prompts, 'prompt')} of "
            f"{result.prompts_file or 'the prompt file'}, greedy): accuracy "
            f"{baseline} {percent(acc.baseline_accuracy)} → {candidate} {percent(acc.candidate_accuracy)}, "
            f"{acc.verdict} (McNemar exact p = {acc.p_value:.3g}: {acc.baseline_only} "
            f"{plural(acc.baseline_only, 'prompt')} only {baseline} got right, {acc.candidate_only} only "
            f"{candidate})")
    agree = result.agreement
    text += (f"; outputs identical on {agree.identical} of {agree.prompts} {plural(agree.prompts, 'prompt')}, "
             f"{percent(agree.token_agreement)} "
             f"of {baseline}'s tokens alike before the first divergence")
    if result.auto:
        text += "; against BF16 (" + result.auto[0].reference + "): " + ", ".join(
            f"{a.arm} {percent(a.token_agreement)} of tokens alike, {a.identical} identical" for a in result.auto)
    return text + "."


def departures(result: q.Quality, baseline: str, candidate: str) -> list[str]:
    """One warning per arm and phase whose kernel strays from the attention its own cache defines, every such context
    named with its distance (measured, or the lower bound of runs recorded before it was)."""
    sentences = []
    for group in result.strays:
        found = group.departures
        points = ", ".join(
            f"{error(d.distance)} away at context {d.context}" if d.measured else
            f"at least {error(d.distance)} away at context {d.context} (its error {error(d.kernel)} against the "
            f"reference where the format alone has {error(d.format)})" for d in found)
        low, high = f"{group.low_roundings:.0f}", f"{group.high_roundings:.0f}"
        arm = baseline if group.side == "baseline" else candidate
        bound = "" if found[0].measured else "at least "
        sentences.append(
            f"⚠️ {arm}'s {group.what} kernel strays from exact attention over its own dequantized cache: its output "
            f"is {points} ({bound}{low if low == high else f'{low}–{high}'} BF16 roundings, past the "
            f"{q.DEPARTURE_ROUNDINGS} an honest BF16 kernel stays within): the kernel's arithmetic or its reading of "
            "the cache, not the format's bits.")
    return sentences


def decision(results: dict[str, q.Quality], candidate: str, name: Name = _plain) -> str:
    """The decision's quality sentence over a pair's scenarios: what each measured, and whether the narrower format's
    accuracy is established by them."""
    parts = []
    for scenario, result in results.items():
        if result.state == q.MEASURED and result.level == q.ANSWERS:
            acc = result.accuracy
            what = (f"{acc.verdict} over {acc.prompts} {plural(acc.prompts, 'prompt')} (McNemar exact p = "
                    f"{acc.p_value:.3g})")
        elif result.state == q.MEASURED:
            what = "the kernel's attention error above (an error against a reference, not the model's accuracy)"
            strays = dict.fromkeys(f"{candidate if d.side == 'candidate' else 'the baseline'}'s {d.what}"
                                   for d in result.departures)
            if strays:
                what += f", where {' and '.join(strays)} kernel strays from its own dequantized cache"
        else:
            what = f"{result.state}: {result.reason}"
        parts.append(f"{name(scenario)}: {name(what)}")
    answered = [r for r in results.values() if r.state == q.MEASURED and r.level == q.ANSWERS]
    close = (f" No run here measured the model's answers, so {name(candidate)}'s accuracy is not established: check it "
             "before choosing it." if not answered else
             " A paired test that finds no difference does not show the formats equal: its power grows with the "
             "prompts.")
    return "Quality, as measured beside speed: " + ("; ".join(parts) or "no scenario") + "." + close


def _error_table(result: q.Quality, baseline: str, candidate: str) -> tuple[list[str], list[list[str]]]:
    header = ["context", "what", f"{baseline} rel L2", f"{candidate} rel L2", f"{baseline} cosine",
              f"{candidate} cosine", f"{baseline} max abs", f"{candidate} max abs", f"format alone rel L2 "
              f"({baseline} / {candidate})", f"kernel vs own format rel L2 ({baseline} / {candidate})",
              "BF16 output floor"]
    rows = []
    for row in result.errors:
        rows.append([str(row.context), row.what, _metric(row.baseline, "rel_l2"), _metric(row.candidate, "rel_l2"),
                     _metric(row.baseline, "cosine"), _metric(row.candidate, "cosine"),
                     _metric(row.baseline, "max_abs"), _metric(row.candidate, "max_abs"),
                     "–" if row.baseline_format is None and row.candidate_format is None else
                     f"{_metric(row.baseline_format, 'rel_l2')} / {_metric(row.candidate_format, 'rel_l2')}",
                     "–" if row.baseline_vs_format is None and row.candidate_vs_format is None else
                     f"{_metric(row.baseline_vs_format, 'rel_l2')} / {_metric(row.candidate_vs_format, 'rel_l2')}",
                     _metric(row.floor, "rel_l2")])
    return header, rows


def _prompt_table(result: q.Quality, baseline: str, candidate: str) -> tuple[list[str], list[list[str]]]:
    header = ["prompt", f"{baseline} right", f"{candidate} right", "first divergence (token)",
              f"{baseline} tokens", f"{candidate} tokens"]
    rows = [[r.id, "yes" if r.baseline_correct else "no", "yes" if r.candidate_correct else "no",
             "identical" if r.first_divergence is None else str(r.first_divergence), str(r.baseline_tokens),
             str(r.candidate_tokens)] for r in result.differing[:MAX_PROMPT_ROWS]]
    return header, rows


MAX_PROMPT_ROWS = 50  # the markdown must fit an issue; the JSON has every prompt


def markdown(result: q.Quality, baseline: str, candidate: str) -> list[str]:
    """The details section: the per-point error table, or the prompts the arms answered differently."""
    lines = ["### Quality", "", md_text(line(result, baseline, candidate))]
    lines += [f"- {md_text(note)}" for note in result.notes + repeats(result)]
    if result.state != q.MEASURED:
        return lines
    b, c = md_text(baseline), md_text(candidate)
    if result.level == q.KERNEL:
        lines += ["", "rel L2 = ‖out − ref‖ / ‖ref‖ over every checked output value; prefill and decode rows are the "
                  "kernel's output, `cache` rows the round trip of the cache itself; the format-alone column is exact "
                  "attention over the dequantized cache, the kernel-vs-own-format column the kernel's output against "
                  "it (docs/statistics.md).", ""]
        header, rows = _error_table(result, b, c)
        return lines + markdown_table(header, rows)
    header, rows = _prompt_table(result, b, c)
    if not rows:
        return lines + ["", "Every prompt got the same tokens from both arms."]
    more = len(result.differing)
    lines += ["", "Prompts whose answers differ between the arms" + (f" (the first {MAX_PROMPT_ROWS} of {more}; the "
                                                                     "JSON has every prompt)" if more > len(rows)
                                                                     else "") + ":", ""]
    return lines + markdown_table(header, [[md_text(r[0]), *r[1:]] for r in rows])


def terminal(result: q.Quality, baseline: str, candidate: str, console: Console) -> None:
    console.print(f"  {visible(line(result, baseline, candidate))}", markup=False, highlight=False)
    for note in result.notes + repeats(result):
        console.print(f"  {visible(note)}", markup=False, highlight=False)


def terminal_table(result: q.Quality, baseline: str, candidate: str, console: Console) -> None:
    """The per-point errors (kernel level) as a table, for the terminal's details."""
    if result.state != q.MEASURED or result.level != q.KERNEL:
        return
    from rich.table import Table

    header, rows = _error_table(result, baseline, candidate)
    table = Table(title="Quality: attention error against the float64 reference", title_justify="left")
    for index, column in enumerate(header):
        table.add_column(rich(column), justify="left" if index < 2 else "right", overflow="fold")
    for row in rows:
        table.add_row(*[rich(cell) for cell in row])
    console.print(table)


def csv_rows(result: q.Quality, baseline: str, candidate: str) -> list[list]:
    """Long-format rows (section, key, arm, metric, value) as report_csv writes them."""
    rows = [["quality", result.level or "", "", "state", result.state],
            ["quality", result.level or "", "", "reason", result.reason or ""]]
    for row in result.errors:
        for side, label in (("baseline", baseline), ("candidate", candidate)):
            for group, metrics in (("", getattr(row, side)), ("format_", getattr(row, f"{side}_format")),
                                   ("vs_format_", getattr(row, f"{side}_vs_format"))):
                for name in q.METRICS:
                    if metrics is not None and metrics[name] is not None:
                        rows.append(["quality", f"{row.context} {row.what}", label, group + name, metrics[name]])
        if row.floor is not None:
            rows.append(["quality", f"{row.context} {row.what}", "", "floor_rel_l2", row.floor["rel_l2"]])
    for d in result.departures:
        rows.append(["quality", f"{d.context} {d.what}", baseline if d.side == "baseline" else candidate,
                     "departure_rel_l2" if d.measured else "departure_at_least_rel_l2", d.distance])
    if result.accuracy is not None:
        acc = result.accuracy
        rows += [["quality", "answers", baseline, "accuracy", acc.baseline_accuracy],
                 ["quality", "answers", candidate, "accuracy", acc.candidate_accuracy],
                 ["quality", "answers", "", "mcnemar_p", acc.p_value],
                 ["quality", "answers", "", "verdict", acc.verdict]]
    for agree in ([result.agreement] if result.agreement else []) + result.auto:
        rows.append(["quality", f"agreement with {agree.reference}", agree.arm, "token_agreement",
                     "" if agree.token_agreement is None else agree.token_agreement])
    return rows
