"""vLLM engine: matched KV-cache-dtype arms of a real vLLM under Nsight Systems, one traffic scenario per run.

Both arms get one engine flag list and differ only in --kv-cache-dtype. The attention backend is pinned to
FLASHINFER (the only vLLM backend that stores nvfp4) and vLLM's CUDA profiler opens and closes the nsys
capture range, so start-up and warm-up stay out of the trace.

- serve (the Blackwell workflow): `vllm serve` under nsys and `vllm bench serve` as the client. /metrics is
  scraped before and after the measured traffic and polled during it for peaks; /start_profile and
  /stop_profile bracket it. The server runs in its own session and is always shut down, SIGINT first so
  that nsys writes its report, also on errors, Ctrl-C and SIGTERM; its log is kept.
- offline: vLLM's LLM class in kvtrace.capture.vllm_offline_workload under nsys, token-id prompts, no
  tokenizer and no server (what the project's H200 runs).

vLLM is run, never imported, here: standard library, plus prometheus_client when metrics are parsed.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvtrace import model_config
from kvtrace.capture import formats, runner
from kvtrace.capture.vllm_common import (Point, add_sample, capacity_reason, empty_snapshot, metric_deltas,
                                         parse_kv_cache_log, request_order_sha256, update_peaks)
from kvtrace.errors import KvtraceError

ENGINE = "vllm"
SCENARIOS = ("cold-prefill", "decode-heavy", "prefix-reuse", "sweep")
MODES = ("serve", "offline")
LOAD_FORMATS = ("auto", "dummy")
KV_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_4over6")
ATTENTION_BACKEND = "FLASHINFER"
PROFILER_CONFIG = '{"profiler": "cuda"}'
# vLLM's engine core and workers are child processes of the traced command.
NSYS_EXTRA = ("--trace-fork-before-exec=true",)
VLLM_CLI = ("-m", "vllm.entrypoints.cli.main")
WORKER = ("-m", "kvtrace.capture.vllm_offline_workload")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
POLL_INTERVAL_S = 0.5  # /metrics polling during the measured traffic, for the gauges' peaks

DEFAULTS = {
    "cold-prefill": {"input_len": 2048, "output_len": 1, "num_prompts": 64, "concurrency": 16},
    "decode-heavy": {"input_len": 512, "output_len": 256, "num_prompts": 64, "concurrency": 32},
    "prefix-reuse": {"input_len": 256, "output_len": 64, "num_prompts": 128, "concurrency": 32,
                     "prefix_len": 1024, "num_prefixes": 8},
    "sweep": {"output_len": 64, "contexts": (1024, 4096, 16384), "concurrencies": (8, 32, 128)},
}
PREFIX_CACHING = {"cold-prefill": False, "decode-heavy": False, "prefix-reuse": True, "sweep": False}
# Workload options that only some scenarios take.
_ONLY_FOR = {"contexts": ("sweep",), "concurrencies": ("sweep",), "prefix_len": ("prefix-reuse",),
             "num_prefixes": ("prefix-reuse",), "trace_file": ("prefix-reuse",),
             "input_len": ("cold-prefill", "decode-heavy", "prefix-reuse"),
             "concurrency": ("cold-prefill", "decode-heavy", "prefix-reuse")}

# vLLM flags that kvtrace sets itself, so that `-- extra args` cannot break the match between arms.
_OWNED_FLAGS = {
    "--model": "use --model",
    "--kv-cache-dtype": "each arm sets it: use --arms",
    "--attention-backend": f"kvtrace pins {ATTENTION_BACKEND}, the only backend that stores nvfp4",
    "--attention-config.backend": f"kvtrace pins {ATTENTION_BACKEND}, the only backend that stores nvfp4",
    "--profiler-config": "kvtrace sets the CUDA profiler that opens the nsys capture range",
    "--enable-prefix-caching": "the scenario sets prefix caching",
    "--no-enable-prefix-caching": "the scenario sets prefix caching",
    "--load-format": "use kvtrace's --load-format",
    "--seed": "use kvtrace's --seed",
    "--host": "use kvtrace's --host",
    "--port": "use kvtrace's --port",
    "--skip-tokenizer-init": "--mode offline sets it",
}
_OWNED_OFFLINE = {"--max-num-seqs": "--mode offline sets it from --concurrency"}
# Inherited environment worth recording; names that look like credentials are never written.
_ENV_PREFIXES = ("VLLM_", "FLASHINFER_", "CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "TRITON_", "HF_", "NVIDIA_")
_ENV_NAMES = ("PYTHONHASHSEED", "PYTHONPATH", "MAX_JOBS", "LD_LIBRARY_PATH")
_SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")


@dataclass(frozen=True)
class Workload:
    scenario: str
    input_len: int = 0
    output_len: int = 0
    num_prompts: int = 0
    concurrency: int = 0
    prefix_len: int = 0
    num_prefixes: int = 0
    contexts: tuple[int, ...] = ()
    concurrencies: tuple[int, ...] = ()
    trace_file: str | None = None
    seed: int = 0

    @classmethod
    def for_scenario(cls, scenario: str, **options) -> "Workload":
        """The scenario's defaults with the options that were given (None = not given)."""
        if scenario not in SCENARIOS:
            raise KvtraceError(f"unknown scenario {scenario!r}: choose from {', '.join(SCENARIOS)}")
        given = {name: value for name, value in options.items() if value is not None}
        for name in given:
            if name in _ONLY_FOR and scenario not in _ONLY_FOR[name]:
                raise KvtraceError(f"--{name.replace('_', '-')} does not apply to --scenario {scenario} "
                                   f"(only to {', '.join(_ONLY_FOR[name])}): drop it")
        values = {**DEFAULTS[scenario], **given}
        for name in ("contexts", "concurrencies"):
            if name in values:
                values[name] = tuple(sorted(set(values[name])))  # the sweep steps up
        return cls(scenario=scenario, **values)

    def validate(self, mode: str) -> None:
        sizes = {"output_len": self.output_len}
        if self.scenario == "sweep":
            if not self.contexts or not self.concurrencies:
                raise KvtraceError("--scenario sweep needs --contexts and --concurrencies, e.g. 1024,4096 and 8,32")
            sizes.update(contexts=min(self.contexts), concurrencies=min(self.concurrencies))
            if self.num_prompts and mode == "offline":
                raise KvtraceError("--num-prompts does not apply to an offline sweep, whose points each submit "
                                   "their concurrency's worth of prompts at once: drop it")
            if self.num_prompts:
                sizes["num_prompts"] = self.num_prompts
        else:
            sizes.update(input_len=self.input_len, num_prompts=self.num_prompts, concurrency=self.concurrency)
        if self.scenario == "prefix-reuse" and not self.trace_file:
            sizes.update(prefix_len=self.prefix_len, num_prefixes=self.num_prefixes)
        for name, value in sizes.items():
            if value < 1:
                raise KvtraceError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.trace_file:
            if mode != "serve":
                raise KvtraceError("--trace-file needs --mode serve: offline prompts are token ids drawn from --seed")
            if not Path(self.trace_file).is_file():
                raise KvtraceError(f"trace file {self.trace_file} does not exist: check --trace-file")

    def points(self, mode: str) -> list[Point]:
        if self.scenario != "sweep":
            return [Point(self.input_len, self.output_len, self.num_prompts, self.concurrency,
                          self.prefix_len, self.num_prefixes)]
        # Offline submits a point's prompts at once, so there a point's concurrency is its prompt count.
        return [Point(context, self.output_len,
                      concurrency if mode == "offline" else (self.num_prompts or 2 * concurrency), concurrency)
                for context in self.contexts for concurrency in self.concurrencies]


