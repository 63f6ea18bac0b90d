"""A point's traced pass: requests of the point's own prompt shape and concurrency, sent inside its profile window
before its timed traffic, so that the window closes before any timed request is sent.

Closing an nsys capture range holds the engine while nsys collects the range: `cudaProfilerStop` returned 2.5 to 4 s
after the eighth step on the H100 (vLLM 0.33, nsys 2025.3.1, `--cuda-graph-trace=node`), and every request in flight
or queued waited that long. A window that closes inside the timed traffic therefore adds that stall to the TTFT,
ITL and throughput the point reports (analyzer/serving.window_stalls finds such points: not comparable).

Standard library only.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from kvtrace.capture.vllm_common import build_prompts
from kvtrace.capture.vllm_http import http_request
from kvtrace.manifest import Point
from kvtrace.text import plural

REQUEST_TIMEOUT_S = 300.0


def traced_point(point: Point, steps: int) -> Point:
    """Two waves at the point's concurrency (its prompts, if fewer), each request at most `steps` tokens long:
    enough engine steps to fill a window of `steps` with the point's prefill and the decode steps after it."""
    return replace(point, num_prompts=min(point.num_prompts, 2 * point.concurrency),
                   output_len=min(point.output_len, steps))


def describe(point: Point) -> str:
    """The traced pass of `point` (traced_point's) in words, for the dry runs."""
    return (f"{point.num_prompts} token-id {plural(point.num_prompts, 'prompt')} of {point.prefix_len + point.input_len}"
            f" tokens, {point.concurrency} at a time, {point.output_len} output {plural(point.output_len, 'token')} "
            "each")


def send(base: str, model: str, point: Point, seed: int, vocab_size: int | None) -> dict:
    """Send `point`'s requests straight to the server (not through the usage relay: they are not the timed
    traffic), `point.concurrency` at a time, token-id prompts drawn from the seed (other tokens than the timed
    traffic's). Raises RuntimeError if any request fails."""
    if not vocab_size:
        raise RuntimeError("the model's config names no vocab_size, which the traced pass draws its token ids below")
    prompts = build_prompts(point, seed, vocab_size, "traced")

    def complete(prompt: list[int]) -> tuple[int, str]:
        return http_request("POST", base + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                            payload={"model": model, "prompt": prompt, "max_tokens": point.output_len,
                                     "min_tokens": point.output_len, "ignore_eos": True, "temperature": 0.0})

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=point.concurrency) as pool:
        answers = list(pool.map(complete, prompts))
    failed = [(status, body) for status, body in answers if status != 200]
    if failed:
        status, body = failed[0]
        raise RuntimeError(f"the traced pass: {len(failed)} of {len(prompts)} requests failed, the first with "
                           f"{status} {body.strip()[:200]!r}")
    completion_tokens = sum(json.loads(body).get("usage", {}).get("completion_tokens") or 0 for _, body in answers)
    return {"point": point.spec(), "requests": len(prompts), "completion_tokens": completion_tokens,
            "seconds": round(time.monotonic() - started, 2)}
