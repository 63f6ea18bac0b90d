"""`kvtrace repro`: the shapes a run's trace ran, as the specification of a standalone FlashInfer script
(analyzer/render/repro.py writes it) that times FP8 against NVFP4 on each format's route and on a shared one.

Sources: the run's manifest (heads, head_dim, page size, KV formats; FlashInfer runs: the workload's spec; vLLM
runs: the model's config summary and the engine's block size) and the trace (the NVTX ranges: vLLM's
`execute_context_N(T)_generation_M(U)` steps, kvtrace's `kvtrace:KIND ctx=C batch=B` phases), with the traced
kernel time of each case per arm. Routes on SM90 follow vLLM 0.33's FlashInfer backend
(`vllm/v1/attention/backends/flashinfer.py`): FP8 prefill takes FA3 with FP8 queries (`get_q_data_type`:
`backend="auto"` resolves to fa3 for FP8 q and KV), NVFP4 prefill FA2 with BF16 queries (`_nvfp4_kv_on_fa2`);
decode takes FA2 tensor-core decode with BF16 queries for both; NVFP4's append is
`nvfp4_quantize_append_paged_kv_cache_with_slot_mapping` with the scales as float32 GPU tensors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from kvtrace import files, model_config
from kvtrace.analyzer import align, capacity, compare
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.results import Diff
from kvtrace.analyzer.runs import ArmInput, resolve_inputs, run_arm
from kvtrace.errors import KvtraceError
from kvtrace.manifest import parse_phase_name, read_manifest

# The file a run directory's repro results go in (the script's --json), which report and matrix read; one per
# FlashInfer release may sit beside it as repro.SUFFIX.json (e.g. repro.fi0.6.16.post3.json).
RESULTS_NAME = "repro.json"
RESULTS_GLOB = "repro*.json"
RESULTS_SCHEMA = 1  # the script's "kvtrace_repro"
FORMATS = ("fp8", "nvfp4")
SCALES = {
    "fp8": "float8_e4m3fn, one float32 decode scale per tensor passed as k_scale / v_scale: value = fp8 * scale "
           "(scale = amax / 448)",
    "nvfp4": "uint8 holding two E2M1 codes (even element in the low nibble), one float8_e4m3fn block scale per 16 "
             "values along head_dim (linear layout, kv_cache_sf), one float32 global decode scale per tensor passed "
             "as k_scale / v_scale: value = e2m1 * block_scale * global_scale (global = amax / (6 * 448))",
}
QUERY_WORDS = {"bfloat16": "BF16", "float16": "FP16"}
VLLM_PREFILL_PHASE = "vLLM prefill steps"  # the diff's phase of vLLM's prefill steps (analyzer.pairing)
KERNEL_ORDER = ("prefill", "decode", "append")  # the cases in this order: prefill's split first
SEGMENT_OF = {"prefill": "prefill_attention", "decode": "decode_attention", "append": "kv_append"}

# Each kernel's routes: label (what split() in the script reads), format, backend, query dtype, how.
ATTENTION_ROUTES = {
    "prefill": (
        {"label": "fp8 own route", "kv_format": "fp8", "backend": "fa3", "q": "fp8", "route": "FA3, FP8 q",
         "description": "vLLM 0.33's FP8 prefill on SM90"},
        {"label": "nvfp4 own route", "kv_format": "nvfp4", "backend": "fa2", "q": "bf16", "route": "FA2, BF16 q",
         "description": "vLLM 0.33's NVFP4 prefill below SM100"},
        {"label": "fp8 on nvfp4's route", "kv_format": "fp8", "backend": "fa2", "q": "bf16", "route": "FA2, BF16 q",
         "description": "FP8 on NVFP4's route"},
        {"label": "nvfp4 via fp8 workspace", "kv_format": "nvfp4", "backend": "fa3", "q": "fp8",
         "via": "fp8-workspace", "route": "FA3, FP8 q",
         "description": "NVFP4 dequantized to an FP8 workspace first"},
    ),
    "decode": (
        {"label": "fp8 own route", "kv_format": "fp8", "backend": "fa2", "q": "bf16", "route": "FA2, BF16 q",
         "description": "tensor-core decode"},
        {"label": "nvfp4 own route", "kv_format": "nvfp4", "backend": "fa2", "q": "bf16", "route": "FA2, BF16 q",
         "description": "tensor-core decode"},
    ),
    "append": (
        {"label": "fp8 own route", "kv_format": "fp8", "via": "append",
         "description": "torch cast + append_paged_kv_cache"},
        {"label": "nvfp4 own route", "kv_format": "nvfp4", "via": "slot-mapping", "scales": "tensor",
         "description": "slot-mapping append, scales as GPU tensors (vLLM)"},
        {"label": "nvfp4 scales checked once", "kv_format": "nvfp4", "via": "slot-mapping", "scales": "tensor",
         "check": "once", "description": "as vLLM, FlashInfer's host check of the scales once per tensor"},
        {"label": "nvfp4 host scales", "kv_format": "nvfp4", "via": "slot-mapping", "scales": "float",
         "description": "slot-mapping append, scales as Python floats"},
        {"label": "nvfp4 batch append", "kv_format": "nvfp4", "via": "indptr",
         "description": "nvfp4_quantize_append_paged_kv_cache"},
    ),
}


@dataclass
class ReproSpec:
    """What the script needs: the run's shapes, the cases it times, and where they came from."""

    source: dict
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    layers: int | None
    cases: list[dict] = field(default_factory=list)
    seed: int = 0

    def as_dict(self) -> dict:
        return {"source": self.source, "q_heads": self.q_heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "page_size": self.page_size, "layers": self.layers, "layout": "NHD", "scales": SCALES,
                "seed": self.seed, "cases": self.cases}


