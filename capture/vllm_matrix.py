"""`kvtrace capture vllm-matrix`: the whole capacity matrix (cold prefill, prefix reuse, preemption, the sweep) in
one go. One long-lived `vllm serve` per arm (capture/vllm_servers), all arms' servers up at once on one GPU when
they fit; rounds interleave the arms (A B A B ...); each traffic point gets its own bounded profile window; the
prefix cache is reset (POST /reset_prefix_cache) before every point. Each scenario is its own run directory under
the matrix root, with today's files (ARM.rK.pN.bench.json, metrics, requests) plus a trace per point
(ARM.rK.pN.sqlite) and, per run, its windows and the wall time of each phase. Counterfactual (patched) arms end up
in counterfactual/SCENARIO beside the stock arm of their KV dtype (vllm_matrix_split), the co-residence check in
checks/co-residence: every run directory holds two arms, as `kvtrace matrix` wants.

Standard library only.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvtrace.capture import vllm_servers
from kvtrace.capture.vllm_commands import bench_command, dry_run_nsys, point_tag
from kvtrace.capture.vllm_config import VllmCapture, Workload, child_env
from kvtrace.capture.vllm_patches import ArmSpec
from kvtrace.capture.vllm_traced_pass import describe, traced_point
from kvtrace.errors import KvtraceError
from kvtrace.manifest import Point, check_repeats

MATRIX = "matrix.json"
# A patched arm runs only where its question is asked: cold prefill and the sweep's low-load points.
PATCHED_SWEEP_CONCURRENCIES = (4, 8)


@dataclass(frozen=True)
class MatrixRecord:
    """MATRIX as the matrix root holds it: the run directories the matrix wrote, whether its servers shared the GPU,
    what stopped it early and its wall time, with the timeline of every phase and the servers' records as written."""

    scenarios: tuple[str, ...]  # run directories under the root
    counterfactual: tuple[str, ...]  # the patched arms' run directories (vllm_matrix_split)
    co_residence_check: str | None  # its run directory
    co_resident: bool
    co_resident_fallback: str | None  # why the arms ran one after another
    error: str | None  # what stopped the matrix early
    seconds: float  # every phase's wall time together
    timeline: tuple[dict, ...]  # {"phase", where it ran, "seconds"}
    servers: dict  # per arm label: its server's port, log, exit code, KV cache and lifetimes

    @property
    def run_dirs(self) -> tuple[str, ...]:
        """Every run directory it wrote: the scenarios, the counterfactual arms', then the co-residence check's."""
        return self.scenarios + self.counterfactual + ((self.co_residence_check,) if self.co_residence_check else ())

    @classmethod
    def of(cls, data: dict) -> MatrixRecord:
        return cls(scenarios=tuple(data["scenarios"]), counterfactual=tuple(data.get("counterfactual") or ()),
                   co_residence_check=data.get("co_residence_check"), co_resident=data["co_resident"],
                   co_resident_fallback=data.get("co_resident_fallback"), error=data.get("error"),
                   seconds=data["seconds"], timeline=tuple(data.get("timeline") or ()),
                   servers=data.get("servers") or {})


def read_matrix(root: Path) -> MatrixRecord:
    return MatrixRecord.of(json.loads((root / MATRIX).read_text()))


@dataclass(frozen=True)
class MatrixScenario:
    name: str  # the run directory under the matrix root
    workload: Workload
    profile_steps: int
    patched: bool = False  # whether patched arms run here (the sweep: only at PATCHED_SWEEP_CONCURRENCIES)

    def points(self) -> list[Point]:
        return self.workload.points("serve")

    def point_indices(self, spec: ArmSpec) -> list[int]:
        points = self.points()
        if spec.patch is None:
            return list(range(len(points)))
        if not self.patched:
            return []
        if self.workload.scenario != "sweep":
            return list(range(len(points)))
        return [i for i, point in enumerate(points) if point.concurrency in PATCHED_SWEEP_CONCURRENCIES]


# Engine steps traced per point, of its traced pass (capture/vllm_traced_pass): the first 8 hold the prefill and mixed
# steps and the decode steps after them; the H100 matrix traced 12 to 48 per point, 87 MB of exports, which its
# fixture keeps 8 of (pack_run.py --steps 8).
WINDOW_STEPS = 8


