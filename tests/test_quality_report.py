"""Quality beside speed in `kvtrace report`: the FlashInfer engine's attention error per workload point, and the vLLM
quality step's answers paired prompt by prompt (McNemar's exact test, first divergence, agreement with BF16).

The FlashInfer numbers are the H200's (fi-h200-sm90-gaussian, fi-h200-sm90-outliers, and fi-h200-sm90-quality, drawn
before kvtrace recorded each kernel's distance from its own cache). The vLLM runs ran dummy
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

from conftest import FI_GAUSSIAN, FI_OUTLIERS, FI_QUALITY, NSYS2025_DIR, VLLM033_RUNS
from kvtrace.analyzer import quality, report
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render import render_text
from kvtrace.analyzer.stats import mcnemar
from kvtrace.errors import KvtraceError
from test_capture_vllm import make_standin, run_capture, serve_config

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


def percent(value: float) -> str:
    return f"{100 * value:.3g}%"


def test_kernel_errors_per_point_beside_the_phase_rows(shared):
    result = shared.report([FI_GAUSSIAN])
    q = result.quality
    assert (q.state, q.level) == (quality.MEASURED, quality.KERNEL)
    assert q.inputs == {"kind": "gaussian", "drawn_as": "float32 normal rounded to bf16"}
    recorded = recorded_quality(FI_GAUSSIAN)
    assert [(row.context, row.what) for row in q.errors] == [
        (context, what) for context in (2048, 8192, 32768) for what in ("prefill", "decode", "cache k", "cache v")]
    for row in q.errors:
        group, key = ("cache", row.what[-1]) if row.what.startswith("cache") else ("kernel", row.what)
        assert row.baseline == recorded["fp8"][row.context][group][key]
        assert row.candidate == recorded["nvfp4"][row.context][group][key]
        if group == "kernel":
            assert row.baseline_vs_format == recorded["fp8"][row.context]["kernel_vs_format"][key]
            assert row.candidate_vs_format == recorded["nvfp4"][row.context]["kernel_vs_format"][key]
        # The formats' bits: NVFP4's error above FP8's at every point.
        assert row.candidate["rel_l2"] > row.baseline["rel_l2"]
    spans = {what: [min(r.candidate["rel_l2"] for r in q.errors if r.what == what),
                    max(r.candidate["rel_l2"] for r in q.errors if r.what == what)] for what in ("prefill", "decode")}
    assert q.spans["prefill"]["candidate"] == spans["prefill"] and q.spans["decode"]["candidate"] == spans["decode"]
    markdown = render_text(result, "markdown")
    answer = markdown.split("<details>", 1)[0]
    line = next(text for text in answer.splitlines() if text.startswith("Quality"))
    low, high = (percent(v) for v in spans["prefill"])
    assert line.startswith("Quality (kernel error, gaussian Q/K/V): attention output relative L2 error against a "
                           "float64 reference over the BF16 cache, prefill fp8 ")
    assert f"vs nvfp4 {low}–{high}" in line and "(contexts 2048–32768, each context apart below)" in line
    assert answer.index("| control (KV-independent)") < answer.index(line) < answer.index("### Environment")
    details = markdown.split("### Quality", 1)[1]
    assert "| 32768 | cache v |" in details
    first = recorded["fp8"][2048]["kernel_vs_format"]["prefill"]["rel_l2"], recorded["nvfp4"][2048][
        "kernel_vs_format"]["prefill"]["rel_l2"]
    assert f"| {percent(first[0])} / {percent(first[1])} |" in details
    data = json.loads(render_text(result, "json"))["quality"]
    assert data["state"] == "measured" and len(data["errors"]) == 12
    csv = render_text(result, "csv")
    assert "quality,2048 prefill,nvfp4,rel_l2," in csv and "quality,2048 prefill,nvfp4,vs_format_rel_l2," in csv


HONEST_ROUNDINGS = 2  # what FlashInfer's decode and FP8 kernels stay within on the H200 (analyzer.quality says why)


def test_a_kernel_that_strays_from_its_own_cache_is_named(shared):
    """On fi-h200-sm90-gaussian each kernel's output was measured against exact attention over its own dequantized
    cache: NVFP4's causal prefill is several BF16 roundings away at every context, every other kernel within two."""
    q = shared.report([FI_GAUSSIAN]).quality
    recorded = recorded_quality(FI_GAUSSIAN)
    distance = {(side, what, context): point["kernel_vs_format"][what]["rel_l2"]
                for arm, side in (("fp8", "baseline"), ("nvfp4", "candidate"))
                for context, point in recorded[arm].items() for what in ("prefill", "decode")}
    strays = [("candidate", "prefill", context) for context in (2048, 8192, 32768)]
    assert [(d.side, d.what, d.context) for d in q.departures] == strays
    for d in q.departures:
        assert d.measured and d.distance == distance[d.side, d.what, d.context]
        assert d.roundings > quality.DEPARTURE_ROUNDINGS
    assert all(value < HONEST_ROUNDINGS * quality.BF16_ROUNDING
               for key, value in distance.items() if key not in strays)
    line = next(text for text in render_text(shared.report([FI_GAUSSIAN]), "markdown").splitlines()
                if text.startswith("Quality"))
    points = ", ".join(f"{percent(distance[key])} away at context {key[2]}" for key in strays)
    low, high = (f"{min(d.roundings for d in q.departures):.0f}", f"{max(d.roundings for d in q.departures):.0f}")
    assert (f"⚠️ nvfp4's prefill kernel strays from exact attention over its own dequantized cache: its output is "
            f"{points} ({low}–{high} BF16 roundings, past the 5 an honest BF16 kernel stays within)") in line
    assert line.count("⚠️") == 1
    shown = json.loads(render_text(shared.report([FI_GAUSSIAN]), "json"))["quality"]["departures"]
    assert [(d["context"], d["side"], d["what"], d["measured"]) for d in shown] == [
        (context, "candidate", "prefill", True) for context in (2048, 8192, 32768)]
    assert [d["roundings"] for d in shown] == pytest.approx([d.distance * 2 ** 9 for d in q.departures])
    floors = {(row.context, row.what): row.floor["rel_l2"] for row in q.errors if row.floor}
    assert [(d["gap"], d["floor"]) for d in shown] == [
        (d.kernel - d.format, floors[d.context, d.what]) for d in q.departures]
    assert "quality,2048 prefill,nvfp4,departure_rel_l2," in render_text(shared.report([FI_GAUSSIAN]), "csv")


