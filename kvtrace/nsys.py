"""The Nsight Systems command line as both sides use it: finding nsys, asking its version, exporting a report
to SQLite (every table, or only those named) or to a Parquet folder (`--type parquetdir`, the tables named).

Standard library only: capture runs it on a bare GPU box, the analyzer when it is given an .nsys-rep.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Callable, TextIO
from urllib.parse import quote

from kvtrace import files
from kvtrace.errors import KvtraceError

SQLITE_MAGIC = b"SQLite format 3\x00"
# Nsight Systems installs nsys in different places: a standalone install, the copy inside Nsight Compute
# (the H200 image), or a distribution package.
INSTALL_GLOBS = (
    "/opt/nvidia/nsight-systems/*/bin/nsys",
    "/opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys",
    "/usr/local/cuda/bin/nsys",
)


# Time limits of the child processes kvtrace starts, so that none can hang it: nsys --version answers at once; an
# export or import takes about 0.2 s per MiB of report on the H200 (552 MiB: 99 s, docs/performance.md), so ten
# times that, and ten minutes more, is a tool that has stopped working. $KVTRACE_STEP_LIMIT_S replaces them all.
VERSION_LIMIT_S = 60.0
EXPORT_LIMIT_S, EXPORT_LIMIT_S_PER_MIB = 600.0, 2.0
# While an export or import runs, a line on standard error this often says what kvtrace waits for and until when
# (a spinner shows only on a terminal; a log or CI job would otherwise see minutes of nothing).
WAIT_NOTICE_S = 30.0


class TimedOut(KvtraceError, RuntimeError):
    """A child process ran past its time limit (a RuntimeError too: capture records it as the run's failure)."""


def run_step(command: list[str], step: str, limit_s: float, *, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
             cwd: str | os.PathLike | None = None, env: dict | None = None, own_session: bool = True,
             notice_s: float | None = None) -> subprocess.CompletedProcess:
    """The one way kvtrace runs a child process: with a time limit, in its own session. Past the limit, or on any
    exception (Ctrl-C), the whole group is killed (a grandchild holding the output pipe would otherwise keep
    kvtrace waiting), and TimedOut names `step` and the limit. `own_session=False` leaves the child in the
    terminal's group, so that Ctrl-C reaches it too (nsys profile then finalizes its report); then only the
    child is killed. `notice_s`: every so many seconds the child runs, one line on standard error names the step,
    the time so far and the limit."""
    limit_s = _limit_s(limit_s)
    started = time.monotonic()
    with subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, errors="replace", cwd=cwd, env=env,
                          start_new_session=own_session) as process:
        try:
            while True:
                left = limit_s - (time.monotonic() - started)
                try:  # communicate may be called again after its timeout: what was read is kept
                    out, err = process.communicate(timeout=max(0.0, min(left, notice_s or left)))
                    break
                except subprocess.TimeoutExpired:
                    if not notice_s or time.monotonic() - started >= limit_s:
                        raise
                    sys.stderr.write(f"kvtrace: waiting for {step}: {time.monotonic() - started:.0f} s so far, "
                                     f"stopped at {limit_s:.0f} s\n")
                    sys.stderr.flush()
        except BaseException as error:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL) if own_session else process.kill()
            process.communicate()
            if isinstance(error, subprocess.TimeoutExpired):
                raise TimedOut(f"{step} did not finish within {limit_s:.0f} s and was stopped: check that "
                               f"{Path(command[0]).name} works on its own") from None
            raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _limit_s(default: float) -> float:
    """$KVTRACE_STEP_LIMIT_S, when set, in place of every step's own limit (for a machine far slower than the H200)."""
    text = os.environ.get("KVTRACE_STEP_LIMIT_S")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1e9:  # NaN too
        raise KvtraceError(f"KVTRACE_STEP_LIMIT_S={text} is not a number of seconds above 0: set a time limit "
                           "for each child process, or unset it")
    return value


def export_limit_s(report: Path) -> float:
    """The time an export or import of `report` may take (its size decides)."""
    try:
        size = os.stat(report).st_size
    except OSError:
        size = 0
    return EXPORT_LIMIT_S + EXPORT_LIMIT_S_PER_MIB * size / (1 << 20)


def find_nsys(explicit: str | None = None) -> str:
    """The nsys binary: `explicit` (--nsys), else $NSYS, else PATH, else the newest known install."""
    if explicit:
        check_explicit(explicit)
    elif os.path.isdir(os.environ.get("NSYS") or ""):
        # Naming the bin folder is the usual slip; skipping it would quietly pick another nsys.
        raise KvtraceError(f"NSYS={os.environ['NSYS']} is a directory: point NSYS at the nsys binary in it "
                           "(e.g. .../bin/nsys)")
    candidates = [explicit, os.environ.get("NSYS"), shutil.which("nsys")]
    candidates += sorted((p for g in INSTALL_GLOBS for p in glob.glob(g)), reverse=True)
    for candidate in candidates:
        if candidate and _executable_file(candidate):
            return candidate
    raise KvtraceError("nsys (Nsight Systems CLI) not found: install Nsight Systems, put nsys on PATH "
                       "or set NSYS=/path/to/nsys")


