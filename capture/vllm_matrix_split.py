"""A matrix's counterfactual arms in run directories of their own, so that every run directory holds two arms.

`kvtrace capture vllm-matrix --arms fp8,nvfp4,nvfp4:validate-once` records the patched arm beside the stock arms,
in the scenarios it runs (cold prefill, the sweep's low-load points). `kvtrace matrix ROOT` decides between two KV
formats per run directory; a third arm there is refused. So once the matrix is recorded, each patched arm moves to
ROOT/counterfactual/SCENARIO with the stock arm of its KV dtype: that arm's runs of the same rounds, copied, cut to
the patched arm's points (renumbered from 0, files renamed with them). The scenario's own directory keeps the two
stock arms. A copied run is the very measurement the scenario's directory holds (its manifest says so:
`copied_from`); the pair patched/stock of a round was recorded back to back on the same GPU. So ROOT and
ROOT/counterfactual go to separate `kvtrace matrix` calls: together, the stock arm's runs would count twice.

Standard library only.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from kvtrace.capture import runner
from kvtrace.capture.vllm_common import request_order_sha256
from kvtrace.manifest import MANIFEST, CaptureStatus, RunStatus, WindowStatus, capture_status

if TYPE_CHECKING:  # vllm_matrix is imported where it is read, as tidy() reads it
    from kvtrace.capture.vllm_matrix import MatrixRecord

COUNTERFACTUAL = "counterfactual"
CO_RESIDENCE = "checks/co-residence"  # below the root: `kvtrace matrix ROOT` reads one level of run directories


def split(root: Path, scenario: str) -> Path | None:
    """Move the patched arms of ROOT/SCENARIO to ROOT/counterfactual/SCENARIO; returns that directory, or None when
    the scenario ran no patched arm."""
    source = root / scenario
    manifest = json.loads((source / MANIFEST).read_text())
    runs = manifest["arms"]
    patched = {name: run for name, run in runs.items() if run.get("patch")}
    if not patched:
        return None
    dtypes = {run["kv_cache_dtype"] for run in patched.values()}
    stock = {name: run for name, run in runs.items()
             if not run.get("patch") and run.get("kv_cache_dtype") in dtypes}
    indices = sorted({point["index"] for run in patched.values() for point in run["points"]})
    renumber = {old: new for new, old in enumerate(indices)}
    target = root / COUNTERFACTUAL / scenario
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)

    # Copied first and removed from the scenario's directory only once both manifests are written, so that a
    # failure half-way leaves that directory whole.
    moved = {}
    for name, run in {**stock, **patched}.items():
        moved[name] = _renumbered(run, renumber, source, target, name, patched=name in patched)
        log = run.get("log")
        if log and (source / log).is_file() and not (target / log).exists():
            shutil.copy2(source / log, target / log)
    order = [name for name in manifest["settings"].get("order", []) if name in moved]
    settings = {**copy.deepcopy(manifest["settings"]), "order": order,
                "arms": list(dict.fromkeys(run["arm"] for run in moved.values())),
                "points": [manifest["settings"]["points"][i] for i in indices],
                "counterfactual": {"stock_runs_copied_from": f"../../{scenario}", "points_of": scenario,
                                   "point_indices_there": indices}}
    _write(target, manifest, settings, {name: moved[name] for name in order})

    kept = {name: run for name, run in runs.items() if name not in patched}
    settings = {**manifest["settings"], "order": [n for n in manifest["settings"].get("order", []) if n in kept],
                "arms": [arm for arm in manifest["settings"].get("arms", []) if any(r["arm"] == arm for r in kept.values())],
                "patches": {}, "counterfactual_moved_to": f"{COUNTERFACTUAL}/{scenario}"}
    _write(source, manifest, settings, kept)
    for name in patched:
        (source / f"{name}.manifest.json").unlink(missing_ok=True)
        for leftover in source.glob(f"{name}.*"):  # its points' files, copied above; warm-up logs and the like
            if not (target / leftover.name).exists() and not leftover.name.startswith(f"{name}.p"):
                shutil.copy2(leftover, target / leftover.name)
            leftover.unlink()
    kept_logs = {run.get("log") for run in kept.values()}
    for run in patched.values():
        if run.get("log") and run["log"] not in kept_logs:
            (source / run["log"]).unlink(missing_ok=True)
    return target


def _renumbered(run: dict, renumber: dict, source: Path, target: Path, name: str, patched: bool) -> dict:
    """The run's entry for the counterfactual directory: its points at the patched arm's indices, renumbered, and
    their files copied under the new numbers."""
    text = json.dumps(run)
    for old, new in renumber.items():  # file names in the records: "NAME.pOLD." -> "NAME.pNEW."
        text = text.replace(f'"{name}.p{old}.', f'"{name}.p{new}.')
    entry = json.loads(text)
    entry["points"] = [{**point, "index": renumber[point["index"]]} for point in entry["points"]
                       if point["index"] in renumber]
    entry["windows"] = [{**window, "point": renumber[window["point"]]} for window in entry.get("windows", [])
                        if window["point"] in renumber]
    entry["timings"] = [{**timing, "point": renumber[timing["point"]]} for timing in entry.get("timings", [])
                        if timing.get("point") in renumber]
    first = next((w for w in entry["windows"] if w["point"] == 0), None)
    entry["sqlite"] = first["sqlite"] if first and first["status"] == WindowStatus.EXPORTED else None
    hashes = [point["request_order_sha256"] for point in entry["points"]]
    entry["request_order_sha256"] = request_order_sha256(hashes) if hashes else None
    if not patched:
        entry["copied_from"] = f"../../{source.name}/{name}"

    def renamed(file: str) -> str:
        for old, new in renumber.items():
            if file.startswith(f"{name}.p{old}."):
                return file.replace(f"{name}.p{old}.", f"{name}.p{new}.", 1)
        return file

    # The files its kept points' records name (a recording whose one-point scenarios named them without .pN
    # included), their traces and logs, and such a recording's client log.
    files = {value for point in run["points"] if point["index"] in renumber
             for value in (point.get("bench_result"), (point.get("metrics") or {}).get("before"),
                           (point.get("metrics") or {}).get("after"), (point.get("requests") or {}).get("file"))
             if isinstance(value, str)}
    files |= {path.name for old in renumber for path in source.glob(f"{name}.p{old}.*")}
    files |= {f"{name}.bench.log"} if len(renumber) == 1 and (source / f"{name}.bench.log").is_file() else set()
    for file in files:
        if (source / file).is_file():
            shutil.copy2(source / file, target / renamed(file))
    return entry


def tidy(root: Path) -> MatrixRecord:
    """A matrix recorded before its run directories were kept to two arms each: its co-residence check moves to
    checks/co-residence and its patched arms to counterfactual/SCENARIO. Returns the updated matrix.json."""
    from kvtrace.capture.vllm_matrix import MATRIX, MatrixRecord

    matrix = json.loads((root / MATRIX).read_text())
    check = matrix.get("co_residence_check")
    if check and (root / check / MANIFEST).is_file() and check != CO_RESIDENCE:
        (root / CO_RESIDENCE).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(root / check, root / CO_RESIDENCE)
        matrix["co_residence_check"] = CO_RESIDENCE
    matrix["counterfactual"] = sorted(set(matrix.get("counterfactual") or []) | {
        str(moved.relative_to(root)) for scenario in matrix["scenarios"] if (moved := split(root, scenario))})
    runner.write_json_atomic(root / MATRIX, matrix)
    return MatrixRecord.of(matrix)


def _write(folder: Path, manifest: dict, settings: dict, runs: dict) -> None:
    hashes = {run["request_order_sha256"] for run in runs.values() if run.get("request_order_sha256")}
    whole = {**manifest, "settings": settings, "arms": runs,
             "status": capture_status([run["status"] for run in runs.values()],
                                      interrupted=manifest.get("status") == CaptureStatus.INTERRUPTED),
             "request_order_matched": (len(hashes) == 1) if len(runs) > 1 and hashes else None}
    runner.write_json_atomic(folder / MANIFEST, whole)
    for name, run in runs.items():  # as the engine writes them (vllm_engine._write_manifests): runs that ran
        if run["status"] != RunStatus.NOT_RUN:
            status = capture_status([run["status"]], interrupted=False)
            runner.write_json_atomic(folder / f"{name}.manifest.json", {**whole, "arms": {name: run}, "status": status})


if __name__ == "__main__":
    import sys

    for argument in sys.argv[1:]:
        done = tidy(Path(argument))
        print(f"{argument}: co-residence check in {done.co_residence_check}; counterfactual run directories: "
              f"{', '.join(done.counterfactual) or 'none'}")

