"""The vLLM capture engine without a GPU: command lines, preflight, metrics, manifests and process cleanup.

Serving runs go through stand-ins (tests/vllm_standin.py): a fake nsys that runs its target and writes a
report, and a fake `vllm` package whose `serve` is a small HTTP server with vLLM's endpoints and metric
names, whose `bench serve` posts to it, and whose `LLM` class serves the real offline worker.
Metric parsing is checked on the example pages in fixtures/vllm-recorded/ (see its README).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import kvtrace.nsys
import vllm_standin
from conftest import SERVE_RUNS
from kvtrace.capture import cli as capture_cli
from kvtrace.capture import vllm_commands as commands
from kvtrace.capture import vllm_config
from kvtrace.capture import vllm_engine as engine
from kvtrace.capture import vllm_http as http
from kvtrace.capture import vllm_preflight as preflight
from kvtrace.capture import vllm_offline_workload as worker
from kvtrace.capture.vllm_common import (build_prompts, metric_deltas, parse_kv_cache_log, request_order_sha256,
                                         update_peaks)
from kvtrace.analyzer import serving
from kvtrace.manifest import Point, capacity_reason, read_manifest
from kvtrace.errors import KvtraceError

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
RECORDED = ROOT / "fixtures" / "vllm-recorded"
TINY = ROOT / "fixtures" / "models" / "llama-tiny"
GOLDEN = TESTS / "golden" / "vllm"

PROBE_B200 = {"vllm": "0.33.0", "torch": "2.11.0+cu130", "flashinfer-python": "0.6.16", "prometheus-client": "0.26.0",
              "cuda_runtime": "13.0", "gpu_count": 1, "gpu_name": "NVIDIA B200", "capability": [10, 0],
              "vllm_nvfp4_kv": True}


def recorded(name: str) -> dict:
    return http.parse_metrics((RECORDED / name).read_text())


def config(scenario="cold-prefill", mode="serve", arms=("fp8", "nvfp4"), model="/models/llama-tiny", extra=(),
           load_format="dummy", port=8000, repeats=1, **workload) -> vllm_config.VllmCapture:
    return vllm_config.VllmCapture(model=model, workload=vllm_config.Workload.for_scenario(scenario, **workload), arms=arms,
                              mode=mode, load_format=load_format, port=port, extra_args=tuple(extra), repeats=repeats)


# Command lines ---------------------------------------------------------------------------------------------

GOLDEN_CASES = [(scenario, mode) for mode in vllm_config.MODES for scenario in vllm_config.SCENARIOS]


@pytest.mark.parametrize("scenario,mode", GOLDEN_CASES)
def test_dry_run_matches_golden(scenario, mode, monkeypatch):
    monkeypatch.setattr(kvtrace.nsys, "find_nsys", lambda explicit=None: "nsys")
    arms = ("fp8", "nvfp4") if mode == "serve" else ("auto", "fp8")
    text = commands.dry_run(config(scenario, mode, arms), Path("runs/demo"), python="python3")
    golden = GOLDEN / f"{scenario}.{mode}.txt"
    if os.environ.get("KVTRACE_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()


@pytest.mark.parametrize("mode", vllm_config.MODES)
@pytest.mark.parametrize("scenario", vllm_config.SCENARIOS)
def test_arms_differ_only_in_kv_dtype(scenario, mode):
    cfg = config(scenario, mode, extra=("--max-model-len", "8192"))
    out = Path("runs/x")
    if mode == "serve":
        first, second = (commands.server_command(cfg, arm, out, "nsys", "python3") for arm in ("fp8", "nvfp4"))
    else:
        points = cfg.workload.points(mode)
        first, second = (commands.worker_command(cfg, arm, out, "nsys", "python3", points, False)
                         for arm in ("fp8", "nvfp4"))
    assert [arg.replace("fp8", "ARM") for arg in first] == [arg.replace("nvfp4", "ARM") for arg in second]
    flags = " ".join(first)
    for pinned in ("--attention-backend FLASHINFER", '--profiler-config {"profiler": "cuda"}', "--load-format dummy",
                   "--trace-fork-before-exec=true", "--cuda-graph-trace=node", "--capture-range=cudaProfilerApi",
                   "--capture-range-end=stop", "--max-model-len 8192"):
        assert pinned in flags


def test_scenarios_set_what_they_measure():
    cold = config("cold-prefill")
    assert "--no-enable-prefix-caching" in vllm_config.engine_flags(cold, "fp8")
    assert cold.workload.points("serve") == [Point(2048, 1, 64, 16)]
    reuse = config("prefix-reuse")
    assert "--enable-prefix-caching" in vllm_config.engine_flags(reuse, "fp8")
    assert vllm_config.child_env(reuse)["VLLM_SERVER_DEV_MODE"] == "1"
    bench = commands.bench_command(reuse, "python3", reuse.workload.points("serve")[0], seed=0, result=None, relay_port=9)
    assert bench[bench.index("--dataset-name") + 1] == "prefix_repetition"
    assert bench[bench.index("--num-warmups") + 1] == "0" and bench[bench.index("--ready-check-timeout-sec") + 1] == "0"
    decode = config("decode-heavy", mode="offline")
    assert vllm_config.engine_flags(decode, "fp8")[-3:] == ["--skip-tokenizer-init", "--max-num-seqs", "32"]
    env = vllm_config.child_env(decode)
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in env


def test_the_unused_flashinfer_sampler_is_not_built_unless_the_user_asks(monkeypatch):
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    assert vllm_config.child_env(config("sweep"))["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in vllm_config.child_env(config("sweep"))


def test_sweep_steps_up_and_runs_the_narrowest_format_first():
    """The first run's grid stops at its own capacity: the largest pool (narrowest format) must set it."""
    cfg = config("sweep", arms=("fp8", "nvfp4"), contexts=(4096, 1024), concurrencies=(32, 8))
    assert cfg.arm_order() == ("nvfp4", "fp8")
    assert [run.name for run in cfg.runs()] == ["nvfp4", "fp8"]
    assert config("sweep", arms=("auto", "fp8"), contexts=(1024,), concurrencies=(8,)).arm_order() == ("fp8", "auto")
    assert [p.spec() for p in cfg.workload.points("serve")] == [
        "input=1024,output=64,prompts=16,concurrency=8", "input=1024,output=64,prompts=64,concurrency=32",
        "input=4096,output=64,prompts=16,concurrency=8", "input=4096,output=64,prompts=64,concurrency=32"]
    assert [p.num_prompts for p in cfg.workload.points("offline")] == [8, 32, 8, 32]


@pytest.mark.parametrize("kwargs,message", [
    ({"arms": ("fp8", "fp9")}, "unknown arm(s) fp9"),
    ({"arms": ("fp8", "fp8")}, "names an arm twice"),
    ({"arms": ()}, "--arms is empty"),
    ({"extra": ("--kv-cache-dtype", "fp8")}, "--kv-cache-dtype is set by kvtrace"),
    ({"extra": ("--attention-backend=TRITON_ATTN",)}, "pins FLASHINFER"),
    ({"extra": ("--profiler-config.profiler", "torch")}, "CUDA profiler"),
    ({"extra": ("--enable-prefix-caching",)}, "the scenario sets prefix caching"),
    ({"extra": ("--port", "9000")}, "use kvtrace's --port"),
    ({"mode": "offline", "extra": ("--max-num-seqs", "8")}, "sets it from --concurrency"),
    ({"output_len": 0}, "--output-len must be at least 1"),
    ({"mode": "offline", "scenario": "prefix-reuse", "trace_file": __file__}, "--trace-file needs --mode serve"),
    ({"scenario": "prefix-reuse", "trace_file": "/nonexistent.jsonl"}, "does not exist"),
    ({"port": 70000}, "is not a TCP port"),
    ({"mode": "offline", "scenario": "sweep", "num_prompts": 64}, "does not apply to an offline sweep"),
    ({"repeats": 0}, "--repeats must be at least 1, got 0"),
])
def test_bad_input_is_one_clear_error(kwargs, message):
    with pytest.raises(KvtraceError) as error:
        config(**kwargs).validate()
    assert message in str(error.value) and "\n" not in str(error.value)


