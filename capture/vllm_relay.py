"""The usage relay: a local HTTP relay between `vllm bench serve` and `vllm serve` that keeps, per request, what
the server itself said about it.

`vllm bench serve` discards the usage block of each response, so the prompt tokens that the server served from
its prefix cache (`usage.prompt_tokens_details.cached_tokens`, sent with `--enable-prompt-tokens-details` on the
last chunk of a streamed completion) never reach its result JSON. The relay passes every request and every
response byte through unchanged, as each chunk arrives, and reads the usage chunk and the first token's arrival
on the way. It keeps its connections to the server open between requests (replacing one the server closed while
idle), so that no request's time includes opening one. Both arms go through it, so what it adds to the client's
latencies is the same in each.

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
SHUTDOWN_POLL_S = 0.5  # how often the relay's accept loop looks for a shutdown: the most that stopping it waits


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
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(SHUTDOWN_POLL_S,), name="usage-relay",
                                        daemon=True)
        self._upstream = _Upstream(server_host, server_port)

    def __enter__(self) -> "UsageRelay":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._upstream.close()

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
                connection = None
                try:
                    connection, response = relay._upstream.send(self.command, self.path, body or None, headers)
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
                    # Back to the pool and recorded before the client hears the end: its next request, or the
                    # engine's take() once the client has exited, finds them.
                    relay._upstream.give_back(connection, response)
                    connection = None
                    if watcher is not None:
                        relay._record({"arrival": arrival, "status": response.status, **watcher.result()})
                    elif completion:
                        relay._record({"arrival": arrival, "status": response.status})
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except NET_ERRORS as failure:
                    if completion:
                        relay._record({"arrival": arrival, "status": None, "error": type(failure).__name__})
                    self.close_connection = True
                finally:
                    if connection is not None:  # its response was not read to the end
                        connection.close()

            def log_message(self, *args):
                pass

        return Handler


class _Upstream:
    """Keep-alive connections to the server, shared by the relay's threads, so that opening one is not inside a
    request's measured time: a request takes an idle one, else opens one, and gives it back once its response
    has been read to the end."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self._closed = False  # the relay has stopped: a handler thread still running gives its connection back late

    def send(self, method: str, path: str, body: bytes | None,
             headers: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """The server's response to one request. An idle connection that the server has closed meanwhile is
        replaced by a new one, once (a server that closed it read no request from it)."""
        with self._lock:
            idle = self._idle.pop() if self._idle else None
        if idle is not None:
            try:
                return idle, self._exchange(idle, method, path, body, headers)
            except ConnectionError:  # reset, broken pipe, or closed before any answer (RemoteDisconnected)
                idle.close()
            except BaseException:
                idle.close()
                raise
        connection = http.client.HTTPConnection(self.host, self.port, timeout=_SERVER_TIMEOUT_S)
        try:
            return connection, self._exchange(connection, method, path, body, headers)
        except BaseException:
            connection.close()
            raise

    @staticmethod
    def _exchange(connection: http.client.HTTPConnection, method: str, path: str, body: bytes | None,
                  headers: dict) -> http.client.HTTPResponse:
        connection.request(method, path, body=body, headers=headers)
        return connection.getresponse()

    def give_back(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        """Keeps a connection once its response has been read until read1() gave nothing, unless the server is
        closing it, the body ended short of its Content-Length, or the relay has stopped."""
        response.close()  # the connection takes no next request while its last response is open
        with self._lock:
            if not (self._closed or response.will_close or response.length):
                self._idle.append(connection)
                return
        connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class _StreamWatcher:
    """Reads a streamed completion (server-sent events) as it passes: the first token's arrival and the last
    usage block, keeping only an event not yet complete. A non-streamed JSON body is kept and read at the end."""

    def __init__(self, started: float):
        self.started = started
        self.first_token_s: float | None = None
        self.usage: dict | None = None
        self._pending = b""
        self._fed = False
        self._body: bytearray | None = None  # a non-streamed body: it starts with "{"

    def feed(self, chunk: bytes) -> None:
        if not self._fed:
            self._fed = True
            if chunk[:1] == b"{":
                self._body = bytearray()
        if self._body is not None:
            self._body += chunk
            return
        *events, self._pending = (self._pending + chunk).split(b"\n\n")
        for event in events:
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
        if self._body is not None:
            try:
                whole = json.loads(self._body)
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
