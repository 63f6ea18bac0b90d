"""A run directory's manifest.json, the contract between capture (which writes it) and the analyzer (which
reads it): the runs and the order they were recorded in, the NVTX names of kvtrace's workload phases, the
vLLM traffic points and their capacity rule, and the typed view the analyzer reads.

Standard library only: capture imports it on the GPU box.

Shape of the file (capture/runner.manifest writes it; the engines add fields):

    {"kvtrace_manifest": 1, "engine": "flashinfer" | "vllm", "created_utc": ..., "environment": {...},
     "settings": {..., "arms": [ARM, ...], "repeats": N, "order": [RUN, ...]},
     "arms": {RUN: {"name": RUN, "arm": ARM, "repeat": K, "status": "ok" | "failed" | "not run", "error",
                    "sqlite", "report", "log", "workload", "commands", "seconds", ...}},
     vLLM only: "status", "request_order_matched"; per run "kv_cache_dtype", "kv_cache", "points", ... (a point
     whose profile window closed before its timed traffic has "traced_pass" {"point", "requests", "completion_tokens",
     "seconds"}: what the window traced instead, capture/vllm_traced_pass);
     `capture vllm-matrix` runs also "windows" [{"point", "sqlite", "steps", "status", ...}] (a trace per point,
     ARM.rK.pN.sqlite), "timings" [{"phase", "point", "seconds"}], "server" (its key in settings.servers: start,
     warm-up and lifetime seconds of the server the run belonged to) and "patch" ({"name", "sha256", ...} of a
     counterfactual arm), and settings "servers", "co_resident", "patches"}

A run is one recording of one arm: named like the arm, or ARM.rK with --repeats (then its files are
ARM.rK.sqlite, ...). Manifests written before --repeats have no `arm` and `repeat`: the run is the arm. A run's
`sqlite` is its one trace, covering its first point; a matrix run's windows add one per point (RunRecord.trace_for).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvtrace.errors import KvtraceError
from kvtrace.files import read_json
from kvtrace.kv_formats import bytes_per_value
from kvtrace.text import TextEnum, plural

MANIFEST = "manifest.json"
SCHEMA = 1
MARKER = "kvtrace_manifest"  # the key that says kvtrace wrote the file; its value is SCHEMA


# ---- runs: which arm, which repeat, in which order ------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """One recording of one arm."""

    name: str
    arm: str
    repeat: int


# A serving point is decided on this many run pairs or more. Fewer leave the run-to-run spread unmeasured (one run
# pair) or measured by one difference (two: t with 1 df, whose interval is narrow whenever two recordings happen to
# agree); their verdict is too few runs however narrow the interval (docs/statistics.md). Served captures record
# this many repeats by default.
DECIDING_RUN_PAIRS = 3


def check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise KvtraceError(f"--repeats must be at least 1, got {repeats}")


def run_order(arms: tuple[str, ...] | list[str], repeats: int) -> list[Run]:
    """The runs in the order they are recorded: arms interleaved (A B A B …), so that drift over time (clocks,
    temperature, other tenants) is spread over both arms instead of riding on one."""
    check_repeats(repeats)
    if repeats == 1:
        return [Run(arm, arm, 1) for arm in arms]
    return [Run(f"{arm}.r{k}", arm, k) for k in range(1, repeats + 1) for arm in arms]


# ---- how runs and captures end ------------------------------------------------------------------------

class RunStatus(TextEnum):
    """How one run ended (its entry's `status`)."""

    OK = "ok"
    FAILED = "failed"
    NOT_RUN = "not run"  # the capture stopped before it


class CaptureStatus(TextEnum):
    """How a whole capture ended (vLLM's manifest `status`; a per-run manifest's is its run's, ok or failed)."""

    OK = "ok"  # every run ok
    PARTIAL = "partial"  # some runs ok
    FAILED = "failed"  # none ok
    INTERRUPTED = "interrupted"  # Ctrl-C or SIGTERM stopped it, whatever the runs before gave


class WindowStatus(TextEnum):
    """How one profile window of a matrix run ended (its `status` under `windows`)."""

    OPEN = "open"  # profiling
    CLOSED = "closed"  # profiling stopped; nsys' report not yet assigned to it
    FAILED = "failed"  # vLLM refused to start or stop the profile
    NO_REPORT = "no report"  # nsys wrote fewer or more reports than windows: which is its own is uncertain
    EXPORTED = "exported"
    EXPORT_FAILED = "export failed"


def capture_status(run_statuses, interrupted: bool) -> CaptureStatus:
    """The capture's status from its runs' statuses: the one rule for the engine that records and for `capture
    import`, which takes failed runs up but cannot make an interrupted capture whole."""
    if interrupted:
        return CaptureStatus.INTERRUPTED
    statuses = set(run_statuses)
    if statuses == {RunStatus.OK}:
        return CaptureStatus.OK
    return CaptureStatus.PARTIAL if RunStatus.OK in statuses else CaptureStatus.FAILED


# ---- NVTX names of kvtrace's workload phases ------------------------------------------------------------

# The FlashInfer workload names each measured phase `kvtrace:<kind> ctx=<tokens> batch=<sequences>`.
PHASE_KINDS = ("prefill", "decode", "append", "gemm")
_PHASE_NAME = re.compile(r"kvtrace:(\w+) ctx=(\d+)")


def phase_name(kind: str, context: int, batch: int) -> str:
    return f"kvtrace:{kind} ctx={context} batch={batch}"


def parse_phase_name(name: str) -> tuple[str, int] | None:
    """(kind, context) of a FlashInfer workload phase's NVTX name; None for any other name."""
    match = _PHASE_NAME.match(name)
    return (match.group(1), int(match.group(2))) if match else None


# ---- vLLM traffic points and the capacity rule ----------------------------------------------------------

PREEMPTIONS = "vllm:num_preemptions_total"
KV_USAGE = "vllm:kv_cache_usage_perc"
# A point is capacity-bound once the arm preempts or fills this much of its KV cache; a sweep stops
# stepping up a context length there.
CAPACITY_FRACTION = 0.95


@dataclass(frozen=True)
class Point:
    """One traffic shape: `num_prompts` requests of `prefix_len + input_len` prompt tokens, `concurrency` at
    a time, each generating exactly `output_len` tokens (EOS ignored)."""

    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    prefix_len: int = 0
    num_prefixes: int = 0

    _KEYS = {"input": "input_len", "output": "output_len", "prompts": "num_prompts", "concurrency": "concurrency",
             "prefix": "prefix_len", "prefixes": "num_prefixes"}

    def spec(self) -> str:
        """Compact, exact text form used on command lines and in manifests."""
        keys = [key for key in self._KEYS if self.prefix_len or key not in ("prefix", "prefixes")]
        return ",".join(f"{key}={getattr(self, self._KEYS[key])}" for key in keys)

    @classmethod
    def parse(cls, text: str) -> "Point":
        values = dict(item.split("=", 1) for item in text.split(","))
        unknown = set(values) - set(cls._KEYS)
        if unknown:
            raise ValueError(f"unknown point key(s) {sorted(unknown)} in {text!r}")
        return cls(**{cls._KEYS[key]: int(value) for key, value in values.items()})

    def kv_tokens(self) -> int:
        """KV-cache tokens the running requests hold at the end of generation."""
        return self.concurrency * (self.prefix_len + self.input_len + self.output_len)


def point_range_name(scenario: str, point: Point) -> str:
    """NVTX name of one traffic point in the vLLM offline worker."""
    return f"kvtrace:{scenario}:{point.spec()}"


def capacity_reason(point: Point, deltas: dict, peaks: dict | None, kv_cache_tokens: int | None) -> str | None:
    """Why this point counts as capacity-bound, or None. Offline runs have no polled peaks; there the KV
    demand against the startup line's token count stands in for the usage gauge."""
    preempted = deltas["counters"].get(PREEMPTIONS, 0)
    if preempted > 0:
        return f"{preempted:g} {plural(preempted, 'preemption')}"
    usage = (peaks or {}).get(KV_USAGE)
    if usage is not None and usage >= CAPACITY_FRACTION:
        return f"KV cache usage peaked at {usage:.0%}"
    if kv_cache_tokens and point.kv_tokens() >= CAPACITY_FRACTION * kv_cache_tokens:
        return f"{point.kv_tokens():,} KV tokens needed of {kv_cache_tokens:,} available"
    return None


# ---- engine flags ----------------------------------------------------------------------------------------

_TP_FLAG = re.compile(r"(?:--tensor-parallel-size|-tp)(?:=(.*))?", re.DOTALL)


def tensor_parallel_size(flags: list[str] | tuple[str, ...], where: str = "extra vLLM arguments",
                         fix: str = "pass --tensor-parallel-size N with N >= 1") -> int:
    """vLLM's --tensor-parallel-size (or -tp, `=N` or `N` after it) in an engine flag list, 1 when absent: how many
    GPUs, one worker process each, an engine's ranks run on. A value that is not a whole number of 1 or more is one
    line naming `where` and `fix`."""
    for index, flag in enumerate(flags):
        match = _TP_FLAG.fullmatch(flag)
        if match:
            value = match.group(1) if match.group(1) is not None else \
                flags[index + 1] if index + 1 < len(flags) else ""
            if not (value.isdecimal() and 0 < int(value) < 1 << 31):
                raise KvtraceError(f"{where}: {flag}{'' if match.group(1) is not None else ' ' + repr(value)} is not "
                                   f"a tensor-parallel size (a whole number of 1 or more); {fix}")
            return int(value)
    return 1


# ---- reading ---------------------------------------------------------------------------------------------

def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _status(kind: type[TextEnum], value) -> TextEnum | None:
    """A recorded status as its enum (Manifest.of has checked that it is one of kind's values), None where absent."""
    return None if value is None else kind(value)


@dataclass(frozen=True)
class Phase:
    """A FlashInfer workload phase as the run recorded it: its NVTX range, calls and KV bytes per call."""

    nvtx: str
    kind: str | None  # prefill, decode, append, gemm; None when the name is not a kvtrace phase name
    context: int | None
    calls: int | None
    bytes_per_call: int | None

    @classmethod
    def of(cls, record: dict) -> "Phase":
        nvtx = record.get("nvtx") or ""
        kind, context = parse_phase_name(nvtx) or (None, None)
        return cls(nvtx, kind, context, _int(record.get("calls")), _int(record.get("bytes_per_call")))


@dataclass(frozen=True)
class Window:
    """A profile window inside one traffic point of a run (capture vllm-matrix): its trace and its size."""

    point: int
    sqlite: str | None  # ARM.rK.pN.sqlite in the run directory; None when the window left no export
    steps: int | None  # engine steps vLLM's profiler was asked to trace
    status: WindowStatus | None

    @classmethod
    def of(cls, record: dict) -> "Window":
        return cls(_int(record.get("point")) or 0, record.get("sqlite"), _int(record.get("steps")),
                   _status(WindowStatus, record.get("status")))


@dataclass(frozen=True)
class RunRecord:
    """One run's entry under `arms` (Manifest.of has checked the types of its fields)."""

    name: str  # the run's name: the arm's, or ARM.rK
    arm: str
    repeat: int
    status: RunStatus | None
    error: str | None
    sqlite: str | None  # file name in the run directory
    log: str | None  # the run's log (file name in the run directory): what nsys and the engine printed
    kv_cache_dtype: str | None  # vLLM's --kv-cache-dtype
    kv_cache: dict  # vLLM's startup capacity line: tokens, line, ...
    workload: dict  # the workload's own result (FlashInfer: kv_format, phases; vLLM offline: engine, ...)
    points: list[dict]  # vLLM traffic points with bench results and metrics
    request_order_sha256: str | None
    # capture vllm-matrix: a trace per point, the wall time of each phase ({"phase", "point", "seconds"}: traffic,
    # profiling, export), the server (settings.servers) whose lifetime the run belonged to, and a counterfactual
    # arm's engine patch ({"name", "sha256", ...}). Older manifests have none of these.
    windows: list[Window] = field(default_factory=list)
    timings: list[dict] = field(default_factory=list)
    server: str | None = None
    patch: dict | None = None

    @classmethod
    def of(cls, name: str, entry: dict) -> "RunRecord":
        return cls(name=name, arm=entry.get("arm") or name, repeat=entry.get("repeat") or 1,
                   status=_status(RunStatus, entry.get("status")), error=entry.get("error"), sqlite=entry.get("sqlite"),
                   log=entry.get("log"), kv_cache_dtype=entry.get("kv_cache_dtype"),
                   kv_cache=_dict(entry.get("kv_cache")), workload=_dict(entry.get("workload")),
                   points=[p for p in entry.get("points") or [] if isinstance(p, dict)],
                   request_order_sha256=entry.get("request_order_sha256"),
                   windows=[Window.of(w) for w in entry.get("windows") or [] if isinstance(w, dict)],
                   timings=[t for t in entry.get("timings") or [] if isinstance(t, dict)],
                   server=entry.get("server"), patch=entry.get("patch"))

    def trace_for(self, point: int) -> str | None:
        """The export that traced this point: its own window's, or (a legacy run, one trace covering its first
        point) the run's export for point 0; None when the point was not traced."""
        if self.windows:
            return next((w.sqlite for w in self.windows if w.point == point and w.sqlite), None)
        return self.sqlite if point == 0 else None

    @property
    def kv_dtype(self) -> str:
        """The KV format as the engine named it: vLLM's --kv-cache-dtype, FlashInfer's kv_format, else the arm."""
        kv_format = self.workload.get("kv_format")
        return self.kv_cache_dtype or (kv_format if isinstance(kv_format, str) else None) or self.arm

    @property
    def kv_cache_tokens(self) -> int | None:
        return _int(self.kv_cache.get("tokens"))

    @property
    def phases(self) -> list[Phase]:
        phases = self.workload.get("phases")
        return [Phase.of(p) for p in phases if isinstance(p, dict)] if isinstance(phases, list) else []


@dataclass(frozen=True)
class Manifest:
    path: Path  # the file read
    engine: str | None
    settings: dict
    runs: dict[str, RunRecord]  # by run name, in the file's order
    status: CaptureStatus | None = None  # vLLM's
    request_order_matched: bool | None = None  # vLLM: every run saw the same requests in the same order
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, data: dict, path: Path) -> "Manifest":
        _check_shape(data, _MANIFEST_SHAPE, "", path)
        runs = data["arms"]
        for name, entry in runs.items():
            if not isinstance(entry, dict):
                raise _bad_shape(path, f"arms.{name}", "an object")
            _check_shape(entry, _RUN_SHAPE, f"arms.{name}", path)
        return cls(path=path, engine=data.get("engine"), settings=_dict(data.get("settings")),
                   runs={name: RunRecord.of(name, e) for name, e in runs.items()},
                   status=_status(CaptureStatus, data.get("status")),
                   request_order_matched=data.get("request_order_matched"), raw=data)

    @property
    def scenario(self) -> str | None:
        return self.settings.get("scenario")

    @property
    def mode(self) -> str | None:
        return self.settings.get("mode")

    @property
    def model(self) -> dict:
        """vLLM: the model's config summary (layers, heads, head_dim, torch_dtype, kv_config, kv_layout, ...); {}
        otherwise."""
        return _dict(self.settings.get("model"))

    @property
    def packages(self) -> dict:
        """The engine's packages by name: the workload's own versions (as the engine process imported them) over
        the capture host's packages."""
        environment = _dict(self.raw.get("environment"))
        workload = next((r.workload for r in self.runs.values() if r.workload), {})
        return {**(environment.get("packages") or {}), **(workload.get("versions") or {})}

    @property
    def kv_config(self) -> dict:
        """vLLM: the config fields kvtrace.model_config reads the KV layout from (the summary's kv_config);
        manifests written before capture recorded them offer the summary's own fields."""
        return _dict(self.model.get("kv_config")) or self.model

    @property
    def model_dtype(self) -> str | None:
        """The model's torch_dtype, what vLLM's "auto" KV cache stores."""
        dtype = self.model.get("torch_dtype")
        return dtype if isinstance(dtype, str) else None

    @property
    def runs_by_arm(self) -> dict[str, list[str]]:
        """Run names per arm, in repeat order; arms in the order their first runs appear."""
        arms: dict[str, list[RunRecord]] = {}
        for record in self.runs.values():
            arms.setdefault(record.arm, []).append(record)
        return {arm: [r.name for r in sorted(records, key=lambda r: r.repeat)] for arm, records in arms.items()}

    def widest_first(self, names: list[str] | None = None, model_dtype: str | None = None) -> list[str]:
        """Run names (all by default), the widest KV format first: a comparison's baseline is the wider
        format. Equal widths keep their order. `model_dtype` decides "auto" (default: the manifest's)."""
        dtype = model_dtype or self.model_dtype
        return sorted(names if names is not None else self.runs,
                      key=lambda name: -bytes_per_value(self.runs[name].kv_dtype, dtype))


