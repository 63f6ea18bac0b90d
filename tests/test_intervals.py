"""Do the intervals keep their promise on real calls? Coverage and false alarms (issue 12's done-when).

The synthetic comparisons are built from real H200 calls: the FP8 arm of fixtures/fi-h200-sm90 paired, call
for call, with the same FP8 workload recorded again (fixtures/fi-h200-sm90-repeat). Each pair of calls is
one call's real run-to-run noise. A draw resamples those pairs inside each cell (the population is the
recorded pairs), keeps the first run's call as the baseline and scales the repeat's call by a known ratio
r. The repeat's calls are first rescaled per cell so that, over the population, they sum to the first
run's: the drift between the two machines (the GEMM control moved +1.4%) is then not part of the truth,
which is exactly r for every cell and every row of cells.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from conftest import FIXTURES, NSYS2025_DIR
from kvtrace.analyzer import align, compare, pairing, stats
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.load import open_trace

REPEAT = FIXTURES / "fi-h200-sm90-repeat"
DECODE_HEAVY = FIXTURES / "vllm-h200-decode-heavy"
CHANGES = (stats.REGRESSION, stats.IMPROVEMENT)


@pytest.fixture(scope="module")
def recipes():
    return load_recipes()


def repeat_pairs(recipes, fmt: str):
    """The recorded call pairs of a same-format repeat, cell by cell, the repeat rescaled per cell."""
    traces = [open_trace(NSYS2025_DIR / f"{fmt}.sqlite"), open_trace(REPEAT / f"{fmt}.sqlite")]
    classes = [compare.classify_signatures(t, recipes) for t in traces]
    vocabulary = pairing.Vocabulary.of(traces, classes)
    pairs = pairing.pair(*(vocabulary.run(t, c, align.Window()) for t, c in zip(traces, classes)), vocabulary)
    base, repeat = pairs.baseline.astype(np.float64), pairs.candidate.astype(np.float64)
    sizes = np.diff(pairs.offsets)
    repeat *= np.repeat(np.add.reduceat(base, pairs.offsets[:-1]) / np.add.reduceat(repeat, pairs.offsets[:-1]), sizes)
    return pairs, vocabulary, base, repeat


def rows_of(pairs: pairing.Pairs, vocabulary: pairing.Vocabulary) -> tuple[dict, dict]:
    """Rows of one cell (the largest-context prefill cell, 8 calls; decode, append and GEMM cells) and rows of
    several cells (their segments: 3 to 6 cells of different work)."""
    strata = pairs.strata.with_columns(pl.col("segment").map_elements(lambda c: vocabulary.segments[c],
                                                                      return_dtype=pl.Utf8).alias("name"))
    one, several = {}, {}
    for segment, nvtx in (("prefill_attention", "kvtrace:prefill ctx=32768 batch=8"),
                          ("decode_attention", "kvtrace:decode ctx=8192 batch=8"),
                          ("kv_append", "kvtrace:append ctx=2048 batch=8"), ("gemm", "kvtrace:gemm ctx=2048 batch=8")):
        cells = strata.filter((pl.col("name") == segment) & (pl.col("nvtx") == vocabulary.names.index(nvtx)))
        one[f"{segment} in {nvtx}"] = cells["stratum"].to_numpy()[:1]  # decode: the attention kernel's cell
        several[segment] = strata.filter(pl.col("name") == segment)["stratum"].to_numpy()
    assert all(members.size == 1 for members in one.values())
    assert all(members.size >= 3 for members in several.values())
    return one, several


def draw(rng: np.random.Generator, offsets: np.ndarray) -> np.ndarray:
    """Indices of one resample of every cell's pairs, cell by cell."""
    sizes = np.diff(offsets)
    return np.repeat(offsets[:-1], sizes) + (rng.random(offsets[-1]) * np.repeat(sizes, sizes)).astype(np.int64)


def test_intervals_cover_a_known_ratio(recipes):
    """500 draws with r = 1.7: the 95% interval covers r in 93-97% of them, pooled over rows of one cell and
    pooled over rows of several cells, and in at least 90% for every row alone. 1000 resamples per interval
    are enough: the Monte Carlo error of a 95% endpoint is small against the spread of 500 draws."""
    pairs, vocabulary, base, repeat = repeat_pairs(recipes, "fp8")
    one, several = rows_of(pairs, vocabulary)
    rows = list(one.values()) + list(several.values())
    truth, draws = 1.7, 500
    rng = np.random.default_rng(2013)
    covered = np.zeros(len(rows))
    runs = np.zeros(pairs.strata.height, dtype=np.int64)
    for index in range(draws):
        picked = draw(rng, pairs.offsets)
        strata = stats.PairedStrata(base[picked], truth * repeat[picked], pairs.offsets, runs, 1)
        estimates = stats.estimate_rows(strata, rows, resamples=1000, seed=index)
        covered += [e.low <= truth <= e.high for e in estimates]
    coverage = covered / draws
    single, multiple = coverage[:len(one)], coverage[len(one):]
    assert 0.93 <= single.mean() <= 0.97, dict(zip(one, single))
    assert 0.93 <= multiple.mean() <= 0.97, dict(zip(several, multiple))
    assert coverage.min() >= 0.90, dict(zip([*one, *several], coverage))


