"""Every shipped fixture's report, diff and matrix, as markdown and JSON: the outputs that tests over "every
shipped output" read (byte-stability, no impossible interval, no repr text in a sentence), and that tests of one
output read instead of running the same command again.

Each output is written once per test session into one folder that every xdist worker shares: the first worker to
ask for it runs the command (in its process, as run_kvtrace does) under a lock, and keeps the exit code, standard
output and standard error beside it; the others wait for it and read. Nothing there is written again: a test that
wants to change an output writes its own."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from conftest import (COUNTERFACTUAL, MATRIX, MATRIX_RUNS, NSYS2025_DIR, PACKED_RUNS, RECORDED_REPORT, SERVE_RUNS,
                      VLLM033_8B_RUNS, VLLM033_RUNS, _run_in_process)

FORMATS = {"markdown": "md", "json": "json"}
SERVE_SCENARIOS = sorted({name.rsplit("-", 1)[0] for name in SERVE_RUNS})


def commands() -> dict[str, list]:
    """name -> kvtrace arguments (less --format and -o), one per output kind and input."""
    found: dict[str, list] = {}
    runs = {**PACKED_RUNS, **{f"vllm033-{name}": path for name, path in VLLM033_RUNS.items()},
            **{f"vllm033-8b-{name}": path for name, path in VLLM033_8B_RUNS.items()},
            **{f"vllm033-h100-matrix-{name}": path for name, path in MATRIX_RUNS.items()}}
    for name, path in runs.items():
        if name != "fi-h200-sm90-nsys2023":  # its manifest records both arms as failed (nsys wrote no report)
            found[f"report.{name}"] = ["report", path]
        if (path / "fp8.sqlite").exists() and (path / "nvfp4.sqlite").exists():
            found[f"diff.{name}"] = ["diff", path / "fp8.sqlite", path / "nvfp4.sqlite"]
    for name in ("sweep", "capacity-win"):  # recorded beside fi-h200-sm90, whose exports they name
        found[f"report.recorded-{name}"] = ["report", RECORDED_REPORT / name, "--exports-from", NSYS2025_DIR]
    for scenario in SERVE_SCENARIOS:  # one arm per run directory
        auto, fp8 = SERVE_RUNS[f"{scenario}-auto"], SERVE_RUNS[f"{scenario}-fp8"]
        found[f"report.serve-{scenario}"] = ["report", auto, fp8]
        found[f"diff.serve-{scenario}"] = ["diff", auto / "auto.sqlite", fp8 / "fp8.sqlite"]
    found["matrix.vllm033"] = ["matrix", *VLLM033_RUNS.values()]
    found["matrix.vllm033-8b"] = ["matrix", *VLLM033_8B_RUNS.values()]
    found["matrix.vllm033-h100-matrix"] = ["matrix", MATRIX]
    found["matrix.vllm033-h100-counterfactual"] = ["matrix", COUNTERFACTUAL / "counterfactual"]
    return found


def _patchable() -> tuple:
    """What tests patch that changes an output (the issue-body limit, how many run pairs decide a point)."""
    from kvtrace.analyzer.render import markdown
    from kvtrace.analyzer.stats import serving_intervals

    return markdown.ISSUE_LIMIT, serving_intervals.DECIDING_RUN_PAIRS


@dataclass(frozen=True)
class Output:
    """One output: its file (FOLDER/NAME.md or .json; a whole document too long for an issue is beside it) and what
    the command it came from exited with and printed."""
    path: Path
    code: int
    out: str
    err: str


class ShippedOutputs:
    """The outputs of `commands()` in `folder`, each written on first request (read only after that)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._commands = commands()
        self._unpatched = _patchable()
        (folder / ".results").mkdir(parents=True, exist_ok=True)

    def __call__(self, name: str, fmt: str = "markdown") -> Output:
        """NAME.md (markdown) or NAME.json (json), written now unless it was."""
        with self._locked(name, fmt, wait=True) as held:
            assert held
            return self._written(name, fmt)

    def all(self) -> dict[str, Path]:
        """Every output, file name -> path. Outputs another worker is writing are waited for last, so that two workers
        that both want all of them write different ones."""
        written, later = {}, []
        for name in self._commands:
            for fmt in FORMATS:
                with self._locked(name, fmt, wait=False) as held:
                    if held:
                        written[name, fmt] = self._written(name, fmt)
                    else:
                        later.append((name, fmt))
        for name, fmt in later:
            written[name, fmt] = self(name, fmt)
        for (name, fmt), output in written.items():
            assert output.code == 0, f"{name} ({fmt}): {output.err[-2000:]}"
        return {output.path.name: output.path for output in written.values()}

    @contextmanager
    def _locked(self, name: str, fmt: str, *, wait: bool) -> Iterator[bool]:
        with open(self.folder / ".results" / f"{name}.{FORMATS[fmt]}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True

    def _written(self, name: str, fmt: str) -> Output:
        """The output, written first if no worker has; the caller holds its lock."""
        path = self.folder / f"{name}.{FORMATS[fmt]}"
        result = self.folder / ".results" / f"{path.name}.json"
        if not result.exists():
            assert _patchable() == self._unpatched, "a test's patch is in force: an output shared is kvtrace's own"
            args = [str(a) for a in self._commands[name]] + ["--format", fmt, "-o", str(path)]
            code, out, err = _run_in_process(args, {}, self.folder)
            scratch = result.with_suffix(".partial")
            scratch.write_text(json.dumps({"code": code, "out": out, "err": err}))
            os.replace(scratch, result)
        return Output(path, **json.loads(result.read_text()))
