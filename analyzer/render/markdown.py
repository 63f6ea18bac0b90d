"""GitHub-flavoured markdown, ready to paste into an upstream performance issue."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePath

from kvtrace.analyzer import drift_band
from kvtrace.analyzer.results import Arm, Diff, DiffRow, Summary
from kvtrace.analyzer.findings import read_first
from kvtrace.analyzer.kernels import KernelList
from kvtrace.analyzer.headline import APPEND_PHASE, Headline
from kvtrace.analyzer.render.escape import code_fence, md_code, md_prose, md_text, shown, visible
from kvtrace.analyzer.render.statements import text as statement_text
from kvtrace.analyzer.render.units import (HEAD_TIMES, MARK, PART, arm_time, calls, duration, head_time,
                                          markdown_table, no_change_band, numbered_notes, per_call, percent,
                                          ratio, row_interval, run_ratios, signed_duration, summary_part)
from kvtrace.analyzer.verify import MISMATCHES_SHOWN

# Characters a GitHub issue or comment body holds: markdown past it is cut to fit (sized).
ISSUE_LIMIT = 65_536
WHOLE = "whole"  # a markdown renderer's `rest` that asks for every section inline
WHOLE_SUFFIX = ".full"  # the whole document's file: the -o file's name with this before its suffix
_POINTER_ROOM = 600  # characters kept for the line that names what was left out
# The most the visible head of a report may take when the whole does not fit: half an issue body, so that the
# sections it leads to and the reporter's own words have room. Past it the head is cut at a line.
HEAD_CHARS = 32_768
_FENCE = re.compile(r"^(`{3,})")


@dataclass(frozen=True)
class Section:
    name: str  # how the line naming what was left out names it
    lines: list[str]
    rank: int = 0  # which sections an issue-sized text keeps first: the lowest ranks, then the next


def kernels(kernels: KernelList) -> str:
    what = "Unclassified kernels" if kernels.only_unclassified else "Kernels"
    lines = [f"## {what}: {md_text(kernels.arm.label)}", ""]
    lines += markdown_table(["segment", "calls", "total", "share", "mean", "recipe", "kernel"],
                    [[r["segment"], f"{r['calls']:,}", duration(r["total_ns"]), percent(r["share"]),
                      duration(r["mean_ns"]), md_code(r["recipe"]) if r["recipe"] else "–", md_code(r["demangled"])]
                     for r in kernels.rows])
    return "\n".join(lines + ["", footer(kernels.kvtrace_version, kernels.recipes)]) + "\n"


def _environment(arms: list[Arm]) -> list[str]:
    def gpu(arm: Arm) -> str:
        parts = []
        for g in arm.info.gpus:
            extras = [f"{g.sm_count} SMs" if g.sm_count else None,
                      f"SM {g.compute_capability}" if g.compute_capability else None]
            parts.append(md_text(g.name) + (f" ({', '.join(e for e in extras if e)})" if any(extras) else ""))
        return "; ".join(parts) or "unknown"

    fields = [
        ("file", lambda a: md_code(Path(a.info.source).name)),
        ("GPU", gpu),
        ("driver", lambda a: md_text(a.info.driver_version or "–")),
        ("Nsight Systems",
         lambda a: md_text(f"{a.info.product_version or '?'} (schema {a.info.schema_version or '?'})")),
        ("CUDA graph trace", lambda a: md_text(a.info.graph_trace_mode or "not recorded")),
        ("kernels", lambda a: f"{a.info.kernel_count:,}"),
        ("kernel span", lambda a: duration(a.info.kernel_span_ns)),
        ("GPU kernel time", lambda a: duration(a.total_ns)),
        ("KV dtype (from kernel names)", lambda a: ", ".join(a.kv_dtypes) or "none detected"),
    ]
    return markdown_table([""] + [md_text(a.label) for a in arms],
                          [[name] + [fn(a) for a in arms] for name, fn in fields])


def summary(summary: Summary) -> str:
    arm = summary.arm
    lines = [f"## kvtrace summary: {md_text(arm.label)}", "",
             f"{arm.info.kernel_count:,} kernels, {duration(arm.total_ns)} of GPU kernel time. Per-call statistics "
             "appear only over calls of the same work: every rank and instance-numbered NVTX range of a kernel "
             "together, as nsys stats counts them, with a row per launch shape (and per range name, where one shape "
             "cost differently per range) for a family whose calls cost differently; rows over cells of different "
             "cost say \"mixed\" (their total is beside it).", "", "### Segments", ""]
    lines += markdown_table(["segment", "calls", "total", "share", "per call", "median", "p90", "KV dtype"],
                    [[r.segment, f"{r.stats.calls:,}", duration(r.stats.total_ns), percent(r.stats.share),
                      per_call(r.stats, r.cells), duration(r.stats.median_ns), duration(r.stats.p90_ns),
                      ", ".join(r.kv_dtypes) or "–"] for r in summary.segments])
    lines += ["", "### Kernel families", ""]
    parted = any(r.launch or r.nvtx_range for r in summary.families)
    lines += markdown_table(["segment", "family", *([PART] if parted else []), "calls", "total", "share", "per call",
                             "median", "p90", "KV dtype"],
                    [[r.segment, md_code(r.family_label), *([md_text(summary_part(r))] if parted else []),
                      f"{r.stats.calls:,}", duration(r.stats.total_ns), percent(r.stats.share),
                      per_call(r.stats, r.cells), duration(r.stats.median_ns), duration(r.stats.p90_ns),
                      ", ".join(r.kv_dtypes) or "–"] for r in summary.families])
    lines += ["", "### Environment", ""] + _environment([arm])
    lines += ["", "<details><summary>Kernel names per segment</summary>", ""]
    for r in summary.segments:
        lines += [f"**{r.segment}**", ""] + [f"- {md_code(name)}" for name in r.names] + [""]
    lines += ["</details>", "", footer(summary.kvtrace_version, summary.recipes)]
    return "\n".join(lines) + "\n"


def _diff_table(first: list[str], rows: list[DiffRow], lead, diff: Diff) -> list[str]:
    """A diff table whose verdict cells point to numbered notes below it (pairing notes, reasons)."""
    b, c = diff.baseline, diff.candidate
    confidence = f"{100 * diff.confidence:.0f}%"
    labels = md_text(b.label), md_text(c.label)
    header = first + [f"calls {labels[0]}", f"calls {labels[1]}", f"time {labels[0]}", f"time {labels[1]}", "ratio",
                      f"{confidence} CI"] + (["runs"] if diff.runs > 1 else []) + ["verdict", "Δ total",
                                                                                  "share of |Δ|"]
    verdicts, notes = numbered_notes(rows)
    body = [lead(r) + [*calls(r), arm_time(r.baseline, r.cells), arm_time(r.candidate, r.cells), ratio(r.ratio),
                       row_interval(r)] + ([run_ratios(r)] if diff.runs > 1 else [])
            + [verdict, signed_duration(r.total_delta_ns), percent(r.abs_delta_share)]
            for r, verdict in zip(rows, verdicts)]
    lines = markdown_table(header, body)
    if notes:
        lines += [""] + [f"{i}. {md_prose(text)}" for i, text in enumerate(notes, 1)]
    return lines


def diff(diff: Diff, rest: str | None = WHOLE) -> tuple[str, str | None]:
    labels = md_text(diff.baseline.label), md_text(diff.candidate.label)
    top = [f"## kvtrace diff: {labels[0]} → {labels[1]}", ""] + head(diff, 3)
    summary = ("Everything else: how rows are compared, comparability, every segment, phase and kernel family, each "
               "trace, kernel names")
    return sized(top, summary, body(diff, 3), [footer(diff.kvtrace_version, diff.recipes)], rest, "diff")


def sized(top: list[str], summary: str, sections: list[Section], bottom: list[str], rest: str | None,
          what: str) -> tuple[str, str | None]:
    """`top` (the visible part), then `sections` inside one <details> named `summary`, then `bottom`; and the whole
    document where that text leaves sections out, else None. With `rest` other than WHOLE, a text past ISSUE_LIMIT
    keeps the sections that fit (lowest rank first, shown in their order) and says under `top` which ones are in the
    whole document instead: the file linked by `rest`, or with None, none yet."""
    def text(chosen: list[Section], pointer: list[str]) -> str:
        lines = top + pointer + ["", f"<details><summary>{summary}</summary>", ""]
        for section in chosen:
            lines += section.lines + [""]
        return "\n".join(lines + ["</details>", ""] + bottom).rstrip() + "\n"

    whole = text(sections, [])
    if rest == WHOLE or len(whole) < ISSUE_LIMIT:
        return whole, None
    top = cut(top, HEAD_CHARS, f"The rest of this {what}'s head is in the whole {what}.")
    budget = ISSUE_LIMIT - len(text([], [])) - _POINTER_ROOM
    kept = set()
    for index in sorted(range(len(sections)), key=lambda i: sections[i].rank):
        size = len("\n".join(sections[index].lines)) + 2
        if size <= budget:
            kept.add(index)
            budget -= size
    chosen = [s for i, s in enumerate(sections) if i in kept]
    left = ", ".join(s.name for i, s in enumerate(sections) if i not in kept)
    where = (f"is in {whole_named(whole, rest)}, written beside this file to attach to the issue"
             if rest is not None else f"is written beside the output by `-o FILE.md`, as FILE{WHOLE_SUFFIX}.md")
    pointer = ["", f"This {what} leaves out {left}, to fit a GitHub issue body; the whole {what} ({len(whole):,} "
                   f"characters) {where}."]
    return text(chosen, pointer), whole


def cut(lines: list[str], budget: int, note: str) -> list[str]:
    """`lines` as they are if they fit `budget` characters, else the first whole lines that do (each line's escaping
    stays whole), a code fence or <details> they leave open closed, then a line saying how much was cut and `note`."""
    if len("\n".join(lines)) <= budget:
        return lines
    kept, size, opened = [], 0, []
    budget -= _POINTER_ROOM
    for line in lines:
        if size + len(line) + 1 > budget:
            break
        kept.append(line)
        size += len(line) + 1
        opened = _blocks(opened, line)
    left = lines[len(kept):]
    return kept + _closers(opened) + ["", f"{len(left):,} more lines ({sum(len(x) + 1 for x in left):,} characters) "
                                          f"are left out here to fit a GitHub issue body. {note}"]


def _blocks(opened: list[str], line: str) -> list[str]:
    """The opening lines of the <details> and code fence still open after `line` (outermost first), given those
    open before it: inside a fence only its closing fence counts."""
    fence = _FENCE.match(line)
    if opened and _FENCE.match(opened[-1]):
        return opened[:-1] if fence and fence.group(1) == _FENCE.match(opened[-1]).group(1) else opened
    if fence:
        return opened + [line]
    depth = line.count("<details>") - line.count("</details>")
    return opened + [line] * depth if depth >= 0 else opened[:max(len(opened) + depth, 0)]


def _closers(opened: list[str]) -> list[str]:
    """The lines that close what `opened` left open, innermost first: a fence's backticks, or </details> after a
    blank line (which ends a table or list before it)."""
    return [line for opening in reversed(opened)
            for line in ([_FENCE.match(opening).group(1)] if _FENCE.match(opening) else ["", "</details>"])]


def _reopeners(opened: list[str]) -> list[str]:
    """The lines that open again what `opened` left open, outermost first: a <details> line with the blank line after
    it that lets markdown follow."""
    return [line for opening in opened for line in ([opening] if _FENCE.match(opening) else [opening, ""])]


def part_name(first: str, number: int) -> str:
    """The file name of part `number` of a document (parts) whose first part is `first`: FILE.full.md, then
    FILE.full-2.md, FILE.full-3.md, …"""
    name = PurePath(first)
    return first if number == 1 else f"{name.stem}-{number}{name.suffix}"


def parts(text: str, first: str, budget: int = ISSUE_LIMIT) -> list[str]:
    """`text` in parts of at most `budget` characters each, to be written as part_name(first, 1), (first, 2), …: one
    part, `text` itself, where it fits. Parts end between lines; a code fence or <details> open there is closed at
    the end of the part and its opening line repeated at the top of the next, so that each part renders on its own.
    From the second part on, each starts saying which part it is of how many, and each but the last ends naming the
    next part's file. Only a line longer than a part holds is cut inside, and both parts around the cut say so."""
    if len(text) <= budget:
        return [text]
    digits = 1  # of the number of parts, for the room the part lines take: more only where the parts need it
    while len(split := _split(text, first, budget, digits)) >= 10 ** digits:
        digits += 1
    return split


