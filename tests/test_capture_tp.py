"""Tensor-parallel vLLM captures (issue 37) through the stand-ins (tests/vllm_standin.py): every rank recorded
in the run's one report, checked after the export, and the manifest's ranks, devices and KV pool per device,
which `kvtrace capacity` sets its ideal against."""

from __future__ import annotations

import pytest

from kvtrace.analyzer import capacity
from kvtrace.capture import vllm_commands as commands
from kvtrace.capture import vllm_engine as engine
from kvtrace.capture import vllm_preflight as preflight
from kvtrace.errors import KvtraceError
from kvtrace.manifest import read_manifest, tensor_parallel_size
from test_capture_vllm import PROBE_B200, config, run_capture, serve_config
from test_capture_vllm import plain_serve, standin  # noqa: F401 (fixtures)

TP2 = ("--tensor-parallel-size", "2")


@pytest.mark.parametrize("flags,size", [((), 1), (TP2, 2), (("-tp", "4"), 4), (("--tensor-parallel-size=8",), 8),
                                        (("-tp=2", "--max-model-len", "4096"), 2)])
def test_tensor_parallel_size_from_vllm_flags(flags, size):
    assert tensor_parallel_size(list(flags)) == size


@pytest.mark.parametrize("flags", [("-tp", "two"), ("--tensor-parallel-size",), ("--tensor-parallel-size=0",)])
def test_a_tensor_parallel_size_that_is_no_whole_number_is_refused(flags):
    with pytest.raises(KvtraceError, match="is not a tensor-parallel size") as raised:
        config(extra=flags).validate()
    assert "\n" not in str(raised.value)


def test_preflight_needs_a_gpu_per_rank():
    with pytest.raises(KvtraceError, match="--tensor-parallel-size 2 needs 2 GPUs, and torch sees 1"):
        preflight.check_probe(dict(PROBE_B200), ("fp8", "nvfp4"), 2)
    preflight.check_probe({**PROBE_B200, "gpu_count": 2}, ("fp8", "nvfp4"), 2)


def test_dry_run_says_how_the_ranks_are_recorded(tmp_path):
    text = commands.dry_run(config(extra=TP2), tmp_path / "run", nsys="nsys", python="python3")
    assert "# tensor parallel: 2 ranks, one report for every rank" in text
    assert "VLLM_WORKER_MULTIPROC_METHOD=spawn" in text and "--trace-fork-before-exec=true" in text
    assert "--tensor-parallel-size 2" in text
    assert "tensor parallel" not in commands.dry_run(config(), tmp_path / "run", nsys="nsys", python="python3")


@pytest.fixture
def two_gpus(standin, monkeypatch):
    monkeypatch.setattr(engine, "probe_environment", lambda python, nvfp4: {**PROBE_B200, "gpu_count": 2})
    monkeypatch.setenv("STANDIN_RANK_GIB", "60.5,60.25")
    return standin


def test_every_rank_is_recorded_with_its_device_and_kv_pool(two_gpus, monkeypatch):
    monkeypatch.setenv("STANDIN_DEVICES", "0,1")
    manifest = run_capture(two_gpus, serve_config(two_gpus, extra=TP2))
    assert manifest["status"] == "ok"
    ranks = manifest["settings"]["ranks"]
    assert ranks["tensor_parallel_size"] == 2 and "spawned" in ranks["recorded"]
    for arm in manifest["arms"].values():
        assert arm["ranks"] == [{"rank": 0, "device": 0, "kernels": 3, "processes": [100]},
                                {"rank": 1, "device": 1, "kernels": 3, "processes": [101]}]
        # each worker's KV memory, and the smallest as the pool every rank is given
        assert arm["kv_cache"]["available_gib_per_rank"] == {"0": 60.5, "1": 60.25}
        assert arm["kv_cache"]["available_gib"] == 60.25
    run = two_gpus.tmp / "run"
    read_manifest(run)  # the typed reader takes what the capture wrote
    found = capacity.from_run(run)
    assert found.tp == 2
    assert {row.available_gib for row in found.measured} == {60.25}
    with pytest.raises(KvtraceError, match="--tp 4, but run ran on 2 GPU"):
        capacity.from_run(run, tp=4)
    assert capacity.from_run(run, tp=2).tp == 2


def test_a_rank_without_kernels_fails_the_run_and_is_named(two_gpus, monkeypatch):
    monkeypatch.setenv("STANDIN_DEVICES", "0")
    manifest = run_capture(two_gpus, serve_config(two_gpus, extra=TP2))
    assert manifest["status"] == "failed"
    for arm in manifest["arms"].values():
        assert arm["status"] == "failed"
        assert "rank(s) 1 of --tensor-parallel-size 2 recorded no kernels (devices with kernels: 0)" in arm["error"]
        assert "VLLM_WORKER_MULTIPROC_METHOD=spawn" in arm["error"]


def test_one_gpu_runs_record_no_ranks(plain_serve):
    manifest = plain_serve.manifest
    assert "ranks" not in manifest["settings"]
    assert all(arm["ranks"] == [] for arm in manifest["arms"].values())
