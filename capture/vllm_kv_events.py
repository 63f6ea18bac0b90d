"""vLLM's KV-cache events, received as the server publishes them: every cached block stored and every one
removed (evicted) from the prefix cache, counted exactly rather than inferred from preemptions.

`vllm serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'` publishes ZeroMQ
multipart messages (topic, 8-byte big-endian sequence number, msgpack payload). The payload is an event batch,
an array [ts, events, data_parallel_rank]; each event is a tagged map whose "type" is BlockStored, BlockRemoved
or AllBlocksCleared (vllm/distributed/kv_events.py, vLLM 0.33). The recorder binds the endpoint the server's
publisher connects to, so no event is sent before anyone listens. A gap in the sequence numbers means messages
were dropped (the publisher's high-water mark), and the counts then say so instead of posing as exact.

Each batch is also written to a JSON-lines file in the run directory, so the counts can be checked afresh.

pyzmq and msgspec, both vLLM's own dependencies, are imported only when a recorder starts.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from kvtrace.errors import KvtraceError

EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
TOPIC = "kvtrace"
QUIET_S = 0.3  # no batch for this long after a point's traffic: its last step's events are in


def events_config(port: int) -> str:
    """The server's --kv-events-config: publish to the recorder on the loopback port."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://127.0.0.1:{port}", "topic": TOPIC}, separators=(",", ":"))


def check_available() -> None:
    """The recorder runs in kvtrace's own process: it needs pyzmq and msgspec there (vLLM installs both)."""
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as missing:
        raise KvtraceError(f"recording vLLM's KV-cache events needs {missing.name}, which this Python lacks: run "
                           "kvtrace with the Python that vLLM is installed in, or pip install pyzmq msgspec") from None


def batch_counts(payload) -> tuple[float | None, dict[str, int]]:
    """A decoded batch's time and its block counts per event type (blocks, not events: one BlockStored can
    carry several block hashes)."""
    counts = dict.fromkeys(EVENT_TYPES, 0)
    if not isinstance(payload, (list, tuple)) or len(payload) < 2 or not isinstance(payload[1], list):
        raise ValueError("not an event batch")
    for event in payload[1]:
        kind = event.get("type") if isinstance(event, dict) else event[0] if isinstance(event, list) and event else None
        if kind not in counts:
            continue
        hashes = event.get("block_hashes") if isinstance(event, dict) else None
        counts[kind] += 1 if kind == "AllBlocksCleared" else len(hashes) if isinstance(hashes, list) else 1
    stamp = payload[0] if isinstance(payload[0], (int, float)) else None
    return stamp, counts


class KvEventRecorder(threading.Thread):
    """Receives the server's KV events for the whole arm; `snapshot()` gives running totals, so a point's
    evictions are the difference of two snapshots, like a /metrics counter's."""

    def __init__(self, port: int, log_path: Path):
        super().__init__(name="kv-events", daemon=True)
        import msgspec
        import zmq

        self._decode = msgspec.msgpack.Decoder().decode
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._socket.setsockopt(zmq.RCVHWM, 0)  # never drop on our side
        self._socket.bind(f"tcp://127.0.0.1:{port}")
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._log = open(log_path, "w")
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._totals = {**dict.fromkeys(EVENT_TYPES, 0), "batches": 0, "missed_batches": 0, "undecoded": 0}
        self._last_seq: int | None = None

    def run(self) -> None:
        while not self._done.is_set() or self._poller.poll(0):
            if not self._poller.poll(100):
                continue
            frames = self._socket.recv_multipart()
            self._receive(frames)

    def _receive(self, frames: list[bytes]) -> None:
        with self._lock:
            if len(frames) != 3:
                self._totals["undecoded"] += 1
                return
            seq = int.from_bytes(frames[1], "big")
            if self._last_seq is not None and seq > self._last_seq + 1:
                self._totals["missed_batches"] += seq - self._last_seq - 1
            self._last_seq = seq
            try:
                stamp, counts = batch_counts(self._decode(frames[2]))
            except (ValueError, TypeError, IndexError, AttributeError) as failure:
                self._totals["undecoded"] += 1
                self._log.write(json.dumps({"seq": seq, "error": str(failure)[:200]}) + "\n")
                return
            self._totals["batches"] += 1
            for kind, count in counts.items():
                self._totals[kind] += count
            self._log.write(json.dumps({"seq": seq, "ts": stamp, **counts}) + "\n")

    def settle(self, limit_s: float = 5.0) -> None:
        """Waits until no batch has come for QUIET_S (at most limit_s): the engine publishes a step's events after
        the step, so the last responses of a point can arrive before its last events."""
        deadline, seen = time.monotonic() + limit_s, self._received()
        while time.monotonic() < deadline:
            time.sleep(QUIET_S)
            received = self._received()
            if received == seen:
                return
            seen = received

    def _received(self) -> int:
        with self._lock:
            return self._totals["batches"] + self._totals["undecoded"]

    def snapshot(self) -> dict:
        with self._lock:
            self._log.flush()
            return dict(self._totals)

    def finish(self) -> dict:
        """Stops once the queue is drained; the arm's totals."""
        self._done.set()
        self.join()
        self._socket.close(linger=0)
        self._context.term()
        self._log.close()
        return dict(self._totals)


def deltas(before: dict, after: dict) -> dict:
    """A point's events: the totals' differences, exact only when no batch was missed or undecoded."""
    change = {key: after[key] - before[key] for key in after}
    change["exact"] = change["missed_batches"] == 0 and change["undecoded"] == 0
    return change