@dataclass(frozen=True)
class _Number:
    """A number with a lower bound, within int64 (past it a count or size means nothing); `whole`: no fraction.
    Prometheus labels (`digits`) carry numbers as text."""

    low: float
    whole: bool = False
    digits: bool = False

    def holds(self, value) -> bool:
        if self.digits and isinstance(value, str):
            return value.isdecimal() and self.low <= int(value) < 2 ** 63
        if isinstance(value, bool) or not isinstance(value, int if self.whole else (int, float)):
            return False
        return self.low <= value < 2 ** 63

    @property
    def wanted(self) -> str:
        return ("a whole number" if self.whole else "a number") + (" of at least 1" if self.low == 1 else
                                                                    " of 0 or more" if self.low == 0 else "")


_COUNT, _AMOUNT, _SIZE = _Number(1, whole=True), _Number(0), _Number(1, whole=True, digits=True)
# What the values kvtrace reads must be, where present and not null: a type, a _Number, a status (one of its
# values), a dict of an object's fields ("*": every field), or [shape] for a list. A hand-edited or damaged manifest
# fails in one line naming the field, rather than reading as absent or failing later in the analysis.
_MANIFEST_SHAPE = {"engine": str, "status": CaptureStatus, "request_order_matched": bool, "created_utc": str,
                   "environment": {"packages": dict, "cuda_runtime": str, "gpus": [dict]},
                   "settings": {"model": {"kv_config": dict}, "scenario": str, "mode": str,
                                "spec": {"kv_heads": _COUNT, "head_dim": _COUNT, "q_heads": _COUNT,
                                         "page_size": _COUNT},
                                "engine_flags": {"*": [str]}, "extra_vllm_args": [str]}}
