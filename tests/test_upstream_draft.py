"""`kvtrace report --upstream flashinfer|vllm`: the NVFP4 host-sync finding as a draft issue. It follows the project's
issue template (sections in order), fits a GitHub issue body with the answer before <details>, carries the copies
the trace holds (counted again in plain SQL), says "not measured" without a counterfactual arm and gives its numbers
with the patch's name and hash with one, and inlines a repro that is standalone Python with the traced shapes."""

from __future__ import annotations

import ast
import json
import re
import shutil
import sqlite3
import sys

import pytest

from conftest import FI_GAUSSIAN, MATRIX_RUNS, VLLM033_8B_RUNS

SWEEP = MATRIX_RUNS["sweep"]
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
    eager = [n for n in names if (m := re.fullmatch(r"execute_context_(\d+)\(\d+\)_generation_\d+\(\d+\)", n or ""))
             and m.group(1) != "0"]
    return copies, len(eager)


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
    copies, steps = eager_copies(SWEEP / "nvfp4.r1.sqlite")
    assert copies == 32 * steps  # one copy per layer (32) in every eager step
    assert f"makes 32 device-to-host copies of 8 bytes" in answer
    assert eager_copies(SWEEP / "fp8.r1.sqlite")[0] == 0
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
    assert {sum(case["new_lens"]) for case in spec["cases"]} == {2048, 6145}


def test_counterfactual_arm_is_named_with_its_patch(run_kvtrace, tmp_path):
    """Synthetic: the sweep's second NVFP4 run relabelled as the patched arm (the real one comes from the H200), to
    check that its numbers come with the patch's name and hash and are never called a stock release."""
    run = tmp_path / "synthetic-counterfactual"
    shutil.copytree(SWEEP, run)
    manifest = json.loads((run / "manifest.json").read_text())
    entry = manifest["arms"].pop("nvfp4.r2")
    entry.update(arm="nvfp4-validate-once", repeat=1, patch={"name": "validate-once", "sha256": "ab" * 32})
    manifest["arms"]["nvfp4-validate-once"] = entry
    manifest["arms"]["nvfp4.r1"]["repeat"] = 1
    (run / "manifest.json").chmod(0o644)
    (run / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_kvtrace("report", run, "--arm", "fp8.r1", "--arm", "nvfp4.r1", "--upstream", "flashinfer")
    assert code == 0, err
    assert "validate-once" in out and "ab" * 32 in out and "not a stock release" in out
    assert "no arm with the check run once" not in out and "patched / stock NVFP4" in out


def test_a_report_without_the_finding_gets_one_line(run_kvtrace):
    code, out, err = run_kvtrace("report", FI_GAUSSIAN, "--upstream", "flashinfer")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "no finding to draft" in err
