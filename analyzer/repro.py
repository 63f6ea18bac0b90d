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

from kvtrace.analyzer import align, compare
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.load import open_trace
from kvtrace.analyzer.runs import ArmInput, resolve_inputs, run_arm
from kvtrace.errors import KvtraceError
from kvtrace.manifest import parse_phase_name, read_manifest

# The file a run directory's repro results go in (the script's --json), which report and matrix read.
RESULTS_NAME = "repro.json"
FORMATS = ("fp8", "nvfp4")
SCALES = {
    "fp8": "float8_e4m3fn, one float32 decode scale per tensor passed as k_scale / v_scale: value = fp8 * scale "
           "(scale = amax / 448)",
    "nvfp4": "uint8 holding two E2M1 codes (even element in the low nibble), one float8_e4m3fn block scale per 16 "
             "values along head_dim (linear layout, kv_cache_sf), one float32 global decode scale per tensor passed "
             "as k_scale / v_scale: value = e2m1 * block_scale * global_scale (global = amax / (6 * 448))",
}
QUERY_WORDS = {"bfloat16": "BF16", "float16": "FP16"}
KERNEL_ORDER = ("prefill", "decode", "append")  # the cases in this order: prefill's split first
SEGMENT_OF = {"prefill": "prefill_attention", "decode": "decode_attention", "append": "kv_append"}

# Each kernel's routes: label (what split() in the script reads), format, backend, query dtype, how.
ATTENTION_ROUTES = {
    "prefill": (
        {"label": "fp8 own route", "kv_format": "fp8", "backend": "fa3", "q": "fp8",
         "description": "FA3, FP8 q (vLLM 0.33's FP8 prefill on SM90)"},
        {"label": "nvfp4 own route", "kv_format": "nvfp4", "backend": "fa2", "q": "bf16",
         "description": "FA2, BF16 q (vLLM 0.33's NVFP4 prefill below SM100)"},
        {"label": "fp8 on nvfp4's route", "kv_format": "fp8", "backend": "fa2", "q": "bf16",
         "description": "FA2, BF16 q: FP8 on NVFP4's route"},
        {"label": "nvfp4 via fp8 workspace", "kv_format": "nvfp4", "backend": "fa3", "q": "fp8",
         "via": "fp8-workspace",
         "description": "NVFP4 dequantized to an FP8 workspace, then FA3 FP8 q"},
    ),
    "decode": (
        {"label": "fp8 own route", "kv_format": "fp8", "backend": "fa2", "q": "bf16",
         "description": "FA2 tensor-core decode, BF16 q"},
        {"label": "nvfp4 own route", "kv_format": "nvfp4", "backend": "fa2", "q": "bf16",
         "description": "FA2 tensor-core decode, BF16 q"},
    ),
    "append": (
        {"label": "fp8 own route", "kv_format": "fp8", "via": "append",
         "description": "torch cast + append_paged_kv_cache"},
        {"label": "nvfp4 own route", "kv_format": "nvfp4", "via": "slot-mapping", "scales": "tensor",
         "description": "slot-mapping append, scales as GPU tensors (vLLM)"},
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
    run = _run_dir(Path(path))
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
    gpu = (manifest.raw.get("environment") or {}).get("gpus") or [{}]
    query_dtypes = {fmt: run_arm(item, item.arm).query_dtypes for fmt, item in arms.items()}
    spec.source = {"run": run.name, "engine": manifest.engine, "versions": versions,
                   "gpu": gpu[0].get("name") if isinstance(gpu[0], dict) else None,
                   "sm": str((gpu[0] or {}).get("compute_cap", "")).replace(".", "") or None,
                   "manifest_sha256": hashlib.sha256((run / "manifest.json").read_bytes()).hexdigest(),
                   "traced_query_dtypes": query_dtypes,
                   "traced_routes": _traced_routes(manifest.engine, query_dtypes)}
    spec.seed = manifest.settings.get("seed", 0) if isinstance(manifest.settings.get("seed"), int) else 0
    _add_traced_times(spec, arms)
    return spec


def _run_dir(path: Path) -> Path:
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


def _vllm_shapes(arms: dict[str, ArmInput]) -> ReproSpec:
    manifest = arms["fp8"].manifest
    model = manifest.model
    where = f"{arms['fp8'].run}/manifest.json settings.model"
    q_heads = _positive(model.get("num_attention_heads"), "num_attention_heads", where)
    kv_heads = _positive(model.get("num_key_value_heads", q_heads), "num_key_value_heads", where)
    head_dim = _positive(model.get("head_dim") or (model.get("hidden_size") or 0) // q_heads, "head_dim", where)
    engine = arms["fp8"].record.workload.get("engine") or {}
    page = _positive(engine.get("block_size"), "the engine's block_size", f"{arms['fp8'].run}'s fp8 workload")
    spec = ReproSpec({}, q_heads, kv_heads, head_dim, page, _positive(model.get("num_hidden_layers"),
                                                                      "num_hidden_layers", where))
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
    if any(row.get("cached_tokens") for point in arms["fp8"].record.points for row in [point]):
        raise KvtraceError(f"{arms['fp8'].run} served cached prefix tokens: the trace does not say which request's "
                           "query attended to how many cached tokens; use a cold-prefill run")
    return spec


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
        return f"{len(kv)} sequences, {lens(case['new_lens'])} new token(s) each, written at position {kv[0] - case['new_lens'][0]}"
    return (f"{len(kv)} requests, {lens(qo)} query token(s) against {lens(kv)} cached each, "
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