@dataclass
class _Part:
    reopened: list[str]  # the lines opening again what the previous part left open
    carried: int | None = None  # a line cut at the previous part's end that this one goes on with: its length
    lines: list[str] = field(default_factory=list)
    closing: list[str] = field(default_factory=list)
    cut: int | None = None  # the length of the line cut at this part's end
    used: int = field(init=False)  # characters of the reopened lines and the lines, each with its newline

    def __post_init__(self):
        self.used = sum(len(line) + 1 for line in self.reopened)

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.used += len(line) + 1

    def size(self, line: str, opened: list[str]) -> int:
        """Characters of the part with `line` added and what `opened` leaves open closed, each line's newline too."""
        return self.used + len(line) + 1 + sum(len(closer) + 1 for closer in _closers(opened))


def _split(text: str, first: str, budget: int, digits: int) -> list[str]:
    """parts, with room for part numbers of up to `digits` digits."""
    lines = text.removesuffix("\n").split("\n")
    most, longest = 10 ** digits - 1, max(len(line) for line in lines)
    # Room for a part's own lines: the budget less its top and bottom lines at their longest (the numbers and file
    # names of the last parts, with the note of a cut line).
    top, bottom = _part_lines(most, most, first, longest, None)[0], _part_lines(most - 1, most, first, None, longest)[1]
    room = budget - len(top) - len(bottom) - 4  # each line's newline and the blank line beside it
    done, part, opened = [], _Part([]), []
    for line in lines:
        after = _blocks(opened, line)
        if part.size(line, after) > room and part.lines:
            part.closing = _closers(opened)
            done.append(part)
            part = _Part(_reopeners(opened))
        length = len(line)
        while part.size(line, after) > room:  # longer than a part holds: cut, its blocks counted once it is whole
            take = max(room - part.size("", opened), 1)
            part.add(line[:take])
            part.closing, part.cut = _closers(opened), length
            done.append(part)
            part = _Part(_reopeners(opened), carried=length)
            line = line[take:]
        part.add(line)
        opened = after
    done.append(part)
    texts = []
    for number, part in enumerate(done, 1):
        top, bottom = _part_lines(number, len(done), first, part.carried, part.cut)
        lines = ([top, ""] if top else []) + part.reopened + part.lines
        texts.append("\n".join(lines + part.closing + (["", bottom] if bottom else [])) + "\n")
    if not text.endswith("\n"):
        texts[-1] = texts[-1].removesuffix("\n")
    return texts


