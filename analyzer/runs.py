"""The inputs of a report: run directories written by `kvtrace capture`, their manifests, and the arms (with all
their runs) that a report compares, checked before any trace is opened."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from kvtrace import files, kv_formats
from kvtrace.errors import KvtraceError
from kvtrace.manifest import Manifest, RunRecord, RunStatus, read_manifest


@dataclass
class RunArm:
    """One side of the report: an arm of a run directory."""

    label: str
    run: str  # the run directory
    arm: str  # the arm's name in its manifest
    engine: str | None
    kv_cache_dtype: str | None  # as the engine names it (vLLM --kv-cache-dtype, FlashInfer kv_format)
    kv_format: str | None  # fp8, nvfp4, bf16 or fp16 (None when unknown)
    scenario: str | None
    mode: str | None
    sqlite: str  # the first run's export
    runs: tuple[str, ...]  # every run's export, in repeat order
    kv_cache_tokens: int | None  # vLLM's "GPU KV cache size: N tokens"
    kv_cache_line: str | None
    versions: dict = field(default_factory=dict)  # torch, CUDA runtime, FlashInfer, vLLM, as the workload recorded
    # The query dtype per phase (prefill, decode) that vLLM's FlashInfer backend resolved, from the run's log.
    query_dtypes: dict = field(default_factory=dict)
    log: str | None = None  # the first run's log, read for query_dtypes (an input: outputs never land on it)
    # A counterfactual arm's engine patch as its manifest records it ({"name", "sha256"}); None for a stock release.
    patch: dict | None = None

    def patch_words(self) -> str | None:
        """"nvfp4-validate-once runs vLLM 0.33.0 and FlashInfer 0.7.2.post1 with the patch validate-once (SHA-256 …)
        loaded in its server: not a stock release", or None for a stock arm."""
        if not self.patch:
            return None
        releases = self.patch.get("releases") or self.engine or "its engine"
        return (f"{self.label} runs {releases} with the patch {self.patch.get('name') or 'unnamed'} (SHA-256 "
                f"{self.patch.get('sha256') or 'not recorded'}) loaded in its server: not a stock release")


@dataclass
class ArmInput:
    run: Path
    manifest: Manifest
    arm: str  # the arm's name, or the run's name when one run of an arm was picked
    runs: tuple[str, ...]  # the names of its runs in the manifest, in repeat order
    left_out: tuple[str, ...] = ()  # its runs left out because their pair's other run was never run

    @classmethod
    def of(cls, run: Path, manifest: Manifest, name: str) -> ArmInput:
        """An arm by name (all its runs) or one run by its name (ARM.rK)."""
        by_arm = manifest.runs_by_arm
        if name in by_arm:
            return cls(run, manifest, name, tuple(by_arm[name]))
        if name in manifest.runs:
            return cls(run, manifest, name, (name,))
        raise KvtraceError(f"{run} has no arm {name!r} (it has {', '.join(by_arm)}): check --arm")

    @property
    def record(self) -> RunRecord:
        """The first run's record (what every run of the arm shares: format, workload, serving points)."""
        return self.manifest.runs[self.runs[0]]


def _locate(path: Path) -> tuple[Path, Manifest, str | None]:
    """A run directory, its manifest.json or an ARM.manifest.json in it, or RUNDIR/ARM (an arm or a run by name)."""
    if path.is_file() and path.name.endswith("manifest.json"):
        manifest = read_manifest(path)
        arms = list(manifest.runs_by_arm)
        return path.parent, manifest, arms[0] if path.name != "manifest.json" and len(arms) == 1 else None
    if not path.exists() and (path.parent / "manifest.json").is_file():
        manifest = read_manifest(path.parent)
        if path.name in manifest.runs_by_arm or path.name in manifest.runs:
            return path.parent, manifest, path.name
        raise KvtraceError(f"{path}: no such run directory, and {path.parent} has no arm {path.name!r} (it has "
                           f"{', '.join(manifest.runs_by_arm)}): pass RUNDIR or RUNDIR/ARM")
    if path.exists() and not path.is_dir():
        raise KvtraceError(f"{path} is a file: pass a run directory written by `kvtrace capture` (it holds "
                           "manifest.json), not a trace; `kvtrace diff` compares traces")
    return path, read_manifest(path), None