# A traffic point's serving numbers decide `matrix`: every one is a finite number of 0 or more (the bench client's
# summary, the offline worker's counts, /metrics counter deltas, histogram sums and polled peaks). NaN would lose
# every comparison, so make the other arm win; a negative counter delta is a counter that reset mid-point.
_POINT_SHAPE = {
    "point": str, "capacity": str, "bench": {"*": _AMOUNT}, "seconds": _AMOUNT, "elapsed_s": _AMOUNT,
    # The offline worker's count of requests, or (serve) the usage relay's summary of them beside its file.
    "requests": (_AMOUNT, {"file": str, "requests": _AMOUNT, "with_cached_tokens": _AMOUNT, "prompt_tokens": _AMOUNT,
                           "cached_tokens": _AMOUNT, "cached_share": _AMOUNT, "failed": _AMOUNT}),
    "kv_events": {"BlockStored": _AMOUNT, "BlockRemoved": _AMOUNT, "AllBlocksCleared": _AMOUNT, "batches": _AMOUNT,
                  "missed_batches": _AMOUNT, "undecoded": _AMOUNT, "exact": bool},
    "tokens_in": _AMOUNT, "tokens_out": _AMOUNT, "cached_tokens": _AMOUNT,
    "cached_tokens_per_request": [_AMOUNT],
    "metrics": {"deltas": {"counters": {"*": _AMOUNT},
                           "histograms": {"*": {"count": _AMOUNT, "sum": _AMOUNT, "mean": _AMOUNT}}},
                "peaks": {"*": _AMOUNT}, "polls": _AMOUNT, "poll_errors": _AMOUNT, "busy_polls": _AMOUNT,
                "poll_interval_s": _AMOUNT, "cache_config": [{"block_size": _SIZE}]},
}
_RUN_SHAPE = {
    "arm": str, "repeat": _COUNT, "status": RunStatus, "error": str, "sqlite": str, "log": str, "kv_cache_dtype": str,
    "request_order_sha256": str,
    "workload": {"kv_format": str, "engine": {"block_size": _COUNT}, "settings": dict, "versions": dict,
                 "phases": [{"nvtx": str, "calls": _AMOUNT, "bytes_per_call": _AMOUNT}]},
    "kv_cache": {"tokens": _COUNT, "available_gib": _AMOUNT, "line": str, "available_gib_per_rank": {"*": _AMOUNT}},
    "ranks": [{"rank": _Number(0, whole=True), "device": _Number(0, whole=True), "kernels": _COUNT}],
    "points": [_POINT_SHAPE],
    "windows": [{"point": _Number(0, whole=True), "sqlite": str, "steps": _COUNT, "status": WindowStatus}],
    "timings": [{"phase": str, "point": _Number(0, whole=True), "seconds": _AMOUNT}],
    "server": str, "patch": {"name": str, "sha256": str},
}


