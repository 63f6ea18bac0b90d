"""Serving metrics of a report: one arm at one traffic point as the capture recorded it (the bench client's
summary, vLLM's /metrics counter deltas and polled peaks, the startup log's KV pool), the checks between sources
that measure the same thing, and the rows that set the two arms' points side by side."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtrace import files
from kvtrace.analyzer import budget as budget_lib
from kvtrace.analyzer.budget import ArmBudget, Reason
from kvtrace.analyzer.reuse import Evictions, PrefixReuse, evictions, prefix_reuse
from kvtrace.analyzer.runs import ArmInput, run_file
from kvtrace.analyzer.stats import serving_intervals, shares
from kvtrace.analyzer.stats.serving_intervals import ArmSamples
from kvtrace.errors import KvtraceError
from kvtrace.manifest import Point, RunRecord, WindowStatus, capacity_reason

# Polls of /metrics inside a point's traffic before their maxima count as its peaks. A point shorter than a few
# poll intervals (vLLM bench points of under a second against 0.5 s polling) gives one or two samples at random
# moments, whose maximum says nothing about the peak.
MIN_PEAK_POLLS = 10
# Two hit rates that differ by less than this (half a percentage point) agree.
HIT_RATE_TOLERANCE = 0.005
# vLLM histograms (seconds) that stand in for the bench client's latencies in offline runs: means only.
_HISTOGRAMS = {"ttft": ("vllm:time_to_first_token_seconds",),
               "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
               "tpot": ("vllm:request_time_per_output_token_seconds",),
               "e2el": ("vllm:e2e_request_latency_seconds",)}


# The serving means that get an interval (ServingRow.estimates), each with whether higher is better. `tpot_ms` is
# each request's mean inter-token gap: the ITL a request saw, one sample per request (its gaps share its batches).
# `duration_s` is the point's wall time (the bench's `duration`: what a whole workload takes), one value per run.
ESTIMATED = {"ttft_ms": False, "tpot_ms": False, "e2el_ms": False, "output_tokens_per_s": True, "duration_s": False}
# The ESTIMATED values that are one number per run, not a mean over requests.
_RUN_VALUES = ("output_tokens_per_s", "duration_s")
# The bench client's summary name of each latency (mean_X_ms, std_X_ms).
_SUMMARY = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2el_ms": "e2el"}


@dataclass
class RequestSamples:
    """One arm's requests at one traffic point, in request order (request i of one arm is the same prompt as request
    i of the other when their request orders match): what `vllm bench serve --save-result --save-detailed` keeps
    per request (`ttfts`, `itls`, `latencies`, `input_lens`, `output_lens`, in seconds), or the same keys in a point
    record, and the prefix-cache tokens each request was served (`cached_tokens_per_request`). Any may be None."""

    ttft_ms: np.ndarray | None = None
    tpot_ms: np.ndarray | None = None  # (latency - TTFT) / (output tokens - 1), per request with two tokens or more
    e2el_ms: np.ndarray | None = None
    prompt_tokens: np.ndarray | None = None
    output_tokens: np.ndarray | None = None
    cached_tokens: np.ndarray | None = None

    @property
    def cached_share(self) -> np.ndarray | None:
        """Per request, the share of its prompt served from the prefix cache (beside its TTFT)."""
        cached, prompt = self.cached_tokens, self.prompt_tokens
        if cached is None or prompt is None or cached.size != prompt.size:
            return None
        return np.divide(cached, prompt, out=np.zeros(cached.size), where=prompt > 0)


@dataclass
class Latency:
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


@dataclass
class SourceCheck:
    """One quantity that two sources measure, and whether they agree (`note`: why not, when known)."""

    quantity: str
    unit: str  # count, fraction
    first: str
    first_value: float | None
    second: str
    second_value: float | None
    agree: bool
    note: str | None


@dataclass
class ServingMetrics:
    """One arm at one traffic point, as the capture recorded it. Latencies in milliseconds."""

    source: str  # "vllm bench serve" or "vLLM metrics (offline)"
    requests: int | None
    failed: int | None
    duration_s: float | None
    ttft_ms: Latency
    itl_ms: Latency
    tpot_ms: Latency
    e2el_ms: Latency
    prompt_tokens: int | None
    cached_prompt_tokens: int | None  # served from the prefix cache
    prefix_cache_queries: int | None
    prefix_cache_hits: int | None
    prefix_hit_rate: float | None
    output_tokens: int | None
    input_tokens_per_s: float | None
    output_tokens_per_s: float | None
    queue_ms: float | None  # mean time a request waited in vLLM's queue (vllm:request_queue_time_seconds)
    preemptions: int | None
    peak_running: float | None  # polled maxima; None when the polls could not observe them (peaks_note)
    peak_waiting: float | None
    peak_kv_usage: float | None  # fraction of the KV cache
    peaks_note: str | None  # why the polled maxima are not peaks, when they are not
    # Why this point is capacity-bound (preemptions, KV usage, KV demand), on observed evidence only, or None.
    capacity: str | None
    checks: list[SourceCheck] = field(default_factory=list)
    # A capacity reason resting on polled peaks that were not observed (peaks_note): not counted, so whether the
    # point is capacity-bound cannot be told.
    capacity_note: str | None = None
    reuse: PrefixReuse | None = None  # the server's cached tokens per request (serve runs with the usage relay)
    evictions: Evictions | None = None  # cached blocks evicted, from vLLM's KV-cache events
    requests_detail: RequestSamples | None = field(default=None, repr=False)  # per request, where recorded
    budget: ArmBudget | None = None  # the TTFT budget from vLLM's request histograms (analyzer.budget)
    # Why a profile window closed inside this point's timed traffic (window_stalls), or None: nsys then held the
    # engine while it stopped collecting, and every timed number here includes that stall.
    window_stall: str | None = None

    @property
    def cached_share(self) -> float | None:
        """Of the prompt tokens, the share served from the prefix cache."""
        if self.cached_prompt_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_prompt_tokens / self.prompt_tokens

    def agreed(self) -> list[str]:
        """The quantities whose every source check agrees, in the order they were checked (cached prompt tokens
        count once, however many pairs of sources checked them)."""
        quantities = dict.fromkeys(check.quantity for check in self.checks)
        return [q for q in quantities if all(check.agree for check in self.checks if check.quantity == q)]


@dataclass
class ServingRow:
    point: str  # the traffic shape, e.g. input=1024,output=1,prompts=32,concurrency=16
    context: int | None  # prompt tokens per request (prefix + input)
    concurrency: int | None
    baseline: ServingMetrics | None
    candidate: ServingMetrics | None
    baseline_first_capacity: bool = False  # the first point of its context length that is capacity-bound
    candidate_first_capacity: bool = False
    ttft_stat: str | None = None  # p50, else mean: the statistic both arms have
    ttft_ratio: float | None = None  # candidate / baseline
    ratios: dict = field(default_factory=dict)  # candidate / baseline per metric (`ttft_ms.p50`, `output_tokens_per_s`)
    # Per ESTIMATED metric, candidate / baseline of its mean over every run pair with its interval and verdict
    # (serving_intervals.serving_estimate); None where either arm lacks it. `runs`: the run pairs they cover.
    estimates: dict = field(default_factory=dict)
    runs: int = 1
    paired_requests: bool = False  # both arms sent the same prompts in the same order: per-request values pair
    # Each run pair's metrics at this point, in repeat order (the runs of both arms that ran it).
    run_pairs: tuple[tuple[ServingMetrics, ServingMetrics], ...] = ()
    # The TTFT budget over the run pairs and what carries its difference, with the split of the traced prefill steps
    # where a trace covers this point's own traffic (analyzer.budget, budget_trace); None without the histograms.
    reason: Reason | None = None
    trace_note: str | None = None  # why no trace splits this point (budget_trace.NOT_TRACED, NO_PREFILL_STEPS, …)
    diff_covers: bool = False  # the report's kernel diff read this point's traces (a one-trace run's first point)

    @property
    def window_stalls(self) -> list[str]:
        """Each run here whose timings include a profile window's close (ServingMetrics.window_stall), pair by pair."""
        return [m.window_stall for pair in self.run_pairs for m in pair if m.window_stall]


