"""A vLLM capture's configuration: scenarios and their traffic, the arms, and the engine flags and environment
every arm shares (they differ only in --kv-cache-dtype).

Standard library only.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvtrace.capture.vllm_kv_events import events_config
from kvtrace.errors import KvtraceError
from kvtrace.kv_formats import VLLM_KV_CACHE_DTYPES, bytes_per_value
from kvtrace.manifest import Point, Run, RunStatus, check_repeats, read_manifest, run_order, tensor_parallel_size

SCENARIOS = ("cold-prefill", "decode-heavy", "prefix-reuse", "sweep")
MODES = ("serve", "offline")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKEND = "FLASHINFER"
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
    "--enable-prompt-tokens-details": "--mode serve sets it: the report reads each request's cached tokens",
    "--kv-events-config": "kvtrace records the KV-cache events of prefix-caching scenarios itself",
}
_OWNED_OFFLINE = {"--max-num-seqs": "--mode offline sets it from --concurrency"}
# What a followed sweep's points fix, so that these options would contradict them.
_FOLLOWED_SHAPE = ("contexts", "concurrencies", "num_prompts", "output_len")


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
    # A sweep that runs exactly these points (an earlier run's, --points-from) instead of choosing its own.
    followed: tuple[Point, ...] = ()
    followed_from: str | None = None  # which run and arm they come from

    @classmethod
    def for_scenario(cls, scenario: str, **options) -> "Workload":
        """The scenario's defaults with the options that were given (None = not given)."""
        if scenario not in SCENARIOS:
            raise KvtraceError(f"unknown scenario {scenario!r}: choose from {', '.join(SCENARIOS)}")
        given = {name: value for name, value in options.items() if value is not None}
        if given.get("followed") and scenario != "sweep":
            raise KvtraceError(f"--points-from applies only to --scenario sweep, not {scenario}: drop it")
        for name in given:
            if name in _ONLY_FOR and scenario not in _ONLY_FOR[name]:
                raise KvtraceError(f"--{name.replace('_', '-')} does not apply to --scenario {scenario} "
                                   f"(only to {', '.join(_ONLY_FOR[name])}): drop it")
        if given.get("followed"):
            shaped = [name for name in _FOLLOWED_SHAPE if name in given]
            if shaped:
                raise KvtraceError(f"--points-from takes every point from {given['followed_from']}: drop "
                                   + ", ".join(f"--{name.replace('_', '-')}" for name in shaped))
            given.update(contexts=tuple(sorted({p.input_len for p in given["followed"]})),
                         concurrencies=tuple(sorted({p.concurrency for p in given["followed"]})))
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
        if self.followed:
            return list(self.followed)
        if self.scenario != "sweep":
            return [Point(self.input_len, self.output_len, self.num_prompts, self.concurrency,
                          self.prefix_len, self.num_prefixes)]
        # Offline submits a point's prompts at once, so there a point's concurrency is its prompt count.
        return [Point(context, self.output_len,
                      concurrency if mode == "offline" else (self.num_prompts or 2 * concurrency), concurrency)
                for context in self.contexts for concurrency in self.concurrencies]


def followed_points(path: str, mode: str) -> tuple[tuple[Point, ...], str]:
    """The points an earlier sweep ran (its first run that finished, whose points the sweep's other runs
    followed), so that an arm recorded on its own later runs the same grid; and where they come from."""
    manifest = read_manifest(Path(path))
    if manifest.scenario != "sweep" or manifest.mode != mode:
        raise KvtraceError(f"{path} holds a {manifest.mode} {manifest.scenario} run: --points-from follows an "
                           f"earlier --scenario sweep --mode {mode} run")
    order = manifest.settings.get("order")
    order = [name for name in (order if isinstance(order, list) else []) if isinstance(name, str)
             and name in manifest.runs] or list(manifest.runs)
    for name in order:
        record = manifest.runs[name]
        if record.status == RunStatus.OK and record.points:
            try:
                points = tuple(Point.parse(point["point"]) for point in record.points)
            except (KeyError, TypeError, ValueError):
                break
            for point in points:  # a point vLLM's bench would refuse, or run as nothing
                if min(point.input_len, point.output_len, point.num_prompts, point.concurrency) < 1 \
                        or min(point.prefix_len, point.num_prefixes) < 0:
                    raise KvtraceError(f"{path} (run {name}) lists the point {point.spec()}, which sends no requests "
                                       "or asks for no tokens: follow a run whose points are whole, or let this "
                                       "sweep choose its own points")
            return points, f"{path} (run {name})"
    raise KvtraceError(f"{path} has no finished sweep run with its points: follow a run whose first arm "
                       "finished, or let this sweep choose its own points")


