"""`kvtrace capacity`: bytes per token per format from a model's KV layout, TP sharding, page padding, tokens that
fit, and vLLM's measured capacity against the ideal. Expected values come from the issue's worked example, the
formulas written out here (plain GQA, MLA latents, sliding windows, hybrid Mamba models, on the published configs
in fixtures/models/published) and the manifests' own numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from conftest import FIXTURES, NSYS2025_DIR, RECORDED_REPORT, VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY
from kvtrace import model_config
from kvtrace.analyzer import capacity
from kvtrace.capture.vllm_preflight import model_summary
from kvtrace.cli import cli, main
from kvtrace.errors import KvtraceError
from kvtrace.manifest import Manifest

GIB = 1 << 30
TINY = FIXTURES / "models" / "llama-tiny" / "config.json"
CAPACITY_WIN = RECORDED_REPORT / "capacity-win"
VLLM_H200 = [VLLM_COLD_PREFILL, VLLM_DECODE_HEAVY]  # the offline vLLM 0.26 runs
PUBLISHED = FIXTURES / "models" / "published"
DEEPSEEK_V3, GEMMA3_27B = PUBLISHED / "deepseek-v3.json", PUBLISHED / "gemma-3-27b-it.json"
GPT_OSS_120B, JAMBA_MINI = PUBLISHED / "gpt-oss-120b.json", PUBLISHED / "jamba-1.5-mini.json"


def fp8_bytes(layers, heads, dim):  # the formulas, written out
    return 2 * layers * heads * dim


def nvfp4_bytes(layers, heads, dim):
    return 2 * layers * heads * (dim / 2 + dim / 16)


def run_main(args: list[str]):
    """kvtrace's real entry point (one-line errors, exit codes) in-process."""
    return CliRunner().invoke(click.Command("kvtrace", callback=lambda: main([str(a) for a in args])), [])


def test_the_seeds_worked_example_comes_out_exactly():
    shape = model_config.plain(64, 8, 128)
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
    assert data["schema"] == "kvtrace.capacity/2"
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
    layout = model_config.read({"num_hidden_layers": 2, "num_attention_heads": 16, "hidden_size": 2048}, "x")
    assert layout.groups == (model_config.LayerGroup("full", 2, 16, 128),)
    assert any("num_attention_heads" in n for n in layout.notes) and any("hidden_size" in n for n in layout.notes)
    nested = model_config.read({"text_config": {"num_hidden_layers": 3, "num_attention_heads": 8,
                                                "num_key_value_heads": 2, "head_dim": 64}}, "vlm")
    assert nested.groups == (model_config.LayerGroup("full", 3, 2, 64),)
    with pytest.raises(KvtraceError, match="num_hidden_layers"):
        model_config.read({"num_attention_heads": 8, "hidden_size": 512}, "x")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(KvtraceError, match="not readable JSON"):
        capacity.load_config(bad)
    with pytest.raises(KvtraceError, match="no such file"):
        capacity.load_config(tmp_path / "missing.json")


def test_tensor_parallel_shards_kv_heads_and_replicates_when_too_few():
    shape = model_config.plain(64, 8, 128)
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
        capacity.capacity(model_config.plain(1, 8, 128), [("fp8", "fp8")], tp=12)


def test_page_padding_sequences_and_memory():
    shape = model_config.plain(16, 8, 128)
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


@pytest.mark.parametrize("run", VLLM_H200, ids=[p.name for p in VLLM_H200])
def test_measured_capacity_of_real_vllm_runs(run):
    manifest = json.loads((run / "manifest.json").read_text())
    result = capacity.from_run(run)
    for row in result.measured:
        assert row.tokens == manifest["arms"][row.arm]["kv_cache"]["tokens"]
    if len(result.measured) == 2 and {m.format for m in result.measured} == {"bf16", "fp8"}:
        assert result.measured[1].ideal_multiplier == 2.0


# ---- beyond plain GQA: MLA, sliding windows, hybrid Mamba, nested text_config (published configs) ---------

def test_mla_caches_one_latent_per_layer_on_every_gpu():
    """DeepSeek-V3: 61 layers × (kv_lora_rank 512 + qk_rope_head_dim 64) = 61 × 576 values per token, no K/V pair
    and no per-head split (2·L·H·D with H = 128 and D = 7168 / 128 = 56 would claim 874,496 B)."""
    layout = capacity.load_config(DEEPSEEK_V3)
    result = capacity.capacity(layout, [("bf16", "auto"), ("fp8", "fp8")], tp=8, tokens=131_072, memory_gib=40)
    bf16, fp8 = result.formats
    assert fp8.bytes_per_token == 61 * 576 == 35_136 and bf16.bytes_per_token == 61 * 576 * 2 == 70_272
    assert fp8.bytes_per_token_model == 35_136  # TP 8 does not split the latent: each GPU holds all of it
    assert (result.tp, result.kv_heads_per_rank, result.replicas) == (8, 1, 8)
    assert fp8.bytes_for_tokens == 131_072 * 35_136 and fp8.ratio == 0.5
    assert fp8.tokens_in_memory == math.floor(40 * GIB / (35_136 * 16)) * 16
    assert any("multi-token-prediction" in note for note in result.notes)