def test_synthetic_null_pairs_raise_few_false_alarms(recipes):
    """r = 1 on the NVFP4 repeat's noise: at the default threshold, at most 5% of verdicts over every cell and
    segment row are a regression or an improvement."""
    pairs, vocabulary, base, repeat = repeat_pairs(recipes, "nvfp4")
    segments = pairs.strata["segment"].to_numpy()
    rows = [np.array([s]) for s in range(pairs.strata.height)] + [np.flatnonzero(segments == code)
                                                                    for code in np.unique(segments)]
    rng = np.random.default_rng(1988)
    alarms = verdicts = 0
    runs = np.zeros(pairs.strata.height, dtype=np.int64)
    for index in range(200):
        picked = draw(rng, pairs.offsets)
        estimates = stats.estimate_rows(stats.PairedStrata(base[picked], repeat[picked], pairs.offsets, runs, 1),
                                        rows, resamples=1000, seed=index)
        found = [stats.verdict(e) for e in estimates]
        alarms += sum(v in CHANGES for v in found)
        verdicts += len(found)
    assert alarms / verdicts <= 0.05


def test_same_format_repeat_raises_few_false_alarms(recipes):
    """The real same-format pairs (FP8 with FP8, NVFP4 with NVFP4, recorded on two H200 machines): at most 5%
    of all rows, at every level, say regression or improvement; no segment does."""
    verdicts = []
    for fmt in ("fp8", "nvfp4"):
        result = compare.diff(open_trace(NSYS2025_DIR / f"{fmt}.sqlite"), open_trace(REPEAT / f"{fmt}.sqlite"),
                              recipes)
        assert all(r.verdict not in CHANGES for r in result.segments)
        verdicts += [r.verdict for r in result.segments + result.phases + result.families]
    assert sum(v in CHANGES for v in verdicts) / len(verdicts) <= 0.05


@pytest.fixture(scope="module")
def decode_heavy(recipes):
    return compare.diff(open_trace(DECODE_HEAVY / "auto.sqlite"), open_trace(DECODE_HEAVY / "fp8.sqlite"), recipes)


def test_kv_append_segment_keeps_its_step_kinds_apart(decode_heavy):
    """KV append runs in decode steps (2 µs per call) and prefill steps (45 µs); its rows per step kind are
    1.85× and 1.90×. Resampled per cell, the segment's interval lies between them, not over [1.45, 2.40]."""
    segment = next(r for r in decode_heavy.segments if r.segment == "kv_append")
    kinds = [r for r in decode_heavy.phases if r.segment == "kv_append"]
    assert len(kinds) == 2 and not segment.same_work
    assert 1.80 <= segment.ci_low < segment.ratio < segment.ci_high <= 1.95
    assert min(r.ratio for r in kinds) < segment.ratio < max(r.ratio for r in kinds)


def test_rows_say_when_their_cells_hold_single_or_few_calls(decode_heavy):
    """vLLM's sampler kernels run once per step kind: their single-call cells are resampled together, and the
    row says how many; cells of two to four pairs are named as such."""
    other = next(r for r in decode_heavy.phases if r.segment == "other" and r.phase == "vLLM prefill steps")
    assert other.single_call_cells > 1 and other.ci_low is not None
    assert f"{other.single_call_cells} single-call cells resampled together" in other.note
    lone = next(r for r in decode_heavy.phases if r.segment == "memory" and r.phase == "vLLM prefill steps")
    assert (lone.compared_calls, lone.ci_low, lone.verdict) == (1, None, stats.INSUFFICIENT_DATA)


def test_kernels_the_kv_format_cannot_touch_get_no_verdict_beyond_drift(decode_heavy):
    """Activation in decode steps moved -2.6% with an interval far from 1: alone it would read as an
    improvement. The KV-independent kernels (GEMM, norm, activation) moved up to 3.2% for sure between the
    two runs, so no activation, norm, memory or GEMM row, at any level, is called a change."""
    drift = decode_heavy.drift
    assert drift.segments == ("gemm", "norm", "activation") and drift.band > decode_heavy.threshold
    finding = next(f for f in decode_heavy.findings if f.check == "drift")
    assert f"±{100 * drift.band:.1f}% are not attributed to the KV format" in finding.message
    rows = [r for r in decode_heavy.segments + decode_heavy.phases + decode_heavy.families
            if r.segment in ("activation", "norm", "memory", "gemm")]
    assert rows and all(r.verdict not in CHANGES for r in rows)
    activation = next(r for r in decode_heavy.phases if r.segment == "activation" and r.phase == "vLLM decode steps")
    alone = stats.Estimate(activation.ratio, activation.ci_low, activation.ci_high, 0.95, 2000, stats.BOOTSTRAP, 0.0,
                           None, None, 0.0, None, None, (), 1, 0)
    assert stats.verdict(alone) == stats.IMPROVEMENT and activation.verdict == stats.NO_CHANGE
    # The band comes from the rows themselves: the widest sure move among them sets it.
    controls = [r for r in decode_heavy.segments + decode_heavy.phases + decode_heavy.families if r.kv_independent
                and r.ci_low is not None]
    assert drift.band == pytest.approx(max(max(r.ci_low - 1, 1 - r.ci_high, 0) for r in controls))
    # KV-dependent rows beyond the band keep their verdicts.
    decode = next(r for r in decode_heavy.segments if r.segment == "decode_attention")
    assert decode.verdict == stats.REGRESSION and decode.ci_low > 1 + drift.band


