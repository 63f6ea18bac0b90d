"""What the vLLM engine and its offline worker share: workload points, metric snapshots, deltas and peaks,
the sweep's capacity rule, the request-order hash and the KV-cache startup line.

Standard library only: the worker imports this next to vLLM on the GPU box.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

PREEMPTIONS = "vllm:num_preemptions_total"
KV_USAGE = "vllm:kv_cache_usage_perc"
# Gauges polled during the measured traffic; their maxima are the run's peaks.
PEAK_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", KV_USAGE)
# The sweep stops stepping up a context length once the reference arm preempts or fills this much of its KV.
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


def capacity_reason(point: Point, deltas: dict, peaks: dict | None, kv_cache_tokens: int | None) -> str | None:
    """Why this point counts as capacity-bound, or None. Offline runs have no polled peaks; there the KV
    demand against the startup line's token count stands in for the usage gauge."""
    preempted = deltas["counters"].get(PREEMPTIONS, 0)
    if preempted > 0:
        return f"{preempted:g} preemptions"
    usage = (peaks or {}).get(KV_USAGE)
    if usage is not None and usage >= CAPACITY_FRACTION:
        return f"KV cache usage peaked at {usage:.0%}"
    if kv_cache_tokens and point.kv_tokens() >= CAPACITY_FRACTION * kv_cache_tokens:
        return f"{point.kv_tokens():,} KV tokens needed of {kv_cache_tokens:,} available"
    return None


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
    memory = _KV_MEMORY.search(text)
    if memory is not None:
        result["available_gib"] = float(memory.group(1))
    return result