def test_runs_recorded_before_the_direct_distance_get_its_lower_bound(shared):
    """fi-h200-sm90-quality recorded no kernel_vs_format: kernel − format bounds the distance from below (the
    triangle inequality, scaled to the dequantized output's norm), and the bound stays under the direct check its
    workload made at the smallest context."""
    result = shared.report([FI_QUALITY])
    q = result.quality
    recorded = recorded_quality(FI_QUALITY)
    assert [(d.side, d.what, d.context, d.measured) for d in q.departures] == [
        ("candidate", "prefill", context, False) for context in (2048, 8192, 32768)]
    for d in q.departures:
        point = recorded["nvfp4"][d.context]
        assert (d.kernel, d.format) == (point["kernel"]["prefill"]["rel_l2"], point["format"]["prefill"]["rel_l2"])
        assert d.distance == pytest.approx((d.kernel - d.format) / (1 + d.format))
    direct = json.loads((FI_QUALITY / "nvfp4.workload.json").read_text())["contexts"][0]["accuracy"]
    assert q.departures[0].distance <= direct["prefill_vs_dequantized_cache"]
    line = next(text for text in render_text(result, "markdown").splitlines() if text.startswith("Quality"))
    assert line.startswith("Quality (kernel error, gaussian Q/K/V drawn before kvtrace recorded how: if by torch "
                           "2.7–2.11's BF16 CPU normal, no value passes |x| = 3.33 (pytorch/pytorch#166853)): ")
    first = q.departures[0]
    assert (f"its output is at least {percent(first.distance)} away at context 2048 (its error "
            f"{percent(first.kernel)} against the reference where the format alone has {percent(first.format)})"
            ) in line
    low, high = (f"{min(d.roundings for d in q.departures):.0f}", f"{max(d.roundings for d in q.departures):.0f}")
    assert f"(at least {low}–{high} BF16 roundings, past the 5" in line
    assert "fp8's" not in line and "decode kernel" not in line
    assert "departure_at_least_rel_l2" in render_text(result, "csv")


