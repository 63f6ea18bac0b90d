"""Long-lived `vllm serve` processes for a capture matrix (capture/vllm_matrix): one per arm, under its own
`nsys profile --capture-range-end=repeat`, so that every profile window (POST /start_profile ... /stop_profile,
bounded by max_iterations engine steps) becomes a report of its own; clients started ahead of their turn; and the
reports found, named by point and exported once the servers are down.

Standard library only.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import kvtrace.nsys
from kvtrace.capture import runner, vllm_patches
from kvtrace.capture.processes import ManagedProcess
from kvtrace.capture.vllm_commands import NSYS_EXTRA, VLLM_CLI, base_url
from kvtrace.capture.vllm_common import parse_kv_cache_log
from kvtrace.capture.vllm_config import VllmCapture
from kvtrace.capture.vllm_engine import _wait_ready
from kvtrace.capture.vllm_http import NET_ERRORS, http_request
from kvtrace.capture.vllm_kv_events import KvEventRecorder
from kvtrace.capture.vllm_relay import UsageRelay

GATED = ("-m", "kvtrace.capture.vllm_gated_client")
_REPORT_NUMBER = re.compile(r"\.(\d+)\.nsys-rep$")


@dataclass
class Window:
    """One profile window: which run and point it lies in, and the report nsys wrote for it."""

    run_dir: Path
    run: str  # ARM.rK
    point: int
    steps: int
    delay_steps: int = 0
    status: str = "open"  # open, closed, failed (start or stop refused), exported, export failed, no report
    report: Path | None = None
    error: str | None = None
    export_s: float | None = None

    @property
    def sqlite(self) -> str:
        return f"{self.run}.p{self.point}.sqlite"

    def record(self) -> dict:
        return {"point": self.point, "sqlite": self.sqlite if self.status == "exported" else None,
                "steps": self.steps, "delay_steps": self.delay_steps, "status": self.status,
                "report": str(self.report) if self.report else None, "error": self.error, "export_s": self.export_s}


@dataclass
class ArmServer:
    """One arm's server for its whole lifetime, across scenarios and rounds."""

    spec: vllm_patches.ArmSpec
    cfg: VllmCapture  # the server's flags: prefix caching on, this arm's port
    folder: Path  # servers/LABEL: log, reports, KV events, patch
    nsys: str
    python: str
    env: dict
    process: ManagedProcess | None = None
    relay: UsageRelay | None = None
    events: KvEventRecorder | None = None
    kv_cache: dict | None = None
    windows: list[Window] = field(default_factory=list)
    seen_reports: set[str] = field(default_factory=set)
    timings: dict = field(default_factory=dict)  # started_utc, start_s (start and compile), warmup_s, lifetime_s
    error: str | None = None
    exit_code: int | None = None

    @property
    def base(self) -> str:
        return base_url(self.cfg)

    @property
    def log(self) -> Path:
        return self.folder / "server.log"

    def command(self) -> list[str]:
        from kvtrace.capture.vllm_config import engine_flags

        serve = [self.python, *VLLM_CLI, "serve", self.cfg.model, "--host", self.cfg.host, "--port",
                 str(self.cfg.port), *engine_flags(self.cfg, self.spec.kv_dtype)]
        return runner.profile_command(self.nsys, self.folder / "trace", serve, extra=NSYS_EXTRA, range_end="repeat")

    def start(self) -> None:
        """Start without waiting: servers that share the GPU compile at the same time."""
        self.folder.mkdir(parents=True, exist_ok=True)
        env = vllm_patches.install(self.spec, self.folder / "patch", self.env)
        self.events = KvEventRecorder(self.cfg.kv_events_port, self.folder / "kv-events.jsonl")
        self.events.start()
        self.timings["started_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._started = time.monotonic()
        self.process = ManagedProcess(self.command(), env, self.log).start()

    def wait_ready(self, timeout_s: float) -> None:
        _wait_ready(self.process, self.base, timeout_s)
        self.timings["start_s"] = round(time.monotonic() - self._started, 1)
        self.kv_cache = parse_kv_cache_log(self.log.read_text(errors="replace"))
        self.relay = UsageRelay(self.cfg.host, self.cfg.port).__enter__()

    def alive(self) -> bool:
        return self.process is not None and self.process.running()

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        """vLLM 0.33 answers {"success": false} while blocks are still held (requests finishing): retry briefly."""
        for _ in range(attempts):
            status, body = http_request("POST", self.base + "/reset_prefix_cache", timeout=60)
            if status != 200:
                raise RuntimeError(f"POST /reset_prefix_cache answered {status} {body.strip()[:200]!r} (needs "
                                   "VLLM_SERVER_DEV_MODE=1 on the server)")
            if '"success":false' not in body.replace(" ", ""):
                return
            time.sleep(0.25)
        raise RuntimeError("POST /reset_prefix_cache kept answering success=false: requests still hold blocks")

    def open_window(self, window: Window) -> None:
        self.collect_reports()
        status, body = http_request("POST", self.base + "/start_profile", timeout=600,
                                    payload={"max_iterations": window.steps, "delay_iterations": window.delay_steps})
        if status != 200:
            window.status, window.error = "failed", f"POST /start_profile answered {status} {body.strip()[:200]!r}"
            raise RuntimeError(window.error)
        self.windows.append(window)

    def close_window(self, window: Window) -> None:
        status, body = http_request("POST", self.base + "/stop_profile", timeout=600)
        if status != 200:
            window.status, window.error = "failed", f"POST /stop_profile answered {status} {body.strip()[:200]!r}"
            raise RuntimeError(window.error)
        window.status = "closed"

    def collect_reports(self) -> None:
        """Give the reports nsys has written since the last look to the oldest windows still without one, in nsys'
        numbering order (each window is one capture range, hence one report)."""
        new = sorted((path for path in self.folder.glob("trace*.nsys-rep") if path.name not in self.seen_reports),
                     key=_report_order)
        waiting = [window for window in self.windows if window.report is None and window.status in ("closed", "open")]
        for path, window in zip(new, waiting):
            window.report = path
            self.seen_reports.add(path.name)

    def stop(self, grace_s: float) -> None:
        if self.relay is not None:
            self.relay.__exit__(None, None, None)
            self.relay = None
        if self.process is not None and self.exit_code is None:
            self.exit_code = self.process.stop(grace_s)
            self.timings["lifetime_s"] = round(time.monotonic() - self._started, 1)
        if self.events is not None:
            self.events.finish()
            self.events = None
        self.kv_cache = parse_kv_cache_log(self.log.read_text(errors="replace")) or self.kv_cache
        self.collect_reports()
        for window in self.windows:
            if window.report is None and window.status == "closed":
                window.status, window.error = "no report", "nsys wrote no report for this window (see server.log)"

    def record(self) -> dict:
        return {"arm": self.spec.label, "kv_cache_dtype": self.spec.kv_dtype, "patch": self.spec.record(),
                "port": self.cfg.port, "log": str(self.log), "exit_code": self.exit_code, "kv_cache": self.kv_cache,
                "error": self.error, **self.timings}


def _report_order(path: Path) -> tuple[int, str]:
    match = _REPORT_NUMBER.search(path.name)
    return (int(match.group(1)) if match else -1, path.name)


def export_windows(windows: list[Window], nsys: str, workers: int) -> None:
    """Export every window's report to RUN_DIR/ARM.rK.pN.sqlite, `workers` at a time (the servers are down)."""
    def export(window: Window) -> None:
        started = time.monotonic()
        with open(window.run_dir / f"{window.run}.p{window.point}.export.log", "w") as log:
            try:
                kvtrace.nsys.export_sqlite(nsys, window.report, window.run_dir / window.sqlite, log=log)
                window.status = "exported"
            except (OSError, kvtrace.nsys.ExportFailed, kvtrace.nsys.TimedOut) as failure:
                window.status, window.error = "export failed", f"{failure} (see {log.name})"
        window.export_s = round(time.monotonic() - started, 1)

    todo = [window for window in windows if window.report is not None and window.status == "closed"]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(export, todo))


class GatedClient:
    """A bench client started ahead of its point (kvtrace.capture.vllm_gated_client), released on its turn."""

    def __init__(self, command: list[str], env: dict, log: Path, python: str):
        gated = [python, *GATED, "--", *command[command.index(VLLM_CLI[1]):]]
        self.command = command
        self.process = ManagedProcess(gated, env, log, append=True, stdin=subprocess.PIPE)

    def start(self) -> "GatedClient":
        self.process.start()
        return self

    def run(self) -> int:
        """Release the client and wait for it."""
        try:
            self.process.process.stdin.write(b"go\n")
            self.process.process.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # it already exited: its exit code says why
        try:
            return self.process.wait()
        finally:
            self.process.stop(grace_s=10.0)

    def cancel(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.process.process.stdin.close()
        self.process.stop(grace_s=5.0)
