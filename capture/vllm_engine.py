"""vLLM engine: matched KV-cache-dtype arms of a real vLLM under Nsight Systems, one traffic scenario per run.

Both arms get one engine flag list and differ only in --kv-cache-dtype. The attention backend is pinned to
FLASHINFER (the only vLLM backend that stores nvfp4) and vLLM's CUDA profiler opens and closes the nsys
capture range, so start-up and warm-up stay out of the trace.

- serve (the serving stack as deployed): `vllm serve` under nsys and `vllm bench serve` as the client. /metrics is
  scraped before and after the measured traffic and polled during it for peaks; /start_profile and
  /stop_profile bracket it. The server runs in its own session and is always shut down, SIGINT first so
  that nsys writes its report, also on errors, Ctrl-C and SIGTERM; its log is kept.
- offline: vLLM's LLM class in kvtrace.capture.vllm_offline_workload under nsys, token-id prompts, no
  tokenizer and no server (kernel-level matched steps: both arms schedule the same batches).

This module runs the sessions and writes the manifests; vllm_config (scenarios, arms, flags), vllm_commands
(command lines, dry run), vllm_preflight (checks before anything starts), vllm_http (server requests and
/metrics) and processes (child processes) hold the rest. vLLM is run, never imported: standard library, plus
prometheus_client when metrics are parsed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import kvtrace.nsys
from kvtrace import files
from kvtrace.capture import runner, vllm_quality, vllm_ranks, vllm_traced_pass
from kvtrace.capture.processes import ManagedProcess, sigterm_as_interrupt
from kvtrace.capture.vllm_commands import (POLL_INTERVAL_S, base_url, bench_command, point_tag, request_identity,
                                           server_command, warmup_point, worker_command)
from kvtrace.capture.vllm_common import metric_deltas, parse_kv_cache_log, request_order_sha256, update_peaks
from kvtrace.capture.vllm_config import ATTENTION_BACKEND, PREFIX_CACHING, VllmCapture, child_env, engine_flags
from kvtrace.capture.vllm_http import NET_ERRORS, MetricsPoller, http_request, parse_metrics, post_ok, scrape
from kvtrace.capture.vllm_kv_events import KvEventRecorder
from kvtrace.capture.vllm_kv_events import check_available as check_kv_events_available
from kvtrace.capture.vllm_kv_events import deltas as kv_event_deltas
from kvtrace.capture.vllm_preflight import (check_model, check_port, check_probe, port_free, probe_environment,
                                            relevant_env)
from kvtrace.capture.vllm_relay import UsageRelay
from kvtrace.capture.vllm_relay import summarize as summarize_requests
from kvtrace.manifest import MANIFEST, Point, RunStatus, capacity_reason, capture_status

ENGINE = "vllm"
# /health is polled soon at first (a small model is up in a fraction of a second), then at most this far apart.
READY_POLL_MAX_S = 1.0

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
    kv_events: dict | None = None  # the KV-cache event recorder's file and the arm's totals (serve, prefix caching)
    ranks: list[dict] = field(default_factory=list)  # with --tensor-parallel-size > 1: vllm_ranks.recorded_ranks
    quality: dict | None = None  # the quality prompts' summary (capture/vllm_quality)


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
    vocab_size: int | None = None  # the model's, for a traced pass's token-id prompts (capture/vllm_traced_pass)


def _wait_ready(server: ManagedProcess, base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pause_s = min(0.05, READY_POLL_MAX_S)
    while True:
        if not server.running():
            raise RuntimeError(f"server exited with code {server.process.returncode} before it was ready")
        with contextlib.suppress(*NET_ERRORS):
            if http_request("GET", base + "/health", timeout=10)[0] == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not ready after {timeout_s:g} s (raise --startup-timeout for slow starts)")
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, READY_POLL_MAX_S)


def _run_bench(session: _Session, command: list[str], log: Path) -> int:
    bench = ManagedProcess(command, session.env, log, append=True)
    try:
        return bench.start().wait()
    finally:
        bench.stop(grace_s=10.0)


def _serve_arm(session: _Session, arm: VllmArm, points: list[Point], stop_at_capacity: bool) -> None:
    cfg, out = session.cfg, session.out
    base, workload = base_url(cfg), cfg.workload
    if not port_free(cfg.host, cfg.port):
        time.sleep(5.0)  # the previous arm's server may still be releasing it
        if not port_free(cfg.host, cfg.port):
            raise RuntimeError(f"port {cfg.port} on {cfg.host} is still in use")
    bench_log = out / f"{arm.name}.bench.log"
    server = ManagedProcess(server_command(cfg, arm.kv_cache_dtype, out, session.nsys, session.python, run=arm.name),
                            session.env, out / arm.log)
    arm.commands.append(server.command)
    # Bound before the server starts, so that its publisher connects to a listener from the first event on.
    events = KvEventRecorder(cfg.kv_events_port, out / f"{arm.name}.kv-events.jsonl") \
        if PREFIX_CACHING[workload.scenario] else None
    try:
        if events is not None:
            events.start()
        server.start()
        _wait_ready(server, base, session.startup_timeout_s)
        arm.kv_cache = parse_kv_cache_log(server.log_path.read_text(errors="replace"))
        with UsageRelay(cfg.host, cfg.port) as relay:
            _serve_points(session, arm, points, stop_at_capacity, relay, events, bench_log)
    finally:
        arm.exit_code = server.stop(session.shutdown_grace_s)
        arm.kv_cache = parse_kv_cache_log(server.log_path.read_text(errors="replace")) or arm.kv_cache
        if events is not None:
            arm.kv_events = {"file": f"{arm.name}.kv-events.jsonl", "totals": events.finish()}
    arm.request_order_sha256 = request_order_sha256([p["request_order_sha256"] for p in arm.points])
    _export(session, arm)


def _serve_points(session: _Session, arm: VllmArm, points: list[Point], stop_at_capacity: bool, relay: UsageRelay,
                  events: KvEventRecorder | None, bench_log: Path) -> None:
    cfg, workload, base = session.cfg, session.cfg.workload, base_url(session.cfg)
    warm = bench_command(cfg, session.python, warmup_point(points[0]), seed=workload.seed + 1, result=None,
                         relay_port=relay.port)
    arm.commands.append(warm)
    if _run_bench(session, warm, bench_log) != 0:
        raise RuntimeError("the warm-up `vllm bench serve` failed")
    if PREFIX_CACHING[workload.scenario]:
        post_ok(base, "/reset_prefix_cache", " (needs VLLM_SERVER_DEV_MODE=1 on the server)")
    relay.take()  # the warm-up's requests are not the measured traffic's
    post_ok(base, "/start_profile", " (does this vLLM take --profiler-config?)")
    traced = None
    if cfg.profile_steps:
        # A window of profile_steps would close inside the timed traffic and stall it (capture/vllm_traced_pass):
        # it traces a traced pass of the first point instead, and closes before the timed traffic starts.
        try:
            traced = vllm_traced_pass.send(base, cfg.model, vllm_traced_pass.traced_point(points[0], cfg.profile_steps),
                                           workload.seed, session.vocab_size)
        finally:
            post_ok(base, "/stop_profile")
        if PREFIX_CACHING[workload.scenario]:
            post_ok(base, "/reset_prefix_cache", " (needs VLLM_SERVER_DEV_MODE=1 on the server)")
    capped: set[tuple[int, int]] = set()
    for index, point in enumerate(points):
        if (point.prefix_len, point.input_len) in capped:
            continue
        record = _serve_point(session, arm, index, point, bench_log, relay, events)
        if traced is not None and index == 0:
            record["traced_pass"] = traced
        if stop_at_capacity:
            tokens = (arm.kv_cache or {}).get("tokens")
            record["capacity"] = capacity_reason(point, record["metrics"]["deltas"], record["metrics"]["peaks"],
                                                 tokens)
            if record["capacity"]:
                capped.add((point.prefix_len, point.input_len))
    if not cfg.profile_steps:
        post_ok(base, "/stop_profile")
    if cfg.quality_prompts:  # after the trace's range: the model's answers, not its timing
        arm.quality = vllm_quality.run(base, cfg.quality_prompts, cfg.quality_max_tokens, session.out, arm.name)


def _serve_point(session: _Session, arm: VllmArm, index: int, point: Point, bench_log: Path, relay: UsageRelay,
                 events: KvEventRecorder | None, run_bench=None) -> dict:
    """One point's measured traffic and what it is measured by; run_bench(command) runs the client (default: a
    fresh `vllm bench serve`; the matrix releases one it started earlier, capture/vllm_servers)."""
    cfg, out, base = session.cfg, session.out, base_url(session.cfg)
    stem = f"{arm.name}{point_tag(cfg.workload, index, cfg.tag_every_point)}"
    result = out / f"{stem}.bench.json"
    command = bench_command(cfg, session.python, point, seed=cfg.workload.seed, result=result, relay_port=relay.port)
    arm.commands.append(command)
    record = {"index": index, "point": point.spec(),
              "request_order_sha256": request_order_sha256(request_identity(cfg.workload, point)),
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    arm.points.append(record)
    started = time.monotonic()
    before_text = scrape(base)
    events_before = events.snapshot() if events is not None else None
    poller = MetricsPoller(base, session.poll_interval_s)
    poller.start()
    try:
        record["bench_exit_code"] = (run_bench(command) if run_bench else _run_bench(session, command, bench_log))
    finally:
        peaks = poller.finish()
    after_text = scrape(base)
    record["seconds"] = round(time.monotonic() - started, 2)
    requests = relay.take()
    runner.write_json_atomic(out / f"{stem}.requests.json", requests)
    record["requests"] = {"file": f"{stem}.requests.json", **summarize_requests(requests)}
    if events is not None:
        events.settle()
        record["kv_events"] = kv_event_deltas(events_before, events.snapshot())
    files.write(out / f"{stem}.metrics.before.prom", before_text)
    files.write(out / f"{stem}.metrics.after.prom", after_text)
    before, after = parse_metrics(before_text), parse_metrics(after_text)
    update_peaks(peaks, before)
    update_peaks(peaks, after)
    record["metrics"] = {"deltas": metric_deltas(before, after), "peaks": peaks, "polls": poller.polls,
                         "poll_errors": poller.errors, "busy_polls": poller.busy_polls,
                         "poll_interval_s": session.poll_interval_s, "before": f"{stem}.metrics.before.prom",
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
    worker = ManagedProcess(worker_command(session.cfg, arm.kv_cache_dtype, out, session.nsys, session.python, points,
                                           stop_at_capacity, run=arm.name), session.env, out / arm.log)
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
    if (session.out / f"{arm.name}.nsys-rep").exists():
        arm.report = f"{arm.name}.nsys-rep"  # kept even when the export fails: it may still open in the GUI
    with open(session.out / arm.log, "a") as log:
        arm.commands += runner.export_run(session.out, arm.name, session.nsys, log,
                                          no_report="vLLM's CUDA profiler range never opened")
    arm.sqlite = f"{arm.name}.sqlite"
    if session.cfg.tensor_parallel_size > 1:
        arm.ranks = vllm_ranks.recorded_ranks(session.out / arm.sqlite, session.cfg.tensor_parallel_size)


def _write_manifests(out: Path, environment: dict, settings: dict, arms: list[VllmArm], interrupted: bool) -> dict:
    manifest = runner.manifest(ENGINE, environment, settings, arms)
    manifest["status"] = capture_status([arm.status for arm in arms], interrupted)
    hashes = [arm.request_order_sha256 for arm in arms if arm.request_order_sha256]
    manifest["request_order_matched"] = len(set(hashes)) == 1 if len(hashes) > 1 else None
    runner.write_json_atomic(out / MANIFEST, manifest)
    for arm in arms:
        if arm.status != RunStatus.NOT_RUN:
            arm_manifest = runner.manifest(ENGINE, environment, settings, [arm])
            arm_manifest["status"] = capture_status([arm.status], interrupted=False)
            runner.write_json_atomic(out / f"{arm.name}.manifest.json", arm_manifest)
    return manifest



def capture_environment(nsys_path: str, probe: dict) -> dict:
    """The manifest's environment: the host's, and what the probe found of vLLM, torch, FlashInfer, CUDA and the GPU."""
    environment = runner.host_environment(nsys_path)
    environment.update({
        "packages": {name: probe.get(name) for name in ("vllm", "torch", "flashinfer-python", "prometheus-client")},
        "cuda_runtime": probe.get("cuda_runtime"),
        "gpu": {"name": probe.get("gpu_name"), "sm": "".join(map(str, probe.get("capability", []))),
                "count": probe.get("gpu_count")},
        "vllm_nvfp4_kv": probe.get("vllm_nvfp4_kv"), "inherited_env": relevant_env(os.environ)})
    return environment

def capture(cfg: VllmCapture, out: Path, *, force: bool = False, nsys: str | None = None,
            python: str | None = None, startup_timeout_s: float = 1800.0, shutdown_grace_s: float = 300.0,
            poll_interval_s: float = POLL_INTERVAL_S) -> dict:
    """Record every run (arm, or arm and repeat); a failed run is recorded and the next one still runs. Returns
    the run directory's manifest."""
    cfg.validate()
    python = python or sys.executable
    model = check_model(cfg)
    nsys_path = kvtrace.nsys.find_nsys(nsys)
    if cfg.mode == "serve":
        check_port(cfg.host, cfg.port)
        if PREFIX_CACHING[cfg.workload.scenario]:
            check_port("127.0.0.1", cfg.kv_events_port)
            check_kv_events_available()
    probe = probe_environment(python, any(arm.startswith("nvfp4") for arm in cfg.arms))
    check_probe(probe, cfg.arms, cfg.tensor_parallel_size)
    runner.prepare_run_dir(out, force)

    environment = capture_environment(nsys_path, probe)
    env = child_env(cfg)
    order, runs = cfg.arm_order(), cfg.runs()
    workload = cfg.workload
    settings = {
        "scenario": workload.scenario, "mode": cfg.mode, "model": model, "arms": list(order),
        "repeats": cfg.repeats, "order": [run.name for run in runs], "profile_steps": cfg.profile_steps,
        "attention_backend": ATTENTION_BACKEND, "load_format": cfg.load_format, "seed": workload.seed,
        "prefix_caching": PREFIX_CACHING[workload.scenario],
        "points": [point.spec() for point in workload.points(cfg.mode)],
        "engine_flags": {arm: engine_flags(cfg, arm) for arm in order},
        "extra_vllm_args": list(cfg.extra_args), "env": env,
        "request_order_basis": ("token ids of every prompt, in order, with the output length" if cfg.mode == "offline"
                                else "the bench client's dataset arguments and seed (it draws the prompts from them)"),
    }
    if workload.followed:
        settings["points_from"] = workload.followed_from
    if cfg.tensor_parallel_size > 1:
        settings["ranks"] = vllm_ranks.settings(cfg.tensor_parallel_size)
    if cfg.mode == "serve":
        settings["server"] = {"host": cfg.host, "port": cfg.port, "trace_file": workload.trace_file}
    session = _Session(cfg, out, nsys_path, python, {**os.environ, **env}, startup_timeout_s, shutdown_grace_s,
                       poll_interval_s, model.get("vocab_size"))
    arms = [VllmArm(name=run.name, arm=run.arm, repeat=run.repeat, kv_cache_dtype=run.arm, log=f"{run.name}.log")
            for run in runs]
    _write_manifests(out, environment, settings, arms, interrupted=False)
    run_arm = _offline_arm if cfg.mode == "offline" else _serve_arm
    # The sweep's points, once chosen: by the first run, or by an earlier run that this one follows.
    grid: list[Point] | None = list(workload.followed) or None
    with sigterm_as_interrupt():
        for arm in arms:
            points = grid if grid is not None else workload.points(cfg.mode)
            started = time.monotonic()
            try:
                run_arm(session, arm, points, workload.scenario == "sweep" and grid is None)
                arm.status = RunStatus.OK
            except (*NET_ERRORS, RuntimeError, ValueError) as failure:
                logs = arm.log + (f", {arm.name}.bench.log" if cfg.mode == "serve" else "")
                arm.status, arm.error = RunStatus.FAILED, f"{failure} (see {logs})"
            except KeyboardInterrupt:
                arm.status = RunStatus.FAILED
                arm.error = "interrupted (Ctrl-C or SIGTERM); its processes were shut down"
                arm.seconds = round(time.monotonic() - started, 1)
                _write_manifests(out, environment, settings, arms, interrupted=True)
                raise
            arm.seconds = round(time.monotonic() - started, 1)
            if workload.scenario == "sweep" and grid is None and arm.status == RunStatus.OK:
                grid = [Point.parse(record["point"]) for record in arm.points]
            # Written after each arm so that an interrupted run still says what finished.
            manifest = _write_manifests(out, environment, settings, arms, interrupted=False)
    return manifest