def _number(value):
    return None if value is None else (int(value) if float(value).is_integer() else float(value))


def _latency(bench: dict, histograms: dict, name: str) -> Latency:
    if bench and any(key.endswith(f"_{name}_ms") for key in bench):
        return Latency(mean=bench.get(f"mean_{name}_ms"), p50=bench.get(f"p50_{name}_ms", bench.get(f"median_{name}_ms")),
                       p90=bench.get(f"p90_{name}_ms"), p99=bench.get(f"p99_{name}_ms"))
    for metric in _HISTOGRAMS[name]:
        entry = histograms.get(metric)
        if entry and entry.get("count"):
            return Latency(mean=1000.0 * entry["sum"] / entry["count"])
    return Latency()


def _check(quantity: str, first: tuple[str, float | None], second: tuple[str, float | None], *,
           unit: str = "count", tolerance: float = 0.0, note: str | None = None) -> SourceCheck | None:
    """Two sources of one quantity; None when either did not record it."""
    if first[1] is None or second[1] is None:
        return None
    agree = abs(first[1] - second[1]) <= tolerance
    return SourceCheck(quantity=quantity, unit=unit, first=first[0], first_value=_number(first[1]), second=second[0],
                       second_value=_number(second[1]), agree=agree, note=None if agree else note)


