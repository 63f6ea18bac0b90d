"""Text from files and flags made visible: the one escape of control characters, for every output and for error
lines. Standard library only: capture's errors go through it too."""

from __future__ import annotations

import re
from enum import Enum

# C0 and C1 control characters and DEL (cursor movement, screen clearing, OSC titles and hyperlinks, BEL, CR and
# LF that end a markdown row or an error line); Unicode line separators; bidirectional overrides, isolates and
# marks (U+202A-E, U+2066-9, U+200E/F, U+061C) and zero-width characters (U+200B-D, U+2060-4, U+FEFF), which
# reorder or hide what a reader sees. Bytes of a file name that are not UTF-8 reach Python as lone surrogates
# (U+DC80-DCFF), which no output encoding can write: shown as the byte, `\xff`.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\udc80-\udcff]")
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def visible(text) -> str:
    """Control characters as visible escapes: `\\x1b`, `\\n`, `\\u202e`."""
    return _CONTROL.sub(lambda m: _SHORT.get(m.group()) or
                        (f"\\x{ord(m.group()) & 0xff:02x}" if ord(m.group()) < 0x100 or
                         0xdc80 <= ord(m.group()) <= 0xdcff else f"\\u{ord(m.group()):04x}"),
                        str(text))


def plural(count, noun: str, many: str | None = None) -> str:
    """The noun for a count: singular for exactly one, else `many` (the noun with an s): "1 preemption",
    "9 preemptions", "0 pairs". Callers keep their own number format."""
    return noun if count == 1 else many or noun + "s"


class TextEnum(str, Enum):
    """An enum whose members are the text a file or an output records (statuses, verdicts): JSON, CSV, sentences,
    sets and comparisons with that text all carry the value itself ("ok", never "RunStatus.OK"), whatever the
    Python version's default for mixed-in enums."""

    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__