def test_outlier_inputs_cost_both_formats_without_a_kernel_departure(shared):
    q = shared.report([FI_OUTLIERS]).quality
    assert q.inputs["kind"] == "outliers" and q.departures == []
    assert all(row.candidate_vs_format["rel_l2"] < HONEST_ROUNDINGS * quality.BF16_ROUNDING
               for row in q.errors if row.what in ("prefill", "decode"))
    plain = shared.report([FI_GAUSSIAN]).quality.spans
    for what in ("prefill", "decode"):
        assert q.spans[what]["baseline"][0] > plain[what]["baseline"][1]  # FP8's error grows with outliers too
    assert "⚠️" not in render_text(shared.report([FI_OUTLIERS]), "markdown").split("<details>", 1)[0]


def test_runs_without_quality_numbers_say_so(shared, tmp_path):
    result = shared.report([NSYS2025_DIR])
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

@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> Path:
    """A real vLLM serve run (fp8 vs nvfp4) with the quality step's records of a stand-in capture (auto, fp8 and
    nvfp4 answering fixtures/quality/arithmetic-8.jsonl) grafted in: captured once, each test edits its own copy."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        standin = make_standin(tmp_path_factory.mktemp("standin"), monkeypatch)
        cfg = dataclasses.replace(serve_config(standin, arms=("auto", "fp8", "nvfp4")), quality_prompts=str(PROMPTS),
                                  quality_max_tokens=5)
        captured = run_capture(standin, cfg)
    run = copy_run(VLLM033_RUNS["serve-prefix-reuse"], tmp_path_factory.mktemp("answers") / "synthetic-answers")
    for arm in ("auto", "fp8", "nvfp4"):
        shutil.copy(standin.tmp / "run" / f"{arm}.quality.json", run)

    def graft(data):
        data["arms"]["auto"] = {**captured["arms"]["auto"], "sqlite": None, "status": "ok"}
        for arm in ("auto", "fp8", "nvfp4"):
            data["arms"][arm]["quality"] = captured["arms"][arm]["quality"]
    edit_manifest(run, graft)
    return run


@pytest.fixture
def answered(answers, tmp_path) -> Path:
    return copy_run(answers, tmp_path / "synthetic-answers")


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
    assert acc.p_value == mcnemar.mcnemar_exact(3, 0) == 2 / 8 and acc.verdict == mcnemar.AccuracyVerdict.SAME
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


def test_the_decision_states_quality_as_measured(shared, answered):
    from kvtrace.analyzer.render import quality as quality_render

    real_weights(answered)
    answers = build(answered, arms=("fp8", "nvfp4")).quality
    kernel = shared.report([FI_QUALITY]).quality
    text = quality_render.decision({"prefix-reuse": answers, "fi": kernel}, "nvfp4")
    assert text.startswith("Quality, as measured beside speed: prefix-reuse: no significant accuracy difference over "
                           "8 prompts (McNemar exact p = 0.25); fi: the kernel's attention error above")
    assert "does not show the formats equal" in text and "not established" not in text
    assert ("fi: the kernel's attention error above (an error against a reference, not the model's accuracy), where "
            "nvfp4's prefill kernel strays from its own dequantized cache") in text
    alone = quality_render.decision({"fi": kernel}, "nvfp4")
    assert alone.endswith("No run here measured the model's answers, so nvfp4's accuracy is not established: check "
                          "it before choosing it.")
