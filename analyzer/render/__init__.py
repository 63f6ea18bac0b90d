"""Renderers: each formats a result object (analyzer.compare's Summary, Diff and KernelList, analyzer.report's
Report, analyzer.capacity's Capacity). Text renderers pick and format its fields; the plots add only what a
drawing needs (ECDF steps, unit scaling)."""

from __future__ import annotations

from kvtrace.analyzer.render import csv_out, json_out, markdown, terminal

FORMATS = ("table", "markdown", "json", "csv")


def render_text(result, fmt: str) -> str:
    """Text of a Summary or Diff in one of FORMATS except 'table' (which needs a console)."""
    module = {"markdown": markdown, "json": json_out, "csv": csv_out}[fmt]
    return module.render(result)