def resolve_inputs(paths: list[Path], arms: tuple[str, ...] = (),
                   exports_from: tuple[Path, ...] | None = None) -> list[ArmInput]:
    """Baseline and candidate from one run directory (its two arms) or two (one arm each), each with its runs.
    `exports_from`: where else a manifest's exports may lie (the CLI's --exports-from); None, for callers that
    vouch for their manifests, reads them wherever they point."""
    if not 1 <= len(paths) <= 2:
        raise KvtraceError(f"report takes one run directory (compares its two arms) or two (one arm each), "
                           f"got {len(paths)}")
    if len(arms) > 2:
        raise KvtraceError("--arm takes at most two names, baseline first")
    located = [_locate(Path(p)) for p in paths]
    if len(located) == 1:
        run, manifest, named = located[0]
        if named is not None:
            raise KvtraceError(f"{paths[0]} names one arm: give a second run directory or arm to compare it with, "
                               f"e.g. `kvtrace report {run}` compares all of {run}'s arms")
        if len(arms) == 1:
            raise KvtraceError(f"one run directory and one --arm: name two arms, baseline first "
                               f"(--arm {arms[0]} --arm OTHER), or give a second run directory")
        if arms:
            names = list(arms)
        else:
            by_arm = manifest.runs_by_arm
            if len(by_arm) != 2:
                raise KvtraceError(f"{run} holds {len(by_arm)} arm(s) ({', '.join(by_arm) or 'none'}): pick two "
                                   "with --arm BASELINE --arm CANDIDATE")
            names = [manifest.runs[first].arm for first in manifest.widest_first([runs[0] for runs in by_arm.values()])]
        inputs = [ArmInput.of(run, manifest, name) for name in names]
    else:
        inputs = []
        for index, (run, manifest, named) in enumerate(located):
            name = named
            if name is None and arms:
                name = arms[index] if len(arms) == 2 else arms[0]
            if name is None:
                arms_here = list(manifest.runs_by_arm)
                if len(arms_here) != 1:
                    raise KvtraceError(f"{run} holds arms {', '.join(arms_here)}: pick one with --arm NAME "
                                       "(once for both run directories, twice for one each) or pass RUNDIR/ARM")
                name = arms_here[0]
            inputs.append(ArmInput.of(run, manifest, name))
    inputs = _complete_pairs(*inputs)
    for item in inputs:
        _check_arm(item, exports_from)
        check_distinct_recordings(recording_files(item.run, item.manifest, item.runs),
                                  "each run of an arm must be a recording of its own; capture it again")
    base, cand = inputs
    if len(base.runs) != len(cand.runs):
        raise KvtraceError(f"arm {base.arm} has {len(base.runs)} run(s) and arm {cand.arm} {len(cand.runs)}: "
                           "runs pair in repeat order, so both arms need as many; name single runs as RUNDIR/ARM.rK")
    return inputs


def _complete_pairs(base: ArmInput, cand: ArmInput) -> list[ArmInput]:
    """With --repeats, a capture stopped early (its machine taken back, a queue cut short) leaves its last runs "not
    run". Runs pair in repeat order, so the run pairs that both ran are compared and the others left out, each
    named (ArmInput.left_out). A failed run is not left out: why it failed may be the finding (_check_arm)."""
    def unrun(item: ArmInput, name: str) -> bool:
        return item.manifest.runs[name].status == RunStatus.NOT_RUN

    if len(base.runs) != len(cand.runs) or len(base.runs) < 2:
        return [base, cand]
    kept = [(b, c) for b, c in zip(base.runs, cand.runs) if not unrun(base, b) and not unrun(cand, c)]
    if not kept or len(kept) == len(base.runs):
        return [base, cand]
    for item in (base, cand):  # a failed run whose partner was not run is refused as any failed run is
        for name in item.runs:
            if item.manifest.runs[name].status == RunStatus.FAILED:
                _check_arm(replace(item, runs=(name,)), None)
    return [replace(item, runs=tuple(pair[side] for pair in kept),
                    left_out=tuple(name for name in item.runs if name not in {pair[side] for pair in kept}))
            for side, item in enumerate((base, cand))]


