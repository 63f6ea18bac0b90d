"""`kvtrace capture import RUNDIR`: take up the runs whose workload finished but whose report never became an
SQLite export (nsys profile's import step failed, or the export did).

Per such run, in this order: adopt an ARM.sqlite already exported by hand, once it is checked to be a complete
nsys export; else export ARM.nsys-rep; else import ARM.qdstrm with the QdstrmImporter of the nsys install and
export the report. The manifests (manifest.json and ARM.manifest.json) then say so: the run's status becomes
"ok", and its entry keeps what the capture recorded, the original status and error, under "import" beside what
was done, when, and the export's SHA-256. Nothing is rewritten for a run that stays failed.

Standard library only (plus the kvtrace floor), so that it runs where the capture ran.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

import kvtrace.nsys
from kvtrace import __version__, files
from kvtrace.capture import runner
from kvtrace.errors import KvtraceError
from kvtrace.manifest import MANIFEST, CaptureStatus, RunStatus, capture_status, is_kvtrace_manifest


def importable(entry: dict) -> bool:
    """A run that failed only on its report: what this command may take up."""
    return entry.get("status") == RunStatus.FAILED and str(entry.get("error") or "").startswith(runner.REPORT_FAILURES)


def _read(path: Path) -> dict:
    data = files.read_json(path, f"manifest {path}", "pass a run directory written by `kvtrace capture`")
    if not is_kvtrace_manifest(data) or not isinstance(data.get("arms"), dict):
        raise KvtraceError(f"{path} was not written by kvtrace (no kvtrace_manifest field or no arms): pass a run "
                           "directory written by `kvtrace capture`")
    for name, entry in data["arms"].items():
        # An arm's name becomes file names in the run directory: a planted "../x" must not reach outside it.
        if not isinstance(entry, dict) or Path(name).name != name or name in (".", ".."):
            raise KvtraceError(f"{path}: arm {name!r} is not an arm entry kvtrace wrote (an object named by a file "
                               "stem): pass a run directory written by `kvtrace capture`")
        if not all(isinstance(entry.get(key), (str, type(None))) for key in ("status", "error")):
            raise KvtraceError(f"{path}: arm {name!r} has a status or error that is not text: pass a run directory "
                               "written by `kvtrace capture`")
    return data


def _present(path: Path) -> bool:
    """Whether a run's file is there, as a regular file in the run directory. A FIFO would block (nsys or the
    check would wait for a writer for ever), a link may lead outside the run directory, which this command writes
    into: both are refused, as is a folder or device."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(status.st_mode):
        kind = "a link" if stat.S_ISLNK(status.st_mode) else "not a regular file (a FIFO, device or folder)"
        raise RuntimeError(f"{path.name} is {kind}: put the file itself in the run directory")
    return True


def _open_log(path: Path):
    """The run's log, opened to append without following a link or waiting on a FIFO (checked first, then opened
    so that one put there meanwhile is refused too)."""
    _present(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        raise RuntimeError(f"cannot write {path.name} ({(error.strerror or str(error)).lower()}): put a regular file "
                           "there, or none") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RuntimeError(f"{path.name} is not a regular file (a FIFO or device): put a regular file there, or none")
    os.set_blocking(fd, True)
    return open(fd, "a")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _Nsys:
    """nsys, found on first need: adopting a hand export needs none."""

    def __init__(self, explicit: str | None):
        self.explicit, self._path = explicit, None

    @property
    def path(self) -> str:
        if self._path is None:
            self._path = kvtrace.nsys.find_nsys(self.explicit)
        return self._path


def _take_up(out: Path, name: str, nsys: _Nsys) -> dict:
    """Makes out/NAME.sqlite a complete export; returns what was done. Raises RuntimeError saying why not.
    A hand export is adopted once checked; otherwise the capture's own export step runs again
    (runner.export_run: the .nsys-rep, else the .qdstrm through QdstrmImporter)."""
    sqlite, report, raw = (out / f"{name}{suffix}" for suffix in (".sqlite", ".nsys-rep", ".qdstrm"))
    if _present(sqlite):
        problem = kvtrace.nsys.export_problem(sqlite)
        if problem:
            raise RuntimeError(f"{sqlite.name} {problem}: export {report.name} again with `nsys export --type sqlite`")
        return {"how": f"adopted {sqlite.name}, exported outside kvtrace", "commands": []}
    if _present(report):
        how = f"exported {report.name}"
    else:
        _present(raw)  # refused here when it is no regular file, before the importer would wait on it
        how = f"imported {raw.name} with QdstrmImporter, exported {report.name}"
    with _open_log(out / f"{name}.log") as log:
        log.write(f"# kvtrace capture import, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
        try:
            commands = runner.export_run(out, name, nsys.path, log,
                                         no_report=f"none of {sqlite.name}, {report.name} or {raw.name} is in {out}")
        except kvtrace.nsys.ExportFailed as failed:
            raise RuntimeError(f"{failed} (\"{failed.last_line}\"); see {name}.log") from None
    return {"how": how, "commands": commands}


def import_run(out: Path, *, nsys: str | None = None) -> dict[str, str | None]:
    """Takes up every importable run in `out`; returns, per run taken up, None when it is now ok, else why not.
    The manifests are written once, after every run, and only when one was taken up."""
    if not out.is_dir():
        raise KvtraceError(f"{out}: no such run directory: pass a directory written by `kvtrace capture`")
    if not (out / MANIFEST).is_file():
        raise KvtraceError(f"{out} has no {MANIFEST}: pass a run directory written by `kvtrace capture`")
    # The manifests are rewritten: one that is a link would be written through, outside the run directory.
    for manifest in (out / MANIFEST, *out.glob("*.manifest.json")):
        if manifest.is_symlink():
            raise KvtraceError(f"{manifest} is a link, and `capture import` writes only inside the run directory: "
                               "put the manifest itself there")
    data = _read(out / MANIFEST)
    finder, outcome, done = _Nsys(nsys), {}, {}
    for name, entry in data["arms"].items():
        if not importable(entry):
            continue
        try:
            done[name] = _take_up(out, name, finder)
            outcome[name] = None
        except (OSError, RuntimeError) as failure:
            outcome[name] = str(failure)
    if not done:
        return outcome
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for name, how in done.items():
        entry = data["arms"][name]
        sqlite = out / f"{name}.sqlite"
        entry["import"] = {"utc": stamp, "kvtrace": __version__, **how,
                           "sqlite": {"bytes": sqlite.stat().st_size, "sha256": _sha256(sqlite)},
                           "original": {"status": entry["status"], "error": entry["error"]}}
        entry.update(status=RunStatus.OK, error=None, sqlite=sqlite.name)
        if (out / f"{name}.nsys-rep").exists():
            entry["report"] = f"{name}.nsys-rep"
    if "status" in data:
        data.setdefault("imports", []).append({"utc": stamp, "runs": sorted(done), "status_before": data["status"]})
        data["status"] = capture_status([entry.get("status") for entry in data["arms"].values()],
                                        interrupted=data["status"] == CaptureStatus.INTERRUPTED)
    for name in done:  # the per-run manifests (vLLM) carry the same entry
        arm_file = out / f"{name}.manifest.json"
        if arm_file.is_file():
            arm_data = _read(arm_file)
            arm_data["arms"][name] = data["arms"][name]
            arm_data["status"] = CaptureStatus.OK
            runner.write_json_atomic(arm_file, arm_data)
    runner.write_json_atomic(out / MANIFEST, data)
    return outcome
