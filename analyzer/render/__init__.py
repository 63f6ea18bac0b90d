"""Renderers: each takes a result object from analyzer.compare and computes nothing new."""

from __future__ import annotations

from kvtrace.analyzer.render import csv_out, json_out, markdown, terminal

FORMATS = ("table", "markdown", "json", "csv")


def render_text(result, fmt: str) -> str:
    """Text of a Summary or Diff in one of FORMATS except 'table' (which needs a console)."""
    module = {"markdown": markdown, "json": json_out, "csv": csv_out}[fmt]
    return module.render(result)
