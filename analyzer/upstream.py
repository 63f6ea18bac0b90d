"""`kvtrace report --upstream flashinfer|vllm`: a finding of a report with what its upstream project's bug template
asks for (analyzer/render/upstream.py words it): the environment, the evidence with its intervals, a standalone
repro script, and the counterfactual arm's numbers where one was recorded.

The finding drafted so far: NVFP4's host synchronization per layer in vLLM's eager steps. FlashInfer's
`nvfp4_quantize_append_paged_kv_cache_with_slot_mapping` checks CUDA-tensor scales on the host on every call
(`_as_float32_scalar_tensors` in `flashinfer/page.py`: one device-to-host copy into pageable memory, which waits for
the stream), and vLLM 0.33 passes each layer's scale tensors. A report shows it as the candidate's 8-byte
device-to-host copies just before the NVFP4 append kernel in its eager steps (analyzer.steps' `held_by`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtrace.analyzer import repro as repro_lib
from kvtrace.analyzer.report import Report
from kvtrace.analyzer.runs import bare_name
from kvtrace.analyzer.steps import StepPhase
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.errors import KvtraceError
from kvtrace.kv_formats import patched_arm_label
from kvtrace.manifest import read_manifest

PROJECTS = ("flashinfer", "vllm")
APPEND_KERNEL = "NVFP4QuantizeAppendPagedKVCacheWithSlotMapping"  # the kernel launched right after the copy
# The counterfactual arm: NVFP4 with FlashInfer's check run once per scale tensor (capture/patches/validate-once.py,
# recorded with `--arms fp8,nvfp4,nvfp4:validate-once`).
COUNTERFACTUAL_ARM = patched_arm_label("nvfp4", "validate-once")
NOT_MEASURED = "not measured"
# What the sources say about the check (read in the FlashInfer sources: v0.6.15 onwards in its repository, the
# 0.7.2.post1 that vLLM 0.33 ships) and what others measured: facts the draft states with their source.
HISTORY = (
    "The check came with flashinfer-ai/flashinfer#3740 (first in v0.6.15): a zero, negative or NaN scale on the "
    "device would silently write an all-zero cache. A fix must keep that safety: validate once per scale tensor "
    "(re-checked when the tensor changes), or check on the device.",
    "`_as_float32_scalar_tensors` is the same in v0.6.16.post3 and in 0.7.2.post1 (the release vLLM 0.33 ships): both "
    "stack the CUDA scales and copy them to the host on every call made outside CUDA graph capture.",
    "Python floats are no cure as the function stands: it turns a float into `torch.tensor([scale], device=...)`, "
    "torch's blocking host-to-device copy, which also waits for the stream (the repro times it as "
    "`nvfp4 host scales`).",
    "A third-party fork on SM120 reported −1.3 ms per step (−5.6%) from caching the check; not reproduced here.",
)


@dataclass(frozen=True)
class StepCopies:
    """One eager step kind of the report's paired steps: the candidate's host copies and what they cost."""

    phase: str
    steps: int
    copies_low: int  # the fewest and most copies in one step
    copies_high: int
    bytes_low: int | None
    bytes_high: int | None
    host_mean_ms: float  # the host's time in one copy, mean over the steps' copies
    host_per_step_ms: float
    before: str | None
    span_ratio: float  # the step's first-kernel-to-last-kernel span, candidate / baseline, with its interval
    span_low: float | None
    span_high: float | None
    idle_ms: tuple[float, float]  # per step, baseline and candidate: time inside the span with no kernel running


@dataclass(frozen=True)
class Ttft:
    point: str
    ratio: float
    low: float | None
    high: float | None
    verdict: Verdict
    runs: int
    window_stall: str | None = None  # why its timings include a profile window's close (serving.window_stalls)


@dataclass
class Counterfactual:
    """The arm with the check once per tensor, against stock NVFP4 and against FP8; `state` says whether it ran."""

    state: str  # "measured" or NOT_MEASURED
    arm: str = COUNTERFACTUAL_ARM
    patch: dict = field(default_factory=dict)  # name, sha256, as its manifest records them
    run: str | None = None
    against_nvfp4: list[Ttft] = field(default_factory=list)
    against_fp8: list[Ttft] = field(default_factory=list)
    copies_per_step: dict = field(default_factory=dict)  # phase: (stock NVFP4's, the patched arm's) waits per step


@dataclass
class HostSyncFinding:
    project: str
    run: str
    baseline: str  # the arms' labels
    candidate: str
    environment: list[tuple[str, str]]
    environment_source: str
    steps: list[StepCopies]
    ttft: list[Ttft]
    counterfactual: Counterfactual
    kernel_level: list[repro_lib.ReproSplit]  # the run directory's repro results with their append routes
    script: str | None  # the standalone repro of the traced appends
    script_note: str | None  # why there is none

    @property
    def worst_step(self) -> StepCopies:
        """The step kind whose copies hold the host longest per step: the one the draft's answer names."""
        return max(self.steps, key=lambda s: s.host_per_step_ms)


