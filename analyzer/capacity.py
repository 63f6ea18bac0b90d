"""KV-cache capacity: bytes per token per format from a model's KV layout, what fits in memory, and, for a vLLM run
directory, the capacity vLLM measured against the ideal.

The layout (layer groups: full attention, sliding window, MLA) is kvtrace.model_config's; the bytes of one cached
row of D values are kvtrace.kv_formats' (one implementation for capture and analysis): FP8 = D, NVFP4 = D/2
packed bytes plus D/16 E4M3 scales, BF16 = 2·D. Full and windowed layers store a K and a V row per KV head and
token; an MLA layer stores one latent row.

Tensor parallelism shards KV heads across ranks: H/T heads per rank when H >= T (vLLM requires H % T == 0);
when T > H each rank holds one head and every head is replicated on T/H ranks, so per-GPU bytes stop
shrinking. An MLA latent is not split: every rank holds all of it (vLLM's ModelConfig.get_num_kv_heads is 1).

Capacity is counted in whole pages: a sequence occupies ceil(tokens / page_size) pages of every full or MLA layer,
and of a sliding-window layer only the pages that cover its last `window` tokens. vLLM's hybrid KV cache manager
allocates per layer group in this way (SlidingWindowSpec in vllm/v1/kv_cache_interface.py, which also keeps room
for a prefill chunk); with --disable-hybrid-kv-cache-manager windowed layers keep every page, as full ones do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvtrace import __version__, model_config
from kvtrace.files import read_json
from kvtrace.errors import KvtraceError
from kvtrace.kv_formats import NVFP4_BLOCK, canonical_format
from kvtrace.manifest import Manifest, RunRecord, RunStatus, read_manifest, tensor_parallel_size
from kvtrace.model_config import MLA, SLIDING, KVLayout, LayerGroup

CAPACITY_SCHEMA = "kvtrace.capacity/2"
GIB = 1 << 30
# --memory as bytes stays within int64, like every size kvtrace counts (8 EiB: no GPU comes near).
MAX_MEMORY_GIB = 1 << 33


def default_formats(layout: KVLayout) -> tuple[list[str], list[str]]:
    """fp8 and nvfp4, or bf16 and fp8 where vLLM has no NVFP4 cache of the layout; notes say what was left out."""
    problem = model_config.format_problem(layout, "nvfp4")
    return (["bf16", "fp8"], [f"nvfp4 not sized: {problem}"]) if problem else (["fp8", "nvfp4"], [])


def load_config(path: Path) -> KVLayout:
    """A config.json, or a model directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise KvtraceError(f"{path}: no such file: pass a Hugging Face config.json or the model directory")
    return model_config.read(read_json(path, str(path), "pass the model's config.json"), str(path))


def with_overrides(layout: KVLayout, source: str, **overrides: int) -> KVLayout:
    """--layers, --kv-heads, --head-dim over a config's plain GQA shape."""
    group = layout.groups[0]
    if len(layout.groups) != 1 or group.kind != model_config.FULL or layout.state_layers:
        raise KvtraceError(f"--layers, --kv-heads and --head-dim describe a model whose every layer is full attention; "
                           f"{layout.source} is {layout.describe()}: drop them")
    shape = {"layers": group.layers, "kv_heads": group.kv_heads, "head_dim": group.head_dim, **overrides}
    return model_config.plain(**shape, attention_heads=layout.attention_heads, dtype=layout.dtype, source=source,
                              notes=layout.notes)


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


def shard_layout(layout: KVLayout, tp: int) -> Sharding:
    """How a layout's KV splits over tp GPUs: its attention groups share one KV head count; an MLA latent is one
    head that every GPU holds whole."""
    group = layout.groups[0]
    if group.kind != MLA:
        return shard(group.kv_heads, tp)
    return replace(shard(1, tp), note="one GPU holds the whole MLA latent" if tp == 1 else
                   f"MLA: each of the {tp} GPUs holds the whole latent of every layer, so per-GPU bytes do not "
                   "shrink with --tp")


