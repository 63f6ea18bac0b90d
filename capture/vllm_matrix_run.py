"""Runs a capture matrix (capture/vllm_matrix): servers up, rounds of gated clients, a window per point, the
co-residence check, exports, and the manifests (rewritten after every point, so that an interrupted matrix still
says what finished; reports stay in servers/LABEL/ for a later export).

Standard library only.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import kvtrace.nsys
from kvtrace.capture import runner, vllm_engine, vllm_matrix_split, vllm_servers, vllm_traced_pass
from kvtrace.capture.processes import sigterm_as_interrupt
from kvtrace.capture.vllm_commands import bench_command, point_tag, warmup_point
from kvtrace.capture.vllm_common import request_order_sha256
from kvtrace.capture.vllm_config import ATTENTION_BACKEND, child_env, engine_flags
from kvtrace.capture.vllm_engine import VllmArm, _Session, _write_manifests
from kvtrace.capture.vllm_http import NET_ERRORS
from kvtrace.capture.vllm_kv_events import check_available as check_kv_events_available
from kvtrace.capture.vllm_matrix import (CHECK_PRESTART_S, EXPORT_S, LATER_START_S, MATRIX, PRESTART_S, START_S,
                                         WARMUP_S, MatrixConfig, MatrixRecord, MatrixScenario, Progress, _check_point,
                                         plan, point_estimate_s, read_matrix)
from kvtrace.capture.vllm_preflight import check_model, check_port, check_probe, probe_environment
from kvtrace.errors import KvtraceError
from kvtrace.manifest import RunStatus, WindowStatus, capacity_reason

READY_LINE = "kvtrace: client ready"
PRESTART_LIMIT_S = 300.0
CLIENT_READY_POLL_S = 0.2  # between looks at a prestarted client's log for READY_LINE
# Clients importing at once while the servers start: each import is about 20 s of CPU, and the stock matrix's 56
# clients started together would hold every core through the servers' own imports and FlashInfer builds, which are
# the start's critical path. Half the cores leave the servers theirs.
PRESTART_AT_ONCE = max(1, (os.cpu_count() or 2) // 2)


def _past_imports(client) -> bool:
    """It logged READY_LINE, or it exited (its exit code then says why when its turn comes)."""
    return not client.process.running() or READY_LINE in client.process.log_path.read_text(errors="replace")


def _await_ready(clients) -> None:
    """Until each prestarted client is past its imports, PRESTART_LIMIT_S at most in all."""
    deadline = time.monotonic() + PRESTART_LIMIT_S
    for client in clients:
        while time.monotonic() < deadline and not _past_imports(client):
            time.sleep(CLIENT_READY_POLL_S)


class _Prestart:
    """Starts clients in their order in a thread, at most `at_once` of them importing at a time (after
    PRESTART_LIMIT_S, the rest together). `join` waits for every start; `halt` starts no more."""

    def __init__(self, clients: list, at_once: int = PRESTART_AT_ONCE, past_imports=_past_imports):
        self.clients, self.at_once, self.past_imports = clients, at_once, past_imports
        self.halted, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self._start_in_turn, name="kvtrace-client-prestart", daemon=True)
        self.thread.start()

    def _start_in_turn(self) -> None:
        deadline = time.monotonic() + PRESTART_LIMIT_S
        importing: list = []
        try:
            for client in self.clients:
                while len(importing) >= self.at_once and time.monotonic() < deadline:
                    importing = [c for c in importing if not self.past_imports(c)]
                    if len(importing) >= self.at_once and self.halted.wait(CLIENT_READY_POLL_S):
                        return
                if self.halted.is_set():
                    return
                client.start()
                importing.append(client)
        except OSError as failure:  # raised where the clients are awaited, as when they were started there
            self.error = failure

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error

    def halt(self) -> None:
        self.halted.set()
        self.thread.join()


@dataclass
class MatrixRun(VllmArm):
    server: str = ""  # the server (arm label) whose lifetime this run belonged to: settings.servers
    patch: dict | None = None  # the engine patch of a counterfactual arm (capture/vllm_patches)
    windows: list[dict] = field(default_factory=list)
    timings: list[dict] = field(default_factory=list)  # {"phase", "point", "seconds"}: traffic, profiling, export


@dataclass
class _Scenario:
    spec: MatrixScenario
    out: Path
    settings: dict
    runs: dict[tuple[str, int], MatrixRun] = field(default_factory=dict)  # (arm label, round)


def capture(cfg: MatrixConfig, root: Path, *, force: bool = False, nsys: str | None = None, python: str | None = None,
            startup_timeout_s: float = 1800.0, shutdown_grace_s: float = 300.0,
            poll_interval_s: float | None = None, progress_stream=None) -> MatrixRecord:
    from kvtrace.capture.vllm_commands import POLL_INTERVAL_S

    cfg.validate()
    if not 0 < startup_timeout_s < math.inf:
        raise KvtraceError(f"--startup-timeout {startup_timeout_s} is not a number of seconds above 0: give e.g. 900")
    python = python or sys.executable
    poll_interval_s = POLL_INTERVAL_S if poll_interval_s is None else poll_interval_s
    first = cfg.server_cfg(0)
    model = check_model(first)
    nsys_path = kvtrace.nsys.find_nsys(nsys)
    for index in range(len(cfg.arms)):
        server = cfg.server_cfg(index)
        check_port(server.host, server.port)
        check_port("127.0.0.1", server.kv_events_port)
    check_kv_events_available()
    probe = probe_environment(python, any(a.kv_dtype.startswith("nvfp4") for a in cfg.arms))
    check_probe(probe, tuple(sorted({a.kv_dtype for a in cfg.arms})), 1)
    runner.prepare_run_dir(root, force, what="matrix root", whats="matrix roots", holding="a matrix", marker=MATRIX,
                           owned=lambda folder: (folder / MATRIX).is_file())
    environment = vllm_engine.capture_environment(nsys_path, probe)
    env = {**os.environ, **child_env(first), "VLLM_SERVER_DEV_MODE": "1"}  # mounts POST /reset_prefix_cache
    matrix = _Matrix(cfg, root, nsys_path, python, env, environment, model, startup_timeout_s, shutdown_grace_s,
                     poll_interval_s, Progress(plan(cfg), progress_stream))
    return matrix.run()


class _Matrix:
    def __init__(self, cfg, root, nsys, python, env, environment, model, startup_timeout_s, shutdown_grace_s,
                 poll_interval_s, progress):
        self.cfg, self.root, self.nsys, self.python, self.env = cfg, root, nsys, python, env
        self.environment, self.model = environment, model
        self.startup_timeout_s, self.shutdown_grace_s, self.poll_interval_s = startup_timeout_s, shutdown_grace_s, poll_interval_s
        self.progress = progress
        self.timeline: list[dict] = []  # every phase with its wall time, for matrix.json
        self.co_resident, self.fallback = cfg.co_resident, None
        self.servers = self._new_servers()
        self.scenarios = [self._scenario(s) for s in cfg.scenarios]
        self.check: _Scenario | None = None
        self.error: str | None = None  # what stopped the matrix early, if anything did
        self.counterfactual: list[str] = []  # run directories of the patched arms, once split off

    # -- setup --
    def _new_servers(self) -> list[vllm_servers.ArmServer]:
        return [vllm_servers.ArmServer(spec, self._server_cfg(i), self.root / "servers" / spec.label, self.nsys,
                                       self.python, self.env) for i, spec in enumerate(self.cfg.arms)]

    def _server_cfg(self, index):
        from dataclasses import replace

        cfg = self.cfg.server_cfg(index)
        return cfg if self.co_resident else replace(cfg, extra_args=self.cfg.extra_args)

    def _settings(self, spec: MatrixScenario, arms, repeats: int) -> dict:
        workload = spec.workload
        return {
            "scenario": workload.scenario, "mode": "serve", "model": self.model,
            "arms": [a.label for a in arms], "repeats": repeats,
            "order": [f"{a.label}.r{k}" for k in range(1, repeats + 1) for a in arms],
            "profile_steps": spec.profile_steps, "attention_backend": ATTENTION_BACKEND,
            "load_format": self.cfg.load_format, "seed": self.cfg.seed, "prefix_caching": True,
            "prefix_cache_reset": "POST /reset_prefix_cache before every point (VLLM_SERVER_DEV_MODE=1)",
            "points": [point.spec() for point in spec.points()],
            "extra_vllm_args": list(self.cfg.extra_args), "env": child_env(self._server_cfg(0)),
            "patches": {a.label: a.record() for a in self.cfg.arms if a.patch and spec.point_indices(a)},
            "request_order_basis": "the bench client's dataset arguments and seed (it draws the prompts from them)",
            "matrix": {"root": "..", "file": f"../{MATRIX}", "run_dir": spec.name},
        }

    def _scenario(self, spec: MatrixScenario, arms=None, repeats: int | None = None) -> _Scenario:
        arms = [a for a in (arms or self.cfg.arms) if spec.point_indices(a)]
        repeats = repeats or self.cfg.repeats
        out = self.root / spec.name
        out.mkdir(parents=True, exist_ok=True)
        scenario = _Scenario(spec, out, self._settings(spec, arms, repeats))
        for round_ in range(1, repeats + 1):
            for arm in arms:
                scenario.runs[(arm.label, round_)] = MatrixRun(
                    name=f"{arm.label}.r{round_}", arm=arm.label, repeat=round_, kv_cache_dtype=arm.kv_dtype,
                    log=f"{arm.label}.server.log", server=arm.label, patch=arm.record())
        return scenario

    def _write(self, scenario: _Scenario, interrupted: bool = False) -> dict:
        scenario.settings["servers"] = {s.spec.label: s.record() for s in self.servers}
        scenario.settings["engine_flags"] = {s.spec.label: engine_flags(s.cfg, s.spec.kv_dtype) for s in self.servers}
        scenario.settings["co_resident"] = self.co_resident
        if not self.co_resident:  # one arm's rounds after another's
            scenario.settings["order"] = sorted(scenario.settings["order"], key=lambda name: [
                a.label for a in self.cfg.arms].index(name.rsplit(".r", 1)[0]))
        if self.fallback:
            scenario.settings["co_resident_fallback"] = self.fallback
        for run in scenario.runs.values():
            windows = [w for s in self.servers for w in s.windows if w.run_dir == scenario.out and w.run == run.name]
            run.windows = [w.record() for w in windows]
            # What a reader of older manifests takes as the run's one trace, covering its first point.
            first = [w for w in windows if run.points and w.point == run.points[0]["index"]]
            run.sqlite = first[0].sqlite if first and first[0].status == WindowStatus.EXPORTED else None
            server = next(s for s in self.servers if s.spec.label == run.server)
            run.kv_cache = server.kv_cache
        return _write_manifests(scenario.out, self.environment, scenario.settings, list(scenario.runs.values()),
                                interrupted)

    def _write_all(self, interrupted: bool = False) -> None:
        for scenario in self.scenarios + ([self.check] if self.check else []):
            self._write(scenario, interrupted)
        self._write_matrix()

    def _write_matrix(self) -> None:
        runner.write_json_atomic(self.root / MATRIX, {
            "kvtrace_matrix": 1, "scenarios": [s.spec.name for s in self.scenarios],
            "co_residence_check": self.check.spec.name if self.check else None,
            "counterfactual": self.counterfactual,
            "arms": [{"label": a.label, "kv_cache_dtype": a.kv_dtype, "patch": a.record()} for a in self.cfg.arms],
            "repeats": self.cfg.repeats, "co_resident": self.co_resident, "co_resident_fallback": self.fallback,
            "servers": {s.spec.label: s.record() for s in self.servers}, "timeline": self.timeline, "error": self.error,
            "seconds": round(sum(p["seconds"] for p in self.timeline), 1)})

    def _phase(self, name: str, started: float, planned_s: float, **where) -> float:
        seconds = round(time.monotonic() - started, 2)
        self.timeline.append({"phase": name, **where, "seconds": seconds})
        label = " ".join([name] + [f"{k} {v}" for k, v in where.items()])
        self.progress.done(label, planned_s, seconds)
        return seconds

    # -- servers --
    def _start(self, servers, while_compiling=lambda: None) -> list:
        started = time.monotonic()
        for server in servers:
            server.start()
        while_compiling()
        failed = []
        for server in servers:
            try:
                server.wait_ready(self.startup_timeout_s)
            except (*NET_ERRORS, RuntimeError) as failure:
                server.error = f"{failure} (see {server.log})"
                failed.append(server)
        first = not any(p["phase"] == "server start and compile" for p in self.timeline)
        self._phase("server start and compile", started, START_S if first else LATER_START_S,
                    servers=",".join(s.spec.label for s in servers))
        return failed

    def _stop(self, servers) -> None:
        """All at once: each nsys writes its last report while the others do."""
        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
            list(pool.map(lambda server: server.stop(self.shutdown_grace_s), servers))

    # -- traffic --
    def _spawn_clients(self, servers) -> dict:
        """Every client of every round on these servers, not yet started: a _Prestart starts them while the servers
        compile, so that their imports (about 20 s of CPU each) cost no wall time of their own and none runs beside
        a measured point. Keyed by (round, scenario, arm label, point index or "warm-up"), in the order of their
        turns."""
        clients = {}
        for round_ in range(1, self.cfg.repeats + 1):
            for scenario in self.scenarios:
                for server in servers:
                    run = scenario.runs.get((server.spec.label, round_))
                    if run is None:
                        continue
                    indices = scenario.spec.point_indices(server.spec)
                    if round_ == 1:
                        cfg = self.cfg.scenario_cfg(scenario.spec, server.cfg)
                        warm = bench_command(cfg, self.python, warmup_point(scenario.spec.points()[indices[0]]),
                                             seed=self.cfg.seed + 1, result=None, relay_port=server.relay.port)
                        clients[(1, scenario.spec.name, server.spec.label, "warm-up")] = self._client(
                            warm, scenario.out / f"{run.name}.warmup.bench.log")
                    for index in indices:
                        clients[(round_, scenario.spec.name, server.spec.label, index)] = self._point_client(
                            scenario, server, run, index)
        return clients

    def _point_client(self, scenario: _Scenario, server, run: MatrixRun, index: int) -> vllm_servers.GatedClient:
        """The bench client of one point of a run, writing its result and log beside the run's other files."""
        cfg = self.cfg.scenario_cfg(scenario.spec, server.cfg)
        stem = f"{run.name}{point_tag(scenario.spec.workload, index, every=True)}"
        command = bench_command(cfg, self.python, scenario.spec.points()[index], seed=self.cfg.seed,
                                result=scenario.out / f"{stem}.bench.json", relay_port=server.relay.port)
        return self._client(command, scenario.out / f"{stem}.bench.log")

    def _await_clients(self, clients: dict, servers, prestart: _Prestart) -> None:
        """Until every client of a server that came up is past its imports; the others' clients are cancelled."""
        started = time.monotonic()
        labels = {s.spec.label for s in servers if s.up()}
        if labels:
            prestart.join()
        else:  # no client of these servers will run
            prestart.halt()
        _cancel(clients, lambda key: key[2] not in labels)
        _await_ready(clients.values())
        self._phase("client prestart", started, PRESTART_S, rounds=self.cfg.repeats, clients=len(clients))

    def _client(self, command, log: Path) -> vllm_servers.GatedClient:
        return vllm_servers.GatedClient(command, self.env, log, self.python)

    def _round(self, round_: int, servers, clients: dict) -> None:
        try:
            for scenario in self.scenarios:
                for server in servers:
                    run = scenario.runs.get((server.spec.label, round_))
                    if run is not None:
                        self._run(scenario, server, run, clients, round_)
        finally:  # a failed run's clients that never got their turn
            _cancel(clients, lambda key: key[0] == round_)

    def _run(self, scenario: _Scenario, server, run: MatrixRun, clients: dict, round_: int) -> None:
        cfg = self.cfg.scenario_cfg(scenario.spec, server.cfg)
        session = _Session(cfg, scenario.out, self.nsys, self.python, self.env, self.startup_timeout_s,
                           self.shutdown_grace_s, self.poll_interval_s)
        bench_log = scenario.out / f"{run.name}.bench.log"
        started = time.monotonic()
        try:
            if not server.up():
                raise RuntimeError(f"the {server.spec.label} server is not running ({server.error or 'it exited'})")
            warm = clients.pop((round_, scenario.spec.name, server.spec.label, "warm-up"), None)
            if warm is not None:
                begun = time.monotonic()
                if warm.run() != 0:
                    raise RuntimeError("the warm-up `vllm bench serve` failed")
                server.timings.setdefault("warmup_s", {})[scenario.spec.name] = self._phase(
                    "warm-up", begun, WARMUP_S, scenario=scenario.spec.name, arm=server.spec.label)
                server.relay.take()
            for index in scenario.spec.point_indices(server.spec):
                self._point(scenario, server, run, session, index,
                            clients.pop((round_, scenario.spec.name, server.spec.label, index)), bench_log)
            run.status = RunStatus.OK
        except (*NET_ERRORS, RuntimeError, ValueError) as failure:
            run.status, run.error = RunStatus.FAILED, f"{failure} (see {run.name}*.bench.log, {run.log})"
        except KeyboardInterrupt:
            run.status, run.error = RunStatus.FAILED, "interrupted (Ctrl-C or SIGTERM); its processes were shut down"
            raise
        finally:
            run.seconds = round((run.seconds or 0) + time.monotonic() - started, 1)
            hashes = [p["request_order_sha256"] for p in run.points]
            run.request_order_sha256 = request_order_sha256(hashes) if hashes else None
            self._write(scenario)

    def _point(self, scenario: _Scenario, server, run: MatrixRun, session, index: int, client, bench_log: Path) -> None:
        point = scenario.spec.points()[index]
        begun = time.monotonic()
        traced = self._traced_pass(scenario, server, run, index, point)
        profiling = time.monotonic() - begun
        server.reset_prefix_cache()
        record = vllm_engine._serve_point(session, run, index, point, bench_log, server.relay, server.events,
                                          run_bench=lambda command: client.run())
        record["traced_pass"] = traced
        record["capacity"] = capacity_reason(point, record["metrics"]["deltas"], record["metrics"]["peaks"],
                                             (server.kv_cache or {}).get("tokens"))
        run.timings += [{"phase": "traffic", "point": index, "seconds": record["seconds"]},
                       {"phase": "profiling", "point": index, "seconds": round(profiling, 2)}]
        self._phase("traffic", begun, _planned(scenario, index), scenario=scenario.spec.name, run=run.name,
                    point=index)
        self._write(scenario)

    def _traced_pass(self, scenario: _Scenario, server, run: MatrixRun, index: int, point) -> dict:
        """The point's window around its traced pass (capture/vllm_traced_pass), closed before the timed traffic:
        closing it holds the engine while nsys collects the range."""
        server.reset_prefix_cache()
        window = vllm_servers.Window(scenario.out, run.name, index, scenario.spec.profile_steps)
        server.open_window(window, self.cfg.report_wait_s)
        if server.reports_at_exit:  # one nsys writes every server's reports alike: no other server waits to learn it
            for other in self.servers:
                other.reports_at_exit = True
        try:
            traced = vllm_traced_pass.send(server.base, server.cfg.model,
                                           vllm_traced_pass.traced_point(point, scenario.spec.profile_steps),
                                           self.cfg.seed, self.model.get("vocab_size"))
        finally:
            # vLLM refuses a new /start_profile while a session is open: close it even when the pass failed.
            with contextlib.suppress(*NET_ERRORS, RuntimeError):
                closing = time.monotonic()
                server.close_window(window)
                window.close_s = round(time.monotonic() - closing, 2)
        if window.status != WindowStatus.CLOSED:
            raise RuntimeError(window.error or "the profile window did not close")
        return traced

    # -- the whole matrix --
    def run(self) -> MatrixRecord:
        self._write_all()
        with sigterm_as_interrupt():
            try:
                self._record()
            except KeyboardInterrupt:
                self._stop(self.servers)
                self._write_all(interrupted=True)
                raise
            except Exception as failure:  # a fault of kvtrace's own: what was recorded is still exported
                self.error = f"{type(failure).__name__}: {failure}"
                traceback.print_exc()
            finally:
                self._stop(self.servers)
            started = time.monotonic()
            windows = [w for s in self.servers for w in s.windows]
            vllm_servers.export_windows(windows, self.nsys, self.cfg.export_workers)
            self._phase("export", started, EXPORT_S * len(windows) / max(1, self.cfg.export_workers), windows=len(windows))
            for scenario in self.scenarios + ([self.check] if self.check else []):
                for run in scenario.runs.values():
                    run.timings += [{"phase": "export", "point": w.point, "seconds": w.export_s}
                                   for s in self.servers for w in s.windows
                                   if w.run_dir == scenario.out and w.run == run.name and w.export_s is not None]
                    server = next(s for s in self.servers if s.spec.label == run.server)
                    if server.log.exists():
                        shutil.copyfile(server.log, scenario.out / run.log)
            self._write_all()
            try:
                self.counterfactual = [str(moved.relative_to(self.root)) for scenario in self.scenarios
                                       if (moved := vllm_matrix_split.split(self.root, scenario.spec.name))]
            except (OSError, ValueError, KeyError) as failure:  # the scenario directories stay as recorded
                self.error = f"moving the counterfactual arms failed: {type(failure).__name__}: {failure}"
            self._write_matrix()
        return read_matrix(self.root)

    def _record(self) -> None:
        groups = [self.servers] if self.co_resident else [[s] for s in self.servers]
        clients: dict = {}
        prestarts: list[_Prestart] = []

        def spawn(group):
            def prestart():
                made = self._spawn_clients(group)
                clients.update(made)
                prestarts.append(_Prestart(list(made.values())))
            return prestart

        def halt_and_cancel():  # no client may start after its cancel
            for prestart in prestarts:
                prestart.halt()
            _cancel(clients, lambda key: True)

        try:
            failed = self._start(groups[0], spawn(groups[0]))
            if failed and self.co_resident and len(self.servers) > 1:
                self.fallback = (f"{', '.join(s.spec.label for s in failed)} did not start beside the others "
                                 f"({failed[0].error}); the arms ran one after another")
                halt_and_cancel()
                self._stop(self.servers)
                shutil.rmtree(self.root / "servers", ignore_errors=True)
                self.co_resident = False
                self.servers = self._new_servers()
                groups = [[s] for s in self.servers]
                self._start(groups[0], spawn(groups[0]))
            for position, group in enumerate(groups):
                if position:
                    self._start(group, spawn(group))
                self._await_clients(clients, group, prestarts[-1])
                for round_ in range(1, self.cfg.repeats + 1):
                    self._round(round_, group, clients)
                if not self.co_resident:
                    self._stop(group)
        finally:
            halt_and_cancel()
        if self.co_resident and self.cfg.co_residence_check and len(self.servers) > 1 and self.servers[0].up():
            self._co_residence_check()

    def _co_residence_check(self) -> None:
        """One point again on the first arm with every other server shut down: A alone against A beside idle B."""
        from dataclasses import replace

        stopping = time.monotonic()
        self._stop(self.servers[1:])  # inside the timeline, which must add up to the wall time
        self._phase("servers stopped", stopping, 0.0, round="co-residence", servers=len(self.servers) - 1)
        compared, point, index = _check_point(self.cfg)
        first = self.servers[0]
        # Exactly that point, as point 0 of a run directory of its own.
        # Below checks/, where `kvtrace matrix ROOT` (one level of run directories) does not take it for a scenario
        # missing its other arm.
        spec = replace(compared, name=vllm_matrix_split.CO_RESIDENCE,
                       workload=replace(compared.workload, followed=(point,), followed_from=f"{compared.name} point {index}"))
        self.check = self._scenario(spec, arms=[first.spec], repeats=1)
        self.check.settings["co_residence_check"] = {
            "alone": first.spec.label, "compares_with": {"run_dir": compared.name, "point": index},
            "beside_idle": [s.spec.label for s in self.servers[1:]]}
        clients = self._prestart_check(first)
        try:
            self._run(self.check, first, self.check.runs[(first.spec.label, 1)], clients, 1)
        finally:
            _cancel(clients, lambda key: True)

    def _prestart_check(self, server) -> dict:
        started = time.monotonic()
        client = self._point_client(self.check, server, self.check.runs[(server.spec.label, 1)], 0).start()
        _await_ready([client])
        self._phase("client prestart", started, CHECK_PRESTART_S, round="co-residence")
        return {(1, self.check.spec.name, server.spec.label, 0): client}


def _cancel(clients: dict, which) -> None:
    for key in [key for key in clients if which(key)]:
        clients.pop(key).cancel()


def _planned(scenario: _Scenario, index: int) -> float:
    return point_estimate_s(scenario.spec.points()[index])
