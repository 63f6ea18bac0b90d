"""Every shipped fixture's report, diff and matrix (markdown and JSON), rendered once: byte-stable against
tests/golden/outputs.json, so that a refactoring that must not change what kvtrace says can show it did not.

An intended change of output regenerates the digests with KVTRACE_UPDATE_GOLDEN=1; the commit's diff of
outputs.json then names every output the change touched."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from shipped_outputs import render

from conftest import REPO

GOLDEN = REPO / "tests" / "golden" / "outputs.json"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shipped_outputs(tmp_path_factory):
    return render(tmp_path_factory.mktemp("shipped-outputs"))


def test_outputs_are_byte_identical_to_the_golden_digests(shipped_outputs):
    digests = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in sorted(shipped_outputs.items())}
    if os.environ.get("KVTRACE_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(digests, indent=1) + "\n")
    expected = json.loads(GOLDEN.read_text())
    changed = sorted(name for name in digests.keys() | expected.keys() if digests.get(name) != expected.get(name))
    folder = next(iter(shipped_outputs.values())).parent
    assert not changed, f"outputs differ from tests/golden/outputs.json (new ones in {folder}): {changed}"