def capacity_scenarios(concurrencies: tuple[int, ...] = (4, 8, 12, 16), sweep_prompts: int = 32) -> list[MatrixScenario]:
    """The 8B-shaped capacity matrix of fixtures/record-vllm033-h200.sh, with a 1 GiB KV pool: 16,384 FP8 tokens,
    29,120 NVFP4 tokens (vLLM 0.33 on the H100)."""
    return [
        MatrixScenario("cold-prefill", Workload.for_scenario("cold-prefill", input_len=2048, output_len=1,
                                                             num_prompts=32, concurrency=16), WINDOW_STEPS,
                       patched=True),
        MatrixScenario("prefix-reuse", Workload.for_scenario("prefix-reuse", input_len=128, output_len=16,
                                                             num_prompts=96, concurrency=4, prefix_len=2048,
                                                             num_prefixes=12), WINDOW_STEPS),
        MatrixScenario("preemption", Workload.for_scenario("decode-heavy", input_len=1024, output_len=512,
                                                           num_prompts=32, concurrency=16), WINDOW_STEPS),
        MatrixScenario("sweep", Workload.for_scenario("sweep", contexts=(2048,), concurrencies=concurrencies,
                                                      output_len=128, num_prompts=sweep_prompts), WINDOW_STEPS,
                       patched=True),
    ]


@dataclass(frozen=True)
class MatrixConfig:
    model: str
    arms: tuple[ArmSpec, ...]
    scenarios: tuple[MatrixScenario, ...]
    repeats: int = 3
    load_format: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    extra_args: tuple[str, ...] = ()
    seed: int = 0
    co_resident: bool = True
    memory_fraction: float = 0.25  # each server's --gpu-memory-utilization (vLLM's start-up free-memory check)
    co_residence_check: bool = True
    export_workers: int = 8
    report_wait_s: float = vllm_servers.REPORT_WAIT_S

    def server_cfg(self, index: int) -> VllmCapture:
        """A server's flags: prefix caching on (prefix reuse needs it; the others reset it before each point), its
        own port pair, and a memory fraction small enough that the next server's start-up check passes."""
        extra = self.extra_args + (("--gpu-memory-utilization", f"{self.memory_fraction:g}") if self.co_resident else ())
        return VllmCapture(model=self.model, workload=Workload.for_scenario("prefix-reuse", seed=self.seed),
                           arms=tuple(sorted({a.kv_dtype for a in self.arms})), mode="serve",
                           load_format=self.load_format, host=self.host, port=self.port + 10 * index,
                           extra_args=extra, profile_steps=max(s.profile_steps for s in self.scenarios))

    def scenario_cfg(self, scenario: MatrixScenario, server: VllmCapture) -> VllmCapture:
        return replace(server, workload=replace(scenario.workload, seed=self.seed), profile_steps=scenario.profile_steps,
                       tag_every_point=True)

    def validate(self) -> None:
        if not self.arms:
            raise KvtraceError("--arms is empty: name the KV-cache dtypes to compare, e.g. fp8,nvfp4")
        labels = [a.label for a in self.arms]
        if len(set(labels)) != len(labels):
            raise KvtraceError(f"--arms {','.join(labels)} names an arm twice: list each once")
        check_repeats(self.repeats)
        if not 0 < self.memory_fraction <= 1:
            raise KvtraceError(f"--memory-fraction {self.memory_fraction} is not in (0, 1]")
        for index in range(len(self.arms)):
            cfg = self.server_cfg(index)
            cfg.validate()
            for scenario in self.scenarios:
                self.scenario_cfg(scenario, cfg).validate()


# ---- the plan and its estimate ----------------------------------------------------------------------------

# Seconds, from the H100 recordings of the matrix (matrix.json's timelines, docs/performance.md): a fresh machine's
# first start compiles (430 s for three servers together on 2026-12-06, fixtures/vllm033-h100-counterfactual, 170 s
# of it FlashInfer's attention builds and 139 s its sampler's, which the capture no longer builds:
# vllm_config.child_env); a point's traffic at the bench client's measured durations; a window's export (0.2 s each,
# 8 at a time: 1.2 s for 52 windows); a lone client's imports (28 s, the co-residence check's). Every round's clients
# import while the servers compile: PRESTART_S is what they might outlast it by. On 2026-12-07 two servers without
# the sampler started in 220, 344 and 271 s on three fresh H100 machines (the last fixtures/vllm033-h100-matrix), and
# the clients outlasted none.
START_S, WARMUP_S, PRESTART_S, CHECK_PRESTART_S, POINT_OVERHEAD_S, EXPORT_S = 291.0, 3.5, 5.0, 28.0, 2.0, 0.2
# A point's traced pass (capture/vllm_traced_pass): two waves of short requests, and the 2.5 to 4 s the window's close
# holds the engine, once before the timed traffic instead of inside it.
TRACED_PASS_S = 4.5
LATER_START_S = 180.0  # a server started after the first (130 to 250 s on the H200)
# Fitted to the 26 points of 2026-12-07's traced-pass recording (rounds 1 and 2 on an H100; each point's phase within
# 2.7 s, all of them together 4% under): prefill 40,000 tokens/s, a decode step 6.5 ms.
PREFILL_TOKENS_PER_S, DECODE_STEP_S = 40000.0, 0.0065


