"""Prefill attention against the GPU's compute peak: achieved TFLOP/s of the prefill-attention kernels.

Prefill attention is compute-bound (every query row meets every key row), so it is rated against the dense
BF16 tensor-core peak, never against HBM bandwidth; decode and append stay on the bandwidth roofline
(analyzer/report.bandwidth_rows).

FLOPs of one attention call: 4 · batch · q_heads · q_len · kv_len · head_dim (QKᵀ and PV, a multiply-add
counted as 2), halved when causal: the convention of FlashAttention's benchmarks, which count causal
attention as half of full attention (CAUSAL_CONVENTION). Shapes come from the FlashInfer engine's spec, or,
for vLLM, from the model config and the token counts of vLLM's step names, where they fix every request's
length; otherwise the row says why the FLOPs are not derivable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import polars as pl

from kvtrace import model_config
from kvtrace.analyzer import align
from kvtrace.analyzer.compare import Sides
from kvtrace.analyzer.results import Diff
from kvtrace.analyzer.pairing import Run
from kvtrace.errors import KvtraceError
from kvtrace.manifest import Manifest, Point, parse_phase_name

CAUSAL_CONVENTION = ("FLOPs = 4 · batch · q_heads · q_len · kv_len · head_dim (QKᵀ and PV); causal attention counts "
                     "half (FlashAttention's benchmark convention)")
# Dense BF16 tensor-core peaks by the GPU name Nsight Systems records (TARGET_INFO_GPU.name). NVIDIA's
# datasheets list BF16 with 2:4 sparsity; dense is half of that figure.
_H100_H200_SXM = ("NVIDIA H100/H200 Tensor Core GPU datasheets (SXM): BF16 Tensor Core 1,979 TFLOPS with "
                  "sparsity, 989.4 TFLOPS dense")
BF16_DENSE_PEAKS = {
    "NVIDIA H200": (989.4e12, _H100_H200_SXM),
    "NVIDIA H100 80GB HBM3": (989.4e12, _H100_H200_SXM),
    "NVIDIA H200 NVL": (835.5e12, "NVIDIA H200 Tensor Core GPU datasheet (NVL): BF16 Tensor Core 1,671 TFLOPS "
                                  "with sparsity, 835.5 TFLOPS dense"),
}


@dataclass
class ComputeCeiling:
    gpu: str
    flops_per_s: float | None  # None: peak unknown for this GPU
    source: str


@dataclass
class PrefillCompute:
    """Prefill attention FLOPs per call / the prefill-attention kernels' GPU time per call, per arm."""

    phase: str  # the NVTX range, or vLLM's prefill steps
    context: int | None
    flops_per_call: float | None  # None: not derivable (see `derivation`)
    derivation: str  # the shape the FLOPs come from, or why they cannot be derived
    baseline_calls: int | None
    candidate_calls: int | None
    baseline_ns_per_call: float | None
    candidate_ns_per_call: float | None
    baseline_flops_per_s: float | None
    candidate_flops_per_s: float | None
    baseline_fraction_of_peak: float | None
    candidate_fraction_of_peak: float | None


def attention_flops(batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int, *, causal: bool) -> float:
    full = 4 * batch * q_heads * q_len * kv_len * head_dim
    return full / 2 if causal else float(full)


def compute_ceiling(name: str) -> ComputeCeiling:
    """The dense BF16 peak of the GPU Nsight Systems names, or "peak unknown"."""
    if name in BF16_DENSE_PEAKS:
        peak, source = BF16_DENSE_PEAKS[name]
        return ComputeCeiling(gpu=name, flops_per_s=peak, source=source)
    return ComputeCeiling(gpu=name, flops_per_s=None, source=f"peak unknown: kvtrace has no dense BF16 peak for {name}")


def _row(phase: str, context: int | None, flops: float | None, derivation: str, sides: dict,
         ceiling: ComputeCeiling | None) -> PrefillCompute:
    values = {}
    for side in ("baseline", "candidate"):
        calls, total = sides.get(side, (None, None))
        per_call = total / calls if calls and total else None
        rate = flops / (per_call / 1e9) if flops and per_call else None
        peak = ceiling.flops_per_s if ceiling else None
        values[side] = (calls, per_call, rate, rate / peak if rate and peak else None)
    b, c = values["baseline"], values["candidate"]
    return PrefillCompute(phase=phase, context=context, flops_per_call=flops, derivation=derivation,
                          baseline_calls=b[0], candidate_calls=c[0], baseline_ns_per_call=b[1],
                          candidate_ns_per_call=c[1], baseline_flops_per_s=b[2], candidate_flops_per_s=c[2],
                          baseline_fraction_of_peak=b[3], candidate_fraction_of_peak=c[3])


