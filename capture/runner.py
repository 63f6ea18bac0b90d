"""Shared by every capture engine: run directories, nsys profile command lines, export of each run, manifests.

Standard library only (plus the kvtrace floor), so that it runs on a bare GPU box.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import kvtrace.nsys
from kvtrace import __version__, files
from kvtrace.errors import KvtraceError
from kvtrace.manifest import MANIFEST, MARKER, SCHEMA, RunStatus, is_kvtrace_manifest

def profile_command(nsys: str, report: Path, workload: list[str], *, extra: tuple[str, ...] = (),
                    range_end: str = "stop") -> list[str]:
    """nsys profile over a workload that opens its own measured region with cudaProfilerStart/Stop.

    `--cuda-graph-trace=node` keeps one row per kernel inside CUDA graphs (decode in serving stacks);
    the capture range keeps JIT and warm-up out of the trace. range_end "repeat": every range becomes a report of
    its own (a long-lived server traced once per traffic point).
    """
    return [nsys, "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none",
            "--cuda-graph-trace=node", "--capture-range=cudaProfilerApi", f"--capture-range-end={range_end}",
            *extra, "--force-overwrite=true", f"--output={report}", *workload]


# How export_run's failures begin: the workload finished and only its report did not become an export, so
# `kvtrace capture import` can take the run up again (ExportFailed's message is kvtrace.nsys').
REPORT_FAILURES = ("nsys left ", "nsys export failed")


def export_run(out: Path, name: str, nsys: str, log: TextIO, *, no_report: str) -> list[list[str]]:
    """Export the run's report (out/NAME.nsys-rep) to out/NAME.sqlite; returns the commands run, to record.
    `no_report` says what to check when nsys wrote no report at all. When nsys left only the raw capture
    (.qdstrm), its import step failed or is missing: the import is tried once more with QdstrmImporter (the
    first command returned). `kvtrace capture import` takes up failed runs through here too."""
    report = out / f"{name}.nsys-rep"
    commands = []
    if not report.exists():
        raw = report.with_suffix(".qdstrm")
        if not raw.exists():
            raise RuntimeError(f"nsys wrote no report: {no_report}")
        commands.append(_import_again(nsys, raw, report, log))
    kvtrace.nsys.export_sqlite(nsys, report, out / f"{name}.sqlite", log=log)
    return commands + [kvtrace.nsys.export_command(nsys, Path(report.name), Path(f"{name}.sqlite"))]


def _import_again(nsys: str, raw: Path, report: Path, log: TextIO) -> list[str]:
    """Import `raw` with the QdstrmImporter of `nsys`' install, returning its command; raises with nsys' own
    words if that fails."""
    log.flush()
    try:  # what nsys profile printed, for its own error line
        profiled = Path(log.name).read_text(errors="replace")
    except (OSError, TypeError):
        profiled = ""
    said = kvtrace.nsys.importer_error(profiled)
    importer = kvtrace.nsys.find_importer(nsys)
    if importer is None:
        cause = f"nsys said \"{said}\"" if said else "its importer is missing"
        raise RuntimeError(f"nsys left {raw.name} but no report ({cause}), and no QdstrmImporter was found beside "
                           f"{nsys}: run QdstrmImporter -i {raw.name} from the same Nsight Systems version, then "
                           "nsys export --type sqlite")
    result = kvtrace.nsys.import_qdstrm(importer, raw, log=log)
    if result.returncode == 0 and report.exists():
        return [importer, "-i", raw.name]
    again = kvtrace.nsys.importer_error(result.stdout) or kvtrace.nsys.last_line(result.stdout)
    first = f"nsys profile's import said \"{said}\"; " if said else ""
    raise RuntimeError(f"nsys left {raw.name} but no report: {first}QdstrmImporter -i {raw.name} failed"
                       f"{' too' if said else ''} (exit code {result.returncode}: \"{again}\"); see the log")


def write_json_atomic(path: Path, data: dict) -> None:
    """Serialised first, so that data that is not JSON leaves the previous file as it was."""
    files.write(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def _is_kvtrace_run(out: Path) -> bool:
    """A folder with a manifest.json that kvtrace wrote (not merely any manifest.json)."""
    try:
        return is_kvtrace_manifest(json.loads((out / MANIFEST).read_text()))
    except (OSError, ValueError):
        return False


def prepare_run_dir(out: Path, force: bool, *, what: str = "run directory", whats: str = "run directories",
                    holding: str = "a run", marker: str = MANIFEST, owned=_is_kvtrace_run) -> None:
    """`out` made empty for a capture: created, or replaced with --force where `owned` says kvtrace wrote it (a folder
    with its `marker`); a link, a file or a folder of someone else's is refused. `what`, `whats` and `holding` word
    the refusals (a run directory holding a run; capture vllm-matrix: a matrix root holding a matrix)."""
    if out.is_symlink():
        # --force removes the folder; through a link it would remove what the link points to.
        raise KvtraceError(f"--out {out} is a symbolic link (to {os.readlink(out)}): name the {what} itself")
    if out.exists() and not out.is_dir():
        raise KvtraceError(f"--out {out} is a file, not a directory: choose another --out")
    try:
        if out.exists() and any(out.iterdir()):
            # Checked before --force, so that the message never suggests a --force that would be refused.
            if not owned(out):
                raise KvtraceError(f"{out} is not empty and holds no kvtrace {marker}: kvtrace replaces only its "
                                   f"own {whats}, choose another --out")
            if not force:
                raise KvtraceError(f"{out} already holds {holding}: pass --force to replace it, or choose another "
                                   "--out")
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KvtraceError(f"cannot prepare --out {out}: {error.strerror or error}; choose a folder you can "
                           "write to") from None


# The FlashInfer workload under nsys runs for minutes; one still running after this has hung.
PROFILE_LIMIT_S = 3 * 3600.0


def gpu_inventory() -> list[dict]:
    """What nvidia-smi says about the GPUs (empty when there is none or no driver)."""
    fields = "name,compute_cap,driver_version,memory.total,uuid"
    try:
        result = kvtrace.nsys.run_step(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                       "nvidia-smi", 30)
    except (OSError, kvtrace.nsys.TimedOut):
        return []
    if result.returncode != 0:
        return []
    keys = fields.split(",")
    return [dict(zip(keys, (v.strip() for v in line.split(","))))
            for line in result.stdout.splitlines() if line.strip()]


def host_environment(nsys: str) -> dict:
    return {
        "kvtrace": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "nsys": kvtrace.nsys.nsys_version(nsys),
        "nsys_path": nsys,
        "gpus": gpu_inventory(),
    }


@dataclass
class ArmResult:
    name: str  # the run's name: the arm's, or ARM.rK with repeats
    status: RunStatus = RunStatus.NOT_RUN
    error: str | None = None
    sqlite: str | None = None
    report: str | None = None
    log: str | None = None
    workload: dict | None = None
    commands: list[list[str]] = field(default_factory=list)
    seconds: float | None = None
    arm: str = ""  # the arm this run recorded (the run's name when empty)
    repeat: int = 1

    def __post_init__(self) -> None:
        self.arm = self.arm or self.name


def run_arm(name: str, out: Path, nsys: str, workload: list[str], *, env: dict | None = None,
            workload_result: Path | None = None, arm_name: str = "", repeat: int = 1) -> ArmResult:
    """Profile one run and export it. Failures are recorded, not raised, so the other runs still happen."""
    arm = ArmResult(name=name, log=f"{name}.log", arm=arm_name, repeat=repeat)
    report = out / f"{name}.nsys-rep"
    command = profile_command(nsys, out / name, workload)
    arm.commands.append(command)
    started = time.monotonic()
    with open(out / arm.log, "w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        try:
            result = kvtrace.nsys.run_step(command, f"the {name} workload under nsys profile", PROFILE_LIMIT_S,
                                           stdout=log, stderr=subprocess.STDOUT, env=env, own_session=False)
            if result.returncode != 0:
                raise RuntimeError(f"workload under nsys exited with code {result.returncode}")
            arm.commands += export_run(out, name, nsys, log, no_report="did the workload call cudaProfilerStart?")
            arm.sqlite = f"{name}.sqlite"
            arm.status = RunStatus.OK
        except (OSError, RuntimeError) as failure:
            arm.status, arm.error = RunStatus.FAILED, f"{failure} (see {arm.log})"
    arm.seconds = round(time.monotonic() - started, 1)
    if report.exists():
        arm.report = report.name  # kept even when a later step failed: it may still open in the GUI
    if workload_result is not None and workload_result.exists():
        try:
            arm.workload = json.loads(workload_result.read_text())
        except ValueError as error:
            arm.status = RunStatus.FAILED
            arm.error = (arm.error + "; " if arm.error else "") + f"{workload_result.name} is not valid JSON ({error})"
    return arm


def manifest(engine: str, environment: dict, settings: dict, arms: list[ArmResult]) -> dict:
    return {
        MARKER: SCHEMA,
        "engine": engine,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment,
        "settings": settings,
        "arms": {arm.name: asdict(arm) for arm in arms},
    }