def _kv_pool_tokens(cache_config) -> tuple[str, float | None]:
    """vLLM's KV pool in tokens as /metrics' cache_config_info gives it (vLLM 0.26: kv_cache_size_tokens, else
    num_gpu_blocks × block_size)."""
    labels = cache_config[0] if isinstance(cache_config, list) and cache_config else {}
    try:
        if labels.get("kv_cache_size_tokens") not in (None, "None"):
            return "/metrics cache_config_info kv_cache_size_tokens", float(labels["kv_cache_size_tokens"])
        return "/metrics cache_config_info num_gpu_blocks × block_size", (float(labels["num_gpu_blocks"])
                                                                            * float(labels["block_size"]))
    except (KeyError, TypeError, ValueError):
        return "/metrics cache_config_info", None


def source_checks(record: dict, counters: dict, histograms: dict, kv_cache_tokens: int | None,
                  reuse: PrefixReuse | None) -> list[SourceCheck]:
    """Where two sources measure the same thing: the client (bench JSON, or the offline worker's counts)
    against vLLM's /metrics counters, two /metrics counters of cached tokens, the server's cached tokens per
    request (`reuse`) against /metrics, the hit rate against the cached share, and the startup log's KV pool
    against /metrics' cache config."""
    bench = record.get("bench") or {}
    client = "vllm bench serve" if bench else "offline worker"

    def own(bench_key: str, worker_key: str):
        return bench.get(bench_key) if bench else record.get(worker_key)

    checks = [
        _check("completed requests", (client, own("completed", "requests")),
               ("/metrics request_success", counters.get("vllm:request_success_total"))),
        _check("prompt tokens", (client, own("total_input_tokens", "tokens_in")),
               ("/metrics prompt_tokens", counters.get("vllm:prompt_tokens_total"))),
        _check("output tokens", (client, own("total_output_tokens", "tokens_out")),
               ("/metrics generation_tokens", counters.get("vllm:generation_tokens_total"))),
    ]
    prompt, cached = counters.get("vllm:prompt_tokens_total"), counters.get("vllm:prompt_tokens_cached_total")
    computed = (histograms.get("vllm:request_prefill_kv_computed_tokens") or {}).get("sum")
    if record.get("cached_tokens") is not None:  # the offline worker's own count
        checks.append(_check("cached prompt tokens", ("offline worker", record["cached_tokens"]),
                             ("/metrics prompt_tokens_cached", cached)))
    elif prompt is not None and computed is not None:
        checks.append(_check("cached prompt tokens", ("/metrics prompt_tokens_cached", cached),
                             ("/metrics prompt_tokens − request_prefill_kv_computed_tokens", prompt - computed)))
    if reuse is not None:
        checks.append(_check("cached prompt tokens", ("the server, per request (usage.prompt_tokens_details)",
                                                      reuse.cached_tokens), ("/metrics prompt_tokens_cached", cached)))
    queries, hits = counters.get("vllm:prefix_cache_queries_total"), counters.get("vllm:prefix_cache_hits_total")
    if queries and prompt and cached is not None:
        # vLLM counts a lookup each time the scheduler tries a waiting request (KVCacheManager.get_computed_blocks)
        # and tries it again at the next step when its KV blocks do not fit (Scheduler.schedule keeps it waiting).
        note = (f"vLLM made {queries:,.0f} prefix-cache lookups for {prompt:,.0f} prompt tokens ({queries / prompt:.2f} "
                "per token): it looks a waiting request up again at every step until its KV blocks fit, so hits per "
                "lookup understate the share of prompt tokens served from the cache" if queries > prompt else
                "the counters disagree without repeated lookups to explain it")
        checks.append(_check("prefix-cache hit rate", ("/metrics prefix_cache_hits / prefix_cache_queries",
                                                       (hits or 0) / queries),
                             ("/metrics prompt_tokens_cached / prompt_tokens", cached / prompt), unit="fraction",
                             tolerance=HIT_RATE_TOLERANCE, note=note))
    checks.append(_check("KV cache size (tokens)", ('startup log "GPU KV cache size"', kv_cache_tokens),
                         _kv_pool_tokens((record.get("metrics") or {}).get("cache_config"))))
    return [check for check in checks if check is not None]


