"""The capture matrix (kvtrace capture vllm-matrix) without a GPU, through the stand-ins of tests/vllm_standin.py:
one long-lived server per arm, all up at once, rounds interleaving the arms, the prefix cache reset before every
point, a profile window (and a report, hence a trace) per point, per-phase wall times in the manifests, a patched
arm whose patch reaches its own server only, and the dry run's plan."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from kvtrace.capture import vllm_matrix, vllm_matrix_run
from kvtrace.capture.vllm_config import Workload
from kvtrace.capture.vllm_patches import ArmSpec
from kvtrace.errors import KvtraceError
from kvtrace.manifest import read_manifest
from test_capture_vllm import PROBE_B200, alive, free_port
from test_capture_vllm import standin as vllm_standin  # noqa: F401  (a fixture)


@pytest.fixture
def standin(vllm_standin, monkeypatch):  # noqa: F811
    monkeypatch.setattr(vllm_matrix_run, "probe_environment", lambda python, nvfp4: dict(PROBE_B200))
    return vllm_standin

ARMS = ("fp8", "nvfp4", "nvfp4:validate-once")


def tiny_matrix(standin, arms=ARMS, repeats=2, **options) -> vllm_matrix.MatrixConfig:
    scenarios = (
        vllm_matrix.MatrixScenario("cold-prefill", Workload.for_scenario(
            "cold-prefill", input_len=32, output_len=1, num_prompts=4, concurrency=2), 8, patched=True),
        vllm_matrix.MatrixScenario("prefix-reuse", Workload.for_scenario(
            "prefix-reuse", input_len=16, output_len=2, num_prompts=8, concurrency=2, prefix_len=32, num_prefixes=2), 8),
        vllm_matrix.MatrixScenario("sweep", Workload.for_scenario(
            "sweep", contexts=(32,), concurrencies=(4, 8, 12), output_len=2, num_prompts=4), 8, patched=True),
    )
    return vllm_matrix.MatrixConfig(model=str(standin.model), arms=tuple(ArmSpec.parse(a) for a in arms),
                                    scenarios=scenarios, repeats=repeats, load_format="dummy", port=free_port(),
                                    **options)


def record(standin, cfg) -> dict:
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
    assert matrix["co_resident"] is True and matrix["co_resident_fallback"] is None
    patched_port = cfg.server_cfg(2).port
    assert [c["detail"]["patched"] for c in serves if c["detail"]["port"] == patched_port] == [True]

    # Every point: the prefix cache reset, then a window of the scenario's steps, then its stop.
    by_server: dict[int, list[dict]] = {}
    for call in calls:
        by_server.setdefault(call["pid"], []).append(call)
    for server_calls in by_server.values():
        kinds = [c["call"] for c in server_calls if c["call"] != "serve"]
        assert kinds == ["reset_prefix_cache", "start_profile", "stop_profile"] * (len(kinds) // 3)
        assert all(c["detail"] == {"max_iterations": 8, "delay_iterations": 0}
                   for c in server_calls if c["call"] == "start_profile")

    for name, expected_runs in (("cold-prefill", 6), ("prefix-reuse", 4), ("sweep", 6)):
        manifest = read_manifest(root / name)
        raw = manifest.raw
        assert raw["status"] == "ok" and len(manifest.runs) == expected_runs
        # Rounds interleave the arms: A B (C) A B (C).
        assert [r.name for r in manifest.runs.values()] == raw["settings"]["order"]
        assert raw["settings"]["order"][:2] == ["fp8.r1", "nvfp4.r1"]
        for run in manifest.runs.values():
            entry = raw["arms"][run.name]
            indices = [p["index"] for p in entry["points"]]
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
                if name == "sweep":  # the patched arm runs the sweep's low-load points only
                    assert [manifest.settings["points"][i].split("concurrency=")[1] for i in indices] == ["4", "8"]
            else:
                assert run.patch is None and len(indices) == len(raw["settings"]["points"])
            for point in entry["points"]:
                stem = f"{run.name}.p{point['index']}" if name == "sweep" else run.name
                for file in (f"{stem}.bench.json", f"{stem}.metrics.before.prom", f"{stem}.metrics.after.prom",
                             f"{stem}.requests.json"):
                    assert (root / name / file).exists(), file
    # Prefix reuse still hits within a point after the reset (the stand-in client reuses 2 prefixes).
    reuse = json.loads((root / "prefix-reuse" / "manifest.json").read_text())
    counters = reuse["arms"]["fp8.r2"]["points"][0]["metrics"]["deltas"]["counters"]
    assert counters["vllm:prefix_cache_hits_total"] == 6 * 32

    # The co-residence check: one point on the first arm alone, after the others were shut down.
    check = read_manifest(root / "co-residence")
    assert list(check.runs) == ["fp8.r1"] and check.settings["co_residence_check"]["beside_idle"] == [
        "nvfp4", "nvfp4-validate-once"]
    phases = [p["phase"] for p in matrix["timeline"]]
    assert phases[0] == "server start and compile" and phases[-1] == "export"
    assert phases.count("client prestart") == cfg.repeats + 1
    assert not [pid for pid in standin.pids() if alive(pid)]


def test_a_server_that_cannot_start_beside_the_others_falls_back_to_one_arm_at_a_time(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_FAIL", "server-exit@nvfp4")
    cfg = tiny_matrix(standin, arms=("fp8", "nvfp4"), repeats=2, co_residence_check=False)
    cfg = vllm_matrix.MatrixConfig(**{**cfg.__dict__, "scenarios": cfg.scenarios[:1]})
    matrix = record(standin, cfg)
    assert matrix["co_resident"] is False and "nvfp4 did not start" in matrix["co_resident_fallback"]
    manifest = read_manifest(standin.tmp / "matrix" / "cold-prefill")
    assert manifest.runs["fp8.r1"].status == "ok" and manifest.runs["nvfp4.r1"].status == "failed"
    assert manifest.raw["status"] == "partial" and manifest.raw["settings"]["co_resident"] is False
    assert manifest.raw["settings"]["order"] == ["fp8.r1", "fp8.r2", "nvfp4.r1", "nvfp4.r2"]  # arm after arm
    assert manifest.runs["fp8.r2"].status == "ok" and manifest.runs["nvfp4.r2"].status == "failed"
    # Alone, a server keeps vLLM's default memory fraction.
    assert "--gpu-memory-utilization" not in manifest.raw["settings"]["engine_flags"]["fp8"]


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


def test_a_missing_report_leaves_that_servers_windows_untraced_rather_than_misattributed(standin, monkeypatch):
    """nsys numbers a server's reports in order; one missing would shift every later window onto the wrong report.
    With fewer reports than windows no window of that server gets one; the other server's are unaffected."""
    monkeypatch.setenv("STANDIN_FAIL", "drop-window@nvfp4")
    cfg = tiny_matrix(standin, arms=("fp8", "nvfp4"), repeats=1, co_residence_check=False)
    cfg = vllm_matrix.MatrixConfig(**{**cfg.__dict__, "scenarios": cfg.scenarios[2:]})
    record(standin, cfg)
    manifest = read_manifest(standin.tmp / "matrix" / "sweep")
    assert [w.status for w in manifest.runs["fp8.r1"].windows] == ["exported"] * 3
    nvfp4 = manifest.runs["nvfp4.r1"]
    assert [w.status for w in nvfp4.windows] == ["no report"] * 3 and nvfp4.sqlite is None
    assert "2 reports for 3 windows" in manifest.raw["arms"]["nvfp4.r1"]["windows"][0]["error"]
    assert nvfp4.trace_for(0) is None and nvfp4.status == "ok"  # the serving numbers stand


@pytest.mark.parametrize("arms,message", [
    ("fp8,fp8", "names an arm twice"), ("fp8,nvfp4:nope", "unknown patch 'nope'"), ("fp9", "unknown arm"),
])
def test_bad_arms_are_one_clear_error(standin, arms, message):
    with pytest.raises(KvtraceError, match=message):
        tiny_matrix(standin, arms=tuple(arms.split(","))).validate()


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