def build(path: Path) -> ReproSpec:
    """The repro specification of a run directory (or one of its manifests or exports)."""
    run = run_directory(Path(path))
    base, cand = resolve_inputs([run])
    arms = {run_arm(item, item.arm).kv_format: item for item in (base, cand)}
    if set(arms) != set(FORMATS):
        raise KvtraceError(f"{run} compares {' and '.join(str(f) for f in arms)}: kvtrace repro reproduces an FP8 "
                           "against an NVFP4 arm; pass a run directory holding one of each")
    manifest = base.manifest
    if manifest.engine == "flashinfer":
        spec = _flashinfer_shapes(arms)
    elif manifest.engine == "vllm":
        spec = _vllm_shapes(arms)
    else:
        raise KvtraceError(f"{run}'s manifest names engine {manifest.engine!r}: kvtrace repro reads FlashInfer and "
                           "vLLM runs written by `kvtrace capture`")
    first = arms["fp8"].record
    versions = dict(first.workload.get("versions") or {})
    query_dtypes = {fmt: run_arm(item, item.arm).query_dtypes for fmt, item in arms.items()}
    gpu, sm = _gpu(manifest)
    spec.source = {"run": run.name, "engine": manifest.engine, "versions": versions, "gpu": gpu, "sm": sm,
                   "manifest_sha256": hashlib.sha256((run / "manifest.json").read_bytes()).hexdigest(),
                   "traced_query_dtypes": query_dtypes,
                   "traced_routes": _traced_routes(manifest.engine, query_dtypes)}
    spec.seed = manifest.settings.get("seed", 0) if isinstance(manifest.settings.get("seed"), int) else 0
    _add_traced_times(spec, arms)
    return spec


def run_directory(path: Path) -> Path:
    """RUN_DIR, its manifest, or an export (TRACE) inside a run directory."""
    if path.is_dir():
        return path
    if path.is_file() and path.name.endswith("manifest.json"):
        return path.parent
    if path.is_file() and (path.parent / "manifest.json").is_file():
        manifest = read_manifest(path.parent)
        if any(record.sqlite and (path.parent / record.sqlite).resolve() == path.resolve()
               for record in manifest.runs.values()):
            return path.parent
        raise KvtraceError(f"{path} is not an export its run directory's manifest lists: pass the run directory "
                           "written by `kvtrace capture` (the script needs its heads and page size)")
    if path.exists():
        raise KvtraceError(f"{path} has no manifest.json beside it: kvtrace repro needs the run directory "
                           "`kvtrace capture` wrote (a trace alone names no heads, head_dim or page size)")
    raise KvtraceError(f"{path}: no such run directory or trace; pass RUN_DIR or a trace inside one")