def traffic_estimate_s(point: Point) -> float:
    waves = -(-point.num_prompts // point.concurrency)
    prefill = point.num_prompts * (point.input_len + (0 if point.num_prefixes else point.prefix_len))
    prefill += point.num_prefixes * point.prefix_len
    return prefill / PREFILL_TOKENS_PER_S + waves * point.output_len * DECODE_STEP_S


def point_estimate_s(point: Point) -> float:
    """A point's wall time: its traced pass, the prefix-cache resets and its timed traffic."""
    return POINT_OVERHEAD_S + TRACED_PASS_S + traffic_estimate_s(point)


def plan(cfg: MatrixConfig) -> list[dict]:
    """Every step in order: (phase, round, scenario, arm label, point index), each with its estimated seconds."""
    groups = [cfg.arms] if cfg.co_resident else [(arm,) for arm in cfg.arms]
    steps = []
    for position, group in enumerate(groups):
        if position:  # each later arm's server starts on its own, from the first one's compile caches
            steps.append({"phase": "server start", "arm": group[0].label, "seconds": LATER_START_S})
        else:
            steps.append({"phase": "server start and compile", "seconds": START_S})
        steps.append({"phase": "client prestart", "arms": ",".join(a.label for a in group), "seconds": PRESTART_S})
        steps += _rounds(cfg, group)
    if cfg.co_residence_check and cfg.co_resident and len(cfg.arms) > 1:
        steps.append({"phase": "co-residence check", "arm": cfg.arms[0].label,
                      "seconds": point_estimate_s(_check_point(cfg)[1]) + CHECK_PRESTART_S})
    windows = sum(1 for step in steps if step["phase"] == "traffic")
    steps.append({"phase": "export", "seconds": EXPORT_S * windows / max(1, cfg.export_workers)})
    return steps


def _rounds(cfg: MatrixConfig, arms) -> list[dict]:
    steps = []
    for round_ in range(1, cfg.repeats + 1):
        for scenario in cfg.scenarios:
            for spec in arms:
                indices = scenario.point_indices(spec)
                if round_ == 1 and indices:
                    steps.append({"phase": "warm-up", "round": 1, "scenario": scenario.name, "arm": spec.label,
                                  "seconds": WARMUP_S})
                for index in indices:
                    point = scenario.points()[index]
                    steps.append({"phase": "traffic", "round": round_, "scenario": scenario.name, "arm": spec.label,
                                  "point": index, "seconds": point_estimate_s(point)})
    return steps


def _check_point(cfg: MatrixConfig) -> tuple[MatrixScenario, Point, int]:
    """The co-residence check's point: the sweep's lowest load (else the first scenario's first point)."""
    scenario = next((s for s in cfg.scenarios if s.workload.scenario == "sweep"), cfg.scenarios[0])
    return scenario, scenario.points()[0], 0


def dry_run(cfg: MatrixConfig, root: Path, *, nsys: str | None = None, python: str | None = None) -> str:
    cfg.validate()
    nsys = dry_run_nsys(nsys)
    python = python or sys.executable
    steps = plan(cfg)
    total = sum(step["seconds"] for step in steps)
    lines = [f"# kvtrace capture vllm-matrix: {len(cfg.scenarios)} scenarios x arms {', '.join(a.label for a in cfg.arms)}"
             f" x {cfg.repeats} interleaved rounds, {'all servers up at once' if cfg.co_resident else 'one arm after another'}"
             f" (dry run: nothing is started)",
             f"# estimated wall time: {_minutes(total)} (first start on a fresh machine compiles; see docs/performance.md)"]
    for index, spec in enumerate(cfg.arms):
        server = cfg.server_cfg(index)
        env = {**child_env(server), "VLLM_SERVER_DEV_MODE": "1"}
        patch = spec.record()
        if patch:
            lines.append(f"# arm {spec.label}: patch {patch['name']} sha256 {patch['sha256']} as sitecustomize.py "
                         f"first on PYTHONPATH={shlex.quote(str(root / 'servers' / spec.label / 'patch'))}")
        command = vllm_servers.ArmServer(spec, server, root / "servers" / spec.label, nsys, python, {}).command()
        lines.append(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(command))
    for step in steps:
        if step["phase"] == "traffic":
            scenario = next(s for s in cfg.scenarios if s.name == step["scenario"])
            spec = next(a for a in cfg.arms if a.label == step["arm"])
            run = f"{spec.label}.r{step['round']}"
            point = scenario.points()[step["point"]]
            server = cfg.scenario_cfg(scenario, cfg.server_cfg(cfg.arms.index(spec)))
            out = root / scenario.name
            traced = describe(traced_point(point, scenario.profile_steps))
            trace = out / f"{run}.p{step['point']}.sqlite"
            lines.append(f"# {scenario.name} {run} p{step['point']} ({_seconds(step['seconds'])}): POST "
                         f"/reset_prefix_cache; POST /start_profile {{\"max_iterations\": {scenario.profile_steps}}}; "
                         f"the traced pass: {traced} (POST /v1/completions); POST /stop_profile (the window's report "
                         f"-> {shlex.quote(str(trace))}); POST /reset_prefix_cache; then the timed traffic:")
            result = out / f"{run}{point_tag(scenario.workload, step['point'], every=True)}.bench.json"
            lines.append(shlex.join(bench_command(server, python, point, seed=cfg.seed, result=result,
                                                  relay_port="RELAY_PORT")))
        elif step["phase"] == "client prestart":
            lines.append(f"# while {step['arms']} compile: start every client of every round, in the order of their "
                         f"turns and at most one per two cores importing at a time, as `{shlex.quote(python)} "
                         "-m kvtrace.capture.vllm_gated_client -- vllm.entrypoints.cli.main bench serve ...`; once "
                         "the servers are up, wait until each client has imported vLLM; each is released on its turn "
                         f"({_seconds(step['seconds'])})")
        elif step["phase"] == "co-residence check":
            scenario, point, index = _check_point(cfg)
            lines.append(f"# co-residence check: shut every server but {step['arm']}'s down, then {scenario.name} "
                         f"p{index} ({point.spec()}) once more on it alone, into "
                         f"{shlex.quote(str(root / 'checks' / 'co-residence'))} ({_seconds(step['seconds'])})")
        else:
            where = " ".join(str(step[k]) for k in ("round", "scenario", "arm") if k in step)
            lines.append(f"# {step['phase']}{' ' + where if where else ''} ({_seconds(step['seconds'])})")
    patched = [arm.label for arm in cfg.arms if arm.patch]
    if patched:
        lines.append(f"# then {', '.join(patched)} move to {shlex.quote(str(root / 'counterfactual'))}/SCENARIO, beside "
                     "the stock runs of their KV dtype (copied, cut to their points), so that every run directory "
                     "holds two arms")
    return "\n".join(lines) + "\n"


def _seconds(value: float) -> str:
    return f"~{value:.0f} s"


def _minutes(value: float) -> str:
    return f"~{int(value // 60)} min {int(value % 60)} s"


# ---- progress ---------------------------------------------------------------------------------------------

class Progress:
    """A line per phase on stderr: elapsed, what ran, and what remains (the plan's estimate, scaled by how the
    finished steps compared with theirs)."""

    def __init__(self, steps: list[dict], stream=None):
        self.left = sum(step["seconds"] for step in steps)
        self.planned_done = self.actual_done = 0.0
        self.started = time.monotonic()
        self.stream = stream or sys.stderr

    def done(self, text: str, planned_s: float, actual_s: float) -> None:
        self.left = max(0.0, self.left - planned_s)
        self.planned_done += planned_s
        self.actual_done += actual_s
        scale = self.actual_done / self.planned_done if self.planned_done else 1.0
        elapsed = time.monotonic() - self.started
        print(f"[matrix +{elapsed:.0f}s] {text}: {actual_s:.1f} s; {_minutes(self.left * scale)} left",
              file=self.stream, flush=True)
