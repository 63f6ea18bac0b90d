"""Every shipped fixture's outputs, one file per command and format, for checking that a refactoring changes none.

    python tests/snapshot_outputs.py OUT [NAME_PART ...]

writes into OUT what `report`, `diff`, `summary`, `capacity` and `matrix` print (terminal at 200 columns, markdown,
JSON, CSV) for every run directory tests/conftest.py unpacks, each with its exit code and standard error; with
NAME_PART, only the outputs whose name holds one. Run it before and after a change (a minute and a half on one core)
and compare the two folders with `diff -r`: a pure move leaves them byte-identical.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conftest  # noqa: E402 - the fixtures' unpacked folders

FORMATS = ("table", "markdown", "json", "csv")


def run_directories() -> dict[str, Path]:
    runs = {f"serve-{name}": run for name, run in conftest.SERVE_RUNS.items()}
    runs.update({f"v033-{name}": run for name, run in conftest.VLLM033_RUNS.items()})
    runs.update({f"v033-8b-{name}": run for name, run in conftest.VLLM033_8B_RUNS.items()})
    runs.update(conftest.PACKED_RUNS)
    runs.update({f"recorded-{run.name}": run for run in sorted(conftest.RECORDED_REPORT.iterdir()) if run.is_dir()})
    runs["torch-h200"] = conftest.TORCH_H200
    runs["torch-h100x2"] = conftest.TORCH_H100X2
    return runs


def commands() -> list[tuple[str, list]]:
    """(output name, kvtrace arguments) for every output."""
    found = []
    for name, run in run_directories().items():
        found += [(f"report.{name}.{fmt}", ["report", run, "--format", fmt]) for fmt in FORMATS]
        exports = sorted(run.glob("*.sqlite"))
        pair = (run / "fp8.sqlite", run / "nvfp4.sqlite") if (run / "fp8.sqlite").exists() else \
            tuple(exports) if len(exports) == 2 else None
        if pair:
            found += [(f"diff.{name}.{fmt}", ["diff", *pair, "--format", fmt]) for fmt in FORMATS]
            found += [(f"summary.{name}.{fmt}", ["summary", pair[1], "--format", fmt]) for fmt in ("table", "json")]
        found += [(f"capacity.{name}.{fmt}", ["capacity", run, "--format", fmt]) for fmt in FORMATS]
    for name, runs in (("8b", conftest.VLLM033_8B_RUNS), ("v033", conftest.VLLM033_RUNS)):
        found += [(f"matrix.{name}.{fmt}", ["matrix", *(runs[k] for k in sorted(runs)), "--format", fmt])
                  for fmt in FORMATS]
    return found


def main(out: Path, parts: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {"COLUMNS": "200", "KVTRACE_CACHE_DIR": os.environ.get("KVTRACE_CACHE_DIR") or "/tmp/kvtrace-snapshot-cache"}
    for name, args in commands():
        if parts and not any(part in name for part in parts):
            continue
        started = time.time()
        code, stdout, stderr = conftest._run_in_process([str(a) for a in args], env, Path.cwd())
        (out / name).write_text(f"exit {code}\n{stdout}\n--stderr--\n{stderr}")
        print(f"{time.time() - started:5.1f}s {name} exit {code}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
