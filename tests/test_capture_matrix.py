"""The capture matrix (kvtrace capture vllm-matrix) without a GPU, through the stand-ins of tests/vllm_standin.py:
one long-lived server per arm, all up at once, rounds interleaving the arms, the prefix cache reset before every
point, a profile window (and a report, hence a trace) per point, per-phase wall times in the manifests, a patched
arm whose patch reaches its own server only, and the dry run's plan."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from kvtrace.capture import vllm_matrix, vllm_matrix_run
from kvtrace.capture.vllm_config import Workload
from kvtrace.capture.vllm_patches import ArmSpec
from kvtrace.errors import KvtraceError
from kvtrace.manifest import CaptureStatus, RunStatus, WindowStatus, read_manifest
from test_capture_vllm import PROBE_B200, alive, free_port
from test_capture_vllm import standin as vllm_standin  # noqa: F401  (a fixture)


@pytest.fixture
def standin(vllm_standin, monkeypatch):  # noqa: F811
    monkeypatch.setattr(vllm_matrix_run, "probe_environment", lambda python, nvfp4: dict(PROBE_B200))
    return vllm_standin

ARMS = ("fp8", "nvfp4", "nvfp4:validate-once")
# How long a window waits for its predecessor's report where nsys wrote none: the stand-in writes each one before it
# answers /stop_profile, so waiting is only ever for one that will not come.
REPORT_WAIT_S = 0.3


def tiny_matrix(standin, arms=ARMS, repeats=2, **options) -> vllm_matrix.MatrixConfig:
    scenarios = (
        vllm_matrix.MatrixScenario("cold-prefill", Workload.for_scenario(
            "cold-prefill", input_len=32, output_len=1, num_prompts=4, concurrency=2), 8, patched=True),
        vllm_matrix.MatrixScenario("prefix-reuse", Workload.for_scenario(
            "prefix-reuse", input_len=16, output_len=2, num_prompts=8, concurrency=2, prefix_len=32, num_prefixes=2), 8),
        vllm_matrix.MatrixScenario("sweep", Workload.for_scenario(
            "sweep", contexts=(32,), concurrencies=(2, 4, 8), output_len=2, num_prompts=4), 8, patched=True),
    )
    return vllm_matrix.MatrixConfig(model=str(standin.model), arms=tuple(ArmSpec.parse(a) for a in arms),
                                    scenarios=scenarios, repeats=repeats, load_format="dummy", port=free_port(),
                                    **options)


def record(standin, cfg) -> vllm_matrix.MatrixRecord:
    return vllm_matrix_run.capture(cfg, standin.tmp / "matrix", nsys=standin.nsys, startup_timeout_s=60.0,
                                   shutdown_grace_s=30.0, poll_interval_s=0.05)


@pytest.mark.slow
def test_the_matrix_runs_each_arm_on_one_server_with_a_window_per_point(standin):
    cfg = tiny_matrix(standin)
    matrix = record(standin, cfg)
    root = standin.tmp / "matrix"
    calls = standin.calls()
    # One server per arm for the whole matrix, all up at once; the patch only in its own server.
    serves = [c for c in calls if c["call"] == "serve"]
    assert sorted(c["arm"] for c in serves) == ["fp8", "nvfp4", "nvfp4"]
    assert sorted(c["detail"]["patched"] for c in serves) == [False, False, True]
    assert matrix.co_resident is True and matrix.co_resident_fallback is None
    patched_port = cfg.server_cfg(2).port
    assert [c["detail"]["patched"] for c in serves if c["detail"]["port"] == patched_port] == [True]

    # Every point: the prefix cache reset, a window of the scenario's steps around the traced pass (the point's
    # prompt shape, two waves at its concurrency, at most 8 output tokens), the window's stop, the prefix cache reset
    # again, and only then the timed traffic (not recorded as calls here).
    by_server: dict[int, list[dict]] = {}
    for call in calls:
        by_server.setdefault(call["pid"], []).append(call)
    traced_passes = []
    for server_calls in by_server.values():
        kinds = [c["call"] for c in server_calls if c["call"] != "serve"]
        groups = "".join({"reset_prefix_cache": "r", "start_profile": "(", "traced-completion": "t",
                          "stop_profile": ")"}[kind] for kind in kinds).split("r(")
        assert groups[0] == "" and all(re.fullmatch(r"t+\)r", group) for group in groups[1:]), groups
        traced_passes += [group.count("t") for group in groups[1:]]
        assert all(c["detail"] == {"max_iterations": 8, "delay_iterations": 0}
                   for c in server_calls if c["call"] == "start_profile")
    traced = [c["detail"] for c in calls if c["call"] == "traced-completion"]
    assert {(d["prompt_tokens"], d["max_tokens"]) for d in traced} == {(32, 1), (48, 2), (32, 2)}
    assert set(traced_passes) == {4}  # every point's 4 prompts: fewer than two waves of its concurrency

    # Every run directory holds two arms (what `kvtrace matrix` decides between): the scenarios the stock ones, and
    # counterfactual/SCENARIO the patched arm beside the stock arm of its KV dtype, at the patched arm's points.
    assert matrix.counterfactual == ("counterfactual/cold-prefill", "counterfactual/sweep")
    assert not [path for name in ("cold-prefill", "sweep") for path in (root / name).glob("nvfp4-validate-once*")]
    assert (root / "counterfactual" / "sweep" / "nvfp4-validate-once.r1.warmup.bench.log").exists()
    assert (root / "counterfactual" / "sweep" / "nvfp4-validate-once.server.log").exists()
    for name, arms in (("cold-prefill", ["fp8", "nvfp4"]), ("prefix-reuse", ["fp8", "nvfp4"]),
                       ("sweep", ["fp8", "nvfp4"]), ("counterfactual/cold-prefill", ["nvfp4", "nvfp4-validate-once"]),
                       ("counterfactual/sweep", ["nvfp4", "nvfp4-validate-once"])):
        manifest = read_manifest(root / name)
        raw = manifest.raw
        assert raw["status"] == "ok" and raw["request_order_matched"] is True
        # Rounds interleave the arms: A B A B.
        assert [r.name for r in manifest.runs.values()] == raw["settings"]["order"] == [
            f"{arm}.r{k}" for k in (1, 2) for arm in arms]
        assert raw["settings"]["arms"] == arms
        for run in manifest.runs.values():
            entry = raw["arms"][run.name]
            indices = [p["index"] for p in entry["points"]]
            # Each window closed before its point's timed traffic: the traced pass went through it instead.
            assert all(p["traced_pass"]["requests"] == 4 for p in entry["points"])
            assert [w.point for w in run.windows] == indices
            for window in run.windows:
                assert window.status == "exported" and window.sqlite == f"{run.name}.p{window.point}.sqlite"
                assert sqlite3.connect(root / name / window.sqlite).execute(
                    "SELECT value FROM StringIds").fetchone() == ("stand-in",)
                assert run.trace_for(window.point) == window.sqlite
            phases = {(t["phase"], t.get("point")) for t in run.timings}
            assert {("traffic", i) for i in indices} | {("profiling", i) for i in indices} | \
                {("export", i) for i in indices} <= phases
            assert run.server == run.arm and raw["settings"]["servers"][run.server]["start_s"] >= 0
            if run.arm == "nvfp4-validate-once":
                assert run.patch["name"] == "validate-once" and len(run.patch["sha256"]) == 64
                assert run.kv_dtype == "nvfp4"
            else:
                assert run.patch is None
            assert indices == list(range(len(raw["settings"]["points"])))
            if name == "counterfactual/sweep":  # the sweep's low-load points only, renumbered from 0
                assert [p["point"].split("concurrency=")[1] for p in entry["points"]] == ["4", "8"]
            if "copied_from" in entry:  # the stock arm's very runs, cut to those points
                assert run.arm == "nvfp4" and entry["copied_from"] == f"../../{name.split('/')[1]}/{run.name}"
                there = name.split("/")[1]
                shift = 1 if there == "sweep" else 0
                for point in entry["points"]:
                    for suffix in ("bench.json", "sqlite", "requests.json"):
                        assert (root / name / f"{run.name}.p{point['index']}.{suffix}").read_bytes() == (
                            root / there / f"{run.name}.p{point['index'] + shift}.{suffix}").read_bytes()
            for point in entry["points"]:
                stem = f"{run.name}.p{point['index']}"  # every scenario's points, as their traces
                for file in (f"{stem}.bench.json", f"{stem}.metrics.before.prom", f"{stem}.metrics.after.prom",
                             f"{stem}.requests.json"):
                    assert (root / name / file).exists(), file
    # Prefix reuse still hits within a point after the reset (the stand-in client reuses 2 prefixes).
    reuse = json.loads((root / "prefix-reuse" / "manifest.json").read_text())
    counters = reuse["arms"]["fp8.r2"]["points"][0]["metrics"]["deltas"]["counters"]
    assert counters["vllm:prefix_cache_hits_total"] == 6 * 32

    # A scenario the patched arm does not run lists no patch (the H100 matrix's prefix reuse and preemption did).
    assert reuse["settings"]["patches"] == {}

    # The co-residence check: one point on the first arm alone, after the others were shut down.
    check = read_manifest(root / "checks" / "co-residence")
    assert list(check.runs) == ["fp8.r1"] and check.settings["co_residence_check"] == {
        "alone": "fp8", "compares_with": {"run_dir": "sweep", "point": 0}, "beside_idle": ["nvfp4", "nvfp4-validate-once"]}
    sweep = read_manifest(root / "sweep")
    assert check.settings["points"] == sweep.settings["points"][:1]
    assert check.raw["arms"]["fp8.r1"]["points"][0]["point"] == sweep.raw["arms"]["fp8.r1"]["points"][0]["point"]
    phases = [p["phase"] for p in matrix.timeline]
    assert phases[0] == "server start and compile" and phases[-1] == "export"
    # Every round's clients started once, while the servers compiled (and one more for the check).
    assert phases.count("client prestart") == 2 and phases[1] == "client prestart"
    clients = sum(len(s.point_indices(a)) * cfg.repeats + 1 for s in cfg.scenarios for a in cfg.arms
                  if s.point_indices(a))
    assert matrix.timeline[1]["clients"] == clients
    # The other servers' shutdown before the check is a phase of its own, so that the phases add up to the wall time.
    stopped = [p for p in matrix.timeline if p["phase"] == "servers stopped"]
    assert [(p["round"], p["servers"]) for p in stopped] == [("co-residence", 2)]
    assert phases.index("servers stopped") < len(phases) - 1 - phases[::-1].index("client prestart")
    assert not [pid for pid in standin.pids() if alive(pid)]


@pytest.mark.slow
def test_a_server_that_cannot_start_beside_the_others_falls_back_to_one_arm_at_a_time(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_FAIL", "server-exit@nvfp4")
    cfg = tiny_matrix(standin, arms=("fp8", "nvfp4"), repeats=2, co_residence_check=False)
    cfg = vllm_matrix.MatrixConfig(**{**cfg.__dict__, "scenarios": cfg.scenarios[:1]})
    matrix = record(standin, cfg)
    assert matrix.co_resident is False and "nvfp4 did not start" in matrix.co_resident_fallback
    manifest = read_manifest(standin.tmp / "matrix" / "cold-prefill")
    assert manifest.runs["fp8.r1"].status == "ok" and manifest.runs["nvfp4.r1"].status == "failed"
    assert manifest.raw["status"] == "partial" and manifest.raw["settings"]["co_resident"] is False
    # The reader's statuses are the enums the writers assigned, written as their values.
    assert manifest.runs["nvfp4.r1"].status is RunStatus.FAILED and manifest.status is CaptureStatus.PARTIAL
    assert manifest.raw["settings"]["order"] == ["fp8.r1", "fp8.r2", "nvfp4.r1", "nvfp4.r2"]  # arm after arm
    assert manifest.runs["fp8.r2"].status == "ok" and manifest.runs["nvfp4.r2"].status == "failed"
    # Alone, a server keeps vLLM's default memory fraction.
    assert "--gpu-memory-utilization" not in manifest.raw["settings"]["engine_flags"]["fp8"]


@pytest.mark.slow
def test_the_command_says_how_each_run_ended_and_fails_on_a_failed_run(standin, monkeypatch, run_kvtrace):
    """`kvtrace capture vllm-matrix` reads back what it wrote (matrix.json, each run directory's manifest): per run,
    its status and how many of its windows were traced; a failed run makes it exit 1."""
    monkeypatch.setenv("STANDIN_FAIL", "server-exit@nvfp4")
    cold_prefill = tiny_matrix(standin).scenarios[:1]
    monkeypatch.setattr(vllm_matrix, "capacity_scenarios", lambda concurrencies, sweep_prompts: list(cold_prefill))
    code, out, err = run_kvtrace("capture", "vllm-matrix", "--model", str(standin.model), "--out", standin.tmp / "m",
                                 "--arms", "fp8,nvfp4", "--repeats", "1", "--load-format", "dummy", "--port",
                                 str(free_port()), "--no-co-residence-check", "--nsys", standin.nsys)
    lines = out.splitlines()
    assert code == 1 and "cold-prefill/fp8.r1: ok, 1/1 windows traced" in lines, (out, err)
    assert [line for line in lines if line.startswith("cold-prefill/nvfp4.r1: failed, 0/0 windows traced (the nvfp4 "
                                                      "server is not running")]
    assert re.fullmatch(r"matrix: \d+ s in all; co-resident: False", lines[-1])


def test_dry_run_prints_the_whole_plan_with_its_estimate(standin):
    cfg = tiny_matrix(standin)
    text = vllm_matrix.dry_run(cfg, Path("/tmp/m x"), nsys="nsys", python="python3")
    steps = vllm_matrix.plan(cfg)
    total = sum(step["seconds"] for step in steps)
    assert f"~{int(total // 60)} min {int(total % 60)} s" in text.splitlines()[1]
    assert text.count(" bench serve --backend") == sum(1 for s in steps if s["phase"] == "traffic")
    assert "'--output=/tmp/m x/servers/fp8/trace'" in text  # quoted for a shell
    assert "--capture-range-end=repeat" in text and "--gpu-memory-utilization 0.25" in text
    assert text.count("patch validate-once sha256") == 1
    assert "'/tmp/m x/checks/co-residence'" in text and "move to '/tmp/m x/counterfactual'/SCENARIO" in text
    # One arm after another: each later server's start is planned, and no co-residence check.
    apart = vllm_matrix.plan(vllm_matrix.MatrixConfig(**{**cfg.__dict__, "co_resident": False}))
    assert [s.get("arm") for s in apart if s["phase"] == "server start"] == ["nvfp4", "nvfp4-validate-once"]
    assert not [s for s in apart if s["phase"] == "co-residence check"]


@pytest.mark.slow
@pytest.mark.parametrize("dropped,traced", [(1, []), (2, [0]), (3, [0, 1])])
def test_a_missing_report_leaves_windows_untraced_rather_than_misattributed(standin, monkeypatch, dropped, traced):
    """nsys numbers a server's reports in order; one missing would shift every later window onto the wrong report.
    A window keeps its report only while every window up to it found exactly its predecessors' reports when it
    opened and the next found its own; the other server's windows are unaffected."""
    monkeypatch.setenv("STANDIN_FAIL", "drop-window@nvfp4")
    monkeypatch.setenv("STANDIN_DROP_WINDOW", str(dropped))
    cfg = tiny_matrix(standin, arms=("fp8", "nvfp4"), repeats=1, co_residence_check=False, report_wait_s=REPORT_WAIT_S)
    cfg = vllm_matrix.MatrixConfig(**{**cfg.__dict__, "scenarios": cfg.scenarios[2:]})
    record(standin, cfg)
    manifest = read_manifest(standin.tmp / "matrix" / "sweep")
    assert [w.status for w in manifest.runs["fp8.r1"].windows] == ["exported"] * 3
    nvfp4 = manifest.runs["nvfp4.r1"]
    assert [w.point for w in nvfp4.windows if w.status == "exported"] == traced
    assert [nvfp4.trace_for(point) for point in range(3)] == [
        f"nvfp4.r1.p{point}.sqlite" if point in traced else None for point in range(3)]
    first_lost = manifest.raw["arms"]["nvfp4.r1"]["windows"][len(traced)]
    assert first_lost["status"] == "no report" and "2 reports for 3 windows" in first_lost["error"]
    assert nvfp4.windows[len(traced)].status is WindowStatus.NO_REPORT
    assert nvfp4.status == "ok"  # the serving numbers stand


@pytest.mark.slow
def test_reports_written_at_exit_cost_one_wait_and_are_all_attributed(standin, monkeypatch):
    """An nsys that writes a server's reports only when it exits: the second window waits once for the first's
    report, then no more; at the end every window gets its report, by count."""
    monkeypatch.setenv("STANDIN_REPORTS_AT_EXIT", "1")
    cfg = tiny_matrix(standin, arms=("fp8",), repeats=1, co_residence_check=False, report_wait_s=REPORT_WAIT_S)
    cfg = vllm_matrix.MatrixConfig(**{**cfg.__dict__, "scenarios": cfg.scenarios[2:]})
    matrix = record(standin, cfg)
    manifest = read_manifest(standin.tmp / "matrix" / "sweep")
    windows = manifest.raw["arms"]["fp8.r1"]["windows"]
    assert [w["status"] for w in windows] == ["exported"] * 3
    assert [w["report_wait_s"] >= REPORT_WAIT_S for w in windows] == [False, True, False]
    assert matrix.servers["fp8"]["reports_at_exit"] is True


@pytest.mark.slow
def test_a_server_that_refuses_per_window_bounds_is_profiled_with_its_own(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_FAIL", "profile-body-422@fp8")
    cfg = tiny_matrix(standin, arms=("fp8",), repeats=1, co_residence_check=False)
    cfg = vllm_matrix.MatrixConfig(**{**cfg.__dict__, "scenarios": cfg.scenarios[:1]})
    record(standin, cfg)
    run = read_manifest(standin.tmp / "matrix" / "cold-prefill").raw["arms"]["fp8.r1"]
    assert run["status"] == "ok" and run["windows"][0]["status"] == "exported"
    assert "per-window bounds refused (422)" in run["windows"][0]["error"]
    assert [c["detail"] for c in standin.calls() if c["call"] == "start_profile"] == [None]


@pytest.mark.parametrize("arms,message", [
    ("fp8,fp8", "names an arm twice"), ("fp8,nvfp4:nope", "unknown patch 'nope'"), ("fp9", "unknown arm"),
])
def test_bad_arms_are_one_clear_error(standin, arms, message):
    with pytest.raises(KvtraceError, match=message):
        tiny_matrix(standin, arms=tuple(arms.split(","))).validate()


@pytest.mark.parametrize("options,message", [
    ({"repeats": 0}, "--repeats must be at least 1"), ({"memory_fraction": float("nan")}, "--memory-fraction nan"),
    ({"startup_timeout_s": float("nan")}, "--startup-timeout nan"), ({"startup_timeout_s": 0.0}, "--startup-timeout 0"),
])
def test_bad_settings_are_one_clear_error_before_anything_starts(standin, options, message):
    timeout = options.pop("startup_timeout_s", 60.0)
    with pytest.raises(KvtraceError, match=message):
        vllm_matrix_run.capture(tiny_matrix(standin, **options), standin.tmp / "matrix", nsys=standin.nsys,
                                startup_timeout_s=timeout)
    assert not (standin.tmp / "matrix").exists() and not standin.pids()


def test_an_out_that_is_a_link_a_file_or_someone_elses_folder_is_refused(standin, tmp_path):
    cfg = tiny_matrix(standin)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (tmp_path / "link").symlink_to(elsewhere)
    (tmp_path / "file").write_text("x")
    for out, message in ((tmp_path / "link", "is a symbolic link"), (tmp_path / "file", "is a file"),
                         (elsewhere, "holds no kvtrace matrix.json")):
        with pytest.raises(KvtraceError, match=message):
            vllm_matrix_run.capture(cfg, out, nsys=standin.nsys, force=True)
    assert (elsewhere / "keep.txt").read_text() == "mine"


# The validate-once patch (capture/patches/validate-once.py) ------------------------------------------------------

FAKE_PAGE = '''
import math
calls = []
capturing = [False]


def _is_stream_capturing_on_device(device):
    return capturing[0]


def _as_float32_scalar_tensors(values, *, device):
    """FlashInfer 0.7.2.post1's contract, reduced: every CUDA scale copied to the host and checked."""
    calls.append([name for name, _ in values])
    for name, value in values:
        scalar = float(value.item())
        if not math.isfinite(scalar) or scalar <= 0.0:
            raise ValueError(f"{name} must be a positive finite global decode scale")
    return tuple(values_[1] for values_ in values)
'''


def test_validate_once_checks_each_scale_once_and_again_after_any_change(tmp_path, monkeypatch):
    """The patch, loaded as a server loads it (sitecustomize), over a stand-in of FlashInfer's page module and
    scale tensors that look like CUDA scalars: the first call checks, later calls with the same tensors do not copy,
    an in-place change or another tensor is checked again, a bad scale still raises, and graph capture runs the
    original."""
    import importlib
    import sys

    torch = pytest.importorskip("torch")

    class CudaLooking(torch.Tensor):
        is_cuda = property(lambda self: True)
        device = property(lambda self: torch.device("cuda", 0))

    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("")
    (tmp_path / "flashinfer" / "page.py").write_text(FAKE_PAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flashinfer", "flashinfer.page"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    patch = Path(vllm_matrix.__file__).parent / "patches" / "validate-once.py"
    before = list(sys.meta_path)
    try:
        exec(compile(patch.read_text(), str(patch), "exec"), {"__file__": str(patch), "__name__": "sitecustomize"})
        page = importlib.import_module("flashinfer.page")
    finally:
        sys.meta_path[:] = before
    device = torch.device("cuda", 0)
    k, v = torch.ones(1).as_subclass(CudaLooking), torch.full((1,), 0.5).as_subclass(CudaLooking)
    scales = (("k_scale", k), ("v_scale", v))
    assert page._as_float32_scalar_tensors(scales, device=device) == (k, v) and len(page.calls) == 1
    assert page._as_float32_scalar_tensors(scales, device=device) == (k, v) and len(page.calls) == 1
    k.fill_(3.0)  # changed in place: checked again
    page._as_float32_scalar_tensors(scales, device=device)
    assert len(page.calls) == 2
    other = torch.ones(1).as_subclass(CudaLooking)
    page._as_float32_scalar_tensors((("k_scale", other), ("v_scale", v)), device=device)
    assert len(page.calls) == 3
    v.fill_(0.0)  # a bad scale is never skipped
    with pytest.raises(ValueError, match="v_scale must be a positive finite"):
        page._as_float32_scalar_tensors(scales, device=device)
    page.capturing[0] = True
    page._as_float32_scalar_tensors((("k_scale", k), ("v_scale", other)), device=device)
    assert len(page.calls) == 5


def test_a_gated_client_imports_first_and_runs_only_when_released(tmp_path):
    """Started ahead of its point, the client imports its modules, says it is ready and sends nothing until told
    "go"; the end of stdin instead exits without running it."""
    import subprocess
    import sys

    (tmp_path / "fake_bench.py").write_text(
        "import sys\nfrom pathlib import Path\nPath(sys.argv[1]).write_text(' '.join(sys.argv[2:]))\n")
    ran = tmp_path / "ran.txt"
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", "kvtrace.capture.vllm_gated_client", "--preload", "fake_bench_missing", "--",
               "fake_bench", str(ran), "bench", "serve"]
    for release, runs in ((b"go\n", True), (b"", False)):
        ran.unlink(missing_ok=True)
        client = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False, env=env)
        assert client.stdout.readline().startswith(b"kvtrace: not preloaded: fake_bench_missing")
        assert client.stdout.readline().startswith(b"kvtrace: client ready")
        assert not ran.exists()
        client.communicate(release, timeout=60)
        assert client.returncode == 0 and ran.exists() is runs
        assert not runs or ran.read_text() == "bench serve"  # the command's own arguments


def test_clients_start_in_their_turn_with_at_most_so_many_importing_at_once(tmp_path):
    """While the servers start, the clients start in the order of their turns, no more than `at_once` of them
    importing at a time; a halt starts no more, and a client never started is cancelled without error."""
    import sys
    import threading
    import time

    from kvtrace.capture import vllm_servers

    class Client:
        def __init__(self, number):
            self.number, self.started, self.imported = number, False, threading.Event()

        def start(self):
            importing[0] += 1
            peak[0] = max(peak[0], importing[0])
            self.started = True
            order.append(self.number)
            return self

    def past_imports(client):
        return client.imported.is_set()

    def release(client):
        importing[0] -= 1
        client.imported.set()

    def started(count):
        for _ in range(600):
            if len(order) >= count:
                return
            time.sleep(0.05)

    order, importing, peak = [], [0], [0]
    clients = [Client(n) for n in range(7)]
    prestart = vllm_matrix_run._Prestart(clients, at_once=3, past_imports=past_imports)
    started(3)
    time.sleep(0.5)  # had it not waited for imports, all seven would have started by now
    assert order == [0, 1, 2]
    release(clients[1])
    started(4)
    assert order == [0, 1, 2, 3]
    while len(order) < 7:  # each started client imports; the next start then
        for client in clients:
            if client.started and not client.imported.is_set():
                release(client)
        started(len(order) + 1)
    prestart.join()
    assert order == list(range(7)) and peak[0] == 3

    order.clear()
    waiting = [Client(n) for n in range(3)]
    halted = vllm_matrix_run._Prestart(waiting, at_once=1, past_imports=past_imports)
    started(1)
    halted.halt()
    assert order == [0] and not halted.thread.is_alive()
    never_started = vllm_servers.GatedClient([sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"],
                                             {}, tmp_path / "client.log", sys.executable)
    never_started.cancel()
    assert never_started.process.process is None


def test_a_patched_arms_label_names_its_kv_dtype_and_patch():
    """Run names carry KVDTYPE-PATCH (nvfp4-validate-once.r1.*); the floor reads the KV format from them, and a dtype
    whose name has an underscore is not split."""
    from kvtrace import kv_formats

    assert ArmSpec.parse("nvfp4:validate-once").label == "nvfp4-validate-once"
    assert kv_formats.split_arm_label("nvfp4-validate-once") == ("nvfp4", "validate-once")
    assert kv_formats.split_arm_label("nvfp4:validate-once") == ("nvfp4", "validate-once")
    assert kv_formats.split_arm_label("nvfp4_4over6") == ("nvfp4_4over6", None)
    assert kv_formats.split_arm_label("fp8_e4m3-x") == ("fp8_e4m3", "x")
    assert kv_formats.split_arm_label("int4-x") is None and kv_formats.split_arm_label("nvfp4-") is None
    assert kv_formats.canonical_format("nvfp4-validate-once") == "nvfp4"
    assert kv_formats.bytes_per_value("nvfp4-validate-once") == kv_formats.bytes_per_value("nvfp4")
    with pytest.raises(KvtraceError, match="unknown KV format"):
        kv_formats.canonical_format("int4-validate-once")


@pytest.mark.slow
def test_a_matrix_recorded_with_three_arms_per_directory_is_tidied_into_two(standin, monkeypatch):
    """A recording made before the split (patched arms beside both stock arms, the co-residence check at the top):
    `python -m kvtrace.capture.vllm_matrix_split ROOT` gives every run directory two arms, as a new recording has."""
    from kvtrace.capture import vllm_matrix_split

    cfg = tiny_matrix(standin, repeats=1)
    cfg = vllm_matrix.MatrixConfig(**{**cfg.__dict__, "scenarios": cfg.scenarios[2:]})  # the sweep
    with monkeypatch.context() as legacy:
        legacy.setattr(vllm_matrix_split, "CO_RESIDENCE", "co-residence")
        legacy.setattr(vllm_matrix_split, "split", lambda root, scenario: None)
        record(standin, cfg)
    root = standin.tmp / "matrix"
    assert len(read_manifest(root / "sweep").runs) == 3 and (root / "co-residence" / "manifest.json").exists()
    matrix = vllm_matrix_split.tidy(root)
    assert matrix.co_residence_check == "checks/co-residence" and matrix.counterfactual == ("counterfactual/sweep",)
    assert read_manifest(root / "checks" / "co-residence").runs["fp8.r1"].status == "ok"
    assert not (root / "co-residence").exists()
    sweep, counterfactual = read_manifest(root / "sweep"), read_manifest(root / "counterfactual" / "sweep")
    assert list(sweep.runs) == ["fp8.r1", "nvfp4.r1"] and list(counterfactual.runs) == ["nvfp4.r1", "nvfp4-validate-once.r1"]
    for run in counterfactual.runs.values():
        assert [w.sqlite for w in run.windows] == [f"{run.name}.p0.sqlite", f"{run.name}.p1.sqlite"]
        for point in counterfactual.raw["arms"][run.name]["points"]:
            assert (root / "counterfactual" / "sweep" / point["bench_result"]).is_file()
    assert vllm_matrix.read_matrix(root) == matrix  # what it wrote
