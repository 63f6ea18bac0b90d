"""What kvtrace says about whether two arms can be compared at all (same GPU, nsys, KV dtypes, vLLM steps,
window, drift), as opposed to what the numbers say (analyzer.statements)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from kvtrace.analyzer import align, drift_band
from kvtrace.analyzer.results import Arm, DiffRow, Drift, Finding
from kvtrace.analyzer.stats import arm_summary
from kvtrace.kv_formats import bytes_per_value, claimed_dtypes

if TYPE_CHECKING:
    from kvtrace.analyzer.pairing import Run, Vocabulary


def drift_findings(drift: Drift, threshold: float) -> list[Finding]:
    """The drift line (how far the controls moved, and the band that applies to each size of call), and a
    finding of its own for a KV-independent family left out of the bands. Without controls it says that drift
    was not measured: with one run per arm every size of call has the assumed band."""
    def signed(value: float) -> str:
        return f"{100 * (value - 1):+.1f}%".replace("-", "−")

    if drift.ratio is None:
        if any(size.basis == drift_band.ASSUMED for size in drift.bands):
            band = max(threshold, *(size.band for size in drift.bands))
            return [Finding("warning", "drift", "no KV-independent kernel (GEMM, norm, activation) was paired, so "
                            "run-to-run drift cannot be measured from one run per arm: changes within "
                            f"±{100 * band:.1f}% are not attributed to the KV format, whatever their call size "
                            "(assumed; --repeat measures it)")]
        return [Finding("ok", "drift", "no KV-independent kernel (GEMM, norm, activation) was paired: the intervals "
                        "carry the spread between the run pairs (--repeat), so no size of call gets a band beyond "
                        f"the ±{100 * threshold:g}% threshold")]
    moved = signed(drift.ratio)
    if drift.ci_low is not None:
        moved += f" [{signed(drift.ci_low)}, {signed(drift.ci_high)}]"
    text = (f"KV-independent kernels ({', '.join(drift.segments)}; {drift.compared_calls:,} call pairs) moved "
            f"{moved} between the runs")
    spans: list[list] = []  # [first class, last class, band], neighbours that share one band merged
    for index, size in enumerate(drift.bands):
        if size.band <= threshold:
            continue
        if spans and spans[-1][1] == index - 1 and spans[-1][2] == (size.band, size.basis, size.widest):
            spans[-1][1] = index
        else:
            spans.append([index, index, (size.band, size.basis, size.widest)])
    # No control is of the kind of `other` kernels (vLLM's sampler moved 5-19% between runs of the same work).
    uncontrolled = (f"; segment '{drift_band.UNCONTROLLED_SEGMENT}' ±{100 * drift.uncontrolled_band:.1f}% at least "
                    "(assumed: no KV-independent kernel is of its kind; --repeat measures it)"
                    if drift.uncontrolled_band > threshold else "")
    if not spans and not uncontrolled:
        found = [Finding("ok", "drift", f"{text}; every size of call within the ±{100 * threshold:g}% threshold")]
    else:
        parts = []
        for first, last, (band, basis, widest) in spans:
            why = ("assumed: no KV-independent kernel this small was paired; --repeat measures it"
                   if basis == drift_band.ASSUMED else widest)
            parts.append(f"{drift_band.size_class_label(first, last)} ±{100 * band:.1f}% ({why})")
        elsewhere = f"; elsewhere ±{100 * threshold:g}%" if sum(last - first + 1 for first, last, _ in spans) < \
            len(drift.bands) else ""
        sizes = (f"{'; '.join(parts)}{elsewhere}" if parts else
                 f"every size of call ±{100 * threshold:g}% (the threshold)")
        found = [Finding("warning", "drift", f"{text}; changes within the band of their call size are not attributed "
                         f"to the KV format: {sizes}{uncontrolled}")]
    if drift.outlier:
        found.append(Finding("warning", "drift", f"{drift.outlier} (KV-independent) moved "
                             f"{100 * drift.outlier_move:.1f}% for sure, more than twice any other KV-independent "
                             "family: it is left out of the drift bands, since a kernel next to attention can move "
                             "with the KV format (cache and memory traffic)"))
    return found


def window_findings(window: align.Window, families: list[DiffRow], realigned: list[str],
                    relaunched: list[tuple[str, str, str]]) -> list[Finding]:
    """The window compared, and how calls aligned: families paired on their last calls, families whose one name
    ran with other launch shapes in the same ranges (`relaunched`: family, baseline and candidate shapes), and
    families that ran in both arms and paired nowhere."""
    findings = [Finding("ok", "window", "compared " + part) for part in window.describe()]
    if not window.describe():
        findings.append(Finding("ok", "window", "compared whole traces (no --window, --time, --phase or trimming)"))
    for r in families:
        if r.family_label in realigned:
            paired = r.note or "paired on its last calls"
            findings.append(Finding("warning", "alignment", f"{r.family_label}: {paired}; extra calls at the start "
                                    "are usually warm-up (--skip-warmup), missing calls at the end a truncated arm"))
    for label, base_shapes, cand_shapes in relaunched:
        findings.append(Finding("warning", "alignment", f"{label} ran in the same NVTX ranges with other launch "
                                f"shapes ({base_shapes} vs {cand_shapes}): compiled or launched differently; its "
                                "calls are paired by range, not matched work, so the rows of those ranges move with "
                                "its launch as well as with the KV format"))
    shown = {label for label, _, _ in relaunched}
    unmatched = [r.family_label for r in families if r.reason and r.baseline_calls and r.candidate_calls
                 and r.family_label not in shown]
    if unmatched:
        examples = ", ".join(unmatched[:3]) + (", …" if len(unmatched) > 3 else "")
        findings.append(Finding("warning", "alignment", f"{len(unmatched)} kernel famil"
                                f"{'y' if len(unmatched) == 1 else 'ies'} ran in both arms but in different NVTX "
                                f"ranges or launch shapes, so no calls pair ({examples}); the notes under the "
                                "tables say where"))
    return findings


def arm_findings(runs: list[tuple[Run, Run]], candidate_window: align.Window) -> list[Finding]:
    """With --arms: the candidate's window, and per trace that holds both arms, the calls that fall in both
    windows (they count in both arms) and in neither (compared by no one)."""
    if not candidate_window.arm:
        return []
    findings = [Finding("ok", "window", "compared " + part) for part in candidate_window.describe()
                if part.startswith("arm /")]
    for base, cand in runs:
        if base.trace.info.sqlite != cand.trace.info.sqlite:
            continue
        both = int(np.count_nonzero(base.keep & cand.keep))
        neither = int(np.count_nonzero(~(base.keep | cand.keep)))
        source = base.trace.info.source
        if both:
            findings.append(Finding("warning", "arms", f"{source}: {both:,} calls fall in both arms' windows and "
                                    "count in both arms; give --arms patterns whose ranges do not nest in each other"))
        findings.append(Finding("ok", "arms", f"{source}: both arms from one trace; {neither:,} of its "
                                f"{base.trace.calls.count:,} calls fall in neither arm's window"))
    return findings


def rank_findings(vocabulary: Vocabulary, runs: list[tuple[Run, Run]], base_arm: Arm, cand_arm: Arm) -> list[Finding]:
    """Traces of several GPUs: which device and processes each rank is, whether both arms have as many ranks
    (rank k pairs with rank k), and rank skew. A collective ends on every rank when the slowest arrives, so the
    rank that waits least in its communication kernels is the straggler the others wait for."""
    if vocabulary.ranks == 1:
        return []
    findings = []
    for index, pair in enumerate(runs):  # every run pair: a later one may differ where the first does not
        counts = [len(run.trace.info.ranks) for run in pair]
        if counts[0] != counts[1]:
            where = f"r{index + 1}: " if len(runs) > 1 else ""
            findings.append(Finding("error", "ranks", f"{where}{base_arm.label} ran on {counts[0]} GPU(s) and "
                                    f"{cand_arm.label} on {counts[1]}: ranks pair by device order, so the ranks beyond "
                                    f"{min(counts)} have no partner; compare runs of the same tensor-parallel size"))
    communication = vocabulary.segments.index("communication") if "communication" in vocabulary.segments else -1
    for index, pair in enumerate(runs):
        for run, arm in zip(pair, (base_arm, cand_arm)):
            where = f"r{index + 1} " if len(runs) > 1 else ""
            findings.append(_rank_skew(run, f"{where}{arm.label}", communication))
    return findings


def _rank_skew(run: Run, label: str, communication: int) -> Finding:
    ranks = run.trace.info.ranks
    table = run.cells.table.with_columns((pl.col("segment") == communication).alias("collective")).group_by(
        "rank", "collective").agg(pl.col("calls", "total_ns").sum())
    found = {(rank, collective): (calls, total) for rank, collective, calls, total in table.iter_rows()}
    mapping = ", ".join(f"rank {k} = device {r.device_id}" + (f" (pid {', '.join(map(str, r.processes))})"
                                                                if r.processes else "") for k, r in enumerate(ranks))
    compute = ", ".join(f"{found.get((k, False), (0, 0))[1] / 1e6:,.2f} ms" for k in range(len(ranks)))
    text = f"{label}: {len(ranks)} ranks ({mapping}); compute kernels (all but communication) per rank {compute}"
    waits = [found.get((k, True)) for k in range(len(ranks))]
    if not all(waits):
        return Finding("ok", "ranks", f"{text}; no communication kernels on every rank, so skew is not measured")
    per_call = np.array([total / calls for calls, total in waits])
    shown = ", ".join(f"{value / 1e3:,.1f} µs" for value in per_call)
    if arm_summary.same_work([per_call]):
        return Finding("ok", "ranks", f"{text}; communication kernels cost the same per call on every rank "
                       f"({shown}): no straggler")
    straggler = int(per_call.argmin())
    return Finding("warning", "ranks", f"{text}; rank skew: communication kernels per call {shown} by rank, so "
                   f"rank {straggler} (device {ranks[straggler].device_id}) is the straggler: it waits least, and "
                   "the other ranks' collectives wait for it. Communication is never a drift control; compare "
                   "the compute rows rank by rank")


def run_findings(runs: list[tuple[Run, Run]], base_arm: Arm, cand_arm: Arm) -> list[Finding]:
    findings = []
    count = len(runs)
    if count > 1:
        findings.append(Finding("ok", "runs", f"{count} runs per arm, paired in repeat order (r1 with r1, …): "
                                "intervals resample run pairs, then calls within each run, so between-run variance "
                                "is inside them"))
        gpus = sorted({run.trace.info.gpu_label for pair in runs for run in pair})
        if len(gpus) > 1:
            findings.append(Finding("error", "gpu", f"the runs ran on different GPUs: {', '.join(gpus)}"))
    for index, (base, cand) in enumerate(runs):
        found = _step_findings(base, cand, base_arm, cand_arm)
        if count > 1:
            for f in found:
                f.message = f"r{index + 1}: {f.message}"
        findings += found
    return findings


def _step_findings(base: Run, cand: Run, base_arm: Arm, cand_arm: Arm) -> list[Finding]:
    """vLLM step token counts must agree, or per-step kernel times describe different work (kekzl/imp#1816)."""
    steps = [align.steps(run.trace).filter(pl.col("range").is_in(run.ranges.implode())).unique("step_range")
             for run in (base, cand)]
    if not steps[0].height and not steps[1].height:
        return []

    def describe(arm: Arm, found: pl.DataFrame) -> str:
        first = found.bottom_k(4, by=["step_start", "step_range"]).sort("step_start", "step_range")["step"].to_list()
        shown = ", ".join(first) + (f", … ({found.height} steps)" if found.height > 4 else "")
        return f"{arm.label}: {shown or 'none'}"

    # The same steps: each step name as often in both arms. Counted per distinct name, since an hour of serving
    # has hundreds of thousands of steps.
    if steps[0]["step"].value_counts().sort("step").equals(steps[1]["step"].value_counts().sort("step")):
        return [Finding("ok", "steps", f"both arms ran the same {steps[0].height} vLLM steps (same requests and "
                                       "token counts per step)")]
    return [Finding("warning", "steps", f"the arms scheduled different vLLM steps ({describe(base_arm, steps[0])}; "
                    f"{describe(cand_arm, steps[1])}): kernel times of different steps are not comparable, so "
                    "only calls in identical steps pair; re-record so that both arms schedule the same batches")]


def comparability(baseline: Arm, candidate: Arm) -> list[Finding]:
    findings = []
    b_gpu, c_gpu = baseline.info.gpu_label, candidate.info.gpu_label
    unknown = [arm.label for arm in (baseline, candidate) if not arm.info.gpus]
    if unknown:  # an export without TARGET_INFO_GPU (or without its row for the kernels' device)
        findings.append(Finding("warning", "gpu", f"GPU unknown for {' and '.join(dict.fromkeys(unknown))}: the "
                                "export names no GPU (no TARGET_INFO_GPU row), so whether both arms ran on the same "
                                "GPU cannot be checked"))
    else:
        findings.append(Finding("ok" if b_gpu == c_gpu else "error", "gpu",
                                f"same GPU: {b_gpu}" if b_gpu == c_gpu else f"different GPUs: {b_gpu} vs {c_gpu}"))
    b_ver, c_ver = baseline.info.product_version or "?", candidate.info.product_version or "?"
    same_family = b_ver.split(".")[:2] == c_ver.split(".")[:2]
    findings.append(Finding("ok" if same_family else "warning", "nsys",
                            f"Nsight Systems {b_ver} and {c_ver}" + ("" if same_family else
                            ": different versions can report kernels differently")))
    for arm in (baseline, candidate):
        # Graph mode leaves out only the kernels of graphs launched: without a graph launch nothing is missing.
        if arm.info.graph_trace_mode is not None and arm.info.graph_trace_mode.lower() != "node" \
                and arm.info.graph_launches is not False:
            findings.append(Finding("warning", "graph-trace", f"{arm.label}: CUDA graphs traced as "
                                    f"'{arm.info.graph_trace_mode}', so kernels inside graphs are missing; "
                                    "re-profile with --cuda-graph-trace=node"))
    findings += _dtype_findings(baseline, candidate)
    return findings


def read_first(findings: list[Finding]) -> list[Finding]:
    """What to read before any number: which arm is which (the KV dtypes' warnings and errors: the narrower format
    as the baseline, arms that look swapped, one dtype in both arms)."""
    return [f for f in findings if f.check == "kv-dtype" and f.level != "ok"]


def _dtype_findings(baseline: Arm, candidate: Arm) -> list[Finding]:
    findings = []
    for arm in (baseline, candidate):
        seen = ", ".join(arm.kv_dtypes) or "none detected"
        findings.append(Finding("ok", "kv-dtype", f"{arm.label}: KV cache dtype in kernel names: {seen}"))
    if baseline.kv_dtypes and baseline.kv_dtypes == candidate.kv_dtypes:
        findings.append(Finding("warning", "kv-dtype", "both arms ran the same KV dtype "
                                f"({', '.join(baseline.kv_dtypes)}): this compares runs, not formats"))

    widths = [max((bytes_per_value(d) for d in arm.kv_dtypes), default=0.0) for arm in (baseline, candidate)]
    if 0 < widths[0] < widths[1]:  # `kvtrace report` puts the widest format first; a diff says so
        findings.append(Finding("warning", "kv-dtype", f"the baseline ran the narrower KV format "
                                f"({', '.join(baseline.kv_dtypes)} against {', '.join(candidate.kv_dtypes)}): every "
                                "ratio reads the other way round from kvtrace report's; give the wider format first"))
    for arm, other in ((baseline, candidate), (candidate, baseline)):
        claimed = claimed_dtypes(arm.label)
        # A label naming the other arm's dtype but not its own is the swapped-arms signature.
        if claimed and arm.kv_dtypes and not claimed & set(arm.kv_dtypes):
            swapped = claimed_dtypes(other.label) & set(arm.kv_dtypes)
            findings.append(Finding("error", "kv-dtype",
                                    f"'{arm.label}' ran {', '.join(arm.kv_dtypes)} kernels"
                                    + (": the arms look swapped (baseline first, candidate second)" if swapped else
                                       ": check that the file and its label match")))
    return findings
