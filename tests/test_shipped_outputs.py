"""Every shipped fixture's report, diff and matrix (markdown and JSON), rendered once: byte-stable against
tests/golden/outputs.json, so that a refactoring that must not change what kvtrace says can show it did not; no
ratio or time interval below zero; no Python repr text (None, nan, an enum's name) where a sentence wanted words.

An intended change of output regenerates the digests with KVTRACE_UPDATE_GOLDEN=1; the commit's diff of
outputs.json then names every output the change touched."""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest
from conftest import REPO

GOLDEN = REPO / "tests" / "golden" / "outputs.json"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shipped_outputs(shipped_output):
    return shipped_output.all()


def test_outputs_are_byte_identical_to_the_golden_digests(shipped_outputs):
    digests = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in sorted(shipped_outputs.items())}
    if os.environ.get("KVTRACE_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(digests, indent=1) + "\n")
    expected = json.loads(GOLDEN.read_text())
    changed = sorted(name for name in digests.keys() | expected.keys() if digests.get(name) != expected.get(name))
    folder = next(iter(shipped_outputs.values())).parent
    assert not changed, f"outputs differ from tests/golden/outputs.json (new ones in {folder}): {changed}"


# A ratio and its interval as the markdown prints them: "1.567× [0.259, 9.482]", or a table's ratio cell then its
# interval cell ("| 1.478× | [0.612, 3.467] |"); markdown escapes the bracket.
_RATIO_INTERVAL = re.compile(r"\d×(?: \| | )\\?\[([^\],]+),")


def _numbers(node, key=""):
    """(key, value) of every number in a JSON document."""
    if isinstance(node, dict):
        for name, value in node.items():
            yield from _numbers(value, name)
    elif isinstance(node, list):
        for value in node:
            yield from _numbers(value, key)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield key, node


def _strings(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def test_no_ratio_or_time_interval_reaches_below_zero(shipped_outputs):
    """Ratios and times are positive, and so are their intervals (log space, docs/statistics.md): no markdown ratio
    interval and no JSON lower bound (ci_low, total_low_ns, kernel_low, …) below zero."""
    checked = 0
    for name, path in shipped_outputs.items():
        text = path.read_text()
        if name.endswith(".md"):
            lows = _RATIO_INTERVAL.findall(text)
            assert not [low for low in lows if low.strip().startswith(("-", "−"))], name
        else:
            lows = [value for key, value in _numbers(json.loads(text)) if key.endswith(("low", "low_ns"))]
            assert min(lows, default=0) >= 0, name
        checked += len(lows)
    assert checked > 1000  # the patterns still find the intervals


# Python's text for a missing or impossible value, or an object's repr, where a sentence wanted words ("inf" is left
# out: the reproduce section quotes vllm bench serve's `--request-rate inf`).
_REPR = re.compile(r"\bNone\b|\bnan\b|\bNaN\b|\bVerdict\.|\bnp\.|object at 0x|<[A-Za-z_.]+ object")


def test_no_python_repr_text_in_any_sentence(shipped_outputs):
    found = []
    for name, path in shipped_outputs.items():
        texts = [path.read_text()] if name.endswith(".md") else _strings(json.loads(path.read_text()))
        found += [(name, text[max(0, m.start() - 60):m.end() + 20]) for text in texts for m in _REPR.finditer(text)]
    assert not found