def _peaks_note(record: dict, duration: float | None) -> str | None:
    """Why the polled maxima of this point are not its peaks, or None when enough polls fell inside the traffic
    (or nothing says how many did: offline runs, recorded examples)."""
    metrics = record.get("metrics") or {}
    polls = metrics.get("polls")
    if not polls or not duration:
        return None
    busy, interval = metrics.get("busy_polls"), metrics.get("poll_interval_s")
    if busy is None:  # recorded before busy polls were counted: the poller ran over the point's whole wall time
        if not record.get("seconds"):
            return None
        interval = record["seconds"] / (polls + (metrics.get("poll_errors") or 0))
        inside = duration / interval
        how = f"about {inside:.0f} poll{'s' if round(inside) != 1 else ''} inside it"
    else:
        inside, how = busy, f"{busy} poll{'s' if busy != 1 else ''} saw requests in flight"
    if inside >= MIN_PEAK_POLLS:
        return None
    every = f"about every {interval:.2f} s" if interval else "periodically"
    return f"peaks not observed: {duration:.2f} s of traffic, /metrics polled {every} ({how})"


def _finite(values, scale: float = 1.0) -> np.ndarray | None:
    """A per-request list as an array of finite, non-negative numbers (times scaled), or None for anything else."""
    if not isinstance(values, list) or not values or \
            not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    array = np.asarray(values, dtype=np.float64) * scale  # finite after scaling: 1e306 s is no time in ms
    return array if np.isfinite(array).all() and (array >= 0).all() else None


def _bench_result(record: dict, run: Path | None) -> dict:
    """The point's own `vllm bench serve` result file (`bench_result`, inside the run directory), which keeps the
    per-request lists the manifest's summary leaves out; {} where there is none."""
    name = record.get("bench_result")
    if run is None or not isinstance(name, str) or not name:
        return {}
    try:
        path = run_file(run, name, "a point", "bench result")
    except (OSError, ValueError):  # a name no file can have (a NUL byte, a loop of links): no bench result
        return {}
    try:  # supplementary: the manifest's summary stands without it (the intervals then say what they rest on)
        data = files.read_json(path, f"bench result {path}", "keep the capture's own bench JSON there")
    except KvtraceError:
        return {}
    return data if isinstance(data, dict) else {}


def request_samples(record: dict, run: Path | None = None) -> RequestSamples | None:
    """The per-request samples of one point (RequestSamples), from its bench result file or the record itself;
    None when neither holds any. Lists of different lengths are not per-request data of one set of requests, and
    are left out."""
    source = {**record, **_bench_result(record, run)}
    lists = {"ttft_ms": _finite(source.get("ttfts"), 1000.0), "e2el_ms": _finite(source.get("latencies"), 1000.0),
             "output_tokens": _finite(source.get("output_lens")), "prompt_tokens": _finite(source.get("input_lens"))}
    if len({a.size for a in lists.values() if a is not None}) > 1:
        lists = dict.fromkeys(lists)
    samples = RequestSamples(**lists, cached_tokens=_finite(record.get("cached_tokens_per_request")))
    if samples.prompt_tokens is None and samples.cached_tokens is not None:
        try:
            point = Point.parse(record.get("point"))
            samples.prompt_tokens = np.full(samples.cached_tokens.size, float(point.prefix_len + point.input_len))
        except (ValueError, TypeError):
            pass
    ttft, e2el, out = samples.ttft_ms, samples.e2el_ms, samples.output_tokens
    if ttft is not None and e2el is not None and out is not None and (out >= 2).all():
        samples.tpot_ms = (e2el - ttft) / (out - 1)  # as the client computes TPOT
    if all(getattr(samples, name) is None for name in ("ttft_ms", "e2el_ms", "cached_tokens")):
        return None
    return samples


