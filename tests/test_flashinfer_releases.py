"""FlashInfer 0.7.2.post1's kernel A/B (fixtures/fi-h100-sm90-gaussian-fi0.7.2.post1, recorded on an H100) beside
0.6.16.post3's (fi-h200-sm90-gaussian, on an H200): the same command and workload, another release on another GPU
(issue 47). Each run's NVFP4/FP8 ratios are paired within the run; across the runs both the release and the GPU
changed, so kvtrace compares the two runs' calls as "different GPUs" and no release effect is read from them."""

from __future__ import annotations

import json

import pytest

from conftest import FI_GAUSSIAN, FI_GAUSSIAN_072, REPO, sql_durations
from kvtrace.analyzer import headline, quality
from kvtrace.analyzer.render import units

CONTEXTS = (2048, 8192, 32768)
RUNS = {"0.6.16.post3": FI_GAUSSIAN, "0.7.2.post1": FI_GAUSSIAN_072}
# The attention kernel of each question, as the trace names it (MaskMode 1: causal prefill; 0: decode).
KERNELS = {headline.PREFILL: "%BatchPrefillWithPagedKVCacheKernel%MaskMode)1%",
           headline.DECODE: "%BatchPrefillWithPagedKVCacheKernel%MaskMode)0%"}
NVTX = {headline.PREFILL: "kvtrace:prefill ctx={} batch=8", headline.DECODE: "kvtrace:decode ctx={} batch=8"}


def manifest(run) -> dict:
    return json.loads((run / "manifest.json").read_text())


def workload(run, arm: str) -> dict:
    return json.loads((run / f"{arm}.workload.json").read_text())


def test_the_same_workload_on_another_release_and_another_gpu():
    new, old = manifest(FI_GAUSSIAN_072), manifest(FI_GAUSSIAN)
    assert new["settings"]["spec"] == old["settings"]["spec"]
    assert new["settings"]["spec"]["inputs"] == "gaussian"
    for version, run in RUNS.items():
        for arm in ("fp8", "nvfp4"):
            assert workload(run, arm)["versions"]["flashinfer"] == version
    # The same inputs, drawn again from the seed: each cache and its exact attention are the same bits in both runs,
    # so a kernel's distance from its own cache compares across the releases.
    for arm in ("fp8", "nvfp4"):
        points = [[(c["context"], c["k_scale"], c["v_scale"], c["quality"]["cache"], c["quality"]["format"])
                   for c in workload(run, arm)["contexts"]] for run in (FI_GAUSSIAN, FI_GAUSSIAN_072)]
        assert points[0] == points[1] and [p[0] for p in points[0]] == list(CONTEXTS)
    assert {gpu["name"] for gpu in new["environment"]["gpus"]} == {"NVIDIA H100 80GB HBM3"}
    assert {gpu["name"] for gpu in old["environment"]["gpus"]} == {"NVIDIA H200"}


@pytest.mark.parametrize("version", sorted(RUNS))
def test_diff_gives_prefill_and_decode_per_context_with_intervals(shared, version):
    """The head's prefill and decode attention rows, one per context: each the ratio of the per-call means that plain
    SQL over the NVTX range gives, inside its own interval, over every call the workload made."""
    run = RUNS[version]
    head = headline.Headline.of(shared.diff(run / "fp8.sqlite", run / "nvfp4.sqlite"))
    spec = manifest(run)["settings"]["spec"]
    calls = {headline.PREFILL: spec["prefill_calls"], headline.DECODE: spec["decode_calls"]}
    for question, kernel in KERNELS.items():
        rows = [r for r in head.rows if r.question == question and r.family.startswith("BatchPrefill")]
        assert [r.point for r in rows] == [f"ctx={c}" for c in CONTEXTS]
        for context, r in zip(CONTEXTS, rows):
            fp8, nvfp4 = (sql_durations(run / f"{arm}.sqlite", kernel, nvtx=NVTX[question].format(context))
                          for arm in ("fp8", "nvfp4"))
            assert len(fp8) == len(nvfp4) == r.row.compared_calls == calls[question]
            assert r.row.ratio == pytest.approx((sum(nvfp4) / len(nvfp4)) / (sum(fp8) / len(fp8)))
            assert r.row.ci_low < r.row.ratio < r.row.ci_high


