"""Every shipped fixture's report, diff and matrix, as markdown and JSON: the outputs that tests over "every
shipped output" read (byte-stability, no impossible interval, no repr text in a sentence)."""

from __future__ import annotations

from pathlib import Path

from conftest import (NSYS2025_DIR, PACKED_RUNS, RECORDED_REPORT, SERVE_RUNS, VLLM033_8B_RUNS, VLLM033_RUNS,
                      _run_in_process)

FORMATS = {"markdown": "md", "json": "json"}
SERVE_SCENARIOS = sorted({name.rsplit("-", 1)[0] for name in SERVE_RUNS})


def commands() -> dict[str, list]:
    """name -> kvtrace arguments (less --format and -o), one per output kind and input."""
    found: dict[str, list] = {}
    runs = {**PACKED_RUNS, **{f"vllm033-{name}": path for name, path in VLLM033_RUNS.items()},
            **{f"vllm033-8b-{name}": path for name, path in VLLM033_8B_RUNS.items()}}
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
    return found


def render(folder: Path) -> dict[str, Path]:
    """Write every output into folder; file name -> path. Fails on the first command that does not exit 0."""
    written = {}
    for name, args in commands().items():
        for fmt, suffix in FORMATS.items():
            path = folder / f"{name}.{suffix}"
            code, _, err = _run_in_process([str(a) for a in args] + ["--format", fmt, "-o", str(path)], {}, folder)
            assert code == 0, f"{name} ({fmt}): {err[-2000:]}"
            written[path.name] = path
    return written
