"""What a Hugging Face config.json says about a model's KV cache: its layers, grouped by how they cache tokens.

A layout is a list of layer groups: full attention (K and V of every KV head for every token), sliding-window
attention (the same rows, but only the last `window` tokens) and MLA (one latent of kv_lora_rank +
qk_rope_head_dim values per token, shared by all heads). Layers without attention KV are counted apart:
recurrent ones (Mamba, linear attention) hold a fixed state per sequence that no per-token figure includes,
and MLP-only blocks hold nothing.

Configs that need a cache this module does not model (chunked local attention, KV shared across layers,
DeepSeek's sparse-attention indexer, cross-attention, layer patterns it cannot read) are refused with
KvtraceError naming the field, never read as plain attention. The bytes of a cached row are kvtrace.kv_formats'.
Standard library only: capture reads configs here too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvtrace.errors import KvtraceError
from kvtrace.kv_formats import kv_bytes_per_token, kv_bytes_per_token_head

FULL, SLIDING, MLA = "full", "sliding", "mla"
# Counts and sizes end at int64, where the columns and sums they meet end.
_LARGEST = 1 << 63

# How many KV layers the layer-type spellings of transformers' configs stand for.
_KV_LAYER_TYPES = {"full_attention": FULL, "attention": FULL, "sliding_attention": SLIDING}
_STATE_LAYER_TYPES = {"mamba", "linear_attention"}  # a fixed recurrent state per sequence, no per-token KV

# transformers fills layer_types from sliding_window_pattern P when a config has none: layer i is windowed
# unless (i + 1) % P == 0 (Gemma3TextConfig default 6, Cohere2Config 4; Gemma2Config alternates, P = 2).
# vLLM builds its attention layers from these layer_types.
_SLIDING_PATTERN_DEFAULTS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}

# Nemotron-H's hybrid_override_pattern: one character per layer.
_PATTERN_LAYERS = {"*": FULL, "M": "mamba", "-": None, "E": None}

# Fields whose cache kvtrace does not model; a config carrying one is refused, never sized as plain attention.
_UNMODELLED = {
    "attention_chunk_size": "chunked local attention",
    "index_topk": "DeepSeek sparse attention's indexer key cache",
    "compress_ratios": "compressed MLA",
    "num_kv_shared_layers": "KV shared across layers",
    "cross_attention_layers": "cross-attention to image tokens",
    "block_configs": "per-layer attention blocks",
    "linear_attn_config": "linear-attention layers",
    "attn_type_list": "linear-attention layers",
}
# Fields of recurrent layers: with no per-layer pattern beside them, the attention layers are unknown.
_STATE_PREFIXES = ("mamba_", "ssm_", "linear_num_", "linear_conv_")

# Read for the layout; capture records exactly these (kv_fields) so the analyzer reads a run as it would the
# config.
KV_FIELDS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "hidden_size", "head_dim", "hidden_size_per_head",
    "attention_head_dim", "n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
    "multi_query", "new_decoder_architecture", "torch_dtype", "dtype", "kv_lora_rank", "qk_rope_head_dim",
    "num_nextn_predict_layers", "sliding_window", "use_sliding_window", "sliding_window_pattern", "layer_types",
    "layers_block_type", "attn_layer_period", "attn_layer_offset", "attn_layer_indices",
    "hybrid_override_pattern", "full_attention_interval", *_UNMODELLED,
)


@dataclass(frozen=True)
class LayerGroup:
    kind: str  # FULL, SLIDING or MLA
    layers: int
    kv_heads: int  # KV heads of each layer; 1 for MLA (its latent serves every head)
    head_dim: int  # values in one cached row: a head's K or V, or the MLA latent
    window: int | None = None  # SLIDING: the tokens each layer keeps

    def bytes_per_token(self, kv_format: str, kv_heads: int | None = None) -> float:
        """Bytes one token adds to the group's layers in kv_format (fp8, nvfp4, bf16, fp16). kv_heads: the KV
        heads one GPU holds of each layer (default all); MLA's latent is never split. ValueError for a format
        kv_formats cannot size at this head_dim."""
        if self.kind == MLA:
            return kv_bytes_per_token_head(kv_format, self.head_dim) * self.layers
        return kv_bytes_per_token(kv_format, head_dim=self.head_dim, layers=self.layers,
                                  kv_heads=self.kv_heads if kv_heads is None else kv_heads)

    def describe(self) -> str:
        plural = "s" if self.layers != 1 else ""
        if self.kind == MLA:
            return f"{self.layers} MLA layer{plural} × latent {self.head_dim}"
        what = f"sliding-window layer{plural} (window {self.window:,})" if self.kind == SLIDING else f"layer{plural}"
        return (f"{self.layers} {what} × {self.kv_heads} KV head{'s' if self.kv_heads != 1 else ''} × head_dim "
                f"{self.head_dim}")


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[LayerGroup, ...]
    layers: int  # num_hidden_layers, with or without KV
    state_layers: int = 0  # Mamba / linear-attention layers: a per-sequence state no per-token figure counts
    attention_heads: int | None = None
    dtype: str | None = None  # torch_dtype: what vLLM's "auto" KV cache stores
    source: str | None = None
    notes: tuple[str, ...] = ()  # fallbacks and exclusions used while reading the config

    @property
    def kv_layers(self) -> int:
        return sum(g.layers for g in self.groups)

    @property
    def linear(self) -> bool:
        """One group that holds every token, no recurrent state: bytes grow by the same amount every token."""
        return len(self.groups) == 1 and self.groups[0].kind != SLIDING and not self.state_layers

    def bytes_per_token(self, kv_format: str, kv_heads: int | None = None) -> float:
        """Bytes one token adds while every KV layer still holds it (windowed layers stop adding past their
        window)."""
        return sum(g.bytes_per_token(kv_format, kv_heads) for g in self.groups)

    def describe(self) -> str:
        text = " + ".join(g.describe() for g in self.groups)
        if self.kv_layers != self.layers:
            text += f" of {self.layers} layers"
        if self.state_layers:
            text += f" ({self.state_layers} recurrent)"
        return text


def plain(layers: int, kv_heads: int, head_dim: int, *, attention_heads: int | None = None, dtype: str | None = None,
          source: str | None = None, notes: tuple[str, ...] = ()) -> KVLayout:
    """A model whose every layer is full attention with the same KV heads and head dim (plain GQA/MHA)."""
    return KVLayout((LayerGroup(FULL, layers, kv_heads, head_dim),), layers, attention_heads=attention_heads,
                    dtype=dtype, source=source, notes=notes)


def format_problem(layout: KVLayout, kv_format: str) -> str | None:
    """Why vLLM has no cache of this layout in `kv_format` (fp8, nvfp4, bf16, fp16), or None."""
    if kv_format == "nvfp4" and any(g.kind == MLA for g in layout.groups):
        # vLLM's dense MLA backends cache the latent as auto/bf16/fp8 only (supported_kv_cache_dtypes of
        # v1/attention/backends/mla/flashinfer_mla.py and its peers); nvfp4_ds_mla (352 B/token) is
        # FlashMLA-sparse's DeepSeek-V3.2 format on SM100 (v1/attention/backends/mla/flashmla_sparse.py).
        return ("vLLM has no NVFP4 cache for an MLA latent (its MLA backends store auto, bf16 or fp8; nvfp4_ds_mla "
                "is FlashMLA-sparse's DeepSeek-V3.2 format): size fp8 or bf16")
    return None


def text_part(config: dict) -> dict:
    """The language model's config: multimodal configs nest it under text_config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def kv_fields(config: dict) -> dict:
    """The fields read() looks at, from the language model's part (the model dtype may sit at the top)."""
    text = text_part(config)
    fields = {k: v for k, v in text.items() if k in KV_FIELDS or k.startswith(_STATE_PREFIXES)}
    for key in ("torch_dtype", "dtype", "model_type"):
        if key not in fields and config.get(key) is not None:
            fields[key] = config[key]
    return fields