def _check_shape(value, shape, where: str, file: Path) -> None:
    if value is None:
        return
    options = shape if isinstance(shape, tuple) else (shape,)  # a tuple: any one of these shapes
    shape = next((option for option in options if _is(value, option)), None)
    if shape is None:
        raise _bad_shape(file, where, " or ".join(_wanted(option) for option in options))
    if isinstance(shape, dict):
        for key, inner in shape.items():
            for name in (value if key == "*" else [key]):
                _check_shape(value.get(name), inner, f"{where}.{name}" if where else name, file)
    elif isinstance(shape, list):
        for index, item in enumerate(value):
            _check_shape(item, shape[0], f"{where}[{index}]", file)


def _is(value, shape) -> bool:
    """Whether the value is of the shape's kind (an object's fields and a list's items are checked on their own)."""
    if isinstance(shape, (dict, list)):
        return isinstance(value, type(shape))
    if isinstance(shape, _Number):
        return shape.holds(value)
    if isinstance(shape, type) and issubclass(shape, TextEnum):
        return isinstance(value, str) and value in set(shape)
    return isinstance(value, shape) and (shape is bool or not isinstance(value, bool))


def _wanted(shape) -> str:
    if isinstance(shape, _Number):
        return shape.wanted
    if isinstance(shape, type) and issubclass(shape, TextEnum):
        return "one of " + ", ".join(f'"{status}"' for status in shape)
    kind = type(shape) if isinstance(shape, (dict, list)) else shape
    return {bool: "true or false", str: "a string", dict: "an object", list: "a list"}.get(kind, "a number")


def _bad_shape(file: Path, where: str, wanted: str) -> KvtraceError:
    return KvtraceError(f"{file}: {where} is not {wanted}: the manifest was edited or damaged; capture the run again")


def is_kvtrace_manifest(data) -> bool:
    """Whether parsed JSON is a manifest that kvtrace wrote (not merely any manifest.json)."""
    return isinstance(data, dict) and MARKER in data


def read_manifest(path: Path) -> Manifest:
    """manifest.json of a kvtrace run directory (or the file itself), validated."""
    path = Path(path)
    file = path / MANIFEST if path.is_dir() else path
    if not path.exists():
        raise KvtraceError(f"{path}: no such run directory: pass a directory written by `kvtrace capture`")
    if not file.is_file():
        raise KvtraceError(f"{path} has no manifest.json: pass a run directory written by `kvtrace capture`")
    data = read_json(file, str(file), "capture the run again")
    if not is_kvtrace_manifest(data):
        raise KvtraceError(f"{file} was not written by kvtrace (no kvtrace_manifest field): pass a run directory "
                           "written by `kvtrace capture`")
    if not isinstance(data.get("arms"), dict):
        raise KvtraceError(f"{file} lists no arms: capture the run again")
    return Manifest.of(data, file)
