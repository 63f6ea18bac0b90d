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
from kvtrace.capture.vllm_http import http_request
from kvtrace.capture.vllm_kv_events import KvEventRecorder
from kvtrace.capture.vllm_relay import UsageRelay

GATED = ("-m", "kvtrace.capture.vllm_gated_client")
_SLOT_NUMBER = re.compile(r"(\d+)$")


@dataclass
class Window:
    """One profile window: which run and point it lies in, and the report nsys wrote for it."""

    run_dir: Path
    run: str  # ARM.rK
    point: int
    steps: int
    delay_steps: int = 0
    status: str = "open"  # open, closed, failed (start or stop refused), exported, export failed, no report
    report: Path | None = None  # the report's path without its suffix (.nsys-rep, or .qdstrm when nsys' import failed)
    error: str | None = None
    export_s: float | None = None
    reports_before: int | None = None  # reports nsys had written for this server when the window opened

    @property
    def sqlite(self) -> str:
        return f"{self.run}.p{self.point}.sqlite"

    def record(self) -> dict:
        return {"point": self.point, "sqlite": self.sqlite if self.status == "exported" else None,
                "steps": self.steps, "delay_steps": self.delay_steps, "status": self.status,
                "report": f"{self.report}.nsys-rep" if self.report else None, "reports_before": self.reports_before,
                "error": self.error, "export_s": self.export_s}


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

    def up(self) -> bool:
        """Started, answered /health, and still running."""
        return self.relay is not None and self.process is not None and self.process.running()

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
        window.reports_before = len(self.report_slots())  # recorded: when each window's report appeared
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

    def report_slots(self) -> list[Path]:
        """The capture ranges nsys has written so far, in its numbering order: one per range, as its report or,
        where nsys' import failed, its raw capture (.qdstrm), so that a failed import shifts no other window."""
        stems = {path.name.rsplit(".", 1)[0] for pattern in ("trace*.nsys-rep", "trace*.qdstrm")
                 for path in self.folder.glob(pattern)}
        return sorted((self.folder / stem for stem in stems), key=_slot_order)

    def assign_reports(self) -> None:
        """Once nsys is done (the server is down): window k's report is the k-th capture range's. Only when there are
        exactly as many ranges as windows is that certain; otherwise no window gets one, rather than a wrong one."""
        slots, opened = self.report_slots(), [w for w in self.windows if w.status == "closed"]
        if len(slots) != len(self.windows):
            for window in opened:
                window.status = "no report"
                window.error = (f"nsys wrote {len(slots)} reports for {len(self.windows)} windows of this server, so "
                                f"which is whose is uncertain; they are kept in {self.folder}")
            return
        for slot, window in zip(slots, self.windows):
            if window.status == "closed":
                window.report = slot

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
        self.assign_reports()

    def record(self) -> dict:
        return {"arm": self.spec.label, "kv_cache_dtype": self.spec.kv_dtype, "patch": self.spec.record(),
                "port": self.cfg.port, "log": str(self.log), "exit_code": self.exit_code, "kv_cache": self.kv_cache,
                "error": self.error, **self.timings}


def _slot_order(stem: Path) -> tuple[int, str]:
    """nsys numbers the reports of repeated ranges (trace.1, trace.2, ...); the unnumbered one, if any, is first."""
    match = _SLOT_NUMBER.search(stem.name)
    return (int(match.group(1)) if match else -1, stem.name)


def export_windows(windows: list[Window], nsys: str, workers: int) -> None:
    """Export every window's report to RUN_DIR/ARM.rK.pN.sqlite, `workers` at a time (the servers are down)."""
    def export(window: Window) -> None:
        started = time.monotonic()
        with open(window.run_dir / f"{window.run}.p{window.point}.export.log", "w") as log:
            try:
                report = window.report.with_name(window.report.name + ".nsys-rep")
                if not report.exists():  # nsys' own import failed: once more with its QdstrmImporter
                    runner._import_again(nsys, window.report.with_name(window.report.name + ".qdstrm"), report, log)
                kvtrace.nsys.export_sqlite(nsys, report, window.run_dir / window.sqlite, log=log)
                window.status = "exported"
            except (OSError, RuntimeError) as failure:  # ExportFailed and TimedOut are RuntimeErrors
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