def read(config: dict, source: str) -> KVLayout:
    """The KV layout of a Hugging Face config.json (or of the fields kv_fields() kept from one)."""
    if not isinstance(config, dict):
        raise KvtraceError(f"{source} is not a model config (a JSON object): pass the model's config.json")
    text = text_part(config)
    notes = []
    if text is not config:
        notes.append("read text_config (the language model of a multimodal config)")
    for key, what in _UNMODELLED.items():
        if text.get(key):
            raise KvtraceError(f"{source}: {what} ({key}) is not modelled by kvtrace capacity: no bytes per token "
                               "are given for this model")
    layers = _positive(text, "num_hidden_layers", source)
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype")
    dtype = dtype if isinstance(dtype, str) else None
    heads = _positive(text, "num_attention_heads", source, required=False)
    if text.get("kv_lora_rank") is not None:
        groups, state_layers = _mla(text, layers, source, notes), 0
    else:
        kv_heads, head_dim = _attention_shape(text, heads, source, notes)
        kinds = _layer_kinds(text, text.get("model_type") or config.get("model_type"), layers, source, notes)
        state_layers = sum(count for kind, count in kinds.items() if kind in _STATE_LAYER_TYPES)
        window = _window(text, kinds, source)
        groups = tuple(LayerGroup(kind, count, kv_heads, head_dim, window if kind == SLIDING else None)
                       for kind in (FULL, SLIDING) if (count := kinds.get(kind, 0)))
        if not groups:
            raise KvtraceError(f"{source}: none of its {layers} layers is an attention layer: no KV cache to size")
        if state_layers:
            notes.append(f"{state_layers} recurrent layers (Mamba / linear attention) keep a fixed state per "
                         "sequence that is not counted here")
        if layers - state_layers - sum(g.layers for g in groups):
            notes.append(f"{layers - state_layers - sum(g.layers for g in groups)} layers have no attention "
                         "(MLP or MoE only) and hold no KV")
    return KVLayout(groups, layers, state_layers, heads, dtype, source, tuple(notes))