def serving_metrics(record: dict, kv_cache_tokens: int | None, run: Path | None = None, *,
                    window_stall: str | None = None) -> ServingMetrics:
    """One point of a vLLM arm: the bench client's summary (serve) or the worker's counts (offline), with
    vLLM's own counter deltas and polled peaks, and the checks of sources that measure the same thing; with
    `run` (its run directory), the per-request samples its bench result file keeps; `window_stall` as
    window_stalls found it for this point."""
    bench = record.get("bench") or {}
    metrics = record.get("metrics") or {}
    deltas = metrics.get("deltas") or {}
    counters, histograms = deltas.get("counters") or {}, deltas.get("histograms") or {}
    peaks = metrics.get("peaks") or {}
    try:
        point = Point.parse(record["point"]) if record.get("point") else None
    except (ValueError, TypeError):
        point = None

    def counter(*names):
        return next((_number(counters[n]) for n in names if n in counters), None)

    duration = bench.get("duration", record.get("elapsed_s"))
    prompt = counter("vllm:prompt_tokens_total")
    if prompt is None:
        prompt = bench.get("total_input_tokens", record.get("tokens_in"))
    output = counter("vllm:generation_tokens_total")
    if output is None:
        output = bench.get("total_output_tokens", record.get("tokens_out"))
    cached = record.get("cached_tokens")
    if cached is None:
        cached = counter("vllm:prompt_tokens_cached_total", "vllm:prefix_cache_hits_total")
    if isinstance(cached, (int, float)) and isinstance(prompt, (int, float)) and cached > prompt:
        raise KvtraceError(f"{run / 'manifest.json' if run else 'a manifest'}: point {record.get('point')!r:.80} "
                           f"served {cached:,} prompt tokens from the prefix cache of {prompt:,} sent, more than it "
                           "was sent: its counts are damaged; capture the run again")
    queries, hits = counter("vllm:prefix_cache_queries_total"), counter("vllm:prefix_cache_hits_total")
    input_rate = bench.get("input_throughput")
    if input_rate is None and prompt is not None and duration:
        input_rate = prompt / duration
    output_rate = bench.get("output_throughput")
    if output_rate is None and output is not None and duration:
        output_rate = output / duration
    peaks_note = _peaks_note(record, duration)
    observed = {} if peaks_note else peaks
    reason, capacity_note = _observed_capacity(record.get("capacity"), point, counters, peaks, peaks_note,
                                               kv_cache_tokens)
    requests = bench.get("completed", record.get("requests"))
    if requests is None:
        requests = counter("vllm:request_success_total")
    # One output token per request leaves no inter-token gaps; the client then reports 0 ms, which is no latency.
    single = point is not None and point.output_len <= 1
    queue = histograms.get("vllm:request_queue_time_seconds") or {}
    reuse = prefix_reuse(run, record) if run is not None else None
    return ServingMetrics(
        source="vllm bench serve" if bench else "vLLM metrics (offline)",
        requests=_number(requests), failed=_number(bench.get("failed")), duration_s=duration,
        ttft_ms=_latency(bench, histograms, "ttft"), itl_ms=Latency() if single else _latency(bench, histograms, "itl"),
        tpot_ms=Latency() if single else _latency(bench, histograms, "tpot"), e2el_ms=_latency(bench, histograms, "e2el"),
        prompt_tokens=_number(prompt), cached_prompt_tokens=_number(cached), prefix_cache_queries=queries,
        prefix_cache_hits=hits, prefix_hit_rate=hits / queries if queries and hits is not None else None,
        output_tokens=_number(output), input_tokens_per_s=input_rate, output_tokens_per_s=output_rate,
        queue_ms=1000.0 * queue["sum"] / queue["count"] if queue.get("count") else None,
        preemptions=counter("vllm:num_preemptions_total"), peak_running=observed.get("vllm:num_requests_running"),
        peak_waiting=observed.get("vllm:num_requests_waiting"), peak_kv_usage=observed.get("vllm:kv_cache_usage_perc"),
        peaks_note=peaks_note, capacity=reason, capacity_note=capacity_note,
        checks=source_checks(record, counters, histograms, kv_cache_tokens, reuse),
        requests_detail=request_samples(record, run), reuse=reuse, evictions=evictions(record),
        budget=budget_lib.arm_budget(histograms), window_stall=window_stall)