def host_sync(report: Report, project: str, build_report, script_of) -> HostSyncFinding:
    """The finding from a report whose candidate made the NVFP4 append's host copies. `build_report(paths, arms)`
    builds another report as this one was built (for the counterfactual arm); `script_of(spec)` renders a repro."""
    if project not in PROJECTS:
        raise KvtraceError(f"--upstream takes {' or '.join(PROJECTS)}, not {project!r}")
    if COUNTERFACTUAL_ARM in (report.baseline.arm, report.candidate.arm):
        raise KvtraceError(f"--upstream drafts from the stock arms (fp8, nvfp4); arm {COUNTERFACTUAL_ARM} is the "
                           "counterfactual, found beside them: pass the stock arms' run directory")
    steps = [copies for row in report.step_timeline if (copies := _copies(row)) is not None]
    if not steps:
        raise KvtraceError(f"no finding to draft: the candidate's eager steps in this report make no device-to-host "
                           f"copy before {APPEND_KERNEL} (the NVFP4 host sync); --upstream drafts it from a vLLM run "
                           "directory whose NVFP4 arm was traced with copies (kvtrace capture vllm)")
    run = Path(report.candidate.run)
    script = note = None
    try:
        script = script_of(repro_lib.append_spec(run, report.candidate.arm))
    except KvtraceError as error:
        note = str(error)
    return HostSyncFinding(
        project=project, run=run.name, baseline=report.baseline.label, candidate=report.candidate.label,
        environment=_environment(report), environment_source=_environment_source(report), steps=steps,
        ttft=_ttft(report), counterfactual=_counterfactual(report, build_report),
        kernel_level=[split for split in report.repro if split.appends], script=script, script_note=note)


def _copies(row: StepPhase) -> StepCopies | None:
    waits = [w for w in row.held_by if w.copy_kind == "device-to-host" and w.after and APPEND_KERNEL in w.after]
    if not waits:
        return None
    wait = waits[0]
    return StepCopies(row.phase, wait.steps, wait.per_step_low, wait.per_step_high, wait.bytes_low, wait.bytes_high,
                      wait.candidate_mean_ns / 1e6, wait.candidate_ns / 1e6 / max(wait.steps, 1), wait.before,
                      row.span_ratio, row.span_low, row.span_high,
                      (row.baseline_idle_ns / 1e6, row.candidate_idle_ns / 1e6))


def _ttft(report: Report) -> list[Ttft]:
    rows = []
    for row in report.serving:
        estimate = row.estimates.get("ttft_ms")
        if estimate is not None:
            rows.append(Ttft(row.point, estimate.ratio, estimate.low, estimate.high, estimate.verdict, estimate.runs,
                             next(iter(row.window_stalls), None)))
    return rows


def _environment(report: Report) -> list[tuple[str, str]]:
    """What collect_env would name, from the repro results when the run directory holds them (measured on the
    machine that ran the script), else from the capture's manifest."""
    manifest = read_manifest(Path(report.candidate.run))
    env = manifest.raw.get("environment") or {}
    packages = env.get("packages") or {}
    gpu = (env.get("gpus") or [{}])[0]
    gpu = gpu if isinstance(gpu, dict) else {}
    fields = [("flashinfer", packages.get("flashinfer-python") or report.candidate.versions.get("flashinfer")),
              ("vllm", packages.get("vllm") or report.candidate.versions.get("vllm")),
              ("torch", packages.get("torch") or report.candidate.versions.get("torch")),
              ("CUDA runtime", env.get("cuda_runtime") or report.candidate.versions.get("cuda_runtime")),
              ("GPU", gpu.get("name")), ("compute capability", gpu.get("compute_cap")),
              ("driver", gpu.get("driver_version") or report.diff.candidate.info.driver_version),
              ("python", env.get("python")), ("platform", env.get("platform"))]
    return [(name, str(value)) for name, value in fields if value]


def _environment_source(report: Report) -> str:
    return (f"the capture's manifest of {Path(report.candidate.run).name} (kvtrace recorded these on the GPU machine; "
            "python -m flashinfer.collect_env was not run there)")


def _counterfactual(report: Report, build_report) -> Counterfactual:
    """The counterfactual arm where the report's runs hold it, or, for a scenario of a `kvtrace capture vllm-matrix`
    root, in the root's counterfactual/SCENARIO beside the same rounds' stock NVFP4 runs."""
    baseline_run = Path(report.baseline.run)
    for run in _counterfactual_places(report):
        manifest = read_manifest(run)
        if COUNTERFACTUAL_ARM not in manifest.runs_by_arm:
            continue
        patch = manifest.runs[manifest.runs_by_arm[COUNTERFACTUAL_ARM][0]].patch or {}
        if not patch.get("sha256"):
            raise KvtraceError(f"{run}: arm {COUNTERFACTUAL_ARM} records no patch name and SHA-256 in its manifest: a "
                               "patched arm must say which patch it ran; capture it again")
        stock = build_report([run], (report.candidate.arm, COUNTERFACTUAL_ARM))
        against_fp8 = (build_report([run], (report.baseline.arm, COUNTERFACTUAL_ARM))
                       if report.baseline.arm in manifest.runs_by_arm else
                       build_report([baseline_run, run], (report.baseline.arm, COUNTERFACTUAL_ARM)))
        return Counterfactual("measured", patch={"name": str(patch.get("name")), "sha256": str(patch["sha256"])},
                              run=run.name, against_nvfp4=_ttft(stock), against_fp8=_ttft(against_fp8),
                              copies_per_step={row.phase: (row.baseline_host_waits, row.candidate_host_waits)
                                               for row in stock.step_timeline})
    return Counterfactual(NOT_MEASURED)


def _counterfactual_places(report: Report) -> list[Path]:
    runs = sorted({Path(report.baseline.run), Path(report.candidate.run)})
    places = list(runs)
    for run in runs:
        matrix = read_manifest(run).settings.get("matrix")
        # Only the layout `kvtrace capture vllm-matrix` writes: a scenario one level below its root, by a bare name.
        if isinstance(matrix, dict) and matrix.get("root") == ".." and isinstance(matrix.get("run_dir"), str) \
                and bare_name(matrix["run_dir"]):
            place = run.parent / "counterfactual" / matrix["run_dir"]
            if (place / "manifest.json").is_file():
                places.append(place)
    return places
