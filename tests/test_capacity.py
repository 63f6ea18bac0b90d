"""`kvtrace capacity`: bytes per token per format from a model's shape, TP sharding, page padding, tokens that fit,
and vLLM's measured capacity against the ideal. Expected values come from the issue's worked example, the plain
formulas written out here, and the manifests' own numbers."""

from __future__ import annotations

import json
import math

import click
import pytest
from click.testing import CliRunner

from conftest import FIXTURES, NSYS2025_DIR
from kvtrace.analyzer import capacity
from kvtrace.cli import cli, main
from kvtrace.errors import KvtraceError

GIB = 1 << 30
TINY = FIXTURES / "models" / "llama-tiny" / "config.json"
CAPACITY_WIN = FIXTURES / "vllm-recorded-report" / "capacity-win"
VLLM_H200 = sorted(p.parent for p in FIXTURES.glob("vllm-h200-*/manifest.json"))


def fp8_bytes(layers, heads, dim):  # the formulas, written out
    return 2 * layers * heads * dim


def nvfp4_bytes(layers, heads, dim):
    return 2 * layers * heads * (dim / 2 + dim / 16)


def run_main(args: list[str]):
    """kvtrace's real entry point (one-line errors, exit codes) in-process."""
    return CliRunner().invoke(click.Command("kvtrace", callback=lambda: main([str(a) for a in args])), [])


def test_the_seeds_worked_example_comes_out_exactly():
    shape = capacity.ModelShape(layers=64, kv_heads=8, head_dim=128)
    result = capacity.capacity(shape, [("fp8", "fp8"), ("nvfp4", "nvfp4")], tokens=131_072)
    fp8, nvfp4 = result.formats
    assert fp8.bytes_per_token == 131_072 and nvfp4.bytes_per_token == 73_728
    assert fp8.bytes_for_tokens == 16 * GIB and nvfp4.bytes_for_tokens == 9 * GIB
    assert fp8.gib_for_tokens == 16.0 and nvfp4.gib_for_tokens == 9.0
    assert result.ideal_ratio == 0.5625 and nvfp4.ratio == 0.5625
    assert round(result.ideal_multiplier, 2) == 1.78 and result.ideal_multiplier == pytest.approx(16 / 9)


