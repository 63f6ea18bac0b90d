"""Prefix reuse as the server saw it, per request: how much of each prompt vLLM served from its prefix cache
(`usage.prompt_tokens_details.cached_tokens`, kept by the capture's usage relay in POINT.requests.json) and how
many cached blocks it evicted meanwhile (its KV-cache events, BlockRemoved).

A lookup hit that saves a few blocks of a prompt is not the reuse a larger cache buys: a request counts as
reused when the cache served at least REUSED_SHARE of its prompt. Times to first token here are the relay's
(from the request's arrival at the relay to the first token through it), one per request, so they split by
reuse; the bench client's percentiles stay the headline latencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtrace import files
from kvtrace.analyzer.runs import run_file
from kvtrace.errors import KvtraceError

REUSED_SHARE = 0.5  # of a prompt's tokens served from the cache


@dataclass(frozen=True)
class PrefixReuse:
    requests: int  # requests with the server's counts
    prompt_tokens: int
    cached_tokens: int
    reused: int  # requests with at least REUSED_SHARE of their prompt cached
    partial: int  # some cached tokens, less than that
    missed: int  # none
    ttft_reused_ms: float | None  # median of the relay's times to first token, per group
    ttft_missed_ms: float | None  # of the requests with less than REUSED_SHARE cached (partial and missed)

    @property
    def cached_share(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(frozen=True)
class Evictions:
    blocks_removed: int  # cached blocks evicted from the prefix cache during the point
    blocks_stored: int  # blocks newly cached
    exact: bool  # no event batch was missed or undecoded


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _count(value, what: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KvtraceError(f"{path}: {what} is {value!r}, not a token count: the file is damaged; record the run "
                           "again or remove the file to report without per-request reuse")
    return value


def prefix_reuse(run: Path, record: dict) -> PrefixReuse | None:
    """A point's per-request reuse, or None when the capture kept no per-request counts (runs recorded before the
    usage relay, offline runs) or the server sent none (no --enable-prompt-tokens-details)."""
    summary = record.get("requests")
    if not isinstance(summary, dict) or not isinstance(summary.get("file"), str):
        return None
    if Path(summary["file"]).name != summary["file"]:
        raise KvtraceError(f"{run}: the manifest names per-request counts {summary['file']!r}, which is not a file "
                           "in the run directory: restore it from the capture or remove its entry")
    path = run_file(run, summary["file"], "a point", "per-request counts")
    entries = files.read_json(path, f"per-request counts {path}", "record the run again or restore the file")
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise KvtraceError(f"{path}: not a list of requests: the file is damaged; record the run again or restore it")
    counted = [entry for entry in entries if entry.get("status") == 200 and entry.get("cached_tokens") is not None]
    if not counted:
        return None
    reused = partial = missed = prompt_total = cached_total = 0
    ttft_reused, ttft_missed = [], []
    for entry in counted:
        prompt = _count(entry.get("prompt_tokens"), "a request's prompt_tokens", path)
        cached = _count(entry.get("cached_tokens"), "a request's cached_tokens", path)
        if cached > prompt:
            raise KvtraceError(f"{path}: a request has {cached} cached tokens of a {prompt}-token prompt: the file is "
                               "damaged; record the run again")
        prompt_total, cached_total = prompt_total + prompt, cached_total + cached
        is_reused = prompt > 0 and cached >= REUSED_SHARE * prompt
        reused, partial, missed = reused + is_reused, partial + (0 < cached and not is_reused), missed + (cached == 0)
        first = entry.get("first_token_ms")
        if isinstance(first, (int, float)) and not isinstance(first, bool) and math.isfinite(first) and first >= 0:
            (ttft_reused if is_reused else ttft_missed).append(float(first))
    return PrefixReuse(requests=len(counted), prompt_tokens=prompt_total, cached_tokens=cached_total, reused=reused,
                       partial=partial, missed=missed, ttft_reused_ms=_median(ttft_reused),
                       ttft_missed_ms=_median(ttft_missed))


def evictions(record: dict) -> Evictions | None:
    """A point's KV-cache events, or None when none were recorded (no prefix caching, older runs)."""
    events = record.get("kv_events")
    if not isinstance(events, dict):
        return None
    values = [events.get(key) for key in ("BlockRemoved", "BlockStored")]
    if not all(isinstance(value, int) and not isinstance(value, bool) and value >= 0 for value in values):
        return None
    return Evictions(blocks_removed=values[0], blocks_stored=values[1], exact=events.get("exact") is True)