def left_out_note(base: ArmInput, cand: ArmInput) -> str | None:
    """What _complete_pairs left out, for the report's notes."""
    if not base.left_out and not cand.left_out:
        return None
    left = [*base.left_out, *cand.left_out]
    unrun = [name for item in (base, cand) for name in item.left_out
             if item.manifest.runs[name].status == RunStatus.NOT_RUN]
    alone = [name for name in left if name not in unrun]
    pairs = len(base.runs)
    text = (f"{', '.join(unrun)} {'was' if len(unrun) == 1 else 'were'} not run (the capture stopped before "
            f"{'it' if len(unrun) == 1 else 'them'}): {pairs} of {pairs + len(base.left_out)} run pairs compared")
    if alone:
        text += (f"; {', '.join(alone)}, left without a pair, {'is' if len(alone) == 1 else 'are'} not in the ratios "
                 f"(`kvtrace report RUNDIR/{base.runs[0] if alone[0] in base.left_out else cand.runs[0]} "
                 f"RUNDIR/{alone[0]}` compares it with its own arm)")
    return text


def _check_arm(item: ArmInput, exports_from: tuple[Path, ...] | None) -> None:
    for name in item.runs:
        record = item.manifest.runs[name]
        if record.status != RunStatus.OK:
            state = "failed" if record.status == RunStatus.FAILED else f"is {record.status}"
            detail = f": {record.error}" if record.error else ""
            raise KvtraceError(f"arm {name} in {item.run} {state}{detail}; capture it again or report on another arm")
        if not record.sqlite:
            raise KvtraceError(f"arm {name} in {item.run} lists no SQLite export: export its report with "
                               "`nsys export --type sqlite` and capture again")
        path = item.run / record.sqlite
        # A run directory is read inside itself: an edited or planted manifest must not send kvtrace to read
        # (or probe the existence of) files elsewhere, through `..`, an absolute path or a link out.
        places = (item.run, *exports_from) if exports_from is not None else None
        if places is not None and not any(path.resolve().is_relative_to(place.resolve()) for place in places):
            raise KvtraceError(f"arm {name} in {item.run} lists its export as {record.sqlite!r}, which leads "
                               "outside the run directory (through .., an absolute path or a link): keep a run's "
                               "exports inside its directory, or name their folder with --exports-from")
        if not path.is_file():
            raise KvtraceError(f"{path}, the export that arm {name} lists, is missing: copy the run directory whole "
                               f"or re-export {name}.nsys-rep with `nsys export --type sqlite`")


def run_arm(item: ArmInput, label: str) -> RunArm:
    arm, manifest = item.record, item.manifest
    try:
        fmt = kv_formats.canonical_format(arm.kv_dtype, manifest.model_dtype)
    except KvtraceError:
        fmt = None
    return RunArm(label=label, run=str(item.run), arm=item.arm, engine=manifest.engine, kv_cache_dtype=arm.kv_dtype,
                  kv_format=fmt, scenario=manifest.scenario, mode=manifest.mode, sqlite=str(item.run / arm.sqlite),
                  runs=tuple(str(item.run / manifest.runs[name].sqlite) for name in item.runs),
                  kv_cache_tokens=arm.kv_cache_tokens, kv_cache_line=arm.kv_cache.get("line"),
                  versions=dict(arm.workload.get("versions") or {}),
                  patch={**{k: arm.patch.get(k) for k in ("name", "sha256")}, "releases": _releases(manifest)}
                  if arm.patch else None,
                  **_log_fields(item, arm.log))


def _releases(manifest: Manifest) -> str | None:
    """"vLLM 0.33.0 and FlashInfer 0.7.2.post1": the engine's releases a patched arm ran, from the capture host's
    packages and the workload's own versions."""
    packages = manifest.packages
    versions = {"vLLM": packages.get("vllm"),
                "FlashInfer": packages.get("flashinfer") or packages.get("flashinfer-python")}
    return " and ".join(f"{name} {version}" for name, version in versions.items() if isinstance(version, str)) or None