def _positive(value, what: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KvtraceError(f"{where} records {what} as {value!r}, not a whole number above 0: the run's manifest is "
                           "damaged; capture the run again")
    return value


def _flashinfer_shapes(arms: dict[str, ArmInput]) -> ReproSpec:
    settings = arms["fp8"].manifest.settings.get("spec") or {}
    where = f"{arms['fp8'].run}/manifest.json settings.spec"
    shape = {key: _positive(settings.get(key), key, where) for key in
             ("batch", "q_heads", "kv_heads", "head_dim", "page_size")}
    spec = ReproSpec({}, shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["page_size"], None)
    # The contexts are the ones the trace ran: its kvtrace phase ranges name them.
    trace = open_trace(run_arm(arms["fp8"], "fp8").sqlite)
    batch = shape["batch"]
    phases = sorted({parsed for name in trace.range_names if (parsed := parse_phase_name(name))},
                    key=lambda kind_context: (KERNEL_ORDER.index(kind_context[0]) if kind_context[0] in KERNEL_ORDER
                                              else len(KERNEL_ORDER), kind_context[1]))
    for kind, context in phases:
        if kind not in SEGMENT_OF:
            continue
        nvtx = f"kvtrace:{kind} ctx={context} batch={batch}"
        if kind == "prefill":
            case = {"qo_lens": [context] * batch, "kv_lens": [context] * batch, "causal": True}
        elif kind == "decode":
            case = {"qo_lens": [1] * batch, "kv_lens": [context] * batch, "causal": False}
        else:  # the workload appends token `context` of each sequence
            case = {"qo_lens": [1] * batch, "kv_lens": [context + 1] * batch, "new_lens": [1] * batch,
                    "causal": False}
        spec.cases.append({"name": f"{kind}-ctx{context}", "kernel": kind, "nvtx": nvtx,
                           "description": _describe(kind, case), **case,
                           "routes": [dict(route) for route in ATTENTION_ROUTES[kind]]})
    if not spec.cases:
        raise KvtraceError(f"{arms['fp8'].run}: the trace has no kvtrace prefill, decode or append phase range; "
                           "pass a run recorded by `kvtrace capture flashinfer`")
    return spec


def _vllm_model(item: ArmInput) -> ReproSpec:
    """The shapes of a vLLM run's attention layers (capacity.run_shape reads them from the manifest), no cases yet."""
    layout, tp, page = capacity.run_shape(item.manifest, str(item.run))
    (group, *others) = layout.groups
    if others or group.kind != model_config.FULL or tp != 1 or not layout.attention_heads:
        raise KvtraceError(f"{item.run}: kvtrace repro reproduces one GPU's full-attention layers; this model has "
                           f"{layout.describe()} "
                           f"at tensor-parallel size {tp}")
    return ReproSpec({}, layout.attention_heads, group.kv_heads, group.head_dim, page, group.layers)


def _vllm_shapes(arms: dict[str, ArmInput]) -> ReproSpec:
    spec = _vllm_model(arms["fp8"])
    if arms["fp8"].manifest.settings.get("prefix_caching") or any(
            point.get("cached_tokens") for point in arms["fp8"].record.points):
        raise KvtraceError(f"{arms['fp8'].run} ran with prefix caching: its step names count the new tokens only, not "
                           "the cached ones each query attended to; pass a run recorded without prefix caching "
                           "(cold prefill)")
    trace = open_trace(run_arm(arms["fp8"], "fp8").sqlite)
    steps = align.steps(trace).filter(pl.col("phase") == align.PREFILL).unique("step")
    input_tokens = _point_inputs(arms["fp8"])
    for row in steps.sort("step").iter_rows(named=True):
        match = align.VLLM_STEP.fullmatch(row["step"])
        requests, tokens = int(match.group(1)), row["context_tokens"]
        if not requests or tokens is None:
            continue
        lens = _split_tokens(tokens, requests, input_tokens)
        case = {"qo_lens": lens, "kv_lens": lens, "causal": True}  # cold prefill: nothing cached before
        for kind in ("prefill", "append"):
            extra = {"new_lens": lens} if kind == "append" else {}
            spec.cases.append({"name": f"{kind}-{requests}x{tokens // requests}", "kernel": kind, "nvtx": row["step"],
                               "description": _describe(kind, {**case, **extra}), **case, **extra,
                               "routes": [dict(route) for route in ATTENTION_ROUTES[kind]]})
    if not spec.cases:
        raise KvtraceError(f"{arms['fp8'].run}: the trace has no vLLM prefill step range (execute_context_N(T)_"
                           "generation_0(0)); kvtrace repro reproduces prefill steps: record with the CUDA profiler "
                           "(--profiler-config) and a prefill scenario")
    return spec


def append_spec(run: Path, arm: str, most: int = 3) -> ReproSpec:
    """The KV appends of a vLLM arm's eager steps (prefill and mixed: the steps that run outside CUDA graphs), the
    `most` most frequent shapes: each step's prompt tokens and one token per decoding request, written through the
    append routes. The host-sync finding's repro (analyzer/upstream)."""
    item = ArmInput.of(run, read_manifest(run), arm)
    spec = _vllm_model(item)
    trace = open_trace(run_arm(item, arm).sqlite)
    eager = (align.steps(trace).filter(pl.col("phase").is_in([align.PREFILL, align.MIXED]))
             .unique("step_range").group_by("step", "context_tokens", "generation_tokens").len()
             .sort(["len", "step"], descending=[True, False]).head(most))
    for row in eager.iter_rows(named=True):
        match = align.VLLM_STEP.fullmatch(row["step"])
        requests, decoding = int(match.group(1)), int(match.group(3))
        if not requests or row["context_tokens"] is None:
            continue
        lens = _split_tokens(row["context_tokens"], requests, None) + [1] * decoding
        case = {"qo_lens": lens, "kv_lens": lens, "new_lens": lens, "causal": False}
        spec.cases.append({"name": f"append-{sum(lens)}-tokens", "kernel": "append", "nvtx": row["step"],
                           "description": f"the KV append of {row['len']} traced step(s) {row['step']}: "
                                          + _describe("append", case),
                           **case, "routes": [dict(route) for route in ATTENTION_ROUTES["append"]]})
    if not spec.cases:
        raise KvtraceError(f"{run}: arm {arm}'s trace has no eager vLLM step (prefill or mixed) with token counts in "
                           "its name; record with the CUDA profiler (--profiler-config)")
    versions = (item.manifest.raw.get("environment") or {}).get("packages") or {}
    spec.source = {"run": run.name, "engine": "vllm", "gpu": _gpu(item.manifest)[0], "sm": _gpu(item.manifest)[1],
                   "versions": {"flashinfer": versions.get("flashinfer-python"), "vllm": versions.get("vllm"),
                                "torch": versions.get("torch")},
                   "manifest_sha256": hashlib.sha256((run / "manifest.json").read_bytes()).hexdigest()}
    return spec


def _gpu(manifest) -> tuple[str | None, str | None]:
    gpus = (manifest.raw.get("environment") or {}).get("gpus") or [{}]
    first = gpus[0] if isinstance(gpus[0], dict) else {}
    return first.get("name"), str(first.get("compute_cap", "")).replace(".", "") or None


def _point_inputs(item: ArmInput) -> int | None:
    """The traffic point's input length (input=N), when every point of the run shares one."""
    found = set()
    for point in item.record.points:
        for part in str(point.get("point", "")).split(","):
            key, _, value = part.partition("=")
            if key == "input" and value.isdecimal():
                found.add(int(value))
    return found.pop() if len(found) == 1 else None


def _split_tokens(tokens: int, requests: int, input_tokens: int | None) -> list[int]:
    """Per request lengths of a step that names only its total: the point's input length when the total is that
    many times it, else as equal as whole tokens allow (the last requests one longer)."""
    if input_tokens and tokens == requests * input_tokens:
        return [input_tokens] * requests
    base, extra = divmod(tokens, requests)
    return [base] * (requests - extra) + [base + 1] * extra


def _describe(kind: str, case: dict) -> str:
    qo, kv = case["qo_lens"], case["kv_lens"]
    lens = (lambda values: f"{values[0]}" if len(set(values)) == 1 else "/".join(map(str, values)))
    if kind == "append":
        return f"{len(kv)} sequence(s), {lens(case['new_lens'])} new token(s) each, written after {lens([n - new for n, new in zip(kv, case['new_lens'])])} cached"
    return (f"{len(kv)} request(s), {lens(qo)} query token(s) against {lens(kv)} cached each, "
            f"{'causal' if case['causal'] else 'no mask'}")


def _traced_routes(engine: str | None, query_dtypes: dict) -> dict:
    """Which route each format's prefill took in the trace."""
    if engine == "flashinfer":  # capture/flashinfer_workload.py plans backend="fa2" with BF16 queries for both
        return {fmt: "FA2, BF16 q" for fmt in FORMATS}
    routes = {}
    for fmt, dtypes in query_dtypes.items():
        q = dtypes.get("prefill")
        routes[fmt] = ("not in the log" if not q else "FA3, FP8 q" if q.startswith("float8") else
                       f"FA2, {QUERY_WORDS.get(q, q)} q")
    return routes


def _add_traced_times(spec: ReproSpec, arms: dict[str, ArmInput]) -> None:
    """Each case's traced kernel time per arm: its segment's kernels inside the case's ranges, per range."""
    recipes = load_recipes()
    for fmt, item in arms.items():
        trace = open_trace(run_arm(item, fmt).sqlite)
        kernels = trace.kernels.join(compare.classify_signatures(trace, recipes).select("sig", "segment"), on="sig")
        names = pl.DataFrame({"range": trace.ranges["range"], "name": trace.ranges["name"]})
        if item.manifest.engine == "vllm":  # a kernel counts for the step around its innermost range
            names = align.steps(trace).select("range", pl.col("step").alias("name"))
        kernels = kernels.join(names, on="range")
        instances = trace.ranges.group_by("name").len()
        for case in spec.cases:
            rows = kernels.filter((pl.col("name") == case["nvtx"]) & (pl.col("segment") == SEGMENT_OF[case["kernel"]]))
            count = instances.filter(pl.col("name") == case["nvtx"])["len"]
            ranges = int(count[0]) if len(count) else 0
            total_us = float(rows["duration"].sum()) / 1e3
            case.setdefault("traced", {})[fmt] = {
                "kernels": rows.height, "ranges": ranges,
                "us_per_range": round(total_us / ranges, 3) if ranges else None,
                "us_per_kernel": round(total_us / rows.height, 3) if rows.height else None}



# ---- reading the script's results: the traced ratio split into route and format --------------------------------

@dataclass(frozen=True)
class SplitRow:
    """One case of a repro run beside the trace: the traced NVFP4/FP8 ratio of its kernel (this report's diff row,
    with its interval) and the script's ratio on each format's own route, split into route x format (medians, with
    the script's bootstrap intervals over its timed calls)."""

    case: str
    kernel: str
    traced_phase: str | None  # the diff row's NVTX phase; None: no diff row matches the case
    traced_ratio: float | None
    traced_low: float | None
    traced_high: float | None
    ratio: float
    ratio_interval: tuple[float, float]
    route: float
    route_interval: tuple[float, float]
    format: float
    format_interval: tuple[float, float]
    fp8_route: str  # what "own route" meant for each format, and the shared route
    nvfp4_route: str
    # Which of the script's ratios ran the routes the trace ran (its spec's traced_routes): "ratio" (each format's
    # own), "format" (both on NVFP4's: a FlashInfer A/B plans FA2 with BF16 queries for both), None (neither).
    traced_counterpart: str | None
    workspace_ratio: float | None  # NVFP4 dequantized to an FP8 workspace feeding FP8's kernel, against FP8's route
    nvfp4_vs_own_cache: float | None  # NVFP4's output against float64 attention over its own cache (rel. L2)
    fp8_vs_own_cache: float | None


@dataclass(frozen=True)
class AppendRoute:
    """One append route of a repro run: the GPU's time and the host's time inside the call, per call (median, 10th
    and 90th percentile of the timed calls): a call that waits on the device shows it in the host's time."""

    case: str
    label: str
    description: str
    gpu_us: tuple[float, float, float]  # median, p10, p90
    host_us: tuple[float, float, float]


@dataclass(frozen=True)
class ReproSplit:
    """One results file of a run directory: which release and GPU measured it, its rows, its failed routes, and the
    GPU of the trace its rows stand beside (a script run on another GPU is not paired with the trace)."""

    file: str
    flashinfer: str | None
    torch: str | None
    gpu: str | None
    sm: str | None
    rows: tuple[SplitRow, ...]
    failed: tuple[str, ...]  # "case: route: error"
    appends: tuple[AppendRoute, ...] = ()
    traced_gpu: str | None = None


def splits(run_dirs: list[Path], diff: Diff, engine: str | None) -> list[ReproSplit]:
    """Every repro results file in the run directories, each split against the diff's rows."""
    found = sorted({path for run in run_dirs for path in Path(run).glob(RESULTS_GLOB)})
    return [_split(path, diff, engine) for path in found]


def _split(path: Path, diff: Diff, engine: str | None) -> ReproSplit:
    fix = "it is what a `kvtrace repro` script wrote with --json; rerun the script or move the file away"
    data = files.read_json(path, f"repro results {path}", fix)
    if not isinstance(data, dict) or data.get("kvtrace_repro") != RESULTS_SCHEMA or \
            not isinstance(data.get("cases"), list) or not isinstance(data.get("environment"), dict):
        raise KvtraceError(f"{path} is not a kvtrace repro results file (schema {RESULTS_SCHEMA}): {fix}")
    env = data["environment"]
    gpu = env.get("gpu") if isinstance(env.get("gpu"), dict) else {}
    source = (data.get("spec") or {}).get("source") if isinstance(data.get("spec"), dict) else None
    traced_routes = source.get("traced_routes") if isinstance(source, dict) else None
    rows, failed, appends = [], [], []
    for case in data["cases"]:
        try:
            name, kernel, routes = str(case["name"]), str(case["kernel"]), list(case["routes"])
            failed += [f"{name}: {r['label']}: {r.get('error')}" for r in routes if r.get("status") != "ok"]
            if case.get("error"):
                failed.append(f"{name}: the whole case: {case['error']}")
            if case.get("split"):
                rows.append(_row(name, kernel, routes, case["split"], diff, engine, data["cases"], traced_routes))
            if kernel == "append":
                appends += [AppendRoute(name, str(r["label"]), str(r.get("description") or ""), _spread(r["gpu_us"]),
                                        _spread(r["host_us"])) for r in routes if r.get("status") == "ok"]
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise KvtraceError(f"{path}: case {case.get('name') if isinstance(case, dict) else case!r} lacks "
                               f"{error} or holds the wrong type: {fix}") from None
    return ReproSplit(str(path), _text(env.get("flashinfer")), _text(env.get("torch")), _text(gpu.get("name")),
                      _text(gpu.get("sm")), tuple(rows), tuple(failed), tuple(appends),
                      traced_gpu=diff.baseline.info.gpu_label)


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(value)
    return float(value)


def _spread(summary: dict) -> tuple[float, float, float]:
    return _number(summary["median"]), _number(summary["p10"]), _number(summary["p90"])


def _interval(values) -> tuple[float, float]:
    low, high = values
    return _number(low), _number(high)


def _row(name: str, kernel: str, routes: list, split: dict, diff: Diff, engine: str | None,
         cases: list, traced_routes) -> SplitRow:
    by_label = {r["label"]: r for r in routes if r.get("status") == "ok"}

    def words(label):
        route = by_label.get(label) or {}
        return str(route.get("route") or route.get("description") or label)

    def quality(label):
        checks = (by_label.get(label) or {}).get("quality") or {}
        value = checks.get("rel_l2_vs_own_cache")
        return _number(value) if value is not None else None

    workspace = by_label.get("nvfp4 via fp8 workspace")
    fp8 = by_label.get("fp8 own route")
    traced = _traced_row(name, kernel, diff, engine, cases)
    own = {"fp8": words("fp8 own route"), "nvfp4": words("nvfp4 own route")}
    counterpart = ("ratio" if traced_routes == own else
                   "format" if traced_routes == {"fp8": own["nvfp4"], "nvfp4": own["nvfp4"]} else None)
    return SplitRow(
        case=name, kernel=kernel, traced_phase=traced.phase if traced else None,
        traced_ratio=traced.ratio if traced else None, traced_low=traced.ci_low if traced else None,
        traced_high=traced.ci_high if traced else None,
        ratio=_number(split["ratio"]), ratio_interval=_interval(split["ratio_interval"]),
        route=_number(split["route"]), route_interval=_interval(split["route_interval"]),
        format=_number(split["format"]), format_interval=_interval(split["format_interval"]),
        fp8_route=own["fp8"], nvfp4_route=own["nvfp4"], traced_counterpart=counterpart,
        workspace_ratio=(_number(workspace["gpu_us"]["median"]) / _number(fp8["gpu_us"]["median"])
                         if workspace and fp8 else None),
        nvfp4_vs_own_cache=quality("nvfp4 own route"), fp8_vs_own_cache=quality("fp8 own route"))


def _traced_row(name: str, kernel: str, diff: Diff, engine: str | None, cases: list):
    """The diff's row for the case: its segment in the case's NVTX range (FlashInfer phases), or in vLLM's steps of
    that kind when the script holds one case of this kernel (the diff pools a kind's steps)."""
    segment = SEGMENT_OF.get(kernel)
    case = next((c for c in cases if c.get("name") == name), {})
    nvtx = case.get("nvtx") if isinstance(case, dict) else None
    for row in diff.phases:
        if row.segment == segment and row.phase == nvtx:
            return row
    same_kernel = [c for c in cases if isinstance(c, dict) and c.get("kernel") == kernel]
    if engine == "vllm" and len(same_kernel) == 1:
        return next((row for row in diff.phases if row.segment == segment and row.phase == VLLM_PREFILL_PHASE), None)
    return None
