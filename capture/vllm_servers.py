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
from kvtrace.manifest import WindowStatus

GATED = ("-m", "kvtrace.capture.vllm_gated_client")
REPORT_WAIT_S = 60.0  # at most, before a window, for nsys to finish the previous window's report
FIRST_REPORT_WAIT_S = 20.0  # at most, for a server's first report (a 24-48-step window imports in seconds)
REPORT_POLL_S = 0.2  # between looks for that report
REPORT_STEADY_S = 0.5  # a report whose size holds this long is no longer being written
_SLOT_NUMBER = re.compile(r"(\d+)$")


@dataclass
class Window:
    """One profile window: which run and point it lies in, and the report nsys wrote for it."""

    run_dir: Path
    run: str  # ARM.rK
    point: int
    steps: int
    delay_steps: int = 0
    status: WindowStatus = WindowStatus.OPEN
    report: Path | None = None  # the report's path without its suffix (.nsys-rep, or .qdstrm when nsys' import failed)
    error: str | None = None
    export_s: float | None = None
    reports_before: int | None = None  # reports nsys had written for this server when the window opened
    report_wait_s: float | None = None  # how long it waited for them
    close_s: float | None = None  # how long POST /stop_profile took

    @property
    def sqlite(self) -> str:
        return f"{self.run}.p{self.point}.sqlite"

    def record(self) -> dict:
        return {"point": self.point, "sqlite": self.sqlite if self.status == WindowStatus.EXPORTED else None,
                "steps": self.steps, "delay_steps": self.delay_steps, "status": self.status,
                "report": f"{self.report}.nsys-rep" if self.report else None, "reports_before": self.reports_before,
                "report_wait_s": self.report_wait_s, "close_s": self.close_s,
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
    ready: bool = False  # answered /health
    reports_at_exit: bool = False  # this nsys writes its reports when the server exits, not after each window

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
        # Up before the server, so that clients started while it compiles know where to send their requests.
        self.relay = UsageRelay(self.cfg.host, self.cfg.port).__enter__()

    def wait_ready(self, timeout_s: float) -> None:
        _wait_ready(self.process, self.base, timeout_s)
        self.timings["start_s"] = round(time.monotonic() - self._started, 1)
        self.kv_cache = parse_kv_cache_log(self.log.read_text(errors="replace"))
        self.ready = True

    def up(self) -> bool:
        """Started, answered /health, and still running."""
        return self.ready and self.relay is not None and self.process is not None and self.process.running()

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

    def open_window(self, window: Window, report_wait_s: float = REPORT_WAIT_S) -> None:
        """Start a window once nsys has written the previous window's report (bounded): a range that starts while
        nsys still writes the last one's report is at risk, and the count of reports before each window is what
        tells them apart if one goes missing. A server whose nsys wrote no report for its first window writes them
        at exit: no more waiting there."""
        begun = time.monotonic()
        previous = self.windows[-1] if self.windows else None
        if previous is not None and not self.reports_at_exit:
            # Until this nsys has shown that it writes a report per window, waiting long would cost every server
            # that much once, were its reports written at exit.
            limit = report_wait_s if self.report_slots() else min(report_wait_s, FIRST_REPORT_WAIT_S)
            while not self._report_written_since(previous.reports_before):
                if time.monotonic() - begun > limit:
                    self.reports_at_exit = not self.report_slots()
                    break
                time.sleep(REPORT_POLL_S)
        window.report_wait_s = round(time.monotonic() - begun, 2)
        window.reports_before = len(self.report_slots())
        status, body = http_request("POST", self.base + "/start_profile", timeout=600,
                                    payload={"max_iterations": window.steps, "delay_iterations": window.delay_steps})
        if status in (400, 422):  # a vLLM without per-window bounds: the server's --profiler-config bounds it
            window.steps, window.error = self.cfg.profile_steps, f"per-window bounds refused ({status}): server's own"
            status, body = http_request("POST", self.base + "/start_profile", timeout=600)
        if status != 200:
            window.status = WindowStatus.FAILED
            window.error = f"POST /start_profile answered {status} {body.strip()[:200]!r}"
            raise RuntimeError(window.error)
        self.windows.append(window)

    def close_window(self, window: Window) -> None:
        status, body = http_request("POST", self.base + "/stop_profile", timeout=600)
        if status != 200:
            window.status = WindowStatus.FAILED
            window.error = f"POST /stop_profile answered {status} {body.strip()[:200]!r}"
            raise RuntimeError(window.error)
        window.status = WindowStatus.CLOSED

    def report_slots(self) -> list[Path]:
        """The capture ranges nsys has written so far, in its numbering order: one per range, as its report or,
        where nsys' import failed, its raw capture (.qdstrm), so that a failed import shifts no other window."""
        stems = {path.name.rsplit(".", 1)[0] for pattern in ("trace*.nsys-rep", "trace*.qdstrm")
                 for path in self.folder.glob(pattern)}
        return sorted((self.folder / stem for stem in stems), key=_slot_order)

    def _report_written_since(self, count: int) -> bool:
        """A report more than `count`, and the newest one no longer growing."""
        slots = self.report_slots()
        if len(slots) <= count:
            return False
        newest = slots[-1].with_name(slots[-1].name + ".nsys-rep")
        try:
            size = newest.stat().st_size
            time.sleep(REPORT_STEADY_S)
            return newest.stat().st_size == size
        except OSError:  # only its raw capture: nsys' import failed, nothing more will come for it
            return True

    def assign_reports(self) -> None:
        """Once nsys is done (the server is down): window k's report is the k-th capture range's. With exactly as
        many ranges as windows that is certain. Otherwise only the windows before the first that did not find
        exactly its predecessors' reports when it opened, and its own when the next one did, get theirs; the rest
        get none rather than a wrong one."""
        slots = self.report_slots()
        if len(slots) == len(self.windows):
            certain = len(self.windows)
        else:
            before = [w.reports_before for w in self.windows] + [None]
            certain = next((k for k in range(len(self.windows)) if before[k] != k or before[k + 1] != k + 1),
                           len(self.windows))
        for k, window in enumerate(self.windows):
            if window.status != WindowStatus.CLOSED:
                continue
            if k < certain:
                window.report = slots[k]
            else:
                window.status = WindowStatus.NO_REPORT
                window.error = (f"nsys wrote {len(slots)} reports for {len(self.windows)} windows of this server, so "
                                f"which is whose is uncertain from window {certain + 1} on; they are kept in "
                                f"{self.folder}")

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
                "reports_at_exit": self.reports_at_exit,
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
                window.status = WindowStatus.EXPORTED
            except (OSError, RuntimeError) as failure:  # ExportFailed and TimedOut are RuntimeErrors
                window.status, window.error = WindowStatus.EXPORT_FAILED, f"{failure} (see {log.name})"
        window.export_s = round(time.monotonic() - started, 1)

    todo = [window for window in windows if window.report is not None and window.status == WindowStatus.CLOSED]
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
        """Ends it, started or not."""
        if self.process.process is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.process.process.stdin.close()
        self.process.stop(grace_s=5.0)