def test_dry_run_with_repeats_prints_the_runs_in_order(monkeypatch):
    monkeypatch.setattr(kvtrace.nsys, "find_nsys", lambda explicit=None: "nsys")
    out = Path("runs/demo")
    offline = config("sweep", "offline", ("auto", "fp8"), repeats=2, contexts=(64,), concurrencies=(2,))
    text = commands.dry_run(offline, out, python="python3")
    order = ["fp8.r1", "auto.r1", "fp8.r2", "auto.r2"]
    assert text.splitlines()[0].startswith("# kvtrace capture vllm: scenario sweep, mode offline, arms fp8, auto, "
                                           "2 repeats interleaved")
    assert "# sweep: run fp8.r1 steps up" in text and "the other runs run exactly the points it ran" in text
    runs = [line for line in text.splitlines() if line.startswith("# run ")]
    assert runs == [f"# run {name}: arm {name.split('.')[0]}, repeat {name[-1]}" for name in order]
    workers = [line.split() for line in text.splitlines() if " profile " in line]
    assert [next(a for a in w if a.startswith("--output=")) for w in workers] == [f"--output={out / n}" for n in order]
    assert [w[w.index("--result") + 1] for w in workers] == [str(out / f"{n}.workload.json") for n in order]
    assert [w[w.index("--kv-cache-dtype") + 1] for w in workers] == ["fp8", "auto", "fp8", "auto"]
    assert ["--stop-at-capacity" in w for w in workers] == [True, False, False, False]
    exports = [line.split()[-1] for line in text.splitlines() if " export " in line]
    assert exports == [f"{out / n}.nsys-rep" for n in order]

    serve = commands.dry_run(config("decode-heavy", repeats=2), out, python="python3")
    results = [line.split()[-1] for line in serve.splitlines() if "--save-result" in line]
    order = ["fp8.r1", "nvfp4.r1", "fp8.r2", "nvfp4.r2"]
    assert results == [f"{n}.bench.json" for n in order]  # --result-filename, last on the line
    servers = [line.split() for line in serve.splitlines() if " serve " in line and " profile " in line]
    assert [(next(a for a in s if a.startswith("--output=")), s[s.index("--kv-cache-dtype") + 1]) for s in servers] == [
        (f"--output={out / n}", n.split(".")[0]) for n in order]


def test_options_outside_their_scenario_are_rejected():
    with pytest.raises(KvtraceError, match="--contexts does not apply to --scenario cold-prefill"):
        vllm_config.Workload.for_scenario("cold-prefill", contexts=(1024,))
    with pytest.raises(KvtraceError, match="--input-len does not apply to --scenario sweep"):
        vllm_config.Workload.for_scenario("sweep", input_len=10)


def test_points_from_follows_the_points_an_earlier_sweep_ran(monkeypatch):
    """The real H200 sweep recorded alone (fixtures/vllm-h200-serve/sweep-auto): it stopped at capacity after 3
    of the 4 grid points, and an arm recorded later with --points-from runs exactly those 3, without stopping."""
    monkeypatch.setattr(kvtrace.nsys, "find_nsys", lambda explicit=None: "nsys")
    earlier = SERVE_RUNS["sweep-auto"]
    ran = [point["point"] for point in json.loads((earlier / "manifest.json").read_text())["arms"]["auto"]["points"]]
    monkeypatch.chdir(earlier.parent)  # so that the golden names the run directory, not where it was unpacked
    followed, source = vllm_config.followed_points(earlier.name, "serve")
    assert [point.spec() for point in followed] == ran and source == f"{earlier.name} (run auto)"
    cfg = config("sweep", arms=("fp8",), followed=followed, followed_from="sweep-auto (run auto)")
    assert [point.spec() for point in cfg.workload.points("serve")] == ran
    text = commands.dry_run(cfg, Path("runs/demo"), python="python3")
    golden = GOLDEN / "sweep.serve.points-from.txt"
    if os.environ.get("KVTRACE_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    result = CliRunner().invoke(capture_cli.capture, ["vllm", "--model", "/models/m", "--scenario", "sweep", "--arms",
                                                      "fp8", "--points-from", earlier.name, "--repeats", "1",
                                                      "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"runs the 3 points that {earlier.name} (run auto) ran" in result.output
    assert result.output.count("--save-result") == 3


@pytest.mark.parametrize("args,message", [
    (["--scenario", "sweep", "--contexts", "1024"], "--points-from takes every point from"),
    (["--scenario", "cold-prefill"], "--points-from applies only to --scenario sweep"),
    (["--scenario", "sweep", "--mode", "offline"], "follows an earlier --scenario sweep --mode offline run"),
])
def test_points_from_refuses_what_contradicts_it(args, message, run_kvtrace):
    earlier = SERVE_RUNS["sweep-auto"]
    code, out, err = run_kvtrace("capture", "vllm", "--model", "m", *args, "--points-from", earlier, "--dry-run",
                                 cwd=TESTS)
    assert code == 2 and err.startswith("kvtrace: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    prefix = SERVE_RUNS["prefix-reuse-fp8"]
    with pytest.raises(KvtraceError, match="holds a serve prefix-reuse run"):
        vllm_config.followed_points(str(prefix), "serve")


def test_cli_dry_run_and_errors(monkeypatch, run_kvtrace):
    monkeypatch.setattr(kvtrace.nsys, "find_nsys", lambda explicit=None: "nsys")
    runner_ = CliRunner()
    result = runner_.invoke(capture_cli.capture, ["vllm", "--model", "/models/m", "--scenario", "decode-heavy",
                                                  "--mode", "offline", "--arms", "auto,fp8", "--dry-run", "--",
                                                  "--max-model-len", "4096"])
    assert result.exit_code == 0, result.output
    assert result.output.count("nsys profile") == 2 and "--max-model-len 4096" in result.output
    assert "--output=runs/vllm-decode-heavy/auto" in result.output
    code, out, err = run_kvtrace("capture", "vllm", "--model", "m", "--arms", "fp8,bogus", "--dry-run", cwd=TESTS)
    assert code == 2 and err.startswith("kvtrace: error: unknown arm(s) bogus")
    code, out, err = run_kvtrace("capture", "vllm", "--model", "m", "--repeats", "0", "--dry-run", cwd=TESTS)
    assert (code, err) == (2, "kvtrace: error: --repeats must be at least 1, got 0\n")
    repeated = runner_.invoke(capture_cli.capture, ["vllm", "--model", "/models/m", "--mode", "offline",
                                                    "--arms", "auto,fp8", "--repeats", "2", "--dry-run"])
    assert repeated.exit_code == 0, repeated.output
    assert [line for line in repeated.output.splitlines() if line.startswith("# run ")] == [
        "# run auto.r1: arm auto, repeat 1", "# run fp8.r1: arm fp8, repeat 1", "# run auto.r2: arm auto, repeat 2",
        "# run fp8.r2: arm fp8, repeat 2"]


def test_makefile_fragment_runs_the_cli(tmp_path):
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    main = tmp_path / "Makefile"  # as the project's Makefile includes it, with an OUT default of its own
    main.write_text(f"OUT ?= out\ninclude {ROOT / 'capture' / 'capture.mk'}\n")

    def make(*variables: str) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "-s", "-f", str(main), "capture", f"KVTRACE={sys.executable} -m kvtrace",
                               *variables], capture_output=True, text=True, cwd=tmp_path)

    usage = make()
    assert usage.returncode != 0 and "usage: make capture MODEL=" in usage.stderr
    done = make("MODEL=/models/m", "SCENARIO=sweep", "MODE=offline", "ARMS=auto,fp8", "DRY_RUN=1",
                "VLLM_ARGS=--max-model-len 20000")
    assert done.returncode == 0, done.stderr
    assert "scenario sweep, mode offline, arms fp8, auto" in done.stdout
    assert "--max-model-len 20000" in done.stdout and "--output=runs/vllm-sweep/fp8" in done.stdout
    assert "--output=runs/x/fp8" in make("MODEL=/models/m", "SCENARIO=cold-prefill", "OUT=runs/x", "DRY_RUN=1").stdout
    repeated = make("MODEL=/models/m", "SCENARIO=cold-prefill", "REPEATS=2", "DRY_RUN=1").stdout
    assert "2 repeats interleaved" in repeated and "--output=runs/vllm-cold-prefill/nvfp4.r2" in repeated
    served = make("MODEL=/models/m", "SCENARIO=prefix-reuse", "DRY_RUN=1").stdout  # serve: 3 repeats by default
    assert "3 repeats interleaved" in served and "--output=runs/vllm-prefix-reuse/nvfp4.r3" in served
    offline = make("MODEL=/models/m", "SCENARIO=cold-prefill", "MODE=offline", "DRY_RUN=1").stdout
    assert "repeats interleaved" not in offline and "--output=runs/vllm-cold-prefill/nvfp4 " in offline
    whole = make("MODEL=/models/m", "OUT=runs/x", "DRY_RUN=1", "VLLM_ARGS=--max-model-len 4096")  # the whole matrix
    assert whole.returncode == 0, whole.stderr
    assert ("# kvtrace capture vllm-matrix: 4 scenarios x arms fp8, nvfp4 x 3 interleaved rounds, all servers up at "
            "once") in whole.stdout and "# estimated wall time: ~" in whole.stdout
    assert "--output=runs/x/servers/nvfp4/trace" in whole.stdout and "--max-model-len 4096" in whole.stdout