@dataclass(frozen=True)
class VllmCapture:
    model: str
    workload: Workload
    arms: tuple[str, ...] = ("fp8", "nvfp4")
    mode: str = "serve"
    load_format: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    extra_args: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.mode not in MODES:
            raise KvtraceError(f"unknown mode {self.mode!r}: choose serve or offline")
        if self.load_format not in LOAD_FORMATS:
            raise KvtraceError(f"unknown --load-format {self.load_format!r}: choose auto or dummy")
        if not self.arms:
            raise KvtraceError("--arms is empty: name the KV-cache dtypes to compare, e.g. fp8,nvfp4")
        unknown = [arm for arm in self.arms if arm not in KV_DTYPES]
        if unknown:
            raise KvtraceError(f"unknown arm(s) {', '.join(unknown)}: arms are vLLM --kv-cache-dtype values, "
                               f"choose from {', '.join(KV_DTYPES)}")
        if len(set(self.arms)) != len(self.arms):
            raise KvtraceError(f"--arms {','.join(self.arms)} names an arm twice: list each KV dtype once")
        if not 0 < self.port < 65536:
            raise KvtraceError(f"--port {self.port} is not a TCP port: choose one in 1-65535")
        owned = {**_OWNED_FLAGS, **(_OWNED_OFFLINE if self.mode == "offline" else {})}
        for arg in self.extra_args:
            for flag, reason in owned.items():
                if arg == flag or arg.startswith((flag + "=", flag + ".")):
                    raise KvtraceError(f"extra vLLM argument {arg} is set by kvtrace ({reason}): drop it")
        self.workload.validate(self.mode)

    def is_local_model(self) -> bool:
        return Path(self.model).expanduser().exists() or self.model.startswith(("/", "./", "../", "~"))

    def run_order(self) -> tuple[str, ...]:
        """Arms in the order they run. The sweep's first arm decides its grid, so an fp8 arm goes first."""
        if self.workload.scenario != "sweep":
            return self.arms
        return tuple(sorted(self.arms, key=lambda arm: not arm.startswith("fp8")))


# Command lines -----------------------------------------------------------------------------------------

def engine_flags(cfg: VllmCapture, kv_dtype: str) -> list[str]:
    """vLLM engine flags of one arm; arms differ only in the first pair."""
    workload = cfg.workload
    flags = ["--kv-cache-dtype", kv_dtype, "--attention-backend", ATTENTION_BACKEND,
             "--profiler-config", PROFILER_CONFIG, "--seed", str(workload.seed),
             "--enable-prefix-caching" if PREFIX_CACHING[workload.scenario] else "--no-enable-prefix-caching"]
    if cfg.load_format == "dummy":
        flags += ["--load-format", "dummy"]
    if cfg.mode == "offline":
        max_seqs = max(point.concurrency for point in workload.points(cfg.mode))
        flags += ["--skip-tokenizer-init", "--max-num-seqs", str(max_seqs)]
    return flags + list(cfg.extra_args)