# The engine steps of a point's timed traffic: vLLM observes this histogram once per engine step.
ENGINE_STEPS = "vllm:iteration_tokens_total"


def window_stalls(run: RunRecord, profile_steps: int | None) -> dict[str, str]:
    """Per point spec, why a bounded profile window closed inside that point's timed traffic. Closing an nsys capture
    range holds the engine while nsys collects it: 2.5 to 4 s per window on the H100 matrix of 2026-12-06, a gap
    in every request in flight (capture/vllm_traced_pass). A matrix run's window opens before each point's traffic
    and closes after `steps` engine steps, unless the point ran a traced pass (the window closed before its timed
    traffic); a single run's one window opens before its first point and closes after `profile_steps` steps of the
    points in order. Where vLLM's step count was not kept, nothing is claimed."""
    stalls: dict[str, str] = {}
    if not run.windows and any("traced_pass" in record for record in run.points):
        return stalls  # the run's one window closed before its timed traffic
    windows = {w.point: w.steps for w in run.windows if w.status != WindowStatus.FAILED}
    steps_before = 0  # a single run's engine steps since its window opened
    for record in run.points:
        spec = record.get("point")
        histograms = ((record.get("metrics") or {}).get("deltas") or {}).get("histograms") or {}
        steps = _number((histograms.get(ENGINE_STEPS) or {}).get("count"))
        if not spec or not steps or "traced_pass" in record:
            continue
        if run.windows:
            bound, words = windows.get(record.get("index")), "its own profile window"
            closes_inside = bound is not None and steps > bound
        else:
            bound, words = profile_steps, "the run's profile window"
            closes_inside = bool(bound) and steps_before < bound < steps_before + steps
            steps_before += steps
        if closes_inside:
            stalls[spec] = f"{run.name}: {words} closed after {bound:,} of the traffic's {steps:,.0f} engine steps"
    return stalls


def _observed_capacity(recorded: str | None, point: Point | None, counters: dict, peaks: dict,
                       peaks_note: str | None, kv_cache_tokens: int | None) -> tuple[str | None, str | None]:
    """Why the point is capacity-bound, from observed evidence only (counter deltas, polled peaks when enough
    polls fell inside the traffic, the KV demand against the startup log's pool), and a note when the reason the
    polls alone would give (manifest.capacity_reason over every poll's maxima, or the capture's recorded one) is
    not counted: a sub-second point's one or two polls make no peak. A point that does not parse gets no reason
    where its peaks were not observed: kvtrace cannot tell what the recorded one rests on."""
    if point is None:
        if recorded is None or not peaks_note:
            return recorded, None
        return None, f"{recorded}: not counted ({peaks_note})"
    # kvtrace's own words for the evidence the capture recorded (its recorded reason, from the same rule, may carry
    # an older wording); the recorded one where the rule finds none in what was kept.
    claimed = capacity_reason(point, {"counters": counters}, peaks or None, kv_cache_tokens) or recorded
    if not peaks_note:
        return claimed, None
    reason = capacity_reason(point, {"counters": counters}, None, kv_cache_tokens)
    return reason, f"{claimed}: not counted ({peaks_note})" if claimed and not reason else None