# ---- repeated runs ---------------------------------------------------------------------------------------


def test_repeated_runs_put_between_run_variance_in_the_interval(recipes, run_kvtrace):
    """Two real runs per arm (the FlashInfer workload recorded twice): the intervals resample runs, then calls,
    so each covers every run pair's own ratio, also where the two runs disagree beyond one run's interval."""
    fp8, nvfp4 = NSYS2025_DIR / "fp8.sqlite", NSYS2025_DIR / "nvfp4.sqlite"
    again = (REPEAT / "fp8.sqlite", REPEAT / "nvfp4.sqlite")
    code, out, err = run_kvtrace("diff", fp8, nvfp4, "--repeat", *again, "--format", "json")
    assert code == 0, err
    both = json.loads(out)
    assert both["runs"] == 2 and both["method"] == stats.HIERARCHICAL
    singles = [compare.diff(open_trace(b), open_trace(c), recipes) for b, c in ((fp8, nvfp4), again)]
    disagree = 0
    for row in both["phases"]:
        if row["ratio"] is None:
            continue
        alone = [next(r for r in single.phases if (r.segment, r.phase) == (row["segment"], row["phase"]))
                 for single in singles]
        assert row["run_ratios"] == pytest.approx([r.ratio for r in alone])
        assert row["ci_low"] <= min(row["run_ratios"]) and max(row["run_ratios"]) <= row["ci_high"]
        assert row["baseline_calls"] == sum(r.baseline_calls for r in alone)
        disagree += any(not r.ci_low <= other.ratio <= r.ci_high for r, other in zip(alone, alone[::-1]))
    assert disagree  # runs that one run's interval cannot explain: the between-run variance is real
    code, out, err = run_kvtrace("diff", fp8, nvfp4, "--format", "json", "--repeat", again[0])
    assert code == 2 and "--repeat" in err


def repeats_run_directory(tmp_path):
    """A run directory as `kvtrace capture flashinfer --repeats 2` writes it (runs fp8.r1, nvfp4.r1, fp8.r2,
    nvfp4.r2 with `arm` and `repeat`), built from the two real FlashInfer recordings."""
    manifest = json.loads((NSYS2025_DIR / "manifest.json").read_text())
    folder = tmp_path / "fi-repeats"
    folder.mkdir()
    arms = {}
    for repeat, source in ((1, NSYS2025_DIR), (2, REPEAT)):
        for arm in ("fp8", "nvfp4"):
            name = f"{arm}.r{repeat}"
            (folder / f"{name}.sqlite").symlink_to(source / f"{arm}.sqlite")
            arms[name] = {**manifest["arms"][arm], "arm": arm, "repeat": repeat, "sqlite": f"{name}.sqlite"}
    manifest["arms"] = arms
    manifest.setdefault("settings", {}).update(repeats=2, order=list(arms))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_report_picks_repeats_up_from_the_manifest(tmp_path, recipes, run_kvtrace):
    from kvtrace.analyzer import report

    folder = repeats_run_directory(tmp_path)
    result = report.build([folder], recipes)
    assert (result.baseline.arm, result.candidate.arm) == ("fp8", "nvfp4")
    assert result.baseline.runs == (str(folder / "fp8.r1.sqlite"), str(folder / "fp8.r2.sqlite"))
    assert result.diff.runs == 2 and any(f.check == "runs" for f in result.diff.findings)
    prefill = next(r for r in result.diff.segments if r.segment == "prefill_attention")
    assert len(prefill.run_ratios) == 2 and prefill.ci_low <= min(prefill.run_ratios)
    # Bandwidth per call divides the summed time of both runs by both runs' calls.
    single = report.build([NSYS2025_DIR], recipes)
    for row, alone in zip(result.bandwidth, single.bandwidth):
        assert row.phase == alone.phase and row.baseline_ns_per_call == pytest.approx(alone.baseline_ns_per_call,
                                                                                      rel=0.05)
    # One run of each arm by name compares just those runs.
    one = report.build([folder / "fp8.r2", folder / "nvfp4.r2"], recipes)
    assert one.diff.runs == 1 and one.baseline.sqlite == str(folder / "fp8.r2.sqlite")
    code, out, err = run_kvtrace("report", folder, "--format", "markdown")
    assert code == 0, err
    assert "2 runs per arm" in out and "| runs |" in out