def check_explicit(nsys: str) -> None:
    """Refuse an nsys named on the command line (--nsys) that is not an executable file."""
    if not _executable_file(nsys):
        problem = "is a directory" if os.path.isdir(nsys) else "is not an executable file"
        raise KvtraceError(f"--nsys {nsys} {problem}: point it at the nsys binary (e.g. .../bin/nsys)")


def _executable_file(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_importer(nsys: str) -> str | None:
    """QdstrmImporter of the same Nsight Systems install as `nsys`: beside it, or in a host folder next to
    the folder that holds it (`host-linux-x64/` beside `target-linux-x64/` or `bin/`; `linux-desktop-*/`
    inside Nsight Compute's `host/`)."""
    here = Path(os.path.realpath(nsys)).parent
    candidates = [here / "QdstrmImporter"]
    for pattern in ("host-linux-*", "linux-desktop-*", "*/host-linux-*"):
        candidates += sorted(here.parent.glob(f"{pattern}/QdstrmImporter"))
    return next((str(c) for c in candidates if _executable_file(str(c))), None)


def import_qdstrm(importer: str, raw: Path, *, log: TextIO | None = None) -> subprocess.CompletedProcess:
    """Turn the raw capture `raw` (.qdstrm) into a report beside it, as nsys profile's own import step does."""
    return _run_logged([importer, "-i", str(raw)], log, f"QdstrmImporter on {raw}", export_limit_s(raw))


def _run_logged(command: list[str], log: TextIO | None, step: str, limit_s: float) -> subprocess.CompletedProcess:
    """Run an nsys tool (run_step), its command line and output (stdout and stderr together) written to `log` if
    given."""
    if log is not None:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
    result = run_step(command, step, limit_s, stderr=subprocess.STDOUT, notice_s=WAIT_NOTICE_S)
    if log is not None:
        log.write(result.stdout)
        log.flush()
    return result


def importer_error(output: str) -> str | None:
    """nsys' own words when its import step failed ("Importer error status: ..."), else None."""
    lines = [line.strip() for line in output.splitlines() if "importer error" in line.lower()]
    return lines[-1] if lines else None


def nsys_version(nsys: str) -> str:
    result = run_step([nsys, "--version"], f"`{nsys} --version`", VERSION_LIMIT_S)
    return result.stdout.strip() or result.stderr.strip()


def is_sqlite(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC


# What every complete `nsys export --type sqlite` of a CUDA trace holds; nsys writes StringIds first and
# META_DATA_EXPORT last, so an export that died half-way lacks the metadata.
EXPORT_TABLES = ("StringIds", "CUPTI_ACTIVITY_KIND_KERNEL", "META_DATA_EXPORT")


def read_only(path: Path) -> closing:
    """An SQLite file opened read-only, closed on leaving the `with`. The path's bytes are quoted: `#`, `?` or `%` in
    a folder name would otherwise cut the URI short."""
    return closing(sqlite3.connect(f"file:{quote(os.fsencode(Path(path).resolve()))}?mode=ro", uri=True))


def export_problem(path: Path) -> str | None:
    """Why `path` is not a complete Nsight Systems SQLite export of a CUDA trace, or None when it is one."""
    if not is_sqlite(path):
        return "is not an SQLite file"
    try:
        with read_only(path) as conn:
            if conn.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                return "fails SQLite's integrity check (truncated or damaged)"
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            missing = [name for name in EXPORT_TABLES if name not in tables]
            if missing:
                return f"lacks {', '.join(missing)} (not a complete nsys export)"
            if conn.execute("SELECT 1 FROM CUPTI_ACTIVITY_KIND_KERNEL LIMIT 1").fetchone() is None:
                return "has no CUDA kernel records"
    except sqlite3.DatabaseError as error:
        return f"is not a readable SQLite database ({error})"
    return None


class ExportFailed(RuntimeError):
    """nsys export ended without a complete SQLite file; `output` is what it printed."""

    def __init__(self, returncode: int, output: str):
        super().__init__(f"nsys export failed with exit code {returncode}")
        self.returncode, self.output = returncode, output

    @property
    def newer_report(self) -> bool:
        """An older nsys fails this way on a report that a newer one recorded (2023.4 on a 2025.3 report)."""
        return "ProtobufParseException" in self.output

    @property
    def last_line(self) -> str:
        return last_line(self.output)


def last_line(output: str) -> str:
    """A tool's last words: its last non-blank line of output."""
    return next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")


def export_command(nsys: str, report: Path, output: Path, tables: tuple[str, ...] = ()) -> list[str]:
    """`nsys export --type=sqlite`, of only `tables` when given (every table otherwise). --tables takes
    whole-name POSIX regular expressions (2023.4.4: `KERNEL` alone matches no table), so names pass as they are."""
    only = [f"--tables={','.join(tables)}"] if tables else []
    return [nsys, "export", "--type=sqlite", *only, "--force-overwrite=true", f"--output={output}", str(report)]


def export_sqlite(nsys: str, report: Path, target: Path, *, log: TextIO | None = None,
                  tables: tuple[str, ...] = (), seal: Callable[[Path], None] | None = None) -> None:
    """Export `report` to `target` (only `tables` when given). nsys writes a temporary file beside the target,
    renamed into place only once it is a complete SQLite file, so `target` never holds half an export; `seal`
    is called with that file first (the cache records what it holds). The command and nsys' output go to `log`
    when one is given. Raises ExportFailed."""
    with files.beside(target, suffix=".sqlite") as partial:
        result = _run_logged(export_command(nsys, report, partial, tables), log, f"nsys export of {report}",
                             export_limit_s(report))
        if result.returncode != 0 or not is_sqlite(partial):
            raise ExportFailed(result.returncode, result.stdout)
        if seal is not None:
            seal(partial)


# Versions whose Parquet output is known to lack a table kvtrace reads: Nsight Systems 2023.4.4 never writes
# META_DATA_CAPTURE (the CUDA graph trace mode, the capture trigger) into Arrow or Parquet output, named in
# --tables or not (docs/performance.md, observed on every export tried). A Parquet export there is a whole
# export's time wasted, so it is not tried; 2025.3.1 writes the table. Any other version is tried, and its
# output checked for every table it must hold (parquet_problem).
PARQUET_LACKS_CAPTURE = ("2023.4.4",)
# What a Parquet export must hold to answer as the SQLite export does: nsys writes StringIds first and
# META_DATA_EXPORT last; META_DATA_CAPTURE is the table 2023.4.4 leaves out.
PARQUET_REQUIRED = ("StringIds", "META_DATA_EXPORT", "META_DATA_CAPTURE")


# Reports at least this large go to SQLite (--tables) even where Parquet is exact. Measured on the H200 with
# 2025.3.1, pairs of eager-launch reports exported both at once (docs/performance.md): Parquet was faster at
# 119 MiB (16.6 s against 22.3 s) and slower at 552 MiB (99.1 s against 81.0 s), where its exporter also peaked
# at 2.9 GiB per report (5.4x the report) while SQLite's streams in 148 MiB. The bound is the geometric middle
# of the two sizes; between them nothing was measured.
PARQUET_MAX_REPORT_BYTES = 256 << 20


def parquet_known_inexact(version: str) -> bool:
    """Whether this `nsys --version` line names a version whose Parquet output is known to lack a table."""
    found = re.search(r"(\d+\.\d+\.\d+)", version)
    return bool(found) and found.group(1) in PARQUET_LACKS_CAPTURE


def parquet_command(nsys: str, report: Path, output: Path, tables: tuple[str, ...]) -> list[str]:
    """`nsys export --type=parquetdir` of `tables`: one TABLE.parquet per table in the folder `output`."""
    return [nsys, "export", "--type=parquetdir", f"--tables={','.join(tables)}", "--force-overwrite=true",
            f"--output={output}", str(report)]


def export_parquet(nsys: str, report: Path, target: Path, tables: tuple[str, ...], *,
                   log: TextIO | None = None, seal: Callable[[Path], None] | None = None) -> None:
    """Export `report`'s `tables` to the Parquet folder `target`. nsys writes into a temporary folder beside the
    target, renamed into place only once it holds PARQUET_REQUIRED, so `target` never holds half an export;
    `seal` is called with that folder first. Raises ExportFailed, its output ending with what the folder lacks
    when nsys itself said nothing wrong."""
    stem = os.fsdecode(os.fsencode(target.name)[:128])
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{stem}."))
    try:
        output = scratch / "export"
        result = _run_logged(parquet_command(nsys, report, output, tables), log,
                             f"nsys export --type parquetdir of {report}", export_limit_s(report))
        if result.returncode != 0:
            raise ExportFailed(result.returncode, result.stdout)
        missing = [name for name in PARQUET_REQUIRED if not (output / f"{name}.parquet").is_file()]
        if missing:
            raise ExportFailed(0, f"{result.stdout}\nthe Parquet output lacks {', '.join(missing)}")
        if seal is not None:
            seal(output)
        try:
            os.replace(output, target)
        except OSError:
            if not target.is_dir():  # else another kvtrace exported the same report meanwhile: theirs is kept
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
