"""Hostile input, round 4 (issue 48): per-request counts, quality answers and prompts, `.safetensors` inputs,
host-wait tables, tensor-parallel ranks, pooling and repeats, the markdown budget, and the capture plumbing.
tests/test_hostile_input.py holds round 1 and the helpers, round 2 and 3 their own files.

Every CLI run goes through `kv` (no traceback, the inputs on the command line unchanged); every hostile input is
a copy of a real fixture edited in tmp_path. docs/reliability.md has a row per kind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import VLLM033_8B_RUNS, fingerprint
from test_bad_input import assert_one_line_error
from test_hostile_input import kv  # noqa: F401 (a fixture)

PREEMPTION = VLLM033_8B_RUNS["capacity-preemption"]  # fp8 and nvfp4, two repeats each, with requests and answers


def run_copy(tmp_path: Path, source: Path = PREEMPTION, name: str = "run") -> Path:
    """A writable copy of a real run directory."""
    run = tmp_path / name
    shutil.copytree(source, run)
    for path in [run, *run.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return run


def fingerprints(folder: Path) -> dict:
    return {p.name: fingerprint(p) for p in sorted(folder.iterdir()) if p.is_file()}


# ==== 1. every file of a run directory is an input ================================================================

@pytest.mark.parametrize("name", ["nvfp4.r1.requests.json", "fp8.r2.bench.json", "fp8.r1.quality.json"])
def test_no_output_replaces_a_file_of_the_run_directory(name, tmp_path, kv):
    run = run_copy(tmp_path)
    before = fingerprints(run)
    code, out, err = kv("report", run, "-q", "-o", run / name)
    assert_one_line_error(code, out, err, str(run / name), "never overwrites its inputs", "choose another output")
    assert fingerprints(run) == before


def test_no_output_replaces_a_run_file_through_a_link(tmp_path, kv):
    run = run_copy(tmp_path)
    before = fingerprints(run)
    (tmp_path / "latest.md").symlink_to(run / "nvfp4.r1.requests.json")
    code, out, err = kv("report", run, "-q", "-o", tmp_path / "latest.md")
    assert_one_line_error(code, out, err, "latest.md", "never overwrites its inputs")
    assert fingerprints(run) == before
