"""What the vLLM engine and its offline worker share: metric snapshots, deltas and peaks, the request-order
hash, the KV-cache startup line, and the token-id prompts of the offline worker and the traced pass. Traffic points
and the capacity rule are kvtrace.manifest's (the report reads them too).

Standard library only: the worker imports this next to vLLM on the GPU box.
"""

from __future__ import annotations

import hashlib
import json
import random
import re

from kvtrace.manifest import KV_USAGE, Point

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
# Gauges polled during the measured traffic; their maxima are the run's peaks.
PEAK_GAUGES = (RUNNING, WAITING, KV_USAGE)


def empty_snapshot() -> dict:
    return {"counters": {}, "gauges": {}, "histograms": {}, "info": {}}


def add_sample(snapshot: dict, kind: str, name: str, labels: dict, value: float) -> None:
    """Fold one sample into a snapshot, across label sets (engines, finished reasons, ...).

    kind is "counter" (name with `_total`), "gauge", "histogram_count" or "histogram_sum" (name without
    suffix). Usage fractions take the maximum over engines; every other value adds up.
    """
    if kind == "counter":
        snapshot["counters"][name] = snapshot["counters"].get(name, 0.0) + value
    elif kind == "gauge" and name.endswith("_info"):
        snapshot["info"].setdefault(name, []).append(dict(labels))
    elif kind == "gauge":
        previous = snapshot["gauges"].get(name)
        if previous is None:
            snapshot["gauges"][name] = value
        else:
            snapshot["gauges"][name] = max(previous, value) if name.endswith("_perc") else previous + value
    elif kind in ("histogram_count", "histogram_sum"):
        entry = snapshot["histograms"].setdefault(name, {"count": 0.0, "sum": 0.0})
        entry[kind.removeprefix("histogram_")] += value
    else:
        raise ValueError(f"unknown sample kind {kind!r}")


def metric_deltas(before: dict, after: dict) -> dict:
    """Counter and histogram changes between two snapshots (metrics present in both)."""
    counters = {name: after["counters"][name] - value
                for name, value in before["counters"].items() if name in after["counters"]}
    histograms = {}
    for name, first in before["histograms"].items():
        last = after["histograms"].get(name)
        if last is None:
            continue
        count, total = last["count"] - first["count"], last["sum"] - first["sum"]
        histograms[name] = {"count": count, "sum": total, "mean": total / count if count else None}
    return {"counters": counters, "histograms": histograms}


def update_peaks(peaks: dict, snapshot: dict) -> None:
    for name in PEAK_GAUGES:
        value = snapshot["gauges"].get(name)
        if value is not None:
            peaks[name] = max(value, peaks.get(name, value))


def request_order_sha256(obj) -> str:
    """Hash of what the requests are, in order; equal in both arms when they saw the same traffic."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# vLLM >= 0.27 logs one line: "GPU KV cache size: 1,234 tokens, Maximum concurrency for 8,192 tokens per
# request: 37.68x"; 0.26 and older split it in two lines. Both forms match.
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_KV_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_KV_MEMORY = re.compile(r"Available KV cache memory: ([\d.]+) GiB")


def parse_kv_cache_log(text: str) -> dict | None:
    """The KV-cache capacity vLLM reports at startup, from a server or worker log; None when absent."""
    tokens = _KV_TOKENS.search(text)
    if tokens is None:
        return None

    def line_from(match: re.Match) -> str:
        end = text.find("\n", match.start())
        return text[match.start(): end if end >= 0 else len(text)].rstrip()

    result = {"tokens": int(tokens.group(1).replace(",", "")), "line": line_from(tokens)}
    concurrency = _KV_CONCURRENCY.search(text)
    if concurrency is not None:
        result["tokens_per_request"] = int(concurrency.group(1).replace(",", ""))
        result["max_concurrency"] = float(concurrency.group(2))
        if "\n" in text[tokens.end():concurrency.start()]:  # the two-line form
            result["line"] += "\n" + line_from(concurrency)
    # Each worker logs its own; with tensor parallelism vLLM gives every rank the pages of the smallest, so that
    # one is the pool the token count comes from.
    memory = {_worker_rank(found, text, index): float(found.group(1))
              for index, found in enumerate(_KV_MEMORY.finditer(text))}
    if memory:
        result["available_gib"] = min(memory.values())
    if len(memory) > 1:
        result["available_gib_per_rank"] = {str(rank): gib for rank, gib in sorted(memory.items())}
    return result


_WORKER = re.compile(r"\((?:[^()\n]*?)\bTP(\d+)\b[^()\n]*\)|\brank=(\d+)")


def _worker_rank(found: re.Match, text: str, index: int) -> int:
    """The tensor-parallel rank a log line's process prefix names ("(Worker_TP1 pid=…)", "(VllmWorker rank=1 …)"),
    else the line's place among the lines of its kind."""
    start = text.rfind("\n", 0, found.start()) + 1
    rank = _WORKER.search(text, start, found.start())
    return int(rank.group(1) or rank.group(2)) if rank else index


def build_prompts(point: Point, seed: int, vocab_size: int, purpose: str) -> list[list[int]]:
    """Token-id prompts, identical for every arm given the same seed and point.

    `purpose` separates warm-up tokens from measured ones, so that a warm-up cannot pre-fill the prefix
    cache. Random(str) seeds through SHA-512, independent of PYTHONHASHSEED.
    """
    rng = random.Random(f"kvtrace:{seed}:{purpose}:{point.spec()}")
    prefixes = [[rng.randrange(1, vocab_size) for _ in range(point.prefix_len)]
                for _ in range(point.num_prefixes if point.prefix_len else 0)]
    prompts = [(prefixes[i % len(prefixes)] if prefixes else []) + [rng.randrange(1, vocab_size)
                                                                      for _ in range(point.input_len)]
               for i in range(point.num_prompts)]
    if prefixes:
        rng.shuffle(prompts)  # interleave the shared prefixes in a fixed order
    return prompts
