"""Prefill attention against the compute peak (analyzer/roofline): FLOPs written out by hand from the fixtures'
manifests and step names, kernel time from plain SQL over the same exports."""

from __future__ import annotations

import json
import re
import sqlite3

import pytest

from conftest import NSYS2025_DIR, RECORDED_REPORT, VLLM_COLD_PREFILL, sql_durations
from kvtrace.analyzer import align, report, roofline
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render import json_out, render_text

PREFILL = "%BatchPrefillWithPagedKVCacheKernel%MaskMode)1%"
H200_DENSE_BF16 = 989.4e12  # NVIDIA H200 SXM datasheet: 1,979 TFLOPS BF16 with sparsity, half of it dense


@pytest.fixture(scope="module")
def fi(fi_h200_report):
    return fi_h200_report


def test_prefill_tflops_of_fi_h200_match_the_hand_calculation(fi):
    spec = json.loads((NSYS2025_DIR / "manifest.json").read_text())["settings"]["spec"]
    assert (spec["batch"], spec["q_heads"], spec["head_dim"]) == (8, 64, 128)
    # Causal prefill over the whole context (q_len = kv_len = context), counted as half of full attention:
    # 4 · batch · q_heads · ctx · ctx · head_dim / 2.
    #   ctx  2,048: 4 · 8 · 64 · 2,048 · 2,048 · 128 / 2 =     549,755,813,888 FLOPs
    #   ctx  8,192: 16× the work of 2,048                =   8,796,093,022,208 FLOPs
    #   ctx 32,768: 16× the work of 8,192                = 140,737,488,355,328 FLOPs
    by_hand = {2048: 549_755_813_888, 8192: 8_796_093_022_208, 32768: 140_737_488_355_328}
    assert [r.context for r in fi.prefill_compute] == list(by_hand)
    assert fi.compute_ceiling.flops_per_s == H200_DENSE_BF16 and "datasheet" in fi.compute_ceiling.source
    for row in fi.prefill_compute:
        assert row.flops_per_call == by_hand[row.context]
        for side, arm in (("baseline", "fp8"), ("candidate", "nvfp4")):
            times = sql_durations(NSYS2025_DIR / f"{arm}.sqlite", PREFILL, nvtx=row.phase)
            assert len(times) == spec["prefill_calls"] == getattr(row, f"{side}_calls")
            per_call_s = sum(times) / len(times) / 1e9
            assert getattr(row, f"{side}_flops_per_s") == pytest.approx(by_hand[row.context] / per_call_s)
            assert getattr(row, f"{side}_fraction_of_peak") == pytest.approx(
                by_hand[row.context] / per_call_s / H200_DENSE_BF16)
    # Compute-bound: prefill is rated against the tensor-core peak, no longer against HBM bandwidth.
    assert not [r for r in fi.bandwidth if r.kind == "prefill"]


def test_the_convention_is_stated_in_the_report(fi):
    text = render_text(fi, "markdown")
    assert "### Achieved compute (prefill)" in text
    assert "causal attention counts half" in text and "989.4 TFLOP/s" in text
    assert json.loads(json_out.render(fi))["flops_convention"] == roofline.CAUSAL_CONVENTION


def test_vllm_prefill_flops_from_the_model_config_and_step_names(shared):
    result = shared.report([VLLM_COLD_PREFILL])
    model = json.loads((VLLM_COLD_PREFILL / "manifest.json").read_text())["settings"]["model"]
    layers, heads, head_dim = model["num_hidden_layers"], model["num_attention_heads"], model["head_dim"]
    (row,) = result.prefill_compute
    with sqlite3.connect(f"file:{VLLM_COLD_PREFILL / 'auto.sqlite'}?mode=ro", uri=True) as conn:
        names = [r[0] for r in conn.execute(
            "SELECT coalesce(n.text, s.value) AS v FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId "
            "WHERE v LIKE 'execute_context_%_generation_0(0)' AND v NOT LIKE 'execute_context_0(%'")]
    steps = [tuple(map(int, re.fullmatch(r"execute_context_(\d+)\((\d+)\)_generation_0\(0\)", n).groups()))
             for n in names]
    assert steps and all(tokens == requests * 1024 for requests, tokens in steps)  # input=1024, no prefix cache
    # Each request: causal over its 1,024 tokens in every layer, 4 · q_heads · 1,024² · head_dim / 2 · layers.
    per_request = 4 * heads * 1024 * 1024 * head_dim // 2 * layers
    assert row.flops_per_call == pytest.approx(sum(r for r, _ in steps) * per_request / len(steps))
    assert row.baseline_calls == len(steps) and row.baseline_fraction_of_peak < 1


def test_not_derivable_and_unknown_peak_are_said(shared):
    sweep = shared.report([RECORDED_REPORT / "sweep"])
    (row,) = sweep.prefill_compute
    assert row.flops_per_call is None and row.derivation.startswith("not derivable:")
    assert "not derivable" in render_text(sweep, "markdown")
    unknown = roofline.compute_ceiling("NVIDIA A100-SXM4-80GB")
    assert unknown.flops_per_s is None and unknown.source.startswith("peak unknown")


def test_vllm_prefill_flops_under_trimming_are_not_derivable_and_a_time_window_keeps_whole_steps(shared):
    trimmed = report.build([VLLM_COLD_PREFILL], load_recipes(), window=align.Window(last=2))
    (row,) = trimmed.prefill_compute
    assert row.flops_per_call is None and "--last" in row.derivation
    whole = shared.report([VLLM_COLD_PREFILL])
    (full,) = whole.prefill_compute
    timed = report.build([VLLM_COLD_PREFILL], load_recipes(), window=align.Window(time_ns=(0, None)))
    assert timed.prefill_compute[0].baseline_calls == full.baseline_calls