_HOST = re.compile(r"[A-Za-z0-9.:%_-]{1,253}|\[[0-9A-Fa-f:.%]{1,100}\]")  # a name, IPv4, IPv6 (bracketed or not)


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
    repeats: int = 1
    profile_steps: int = 0  # vLLM's profiler stops after this many engine steps (0: at /stop_profile)
    quality_prompts: str | None = None  # a JSONL of prompts and answers (capture/vllm_quality)
    quality_max_tokens: int = 256
    tag_every_point: bool = False  # name every point's files ARM.rK.pN.* (the matrix: its traces are per point)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise KvtraceError(f"unknown mode {self.mode!r}: choose serve or offline")
        if self.load_format not in LOAD_FORMATS:
            raise KvtraceError(f"unknown --load-format {self.load_format!r}: choose auto or dummy")
        if not self.arms:
            raise KvtraceError("--arms is empty: name the KV-cache dtypes to compare, e.g. fp8,nvfp4")
        unknown = [arm for arm in self.arms if arm not in VLLM_KV_CACHE_DTYPES]
        if unknown:
            raise KvtraceError(f"unknown arm(s) {', '.join(unknown)}: arms are vLLM --kv-cache-dtype values, "
                               f"choose from {', '.join(VLLM_KV_CACHE_DTYPES)}")
        if len(set(self.arms)) != len(self.arms):
            raise KvtraceError(f"--arms {','.join(self.arms)} names an arm twice: list each KV dtype once")
        check_repeats(self.repeats)
        if self.profile_steps < 0:
            raise KvtraceError(f"--profile-steps {self.profile_steps} is negative: give 0 (trace everything) or more")
        if not _HOST.fullmatch(self.host):
            raise KvtraceError(f"--host {self.host!r:.80} is not a host name or IP address (letters, digits, '.', '-', "
                               "':'): give the address the server binds, e.g. 127.0.0.1")
        if not 0 < self.port < 65535:
            raise KvtraceError(f"--port {self.port} is not a TCP port kvtrace can use (it also takes the next one, "
                               "for KV-cache events): choose one in 1-65534")
        owned = {**_OWNED_FLAGS, **(_OWNED_OFFLINE if self.mode == "offline" else {})}
        for arg in self.extra_args:
            for flag, reason in owned.items():
                if arg == flag or arg.startswith((flag + "=", flag + ".")):
                    raise KvtraceError(f"extra vLLM argument {arg} is set by kvtrace ({reason}): drop it")
        tensor_parallel_size(self.extra_args)  # refuses a --tensor-parallel-size that is no whole number
        self.workload.validate(self.mode)
        if self.quality_prompts is not None:
            from kvtrace.capture.vllm_quality import check

            check(self)

    @property
    def tensor_parallel_size(self) -> int:
        """GPUs (ranks) each arm's engine runs on: vLLM's --tensor-parallel-size among the extra arguments."""
        return tensor_parallel_size(self.extra_args)

    @property
    def kv_events_port(self) -> int:
        """Where the server publishes its KV-cache events (serve mode, prefix caching on)."""
        return self.port + 1

    def is_local_model(self) -> bool:
        return Path(self.model).expanduser().exists() or self.model.startswith(("/", "./", "../", "~"))

    def arm_order(self) -> tuple[str, ...]:
        """Arms in the order they run. The sweep's first run decides its grid and stops a context at its first
        capacity-bound point, so the narrowest format (the largest pool) goes first: the grid then reaches past
        every wider format's capacity, with points on both sides of each."""
        if self.workload.scenario != "sweep":
            return self.arms
        return tuple(sorted(self.arms, key=lambda arm: bytes_per_value(arm) or math.inf))

    def runs(self) -> list[Run]:
        """Every run in the order it is recorded (with --repeats the arms interleave)."""
        return run_order(self.arm_order(), self.repeats)


def profiler_config(cfg: VllmCapture) -> str:
    """vLLM's CUDA profiler opens and closes the nsys capture range; max_iterations closes it after that many
    engine steps (vLLM 0.33's ProfilerConfig)."""
    config = {"profiler": "cuda", **({"max_iterations": cfg.profile_steps} if cfg.profile_steps else {})}
    return json.dumps(config)


def engine_flags(cfg: VllmCapture, kv_dtype: str) -> list[str]:
    """vLLM engine flags of one arm; arms differ only in the first pair."""
    workload = cfg.workload
    flags = ["--kv-cache-dtype", kv_dtype, "--attention-backend", ATTENTION_BACKEND,
             "--profiler-config", profiler_config(cfg), "--seed", str(workload.seed),
             "--enable-prefix-caching" if PREFIX_CACHING[workload.scenario] else "--no-enable-prefix-caching"]
    if cfg.load_format == "dummy":
        flags += ["--load-format", "dummy"]
    if cfg.mode == "offline":
        max_seqs = max(point.concurrency for point in workload.points(cfg.mode))
        flags += ["--skip-tokenizer-init", "--max-num-seqs", str(max_seqs)]
    else:
        flags.append("--enable-prompt-tokens-details")
        if PREFIX_CACHING[workload.scenario]:
            flags += ["--kv-events-config", events_config(cfg.kv_events_port)]
    return flags + list(cfg.extra_args)


def child_env(cfg: VllmCapture) -> dict[str, str]:
    """Environment kvtrace sets for every child (server, client, worker), on top of its own."""
    env = {
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # Nsight Systems cannot follow fork() without exec()
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONHASHSEED": "0",  # the bench client's timed_trace prompts hash strings
        "PYTHONSAFEPATH": "1",  # `python -m` must not import a source checkout from the working directory
    }
    if "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ:
        # kvtrace's requests set neither top-k nor top-p, so FlashInfer's sampler never runs, yet vLLM builds it at
        # start: 139 s of nvcc on the critical path where no prebuilt FlashInfer kernels are installed (the H100
        # matrix of 2026-12-06, servers/*/server.log). A user's own setting is kept.
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
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