def test_nvfp4_prefill_stays_with_its_own_cache_on_0_7_2_post1(shared):
    """The mask finding, measured: on 0.6.16.post3 NVFP4's causal prefill strays from exact attention over its own
    dequantized cache at every context (past DEPARTURE_ROUNDINGS BF16 roundings) and kvtrace names it; on
    0.7.2.post1 the same workload's every kernel stays within them and kvtrace names nothing."""
    def distances(run):
        return {(arm, what, point["context"]): point["quality"]["kernel_vs_format"][what]["rel_l2"]
                for arm in ("fp8", "nvfp4") for point in workload(run, arm)["contexts"]
                for what in ("prefill", "decode")}

    limit = quality.DEPARTURE_ROUNDINGS * quality.BF16_ROUNDING
    old, new = distances(FI_GAUSSIAN), distances(FI_GAUSSIAN_072)
    assert {key for key, value in old.items() if value > limit} == {("nvfp4", "prefill", c) for c in CONTEXTS}
    assert len(new) == len(old) and max(new.values()) < limit
    departures = {version: [(d.side, d.what, d.context) for d in shared.report([run]).quality.departures]
                  for version, run in RUNS.items()}
    assert departures == {"0.6.16.post3": [("candidate", "prefill", c) for c in CONTEXTS], "0.7.2.post1": []}


def test_the_two_releases_runs_are_not_compared_call_for_call(shared):
    """The same arm across the two runs: kvtrace flags the GPUs as different (an error), so a release's effect is not
    read from such a diff; the releases are compared by each run's own NVFP4/FP8 ratio."""
    for arm in ("fp8", "nvfp4"):
        diff = shared.diff(FI_GAUSSIAN / f"{arm}.sqlite", FI_GAUSSIAN_072 / f"{arm}.sqlite")
        gpu = [f for f in diff.findings if f.check == "gpu"]
        assert [(f.level, f.message) for f in gpu] == [
            ("error", "different GPUs: NVIDIA H200 vs NVIDIA H100 80GB HBM3")]


def test_readme_head_is_what_kvtrace_prints_for_the_newest_release(run_kvtrace, shared):
    """README's shortened head of `make demo` comes from kvtrace on FlashInfer 0.7.2.post1's run: each of its lines
    from the first question on is a line of the 100-column terminal diff (as words), and the history it quotes for
    0.6.16.post3 are that run's own head rows."""
    text = (REPO / "README.md").read_text()
    block = text.split("```\n", 2)[1]
    assert block.startswith("baseline fp8 → candidate nvfp4 on NVIDIA H100 80GB HBM3:")
    code, out, err = run_kvtrace("diff", FI_GAUSSIAN_072 / "fp8.sqlite", FI_GAUSSIAN_072 / "nvfp4.sqlite",
                                 env={"COLUMNS": "100"})
    assert code == 0, err
    printed = [line.split() for line in out.splitlines()]
    shown = block.splitlines()
    first = next(i for i, line in enumerate(shown) if line.startswith(headline.PREFILL))
    assert [line for line in shown[first:] if line.split() not in printed] == []
    head = headline.Headline.of(shared.diff(FI_GAUSSIAN / "fp8.sqlite", FI_GAUSSIAN / "nvfp4.sqlite"))
    quoted = {(question, f"ctx={context}"): units.ratio(r.row.ratio) for question in (headline.PREFILL, headline.DECODE)
              for context in (2048, 32768) for r in head.rows
              if r.question == question and r.point == f"ctx={context}" and r.family.startswith("BatchPrefill")}
    history = text[text.index("History: FlashInfer"):]
    assert (f"prefill {quoted[headline.PREFILL, 'ctx=2048']} at 2,048 tokens and {quoted[headline.PREFILL, 'ctx=32768']}"
            f" at 32,768, decode {quoted[headline.DECODE, 'ctx=2048']} and {quoted[headline.DECODE, 'ctx=32768']}"
            ) in " ".join(history.split())