def test_mla_defaults_to_bf16_and_fp8_and_refuses_nvfp4_through_the_cli():
    out = CliRunner().invoke(cli, ["capacity", "--config", str(DEEPSEEK_V3), "--format", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [(f["label"], f["bytes_per_token"]) for f in data["formats"]] == [("bf16", 70_272), ("fp8", 35_136)]
    assert data["model"]["groups"] == [{"kind": "mla", "layers": 61, "kv_heads": 1, "head_dim": 576, "window": None}]
    assert any(note.startswith("nvfp4 not sized: vLLM has no NVFP4 cache for an MLA latent") for note in data["notes"])
    refused = run_main(["capacity", "--config", DEEPSEEK_V3, "--kv-format", "fp8", "--kv-format", "nvfp4"])
    assert refused.exit_code == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "no NVFP4 cache for an MLA latent" in lines[0] and "56" not in lines[0]


def test_sliding_window_layers_hold_only_their_window():
    """gpt-oss-120b: layer_types alternate sliding (window 128) and full attention, 18 each, 8 KV heads of 64."""
    per_layer = {"fp8": 2 * 8 * 64, "nvfp4": 2 * 8 * (64 / 2 + 64 / 16)}  # K and V rows of every KV head
    layout = capacity.load_config(GPT_OSS_120B)
    assert [(g.kind, g.layers, g.window) for g in layout.groups] == [("full", 18, None), ("sliding", 18, 128)]
    result = capacity.capacity(layout, [("fp8", "fp8"), ("nvfp4", "nvfp4")], tokens=1000, sequences=2,
                               memory_gib=1)
    fp8, nvfp4 = result.formats
    assert fp8.bytes_per_token == 36 * per_layer["fp8"] == 36_864  # until the window is full
    assert nvfp4.bytes_per_token == 36 * per_layer["nvfp4"] and nvfp4.ratio == 0.5625
    # 1,000 tokens: full layers hold all 63 pages of 16; the window covers tokens 872..999, pages 54..62 = 9 pages.
    full_pages, window_pages = 63, 62 - 54 + 1
    assert fp8.bytes_for_tokens == 2 * 16 * (full_pages + window_pages) * 18 * per_layer["fp8"]
    groups = [(g.label, g.kind, g.pages_per_sequence, g.bytes_for_tokens) for g in result.groups]
    assert groups[:2] == [("fp8", "full", 63, 2 * 16 * 63 * 18 * per_layer["fp8"]),
                          ("fp8", "sliding", 9, 2 * 16 * 9 * 18 * per_layer["fp8"])]
    # One sequence in 1 GiB: k pages of full layers plus the window's 128 / 16 = 8 pages, 16 · 18,432 B per page each.
    page_bytes = 16 * 18 * per_layer["fp8"]
    assert fp8.tokens_in_memory == (GIB // page_bytes - 8) * 16
    assert any("sliding-window layers keep at most" in note for note in result.notes)


def test_nested_text_config_with_the_default_sliding_pattern():
    """gemma-3-27b-it nests its language model under text_config and gives no layer_types: transformers' default
    pattern makes every 6th of its 62 layers full attention (layers 5, 11, …, 59: 10), the other 52 keep 1,024
    tokens; 16 KV heads of 128."""
    out = CliRunner().invoke(cli, ["capacity", "--config", str(GEMMA3_27B), "--tokens", "131072", "--kv-format",
                                   "auto", "--kv-format", "fp8", "--format", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [(g["kind"], g["layers"], g["window"]) for g in data["model"]["groups"]] == [("full", 10, None),
                                                                                    ("sliding", 52, 1024)]
    auto, fp8 = data["formats"]
    assert auto["format"] == "bf16"  # "auto" follows the top-level torch_dtype
    assert fp8["bytes_per_token"] == 2 * 62 * 16 * 128 == 253_952
    # 131,072 tokens: full layers hold 8,192 pages of 16, windowed ones the 1,024 / 16 = 64 pages of their window.
    assert fp8["bytes_for_tokens"] == 16 * (8192 * 10 + 64 * 52) * 2 * 16 * 128
    assert auto["bytes_for_tokens"] == 2 * fp8["bytes_for_tokens"]
    assert "read text_config (the language model of a multimodal config)" in data["model"]["notes"]


def test_hybrid_mamba_counts_only_attention_layers():
    """Jamba-1.5-Mini: attention where layer % attn_layer_period 8 == attn_layer_offset 4 (layers 4, 12, 20, 28),
    Mamba elsewhere; 8 KV heads, head_dim 4096 / 32 = 128."""
    result = capacity.capacity(capacity.load_config(JAMBA_MINI), [("fp8", "fp8"), ("nvfp4", "nvfp4")], tp=2)
    fp8, nvfp4 = result.formats
    assert fp8.bytes_per_token == 2 * 4 * (8 // 2) * 128 == 4096  # 4 KV heads per GPU
    assert nvfp4.bytes_per_token == 2 * 4 * (8 // 2) * (128 / 2 + 128 / 16)
    assert result.model.state_layers == 28 and result.groups == []
    assert any("28 recurrent layers" in note and "not counted" in note for note in result.notes)


def test_capture_records_the_layout_the_analyzer_reads_back():
    """capture's model summary keeps the config's KV fields; a run's capacity reads the same layout from them."""
    config = json.loads(DEEPSEEK_V3.read_text())
    summary = model_summary("deepseek-ai/DeepSeek-V3", config, ("auto", "fp8", "nvfp4"))
    assert summary["kv_bytes_per_token"] == {"auto": 61 * 576 * 2, "fp8": 61 * 576}  # no NVFP4 MLA cache
    manifest = Manifest.of({"engine": "vllm", "settings": {"model": summary}, "arms": {}}, Path("manifest.json"))
    layout, _, _ = capacity.run_shape(manifest, "run")
    assert layout.groups == capacity.load_config(DEEPSEEK_V3).groups


def test_a_windowed_run_compares_measured_tokens_between_arms_only(tmp_path):
    """vLLM counts a hybrid-allocator model's tokens as max_model_len-long requests over its groups: no ideal."""
    manifest = json.loads((CAPACITY_WIN / "manifest.json").read_text())
    manifest["settings"]["model"] = model_summary("google/gemma-3-27b-it", json.loads(GEMMA3_27B.read_text()),
                                                  ("fp8", "nvfp4"))
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    result = capacity.from_run(tmp_path)
    assert [m.ideal_tokens for m in result.measured] == [None, None]
    tokens = [manifest["arms"][arm]["kv_cache"]["tokens"] for arm in ("fp8", "nvfp4")]
    assert result.measured[1].multiplier == tokens[1] / tokens[0]
    assert any("compared between arms only" in note for note in result.notes)


def _edited(tmp_path, fixture, edit):
    config = json.loads(fixture.read_text())
    edit(config)
    path = tmp_path / f"edited-{fixture.name}"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("fixture,edit,message", [
    (DEEPSEEK_V3, lambda c: c.update(index_topk=2048), "DeepSeek sparse attention's indexer key cache (index_topk)"),
    (GEMMA3_27B, lambda c: c["text_config"].update(attention_chunk_size=8192), "chunked local attention"),
    (GPT_OSS_120B, lambda c: c.pop("layer_types"), "sliding_window 128 without layer_types"),
    (GPT_OSS_120B, lambda c: c["layer_types"].__setitem__(0, "chunked_attention"), "layer type 'chunked_attention'"),
    (JAMBA_MINI, lambda c: c.pop("attn_layer_period"), "recurrent-layer fields (mamba_d_conv)"),
    (JAMBA_MINI, lambda c: c.update(attn_layer_period=8, attn_layer_offset=9), "do not place attention layers"),
], ids=["sparse-mla-indexer", "chunked-attention", "window-without-layers", "unknown-layer-type",
        "mamba-without-pattern", "bad-attention-period"])
def test_layouts_kvtrace_cannot_size_are_refused(tmp_path, fixture, edit, message):
    """Edited copies of the published configs: what kvtrace cannot size exits 2 with one line, never a number."""
    out = run_main(["capacity", "--config", _edited(tmp_path, fixture, edit)])
    assert out.exit_code == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: ") and message in lines[0], out.stderr


@pytest.mark.parametrize("args,message", [
    (["capacity"], "give the model's shape"),
    (["capacity", "--layers", "4"], "give --kv-heads, --head-dim too"),
    (["capacity", "--layers", "4", "--kv-heads", "8", "--head-dim", "128", "--tp", "3"], "do not split evenly"),
    (["capacity", "--config", "/nonexistent/config.json"], "no such file"),
    (["capacity", "--layers", "4", "--kv-heads", "8", "--head-dim", "100", "--kv-format", "nvfp4"],
     "divisible by 16"),
    (["capacity", "--layers", "4", "--kv-heads", "8", "--head-dim", "128", "--kv-format", "int3"], "unknown KV format"),
    (["capacity", str(FIXTURES / "bad")], "no manifest.json"),
    (["capacity", "--config", str(GEMMA3_27B), "--layers", "4"],
     "describe a model whose every layer is full attention"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = run_main(args)
    assert out.exit_code == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: ") and message in lines[0], out.stderr
