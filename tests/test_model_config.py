"""kvtrace.model_config: the config spellings it reads into layer groups, and the ones it refuses. Layer patterns and
shapes named after a model are written out from its published config; the other dicts spell one convention each."""

from __future__ import annotations

import pytest

from kvtrace import model_config
from kvtrace.analyzer import capacity
from kvtrace.errors import KvtraceError
from kvtrace.model_config import FULL, MLA, SLIDING, LayerGroup

GIB = 1 << 30
HEADS = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}


def kinds(layout):
    return [(g.kind, g.layers) for g in layout.groups], layout.state_layers


def test_nemotron_h_pattern_counts_attention_mamba_and_mlp_layers_apart():
    # nvidia/Nemotron-H-8B-Base-8K: 52 characters, '*' attention, 'M' Mamba-2, '-' MLP only.
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    layout = model_config.read({"num_hidden_layers": 52, "hybrid_override_pattern": pattern, **HEADS}, "nemotron-h")
    assert kinds(layout) == ([(FULL, 4)], 24)
    assert any("24 layers have no attention" in note for note in layout.notes)
    with pytest.raises(KvtraceError, match="one of \\*M-E per layer \\(51\\)"):
        model_config.read({"num_hidden_layers": 51, "hybrid_override_pattern": pattern, **HEADS}, "x")


def test_qwen3_next_full_attention_interval_and_granite_layer_types():
    # Qwen/Qwen3-Next-80B-A3B: 48 layers, full attention every 4th (transformers' default layer_types).
    qwen = model_config.read({"num_hidden_layers": 48, "full_attention_interval": 4, "num_attention_heads": 16,
                              "num_key_value_heads": 2, "head_dim": 256}, "qwen3-next")
    assert kinds(qwen) == ([(FULL, 12)], 36) and qwen.groups[0].kv_heads == 2
    granite = model_config.read({"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "mamba"],
                                 **HEADS}, "granite")
    assert kinds(granite) == ([(FULL, 1)], 3)
    bamba = model_config.read({"num_hidden_layers": 32, "attn_layer_indices": [9, 18, 27], **HEADS}, "bamba")
    assert kinds(bamba) == ([(FULL, 3)], 29)


def test_windows_that_are_not_used_and_kv_head_spellings():
    # Qwen2.5 configs carry sliding_window with use_sliding_window false: every layer is full attention.
    qwen = model_config.read({"num_hidden_layers": 28, "sliding_window": 131072, "use_sliding_window": False,
                              **HEADS}, "qwen2.5")
    assert qwen.groups == (LayerGroup(FULL, 28, 8, 128),) and any("not used" in n for n in qwen.notes)
    # Falcon-7B: multi_query without the new decoder architecture is one KV head; ChatGLM's spelling of KV groups.
    falcon = model_config.read({"num_hidden_layers": 32, "num_attention_heads": 71, "hidden_size": 4544,
                                "multi_query": True}, "falcon")
    assert falcon.groups == (LayerGroup(FULL, 32, 1, 64),)
    glm = model_config.read({"num_hidden_layers": 28, "num_attention_heads": 32, "hidden_size": 4096,
                             "multi_query_group_num": 2}, "multi_query_group_num")
    assert glm.groups == (LayerGroup(FULL, 28, 2, 128),)
    with pytest.raises(KvtraceError, match="attention_head_dim 96 differs from hidden_size / num_attention_heads"):
        model_config.read({"num_hidden_layers": 2, "num_attention_heads": 32, "hidden_size": 4096,
                           "attention_head_dim": 96}, "x")


def test_explicit_sliding_window_pattern_and_an_all_windowed_model():
    cohere = model_config.read({"num_hidden_layers": 8, "model_type": "cohere2", "sliding_window": 4096, **HEADS},
                               "cohere2")
    assert kinds(cohere) == ([(FULL, 2), (SLIDING, 6)], 0) and cohere.groups[1].window == 4096
    windowed = model_config.read({"num_hidden_layers": 2, "layer_types": ["sliding_attention"] * 2,
                                  "sliding_window": 256, **HEADS}, "all-windowed")
    # Two layers of 2·8·128 B in FP8, each holding at most 256 / 16 = 16 pages: 2 · 16 · 16 · 2,048 B = 1 MiB.
    bounded = capacity.capacity(windowed, [("fp8", "fp8")], memory_gib=1)
    assert bounded.formats[0].tokens_in_memory is None  # any length fits once 1 MiB does
    tight = capacity.capacity(windowed, [("fp8", "fp8")], memory_gib=0.5 / 1024)  # 512 KiB: 8 pages
    assert tight.formats[0].tokens_in_memory == 8 * 16


def test_mla_is_one_latent_not_split_by_tp_and_refuses_plain_overrides():
    layout = model_config.read({"num_hidden_layers": 27, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                "num_attention_heads": 16, "model_type": "deepseek_v2"}, "deepseek-v2-lite")
    assert layout.groups == (LayerGroup(MLA, 27, 1, 576),)
    sharded = capacity.capacity(layout, [("fp8", "fp8")], tp=4)
    assert sharded.formats[0].bytes_per_token == 27 * 576 and sharded.replicas == 4
    with pytest.raises(KvtraceError, match="drop them"):
        capacity.with_overrides(layout, "x", layers=2)
    with pytest.raises(KvtraceError, match="MLA \\(kv_lora_rank\\) beside a layer pattern \\(layer_types\\)"):
        model_config.read({"num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                           "layer_types": ["full_attention", "sliding_attention"]}, "x")


def test_kv_fields_keep_what_read_needs():
    nested = {"model_type": "gemma3", "torch_dtype": "bfloat16", "vision_config": {"hidden_size": 1152},
              "text_config": {"num_hidden_layers": 12, "sliding_window": 512, "model_type": "gemma3_text",
                              "intermediate_size": 9216, **HEADS}}
    fields = model_config.kv_fields(nested)
    assert "intermediate_size" not in fields and fields["torch_dtype"] == "bfloat16"
    assert model_config.read(fields, "kv_config").groups == model_config.read(nested, "config").groups
