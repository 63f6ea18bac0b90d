"""Trace text (kernel and NVTX names, labels, GPU names, file names) is hostile: made inert for each output.

Every renderer passes such text through one of these where it emits it; text kvtrace writes itself (units,
verdicts, rich markup for levels) is left alone. JSON needs nothing: json.dumps escapes control characters.
"""

from __future__ import annotations

import csv
import re

from rich.markup import escape as _rich_escape

from kvtrace.text import visible

_BACKTICKS = re.compile("`+")
# A spreadsheet evaluates a cell that starts with one of these as a formula.
_FORMULA_START = ("=", "+", "-", "@")
# Not `|`: a table cell escapes it (units.markdown_table), and elsewhere it is plain text.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]<>~])")
_PROSE_SPECIAL = re.compile(r"([\\`*<>~])")
# Where GitHub would make plain text active, split by an empty HTML comment (GitHub matches each within one piece
# of text only; code spans are never matched): after the first colon of an emoji shortcode (`:cat:`, a picture;
# names with a letter, so a time's 02:20:00 stays as it is), after the @ of a mention (@user, @org/team: a ping;
# an e-mail address too), and inside a bare URL (scheme://…, www.…: a link).
_ACTIVE = re.compile(r"(?<=:)(?=[\w+-]*[^\W\d_][\w+-]*:)|(?<=@)(?=[\w-])|(?<=:)(?=//)|(?<=\bwww)(?=\.\w)",
                     re.IGNORECASE)


# The most characters one text shows in markdown or a terminal: a name or cell (a label, GPU name, version string,
# scenario, run or kernel name: real ones stay under 1,000), and one of kvtrace's notes quoting such text (a
# note listing the unpaired calls of a vLLM sweep runs to 13,000). Past it the text is shortened with a note of
# its length, so that one field cannot push a report past an issue body, nor make rich wrap it for minutes
# (100,000 characters took over a minute); JSON and CSV keep it whole.
FIELD_CHARS = 2_000
PROSE_CHARS = 16_384


def shown(text, limit: int = FIELD_CHARS) -> str:
    """`text` with control characters visible, shortened past `limit` with a note of its length."""
    text = visible(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… (shortened: {len(text):,} characters in all)"


def _inert(text: str) -> str:
    return _ACTIVE.sub("<!-- -->", text)


def rich(text) -> str:
    """For a rich console or table cell: control characters visible, square brackets not read as markup."""
    return _rich_escape(shown(text))


def code_fence(text: str) -> str:
    """The fence of a markdown code block holding `text`: three backticks, more than any run of them in it."""
    return "`" * max(3, 1 + max((len(run) for run in _BACKTICKS.findall(text)), default=0))


def md_code(text) -> str:
    """A markdown code span holding `text` whatever backticks it contains (a longer fence than any run in it)."""
    content = shown(text)
    fence = "`" * (max((len(run) for run in _BACKTICKS.findall(content)), default=0) + 1)
    pad = " " if content.startswith("`") or content.endswith("`") else ""
    return f"{fence}{pad}{content}{pad}{fence}"


def md_text(text) -> str:
    """Plain markdown text (a label in a heading or table): emphasis, links, HTML and emoji shortcodes made literal.
    (An underscore inside a word emphasises nothing in GitHub markdown, so `fp8_e4m3` stays as it is.)"""
    return _inert(_MARKDOWN_SPECIAL.sub(r"\\\1", shown(text)))


def md_prose(text) -> str:
    """A sentence kvtrace wrote with trace or manifest text inside (a finding, a note): emphasis, HTML, links and
    emoji shortcodes made literal, as md_text does, but square brackets that hold kvtrace's own intervals
    (`[0.98, 1.01]`) stay as they are: only `](`, which would make them a link, is broken."""
    return _inert(_PROSE_SPECIAL.sub(r"\\\1", shown(text, PROSE_CHARS)).replace("](", "]\\("))


def plot_text(text) -> str:
    """Text in a plot, line by line (kvtrace's titles break lines on purpose): control characters visible. Plots
    also turn off mathtext (render/plots.py), so `$` is drawn as written."""
    return "\n".join(visible(line) for line in str(text).split("\n"))


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