def test_worked_example_through_the_cli():
    runner = CliRunner()
    out = runner.invoke(cli, ["capacity", "--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--tokens",
                              "131072", "--format", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["schema"] == "kvtrace.capacity/1"
    assert [f["bytes_per_token"] for f in data["formats"]] == [131_072, 73_728]
    assert [f["bytes_for_tokens"] for f in data["formats"]] == [16 * GIB, 9 * GIB]
    assert data["ideal_ratio"] == 0.5625
    text = runner.invoke(cli, ["capacity", "--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--tokens",
                               "131072", "--format", "markdown"]).stdout
    assert "131,072 B" in text and "73,728 B" in text and "16 GiB" in text and "9 GiB" in text
    assert "ratio 0.5625, capacity 1.78×" in text
    table = runner.invoke(cli, ["capacity", "--layers", "64", "--kv-heads", "8", "--head-dim", "128"]).stdout
    assert "131,072 B" in table and "1.78×" in table


def test_bytes_per_token_from_a_hugging_face_config():
    config = json.loads(TINY.read_text())
    layers, heads, dim = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
    result = capacity.capacity(capacity.load_config(TINY.parent), [("bf16", "auto"), ("fp8", "fp8"), ("nvfp4", "nvfp4")])
    bf16, fp8, nvfp4 = result.formats
    assert (bf16.format, fp8.format, nvfp4.format) == ("bf16", "fp8", "nvfp4")  # auto follows torch_dtype
    assert fp8.bytes_per_token == fp8_bytes(layers, heads, dim)
    assert nvfp4.bytes_per_token == nvfp4_bytes(layers, heads, dim)
    assert bf16.bytes_per_token == 2 * fp8_bytes(layers, heads, dim)
    assert fp8.ratio == 0.5 and nvfp4.ratio == pytest.approx(0.5625 / 2)


def test_config_fallbacks_and_missing_fields(tmp_path):
    # No num_key_value_heads: multi-head attention; no head_dim: hidden_size / num_attention_heads.
    shape = capacity.shape_from_config({"num_hidden_layers": 2, "num_attention_heads": 16, "hidden_size": 2048}, "x")
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (2, 16, 128)
    assert any("num_attention_heads" in n for n in shape.notes) and any("hidden_size" in n for n in shape.notes)
    nested = capacity.shape_from_config({"text_config": {"num_hidden_layers": 3, "num_attention_heads": 8,
                                                         "num_key_value_heads": 2, "head_dim": 64}}, "vlm")
    assert (nested.layers, nested.kv_heads, nested.head_dim) == (3, 2, 64)
    with pytest.raises(KvtraceError, match="num_hidden_layers"):
        capacity.shape_from_config({"num_attention_heads": 8, "hidden_size": 512}, "x")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(KvtraceError, match="not readable JSON"):
        capacity.load_config(bad)
    with pytest.raises(KvtraceError, match="no such file"):
        capacity.load_config(tmp_path / "missing.json")


def test_tensor_parallel_shards_kv_heads_and_replicates_when_too_few():
    shape = capacity.ModelShape(layers=64, kv_heads=8, head_dim=128)
    one = capacity.capacity(shape, [("fp8", "fp8")], tp=1).formats[0].bytes_per_token
    two = capacity.capacity(shape, [("fp8", "fp8")], tp=2)
    assert two.kv_heads_per_rank == 4 and two.replicas == 1 and two.formats[0].bytes_per_token == one / 2
    assert two.formats[0].bytes_per_token_model == one
    sixteen = capacity.capacity(shape, [("fp8", "fp8"), ("nvfp4", "nvfp4")], tp=16)
    assert sixteen.kv_heads_per_rank == 1 and sixteen.replicas == 2
    assert sixteen.formats[0].bytes_per_token == fp8_bytes(64, 1, 128)  # one head per GPU, not half a head
    assert any("replicated on 2 GPUs" in note for note in sixteen.notes)
    with pytest.raises(KvtraceError, match="do not split evenly"):
        capacity.capacity(shape, [("fp8", "fp8")], tp=3)
    with pytest.raises(KvtraceError, match="not a multiple"):
        capacity.capacity(capacity.ModelShape(layers=1, kv_heads=8, head_dim=128), [("fp8", "fp8")], tp=12)


def test_page_padding_sequences_and_memory():
    shape = capacity.ModelShape(layers=16, kv_heads=8, head_dim=128)
    per_token = fp8_bytes(16, 8, 128)
    result = capacity.capacity(shape, [("fp8", "fp8"), ("nvfp4", "nvfp4")], tokens=1000, sequences=3, page_size=16,
                               memory_gib=10)
    fp8, nvfp4 = result.formats
    assert fp8.padded_tokens == 3 * 1008 and fp8.tokens == 3000  # 1,000 tokens fill 63 pages of 16
    assert fp8.bytes_for_tokens == 3 * 1008 * per_token
    assert nvfp4.bytes_for_tokens == 3 * 1008 * nvfp4_bytes(16, 8, 128)
    assert fp8.tokens_in_memory == math.floor(10 * GIB / (per_token * 16)) * 16
    assert nvfp4.tokens_in_memory == math.floor(10 * GIB / (nvfp4_bytes(16, 8, 128) * 16)) * 16
    assert any("padded" in note for note in result.notes)


def test_flashinfer_run_directory_bytes_match_its_manifest():
    """The FlashInfer engine's manifest gives KV bytes per attention call; per token they are the ideal bytes."""
    manifest = json.loads((NSYS2025_DIR / "manifest.json").read_text())
    result = capacity.from_run(NSYS2025_DIR)
    for row in result.formats:
        workload = manifest["arms"][row.label]["workload"]
        batch = workload["settings"]["batch"]
        for context in workload["contexts"]:
            assert row.bytes_per_token == context["kv_bytes_read_per_attention_call"] / (batch * context["context"])
    assert result.measured == [] and any("no serving KV pool" in n for n in result.notes)
    assert result.ideal_ratio == 0.5625


def test_measured_capacity_against_the_ideal_from_a_vllm_manifest():
    manifest = json.loads((CAPACITY_WIN / "manifest.json").read_text())
    model = manifest["settings"]["model"]
    layers, heads, dim = model["num_hidden_layers"], model["num_key_value_heads"], model["head_dim"]
    result = capacity.from_run(CAPACITY_WIN)
    assert [m.arm for m in result.measured] == ["fp8", "nvfp4"]
    for row, per_token in zip(result.measured, (fp8_bytes(layers, heads, dim), nvfp4_bytes(layers, heads, dim))):
        kv = manifest["arms"][row.arm]["kv_cache"]
        assert row.tokens == kv["tokens"] and row.available_gib == kv["available_gib"]
        assert row.ideal_tokens == math.floor(kv["available_gib"] * GIB / (per_token * 16)) * 16
        assert row.measured_over_ideal == kv["tokens"] / row.ideal_tokens
    fp8, nvfp4 = result.measured
    tokens = {arm: manifest["arms"][arm]["kv_cache"]["tokens"] for arm in ("fp8", "nvfp4")}
    assert nvfp4.multiplier == tokens["nvfp4"] / tokens["fp8"]
    assert nvfp4.ideal_multiplier == pytest.approx(16 / 9)
    out = CliRunner().invoke(cli, ["capacity", str(CAPACITY_WIN), "--format", "markdown"])
    assert out.exit_code == 0, out.output
    assert "GPU KV cache size" in out.stdout and f"{manifest['arms']['nvfp4']['kv_cache']['tokens']:,}" in out.stdout
    csv_text = CliRunner().invoke(cli, ["capacity", str(CAPACITY_WIN), "--format", "csv"]).stdout
    assert csv_text.splitlines()[0].startswith("section,label,format,bytes_per_token")
    assert sum(line.startswith("measured,") for line in csv_text.splitlines()) == 2


@pytest.mark.skipif(not VLLM_H200, reason="no real vLLM H200 run directories under fixtures/ yet")
@pytest.mark.parametrize("run", VLLM_H200, ids=[p.name for p in VLLM_H200])
def test_measured_capacity_of_real_vllm_runs(run):
    manifest = json.loads((run / "manifest.json").read_text())
    result = capacity.from_run(run)
    for row in result.measured:
        assert row.tokens == manifest["arms"][row.arm]["kv_cache"]["tokens"]
    if len(result.measured) == 2 and {m.format for m in result.measured} == {"bf16", "fp8"}:
        assert result.measured[1].ideal_multiplier == 2.0


@pytest.mark.parametrize("args,message", [
    (["capacity"], "give the model's shape"),
    (["capacity", "--layers", "4"], "give --kv-heads, --head-dim too"),
    (["capacity", "--layers", "4", "--kv-heads", "8", "--head-dim", "128", "--tp", "3"], "do not split evenly"),
    (["capacity", "--config", "/nonexistent/config.json"], "no such file"),
    (["capacity", "--layers", "4", "--kv-heads", "8", "--head-dim", "100", "--kv-format", "nvfp4"],
     "divisible by 16"),
    (["capacity", "--layers", "4", "--kv-heads", "8", "--head-dim", "128", "--kv-format", "int3"], "unknown KV format"),
    (["capacity", str(FIXTURES / "bad")], "no manifest.json"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = run_main(args)
    assert out.exit_code == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: ") and message in lines[0], out.stderr
