"""`kvtrace report --upstream flashinfer|vllm`: the NVFP4 host-sync finding as a draft issue. It follows the project's
issue template (sections in order), fits a GitHub issue body with the answer before <details>, carries the copies
the trace holds (counted again in plain SQL), says "not measured" without a counterfactual arm and gives its numbers
with the patch's name and hash with one, and inlines a repro that is standalone Python with the traced shapes."""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest

from conftest import COUNTERFACTUAL, FI_GAUSSIAN, MATRIX_RUNS, REPO

# The H100 capacity matrix's sweep (fp8 and stock nvfp4, three rounds); the first recording's counterfactual: the patched
# arm nvfp4-validate-once beside copies of stock nvfp4's runs of the same rounds, at its sweep's first two points.
SWEEP = MATRIX_RUNS["sweep"]
COUNTERFACTUAL_SWEEP = COUNTERFACTUAL / "counterfactual" / "sweep"
COPIED_FROM = COUNTERFACTUAL / "sweep"
TEMPLATE_SECTIONS = {
    # flashinfer-ai/flashinfer .github/ISSUE_TEMPLATE/bug_report.yml, in its order
    "flashinfer": ["Environment", "Bug description", "Minimal reproduction", "Error messages / logs",
                   "Additional context"],
    # vllm-project/vllm .github/ISSUE_TEMPLATE/700-performance-discussion.yml, in its order
    "vllm": ["Proposal to improve performance", "Report of performance regression", "Misc discussion on performance",
             "Your current environment"],
}


def eager_copies(sqlite_path) -> tuple[int, int]:
    """(8-byte device-to-host copies into pageable memory, eager vLLM step ranges), in plain SQL."""
    with sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True) as db:
        copies = db.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE copyKind = 2 AND dstKind = 0 "
                            "AND bytes = 8").fetchone()[0]
        names = [row[0] for row in db.execute(
            "SELECT coalesce(n.text, s.value) FROM NVTX_EVENTS n LEFT JOIN StringIds s ON n.textId = s.id")]
    return copies, len(eager_steps(names))