def test_make_capture_records_the_whole_matrix_on_one_server_per_arm_and_ends_with_kvtrace_matrix(tmp_path):
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    calls = tmp_path / "calls.jsonl"
    stub = tmp_path / "kvtrace-stub"  # records its arguments; the capture fails as one with a failed run does
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) "
                    "+ '\\n')\nsys.exit('vllm-matrix' in sys.argv)\n")
    stub.chmod(0o755)
    result = subprocess.run(["make", "-s", "-f", str(ROOT / "capture" / "capture.mk"), "capture", f"KVTRACE={stub}",
                             "MODEL=/models/m", "REPEATS=4"], capture_output=True, text=True, cwd=tmp_path)
    argvs = [json.loads(line) for line in calls.read_text().splitlines()]
    assert argvs == [["capture", "vllm-matrix", "--model", "/models/m", "--arms", "fp8,nvfp4", "--out",
                      "runs/vllm-matrix", "--repeats", "4"], ["matrix", "runs/vllm-matrix"]]
    assert result.returncode != 0 and "the matrix did not record every run" in result.stderr


# Preflight --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gpu,capability,verdict,message", [
    ("NVIDIA H200", [9, 0], False, "vLLM 0.26.0 does not store an nvfp4 KV cache on NVIDIA H200 (SM90): install vLLM "
                                   "0.33 or newer"),
    ("NVIDIA RTX PRO 6000 Blackwell", [12, 0], False, "on NVIDIA RTX PRO 6000 Blackwell (SM120): install vLLM 0.33"),
    ("NVIDIA B200", [10, 0], False, "trtllm-gen attention is unavailable"),
])
def test_nvfp4_preflight_names_the_gpu_and_the_way_out(gpu, capability, verdict, message):
    probe = {**PROBE_B200, "gpu_name": gpu, "capability": capability, "vllm_nvfp4_kv": verdict, "vllm": "0.26.0"}
    with pytest.raises(KvtraceError) as error:
        preflight.check_probe(probe, ("fp8", "nvfp4"))
    assert message in str(error.value) and "--arms auto,fp8" in str(error.value)
    preflight.check_probe(probe, ("auto", "fp8"))  # the same GPU is fine without nvfp4


@pytest.mark.parametrize("capability,verdict,refused", [
    ([10, 0], True, (False,)),  # vLLM says yes
    ([10, 3], None, (False,)),  # a vLLM too old to be asked: SM10x passes
    ([9, 0], True, (False, None)),  # SM90 (vLLM 0.33's FA2 path) passes only on vLLM's yes
    ([12, 0], True, (False, None)),  # SM120 likewise
])
def test_nvfp4_preflight_trusts_the_installed_vllm(capability, verdict, refused):
    probe = {**PROBE_B200, "capability": capability, "vllm_nvfp4_kv": verdict}
    preflight.check_probe(probe, ("fp8", "nvfp4"))
    # The same GPU is refused once the installed vLLM's answer changes: that answer is what decides.
    for other in refused:
        with pytest.raises(KvtraceError, match="nvfp4 KV"):
            preflight.check_probe({**probe, "vllm_nvfp4_kv": other}, ("fp8", "nvfp4"))


FAILING_VLLM = {  # a vLLM whose FlashInfer backend cannot be imported, on a torch that sees an H200
    "torch/__init__.py": "from torch import cuda, version\n",
    "torch/version.py": "cuda = '13.0'\n",
    "torch/cuda.py": ("def device_count(): return 1\n"
                      "def get_device_name(index): return 'NVIDIA H200'\n"
                      "def get_device_capability(index): return (9, 0)\n"),
    "vllm/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/flashinfer.py": "import compressed_tensors_missing_on_purpose\n",
}


def test_failed_nvfp4_probe_is_reported_as_a_failed_probe(tmp_path, monkeypatch):
    """Issue 20: a first staging of vLLM 0.33 on the H200 lacked a package its FlashInfer backend imports. The
    probe could not ask vLLM, and the preflight must say that, with the import error, not "only on Blackwell"."""
    for name, text in FAILING_VLLM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    probe = preflight.probe_environment(sys.executable, nvfp4=True)
    assert probe["gpu_name"] == "NVIDIA H200" and probe["capability"] == [9, 0] and probe.get("vllm_nvfp4_kv") is None
    assert "ModuleNotFoundError" in probe["vllm_nvfp4_kv_error"]
    with pytest.raises(KvtraceError) as error:
        preflight.check_probe(probe, ("fp8", "nvfp4"))
    message = str(error.value)
    assert message.startswith("could not ask vLLM") and "NVIDIA H200 (SM90)" in message
    assert "No module named 'compressed_tensors_missing_on_purpose'" in message
    assert "Blackwell" not in message and "rejects" not in message and "\n" not in message
    preflight.check_probe(probe, ("auto", "fp8"))  # only the nvfp4 arm needed the answer


def test_real_probe_reports_missing_vllm_and_gpu():
    probe = preflight.probe_environment(sys.executable, nvfp4=True)
    assert {"vllm", "torch", "flashinfer-python", "prometheus-client"} <= set(probe)
    if probe["vllm"] is None:
        with pytest.raises(KvtraceError, match="vLLM is not installed"):
            preflight.check_probe(probe, ("fp8",))
    with pytest.raises(KvtraceError, match="no CUDA GPU visible to torch"):
        preflight.check_probe({**probe, "vllm": "0.26.0", "gpu_count": 0}, ("fp8",))