def child_env(cfg: VllmCapture) -> dict[str, str]:
    """Environment kvtrace sets for every child (server, client, worker), on top of its own."""
    env = {
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # Nsight Systems cannot follow fork() without exec()
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONHASHSEED": "0",  # the bench client's timed_trace prompts hash strings
        "PYTHONSAFEPATH": "1",  # `python -m` must not import a source checkout from the working directory
    }
    if cfg.is_local_model():
        env["HF_HUB_OFFLINE"] = "1"
    if cfg.mode == "serve" and PREFIX_CACHING[cfg.workload.scenario]:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # mounts POST /reset_prefix_cache, used after the warm-up
    if cfg.mode == "offline":
        # With the engine core in its own process, requests reach it while it already steps, so the two
        # arms batched 32 prompts differently on the H200 (3+13+… vs 15+1+… requests per step). In-process,
        # generate() queues every request before the first step and both arms schedule the same batches.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def server_command(cfg: VllmCapture, arm: str, out: Path, nsys: str, python: str) -> list[str]:
    serve = [python, *VLLM_CLI, "serve", cfg.model, "--host", cfg.host, "--port", str(cfg.port),
             *engine_flags(cfg, arm)]
    return runner.profile_command(nsys, out / arm, serve, extra=NSYS_EXTRA)


def request_args(workload: Workload, point: Point, seed: int) -> list[str]:
    """The bench client's arguments that decide which requests it sends and in what order."""
    if workload.trace_file:
        data = ["--dataset-name", "timed_trace", "--dataset-path", workload.trace_file]
    elif point.prefix_len:
        data = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(point.prefix_len),
                "--prefix-repetition-suffix-len", str(point.input_len),
                "--prefix-repetition-num-prefixes", str(point.num_prefixes),
                "--prefix-repetition-output-len", str(point.output_len), "--ignore-eos"]
    else:
        data = ["--dataset-name", "random", "--random-input-len", str(point.input_len),
                "--random-output-len", str(point.output_len), "--random-range-ratio", "0.0", "--ignore-eos"]
    return data + ["--num-prompts", str(point.num_prompts), "--max-concurrency", str(point.concurrency),
                   "--seed", str(seed)]


def _request_identity(workload: Workload, point: Point) -> list[str]:
    """What the serve-mode request-order hash covers: the client draws its prompts from these."""
    identity = request_args(workload, point, workload.seed)
    if workload.trace_file:
        identity.append(hashlib.sha256(Path(workload.trace_file).read_bytes()).hexdigest())
    return identity