def _positive(text: dict, key: str, source: str, *, required: bool = True) -> int | None:
    value = text.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < _LARGEST:
        if value is None:
            raise KvtraceError(f"{source} lacks {key}: pass a Hugging Face config.json, or give --layers, "
                               "--kv-heads and --head-dim")
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
        raise KvtraceError(f"{source}: {key} is {shown}, not a positive whole number below 2^63: fix the config")
    return value


def _mla(text: dict, layers: int, source: str, notes: list[str]) -> tuple[LayerGroup, ...]:
    # vLLM caches kv_lora_rank + qk_rope_head_dim values per token and layer (ModelArchConfigConvertor.
    # get_head_size) with one KV head on every tensor-parallel rank (ModelConfig.get_num_kv_heads).
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern", "sliding_window"):
        if text.get(key):
            raise KvtraceError(f"{source}: MLA (kv_lora_rank) beside a layer pattern ({key}) is not modelled by "
                               "kvtrace capacity")
    latent = _positive(text, "kv_lora_rank", source) + _positive(text, "qk_rope_head_dim", source)
    notes.append(f"MLA: one latent of kv_lora_rank {text['kv_lora_rank']} + qk_rope_head_dim "
                 f"{text['qk_rope_head_dim']} = {latent} values per token and layer, no separate K and V")
    mtp = text.get("num_nextn_predict_layers")
    if isinstance(mtp, int) and mtp > 0:
        notes.append(f"{mtp} multi-token-prediction layer(s) not counted: vLLM caches their KV only when they serve "
                     "speculative decoding")
    return (LayerGroup(MLA, layers, 1, latent),)


def _attention_shape(text: dict, heads: int | None, source: str, notes: list[str]) -> tuple[int, int]:
    # vLLM's spellings, in its order (ModelArchConfigConvertor.get_total_num_kv_heads).
    kv_key = next((k for k in ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num")
                   if text.get(k) is not None), None)
    if kv_key:
        kv_heads = _positive(text, kv_key, source)
    elif text.get("multi_query") and not text.get("new_decoder_architecture"):
        kv_heads = 1  # Falcon's multi-query attention (vLLM's get_total_num_kv_heads)
        notes.append("multi_query: one KV head")
    elif heads:
        kv_heads = heads
        notes.append("no num_key_value_heads: using num_attention_heads (multi-head attention, no GQA)")
    else:
        raise KvtraceError(f"{source} lacks num_key_value_heads and num_attention_heads: pass a Hugging Face "
                           "config.json, or give --layers, --kv-heads and --head-dim")
    head_dim = text.get("head_dim") or text.get("hidden_size_per_head")
    if head_dim:
        head_dim = _positive(text, "head_dim" if text.get("head_dim") else "hidden_size_per_head", source)
    elif text.get("hidden_size") and heads:
        hidden = _positive(text, "hidden_size", source)
        if hidden % heads:
            raise KvtraceError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                               "give head_dim (--head-dim)")
        head_dim = hidden // heads
        notes.append(f"no head_dim: hidden_size / num_attention_heads = {head_dim}")
        if text.get("attention_head_dim") not in (None, head_dim):
            raise KvtraceError(f"{source}: attention_head_dim {text['attention_head_dim']} differs from "
                               f"hidden_size / num_attention_heads = {head_dim}; add head_dim to the config")
    else:
        raise KvtraceError(f"{source} lacks head_dim: pass a Hugging Face config.json, or give --layers, --kv-heads "
                           "and --head-dim")
    return kv_heads, head_dim


