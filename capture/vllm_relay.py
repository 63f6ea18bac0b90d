"""The usage relay: a local HTTP relay between `vllm bench serve` and `vllm serve` that keeps, per request, what
the server itself said about it.

`vllm bench serve` discards the usage block of each response, so the prompt tokens that the server served from
its prefix cache (`usage.prompt_tokens_details.cached_tokens`, sent with `--enable-prompt-tokens-details` on the
last chunk of a streamed completion) never reach its result JSON. The relay passes every request and every
response byte through unchanged, as each chunk arrives, and reads the usage chunk and the first token's arrival
on the way. Both arms go through it, so what it adds to the client's latencies is the same in each.

Standard library only.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvtrace.capture.vllm_http import NET_ERRORS

# Per-hop headers that describe one connection, not the message (RFC 9110, 7.6.1).
_HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                         "upgrade", "proxy-authenticate", "proxy-authorization"))
_SERVER_TIMEOUT_S = 3600.0  # a request may wait that long in a saturated server's queue


class UsageRelay:
    """Relays http://127.0.0.1:PORT to the server at host:port and records one entry per completion request: its
    arrival order within the point, the server's prompt, cached and completion token counts, and the relay's own
    times to the first token and to the end (ms). `take()` returns the entries recorded since the last call."""

    def __init__(self, server_host: str, server_port: int):
        self.server_host, self.server_port = server_host, server_port
        self._lock = threading.Lock()
        self._entries: list[dict] = []
        self._arrivals = 0
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="usage-relay", daemon=True)

    def __enter__(self) -> "UsageRelay":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def take(self) -> list[dict]:
        """The entries recorded since the last call, in arrival order, numbered from 0 again (a point's)."""
        with self._lock:
            entries, self._entries, self._arrivals = sorted(self._entries, key=lambda entry: entry["arrival"]), [], 0
        return entries

    def _arrived(self) -> int:
        with self._lock:
            self._arrivals += 1
            return self._arrivals - 1

    def _record(self, entry: dict) -> None:
        with self._lock:
            self._entries.append(entry)

    def _handler_class(self):
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

            def setup(self):
                super().setup()
                # Each token leaves as its own small write: without this, Nagle's algorithm holds it until the
                # client's delayed ACK of the last one (40 ms on Linux), which would land in every latency.
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def do_GET(self):
                self._relay()

            def do_POST(self):
                self._relay()

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                completion = self.command == "POST" and self.path.rstrip("/").endswith("/completions")
                arrival = relay._arrived() if completion else None
                started = time.perf_counter()
                headers = {name: value for name, value in self.headers.items() if name.lower() not in _HOP_BY_HOP}
                upstream = http.client.HTTPConnection(relay.server_host, relay.server_port, timeout=_SERVER_TIMEOUT_S)
                try:
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    response = upstream.getresponse()
                    self.send_response(response.status, response.reason)
                    for name, value in response.getheaders():
                        if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                            self.send_header(name, value)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    watcher = _StreamWatcher(started) if completion and response.status == 200 else None
                    while chunk := response.read1(65536):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                        if watcher is not None:
                            watcher.feed(chunk)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    if watcher is not None:
                        relay._record({"arrival": arrival, "status": response.status, **watcher.result()})
                    elif completion:
                        relay._record({"arrival": arrival, "status": response.status})
                except NET_ERRORS as failure:
                    if completion:
                        relay._record({"arrival": arrival, "status": None, "error": type(failure).__name__})
                    self.close_connection = True
                finally:
                    upstream.close()

            def log_message(self, *args):
                pass

        return Handler


class _StreamWatcher:
    """Reads a streamed completion (server-sent events) as it passes: the first token's arrival and the last
    usage block. A non-streamed JSON body is read whole at the end."""

    def __init__(self, started: float):
        self.started = started
        self.first_token_s: float | None = None
        self.usage: dict | None = None
        self._pending = b""
        self._whole = bytearray()

    def feed(self, chunk: bytes) -> None:
        self._whole += chunk
        self._pending += chunk
        while b"\n\n" in self._pending:
            event, self._pending = self._pending.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            return
        try:
            data = json.loads(payload)
        except ValueError:
            return
        if not isinstance(data, dict):
            return
        if self.first_token_s is None and data.get("choices"):
            self.first_token_s = time.perf_counter() - self.started
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]

    def result(self) -> dict:
        ended_s = time.perf_counter() - self.started
        if self.usage is None and self._whole[:1] == b"{":  # not streamed: one JSON body
            try:
                whole = json.loads(bytes(self._whole))
            except ValueError:
                whole = None
            if isinstance(whole, dict) and isinstance(whole.get("usage"), dict):
                self.usage = whole["usage"]
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")
        return {"prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else None,
                "completion_tokens": usage.get("completion_tokens"),
                "first_token_ms": None if self.first_token_s is None else round(self.first_token_s * 1e3, 3),
                "end_ms": round(ended_s * 1e3, 3)}


def summarize(entries: list[dict]) -> dict:
    """What a point's requests say about the prefix cache, from the server's own per-request counts."""
    counted = [entry for entry in entries if isinstance(entry.get("cached_tokens"), int)
               and isinstance(entry.get("prompt_tokens"), int)]
    prompt = sum(entry["prompt_tokens"] for entry in counted)
    cached = sum(entry["cached_tokens"] for entry in counted)
    return {"requests": len(entries), "with_cached_tokens": len(counted), "prompt_tokens": prompt,
            "cached_tokens": cached, "cached_share": cached / prompt if prompt else None,
            "failed": sum(1 for entry in entries if entry.get("status") != 200)}