def flashinfer_rows(diff: Diff, manifests: tuple[Manifest, Manifest], phases: tuple[list, list],
                    ceiling: ComputeCeiling | None) -> list[PrefillCompute]:
    """The FlashInfer workload's prefill phases: causal, every context token a query (q_len = kv_len =
    context), batch × q_heads × head_dim from settings.spec; one call per workload call of the phase."""
    spec = manifests[0].settings.get("spec") or {}
    totals = {r.phase: r for r in diff.phases if r.segment == "prefill_attention"}
    rows = []
    nvtx_names = dict.fromkeys(p.nvtx for side in phases for p in side if p.kind == "prefill")
    for nvtx in nvtx_names:
        _, context = parse_phase_name(nvtx)
        if {"batch", "q_heads", "head_dim"} <= set(spec) and context:
            flops = attention_flops(int(spec["batch"]), int(spec["q_heads"]), context, context, int(spec["head_dim"]),
                                    causal=True)
            derivation = (f"causal, batch {spec['batch']} × q_heads {spec['q_heads']} × q_len = kv_len = the phase's "
                          f"context × head_dim {spec['head_dim']} (settings.spec)")
        else:
            flops, derivation = None, "not derivable: the manifest's settings.spec has no batch, q_heads or head_dim"
        row = totals.get(nvtx)
        sides = {}
        for side, side_phases in zip(("baseline", "candidate"), phases):
            phase = next((p for p in side_phases if p.nvtx == nvtx), None)
            total = getattr(row, f"{side}_total_ns") if row else None
            sides[side] = ((phase.calls or 0) * diff.runs if phase else None, total)  # the diff sums the runs
        rows.append(_row(nvtx, context, flops, derivation, sides, ceiling))
    rows.sort(key=lambda r: r.context or 0)
    return rows


_STEP = re.compile(align.VLLM_STEP.pattern)


def vllm_row(sides: Sides, manifest: Manifest, ceiling: ComputeCeiling | None) -> PrefillCompute:
    """vLLM's prefill steps (context requests only) whose every request prefilled the whole prompt of the run's
    one traffic point: N requests of T tokens, causal over T, in every full-attention layer."""
    def not_derivable(reason: str) -> PrefillCompute:
        return _row(align.PREFILL, None, None, f"not derivable: {reason}", {}, ceiling)

    try:
        layout = model_config.read(manifest.kv_config, "settings.model")
    except KvtraceError:
        return not_derivable("the manifest records no model config kvtrace can read")
    groups = [g for g in layout.groups if g.kind == model_config.FULL]
    if len(groups) != len(layout.groups) or not layout.attention_heads:
        return not_derivable("only plain full-attention models (no sliding window, MLA or recurrent layers) are counted")
    if sides.window.skip_warmup or sides.window.last is not None:
        return not_derivable("--skip-warmup and --last trim calls per kernel, not whole steps")
    if manifest.settings.get("prefix_caching"):
        return not_derivable("prefix caching is on, so a step's kv_len is not its token count")
    points = manifest.settings.get("points") or []
    try:
        prompts = {Point.parse(p).prefix_len + Point.parse(p).input_len for p in points}
    except (ValueError, TypeError):
        prompts = set()
    if len(prompts) != 1:
        return not_derivable("the run has no single traffic point that fixes every prompt's length")
    prompt = prompts.pop()
    layers, head_dim, q_heads = sum(g.layers for g in groups), groups[0].head_dim, layout.attention_heads
    sides_time = {}
    flops_per_step = []
    for side, runs in (("baseline", sides.baseline), ("candidate", sides.candidate)):
        calls = total = flops = 0
        for run in runs:
            for name, time_ns in _prefill_step_times(run).iter_rows():
                match = _STEP.fullmatch(name)
                requests, tokens = int(match.group(1)), match.group(2)
                if not tokens.isdigit() or int(tokens) != requests * prompt:
                    return not_derivable(f"step {name} is not {requests} whole prompt(s) of {prompt:,} tokens "
                                         "(chunked prefill or other prompt lengths)")
                calls += 1
                total += time_ns
                flops += layers * attention_flops(requests, q_heads, prompt, prompt, head_dim, causal=True)
        sides_time[side] = (calls or None, total or None)
        flops_per_step.append(flops / calls if calls else None)
    if not all(flops_per_step) or abs(flops_per_step[0] - flops_per_step[1]) > 1e-9 * flops_per_step[0]:
        return not_derivable("the arms ran different prefill steps")
    derivation = (f"causal, per prefill step: N requests × q_heads {q_heads} × q_len = kv_len {prompt:,} × head_dim "
                  f"{head_dim} × {layers} layers (model config, vLLM step names); mean over the steps")
    return _row(align.PREFILL, prompt, flops_per_step[0], derivation, sides_time, ceiling)


def _prefill_step_times(run: Run) -> pl.DataFrame:
    """Per prefill step (its name): the GPU time of its prefill-attention kernels inside the run's window, from
    the signatures the comparison classified."""
    calls = run.trace.calls
    signatures = run.classes.filter(pl.col("segment") == "prefill_attention")["sig"]
    cells = np.flatnonzero(calls.cells["sig"].is_in(signatures.implode()).to_numpy())
    rows = [np.arange(calls.offsets[cell], calls.offsets[cell + 1]) for cell in cells.tolist()]
    if run.keep is not None:
        rows = [span[run.keep[span]] for span in rows]
    rows = np.concatenate(rows + [np.zeros(0, dtype=np.int64)])
    prefill = pl.DataFrame({"range": calls.range[rows], "duration": calls.duration[rows].astype(np.int64)})
    steps = align.steps(run.trace).filter(pl.col("phase") == align.PREFILL).select("range", "step_range", "step")
    return (prefill.join(steps, on="range").group_by("step_range", "step").agg(pl.col("duration").sum())
            .sort("step_range").select("step", "duration"))