def _every(period: int, offset: int, layers: int) -> int:
    """How many of layers 0 … layers-1 are offset modulo period: counted, not listed, so that a config's layer
    count (which may say 10^12) costs nothing."""
    return layers // period + (layers % period > offset)


def _layer_kinds(text: dict, model_type, layers: int, source: str, notes: list[str]) -> dict[str | None, int]:
    """Layers per kind: FULL, SLIDING, a recurrent type ('mamba', 'linear_attention') or None (no attention)."""
    if (types := text.get("layer_types") or text.get("layers_block_type")) is not None:
        key = "layer_types" if text.get("layer_types") else "layers_block_type"
        if not isinstance(types, list) or len(types) != layers:
            raise KvtraceError(f"{source}: {key} should list one type per layer ({layers}): fix the config")
        unknown = sorted({repr(t) for t in types
                          if not isinstance(t, str) or (t not in _KV_LAYER_TYPES and t not in _STATE_LAYER_TYPES)})
        if unknown:
            raise KvtraceError(f"{source}: layer type {', '.join(unknown)} in {key} is not modelled by kvtrace "
                               "capacity")
        return Counter(_KV_LAYER_TYPES.get(t, t) for t in types)
    if (pattern := text.get("hybrid_override_pattern")) is not None:
        if not isinstance(pattern, str) or len(pattern) != layers or set(pattern) - set(_PATTERN_LAYERS):
            raise KvtraceError(f"{source}: hybrid_override_pattern should have one of {''.join(_PATTERN_LAYERS)} "
                               f"per layer ({layers}): fix the config")
        return Counter(_PATTERN_LAYERS[c] for c in pattern)
    if text.get("attn_layer_period") is not None:  # Jamba: transformers' JambaConfig.layers_block_type
        period, offset = text["attn_layer_period"], text.get("attn_layer_offset")
        if not isinstance(period, int) or not isinstance(offset, int) or not 0 <= offset < period:
            raise KvtraceError(f"{source}: attn_layer_period {period!r} / attn_layer_offset {offset!r} do not "
                               "place attention layers: fix the config")
        full = _every(period, offset, layers)
        return {FULL: full, "mamba": layers - full}
    if (indices := text.get("attn_layer_indices")) is not None:  # Bamba
        if not isinstance(indices, list) or not all(isinstance(i, int) and 0 <= i < layers for i in indices):
            raise KvtraceError(f"{source}: attn_layer_indices should list layer numbers below {layers}: fix the "
                               "config")
        return {FULL: len(set(indices)), "mamba": layers - len(set(indices))}
    if (interval := text.get("full_attention_interval")) is not None:  # Qwen3-Next: transformers' default
        if not isinstance(interval, int) or interval < 1:
            raise KvtraceError(f"{source}: full_attention_interval {interval!r} is not a positive whole number")
        full = _every(interval, interval - 1, layers)
        return {FULL: full, "linear_attention": layers - full}
    state = sorted(k for k in text if k.startswith(_STATE_PREFIXES))
    if state:
        raise KvtraceError(f"{source}: recurrent-layer fields ({state[0]}) without a per-layer pattern kvtrace reads "
                           "(layer_types, hybrid_override_pattern, attn_layer_period, attn_layer_indices): which "
                           "layers hold KV is unknown")
    window = text.get("sliding_window")
    if window is None:
        return {FULL: layers}
    if text.get("use_sliding_window") is False:  # Qwen2-family configs carry a window they do not use
        notes.append("sliding_window not used (use_sliding_window is false)")
        return {FULL: layers}
    if isinstance(model_type, str) and model_type in _SLIDING_PATTERN_DEFAULTS:
        period = text.get("sliding_window_pattern", _SLIDING_PATTERN_DEFAULTS[model_type])
        if not isinstance(period, int) or period < 1:
            raise KvtraceError(f"{source}: sliding_window_pattern {period!r} is not a positive whole number")
        if "sliding_window_pattern" not in text:
            notes.append(f"no layer_types: {model_type}'s default pattern, every {period}th layer full attention")
        full = _every(period, period - 1, layers)
        return {FULL: full, SLIDING: layers - full}
    raise KvtraceError(f"{source}: sliding_window {window!r} without layer_types: which layers keep a window "
                       f"depends on the model's code (model_type {model_type!r}); add layer_types to a copy of the "
                       "config")


def _window(text: dict, kinds: dict, source: str) -> int | None:
    if not kinds.get(SLIDING):
        return None
    window = text.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < _LARGEST:
        raise KvtraceError(f"{source}: sliding-window layers but sliding_window is {window!r}: fix the config")
    return window