def _part_lines(number: int, count: int, first: str, carried: int | None, cut: int | None) -> tuple[str, str]:
    """The line at the top of part `number` of `count` (none on the first) and at its bottom (none on the last)."""
    top = bottom = ""
    if number > 1:
        top = f"Part {number} of {count}, continued from {md_code(part_name(first, number - 1))}" + (
            f"; its first line goes on from the last line there, one line of {carried:,} characters cut to fit"
            if carried else "") + "."
    if number < count:
        bottom = f"This is part {number} of {count}; it continues in {md_code(part_name(first, number + 1))}" + (
            f", whose first line goes on from this part's last line, one line of {cut:,} characters cut to fit"
            if cut else "") + "."
    return top, bottom


def whole_named(whole: str, first: str) -> str:
    """How a pointer names the file of the whole document `whole`: `first`, or how many parts it takes and that
    `first` is the first of them (parts)."""
    count = len(parts(whole, first))
    return md_code(first) if count == 1 else f"{count} parts ({md_code(first)} first, each naming the next)"


def fit(text: str, rest: str | None) -> str:
    """Any markdown kvtrace writes for an issue, cut at a line to fit ISSUE_LIMIT: the promise behind every renderer's
    own sizing (one overlong field or table cannot break it)."""
    where = (f"The whole is in {whole_named(text, rest)}, written beside this file." if rest and rest != WHOLE else
             f"Write it with `-o FILE.md` to get the whole as FILE{WHOLE_SUFFIX}.md beside it.")
    return "\n".join(cut(text.split("\n"), ISSUE_LIMIT, where))


