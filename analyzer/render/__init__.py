"""Renderers: each formats a result object (analyzer.compare's Summary, Diff and KernelList, analyzer.report's
Report, analyzer.capacity's Capacity, analyzer.matrix's Matrix). Text renderers pick and format its fields; the
plots add only what a drawing needs (ECDF steps, unit scaling).

One dispatch per format, keyed by the result's type: a new result type or format is one entry below.
"""

from __future__ import annotations

from rich.console import Console

from kvtrace.analyzer.capacity import Capacity
from kvtrace.analyzer.results import Diff, Summary
from kvtrace.analyzer.kernels import KernelList
from kvtrace.analyzer.matrix import Matrix
from kvtrace.analyzer.render import (capacity, csv_out, json_out, markdown, matrix, report_csv, report_markdown,
                                     report_terminal, terminal)
from kvtrace.analyzer.report import Report
from kvtrace.errors import KvtraceError

FORMATS = ("table", "markdown", "json", "csv")

# format -> result type -> renderer. 'table' renderers print to a console, the others return text.
RENDERERS = {
    "table": {Summary: terminal.summary, Diff: terminal.diff, KernelList: terminal.kernels,
              Report: report_terminal.report_terminal, Capacity: capacity.capacity_terminal,
              Matrix: matrix.terminal},
    "markdown": {Summary: markdown.summary, Diff: markdown.diff, KernelList: markdown.kernels,
                 Report: report_markdown.report_markdown, Capacity: capacity.capacity_markdown,
                 Matrix: matrix.markdown},
    "json": {kind: json_out.render for kind in (Summary, Diff, KernelList, Report, Capacity, Matrix)},
    "csv": {Summary: csv_out.summary, Diff: csv_out.diff, KernelList: csv_out.kernels,
            Report: report_csv.report_csv, Capacity: capacity.capacity_csv},
}


def _renderer(result, fmt: str):
    renderer = RENDERERS[fmt].get(type(result))
    if renderer is None:
        offered = [name for name, table in RENDERERS.items() if type(result) in table]
        raise KvtraceError(f"--format {fmt} is not available for a {type(result).__name__} result: use "
                           + (", ".join(offered) if offered else "another command"))
    return renderer


def render_table(result, console: Console) -> None:
    """Print `result` as terminal tables."""
    _renderer(result, "table")(result, console)


# Markdown sized for an issue body (markdown.sized): the renderers take the link of the whole document's file and
# return the text with the whole document (None when nothing was left out).
SIZED = (Diff, Report)


def render_markdown(result, rest: str | None) -> tuple[str, str | None]:
    """Markdown of `result` that fits an issue body, and the whole document when that leaves sections out (for the
    file linked by `rest`; None: no file, and the text says how to get one)."""
    text, whole = (render_text(result, "markdown"), None) if not isinstance(result, SIZED) else \
        _renderer(result, "markdown")(result, rest)
    if rest == markdown.WHOLE or len(text) <= markdown.ISSUE_LIMIT:
        return text, whole
    return markdown.fit(text, rest), whole or text


def render_text(result, fmt: str) -> str:
    """Text of `result` in one of FORMATS except 'table' (which needs a console); sized markdown whole."""
    if fmt == "markdown" and isinstance(result, SIZED):
        return render_markdown(result, markdown.WHOLE)[0]
    return _renderer(result, fmt)(result)
