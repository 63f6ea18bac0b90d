"""KV-cache capacity: bytes per token per format from a model's shape, what fits in memory, and, for a vLLM run
directory, the capacity vLLM measured against the ideal.

The byte math is kvtrace.capture.formats' (one implementation for capture and analysis): per token, K and V
of every layer and every KV head a GPU holds, FP8 = D bytes per head, NVFP4 = D/2 packed bytes plus D/16
E4M3 scales, BF16 = 2·D. Importing formats needs no torch (its quantizers import torch inside).

Tensor parallelism shards KV heads across ranks: H/T heads per rank when H >= T (vLLM requires H % T == 0);
when T > H each rank holds one head and every head is replicated on T/H ranks, so per-GPU bytes stop
shrinking. Capacity is counted in whole pages: a sequence occupies ceil(tokens / page_size) pages.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtrace import __version__
from kvtrace.capture import formats
from kvtrace.errors import KvtraceError

CAPACITY_SCHEMA = "kvtrace.capacity/1"
GIB = 1 << 30

# Names as users, vLLM's --kv-cache-dtype and manifests spell them -> formats' names. "auto" is the model dtype.
_CANONICAL = {"fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "fp8_e4m3fn": "fp8", "nvfp4": "nvfp4",
              "nvfp4_4over6": "nvfp4", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
              "half": "fp16"}
_MODEL_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16"}


def canonical_format(name: str, model_dtype: str | None = None) -> str:
    """fp8, nvfp4, bf16 or fp16 for a format or vLLM --kv-cache-dtype name; 'auto' follows the model dtype."""
    key = name.lower()
    if key == "auto":
        return _MODEL_DTYPES.get((model_dtype or "bfloat16").lower(), "bf16")
    if key not in _CANONICAL:
        raise KvtraceError(f"unknown KV format {name!r}: use fp8, nvfp4, bf16, fp16 or a vLLM --kv-cache-dtype "
                           "such as auto, fp8_e4m3 or nvfp4")
    return _CANONICAL[key]


def format_width(name: str, model_dtype: str | None = None) -> float:
    """Bytes per stored value: what orders arms widest (baseline) first."""
    try:
        return formats.kv_bytes_per_token_head(canonical_format(name, model_dtype), formats.NVFP4_BLOCK) / 16
    except KvtraceError:
        return 0.0


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    attention_heads: int | None = None
    dtype: str | None = None  # torch_dtype, what vLLM's "auto" KV cache stores
    source: str | None = None
    notes: tuple[str, ...] = ()  # fallbacks used while reading the config


def shape_from_config(config: dict, source: str) -> ModelShape:
    """num_hidden_layers, num_key_value_heads (else num_attention_heads: no GQA), head_dim (else hidden_size /
    num_attention_heads), from a Hugging Face config.json or the model summary in a vLLM manifest."""
    text = config.get("text_config") or config  # multimodal configs nest the language model
    notes = []
    if text is not config:
        notes.append("read text_config (the language model of a multimodal config)")
    layers = text.get("num_hidden_layers")
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads")
    if kv_heads is None and heads is not None:
        kv_heads = heads
        notes.append("no num_key_value_heads: using num_attention_heads (multi-head attention, no GQA)")
    head_dim = text.get("head_dim")
    if head_dim is None and text.get("hidden_size") and heads:
        if text["hidden_size"] % heads:
            raise KvtraceError(f"{source}: hidden_size {text['hidden_size']} is not a multiple of "
                               f"num_attention_heads {heads}; give head_dim (--head-dim)")
        head_dim = text["hidden_size"] // heads
        notes.append(f"no head_dim: hidden_size / num_attention_heads = {head_dim}")
    missing = [name for name, value in (("num_hidden_layers", layers), ("num_key_value_heads", kv_heads),
                                        ("head_dim", head_dim)) if not value]
    if missing:
        raise KvtraceError(f"{source} lacks {', '.join(missing)}: pass a Hugging Face config.json, or give "
                           "--layers, --kv-heads and --head-dim")
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype")
    return ModelShape(layers=int(layers), kv_heads=int(kv_heads), head_dim=int(head_dim),
                      attention_heads=int(heads) if heads else None, dtype=dtype, source=source, notes=tuple(notes))


def load_config(path: Path) -> ModelShape:
    """A config.json, or a model directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise KvtraceError(f"{path}: no such file: pass a Hugging Face config.json or the model directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise KvtraceError(f"{path} is not readable JSON ({error}): pass the model's config.json") from None
    if not isinstance(config, dict):
        raise KvtraceError(f"{path} is not a model config (a JSON object): pass the model's config.json")
    return shape_from_config(config, str(path))


@dataclass(frozen=True)
class Sharding:
    tp: int
    kv_heads_per_rank: int
    replicas: int  # ranks that hold each KV head (1: heads split, none duplicated)
    note: str


def shard(kv_heads: int, tp: int) -> Sharding:
    if tp < 1:
        raise KvtraceError(f"--tp {tp}: tensor-parallel size must be at least 1")
    if tp == 1:
        return Sharding(1, kv_heads, 1, f"one GPU holds all {kv_heads} KV heads")
    if kv_heads >= tp:
        if kv_heads % tp:
            raise KvtraceError(f"{kv_heads} KV heads do not split evenly over --tp {tp}: vLLM needs the KV heads "
                               "to be a multiple of the tensor-parallel size")
        return Sharding(tp, kv_heads // tp, 1, f"{kv_heads} KV heads split over {tp} GPUs: {kv_heads // tp} per GPU")
    if tp % kv_heads:
        raise KvtraceError(f"--tp {tp} is not a multiple of the {kv_heads} KV heads: vLLM replicates KV heads "
                           "only when the tensor-parallel size is a multiple of their number")
    return Sharding(tp, 1, tp // kv_heads, f"only {kv_heads} KV heads for {tp} GPUs: each GPU holds 1 head and every "
                    f"head is replicated on {tp // kv_heads} GPUs, so per-GPU bytes do not shrink further")


def bytes_per_token(kv_format: str, shape: ModelShape, heads: int) -> float:
    """K and V of every layer for `heads` KV heads: 2·L·H·(bytes per head-dim row)."""
    return formats.kv_bytes_per_token_head(kv_format, shape.head_dim) * heads * 2 * shape.layers


def _exact(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


@dataclass
class FormatRow:
    label: str  # as given: a format, or a run's arm name
    format: str  # fp8, nvfp4, bf16, fp16
    bytes_per_token: int | float  # per GPU: K and V, all layers, this GPU's KV heads
    bytes_per_token_model: int | float  # the whole model's KV heads, counted once
    ratio: float  # bytes per token / the first format's
    capacity_multiplier: float  # tokens that fit / the first format's (1 / ratio)
    tokens: int | None = None  # requested, all sequences
    padded_tokens: int | None = None  # rounded up to whole pages per sequence
    bytes_for_tokens: int | None = None  # per GPU, whole pages
    gib_for_tokens: float | None = None
    tokens_in_memory: int | None = None  # whole pages in --memory GiB per GPU


@dataclass
class MeasuredRow:
    """vLLM's startup report ("GPU KV cache size: N tokens") against the ideal for the same format."""

    arm: str
    kv_cache_dtype: str
    format: str
    tokens: int  # measured
    line: str | None  # the log line it came from
    available_gib: float | None  # "Available KV cache memory: X GiB", when logged
    ideal_tokens: int | None  # whole pages of ideal bytes per token in available_gib
    measured_over_ideal: float | None
    multiplier: float | None  # tokens / the first arm's tokens
    ideal_multiplier: float | None  # first arm's bytes per token / this arm's


@dataclass
class Capacity:
    model: ModelShape
    tp: int
    kv_heads_per_rank: int
    replicas: int
    page_size: int
    sequences: int
    tokens_per_sequence: int | None
    memory_gib: float | None
    formats: list[FormatRow]
    measured: list[MeasuredRow] = field(default_factory=list)
    run: str | None = None
    notes: list[str] = field(default_factory=list)
    schema: str = CAPACITY_SCHEMA
    kvtrace_version: str = __version__

    @property
    def ideal_ratio(self) -> float | None:
        """Last format's bytes per token / the first's (0.5625 for nvfp4 / fp8)."""
        return self.formats[-1].ratio if len(self.formats) > 1 else None

    @property
    def ideal_multiplier(self) -> float | None:
        return self.formats[-1].capacity_multiplier if len(self.formats) > 1 else None

    def to_dict(self) -> dict:
        data = asdict(self)
        data = {"schema": data.pop("schema"), "kvtrace_version": data.pop("kvtrace_version"), **data}
        data["ideal_ratio"], data["ideal_multiplier"] = self.ideal_ratio, self.ideal_multiplier
        return data


def capacity(shape: ModelShape, kv_formats: list[tuple[str, str]], *, tp: int = 1, page_size: int = 16,
             tokens: int | None = None, sequences: int = 1, memory_gib: float | None = None) -> Capacity:
    """kv_formats: (label, name) pairs, the first being the reference for ratios and multipliers."""
    if page_size < 1:
        raise KvtraceError(f"--page-size {page_size}: a page holds at least one token")
    if sequences < 1:
        raise KvtraceError(f"--sequences {sequences}: at least one sequence")
    if not kv_formats:
        raise KvtraceError("no KV formats to compare: give --kv-format at least once")
    sharding = shard(shape.kv_heads, tp)
    rows: list[FormatRow] = []
    for label, name in kv_formats:
        fmt = canonical_format(name, shape.dtype)
        try:
            per_gpu = bytes_per_token(fmt, shape, sharding.kv_heads_per_rank)
        except ValueError as error:
            raise KvtraceError(f"{label}: {error}") from None
        row = FormatRow(label=label, format=fmt, bytes_per_token=_exact(per_gpu),
                        bytes_per_token_model=_exact(bytes_per_token(fmt, shape, shape.kv_heads)),
                        ratio=per_gpu / rows[0].bytes_per_token if rows else 1.0,
                        capacity_multiplier=rows[0].bytes_per_token / per_gpu if rows else 1.0)
        if tokens is not None:
            pages = -(-tokens // page_size)
            row.tokens = tokens * sequences
            row.padded_tokens = pages * page_size * sequences
            row.bytes_for_tokens = formats.kv_cache_bytes(fmt, tokens_per_sequence=tokens, sequences=sequences,
                                                          num_kv_heads=sharding.kv_heads_per_rank,
                                                          head_dim=shape.head_dim, page_size=page_size,
                                                          layers=shape.layers)
            row.gib_for_tokens = row.bytes_for_tokens / GIB
        if memory_gib is not None:
            row.tokens_in_memory = tokens_in_memory(memory_gib * GIB, per_gpu, page_size)
        rows.append(row)
    notes = [sharding.note, *shape.notes]
    if any(r.format == "nvfp4" for r in rows):
        notes.append(f"nvfp4: {shape.head_dim // 2} packed bytes + {shape.head_dim // formats.NVFP4_BLOCK} E4M3 "
                     f"scales per head and token for head_dim {shape.head_dim} (one scale per "
                     f"{formats.NVFP4_BLOCK} values); the per-tensor global scale is not per token")
    if tokens is not None and tokens % page_size:
        notes.append(f"{tokens:,} tokens per sequence fill {-(-tokens // page_size):,} pages of {page_size}: "
                     f"the last page is padded")
    return Capacity(model=shape, tp=sharding.tp, kv_heads_per_rank=sharding.kv_heads_per_rank,
                    replicas=sharding.replicas, page_size=page_size, sequences=sequences, tokens_per_sequence=tokens,
                    memory_gib=memory_gib, formats=rows, notes=notes)


def tokens_in_memory(memory_bytes: float, per_token: float, page_size: int) -> int:
    """Tokens in whole pages that fit in memory_bytes."""
    return int(memory_bytes // (per_token * page_size)) * page_size


# ---- run directories -----------------------------------------------------------------------------------

_TP_FLAG = re.compile(r"^(?:--tensor-parallel-size|-tp)(?:=(\d+))?$")


def tensor_parallel(flags: list[str]) -> int:
    """--tensor-parallel-size / -tp from a vLLM flag list (1 when absent)."""
    for index, flag in enumerate(flags):
        match = _TP_FLAG.match(flag)
        if match:
            value = match.group(1) or (flags[index + 1] if index + 1 < len(flags) else "1")
            return int(value)
    return 1


def measured_arm(name: str, arm: dict, shape: ModelShape, tp: int, page_size: int) -> MeasuredRow | None:
    """vLLM's startup capacity of one arm against the ideal for its format; None without that line."""
    kv = arm.get("kv_cache")
    if not kv or not kv.get("tokens"):
        return None
    dtype = arm.get("kv_cache_dtype") or name
    fmt = canonical_format(dtype, shape.dtype)
    per_gpu = bytes_per_token(fmt, shape, shard(shape.kv_heads, tp).kv_heads_per_rank)
    available = kv.get("available_gib")
    ideal = tokens_in_memory(available * GIB, per_gpu, page_size) if available else None
    return MeasuredRow(arm=name, kv_cache_dtype=dtype, format=fmt, tokens=int(kv["tokens"]), line=kv.get("line"),
                       available_gib=available, ideal_tokens=ideal,
                       measured_over_ideal=kv["tokens"] / ideal if ideal else None, multiplier=None,
                       ideal_multiplier=None)


def link_measured(rows: list[MeasuredRow], shape: ModelShape, tp: int) -> list[str]:
    """Multipliers against the first row (measured and ideal); notes on what could not be compared."""
    heads = shard(shape.kv_heads, tp).kv_heads_per_rank
    for row in rows:
        row.multiplier = row.tokens / rows[0].tokens
        row.ideal_multiplier = bytes_per_token(rows[0].format, shape, heads) / bytes_per_token(row.format, shape, heads)
    if rows and all(r.available_gib is None for r in rows):
        return ["vLLM did not log its available KV memory, so measured tokens are compared between arms "
                "(multiplier) rather than against ideal bytes in a known memory"]
    return []


def measured_from_manifest(manifest: dict, shape: ModelShape, tp: int, page_size: int,
                           names: list[str]) -> tuple[list[MeasuredRow], list[str]]:
    """Per arm with a startup capacity line: measured tokens against the ideal. Returns rows and notes."""
    if manifest.get("engine") != "vllm":
        return [], [f"no measured capacity: the {manifest.get('engine')} engine allocates no serving KV pool"]
    rows, notes = [], []
    for name in names:
        arm = manifest["arms"].get(name) or {}
        row = measured_arm(name, arm, shape, tp, page_size)
        if row is None:
            status = arm.get("status")
            notes.append(f"{name}: no \"GPU KV cache size\" line recorded"
                         + (f" (arm {status})" if status not in (None, "ok") else ""))
        else:
            rows.append(row)
    return rows, notes + link_measured(rows, shape, tp)


def read_manifest(path: Path) -> dict:
    """manifest.json of a kvtrace run directory (or the file itself), validated."""
    path = Path(path)
    file = path / "manifest.json" if path.is_dir() else path
    if not path.exists():
        raise KvtraceError(f"{path}: no such run directory: pass a directory written by `kvtrace capture`")
    if not file.is_file():
        raise KvtraceError(f"{path} has no manifest.json: pass a run directory written by `kvtrace capture`")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise KvtraceError(f"{file} is not readable JSON ({error}): capture the run again") from None
    if not isinstance(data, dict) or "kvtrace_manifest" not in data:
        raise KvtraceError(f"{file} was not written by kvtrace (no kvtrace_manifest field): pass a run directory "
                           "written by `kvtrace capture`")
    if not isinstance(data.get("arms"), dict):
        raise KvtraceError(f"{file} lists no arms: capture the run again")
    _check_manifest(data, file)
    return data


# What the values kvtrace reads from a manifest must be, where present and not null: a type, a dict of an
# object's fields, or [shape] for a list. A hand-edited or damaged manifest fails here in one line.
_MANIFEST_SHAPE = {"engine": str, "environment": dict,
                   "settings": {"model": dict, "scenario": str, "mode": str, "engine_flags": dict,
                                "extra_vllm_args": list}}
_ARM_SHAPE = {
    "status": str, "error": str, "sqlite": str, "kv_cache_dtype": str, "request_order_sha256": str,
    "workload": {"kv_format": str, "engine": dict,
                 "phases": [{"nvtx": str, "calls": (int, float), "bytes_per_call": (int, float)}]},
    "kv_cache": {"tokens": (int, float), "line": str},
    "points": [{"point": str, "bench": dict, "metrics": {"deltas": {"counters": dict, "histograms": dict},
                                                         "peaks": dict}}],
}


def _check_manifest(data: dict, file: Path) -> None:
    _check_shape(data, _MANIFEST_SHAPE, "", file)
    for name, arm in data["arms"].items():
        if not isinstance(arm, dict):
            raise _bad_shape(file, f"arms.{name}", "an object")
        _check_shape(arm, _ARM_SHAPE, f"arms.{name}", file)


def _check_shape(value, shape, where: str, file: Path) -> None:
    if value is None:
        return
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            raise _bad_shape(file, where, "an object")
        for key, inner in shape.items():
            _check_shape(value.get(key), inner, f"{where}.{key}" if where else key, file)
    elif isinstance(shape, list):
        if not isinstance(value, list):
            raise _bad_shape(file, where, "a list")
        for index, item in enumerate(value):
            _check_shape(item, shape[0], f"{where}[{index}]", file)
    elif not isinstance(value, shape) or isinstance(value, bool):
        raise _bad_shape(file, where, "a string" if shape is str else "a number")


def _bad_shape(file: Path, where: str, wanted: str) -> KvtraceError:
    return KvtraceError(f"{file}: {where} is not {wanted}: the manifest was edited or damaged; capture the run again")


def run_shape(manifest: dict, source: str) -> tuple[ModelShape, int, int]:
    """Model shape, tensor-parallel size and page size a run's manifest records."""
    settings = manifest.get("settings") or {}
    if manifest.get("engine") == "vllm":
        model = settings.get("model") or {}
        if "num_hidden_layers" not in model:
            raise KvtraceError(f"{source}: the manifest has no model config (vLLM could not read config.json "
                               "locally): pass --config")
        shape = shape_from_config(model, f"{source} (settings.model)")
        flags = next(iter((settings.get("engine_flags") or {}).values()), []) + list(settings.get("extra_vllm_args") or [])
        page = 16
        for arm in (manifest.get("arms") or {}).values():
            engine = (arm.get("workload") or {}).get("engine") or {}
            if engine.get("block_size"):
                page = int(engine["block_size"])
                break
            for point in arm.get("points") or []:
                config = ((point.get("metrics") or {}).get("cache_config") or [{}])[0]
                if config.get("block_size"):
                    page = int(config["block_size"])
                    break
        return shape, tensor_parallel(flags), page
    spec = settings.get("spec") or {}
    if {"kv_heads", "head_dim"} <= set(spec):
        # The FlashInfer engine's cache is one attention layer.
        shape = ModelShape(layers=1, kv_heads=int(spec["kv_heads"]), head_dim=int(spec["head_dim"]),
                           attention_heads=spec.get("q_heads"), source=f"{source} (settings.spec: one layer)")
        return shape, 1, int(spec.get("page_size", 16))
    raise KvtraceError(f"{source}: the manifest records no model shape: pass --config")


def from_run(run: Path, *, shape: ModelShape | None = None, tp: int | None = None, page_size: int | None = None,
             tokens: int | None = None, sequences: int = 1, memory_gib: float | None = None,
             kv_formats: list[str] | None = None) -> Capacity:
    """Capacity for the arms of a run directory (widest format first), with vLLM's measured token counts
    beside the ideal. `shape` (from --config) replaces the model shape the manifest records."""
    manifest = read_manifest(run)
    try:
        run_model, run_tp, run_page = run_shape(manifest, str(run))
    except KvtraceError:
        if shape is None:
            raise
        run_model, run_tp, run_page = None, 1, 16
    shape = shape or run_model
    tp = tp or run_tp
    page_size = page_size or run_page
    arms = manifest["arms"]

    def dtype(name: str) -> str:
        return arms[name].get("kv_cache_dtype") or (arms[name].get("workload") or {}).get("kv_format") or name

    names = sorted(arms, key=lambda name: -format_width(dtype(name), shape.dtype))
    labels = [(name, name) for name in kv_formats] if kv_formats else [(name, dtype(name)) for name in names]
    result = capacity(shape, labels, tp=tp, page_size=page_size, tokens=tokens, sequences=sequences,
                      memory_gib=memory_gib)
    result.run = str(run)
    result.measured, notes = measured_from_manifest(manifest, shape, tp, page_size, names)
    result.notes += notes
    return result