def _reaches(diff: Diff) -> str:
    """What an interval must not reach for a verdict: the drift band, measured or assumed, or 1."""
    if diff.drift and diff.drift.ratio is not None:
        return ("reaches the drift band of its calls' size (how far kernels the KV format cannot affect surely moved "
                "between the runs; the drift finding gives each band)")
    if diff.drift and any(size.basis == drift_band.ASSUMED for size in diff.drift.bands):
        return ("reaches the assumed drift band (no kernel the KV format cannot affect was paired to measure it; the "
                "drift finding gives it)")
    return "includes 1"


def body(diff: Diff, level: int) -> list[Section]:
    """Everything after the head, in sections: how rows are compared, comparability, every table, each trace,
    kernel names; `level` is the heading level of the sections."""
    b, c = diff.baseline, diff.candidate
    confidence = f"{100 * diff.confidence:.0f}%"
    labels = md_text(b.label), md_text(c.label)
    runs = (f" over {diff.runs} runs per arm (r1 with r1, …); the interval resamples run pairs, then call pairs "
            "within each run" if diff.runs > 1 else "")
    section = "#" * level
    how = [f"Baseline **{labels[0]}**, candidate **{labels[1]}**. Ratio = candidate / baseline GPU time summed over "
           f"the calls both arms ran, paired call for call per kernel family, launch shape and NVTX range{runs}; "
           f"{confidence} bootstrap interval that resamples the pairs inside each such cell (docs/statistics.md). "
           f"A ratio within ±{100 * diff.threshold:g}% of 1, or whose interval " + _reaches(diff)
           + ", is \"no significant change\". \"time\" is per call where a row's cells cost the same per "
           "call, else the row's total. Rows whose arms did different work say \"not comparable\" or "
           "\"different work\" instead of a verdict.", "",
           f"Total GPU kernel time: {duration(b.total_ns)} → {duration(c.total_ns)} ({ratio(diff.total_ratio)})."]
    # Ranked for an issue-sized text: the tables of segments and phases before the long lists.
    sections = [Section("how rows are compared", how),
                Section("the comparability checks", [f"{section} Comparability", ""]
                        + [f"- {MARK[f.level]} {md_prose(f.message)}" for f in diff.findings], 3),
                Section("the segment table", [f"{section} Segments", ""]
                        + _diff_table(["segment"], diff.segments, lambda r: [r.segment], diff), 1)]
    if diff.phases:
        sections.append(Section("the segments by phase", [f"{section} Segments by phase (NVTX range)", ""]
                                + _diff_table(["segment", "phase"], diff.phases,
                                              lambda r: [r.segment, md_code(r.phase)], diff), 2))
    sections.append(Section("the kernel families", [f"{section} Kernel families", ""] + _diff_table(
        ["segment", "family"], diff.families, lambda r: [r.segment, md_code(r.family_label)], diff), 4))
    sections.append(Section("each trace", [f"{section} Each trace", ""] + _environment([b, c]), 1))
    names = ["<details><summary>Kernel names per segment</summary>", ""]
    for r in diff.segments:
        names += [f"**{r.segment}**", ""]
        names += [f"- {labels[0]}: {md_code(name)}" for name in r.baseline_names]
        names += [f"- {labels[1]}: {md_code(name)}" for name in r.candidate_names] + [""]
    sections.append(Section("the kernel names", names + ["</details>"], 5))
    return sections


