"""FlashInfer engine: kernel-level FP8 vs NVFP4 A/B over identical cached tokens, one nsys trace per run
(one run per arm, or per arm and repeat with --repeats)."""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import kvtrace.nsys
from kvtrace.capture import flashinfer_quality, runner
from kvtrace.errors import KvtraceError
from kvtrace.manifest import MANIFEST, run_order

ENGINE = "flashinfer"
ARMS = ("fp8", "nvfp4")


@dataclass(frozen=True)
class FlashInferSpec:
    contexts: tuple[int, ...] = (2048, 8192, 32768)
    batch: int = 8
    q_heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    prefill_calls: int = 8
    decode_calls: int = 64
    append_calls: int = 64
    gemm_calls: int = 16
    gemm_size: int = 4096
    seed: int = 0
    inputs: str = "gaussian"  # or "outliers", or a .safetensors file of q, k, v (flashinfer_quality)

    def validate(self) -> None:
        if not self.contexts or min(self.contexts) < 1:
            raise KvtraceError("--context needs positive token counts, e.g. --context 2048,8192")
        # Positivity first: --kv-heads 0 would otherwise reach the modulo below (ZeroDivisionError).
        for name in ("batch", "q_heads", "kv_heads", "head_dim", "page_size", "prefill_calls", "decode_calls",
                     "append_calls", "gemm_calls"):
            if getattr(self, name) < 1:
                raise KvtraceError(f"--{name.replace('_', '-')} must be at least 1")
        if self.head_dim % 16:
            raise KvtraceError(f"--head-dim {self.head_dim} is not a multiple of 16, which NVFP4 blocks need")
        if self.q_heads % self.kv_heads:
            raise KvtraceError(f"--q-heads {self.q_heads} is not a multiple of --kv-heads {self.kv_heads}")
        if self.inputs not in flashinfer_quality.GENERATED:
            flashinfer_quality.check_tensor_file(Path(self.inputs), self.q_heads, self.kv_heads, self.head_dim,
                                                 max(self.contexts))

    def workload_args(self) -> list[str]:
        return ["--contexts", ",".join(map(str, self.contexts)), "--batch", str(self.batch),
                "--q-heads", str(self.q_heads), "--kv-heads", str(self.kv_heads), "--head-dim", str(self.head_dim),
                "--page-size", str(self.page_size), "--prefill-calls", str(self.prefill_calls),
                "--decode-calls", str(self.decode_calls), "--append-calls", str(self.append_calls),
                "--gemm-calls", str(self.gemm_calls), "--gemm-size", str(self.gemm_size), "--seed", str(self.seed),
                "--inputs", self.inputs if self.inputs in flashinfer_quality.GENERATED else str(Path(self.inputs).resolve())]


def preflight(arms: tuple[str, ...]) -> None:
    """Fail before any profiling when the box cannot run the requested arms."""
    try:
        import torch
    except ImportError:
        raise KvtraceError("torch is not installed: pip install 'kvtrace[flashinfer]' on the GPU machine") from None
    if not torch.cuda.is_available():
        raise KvtraceError("no CUDA GPU visible to torch: run the FlashInfer capture on a GPU machine (SM80+)")
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if major < 8:
        raise KvtraceError(f"{name} is SM{major}{minor}; FlashInfer's FA2 paged attention needs SM80 or newer")
    try:
        import flashinfer
    except ImportError:
        raise KvtraceError("FlashInfer is not installed: pip install flashinfer-python (0.6.10 or newer)") from None
    if "nvfp4" in arms:
        # NVFP4 KV in FA2 prefill arrived with flashinfer PR #3097 (the kv_cache_sf argument).
        run_parameters = inspect.signature(flashinfer.BatchPrefillWithPagedKVCacheWrapper.run).parameters
        if "kv_cache_sf" not in run_parameters or not hasattr(flashinfer.page, "nvfp4_quantize_append_paged_kv_cache"):
            raise KvtraceError(f"FlashInfer {flashinfer.__version__} has no NVFP4 KV cache path for FA2 on {name}: "
                               "install flashinfer-python 0.6.15 or newer, or drop nvfp4 from --arms")


def capture(out: Path, spec: FlashInferSpec, *, arms: tuple[str, ...] = ARMS, repeats: int = 1,
            force: bool = False, nsys: str | None = None) -> dict:
    spec.validate()
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise KvtraceError(f"unknown arm(s) {', '.join(sorted(unknown))}: choose from {', '.join(ARMS)}")
    if not arms or len(set(arms)) != len(arms):
        raise KvtraceError(f"--arms needs one or more distinct arms from {', '.join(ARMS)}, got {','.join(arms)!r}")
    runs = run_order(arms, repeats)
    nsys_path = kvtrace.nsys.find_nsys(nsys)
    preflight(arms)
    runner.prepare_run_dir(out, force)
    environment = runner.host_environment(nsys_path)
    settings = {"spec": asdict(spec), "arms": list(arms), "repeats": repeats, "order": [run.name for run in runs]}
    results: list[runner.ArmResult] = []
    for run in runs:
        result_file = out / f"{run.name}.workload.json"
        workload = [sys.executable, "-m", "kvtrace.capture.flashinfer_workload", "--kv-format", run.arm,
                    *spec.workload_args(), "--result", str(result_file)]
        results.append(runner.run_arm(run.name, out, nsys_path, workload, env=dict(os.environ),
                                      workload_result=result_file, arm_name=run.arm, repeat=run.repeat))
        # Written after each arm so that an interrupted run still says what finished.
        runner.write_json_atomic(out / MANIFEST, runner.manifest(ENGINE, environment, settings, results))
    return runner.manifest(ENGINE, environment, settings, results)