# vLLM >= 0.33, vllm/v1/attention/backends/flashinfer.py: "FlashInfer resolved query dtypes: prefill=torch.X,
# decode=torch.Y, ..." once per engine start.
_QUERY_DTYPES = re.compile(r"FlashInfer resolved query dtypes: prefill=torch\.(\w+), decode=torch\.(\w+)")


def recording_files(run: Path, manifest: Manifest, names) -> list[Path]:
    """What makes each of the runs `names` a recording: its export and its points' bench results."""
    found = []
    for name in names:
        record = manifest.runs[name]
        found += [run / record.sqlite] if record.sqlite else []
        found += [run / point["bench_result"] for point in record.points if isinstance(point.get("bench_result"), str)]
    return found


def check_distinct_recordings(paths: list[Path], fix: str) -> None:
    """Refuse recordings counted as independent (the runs of an arm, run directories pooled) where a file of one
    holds the same bytes as another: a repeat or run directory copied is no second recording, and counted as one
    its zero difference would pass for agreement (zero-width intervals, points decided on nothing). The same file
    named twice is one file; only files of the same size are hashed."""
    by_size: dict[int, list[tuple[Path, os.stat_result]]] = {}
    for path in paths:
        try:
            status = path.stat()
        except OSError:
            continue  # its reader says what is wrong with it
        if not stat.S_ISREG(status.st_mode):
            continue  # a FIFO is never opened; its reader refuses it
        same = by_size.setdefault(status.st_size, [])
        if not any(os.path.samestat(status, other) for _, other in same):
            same.append((path, status))
    for same in (group for group in by_size.values() if len(group) > 1):
        digests: dict[str, Path] = {}
        for path, _ in same:
            digest = files.sha256(path)
            if digest in digests:
                raise KvtraceError(f"{path} and {digests[digest]} hold the same bytes: a run is not independent "
                                   f"evidence of itself; {fix}")
            digests[digest] = path


def bare_name(name: str) -> bool:
    """Whether a manifest's name for a file or folder is one name in the run directory itself (no folder, no . or
    ..)."""
    return PurePosixPath(name).name == name and name not in ("", ".", "..")


def run_file(run: Path, name: str, owner: str, what: str) -> Path:
    """A file a manifest names (`owner` lists it as its `what`), refused where it leads outside the run directory:
    an edited or planted manifest, or a link in the run directory, must not send kvtrace to read elsewhere."""
    path = run / name
    if not path.resolve().is_relative_to(run.resolve()):
        raise KvtraceError(f"{owner} in {run} lists its {what} as {name!r}, which leads outside the run directory "
                           f"(through .., an absolute path or a link): keep a run's {what} inside it")
    return path


def _log_fields(item: ArmInput, name: str | None) -> dict:
    """The run's log (inside its run directory, as its exports are) and the query dtypes it names; none without
    a log. A planted manifest cannot send kvtrace to read elsewhere, nor to wait on a FIFO or read /dev/zero."""
    if not name:
        return {}
    log = run_file(item.run, name, f"arm {item.arm}", "log")
    if not log.exists():
        return {"log": None, "query_dtypes": {}}
    text = files.read_small(log, f"log {log}", "keep the capture's own log there, or remove it").decode(errors="replace")
    found = _QUERY_DTYPES.findall(text)
    return {"log": str(log), "query_dtypes": {"prefill": found[-1][0], "decode": found[-1][1]} if found else {}}


def trace_query_dtypes(manifest: Manifest | None, trace: Path) -> tuple[dict, str | None]:
    """For `kvtrace diff`: the query dtypes of the run whose export `trace` is, from the log its run directory's
    manifest lists (as run_arm reads them), and that log's path. ({}, None) when no run of the manifest exported
    the trace, or its log is missing or unreadable: the diff stands without them, as without the manifest."""
    if manifest is None:
        return {}, None
    run = manifest.path.parent
    for name, record in manifest.runs.items():
        if record.sqlite and (run / record.sqlite).resolve() == trace.resolve():
            try:
                found = _log_fields(ArmInput(run, manifest, record.arm, (name,)), record.log)
            except KvtraceError:
                return {}, None
            return found.get("query_dtypes", {}), found.get("log")
    return {}, None
