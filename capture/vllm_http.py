"""The vLLM server over HTTP: requests without a proxy, /metrics scrapes parsed into snapshots, and the
poller that keeps the gauges' peaks during the measured traffic.

Standard library, plus prometheus_client when metrics are parsed.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request

from kvtrace.capture.vllm_common import RUNNING, WAITING, add_sample, empty_snapshot, update_peaks

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is local: no proxy
NET_ERRORS = (OSError, http.client.HTTPException)


def http_request(method: str, url: str, timeout: float, payload: dict | None = None) -> tuple[int, str]:
    """The status and the answer's text. payload: a JSON body (an OpenAI-style request); a POST without one sends
    an empty body."""
    data = json.dumps(payload).encode() if payload is not None else b"" if method == "POST" else None
    headers = {} if payload is None else {"Content-Type": "application/json"}
    request = urllib.request.Request(url, method=method, data=data, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode("utf-8", "replace")


def post_ok(base: str, path: str, hint: str = "") -> None:
    status, body = http_request("POST", base + path, timeout=600)
    if status != 200:
        raise RuntimeError(f"POST {path} answered {status} {body.strip()[:200]!r}{hint}")


def scrape(base: str) -> str:
    status, body = http_request("GET", base + "/metrics", timeout=30)
    if status != 200:
        raise RuntimeError(f"GET /metrics answered {status}")
    return body


def parse_metrics(text: str) -> dict:
    """A /metrics page as a snapshot (vLLM's `vllm:` metrics only), parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    snapshot = empty_snapshot()
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        for sample in family.samples:
            if family.type == "counter" and sample.name == family.name + "_total":
                add_sample(snapshot, "counter", sample.name, sample.labels, sample.value)
            elif family.type == "gauge" and not sample.name.endswith("_created"):  # counters' start times
                add_sample(snapshot, "gauge", sample.name, sample.labels, sample.value)
            elif family.type == "histogram" and sample.name in (family.name + "_count", family.name + "_sum"):
                kind = "histogram_count" if sample.name.endswith("_count") else "histogram_sum"
                add_sample(snapshot, kind, family.name, sample.labels, sample.value)
    return snapshot


class MetricsPoller(threading.Thread):
    """Polls /metrics during the measured traffic and keeps the gauges' maxima. `busy_polls` counts the polls
    that found requests running or waiting: how many samples the peaks rest on (a point shorter than the
    interval may get none)."""

    def __init__(self, base: str, interval_s: float):
        super().__init__(daemon=True)
        self.base, self.interval_s = base, interval_s
        self.peaks: dict = {}
        self.polls = self.errors = self.busy_polls = 0
        self._done = threading.Event()

    def run(self) -> None:
        while True:
            try:
                snapshot = parse_metrics(scrape(self.base))
                update_peaks(self.peaks, snapshot)
                self.polls += 1
                gauges = snapshot["gauges"]
                if gauges.get(RUNNING, 0) + gauges.get(WAITING, 0) > 0:
                    self.busy_polls += 1
            except (*NET_ERRORS, RuntimeError, ValueError):
                self.errors += 1
            if self._done.wait(self.interval_s):
                return

    def finish(self) -> dict:
        self._done.set()
        self.join()
        return self.peaks