def serving_rows(base: ArmInput, cand: ArmInput, *, threshold: float = 0.02, confidence: float = 0.95,
                 seed: int = 0) -> list[ServingRow]:
    """One row per traffic point either arm ran, in the baseline's order, matched by the point's spec. The row's
    metrics are the first run's; its estimates cover every run pair of a --repeats capture."""
    runs = []  # per side, per run: {spec: (ServingMetrics, record)}
    for item in (base, cand):
        side = []
        for run in (item.manifest.runs[name] for name in item.runs):
            stalls = window_stalls(run, item.manifest.settings.get("profile_steps"))
            side.append({p["point"]: (serving_metrics(p, run.kv_cache_tokens, item.run,
                                                      window_stall=stalls.get(p["point"])), p)
                         for p in run.points if p.get("point")})
        runs.append(side)
    records = [{spec: metrics for spec, (metrics, _) in side[0].items()} for side in runs]
    order = list(records[0]) + [p for p in records[1] if p not in records[0]]
    rows = []
    for spec in order:
        try:
            point = Point.parse(spec)
            context, concurrency = point.prefix_len + point.input_len, point.concurrency
        except (ValueError, TypeError):
            context = concurrency = None
        row = ServingRow(point=spec, context=context, concurrency=concurrency, baseline=records[0].get(spec),
                         candidate=records[1].get(spec))
        if row.baseline and row.candidate:
            for stat in ("p50", "mean"):
                b, c = getattr(row.baseline.ttft_ms, stat), getattr(row.candidate.ttft_ms, stat)
                if b and c is not None:
                    row.ttft_stat, row.ttft_ratio = stat, shares.ratio(b, c)
                    break
            row.ratios = serving_ratios(row.baseline, row.candidate)
            pairs = [(b[spec], c[spec]) for b, c in zip(*runs) if spec in b and spec in c]
            row.runs = len(pairs)
            row.run_pairs = tuple((b[0], c[0]) for b, c in pairs)
            row.reason = budget_lib.reason(budget_lib.point_budget([(b.budget, c.budget) for b, c in row.run_pairs],
                                                                   confidence), None, None)
            row.paired_requests = all(_same_requests(b[1], c[1]) for b, c in pairs)
            row.estimates = {name: serving_intervals.serving_estimate(
                [(_samples(b, name, row.paired_requests), _samples(c, name, row.paired_requests)) for b, c in pairs],
                higher_is_better=higher, threshold=threshold, confidence=confidence, seed=seed)
                for name, higher in ESTIMATED.items()}
        rows.append(row)
    for side in ("baseline", "candidate"):
        seen: set = set()
        for row in sorted(rows, key=lambda r: (r.context or 0, r.concurrency or 0)):
            metrics = getattr(row, side)
            if metrics and metrics.capacity and row.context not in seen:
                seen.add(row.context)
                setattr(row, f"{side}_first_capacity", True)
    return rows


def _same_requests(base: dict, cand: dict) -> bool:
    """Whether both arms sent the same prompts in the same order at this point (the capture's request-order hash)."""
    digest = base.get("request_order_sha256")
    return isinstance(digest, str) and bool(digest) and digest == cand.get("request_order_sha256")


def _samples(arm: tuple[ServingMetrics, dict], name: str, paired: bool) -> ArmSamples:
    """One arm's samples of an ESTIMATED metric in one run: per request where recorded and the requests pair, else
    the client's mean, std and count, else the mean alone (vLLM's histogram, a throughput)."""
    metrics, record = arm
    if name in _RUN_VALUES:
        return ArmSamples(mean=getattr(metrics, name))
    detail = metrics.requests_detail
    values = getattr(detail, name) if detail is not None else None
    if paired and values is not None and values.size >= 2:
        return ArmSamples.of_values(values)
    mean = getattr(metrics, name).mean
    bench = record.get("bench") or {}
    std, count = bench.get(f"std_{_SUMMARY[name]}_ms"), metrics.requests
    if all(isinstance(v, (int, float)) and math.isfinite(v) for v in (mean, std, count)) and count >= 2:
        return ArmSamples(mean=mean, std=std * math.sqrt(count / (count - 1)), count=int(count))  # client: ddof 0
    return ArmSamples(mean=mean)


def serving_ratios(base: ServingMetrics, cand: ServingMetrics) -> dict[str, float | None]:
    """candidate / baseline of the latencies (per statistic) and throughputs, keyed like `ttft_ms.p50`."""
    ratios = {}
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms"):
        for stat in ("p50", "p90", "p99", "mean"):
            ratios[f"{name}.{stat}"] = shares.ratio(getattr(getattr(base, name), stat),
                                                    getattr(getattr(cand, name), stat))
    for name in ("input_tokens_per_s", "output_tokens_per_s"):
        ratios[name] = shares.ratio(getattr(base, name), getattr(cand, name))
    return ratios
