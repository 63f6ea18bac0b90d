"""The command lines of a vLLM capture: `vllm serve` or the offline worker under nsys, the bench client, the
export, and the dry run that prints them all.

Standard library only.
"""

from __future__ import annotations

import hashlib
import shlex
import sys
from pathlib import Path

import kvtrace.nsys
from kvtrace.capture import runner, vllm_ranks
from kvtrace.capture.vllm_config import PREFIX_CACHING, VllmCapture, Workload, child_env, engine_flags
from kvtrace.capture.vllm_traced_pass import describe, traced_point
from kvtrace.errors import KvtraceError
from kvtrace.manifest import Point
from kvtrace.text import visible

# vLLM's engine core and workers are child processes of the traced command.
NSYS_EXTRA = ("--trace-fork-before-exec=true",)
VLLM_CLI = ("-m", "vllm.entrypoints.cli.main")
WORKER = ("-m", "kvtrace.capture.vllm_offline_workload")
# /metrics polling during the measured traffic, for the gauges' peaks: every 0.5 s, an 8-second point of the H200's
# 8B-shaped prefix reuse got 9 to 14 polls with requests in flight, around analyzer.serving.MIN_PEAK_POLLS.
POLL_INTERVAL_S = 0.2


def server_command(cfg: VllmCapture, arm: str, out: Path, nsys: str, python: str, *, run: str = "") -> list[str]:
    """`vllm serve` of one arm under nsys; `run` names the trace (the arm's name by default)."""
    serve = [python, *VLLM_CLI, "serve", cfg.model, "--host", cfg.host, "--port", str(cfg.port),
             *engine_flags(cfg, arm)]
    return runner.profile_command(nsys, out / (run or arm), serve, extra=NSYS_EXTRA)


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


def request_identity(workload: Workload, point: Point) -> list[str]:
    """What the serve-mode request-order hash covers: the client draws its prompts from these."""
    identity = request_args(workload, point, workload.seed)
    if workload.trace_file:
        identity.append(hashlib.sha256(Path(workload.trace_file).read_bytes()).hexdigest())
    return identity