def eager_steps(names: list[str | None]) -> list[tuple[int, int]]:
    """(prompt tokens, decoding requests) of each eager vLLM step range (one with context requests), from its name."""
    found = [re.fullmatch(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\(\d+\)", n or "") for n in names]
    return [(int(m.group(2)), int(m.group(3))) for m in found if m and m.group(1) != "0"]


def script_of(draft: str) -> str:
    (script,) = re.findall(r"^(`{3,})python\n(.*?)\n\1$", draft, re.S | re.M)
    return script[1]


@pytest.mark.parametrize("project", sorted(TEMPLATE_SECTIONS))
def test_draft_follows_the_template_and_carries_the_traced_copies(run_kvtrace, tmp_path, project):
    out = tmp_path / "draft.md"
    code, stdout, err = run_kvtrace("report", SWEEP, "--upstream", project, "-o", out)
    assert code == 0, err
    draft = out.read_text()
    assert len(draft) < 65_536
    headings = re.findall(r"^### (.+)$", draft, re.M)
    assert headings == TEMPLATE_SECTIONS[project]
    answer = draft.split("<details>")[0]
    assert "**In short:**" in answer and "not measured" in answer
    first = SWEEP / "nvfp4.r1.p0.sqlite"  # the first run's trace of the first point (its manifest's export)
    copies, steps = eager_copies(first)
    assert copies == 32 * steps > 0  # one copy per layer (32) in every eager step
    assert f"makes 32 device-to-host copies of 8 bytes" in answer
    assert eager_copies(SWEEP / "fp8.r1.p0.sqlite")[0] == 0
    script = script_of(draft)
    tree = ast.parse(script)
    modules = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    assert modules - set(sys.stdlib_module_names) == {"torch", "flashinfer"}
    (spec,) = [ast.literal_eval(n.value) for n in tree.body
               if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "SPEC"]
    config = json.loads((SWEEP / "manifest.json").read_text())["settings"]["model"]
    assert (spec["q_heads"], spec["kv_heads"], spec["head_dim"]) == (
        config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    # the traced eager steps' tokens, as their NVTX names count them (prompt tokens + one per decoding request)
    with sqlite3.connect(f"file:{first}?mode=ro", uri=True) as db:
        names = [row[0] for row in db.execute(
            "SELECT coalesce(n.text, s.value) FROM NVTX_EVENTS n LEFT JOIN StringIds s ON n.textId = s.id")]
    assert {sum(case["new_lens"]) for case in spec["cases"]} == {tokens + decoding
                                                                 for tokens, decoding in eager_steps(names)}


def with_fp8(target: Path) -> Path:
    """The counterfactual directory with fp8's runs of the same rounds and points copied in from the sweep, as the
    capture copies stock nvfp4's there (capture/vllm_matrix_split.py): the draft compares the patched arm with both
    formats of one run directory, and the matrix keeps fp8 out of the counterfactual's."""
    shutil.copytree(COUNTERFACTUAL_SWEEP, target)
    manifest = json.loads((target / "manifest.json").read_text())
    source = json.loads((COPIED_FROM / "manifest.json").read_text())
    points = len(manifest["settings"]["points"])
    assert manifest["settings"]["points"] == source["settings"]["points"][:points]
    for repeat in (1, 2, 3):
        name, stock = f"fp8.r{repeat}", manifest["arms"][f"nvfp4.r{repeat}"]
        entry = copy.deepcopy(source["arms"][name])
        entry["points"] = entry["points"][:points]
        entry["windows"] = [w for w in entry["windows"] if w["point"] < points]
        entry["timings"] = [t for t in entry["timings"] if t["point"] < points]
        # The same prompts as stock nvfp4's copied runs, point by point: so the same order over the points kept.
        assert [p["request_order_sha256"] for p in entry["points"]] == [
            p["request_order_sha256"] for p in stock["points"]]
        entry.update(request_order_sha256=stock["request_order_sha256"], copied_from=f"../../sweep/{name}")
        manifest["arms"][name] = entry
        for point in range(points):
            for path in COPIED_FROM.glob(f"{name}.p{point}.*"):
                shutil.copy(path, target / path.name)
    shutil.copy(COPIED_FROM / "fp8.server.log", target)
    manifest["settings"]["arms"] = ["fp8", *manifest["settings"]["arms"]]
    manifest["settings"]["order"] = [f"{arm}.r{r}" for r in (1, 2, 3) for arm in manifest["settings"]["arms"]]
    (target / "manifest.json").chmod(0o644)
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def test_counterfactual_arm_is_named_with_its_patch(run_kvtrace, tmp_path):
    """The real patched arm of the first H100 matrix: its numbers come with the patch's name and the SHA-256 of the file that
    was applied (capture/patches/validate-once.py as shipped), and are never called a stock release."""
    run = with_fp8(tmp_path / "counterfactual-sweep")
    sha = hashlib.sha256((REPO / "capture" / "patches" / "validate-once.py").read_bytes()).hexdigest()
    patches = {entry["patch"]["sha256"] for entry in json.loads((run / "manifest.json").read_text())["arms"].values()
               if entry["arm"] == "nvfp4-validate-once"}
    assert patches == {sha}
    code, out, err = run_kvtrace("report", run, "--arm", "fp8", "--arm", "nvfp4", "--upstream", "flashinfer")
    assert code == 0, err
    assert "validate-once" in out and sha in out and "not a stock release" in out
    assert "no arm with the check run once" not in out and "patched / stock NVFP4" in out


def test_a_report_without_the_finding_gets_one_line(run_kvtrace):
    code, out, err = run_kvtrace("report", FI_GAUSSIAN, "--upstream", "flashinfer")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "no finding to draft" in err