def bench_command(cfg: VllmCapture, python: str, point: Point, *, seed: int, result: Path | None) -> list[str]:
    # No client warm-ups or ready check: both send the first prompt, which would pre-warm the prefix cache.
    command = [python, *VLLM_CLI, "bench", "serve", "--backend", "vllm", "--model", cfg.model,
               "--host", cfg.host, "--port", str(cfg.port), *request_args(cfg.workload, point, seed),
               "--request-rate", "inf", "--num-warmups", "0", "--ready-check-timeout-sec", "0",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm"]
    if result is not None:
        command += ["--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    return command


def warmup_point(point: Point) -> Point:
    return Point(point.input_len, point.output_len, min(point.num_prompts, point.concurrency), point.concurrency,
                 point.prefix_len, point.num_prefixes)


def worker_command(cfg: VllmCapture, arm: str, out: Path, nsys: str, python: str, points: list[Point],
                   stop_at_capacity: bool) -> list[str]:
    work = [python, *WORKER, "--scenario", cfg.workload.scenario, "--seed", str(cfg.workload.seed)]
    for point in points:
        work += ["--point", point.spec()]
    if stop_at_capacity:
        work.append("--stop-at-capacity")
    work += ["--result", str(out / f"{arm}.workload.json"), "--", "--model", cfg.model, *engine_flags(cfg, arm)]
    return runner.profile_command(nsys, out / arm, work, extra=NSYS_EXTRA)


def export_command(nsys: str, out: Path, arm: str) -> list[str]:
    return [nsys, "export", "--type=sqlite", "--force-overwrite=true", f"--output={out / arm}.sqlite",
            f"{out / arm}.nsys-rep"]


def dry_run(cfg: VllmCapture, out: Path, *, nsys: str | None = None, python: str | None = None) -> str:
    """The exact commands of every arm, without a GPU, vLLM or nsys (then `nsys` stands for it)."""
    cfg.validate()
    try:
        nsys = runner.find_nsys(nsys)
    except KvtraceError:
        nsys = nsys or "nsys"
    python = python or sys.executable
    env = " ".join(f"{name}={shlex.quote(value)}" for name, value in child_env(cfg).items())
    workload, order = cfg.workload, cfg.run_order()
    base = _base_url(cfg)
    lines = [f"# kvtrace capture vllm: scenario {workload.scenario}, mode {cfg.mode}, arms {', '.join(order)} "
             "(dry run: nothing is started)"]
    if workload.scenario == "sweep":
        lines.append(f"# sweep: arm {order[0]} steps up concurrency per context length and stops a length at "
                     "its first capacity-bound point (preemptions, or KV cache >= 95% full); the other arms "
                     "run exactly the points it ran")
    for arm in order:
        lines.append(f"# arm {arm}")
        if cfg.mode == "offline":
            points = workload.points(cfg.mode)
            stop = workload.scenario == "sweep" and arm == order[0]
            lines.append(f"{env} {shlex.join(worker_command(cfg, arm, out, nsys, python, points, stop))}")
        else:
            lines.append(f"{env} {shlex.join(server_command(cfg, arm, out, nsys, python))}")
            points = workload.points(cfg.mode)
            lines.append(f"# wait for GET {base}/health 200, then warm up (outside the capture range):")
            warm = bench_command(cfg, python, warmup_point(points[0]), seed=workload.seed + 1, result=None)
            lines.append(f"{env} {shlex.join(warm)}")
            if PREFIX_CACHING[workload.scenario]:
                lines.append(f"# POST {base}/reset_prefix_cache")
            lines.append(f"# POST {base}/start_profile")
            for index, point in enumerate(points):
                result = out / f"{arm}{_tag(workload, index)}.bench.json"
                lines.append(f"# GET {base}/metrics before, every {POLL_INTERVAL_S:g} s during, and after:")
                bench = bench_command(cfg, python, point, seed=workload.seed, result=result)
                lines.append(f"{env} {shlex.join(bench)}")
            lines.append(f"# POST {base}/stop_profile, then SIGINT the server so that nsys writes its report")
        lines.append(shlex.join(export_command(nsys, out, arm)))
    return "\n".join(lines) + "\n"


def _tag(workload: Workload, index: int) -> str:
    return f".p{index}" if workload.scenario == "sweep" else ""


def _base_url(cfg: VllmCapture) -> str:
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    return f"http://{host}:{cfg.port}"


# Preflight ---------------------------------------------------------------------------------------------

_PROBE = r"""
import json, sys
from importlib import metadata, util
info = {}
for dist in ("vllm", "torch", "flashinfer-python", "prometheus-client"):
    try:
        info[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        info[dist] = None
if info["vllm"] is None and util.find_spec("vllm") is not None:
    info["vllm"] = "unknown (no package metadata)"
try:
    import torch
    info["cuda_runtime"] = torch.version.cuda
    info["gpu_count"] = torch.cuda.device_count()
    if info["gpu_count"]:
        info["gpu_name"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
except Exception as error:
    info["torch_error"] = f"{type(error).__name__}: {error}"
if "nvfp4" in sys.argv[1:] and info["vllm"] and info.get("gpu_count"):
    try:
        from vllm.v1.attention.backends.flashinfer import FlashInferBackend
        info["vllm_nvfp4_kv"] = bool(FlashInferBackend.supports_kv_cache_dtype("nvfp4"))
    except Exception as error:
        info["vllm_nvfp4_kv_error"] = f"{type(error).__name__}: {error}"
print("KVTRACE_PROBE " + json.dumps(info))
"""


def probe_environment(python: str, nvfp4: bool) -> dict:
    """Versions, GPU and (when asked) whether the installed vLLM stores nvfp4 KV on this GPU, from a child
    Python so that kvtrace itself never imports torch or vLLM."""
    command = [python, "-c", _PROBE, *(["nvfp4"] if nvfp4 else [])]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False,
                                env={**os.environ, "PYTHONSAFEPATH": "1"})
    except (OSError, subprocess.TimeoutExpired) as error:
        raise KvtraceError(f"{python} could not run the environment probe ({error}): check the Python "
                           "that has vLLM installed") from None
    for line in result.stdout.splitlines():
        if line.startswith("KVTRACE_PROBE "):
            return json.loads(line.removeprefix("KVTRACE_PROBE "))
    detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
    raise KvtraceError(f"{python} could not run the environment probe ({detail}): check that Python "
                       "imports torch and vLLM")


def check_probe(probe: dict, arms: tuple[str, ...]) -> None:
    if not probe.get("vllm"):
        raise KvtraceError("vLLM is not installed for this Python: pip install 'kvtrace[vllm]' (vLLM 0.26 or "
                           "newer) where kvtrace runs, or use --dry-run to print the commands")
    if not probe.get("gpu_count"):
        detail = f" ({probe['torch_error']})" if probe.get("torch_error") else ""
        raise KvtraceError(f"no CUDA GPU visible to torch{detail}: run the vLLM capture on a GPU machine, "
                           "or use --dry-run to print the commands")
    if any(arm.startswith("nvfp4") for arm in arms):
        check_nvfp4(probe)


def check_nvfp4(probe: dict) -> None:
    """Upstream vLLM stores nvfp4 KV only where its FlashInfer backend says so (SM100 trtllm-gen; SM120
    through open PRs). The installed vLLM's own answer decides; without one, only SM10x passes."""
    verdict = probe.get("vllm_nvfp4_kv")
    major, minor = probe["capability"]
    if verdict is True or (verdict is None and major == 10):
        return
    gpu, version = f"{probe['gpu_name']} (SM{major}{minor})", probe["vllm"]
    here = "--arms auto,fp8 here"
    if major == 12:
        problem = f"vLLM {version} does not store an nvfp4 KV cache on {gpu} (SM120 support is in open upstream PRs)"
        fix = f"install a vLLM whose FlashInfer backend accepts nvfp4 on SM120, run on an SM100 GPU, or capture {here}"
    elif major == 10:
        problem = (f"vLLM {version} reports no nvfp4 KV support on {gpu}: its FlashInfer trtllm-gen attention is "
                   "unavailable")
        fix = ("check the FlashInfer install and that --attention-config.use_trtllm_attention is not false, "
               f"or capture {here}")
    else:
        problem = f"vLLM {version} stores an nvfp4 KV cache only on Blackwell and rejects {gpu}"
        fix = f"run the nvfp4 arm on an SM100 GPU (B200, GB200, B300), or capture {here}"
    raise KvtraceError(f"{problem}: {fix}")


def check_model(cfg: VllmCapture) -> dict:
    """The model's attention shapes from its config.json, after checking that vLLM can load it."""
    path = Path(cfg.model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise KvtraceError(f"{cfg.model} has no config.json: point --model at a model directory or a "
                               "Hugging Face model id")
        if cfg.load_format == "auto" and not any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()):
            raise KvtraceError(f"{cfg.model} holds no weights (*.safetensors, *.bin): pass --load-format dummy "
                               "for random weights (kernel timings do not depend on their values), or point "
                               "--model at a full checkpoint")
        if cfg.mode == "serve" and not any((path / name).exists() for name in TOKENIZER_FILES):
            raise KvtraceError(f"{cfg.model} has no tokenizer files, which `vllm bench serve` needs to build "
                               "prompts: add the model's tokenizer files there, or use --mode offline "
                               "(token-id prompts)")
        try:
            config = json.loads((path / "config.json").read_text())
        except ValueError as error:
            raise KvtraceError(f"{path / 'config.json'} is not valid JSON ({error}): fix or replace it") from None
    elif cfg.is_local_model():
        raise KvtraceError(f"model path {cfg.model} does not exist: check --model")
    else:
        config = _hub_config(cfg.model)
    summary = model_summary(cfg.model, config, cfg.arms)
    limit = summary.get("max_position_embeddings")
    longest = max(p.prefix_len + p.input_len + p.output_len for p in cfg.workload.points(cfg.mode))
    if limit and longest > limit and not any(a.startswith("--max-model-len") for a in cfg.extra_args):
        raise KvtraceError(f"requests of {longest} tokens exceed the model's {limit} positions: shorten the "
                           "prompts or outputs of this scenario")
    return summary


def _hub_config(model: str) -> dict | None:
    """config.json from the local Hugging Face cache, if the model was downloaded before (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(model, "config.json")
        return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None
    except (OSError, ValueError):  # not a valid repo id, or a damaged cache entry: vLLM will say more
        return None


_FORMAT_OF = {"auto": "auto", "bfloat16": "bf16", "float16": "fp16", "fp8": "fp8", "fp8_e4m3": "fp8_e4m3",
              "fp8_e5m2": "fp8_e5m2", "nvfp4": "nvfp4", "nvfp4_4over6": "nvfp4"}


def model_summary(model: str, config: dict | None, arms: tuple[str, ...]) -> dict:
    if config is None:
        return {"source": model, "config": "not found locally"}
    text = model_config.text_part(config)
    summary = {
        "source": model,
        "architectures": config.get("architectures"),
        "model_type": text.get("model_type", config.get("model_type")),
        "num_hidden_layers": text.get("num_hidden_layers"),
        "num_attention_heads": text.get("num_attention_heads"),
        "num_key_value_heads": text.get("num_key_value_heads"),
        "head_dim": text.get("head_dim"),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "torch_dtype": text.get("torch_dtype") or text.get("dtype"),
        "kv_config": model_config.kv_fields(config),  # the analyzer reads the KV layout from these
    }
    try:
        layout = model_config.read(config, model)
    except KvtraceError as error:  # kvtrace cannot size this layout; vLLM still runs it
        summary["kv_layout"] = f"not sized: {error}"
        return summary
    summary["kv_layout"] = layout.describe()
    per_token = {}
    for arm in arms:
        kv_format = _FORMAT_OF[arm]
        if model_config.format_problem(layout, kv_format):
            continue
        try:  # every KV layer's bytes per token; "auto" assumes a 16-bit model dtype
            per_token[arm] = layout.bytes_per_token(lambda width: formats.kv_bytes_per_token_head(kv_format, width))
        except ValueError:  # NVFP4 of a head_dim that is no multiple of 16: vLLM refuses that arm itself
            continue
    summary["kv_bytes_per_token"] = {arm: int(b) if b.is_integer() else b for arm, b in per_token.items()}
    return summary


def check_port(host: str, port: int) -> None:
    if not _port_free(host, port):
        raise KvtraceError(f"port {port} on {host} is in use: stop what listens there or pass --port")


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def relevant_env(environ) -> dict[str, str]:
    return {name: value for name, value in sorted(environ.items())
            if (name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES)
            and not any(marker in name.upper() for marker in _SECRET_MARKERS)}


# Processes, HTTP and metrics ---------------------------------------------------------------------------

class ManagedProcess:
    """A child in its own session, logging to a file. A terminal's Ctrl-C reaches only kvtrace, which then
    stops the whole group in order: SIGINT (nsys finalizes its report, vLLM shuts down), then SIGTERM,
    then SIGKILL."""

    def __init__(self, command: list[str], env: dict, log_path: Path, *, append: bool = False):
        self.command, self.env, self.log_path, self.append = command, env, log_path, append
        self.process: subprocess.Popen | None = None

    def start(self) -> "ManagedProcess":
        self._log = open(self.log_path, "a" if self.append else "w")
        self._log.write(f"$ {shlex.join(self.command)}\n")
        self._log.flush()
        try:
            self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True)
        except OSError:
            self._log.close()
            raise
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait(self) -> int:
        # Poll instead of blocking in waitpid(): a Ctrl-C that the kernel hands to another thread must
        # still raise KeyboardInterrupt in the main thread promptly.
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return self.process.wait(timeout=0.5)

    def stop(self, grace_s: float) -> int | None:
        """Exit code after the group is gone (the child's own when it had already exited)."""
        if self.process is None:
            return None
        try:
            for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
                if self.process.poll() is not None:
                    break
                self._signal(sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(wait_s)
            self._end_stragglers()
        except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
            self._signal(signal.SIGKILL)
            self.process.wait()
            raise
        finally:
            self._log.close()
        return self.process.returncode

    def _end_stragglers(self) -> None:
        """The leader (nsys) can exit before the rest of its group (vLLM's server or engine core, holding GPU
        memory the next arm needs): nothing may outlive it for more than a moment."""
        deadline = time.monotonic() + 5.0
        while self._signal(0):
            if time.monotonic() > deadline:
                self._signal(signal.SIGKILL)
                return
            time.sleep(0.05)

    def _signal(self, sig: int) -> bool:
        """Signal the whole group; False once nothing is left in it."""
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):  # gone, or only others' processes reuse the id
            return False
        return True


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is local: no proxy
_NET_ERRORS = (OSError, http.client.HTTPException)


def _http(method: str, url: str, timeout: float) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode("utf-8", "replace")


def _post_ok(base: str, path: str, hint: str = "") -> None:
    status, body = _http("POST", base + path, timeout=600)
    if status != 200:
        raise RuntimeError(f"POST {path} answered {status} {body.strip()[:200]!r}{hint}")


def _scrape(base: str) -> str:
    status, body = _http("GET", base + "/metrics", timeout=30)
    if status != 200:
        raise RuntimeError(f"GET /metrics answered {status}")
    return body


def parse_metrics(text: str) -> dict:
    """A /metrics page as a snapshot (vLLM's `vllm:` metrics only), parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    snapshot = empty_snapshot()
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        for sample in family.samples:
            if family.type == "counter" and sample.name == family.name + "_total":
                add_sample(snapshot, "counter", sample.name, sample.labels, sample.value)
            elif family.type == "gauge" and not sample.name.endswith("_created"):  # counters' start times
                add_sample(snapshot, "gauge", sample.name, sample.labels, sample.value)
            elif family.type == "histogram" and sample.name in (family.name + "_count", family.name + "_sum"):
                kind = "histogram_count" if sample.name.endswith("_count") else "histogram_sum"
                add_sample(snapshot, kind, family.name, sample.labels, sample.value)
    return snapshot


class MetricsPoller(threading.Thread):
    """Polls /metrics during the measured traffic and keeps the gauges' maxima."""

    def __init__(self, base: str, interval_s: float):
        super().__init__(daemon=True)
        self.base, self.interval_s = base, interval_s
        self.peaks: dict = {}
        self.polls = self.errors = 0
        self._done = threading.Event()

    def run(self) -> None:
        while True:
            try:
                update_peaks(self.peaks, parse_metrics(_scrape(self.base)))
                self.polls += 1
            except (*_NET_ERRORS, RuntimeError, ValueError):
                self.errors += 1
            if self._done.wait(self.interval_s):
                return

    def finish(self) -> dict:
        self._done.set()
        self.join()
        return self.peaks


_BENCH_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests")


def summarize_bench(result: dict) -> dict:
    """Totals, throughput and latency percentiles of a `vllm bench serve --save-result` JSON."""
    summary = {key: result[key] for key in _BENCH_KEYS if key in result}
    summary.update({key: value for key, value in result.items()
                    if key.endswith("_ms") and key.split("_")[-2] in ("ttft", "tpot", "itl", "e2el")})
    if result.get("duration"):
        # The client reports no input throughput; cold prefill is about exactly that.
        summary["input_throughput"] = result.get("total_input_tokens", 0) / result["duration"]
    return summary


# Running the arms --------------------------------------------------------------------------------------

@dataclass
class VllmArm(runner.ArmResult):
    kv_cache_dtype: str = ""
    exit_code: int | None = None  # of the workload (offline) or the server after shutdown (serve)
    kv_cache: dict | None = None  # vLLM's startup capacity line
    request_order_sha256: str | None = None
    points: list[dict] = field(default_factory=list)


@dataclass
class _Session:
    cfg: VllmCapture
    out: Path
    nsys: str
    python: str
    env: dict
    startup_timeout_s: float
    shutdown_grace_s: float
    poll_interval_s: float


def _wait_ready(server: ManagedProcess, base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if not server.running():
            raise RuntimeError(f"server exited with code {server.process.returncode} before it was ready")
        with contextlib.suppress(*_NET_ERRORS):
            if _http("GET", base + "/health", timeout=10)[0] == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not ready after {timeout_s:g} s (raise --startup-timeout for slow starts)")
        time.sleep(1.0)


def _run_bench(session: _Session, command: list[str], log: Path) -> int:
    bench = ManagedProcess(command, session.env, log, append=True)
    try:
        return bench.start().wait()
    finally:
        bench.stop(grace_s=10.0)


def _serve_arm(session: _Session, arm: VllmArm, points: list[Point], stop_at_capacity: bool) -> None:
    cfg, out = session.cfg, session.out
    base, workload = _base_url(cfg), cfg.workload
    if not _port_free(cfg.host, cfg.port):
        time.sleep(5.0)  # the previous arm's server may still be releasing it
        if not _port_free(cfg.host, cfg.port):
            raise RuntimeError(f"port {cfg.port} on {cfg.host} is still in use")
    bench_log = out / f"{arm.name}.bench.log"
    server = ManagedProcess(server_command(cfg, arm.name, out, session.nsys, session.python), session.env,
                            out / arm.log)
    arm.commands.append(server.command)
    try:
        server.start()
        _wait_ready(server, base, session.startup_timeout_s)
        arm.kv_cache = parse_kv_cache_log(server.log_path.read_text(errors="replace"))
        warm = bench_command(cfg, session.python, warmup_point(points[0]), seed=workload.seed + 1, result=None)
        arm.commands.append(warm)
        if _run_bench(session, warm, bench_log) != 0:
            raise RuntimeError("the warm-up `vllm bench serve` failed")
        if PREFIX_CACHING[workload.scenario]:
            _post_ok(base, "/reset_prefix_cache", " (needs VLLM_SERVER_DEV_MODE=1 on the server)")
        _post_ok(base, "/start_profile", " (does this vLLM take --profiler-config?)")
        capped: set[tuple[int, int]] = set()
        for index, point in enumerate(points):
            if (point.prefix_len, point.input_len) in capped:
                continue
            record = _serve_point(session, arm, index, point, bench_log)
            if stop_at_capacity:
                tokens = (arm.kv_cache or {}).get("tokens")
                record["capacity"] = capacity_reason(point, record["metrics"]["deltas"], record["metrics"]["peaks"],
                                                     tokens)
                if record["capacity"]:
                    capped.add((point.prefix_len, point.input_len))
        _post_ok(base, "/stop_profile")
    finally:
        arm.exit_code = server.stop(session.shutdown_grace_s)
        arm.kv_cache = parse_kv_cache_log(server.log_path.read_text(errors="replace")) or arm.kv_cache
    arm.request_order_sha256 = request_order_sha256([p["request_order_sha256"] for p in arm.points])
    _export(session, arm)


def _serve_point(session: _Session, arm: VllmArm, index: int, point: Point, bench_log: Path) -> dict:
    cfg, out, base = session.cfg, session.out, _base_url(session.cfg)
    stem = f"{arm.name}{_tag(cfg.workload, index)}"
    result = out / f"{stem}.bench.json"
    command = bench_command(cfg, session.python, point, seed=cfg.workload.seed, result=result)
    arm.commands.append(command)
    record = {"index": index, "point": point.spec(),
              "request_order_sha256": request_order_sha256(_request_identity(cfg.workload, point)),
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    arm.points.append(record)
    started = time.monotonic()
    before_text = _scrape(base)
    poller = MetricsPoller(base, session.poll_interval_s)
    poller.start()
    try:
        record["bench_exit_code"] = _run_bench(session, command, bench_log)
    finally:
        peaks = poller.finish()
    after_text = _scrape(base)
    record["seconds"] = round(time.monotonic() - started, 2)
    (out / f"{stem}.metrics.before.prom").write_text(before_text)
    (out / f"{stem}.metrics.after.prom").write_text(after_text)
    before, after = parse_metrics(before_text), parse_metrics(after_text)
    update_peaks(peaks, before)
    update_peaks(peaks, after)
    record["metrics"] = {"deltas": metric_deltas(before, after), "peaks": peaks, "polls": poller.polls,
                         "poll_errors": poller.errors, "before": f"{stem}.metrics.before.prom",
                         "after": f"{stem}.metrics.after.prom",
                         "cache_config": after["info"].get("vllm:cache_config_info")}
    if record["bench_exit_code"] != 0:
        raise RuntimeError(f"vllm bench serve exited with code {record['bench_exit_code']}")
    record["bench"] = summarize_bench(json.loads(result.read_text()))
    record["bench_result"] = result.name
    return record


def _offline_arm(session: _Session, arm: VllmArm, points: list[Point], stop_at_capacity: bool) -> None:
    out = session.out
    result_path = out / f"{arm.name}.workload.json"
    worker = ManagedProcess(worker_command(session.cfg, arm.name, out, session.nsys, session.python, points,
                                           stop_at_capacity), session.env, out / arm.log)
    arm.commands.append(worker.command)
    try:
        returncode = worker.start().wait()
    finally:
        arm.exit_code = worker.stop(session.shutdown_grace_s)
    arm.kv_cache = parse_kv_cache_log(worker.log_path.read_text(errors="replace"))
    if returncode != 0:
        raise RuntimeError(f"workload under nsys exited with code {returncode}")
    result = json.loads(result_path.read_text())
    result["kv_cache"] = arm.kv_cache
    runner.write_json_atomic(result_path, result)
    arm.workload = {key: value for key, value in result.items()
                    if key not in ("points", "kv_cache", "request_order_sha256")}  # those are the arm's own fields
    arm.request_order_sha256 = result["request_order_sha256"]
    for record in result["points"]:
        before, after = record.pop("metrics_before"), record.pop("metrics_after")
        record["metrics"] = {"deltas": metric_deltas(before, after) if before and after else None}
        arm.points.append(record)
    _export(session, arm)


def _export(session: _Session, arm: VllmArm) -> None:
    report = session.out / f"{arm.name}.nsys-rep"
    if not report.exists():
        raw = report.with_suffix(".qdstrm")
        if raw.exists():
            raise RuntimeError(f"nsys left {raw.name} but no report because its importer is missing: run "
                               f"QdstrmImporter -i {raw.name} from the same Nsight Systems version")
        raise RuntimeError("nsys wrote no report: vLLM's CUDA profiler range never opened")
    arm.report = report.name
    sqlite_path = session.out / f"{arm.name}.sqlite"
    with open(session.out / arm.log, "a") as log:
        runner.export_sqlite(session.nsys, report, sqlite_path, log)
    arm.commands.append([session.nsys, "export", "--type=sqlite", f"--output={sqlite_path.name}", report.name])
    arm.sqlite = sqlite_path.name


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a scheduler, `timeout`) gets the same orderly shutdown as Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write_manifests(out: Path, environment: dict, settings: dict, arms: list[VllmArm], interrupted: bool) -> dict:
    manifest = runner.manifest(ENGINE, environment, settings, arms)
    statuses = {arm.status for arm in arms}
    manifest["status"] = ("interrupted" if interrupted else "ok" if statuses == {"ok"}
                          else "partial" if "ok" in statuses else "failed")
    hashes = [arm.request_order_sha256 for arm in arms if arm.request_order_sha256]
    manifest["request_order_matched"] = len(set(hashes)) == 1 if len(hashes) > 1 else None
    runner.write_json_atomic(out / runner.MANIFEST, manifest)
    for arm in arms:
        if arm.status != "not run":
            arm_manifest = runner.manifest(ENGINE, environment, settings, [arm])
            arm_manifest["status"] = arm.status
            runner.write_json_atomic(out / f"{arm.name}.manifest.json", arm_manifest)
    return manifest


def capture(cfg: VllmCapture, out: Path, *, force: bool = False, nsys: str | None = None,
            python: str | None = None, startup_timeout_s: float = 1800.0, shutdown_grace_s: float = 300.0,
            poll_interval_s: float = POLL_INTERVAL_S) -> dict:
    """Run every arm; a failed arm is recorded and the next one still runs. Returns the run's manifest."""
    cfg.validate()
    python = python or sys.executable
    model = check_model(cfg)
    nsys_path = runner.find_nsys(nsys)
    if cfg.mode == "serve":
        check_port(cfg.host, cfg.port)
    probe = probe_environment(python, any(arm.startswith("nvfp4") for arm in cfg.arms))
    check_probe(probe, cfg.arms)
    runner.prepare_run_dir(out, force)

    environment = runner.host_environment(nsys_path)
    environment.update({
        "packages": {name: probe.get(name) for name in ("vllm", "torch", "flashinfer-python", "prometheus-client")},
        "cuda_runtime": probe.get("cuda_runtime"),
        "gpu": {"name": probe.get("gpu_name"), "sm": "".join(map(str, probe.get("capability", []))),
                "count": probe.get("gpu_count")},
        "vllm_nvfp4_kv": probe.get("vllm_nvfp4_kv"),
        "inherited_env": relevant_env(os.environ),
    })
    env = child_env(cfg)
    order = cfg.run_order()
    workload = cfg.workload
    settings = {
        "scenario": workload.scenario, "mode": cfg.mode, "model": model, "arms": list(order),
        "attention_backend": ATTENTION_BACKEND, "load_format": cfg.load_format, "seed": workload.seed,
        "prefix_caching": PREFIX_CACHING[workload.scenario],
        "points": [point.spec() for point in workload.points(cfg.mode)],
        "engine_flags": {arm: engine_flags(cfg, arm) for arm in order},
        "extra_vllm_args": list(cfg.extra_args), "env": env,
        "request_order_basis": ("token ids of every prompt, in order, with the output length" if cfg.mode == "offline"
                                else "the bench client's dataset arguments and seed (it draws the prompts from them)"),
    }
    if cfg.mode == "serve":
        settings["server"] = {"host": cfg.host, "port": cfg.port, "trace_file": workload.trace_file}
    session = _Session(cfg, out, nsys_path, python, {**os.environ, **env}, startup_timeout_s, shutdown_grace_s,
                       poll_interval_s)
    arms = [VllmArm(name=name, kv_cache_dtype=name, log=f"{name}.log") for name in order]
    _write_manifests(out, environment, settings, arms, interrupted=False)
    run_arm = _offline_arm if cfg.mode == "offline" else _serve_arm
    grid: list[Point] | None = None  # the sweep's points, once the first arm has chosen them
    with _sigterm_as_interrupt():
        for arm in arms:
            points = grid if grid is not None else workload.points(cfg.mode)
            started = time.monotonic()
            try:
                run_arm(session, arm, points, workload.scenario == "sweep" and grid is None)
                arm.status = "ok"
            except (*_NET_ERRORS, RuntimeError, ValueError) as failure:
                logs = arm.log + (f", {arm.name}.bench.log" if cfg.mode == "serve" else "")
                arm.status, arm.error = "failed", f"{failure} (see {logs})"
            except KeyboardInterrupt:
                arm.status, arm.error = "failed", "interrupted (Ctrl-C or SIGTERM); its processes were shut down"
                arm.seconds = round(time.monotonic() - started, 1)
                _write_manifests(out, environment, settings, arms, interrupted=True)
                raise
            arm.seconds = round(time.monotonic() - started, 1)
            if workload.scenario == "sweep" and grid is None and arm.status == "ok":
                grid = [Point.parse(record["point"]) for record in arm.points]
            # Written after each arm so that an interrupted run still says what finished.
            manifest = _write_manifests(out, environment, settings, arms, interrupted=False)
    return manifest
