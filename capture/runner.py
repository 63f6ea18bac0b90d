"""Shared by every capture engine: run directories, nsys command lines, SQLite export, manifests.

Standard library only, so that it runs on a bare GPU box.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtrace import __version__, files
from kvtrace.errors import KvtraceError

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1

# Nsight Systems installs nsys in different places: a standalone install, the copy inside Nsight Compute
# (the H200 image), or a distribution package.
_NSYS_GLOBS = (
    "/opt/nvidia/nsight-systems/*/bin/nsys",
    "/opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys",
    "/usr/local/cuda/bin/nsys",
)


def find_nsys(explicit: str | None = None) -> str:
    if explicit and not os.access(explicit, os.X_OK):
        raise KvtraceError(f"--nsys {explicit} is not an executable file: point it at the nsys binary")
    candidates = [explicit, os.environ.get("NSYS"), shutil.which("nsys")]
    candidates += sorted((p for g in _NSYS_GLOBS for p in glob.glob(g)), reverse=True)
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise KvtraceError("nsys (Nsight Systems CLI) not found: install Nsight Systems, put nsys on PATH "
                       "or set NSYS=/path/to/nsys")


def nsys_version(nsys: str) -> str:
    result = subprocess.run([nsys, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.strip() or result.stderr.strip()


def profile_command(nsys: str, report: Path, workload: list[str], *, extra: tuple[str, ...] = ()) -> list[str]:
    """nsys profile over a workload that opens its own measured region with cudaProfilerStart/Stop.

    `--cuda-graph-trace=node` keeps one row per kernel inside CUDA graphs (decode in serving stacks);
    the capture range keeps JIT and warm-up out of the trace.
    """
    return [nsys, "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none",
            "--cuda-graph-trace=node", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
            *extra, "--force-overwrite=true", f"--output={report}", *workload]


def export_sqlite(nsys: str, report: Path, sqlite_path: Path, log) -> None:
    """Export next to the report; the SQLite file appears only once the export succeeded."""
    partial = sqlite_path.with_name(sqlite_path.name + ".partial")
    command = [nsys, "export", "--type=sqlite", "--force-overwrite=true", f"--output={partial}", str(report)]
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0 or not partial.exists():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"nsys export failed with exit code {result.returncode}")
    os.replace(partial, sqlite_path)


def write_json_atomic(path: Path, data: dict) -> None:
    """Serialised first, so that data that is not JSON leaves the previous file as it was."""
    files.write(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def _is_kvtrace_run(out: Path) -> bool:
    """A folder with a manifest.json that kvtrace wrote (not merely any manifest.json)."""
    try:
        data = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "kvtrace_manifest" in data


def prepare_run_dir(out: Path, force: bool) -> None:
    if out.is_symlink():
        # --force removes the run directory; through a link it would remove what the link points to.
        raise KvtraceError(f"--out {out} is a symbolic link (to {os.readlink(out)}): name the run directory itself")
    if out.exists() and not out.is_dir():
        raise KvtraceError(f"--out {out} is a file, not a directory: choose another --out")
    try:
        if out.exists() and any(out.iterdir()):
            # Checked before --force, so that the message never suggests a --force that would be refused.
            if not _is_kvtrace_run(out):
                raise KvtraceError(f"{out} is not empty and has no kvtrace {MANIFEST}: kvtrace replaces only its "
                                   "own run directories, choose another --out")
            if not force:
                raise KvtraceError(f"{out} already holds a run: pass --force to replace it, or choose another --out")
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KvtraceError(f"cannot prepare --out {out}: {error.strerror or error}; choose a folder you can "
                           "write to") from None


def gpu_inventory() -> list[dict]:
    """What nvidia-smi says about the GPUs (empty when there is none or no driver)."""
    fields = "name,compute_cap,driver_version,memory.total,uuid"
    try:
        result = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=30, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
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
        "nsys": nsys_version(nsys),
        "nsys_path": nsys,
        "gpus": gpu_inventory(),
    }


@dataclass
class ArmResult:
    name: str
    status: str = "not run"  # "ok" or "failed"
    error: str | None = None
    sqlite: str | None = None
    report: str | None = None
    log: str | None = None
    workload: dict | None = None
    commands: list[list[str]] = field(default_factory=list)
    seconds: float | None = None


def run_arm(name: str, out: Path, nsys: str, workload: list[str], *, env: dict | None = None,
            workload_result: Path | None = None) -> ArmResult:
    """Profile one arm and export it. Failures are recorded, not raised, so the other arm still runs."""
    arm = ArmResult(name=name, log=f"{name}.log")
    report = out / f"{name}.nsys-rep"
    sqlite_path = out / f"{name}.sqlite"
    command = profile_command(nsys, out / name, workload)
    arm.commands.append(command)
    started = time.monotonic()
    with open(out / arm.log, "w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        try:
            result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"workload under nsys exited with code {result.returncode}")
            if not report.exists():
                raw = report.with_suffix(".qdstrm")
                if raw.exists():
                    # An nsys without its host importer (e.g. a bare target install) stops at the raw file.
                    raise RuntimeError(f"nsys left {raw.name} but no report because its importer is missing: "
                                       f"run QdstrmImporter -i {raw.name} from the same Nsight Systems "
                                       "version, then nsys export --type sqlite")
                raise RuntimeError("nsys wrote no report: did the workload call cudaProfilerStart?")
            export_sqlite(nsys, report, sqlite_path, log)
            arm.commands.append([nsys, "export", "--type=sqlite", f"--output={sqlite_path.name}", report.name])
            arm.sqlite = sqlite_path.name
            arm.status = "ok"
        except (OSError, RuntimeError) as failure:
            arm.status, arm.error = "failed", f"{failure} (see {arm.log})"
    arm.seconds = round(time.monotonic() - started, 1)
    if report.exists():
        arm.report = report.name  # kept even when a later step failed: it may still open in the GUI
    if workload_result is not None and workload_result.exists():
        try:
            arm.workload = json.loads(workload_result.read_text())
        except ValueError as error:
            arm.status = "failed"
            arm.error = (arm.error + "; " if arm.error else "") + f"{workload_result.name} is not valid JSON ({error})"
    return arm


def manifest(engine: str, environment: dict, settings: dict, arms: list[ArmResult]) -> dict:
    return {
        "kvtrace_manifest": MANIFEST_SCHEMA,
        "engine": engine,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment,
        "settings": settings,
        "arms": {arm.name: asdict(arm) for arm in arms},
    }