def bench_command(cfg: VllmCapture, python: str, point: Point, *, seed: int, result: Path | None,
                  relay_port: int | str) -> list[str]:
    """The client, sent through kvtrace's usage relay on the loopback (kvtrace.capture.vllm_relay)."""
    # No client warm-ups or ready check: both send the first prompt, which would pre-warm the prefix cache.
    command = [python, *VLLM_CLI, "bench", "serve", "--backend", "vllm", "--model", cfg.model,
               "--host", "127.0.0.1", "--port", str(relay_port), *request_args(cfg.workload, point, seed),
               "--request-rate", "inf", "--num-warmups", "0", "--ready-check-timeout-sec", "0",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm"]
    if result is not None:
        # --save-detailed keeps each request's TTFT and latencies: the serving intervals resample them.
        command += ["--save-result", "--save-detailed", "--result-dir", str(result.parent),
                    "--result-filename", result.name]
    return command


def warmup_point(point: Point) -> Point:
    """One round of the first point's traffic. `vllm bench serve --dataset-name prefix_repetition` refuses fewer
    prompts than prefixes ("num_requests (8) must be greater than or equal to num_prefixes (12)", vLLM 0.26),
    so a prefix-reuse warm-up sends at least one prompt per prefix."""
    prompts = max(min(point.num_prompts, point.concurrency), point.num_prefixes)
    return Point(point.input_len, point.output_len, prompts, point.concurrency, point.prefix_len, point.num_prefixes)


def worker_command(cfg: VllmCapture, arm: str, out: Path, nsys: str, python: str, points: list[Point],
                   stop_at_capacity: bool, *, run: str = "") -> list[str]:
    """The offline worker of one arm under nsys; `run` names its files (the arm's name by default)."""
    run = run or arm
    work = [python, *WORKER, "--scenario", cfg.workload.scenario, "--seed", str(cfg.workload.seed)]
    for point in points:
        work += ["--point", point.spec()]
    if stop_at_capacity:
        work.append("--stop-at-capacity")
    if cfg.profile_steps:
        work += ["--traced-pass-steps", str(cfg.profile_steps)]
    work += ["--result", str(out / f"{run}.workload.json"), "--", "--model", cfg.model, *engine_flags(cfg, arm)]
    return runner.profile_command(nsys, out / run, work, extra=NSYS_EXTRA)



def dry_run_nsys(nsys: str | None) -> str:
    """The nsys a dry run's commands name: the one found, else the name given or `nsys` (no GPU box needed)."""
    try:
        return kvtrace.nsys.find_nsys(nsys)
    except KvtraceError:
        return nsys or "nsys"

def dry_run(cfg: VllmCapture, out: Path, *, nsys: str | None = None, python: str | None = None) -> str:
    """The exact commands of every arm, without a GPU, vLLM or nsys (then `nsys` stands for it)."""
    cfg.validate()
    nsys = dry_run_nsys(nsys)
    python = python or sys.executable
    env = " ".join(f"{name}={shlex.quote(value)}" for name, value in child_env(cfg).items())
    workload, runs = cfg.workload, cfg.runs()
    base = base_url(cfg)
    repeats = f", {cfg.repeats} repeats interleaved" if cfg.repeats > 1 else ""
    lines = [f"# kvtrace capture vllm: scenario {workload.scenario}, mode {cfg.mode}, arms "
             f"{', '.join(cfg.arm_order())}{repeats} (dry run: nothing is started)"]
    word = "arm" if cfg.repeats == 1 else "run"
    if cfg.tensor_parallel_size > 1:
        lines.append(f"# tensor parallel: {cfg.tensor_parallel_size} ranks, {vllm_ranks.RECORDED}; after each "
                     f"export, ranks 0-{cfg.tensor_parallel_size - 1} must each have kernels")
    if workload.followed:
        lines.append(f"# sweep: every {word} runs the {len(workload.followed)} points that {workload.followed_from} "
                     "ran (--points-from)")
    elif workload.scenario == "sweep":
        lines.append(f"# sweep: {word} {runs[0].name} steps up concurrency per context length and stops a length "
                     "at its first capacity-bound point (preemptions, or KV cache >= 95% full); the other "
                     f"{word}s run exactly the points it ran")
    for run in runs:
        arm = run.arm
        lines.append(f"# arm {arm}" if cfg.repeats == 1 else f"# run {run.name}: arm {arm}, repeat {run.repeat}")
        if cfg.mode == "offline":
            points = workload.points(cfg.mode)
            stop = workload.scenario == "sweep" and not workload.followed and run == runs[0]
            command = worker_command(cfg, arm, out, nsys, python, points, stop, run=run.name)
            lines.append(f"{env} {shlex.join(command)}")
        else:
            if PREFIX_CACHING[workload.scenario]:
                lines.append(f"# record the server's KV-cache events on tcp://127.0.0.1:{cfg.kv_events_port} "
                             f"into {run.name}.kv-events.jsonl")
            lines.append(f"{env} {shlex.join(server_command(cfg, arm, out, nsys, python, run=run.name))}")
            points = workload.points(cfg.mode)
            lines.append(f"# wait for GET {base}/health 200, start kvtrace's usage relay to it on 127.0.0.1:RELAY_PORT "
                         "(it records each response's cached prompt tokens), then warm up (outside the capture "
                         "range):")
            warm = bench_command(cfg, python, warmup_point(points[0]), seed=workload.seed + 1, result=None,
                                 relay_port="RELAY_PORT")
            lines.append(f"{env} {shlex.join(warm)}")
            if PREFIX_CACHING[workload.scenario]:
                lines.append(f"# POST {base}/reset_prefix_cache")
            lines.append(f"# POST {base}/start_profile")
            if cfg.profile_steps:
                traced = describe(traced_point(points[0], cfg.profile_steps))
                reset = f"; POST {base}/reset_prefix_cache" if PREFIX_CACHING[workload.scenario] else ""
                lines.append(f"# the traced pass: {traced} (POST {base}/v1/completions); POST {base}/stop_profile"
                             f"{reset}")
            for index, point in enumerate(points):
                result = out / f"{run.name}{point_tag(workload, index)}.bench.json"
                lines.append(f"# GET {base}/metrics before, every {POLL_INTERVAL_S:g} s during, and after:")
                bench = bench_command(cfg, python, point, seed=workload.seed, result=result, relay_port="RELAY_PORT")
                lines.append(f"{env} {shlex.join(bench)}")
            close = "" if cfg.profile_steps else f"POST {base}/stop_profile, then "
            lines.append(f"# {close}SIGINT the server so that nsys writes its report")
        lines.append(shlex.join(kvtrace.nsys.export_command(nsys, out / f"{run.name}.nsys-rep",
                                                            out / f"{run.name}.sqlite")))
    # A comment quotes what it was given (--host, a --points-from path): a newline there must not end it, or the
    # rest would be a command line of its own when the plan is pasted into a shell.
    return "\n".join(visible(line) if line.startswith("#") else line for line in lines) + "\n"


def point_tag(workload: Workload, index: int, every: bool = False) -> str:
    """`.pN` in a point's file names: a sweep's points, or (`every`, the matrix) any scenario's."""
    return f".p{index}" if every or workload.scenario == "sweep" else ""


def base_url(cfg: VllmCapture) -> str:
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    return f"http://{host}:{cfg.port}"