def bytes_per_token(kv_format: str, layout: KVLayout, kv_heads: int | None = None) -> float:
    """Bytes one token adds to every KV layer in `kv_format`; kv_heads: the KV heads one GPU holds (default all)."""
    return sum(group_bytes_per_token(kv_format, group, layout, kv_heads) for group in layout.groups)


def group_bytes_per_token(kv_format: str, group: LayerGroup, layout: KVLayout, kv_heads: int | None = None) -> float:
    problem = model_config.format_problem(layout, kv_format)
    if problem:
        raise KvtraceError(f"{kv_format}: {problem}")
    try:
        return group.bytes_per_token(kv_format, kv_heads)
    except ValueError as error:
        raise KvtraceError(f"{kv_format}: {error}") from None


def pages_held(group: LayerGroup, tokens: int, page_size: int) -> int:
    """Pages one sequence of `tokens` occupies in a layer of `group`: all of its pages, or for a sliding window
    those covering its last `window` tokens (the sequence starts on a page boundary)."""
    first = max(0, tokens - group.window) if group.kind == SLIDING else 0
    return (tokens - 1) // page_size - first // page_size + 1


def _exact(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


@dataclass
class FormatRow:
    label: str  # as given: a format, or a run's arm name
    format: str  # fp8, nvfp4, bf16, fp16
    bytes_per_token: int | float  # per GPU, every KV layer (windowed ones until the window is full)
    bytes_per_token_model: int | float  # the whole model's KV heads, counted once
    ratio: float  # bytes per token / the first format's
    capacity_multiplier: float  # tokens that fit / the first format's (1 / ratio)
    tokens: int | None = None  # requested, all sequences
    padded_tokens: int | None = None  # rounded up to whole pages per sequence
    bytes_for_tokens: int | None = None  # per GPU, whole pages
    gib_for_tokens: float | None = None
    tokens_in_memory: int | None = None  # whole pages of one sequence in --memory GiB per GPU


@dataclass
class GroupRow:
    """One format's bytes in one layer group, for layouts of several groups."""

    label: str  # the format row's
    kind: str  # full, sliding, mla
    layers: int
    window: int | None
    bytes_per_token: int | float  # per GPU, while the group holds the token
    pages_per_sequence: int | None = None  # pages of --tokens one layer of the group holds
    bytes_for_tokens: int | None = None  # per GPU, all sequences, whole pages


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
    model: KVLayout
    tp: int
    kv_heads_per_rank: int
    replicas: int
    page_size: int
    sequences: int
    tokens_per_sequence: int | None
    memory_gib: float | None
    formats: list[FormatRow]
    groups: list[GroupRow] = field(default_factory=list)  # per format and layer group, when there are several
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


def capacity(layout: KVLayout, kv_formats: list[tuple[str, str]], *, tp: int = 1, page_size: int = 16,
             tokens: int | None = None, sequences: int = 1, memory_gib: float | None = None) -> Capacity:
    """kv_formats: (label, name) pairs, the first being the reference for ratios and multipliers."""
    if page_size < 1:
        raise KvtraceError(f"--page-size {page_size}: a page holds at least one token")
    if sequences < 1:
        raise KvtraceError(f"--sequences {sequences}: at least one sequence")
    if not kv_formats:
        raise KvtraceError("no KV formats to compare: give --kv-format at least once")
    sharding = shard_layout(layout, tp)
    heads = sharding.kv_heads_per_rank
    rows: list[FormatRow] = []
    groups: list[GroupRow] = []
    for label, name in kv_formats:
        fmt = canonical_format(name, layout.dtype)
        per_group = [group_bytes_per_token(fmt, group, layout, heads) for group in layout.groups]
        per_gpu = sum(per_group)
        row = FormatRow(label=label, format=fmt, bytes_per_token=_exact(per_gpu),
                        bytes_per_token_model=_exact(bytes_per_token(fmt, layout)),
                        ratio=per_gpu / rows[0].bytes_per_token if rows else 1.0,
                        capacity_multiplier=rows[0].bytes_per_token / per_gpu if rows else 1.0)
        if tokens is not None:
            pages = -(-tokens // page_size)
            held = [pages_held(group, tokens, page_size) for group in layout.groups]
            row.tokens = tokens * sequences
            row.padded_tokens = pages * page_size * sequences
            row.bytes_for_tokens = int(sum(p * page_size * sequences * b for p, b in zip(held, per_group)))
            row.gib_for_tokens = row.bytes_for_tokens / GIB
        if memory_gib is not None:
            row.tokens_in_memory = tokens_in_layout(memory_gib * GIB, layout, per_group, page_size)
        rows.append(row)
        if len(layout.groups) > 1:
            for group, per_token in zip(layout.groups, per_group):
                held = pages_held(group, tokens, page_size) if tokens is not None else None
                groups.append(GroupRow(label, group.kind, group.layers, group.window, _exact(per_token), held,
                                       None if held is None else int(held * page_size * sequences * per_token)))
    notes = [sharding.note, *layout.notes, *_layout_notes(layout, rows, groups, memory_gib)]
    if any(r.format == "nvfp4" for r in rows):
        for dim in sorted({g.head_dim for g in layout.groups}):
            notes.append(f"nvfp4: {dim // 2} packed bytes + {dim // NVFP4_BLOCK} E4M3 scales per head and "
                         f"token for head_dim {dim} (one scale per {NVFP4_BLOCK} values); the per-tensor "
                         "global scale is not per token")
    if tokens is not None and tokens % page_size:
        notes.append(f"{tokens:,} tokens per sequence fill {-(-tokens // page_size):,} pages of {page_size}: "
                     f"the last page is padded")
    return Capacity(model=layout, tp=sharding.tp, kv_heads_per_rank=sharding.kv_heads_per_rank,
                    replicas=sharding.replicas, page_size=page_size, sequences=sequences, tokens_per_sequence=tokens,
                    memory_gib=memory_gib, formats=rows, groups=groups, notes=notes)


def _layout_notes(layout: KVLayout, rows: list[FormatRow], groups: list[GroupRow],
                  memory_gib: float | None) -> list[str]:
    windows = sorted({g.window for g in layout.groups if g.kind == SLIDING})
    if not windows:
        return []
    growing = [g for g in groups if g.label == rows[0].label and g.kind != SLIDING]
    past = (f"past it a sequence grows only in its {sum(g.layers for g in growing)} full-attention layers: "
            f"{_exact(sum(g.bytes_per_token for g in growing)):,} B per token in {rows[0].label}" if growing else
            "every KV layer is windowed, so a sequence's KV stops growing there")
    notes = [f"sliding-window layers keep at most the pages covering a sequence's last "
             f"{' / '.join(f'{w:,}' for w in windows)} tokens; bytes per token count every KV layer until then, "
             f"{past}. vLLM's hybrid KV cache manager gives each layer group its own pages like this (plus room for "
             "a prefill chunk per windowed group); with --disable-hybrid-kv-cache-manager windowed layers keep "
             "every page"]
    if memory_gib is not None:
        notes.append("tokens in memory: the longest single sequence that fits (windowed layers at their window); "
                     "shorter sequences each pay for their own windows")
    return notes


def tokens_in_memory(memory_bytes: float, per_token: float, page_size: int) -> int:
    """Tokens in whole pages that fit in memory_bytes."""
    return int(memory_bytes // (per_token * page_size)) * page_size


def tokens_in_layout(memory_bytes: float, layout: KVLayout, per_group: list[float], page_size: int) -> int | None:
    """The longest sequence, in whole pages, whose KV fits in memory_bytes; None when windows bound it."""
    growing = sum(b for g, b in zip(layout.groups, per_group) if g.kind != SLIDING)
    capped = [(-(-g.window // page_size), b * page_size) for g, b in zip(layout.groups, per_group) if g.kind == SLIDING]
    if not capped:
        return tokens_in_memory(memory_bytes, growing, page_size)

    def fits(pages: int) -> bool:  # a sequence of whole pages holds ceil(window / page) of them in a window
        return pages * page_size * growing + sum(min(pages, cap) * cost for cap, cost in capped) <= memory_bytes

    if not growing:
        most = max(cap for cap, _ in capped)
        return None if fits(most) else _last_fitting(fits, most) * page_size
    return _last_fitting(fits, int(memory_bytes // (page_size * growing)) + 1) * page_size


def _last_fitting(fits, high: int) -> int:
    low = 0  # fits(low) holds (no pages); fits is monotone in pages
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


# ---- run directories -----------------------------------------------------------------------------------

def measured_arm(name: str, arm: RunRecord, layout: KVLayout, tp: int, page_size: int) -> MeasuredRow | None:
    """vLLM's startup capacity of one arm against the ideal for its format; None without that line."""
    kv = arm.kv_cache
    if not kv.get("tokens"):
        return None
    dtype = arm.kv_cache_dtype or arm.arm
    fmt = canonical_format(dtype, layout.dtype)
    per_gpu = bytes_per_token(fmt, layout, shard_layout(layout, tp).kv_heads_per_rank)
    available = kv.get("available_gib")
    ideal = tokens_in_memory(available * GIB, per_gpu, page_size) if available and layout.linear else None
    return MeasuredRow(arm=name, kv_cache_dtype=dtype, format=fmt, tokens=int(kv["tokens"]), line=kv.get("line"),
                       available_gib=available, ideal_tokens=ideal,
                       measured_over_ideal=kv["tokens"] / ideal if ideal else None, multiplier=None,
                       ideal_multiplier=None)


def link_measured(rows: list[MeasuredRow], layout: KVLayout, tp: int) -> list[str]:
    """Multipliers against the first row (measured and ideal); notes on what could not be compared."""
    heads = shard_layout(layout, tp).kv_heads_per_rank
    for row in rows:
        row.multiplier = row.tokens / rows[0].tokens
        row.ideal_multiplier = (bytes_per_token(rows[0].format, layout, heads)
                                / bytes_per_token(row.format, layout, heads))
    if rows and not layout.linear:
        # vLLM reports max_model_len × the requests whose pages fit, summed over its KV cache groups
        # (get_kv_cache_capacity in vllm/v1/core/kv_cache_utils.py), not tokens of one pool.
        return ["measured tokens are compared between arms only: for a model with windowed layers or recurrent "
                "state, vLLM's \"GPU KV cache size\" counts max_model_len-long requests over its KV cache groups, "
                "not tokens of one pool of ideal bytes"]
    if rows and all(r.available_gib is None for r in rows):
        return ["vLLM did not log its available KV memory, so measured tokens are compared between arms "
                "(multiplier) rather than against ideal bytes in a known memory"]
    return []


def measured_from_manifest(manifest: Manifest, layout: KVLayout, tp: int, page_size: int,
                           names: list[str]) -> tuple[list[MeasuredRow], list[str]]:
    """Per arm with a startup capacity line: measured tokens against the ideal. Returns rows and notes."""
    if manifest.engine != "vllm":
        return [], [f"no measured capacity: the {manifest.engine} engine allocates no serving KV pool"]
    rows, notes = [], []
    for name in names:
        arm = manifest.runs[name]
        row = measured_arm(name, arm, layout, tp, page_size)
        if row is None:
            status = arm.status
            notes.append(f"{name}: no \"GPU KV cache size\" line recorded"
                         + (f" (arm {status})" if status not in (None, RunStatus.OK) else ""))
        else:
            rows.append(row)
    return rows, notes + link_measured(rows, layout, tp)


def run_shape(manifest: Manifest, source: str) -> tuple[KVLayout, int, int]:
    """KV layout, tensor-parallel size and page size a run's manifest records."""
    settings = manifest.settings
    if manifest.engine == "vllm":
        config = manifest.kv_config
        if "num_hidden_layers" not in config:
            raise KvtraceError(f"{source}: the manifest has no model config (vLLM could not read config.json "
                               "locally): pass --config")
        # Reports show the run directory by name (render/units.shown_path); errors above keep the path.
        layout = model_config.read(config, f"{Path(source).name} (settings.model)")
        flags = _engine_flags(manifest)
        page = 16
        for arm in manifest.runs.values():
            engine = arm.workload.get("engine") or {}
            if engine.get("block_size"):
                page = int(engine["block_size"])
                break
            for point in arm.points:
                config = ((point.get("metrics") or {}).get("cache_config") or [{}])[0]
                if config.get("block_size"):
                    page = int(config["block_size"])
                    break
        return layout, tensor_parallel_size(flags, f"{source}: its engine flags", "capture the run again"), page
    spec = settings.get("spec") or {}
    if {"kv_heads", "head_dim"} <= set(spec):
        # The FlashInfer engine's cache is one attention layer.
        layout = model_config.plain(1, int(spec["kv_heads"]), int(spec["head_dim"]),
                                    attention_heads=spec.get("q_heads"), source=f"{Path(source).name} (settings.spec: one layer)")
        return layout, 1, int(spec.get("page_size", 16))
    raise KvtraceError(f"{source}: the manifest records no model shape: pass --config")


def _engine_flags(manifest: Manifest) -> list[str]:
    """The vLLM flags every arm of a run shared (its first arm's, which differ from the others' only in the KV
    dtype), extra arguments included."""
    settings = manifest.settings
    return next(iter((settings.get("engine_flags") or {}).values()), []) + list(settings.get("extra_vllm_args") or [])


def from_run(run: Path, *, layout: KVLayout | None = None, tp: int | None = None, page_size: int | None = None,
             tokens: int | None = None, sequences: int = 1, memory_gib: float | None = None,
             kv_formats: list[str] | None = None) -> Capacity:
    """Capacity for the arms of a run directory (widest format first), with vLLM's measured token counts
    beside the ideal. `layout` (from --config) replaces the model the manifest records."""
    manifest = read_manifest(run)
    try:
        run_model, run_tp, run_page = run_shape(manifest, str(run))
    except KvtraceError:
        if layout is None:
            raise
        run_model, run_tp, run_page = None, 1, 16
    layout = layout or run_model
    if manifest.engine == "vllm":
        # The measured pool is one GPU's of the engine as it ran: an ideal for another --tp would not be its match.
        run_tp = tensor_parallel_size(_engine_flags(manifest))
        if tp and tp != run_tp:
            raise KvtraceError(f"--tp {tp}, but {Path(run).name} ran on {run_tp} GPU(s) (--tensor-parallel-size "
                               f"{run_tp}), whose per-GPU KV pool is what it measured: drop --tp, or use "
                               "--config without the run directory for another size")
    tp = tp or run_tp
    page_size = page_size or run_page
    names = manifest.widest_first(model_dtype=layout.dtype)
    # One format row per arm (its repeated runs share the format); measured rows stay per run.
    arms = manifest.widest_first([runs[0] for runs in manifest.runs_by_arm.values()], model_dtype=layout.dtype)
    labels = ([(name, name) for name in kv_formats] if kv_formats
              else [(manifest.runs[name].arm, manifest.runs[name].kv_dtype) for name in arms])
    result = capacity(layout, labels, tp=tp, page_size=page_size, tokens=tokens, sequences=sequences,
                      memory_gib=memory_gib)
    result.run = str(run)
    result.measured, notes = measured_from_manifest(manifest, layout, tp, page_size, names)
    result.notes += notes
    return result
