"""Quality beside speed in `kvtrace report`: the FlashInfer engine's attention error per workload point, and the vLLM
quality step's answers paired prompt by prompt (McNemar's exact test, first divergence, agreement with BF16).

The FlashInfer numbers are the H200's (fi-h200-sm90-quality, fi-h200-sm90-outliers). The vLLM runs ran dummy
weights, so their run directories here are real ones copied with the answers a stand-in capture recorded grafted
in, named "synthetic" (tests/vllm_standin.py: its nvfp4 arm gets odd sums wrong).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest

from conftest import FI_OUTLIERS, FI_QUALITY, NSYS2025_DIR, VLLM033_RUNS
from kvtrace.analyzer import quality, report, stats
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render import render_text
from kvtrace.errors import KvtraceError
from test_capture_vllm import run_capture, serve_config, standin  # noqa: F401  (standin: a fixture)

PROMPTS = Path(__file__).resolve().parents[1] / "fixtures" / "quality" / "arithmetic-8.jsonl"


def copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.nsys-rep"))
    for path in target.iterdir():
        path.chmod(0o644)
    return target


def edit_manifest(run: Path, change) -> None:
    data = json.loads((run / "manifest.json").read_text())
    change(data)
    (run / "manifest.json").write_text(json.dumps(data))


def build(run: Path, **options) -> report.Report:
    return report.build([run], load_recipes(()), **options)


# ---- kernel level: FlashInfer ---------------------------------------------------------------------------

def recorded_quality(run: Path) -> dict:
    return {arm: {e["context"]: e["quality"] for e in json.loads((run / "manifest.json").read_text())
                  ["arms"][arm]["workload"]["contexts"]} for arm in ("fp8", "nvfp4")}


def test_kernel_errors_per_point_beside_the_phase_rows():
    result = build(FI_QUALITY)
    q = result.quality
    assert (q.state, q.level, q.inputs) == (quality.MEASURED, quality.KERNEL, {"kind": "gaussian"})
    recorded = recorded_quality(FI_QUALITY)
    assert [(row.context, row.what) for row in q.errors] == [
        (context, what) for context in (2048, 8192, 32768) for what in ("prefill", "decode", "cache k", "cache v")]
    for row in q.errors:
        group, key = ("cache", row.what[-1]) if row.what.startswith("cache") else ("kernel", row.what)
        assert row.baseline == recorded["fp8"][row.context][group][key]
        assert row.candidate == recorded["nvfp4"][row.context][group][key]
        # The formats' bits: NVFP4's error above FP8's at every point.
        assert row.candidate["rel_l2"] > row.baseline["rel_l2"]
    spans = {what: [min(r.candidate["rel_l2"] for r in q.errors if r.what == what),
                    max(r.candidate["rel_l2"] for r in q.errors if r.what == what)] for what in ("prefill", "decode")}
    assert q.spans["prefill"]["candidate"] == spans["prefill"] and q.spans["decode"]["candidate"] == spans["decode"]
    markdown = render_text(result, "markdown")
    answer = markdown.split("<details>", 1)[0]
    line = next(text for text in answer.splitlines() if text.startswith("Quality"))
    low, high = (f"{100 * v:.3g}%" for v in spans["prefill"])
    # Recorded before the workload said how it drew: the line names the draw it used.
    assert line.startswith("Quality (kernel error, gaussian Q/K/V from torch's BF16 CPU normal, which on torch 2.11 "
                           "and earlier stops at |x| = 3.33 (pytorch#166853)): attention output relative L2 error "
                           "against a float64 reference over the BF16 cache, prefill fp8 ")
    assert f"vs nvfp4 {low}–{high}" in line and "(contexts 2048–32768, each context apart below)" in line
    assert answer.index("| control (KV-independent)") < answer.index(line) < answer.index("### Environment")
    assert "| 32768 | cache v |" in markdown.split("### Quality", 1)[1]
    data = json.loads(render_text(result, "json"))["quality"]
    assert data["state"] == "measured" and len(data["errors"]) == 12
    assert "quality,2048 prefill,nvfp4,rel_l2," in render_text(result, "csv")


def test_a_kernel_that_adds_error_its_format_does_not_is_named():
    """On fi-h200-sm90-quality, NVFP4's prefill kernel is far further from the reference than exact attention over
    its own dequantized cache (26.7% against 10.7% at 2048), while its decode and FP8's kernels are not; the workload's
    direct check at the smallest context (the kernel against that attention) agrees."""
    q = build(FI_QUALITY).quality
    recorded = recorded_quality(FI_QUALITY)
    assert [(d.side, d.what, d.context) for d in q.departures] == [
        ("candidate", "prefill", context) for context in (2048, 8192, 32768)]
    for d in q.departures:
        point = recorded["nvfp4"][d.context]
        assert (d.kernel, d.format, d.floor) == (point["kernel"]["prefill"]["rel_l2"],
                                                 point["format"]["prefill"]["rel_l2"],
                                                 point["output_rounding"]["prefill"]["rel_l2"])
        assert d.gap > quality.DEPARTURE_FLOORS * d.floor
    # Every point left out is within the rule: kernel and format agree to a few output floors.
    for arm, side in (("fp8", "baseline"), ("nvfp4", "candidate")):
        for context, point in recorded[arm].items():
            for what in ("prefill", "decode"):
                if (side, what, context) not in {(d.side, d.what, d.context) for d in q.departures}:
                    gap = point["kernel"][what]["rel_l2"] - point["format"][what]["rel_l2"]
                    assert gap <= quality.DEPARTURE_FLOORS * point["output_rounding"][what]["rel_l2"]
    smallest = json.loads((FI_QUALITY / "nvfp4.workload.json").read_text())["contexts"][0]["accuracy"]
    assert smallest["prefill_vs_dequantized_cache"] > min(d.gap for d in q.departures)
    assert smallest["decode_vs_dequantized_cache"] < quality.DEPARTURE_FLOORS * recorded["nvfp4"][2048][
        "output_rounding"]["decode"]["rel_l2"]
    line = next(text for text in render_text(build(FI_QUALITY), "markdown").splitlines() if text.startswith("Quality"))
    assert ("⚠️ nvfp4's prefill kernel adds error its format does not: 26.7% against 10.7% at context 2048, 30.3% "
            "against 9.88% at context 8192, 31.6% against 9.71% at context 32768 for exact attention over its own "
            "dequantized cache, so its output is at least 16% of the reference away from that attention") in line
    assert "decode kernel adds" not in line and "fp8's" not in line
    shown = json.loads(render_text(build(FI_QUALITY), "json"))["quality"]["departures"]
    assert [(d["context"], d["side"], d["what"]) for d in shown] == [
        (context, "candidate", "prefill") for context in (2048, 8192, 32768)]
    assert [d["gap"] for d in shown] == pytest.approx([d.kernel - d.format for d in q.departures])


def test_outlier_inputs_cost_both_formats_without_a_kernel_departure():
    q = build(FI_OUTLIERS).quality
    assert q.inputs["kind"] == "outliers" and q.departures == []
    plain = build(FI_QUALITY).quality.spans
    for what in ("prefill", "decode"):
        assert q.spans[what]["baseline"][0] > plain[what]["baseline"][1]  # FP8's error grows with outliers too
    assert "adds error its format does not" not in render_text(build(FI_OUTLIERS), "markdown")


def test_runs_without_quality_numbers_say_so(tmp_path):
    result = build(NSYS2025_DIR)
    assert result.quality.state == quality.NOT_MEASURED
    assert "Quality not measured: the FlashInfer runs recorded no attention error" in render_text(result, "markdown")


def test_a_damaged_error_value_shows_as_missing(tmp_path):
    run = copy_run(FI_QUALITY, tmp_path / "damaged-nan")
    edit_manifest(run, lambda d: d["arms"]["nvfp4"]["workload"]["contexts"][0]["quality"]["kernel"]["prefill"]
                  .update(rel_l2=float("nan")))
    q = build(run).quality
    assert q.errors[0].candidate is None and q.errors[1].candidate is not None
    assert [d.context for d in q.departures] == [8192, 32768]
    assert "| 2048 | prefill |" in render_text(build(run), "markdown")


# ---- answers level: vLLM --------------------------------------------------------------------------------

@pytest.fixture
def answered(standin, tmp_path) -> Path:
    """A real vLLM serve run (fp8 vs nvfp4) with the quality step's records of a stand-in capture (auto, fp8 and
    nvfp4 answering fixtures/quality/arithmetic-8.jsonl) grafted in."""
    cfg = dataclasses.replace(serve_config(standin, arms=("auto", "fp8", "nvfp4")), quality_prompts=str(PROMPTS),
                              quality_max_tokens=5)
    captured = run_capture(standin, cfg)
    run = copy_run(VLLM033_RUNS["serve-prefix-reuse"], tmp_path / "synthetic-answers")
    for arm in ("auto", "fp8", "nvfp4"):
        shutil.copy(standin.tmp / "run" / f"{arm}.quality.json", run)

    def graft(data):
        data["arms"]["auto"] = {**captured["arms"]["auto"], "sqlite": None, "status": "ok"}
        for arm in ("auto", "fp8", "nvfp4"):
            data["arms"][arm]["quality"] = captured["arms"][arm]["quality"]
    edit_manifest(run, graft)
    return run


def real_weights(run: Path) -> None:
    edit_manifest(run, lambda d: d["settings"].update(load_format="auto"))


def test_dummy_weights_make_the_answers_no_measurement(answered):
    result = build(answered, arms=("fp8", "nvfp4"))
    q = result.quality
    assert q.state == quality.MEANINGLESS and q.accuracy is None and not q.prompts
    markdown = render_text(result, "markdown")
    assert ("Quality not a measurement: the model ran with --load-format dummy (random weights) in synthetic-answers: "
            "its answers say nothing about quality (the quality step itself ran: fp8 answered 8 of 8 prompts of "
            f"{PROMPTS.name}, nvfp4 8 of 8)") in markdown
    assert "accuracy" not in markdown.split("Quality not a measurement", 1)[1].split("\n", 1)[0]


def test_answers_are_paired_prompt_by_prompt(answered):
    real_weights(answered)
    result = build(answered, arms=("fp8", "nvfp4"))
    q = result.quality
    assert q.state == quality.MEASURED and q.prompts_file == PROMPTS.name
    answers = {arm: json.loads((answered / f"{arm}.quality.json").read_text())["results"]
               for arm in ("auto", "fp8", "nvfp4")}
    base = [r["correct"] for r in answers["fp8"]]
    cand = [r["correct"] for r in answers["nvfp4"]]
    b_only = sum(b and not c for b, c in zip(base, cand))
    c_only = sum(c and not b for b, c in zip(base, cand))
    assert (b_only, c_only) == (3, 0)  # the stand-in's nvfp4 gets the three odd sums wrong
    acc = q.accuracy
    assert (acc.baseline_correct, acc.candidate_correct, acc.baseline_only, acc.candidate_only) == (8, 5, 3, 0)
    assert acc.p_value == stats.mcnemar_exact(3, 0) == 2 / 8 and acc.verdict == stats.ACCURACY_SAME
    # The first divergence: the answer's first token, where the sums differ; the others are identical.
    for row, fp8, nvfp4 in zip(q.prompts, answers["fp8"], answers["nvfp4"]):
        assert row.first_divergence == (None if fp8["tokens"] == nvfp4["tokens"] else 0)
    alike = sum(len(f["tokens"]) for f, n in zip(answers["fp8"], answers["nvfp4"]) if f["tokens"] == n["tokens"])
    assert q.agreement.token_agreement == alike / sum(len(f["tokens"]) for f in answers["fp8"])
    assert (q.agreement.identical, q.agreement.prompts) == (5, 8)
    # Against the recorded BF16 arm: fp8 answers alike, nvfp4 as against fp8.
    assert [(a.arm, a.reference, a.identical) for a in q.auto] == [("fp8", "synthetic-answers/auto", 8),
                                                                   ("nvfp4", "synthetic-answers/auto", 5)]
    assert q.auto[0].token_agreement == 1.0 and q.auto[1].token_agreement == q.agreement.token_agreement
    line = next(t for t in render_text(result, "markdown").splitlines() if t.startswith("Quality"))
    assert line.startswith(f"Quality (8 prompts of {PROMPTS.name}, greedy): accuracy fp8 100.0% → nvfp4 62.5%, no "
                           "significant accuracy difference (McNemar exact p = 0.25: 3 prompts only fp8 got right, 0 "
                           "only nvfp4); outputs identical on 5 of 8 prompts")
    assert "against BF16 (synthetic-answers/auto): fp8 100.0% of tokens alike, 8 identical" in line
    data = json.loads(render_text(result, "json"))["quality"]
    assert data["accuracy"]["candidate_accuracy"] == 5 / 8 and len(data["prompts"]) == 8
    assert "quality,answers,,mcnemar_p,0.25" in render_text(result, "csv")


def test_an_arm_without_answers_or_a_quality_file_outside_its_run(answered):
    real_weights(answered)
    edit_manifest(answered, lambda d: d["arms"]["nvfp4"].update(quality=None))
    q = build(answered, arms=("fp8", "nvfp4")).quality
    assert q.state == quality.NOT_MEASURED and q.reason.startswith("nvfp4 ran without --quality-prompts")
    edit_manifest(answered, lambda d: d["arms"]["nvfp4"].update(quality={**d["arms"]["fp8"]["quality"],
                                                                         "file": "../fp8.quality.json"}))
    with pytest.raises(KvtraceError, match="names no quality file inside its run directory"):
        build(answered, arms=("fp8", "nvfp4"))


def test_first_divergence():
    assert quality.first_divergence(["a", "b"], ["a", "b"]) is None
    assert quality.first_divergence(["a", "b"], ["a", "c"]) == 1
    assert quality.first_divergence(["a"], ["a", "b"]) == 1
    assert quality.first_divergence([], []) is None
    assert math.isclose(quality.agreement("x", "y", [{"tokens": ["a", "b"]}], [{"tokens": ["a", "c", "d"]}])
                        .token_agreement, 1 / 3)


def test_an_output_never_lands_on_an_answer_file(answered, run_kvtrace):
    real_weights(answered)
    target = answered / "nvfp4.quality.json"
    before = target.read_bytes()
    code, _, err = run_kvtrace("report", str(answered), "--arm", "fp8", "--arm", "nvfp4", "-o", str(target),
                               "--format", "json")
    assert code == 2 and "nvfp4.quality.json" in err and target.read_bytes() == before


def test_the_decision_states_quality_as_measured(answered):
    from kvtrace.analyzer.render import quality as quality_render

    real_weights(answered)
    answers = build(answered, arms=("fp8", "nvfp4")).quality
    kernel = build(FI_QUALITY).quality
    text = quality_render.decision({"prefix-reuse": answers, "fi": kernel}, "nvfp4")
    assert text.startswith("Quality, as measured beside speed: prefix-reuse: no significant accuracy difference over "
                           "8 prompts (McNemar exact p = 0.25); fi: the kernel's attention error above")
    assert "does not show the formats equal" in text and "not established" not in text
    alone = quality_render.decision({"fi": kernel}, "nvfp4")
    assert alone.endswith("No run here measured the model's answers, so nvfp4's accuracy is not established: check "
                          "it before choosing it.")