def model_dir(tmp_path: Path, tokenizer: bool = True) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(TINY / "config.json", folder)
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def test_model_checks(tmp_path):
    with pytest.raises(KvtraceError, match="model path /nonexistent/model does not exist"):
        preflight.check_model(config(model="/nonexistent/model"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KvtraceError, match="has no config.json"):
        preflight.check_model(config(model=str(empty)))
    (empty / "config.json").write_text("{not json")
    with pytest.raises(KvtraceError, match="config.json is not valid JSON"):
        preflight.check_model(config(model=str(empty), mode="offline"))
    with pytest.raises(KvtraceError, match="holds no weights.*--load-format dummy"):
        preflight.check_model(config(model=str(TINY), mode="offline", load_format="auto"))
    with pytest.raises(KvtraceError, match="no tokenizer files.*--mode offline") as error:
        preflight.check_model(config(model=str(TINY)))
    assert f"python3 {TINY / 'make_tokenizer.py'} {TINY}" in str(error.value)
    copy = tmp_path / "llama-tiny"
    copy.mkdir()
    shutil.copy(TINY / "config.json", copy)
    with pytest.raises(KvtraceError, match=f"fixtures/models/llama-tiny/make_tokenizer.py {copy}"):
        preflight.check_model(config(model=str(copy)))
    with pytest.raises(KvtraceError, match="exceed the model's 8192 positions"):
        preflight.check_model(config("decode-heavy", mode="offline", model=str(TINY), input_len=8192))
    summary = preflight.check_model(config(model=str(TINY), mode="offline", arms=("auto", "fp8", "nvfp4")))
    assert (summary["num_hidden_layers"], summary["num_key_value_heads"], summary["head_dim"]) == (16, 8, 128)
    assert summary["kv_bytes_per_token"] == {"auto": 65536, "fp8": 32768, "nvfp4": 18432}


def test_missing_nsys_and_busy_port(tmp_path, monkeypatch):
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(kvtrace.nsys, "INSTALL_GLOBS", ())
    with pytest.raises(KvtraceError, match="nsys \\(Nsight Systems CLI\\) not found"):
        engine.capture(config(model=str(TINY), mode="offline"), tmp_path / "out")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(KvtraceError, match=f"port {port} on 127.0.0.1 is in use.*--port"):
            engine.capture(config(model=str(model_dir(tmp_path)), port=port), tmp_path / "out", nsys=sys.executable)
    assert not (tmp_path / "out").exists()


def test_missing_vllm_stops_before_the_run_directory(tmp_path):
    if importlib.util.find_spec("vllm") is not None:  # the capture's own probe runs in this interpreter
        pytest.skip("vLLM is installed here")
    with pytest.raises(KvtraceError, match="vLLM is not installed"):
        engine.capture(config(model=str(TINY), mode="offline", arms=("auto", "fp8")), tmp_path / "out",
                       nsys=sys.executable)
    assert not (tmp_path / "out").exists()


# Metrics, bench results and the startup line ----------------------------------------------------------------

def test_metric_deltas_from_recorded_pages():
    before, after = recorded("prefix-reuse-fp8.before.prom"), recorded("prefix-reuse-fp8.after.prom")
    deltas = metric_deltas(before, after)
    assert deltas["counters"] == {
        "vllm:prefix_cache_queries_total": 163840, "vllm:prefix_cache_hits_total": 122880,
        "vllm:num_preemptions_total": 0, "vllm:prompt_tokens_total": 163840,
        "vllm:prompt_tokens_cached_total": 122880, "vllm:generation_tokens_total": 8192,
        "vllm:request_success_total": 128}
    ttft = deltas["histograms"]["vllm:time_to_first_token_seconds"]
    assert ttft["count"] == 128 and ttft["mean"] == pytest.approx(0.075)
    assert after["info"]["vllm:cache_config_info"][0]["cache_dtype"] == "fp8"
    assert "vllm:num_preemptions_created" not in after["counters"] | after["gauges"]


def test_peaks_from_recorded_polls():
    peaks: dict = {}
    for name in ("before", "poll-1", "poll-2", "poll-3", "after"):
        update_peaks(peaks, recorded(f"prefix-reuse-fp8.{name}.prom"))
    assert peaks == {"vllm:num_requests_running": 32, "vllm:num_requests_waiting": 2,
                     "vllm:kv_cache_usage_perc": pytest.approx(0.038)}


def test_capacity_rule_on_a_recorded_sweep_point():
    pages = {name: recorded(f"sweep-fp8-capacity.{name}.prom") for name in ("before", "poll-1", "after")}
    peaks: dict = {}
    for page in pages.values():
        update_peaks(peaks, page)
    deltas = metric_deltas(pages["before"], pages["after"])
    point = Point(16384, 64, 64, 32)
    assert deltas["counters"]["vllm:num_preemptions_total"] == 7
    assert capacity_reason(point, deltas, peaks, None) == "7 preemptions"
    calm = {"counters": {"vllm:num_preemptions_total": 0}, "histograms": {}}
    assert capacity_reason(point, calm, peaks, None) == "KV cache usage peaked at 99%"
    assert capacity_reason(point, calm, {}, 500_000) == "526,336 KV tokens needed of 500,000 available"
    assert capacity_reason(point, calm, {"vllm:kv_cache_usage_perc": 0.5}, 10_000_000) is None


def test_metrics_add_up_across_engines():
    text = "\n".join([
        "# TYPE vllm:prompt_tokens_total counter",
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0',
        'vllm:prompt_tokens_total{engine="1",model_name="m"} 50.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7',
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0',
        "# TYPE process_cpu_seconds_total counter",
        "process_cpu_seconds_total 12.0", ""])
    snapshot = http.parse_metrics(text)
    assert snapshot["counters"] == {"vllm:prompt_tokens_total": 150}
    assert snapshot["gauges"] == {"vllm:kv_cache_usage_perc": 0.7, "vllm:num_requests_running": 7}


def test_bench_summary_from_a_recorded_result():
    summary = engine.summarize_bench(json.loads((RECORDED / "prefix-reuse-fp8.bench.json").read_text()))
    assert summary["completed"] == 128 and summary["failed"] == 0
    assert summary["input_throughput"] == pytest.approx(25600.0)
    assert summary["p99_ttft_ms"] == 180.3 and summary["median_itl_ms"] == 22.4 and summary["mean_e2el_ms"] == 1562.0
    assert "date" not in summary and "max_concurrency" not in summary


def test_kv_cache_startup_lines():
    old = parse_kv_cache_log((RECORDED / "startup-vllm-0.26.log").read_text())
    assert old["tokens"] == 3_847_840 and old["tokens_per_request"] == 8192
    assert old["max_concurrency"] == 469.71 and old["available_gib"] == 117.43
    assert old["line"].splitlines()[0] == "GPU KV cache size: 3,847,840 tokens"
    assert old["line"].splitlines()[1].startswith("Maximum concurrency for 8,192 tokens")
    new = parse_kv_cache_log((RECORDED / "startup-vllm-0.33.log").read_text())
    assert (new["tokens"], new["tokens_per_request"], new["max_concurrency"]) == (1_234_567, 32_768, 37.68)
    assert "\n" not in new["line"]
    assert parse_kv_cache_log("INFO Starting vLLM API server\n") is None


# The offline worker's pure parts ----------------------------------------------------------------------------

def test_points_round_trip():
    for point in (Point(1024, 1, 32, 16), Point(256, 64, 128, 32, prefix_len=1024, num_prefixes=8)):
        assert Point.parse(point.spec()) == point
    assert Point(1024, 1, 32, 16).spec() == "input=1024,output=1,prompts=32,concurrency=16"
    with pytest.raises(ValueError, match="unknown point key"):
        Point.parse("input=1,tokens=2")


def test_prompts_are_deterministic_and_shaped():
    point = Point(48, 4, 12, 4, prefix_len=32, num_prefixes=3)
    prompts = build_prompts(point, 7, 32000, "measure")
    assert prompts == build_prompts(point, 7, 32000, "measure")
    assert prompts != build_prompts(point, 7, 32000, "warmup")
    assert prompts != build_prompts(point, 8, 32000, "measure")
    assert all(len(p) == 80 and all(1 <= t < 32000 for t in p) for p in prompts)
    assert len({tuple(p[:32]) for p in prompts}) == 3 and len({tuple(p[32:]) for p in prompts}) == 12
    assert request_order_sha256([prompts, 4]) == request_order_sha256([build_prompts(point, 7, 32000,
                                                                                            "measure"), 4])
    plain = build_prompts(Point(16, 1, 5, 5), 0, 100, "measure")
    assert [len(p) for p in plain] == [16] * 5


def test_worker_arguments_and_warmups():
    args, flags = worker.parse_args(["--scenario", "sweep", "--seed", "3", "--point", "input=8,output=1,prompts=2,"
                                     "concurrency=2", "--point", "input=8,output=1,prompts=4,concurrency=4",
                                     "--result", "r.json", "--", "--model", "m", "--seed", "3"])
    assert flags == ["--model", "m", "--seed", "3"] and args.seed == 3 and not args.stop_at_capacity
    assert worker.warmup_points(args.points) == [Point(8, 1, 2, 2)]
    with pytest.raises(SystemExit):
        worker.parse_args(["--scenario", "x"])


# End to end through the stand-ins ----------------------------------------------------------------------------

def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def free_port(span: int = 40) -> int:
    """A port free with the `span` ports after it (a matrix gives arm i's server port + 10·i, and each server's KV
    events the port after its own), below the kernel's ephemeral range: a port the kernel hands out is also what
    other tests' outgoing connections take meanwhile, which made a matrix's later ports busy under load."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    lowest = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for _ in range(100):
        base = random.randrange(10_000, lowest - span)  # unseeded: two xdist workers must not pick alike
        if all(_bindable(port) for port in range(base, base + span)):
            return base
    raise RuntimeError(f"no {span} free ports in a row below {lowest}")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def standin(tmp_path, monkeypatch):
    return make_standin(tmp_path, monkeypatch)


def make_standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The stand-in vLLM, bench client and nsys in tmp_path, on PATH for the capture through `monkeypatch`."""
    site = tmp_path / "site"
    vllm_standin.write_fake_vllm(site)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    piddir = tmp_path / "pids"
    piddir.mkdir()
    monkeypatch.setenv("STANDIN_PIDDIR", str(piddir))
    monkeypatch.setenv("STANDIN_CALLS", str(tmp_path / "calls.jsonl"))
    monkeypatch.delenv("STANDIN_FAIL", raising=False)
    nsys = tmp_path / "bin" / "nsys"
    nsys.parent.mkdir()
    # -S: the stand-in nsys needs only the standard library, and it runs once per report and per export.
    nsys.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{TESTS / "vllm_standin.py"}" nsys "$@"\n')
    nsys.chmod(0o755)
    monkeypatch.setattr(engine, "probe_environment", lambda python, nvfp4: dict(PROBE_B200))
    fast_polls(monkeypatch)

    def pids(kind: str = "") -> list[int]:
        return [int(path.read_text()) for path in piddir.glob(f"{kind}*.pid")]

    def calls() -> list[dict]:
        path = tmp_path / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return SimpleNamespace(nsys=str(nsys), tmp=tmp_path, pids=pids, calls=calls, model=model_dir(tmp_path))


def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture's polls and waits sized for the stand-ins, which answer in milliseconds where a GPU server takes
    seconds: /health, the relay's look for its shutdown, a window's report and its steady size, a prestarted
    client's ready line, the quiet after a point's KV events. Each is still waited for, only in shorter steps."""
    from kvtrace.capture import vllm_kv_events, vllm_matrix_run, vllm_relay, vllm_servers

    monkeypatch.setattr(engine, "READY_POLL_MAX_S", 0.02)
    monkeypatch.setattr(vllm_relay, "SHUTDOWN_POLL_S", 0.02)
    monkeypatch.setattr(vllm_servers, "REPORT_POLL_S", 0.01)
    monkeypatch.setattr(vllm_servers, "REPORT_STEADY_S", 0.02)
    monkeypatch.setattr(vllm_matrix_run, "CLIENT_READY_POLL_S", 0.02)
    monkeypatch.setattr(vllm_kv_events, "QUIET_S", 0.02)  # the stand-in publishes before it answers


def run_capture(standin, cfg, **kwargs) -> dict:
    options = {"nsys": standin.nsys, "startup_timeout_s": 60.0, "shutdown_grace_s": 30.0, "poll_interval_s": 0.05}
    return engine.capture(cfg, standin.tmp / "run", **{**options, **kwargs})


def serve_config(standin, **kwargs) -> vllm_config.VllmCapture:
    workload = {"input_len": 32, "output_len": 4, "num_prompts": 6, "concurrency": 3}
    return config(kwargs.pop("scenario", "decode-heavy"), model=str(standin.model), port=free_port(),
                  **{**workload, **kwargs})


_SHARED: dict[str, SimpleNamespace] = {}


def shared_capture(name: str, tmp_path_factory, record) -> SimpleNamespace:
    """A capture through the stand-ins made once per test process, for the tests that each check something else of
    its result, which they only read. record(standin, monkeypatch) runs it and returns (cfg, manifest). Its
    survivors (processes still alive) are looked for at once, before their ids can go to other processes."""
    if name not in _SHARED:
        with pytest.MonkeyPatch.context() as monkeypatch:
            standin = make_standin(tmp_path_factory.mktemp(name), monkeypatch)
            standin.cfg, standin.manifest = record(standin, monkeypatch)
            standin.survivors = [pid for pid in standin.pids() if alive(pid)]
        _SHARED[name] = standin
    return _SHARED[name]


@pytest.fixture(scope="session")
def plain_serve(tmp_path_factory) -> SimpleNamespace:
    """serve_config's two-arm decode-heavy capture with nothing failing."""
    def record(standin, monkeypatch):
        cfg = serve_config(standin)
        return cfg, run_capture(standin, cfg)
    return shared_capture("plain-serve", tmp_path_factory, record)


@pytest.fixture(scope="session")
def prefix_reuse_fp8(tmp_path_factory) -> SimpleNamespace:
    """The fp8 arm alone on prefix reuse, 32 prompts over 2 prefixes, its server noting each connection that carried
    completions (connections.txt) and evicting a prefix block every 4th request."""
    def record(standin, monkeypatch):
        monkeypatch.setenv("STANDIN_CONNECTIONS", str(standin.tmp / "connections.txt"))
        monkeypatch.setenv("STANDIN_EVICT_EVERY", "4")
        cfg = serve_config(standin, scenario="prefix-reuse", prefix_len=32, input_len=16, arms=("fp8",),
                           num_prefixes=2, num_prompts=32)
        return cfg, run_capture(standin, cfg)
    return shared_capture("prefix-reuse-fp8", tmp_path_factory, record)


def test_serve_records_metrics_bench_and_traces(plain_serve):
    standin, manifest = plain_serve, plain_serve.manifest
    run = standin.tmp / "run"
    assert manifest["status"] == "ok" and manifest["request_order_matched"] is True
    assert manifest == json.loads((run / "manifest.json").read_text())
    for name, tokens in (("fp8", 100_000), ("nvfp4", 177_777)):
        arm = manifest["arms"][name]
        assert arm["status"] == "ok" and arm["exit_code"] == 0 and arm["error"] is None
        assert arm["kv_cache"]["tokens"] == tokens and arm["kv_cache"]["tokens_per_request"] == 8192
        point = arm["points"][0]
        counters = point["metrics"]["deltas"]["counters"]
        assert counters["vllm:prompt_tokens_total"] == 6 * 32 and counters["vllm:generation_tokens_total"] == 6 * 4
        assert counters["vllm:request_success_total"] == 6
        assert point["metrics"]["deltas"]["histograms"]["vllm:time_to_first_token_seconds"]["count"] == 6
        assert point["metrics"]["peaks"]["vllm:num_requests_running"] == 3
        assert point["metrics"]["cache_config"][0]["cache_dtype"] == name
        assert point["bench"]["completed"] == 6 and point["bench"]["mean_ttft_ms"] == 50.0
        assert point["bench_exit_code"] == 0
        for file in (arm["sqlite"], arm["report"], arm["log"], point["bench_result"], point["metrics"]["before"],
                     point["metrics"]["after"], f"{name}.bench.log", f"{name}.manifest.json"):
            assert (run / file).exists(), file
        assert sqlite3.connect(run / arm["sqlite"]).execute("SELECT value FROM StringIds").fetchone() == ("stand-in",)
        log = (run / arm["log"]).read_text()
        assert "GPU KV cache size" in log and "stand-in server: shutting down" in log  # SIGINT, not a kill
        server, warmup, bench = arm["commands"][:3]
        assert server[:2] == [standin.nsys, "profile"] and "serve" in server
        assert "--trace-fork-before-exec=true" in server
        assert warmup[warmup.index("--seed") + 1] == "1" and "--save-result" not in warmup
        assert bench[bench.index("--seed") + 1] == "0" and "--save-result" in bench
        assert arm["commands"][3][1] == "export"
        per_arm = json.loads((run / f"{name}.manifest.json").read_text())
        assert list(per_arm["arms"]) == [name] and per_arm["status"] == "ok"
    settings = manifest["settings"]
    assert settings["engine_flags"]["fp8"][:2] == ["--kv-cache-dtype", "fp8"]
    assert settings["env"]["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and settings["attention_backend"] == "FLASHINFER"
    assert settings["model"]["num_key_value_heads"] == 8 and settings["model"]["head_dim"] == 128
    environment = manifest["environment"]
    assert environment["packages"]["vllm"] == "0.33.0" and environment["gpu"] == {"name": "NVIDIA B200", "sm": "100",
                                                                                  "count": 1}
    assert "stand-in" in environment["nsys"]
    assert "PYTHONPATH" in environment["inherited_env"]
    assert standin.pids() and not standin.survivors


def test_prefix_reuse_resets_the_cache_after_warmup(prefix_reuse_fp8):
    manifest = prefix_reuse_fp8.manifest
    assert manifest["status"] == "ok"
    counters = manifest["arms"]["fp8"]["points"][0]["metrics"]["deltas"]["counters"]
    assert counters["vllm:prefix_cache_hits_total"] == 30 * 32  # the stand-in client reuses 2 prefixes
    assert manifest["settings"]["env"]["VLLM_SERVER_DEV_MODE"] == "1"


def one_prefix_reuse_arm(standin, **workload) -> tuple[vllm_config.VllmCapture, dict]:
    """A prefix-reuse capture of the fp8 arm alone through the stand-ins: its configuration and manifest entry."""
    cfg = serve_config(standin, scenario="prefix-reuse", prefix_len=32, input_len=16, arms=("fp8",), **workload)
    arm = run_capture(standin, cfg)["arms"]["fp8"]
    assert arm["status"] == "ok", arm["error"]
    return cfg, arm


def test_serve_records_each_requests_cached_tokens_through_the_relay(prefix_reuse_fp8):
    """The bench client's result has no cached tokens; the relay reads them from each streamed response's usage
    chunk (--enable-prompt-tokens-details). Their sum is the server's prefix-cache hit counter's change, and the
    warm-up's requests are not among them. The relay keeps its connection to the server open: the stand-in
    client sends one request at a time, each over a new connection to the relay, and all of them (warm-up
    included) reach the server over one."""
    standin, arm = prefix_reuse_fp8, prefix_reuse_fp8.manifest["arms"]["fp8"]
    assert arm["status"] == "ok", arm["error"]
    assert (standin.tmp / "connections.txt").read_text().splitlines() == ["fp8"]
    assert "--enable-prompt-tokens-details" in arm["commands"][0]
    point = arm["points"][0]
    requests = json.loads((standin.tmp / "run" / point["requests"]["file"]).read_text())
    assert [entry["arrival"] for entry in requests] == list(range(32))
    assert [entry["cached_tokens"] for entry in requests] == [0, 0] + [32] * 30
    assert {entry["prompt_tokens"] for entry in requests} == {48} and {entry["status"] for entry in requests} == {200}
    assert all(entry["first_token_ms"] <= entry["end_ms"] for entry in requests)
    hits = point["metrics"]["deltas"]["counters"]["vllm:prefix_cache_hits_total"]
    assert point["requests"]["cached_tokens"] == hits == 30 * 32
    assert point["requests"]["cached_share"] == pytest.approx(hits / (32 * 48))


def test_the_relay_reads_the_usage_whatever_the_chunks():
    """Events split anywhere across the chunks that arrive (the relay keeps only the one not yet complete), and a
    non-streamed JSON body, give the same counts."""
    from kvtrace.capture.vllm_relay import _StreamWatcher

    usage = {"prompt_tokens": 48, "prompt_tokens_details": {"cached_tokens": 32}, "completion_tokens": 2}
    events = [{"choices": [{"text": " a"}], "usage": None}, {"choices": [{"text": " b"}], "usage": None},
              {"choices": [], "usage": usage}]
    stream = b"".join(b"data: %s\n\n" % json.dumps(event).encode() for event in events) + b"data: [DONE]\n\n"
    body = json.dumps({"choices": [{"text": " a b"}], "usage": usage}).encode()
    for data, streamed in ((stream, True), (body, False)):
        for size in (1, 7, len(data)):
            watcher = _StreamWatcher(time.perf_counter())
            for start in range(0, len(data), size):
                watcher.feed(data[start:start + size])
            result = watcher.result()
            assert (result["prompt_tokens"], result["cached_tokens"], result["completion_tokens"]) == (48, 32, 2)
            assert (result["first_token_ms"] is not None) is streamed


def test_the_relay_reconnects_when_the_server_drops_an_idle_connection(standin, monkeypatch):
    """A server may close an idle keep-alive connection unannounced (here after every completion): the relay's next
    request over it fails before the server reads it, and goes over a new connection instead."""
    connections = standin.tmp / "connections.txt"
    monkeypatch.setenv("STANDIN_CONNECTIONS", str(connections))
    monkeypatch.setenv("STANDIN_FAIL", "drop-keepalive@fp8")
    _, arm = one_prefix_reuse_arm(standin, num_prefixes=2, num_prompts=8)
    requests = json.loads((standin.tmp / "run" / arm["points"][0]["requests"]["file"]).read_text())
    assert [entry["status"] for entry in requests] == [200] * 8
    assert [entry["cached_tokens"] for entry in requests] == [0, 0] + [32] * 6
    warmup = arm["commands"][1]
    assert len(connections.read_text().splitlines()) == 8 + int(warmup[warmup.index("--num-prompts") + 1])


def test_the_relays_upstream_connections_are_closed_whatever_ends_them():
    """A kept connection whose next answer is not HTTP (an error that is no reset) is closed, not left open; one
    given back after the relay stopped (a handler thread outliving it) is closed, not kept."""
    import http.client

    from kvtrace.capture.vllm_relay import _Upstream

    listener = socket.create_server(("127.0.0.1", 0))
    answers = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"not http\r\n\r\n",
               b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]

    def serve():  # one answer per request, the first two over one connection
        for connections in (2, 1):
            peer, _ = listener.accept()
            with peer:
                for _ in range(connections):
                    peer.recv(65536)
                    peer.sendall(answers.pop(0))
                if connections == 2:
                    peer.recv(65536)  # until the relay closes its side

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    upstream = _Upstream(*listener.getsockname())
    try:
        connection, response = upstream.send("GET", "/v1/models", None, {})
        assert response.read() == b"ok"
        upstream.give_back(connection, response)
        assert upstream._idle == [connection]
        with pytest.raises(http.client.BadStatusLine):
            upstream.send("GET", "/v1/models", None, {})
        assert connection.sock is None and upstream._idle == []
        connection, response = upstream.send("GET", "/v1/models", None, {})
        assert response.read() == b"ok"
        upstream.close()
        upstream.give_back(connection, response)
        assert connection.sock is None and upstream._idle == []
    finally:
        upstream.close()
        listener.close()
    server.join(10)
    assert not server.is_alive()


def test_serve_counts_kv_cache_evictions_from_the_servers_events(prefix_reuse_fp8):
    """Evictions are the server's BlockRemoved events, counted per point and checked afresh against the raw event
    file the run directory keeps."""
    standin, cfg, arm = prefix_reuse_fp8, prefix_reuse_fp8.cfg, prefix_reuse_fp8.manifest["arms"]["fp8"]
    assert arm["status"] == "ok", arm["error"]
    flags = arm["commands"][0]
    assert json.loads(flags[flags.index("--kv-events-config") + 1])["endpoint"] == f"tcp://127.0.0.1:{cfg.port + 1}"
    events = arm["points"][0]["kv_events"]
    assert events["BlockRemoved"] == 32 // 4 and events["exact"] is True
    assert events["BlockStored"] == (2 * 48 + 30 * 16) // 16  # the blocks each request computed
    lines = [json.loads(line) for line in (standin.tmp / "run" / arm["kv_events"]["file"]).read_text().splitlines()]
    assert sum(line["BlockRemoved"] for line in lines) == arm["kv_events"]["totals"]["BlockRemoved"]
    assert [line["seq"] for line in lines] == list(range(len(lines)))


def test_serve_without_prefix_caching_records_no_events(plain_serve):
    arm = plain_serve.manifest["arms"]["fp8"]
    assert arm["status"] == "ok" and arm["kv_events"] is None and "kv_events" not in arm["points"][0]
    assert "--kv-events-config" not in arm["commands"][0]


def test_prefix_reuse_warmup_sends_a_prompt_per_prefix(standin):
    """vLLM's prefix_repetition dataset (and the stand-in client) refuse fewer prompts than prefixes, so a warm-up
    of one round of concurrency (3) with 12 prefixes sends 12 prompts."""
    assert commands.warmup_point(Point(16, 4, 24, 3, prefix_len=32, num_prefixes=12)).num_prompts == 12
    assert commands.warmup_point(Point(16, 4, 24, 3)).num_prompts == 3
    _, arm = one_prefix_reuse_arm(standin, num_prefixes=12, num_prompts=24)
    warmup = arm["commands"][1]
    assert warmup[warmup.index("--num-prompts") + 1] == "12" and warmup[warmup.index("--seed") + 1] == "1"


def test_a_later_arm_follows_an_earlier_sweep(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_KV_TOKENS", "1000")  # fp8 holds 1,000 tokens, auto 500
    sweep = {"contexts": (64, 256), "concurrencies": (2, 4, 8), "output_len": 8}
    first = engine.capture(config("sweep", arms=("fp8",), model=str(standin.model), port=free_port(), **sweep),
                           standin.tmp / "first", nsys=standin.nsys, startup_timeout_s=60.0, shutdown_grace_s=30.0,
                           poll_interval_s=0.05)
    ran = [point["point"] for point in first["arms"]["fp8"]["points"]]
    assert len(ran) < 6 and first["arms"]["fp8"]["points"][-1]["capacity"]  # stopped a length at capacity
    followed, source = vllm_config.followed_points(str(standin.tmp / "first"), "serve")
    cfg = config("sweep", arms=("auto",), model=str(standin.model), port=free_port(), followed=followed,
                 followed_from=source)
    later = engine.capture(cfg, standin.tmp / "later", nsys=standin.nsys, startup_timeout_s=60.0,
                           shutdown_grace_s=30.0, poll_interval_s=0.05)
    auto = later["arms"]["auto"]
    assert auto["status"] == "ok" and [point["point"] for point in auto["points"]] == ran
    assert not any("capacity" in point for point in auto["points"])  # it follows; it does not stop
    assert any(point["metrics"]["deltas"]["counters"]["vllm:num_preemptions_total"] for point in auto["points"])
    assert later["settings"]["points"] == ran and later["settings"]["points_from"] == source
    for point in auto["points"]:
        metrics = point["metrics"]
        assert 0 <= metrics["busy_polls"] <= metrics["polls"] and metrics["poll_interval_s"] == 0.05


@pytest.mark.parametrize("failure,message", [
    ("server-exit@fp8", "server exited with code 3 before it was ready (see fp8.log, fp8.bench.log)"),
    ("never-ready@fp8", "server not ready after 2 s"),
    ("bench@fp8", "vllm bench serve exited with code 1 (see fp8.log, fp8.bench.log)"),
    ("profile-404@fp8", "POST /start_profile answered 404"),
    ("no-report@fp8", "nsys wrote no report"),
    ("export@fp8", "nsys export failed"),
])
def test_a_failed_arm_is_recorded_and_the_other_still_runs(standin, monkeypatch, failure, message):
    monkeypatch.setenv("STANDIN_FAIL", failure)
    manifest = run_capture(standin, serve_config(standin), startup_timeout_s=2.0)
    fp8, nvfp4 = manifest["arms"]["fp8"], manifest["arms"]["nvfp4"]
    assert fp8["status"] == "failed" and message in fp8["error"]
    assert nvfp4["status"] == "ok" and manifest["status"] == "partial"
    assert (standin.tmp / "run" / "fp8.log").exists() and (standin.tmp / "run" / "fp8.manifest.json").exists()
    assert not [pid for pid in standin.pids() if alive(pid)]


@pytest.mark.slow
def test_a_bounded_window_traces_a_traced_pass_and_closes_before_the_timed_traffic(standin):
    """--profile-steps N: closing the window holds the engine, so the window wraps a traced pass of the first point
    (two waves of its prompt shape at its concurrency, at most N output tokens) and closes before the timed
    traffic; prefix reuse resets the cache after it."""
    cfg = replace(serve_config(standin, scenario="prefix-reuse", input_len=16, prefix_len=32, num_prefixes=2,
                               num_prompts=8, concurrency=2, arms=("fp8",)), profile_steps=3)
    manifest = run_capture(standin, cfg)
    assert manifest["status"] == "ok"
    (point,) = manifest["arms"]["fp8"]["points"]
    assert point["traced_pass"]["requests"] == 4 and point["traced_pass"]["completion_tokens"] == 4 * 3
    calls = [c["call"] for c in standin.calls() if c["arm"] == "fp8" and c["call"] != "serve"]
    assert calls == ["reset_prefix_cache", "start_profile"] + ["traced-completion"] * 4 + \
        ["stop_profile", "reset_prefix_cache"]
    assert {(c["detail"]["prompt_tokens"], c["detail"]["max_tokens"]) for c in standin.calls()
            if c["call"] == "traced-completion"} == {(48, 3)}
    assert serving.window_stalls(read_manifest(standin.tmp / "run").runs["fp8"], 3) == {}


@pytest.mark.slow
def test_a_bounded_sweep_window_traces_its_first_point_and_no_timed_point_is_found_stalled(standin):
    cfg = replace(serve_config(standin, scenario="sweep", input_len=None, num_prompts=None, concurrency=None,
                               contexts=(32,), concurrencies=(2, 4), output_len=4, arms=("fp8",)), profile_steps=3)
    manifest = run_capture(standin, cfg)
    points = manifest["arms"]["fp8"]["points"]
    assert len(points) == 2 and "traced_pass" in points[0] and "traced_pass" not in points[1]
    assert points[0]["traced_pass"]["point"] == "input=32,output=3,prompts=4,concurrency=2"
    run = read_manifest(standin.tmp / "run").runs["fp8"]
    assert [p["metrics"]["deltas"]["histograms"][serving.ENGINE_STEPS]["count"] for p in run.points] == [16, 32]
    assert serving.window_stalls(run, 3) == {}
    # Without its traced pass, the run's one window of 3 steps would have closed inside the first point only.
    untraced = replace(run, points=[{k: v for k, v in p.items() if k != "traced_pass"} for p in run.points])
    assert list(serving.window_stalls(untraced, 3)) == [points[0]["point"]]
    assert list(serving.window_stalls(untraced, 20)) == [points[1]["point"]]


def test_a_server_that_ignores_sigint_is_killed(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_FAIL", "ignore-sigint@fp8")
    manifest = run_capture(standin, serve_config(standin, arms=("fp8",)), shutdown_grace_s=0.5)
    assert manifest["arms"]["fp8"]["exit_code"] != 0  # stopped by SIGTERM, so nsys wrote nothing
    assert manifest["status"] == "failed"
    assert standin.pids("server") and not [pid for pid in standin.pids() if alive(pid)]


@pytest.mark.parametrize("sig,to", [(signal.SIGINT, "process"), (signal.SIGTERM, "process"),
                                    (signal.SIGINT, "another thread")])
def test_interrupt_shuts_server_and_client_down(standin, monkeypatch, sig, to):
    """Ctrl-C or SIGTERM while the client runs. The kernel may hand a process-wide signal to any thread;
    "another thread" forces that case, which must still interrupt the main thread's wait."""
    marker = standin.tmp / "bench-started"
    monkeypatch.setenv("STANDIN_BENCH_HANG", str(marker))
    done, rescued = threading.Event(), []

    def interrupt():
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if to == "process":
            os.kill(os.getpid(), sig)
        else:
            signal.pthread_kill(threading.get_ident(), sig)
        if not done.wait(120):  # a hang guard: unblock the main thread so that the test fails, not hangs
            rescued.append(True)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            # Where that did not reach Python either, end every stand-in the capture waits on (each arm's bench
            # hangs) until the capture returns.
            while not done.wait(5):
                for pid in standin.pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)

    handler = signal.getsignal(signal.SIGTERM)
    # Ctrl-C reaches a user's `kvtrace capture` in a terminal through Python's own handler. A suite started as a
    # background job of a script (`pytest … &`: no job control) inherits SIGINT ignored, and Python keeps SIG_IGN
    # in every worker; the test then hung. It installs Python's handler for its run and puts the inherited back.
    foreign = signal.getsignal(signal.SIGINT)
    if foreign is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_capture(standin, serve_config(standin))
    finally:
        done.set()
        if foreign is not signal.default_int_handler and foreign is not None:  # None: not set from Python
            signal.signal(signal.SIGINT, foreign)
    assert marker.exists() and not rescued
    manifest = json.loads((standin.tmp / "run" / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    assert manifest["arms"]["fp8"]["status"] == "failed" and "interrupted" in manifest["arms"]["fp8"]["error"]
    assert manifest["arms"]["nvfp4"]["status"] == "not run"
    assert "GPU KV cache size" in (standin.tmp / "run" / "fp8.log").read_text()
    assert standin.pids("server") and standin.pids("bench")
    assert not [pid for pid in standin.pids() if alive(pid)]
    assert signal.getsignal(signal.SIGTERM) is handler  # restored


def test_cli_exit_code_on_partial_failure(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_FAIL", "bench@nvfp4")
    cfg = serve_config(standin)
    result = CliRunner().invoke(capture_cli.capture, [
        "vllm", "--model", cfg.model, "--scenario", "decode-heavy", "--input-len", "32", "--output-len", "4",
        "--num-prompts", "6", "--concurrency", "3", "--load-format", "dummy", "--port", str(cfg.port),
        "--repeats", "1", "--nsys", standin.nsys, "--out", str(standin.tmp / "cli-run")])
    assert result.exit_code == 1, result.output
    assert "fp8: ok -> " in result.output and "GPU KV cache 100,000 tokens" in result.output
    assert "nvfp4: failed (vllm bench serve exited with code 1" in result.output


def offline_config(standin, **kwargs) -> vllm_config.VllmCapture:
    workload = {"input_len": 64, "output_len": 8, "num_prompts": 8, "concurrency": 4}
    return config(kwargs.pop("scenario", "decode-heavy"), mode="offline", arms=kwargs.pop("arms", ("auto", "fp8")),
                  model=str(TINY), **{**workload, **kwargs})


@pytest.mark.slow
def test_offline_runs_the_worker_under_nsys(standin):
    shutil.rmtree(standin.tmp / "site" / "torch")  # this run's worker imports the real torch, as on the GPU host
    manifest = run_capture(standin, offline_config(standin))
    run = standin.tmp / "run"
    assert manifest["status"] == "ok" and manifest["request_order_matched"] is True
    for name, tokens in (("auto", 50_000), ("fp8", 100_000)):
        arm = manifest["arms"][name]
        assert arm["status"] == "ok" and arm["exit_code"] == 0 and arm["kv_cache"]["tokens"] == tokens
        assert arm["workload"]["engine"]["kv_cache_tokens"] == tokens and arm["workload"]["kv_cache_dtype"] == name
        assert arm["workload"]["versions"]["vllm"] == "0.0.0+standin"
        # The real torch's (a wheel's local tag, e.g. +cu130, may be in __version__ only).
        assert arm["workload"]["versions"]["torch"].split("+")[0] == metadata.version("torch").split("+")[0]
        point = arm["points"][0]
        assert (point["requests"], point["tokens_in"], point["tokens_out"]) == (8, 8 * 64, 8 * 8)
        counters = point["metrics"]["deltas"]["counters"]
        assert counters["vllm:prompt_tokens_total"] == 8 * 64 and counters["vllm:request_success_total"] == 8
        result = json.loads((run / f"{name}.workload.json").read_text())
        assert result["kv_cache"]["tokens"] == tokens and "metrics_before" in result["points"][0]
        assert (run / arm["sqlite"]).exists() and (run / f"{name}.manifest.json").exists()
        command = arm["commands"][0]
        assert "--trace-fork-before-exec=true" in command and "--capture-range=cudaProfilerApi" in command
        assert command[command.index("--") + 1:][:4] == ["--model", str(TINY), "--kv-cache-dtype", name]
    calls = [(c["call"], c["detail"]) for c in standin.calls() if c["arm"] == "fp8"]
    assert calls[0] == ("init", {"kv_cache_dtype": "fp8", "attention_backend": "FLASHINFER", "load_format": "dummy",
                                 "skip_tokenizer_init": True, "enable_prefix_caching": False})
    assert calls[1:] == [("generate", 8), ("start_profile", None), ("generate", 8), ("stop_profile", None)]


@pytest.mark.slow
def test_offline_profile_steps_trace_a_traced_pass_before_the_timed_points(standin):
    """The worker's window wraps a traced pass of the first point (two waves, at most N output tokens), the prefix
    cache is reset after it, and the timed points run outside any window."""
    cfg = replace(offline_config(standin, scenario="prefix-reuse", input_len=16, prefix_len=32, num_prefixes=2),
                  profile_steps=3)
    manifest = run_capture(standin, cfg)
    assert manifest["status"] == "ok" and manifest["request_order_matched"] is True
    for name in ("auto", "fp8"):
        (point,) = manifest["arms"][name]["points"]
        assert point["traced_pass"] == {"point": "input=16,output=3,prompts=8,concurrency=4,prefix=32,prefixes=2",
                                        "requests": 8, "completion_tokens": 24,
                                        "seconds": point["traced_pass"]["seconds"]}
        assert "--traced-pass-steps" in manifest["arms"][name]["commands"][0]
    calls = [c["call"] for c in standin.calls() if c["arm"] == "fp8"]
    assert calls == ["init", "generate", "reset_prefix_cache", "start_profile", "generate", "stop_profile",
                     "reset_prefix_cache", "generate"]
    assert serving.window_stalls(read_manifest(standin.tmp / "run").runs["fp8"], 3) == {}


@pytest.mark.slow
def test_offline_prefix_reuse_counts_cached_tokens(standin):
    cfg = offline_config(standin, scenario="prefix-reuse", input_len=16, prefix_len=32, num_prefixes=2)
    manifest = run_capture(standin, cfg)
    assert manifest["status"] == "ok" and manifest["request_order_matched"] is True
    point = manifest["arms"]["fp8"]["points"][0]
    assert point["cached_tokens"] == 6 * 32 and sorted(point["cached_tokens_per_request"]) == [0, 0] + [32] * 6
    assert point["metrics"]["deltas"]["counters"]["vllm:prefix_cache_hits_total"] == 6 * 32
    calls = [c["call"] for c in standin.calls() if c["arm"] == "fp8"]
    assert calls == ["init", "generate", "reset_prefix_cache", "start_profile", "generate", "stop_profile"]


@pytest.mark.slow
def test_offline_sweep_stops_at_capacity_and_matches_the_grid(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_KV_TOKENS", "1000")  # fp8 holds 1,000 tokens, auto 500
    cfg = offline_config(standin, scenario="sweep", input_len=None, num_prompts=None, concurrency=None,
                         contexts=(64, 256), concurrencies=(2, 4, 8))
    manifest = run_capture(standin, cfg)
    assert manifest["settings"]["arms"] == ["fp8", "auto"]
    fp8, auto = manifest["arms"]["fp8"], manifest["arms"]["auto"]
    ran = [point["point"] for point in fp8["points"]]
    assert ran == ["input=64,output=8,prompts=2,concurrency=2", "input=64,output=8,prompts=4,concurrency=4",
                   "input=64,output=8,prompts=8,concurrency=8", "input=256,output=8,prompts=2,concurrency=2",
                   "input=256,output=8,prompts=4,concurrency=4"]
    assert fp8["points"][-1]["capacity"] == "4 preemptions"  # one per request the stand-in could not fit
    assert [point["point"] for point in auto["points"]] == ran
    assert "--stop-at-capacity" in fp8["commands"][0] and "--stop-at-capacity" not in auto["commands"][0]
    assert fp8["commands"][0].count("--point") == 6 and auto["commands"][0].count("--point") == 5
    assert manifest["request_order_matched"] is True


@pytest.mark.slow
def test_offline_worker_failure_is_recorded(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_FAIL", "worker@fp8")
    manifest = run_capture(standin, offline_config(standin))
    assert manifest["arms"]["auto"]["status"] == "ok"
    fp8 = manifest["arms"]["fp8"]
    assert fp8["status"] == "failed" and "workload under nsys exited with code 1 (see fp8.log)" in fp8["error"]
    assert "illegal memory access" in (standin.tmp / "run" / "fp8.log").read_text()
    assert manifest["status"] == "partial"


@pytest.mark.slow
def test_offline_repeats_interleave_and_a_failed_run_keeps_the_others(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_FAIL", "export@auto.r1")
    manifest = run_capture(standin, offline_config(standin, repeats=2))
    run = standin.tmp / "run"
    order = ["auto.r1", "fp8.r1", "auto.r2", "fp8.r2"]
    assert list(manifest["arms"]) == order and manifest["status"] == "partial"
    assert (manifest["settings"]["arms"], manifest["settings"]["repeats"], manifest["settings"]["order"]) == (
        ["auto", "fp8"], 2, order)
    assert manifest["request_order_matched"] is True
    # The stand-in LLM logs the KV dtype each engine started with: the arms alternate.
    assert [c["arm"] for c in standin.calls() if c["call"] == "init"] == ["auto", "fp8", "auto", "fp8"]
    for name, entry in manifest["arms"].items():
        arm, repeat = name.split(".r")
        assert (entry["name"], entry["arm"], entry["repeat"], entry["kv_cache_dtype"]) == (name, arm, int(repeat), arm)
        assert entry["workload"]["kv_cache_dtype"] == arm
        for file in (f"{name}.log", f"{name}.nsys-rep", f"{name}.workload.json", f"{name}.manifest.json"):
            assert (run / file).exists(), file
        per_run = json.loads((run / f"{name}.manifest.json").read_text())
        assert list(per_run["arms"]) == [name] and per_run["status"] == entry["status"]
        if name == "auto.r1":
            assert entry["status"] == "failed" and "nsys export failed" in entry["error"]
            assert not (run / f"{name}.sqlite").exists()
        else:
            assert entry["status"] == "ok" and (run / entry["sqlite"]).exists() and entry["sqlite"] == f"{name}.sqlite"


@pytest.mark.slow
def test_serve_repeats_name_every_file_by_run(standin):
    manifest = run_capture(standin, serve_config(standin, repeats=2))
    run = standin.tmp / "run"
    order = ["fp8.r1", "nvfp4.r1", "fp8.r2", "nvfp4.r2"]
    assert manifest["status"] == "ok" and list(manifest["arms"]) == order and manifest["settings"]["order"] == order
    for name, entry in manifest["arms"].items():
        point = entry["points"][0]
        assert point["metrics"]["cache_config"][0]["cache_dtype"] == entry["arm"] == name.split(".")[0]
        assert point["bench_result"] == f"{name}.bench.json"
        for file in (entry["sqlite"], entry["report"], f"{name}.log", f"{name}.bench.log", f"{name}.manifest.json",
                     point["metrics"]["before"], point["metrics"]["after"]):
            assert file.startswith(name + ".") and (run / file).exists(), file
    assert not [pid for pid in standin.pids() if alive(pid)]


@pytest.mark.slow
def test_force_rules_follow_the_runner(standin):
    run_capture(standin, offline_config(standin, arms=("fp8",)))
    with pytest.raises(KvtraceError, match="already holds a run: pass --force"):
        run_capture(standin, offline_config(standin, arms=("fp8",)))
    assert run_capture(standin, offline_config(standin, arms=("fp8",)), force=True)["status"] == "ok"


def test_capture_imports_no_analyzer_and_no_engine():
    code = ("import sys, kvtrace.capture.cli, kvtrace.capture.vllm_engine, kvtrace.capture.vllm_offline_workload; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('polars', 'matplotlib', 'torch', 'vllm', "
            "'prometheus_client') or m.startswith('kvtrace.analyzer')]; print(bad); sys.exit(bool(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