def head(diff: Diff, level: int = 3, *, statements: bool = True, serving: list[str] = ()) -> list[str]:
    """The answer first (analyzer.headline): the deciding rows, the environment, how to reproduce; `level` is
    the heading level of its sections; `statements`: the head's own statements (the report lists them among
    its statements); `serving`: a report's serving lines, after the answer."""
    head = diff.headline or Headline.of(diff)
    b, c = md_text(diff.baseline.label), md_text(diff.candidate.label)
    section = "#" * level
    lines = [f"{section} The answer: {c} against {b}", ""]
    first = read_first(diff.findings)
    lines += [f"{MARK[f.level]} {md_prose(f.message)}" for f in first] + [""] * bool(first)
    lines += [f"Baseline **{b}**, candidate **{c}**: ratio {c} / {b}, above 1 where {c} is slower. Per kernel and "
              f"workload point, each arm's {HEAD_TIMES}, the ratio with its {100 * diff.confidence:.0f}% interval, the "
              "no-change band its verdict used (the drift band of its calls' size, at least the threshold), verdict "
              "and the call pairs compared.", ""]
    lines += markdown_table(["question", "point", "kernel family", b, c, "ratio", "interval", "band", "verdict",
                             "pairs"],
                            [[r.question, md_text(r.point), md_code(r.family), head_time(r.baseline_ns, r.mixed),
                              head_time(r.candidate_ns, r.mixed), ratio(r.row.ratio),
                              row_interval(r.row), no_change_band(r.row, diff.threshold),
                              r.row.verdict, f"{r.row.compared_calls:,}"]
                             for r in head.rows])
    notes = []
    if any(r.question == APPEND_PHASE for r in head.rows):
        notes.append("KV append phase: one call is one append with the kernels launched since the previous one "
                     "(FP8 pays a separate cast and copy, NVFP4 one fused quantize-append).")
    notes += [f"{statement_text(s, md_text)}." for s in (head.query_quantize if statements else ())]
    if head.drift:
        notes.append(f"Control: {md_text(head.drift)}.")
    for outcome in diff.verification.outcomes() if diff.verification is not None else []:
        notes.append(f"{MARK['ok' if outcome.agrees else 'error']} {md_text(outcome.summary)}.")
        notes += [f"  - {md_text(line)}" for line in outcome.mismatches[:MISMATCHES_SHOWN]]
    lines += [""] + [f"- {n}" if not n.startswith("  ") else n for n in notes] if notes else []
    lines += list(serving) + ["", f"{section} Environment", ""]
    lines += markdown_table(["", ""], [[name, md_text(value)] for name, value in head.environment])
    if head.commands:
        commands = [shown(command) for command in head.commands]  # a 100,000-character --label shortened
        fence = code_fence("\n".join(commands))
        lines += ["", f"{section} Reproduce", "", "From the run directory (absolute paths shortened to their last "
                  "component): the capture as its settings give it, the engine's commands as it ran them, then "
                  "kvtrace:", "", f"{fence}sh", *commands, fence]
    if head.model_config:
        lines += ["", "The model's shape, as the capture read its config.json:", "", "```json",
                  visible(head.model_config).replace("`", "'"), "```"]
    return lines


def footer(version: str, recipes: tuple[str, ...]) -> str:
    return f"<sub>kvtrace {version} · recipes: {', '.join(md_text(recipe) for recipe in recipes)}</sub>"
