"""Trace text (kernel and NVTX names, labels, GPU names, file names) is hostile: made inert for each output.

Every renderer passes such text through one of these where it emits it; text kvtrace writes itself (units,
verdicts, rich markup for levels) is left alone. JSON needs nothing: json.dumps escapes control characters.
"""

from __future__ import annotations

import csv
import re

from rich.markup import escape as _rich_escape

# C0 and C1 control characters and DEL (cursor movement, screen clearing, OSC titles and hyperlinks, BEL, CR and
# LF that end a markdown row), plus Unicode line separators and bidirectional overrides, which reorder what a
# reader sees.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_BACKTICKS = re.compile("`+")
# A spreadsheet evaluates a cell that starts with one of these as a formula.
_FORMULA_START = ("=", "+", "-", "@")
# Not `|`: a table cell escapes it (units.markdown_table), and elsewhere it is plain text.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]<>~])")


def visible(text) -> str:
    """Control characters as visible escapes: `\\x1b`, `\\n`, `\\u202e`."""
    return _CONTROL.sub(lambda m: _SHORT.get(m.group()) or
                        (f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}"),
                        str(text))


def rich(text) -> str:
    """For a rich console or table cell: control characters visible, square brackets not read as markup."""
    return _rich_escape(visible(text))


def md_code(text) -> str:
    """A markdown code span holding `text` whatever backticks it contains (a longer fence than any run in it)."""
    content = visible(text)
    fence = "`" * (max((len(run) for run in _BACKTICKS.findall(content)), default=0) + 1)
    pad = " " if content.startswith("`") or content.endswith("`") else ""
    return f"{fence}{pad}{content}{pad}{fence}"


def md_text(text) -> str:
    """Plain markdown text (a label in a heading or table): emphasis, links and HTML made literal.
    (An underscore inside a word emphasises nothing in GitHub markdown, so `fp8_e4m3` stays as it is.)"""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", visible(text))


def csv_writer(buffer):
    """A csv writer whose text cells have control characters made visible and cannot start a formula."""
    return _SafeWriter(csv.writer(buffer, lineterminator="\n"))


class _SafeWriter:
    def __init__(self, writer):
        self._writer = writer

    def writerow(self, row):
        self._writer.writerow([_csv_cell(v) for v in row])

    def writerows(self, rows):
        for row in rows:
            self.writerow(row)


def _csv_cell(value):
    if not isinstance(value, str):
        return value
    text = visible(value)
    return "'" + text if text.startswith(_FORMULA_START) else text
