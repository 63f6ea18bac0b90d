"""Hostile input, round 3 (issue 35): serving numbers from run directories, text in plots, Parquet folders, the
export cache of .nsys-rep reports, `capture import`, the process's own environment, and text that stays active.
tests/test_hostile_input.py holds round 1 and the helpers, tests/test_hostile_input_round2.py round 2.

Every CLI run goes through `kv` (no traceback, the inputs on the command line unchanged); every hostile input is
a copy of a real fixture edited in tmp_path. docs/reliability.md has a row per kind.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from pathlib import Path
from xml.etree import ElementTree

import pytest

from conftest import SERVE_RUNS
from test_bad_input import assert_one_line_error
from test_hostile_input import kv  # noqa: F401 (a fixture)
from test_hostile_input_round2 import run_copy


def serve_pair(tmp_path: Path, scenario: str = "cold-prefill", edit=None) -> list[Path]:
    """Copies of a real serve pair (auto, fp8); `edit(arm, manifest)` changes their manifests."""
    runs = []
    for arm in ("auto", "fp8"):
        run = tmp_path / SERVE_RUNS[f"{scenario}-{arm}"].name
        shutil.copytree(SERVE_RUNS[f"{scenario}-{arm}"], run)
        run.chmod(0o755)
        if edit:
            path = run / "manifest.json"
            data = json.loads(path.read_text())
            edit(arm, data)
            path.chmod(0o644)
            path.write_text(json.dumps(data, allow_nan=True))
        runs.append(run)
    return runs


# ==== 1. serving numbers are checked like trace columns ===========================================================

def _point(data: dict, arm: str) -> dict:
    return data["arms"][arm]["points"][0]


SERVING_VALUES = {
    "nan-ttft": (lambda p: p["bench"].update(p50_ttft_ms=float("nan")), "points[0].bench.p50_ttft_ms"),
    "inf-throughput": (lambda p: p["bench"].update(output_throughput=float("inf")),
                       "points[0].bench.output_throughput"),
    "negative-throughput": (lambda p: p["bench"].update(input_throughput=-5.0), "points[0].bench.input_throughput"),
    "negative-tokens": (lambda p: p["bench"].update(total_input_tokens=-16384), "points[0].bench.total_input_tokens"),
    "string-ttft": (lambda p: p["bench"].update(mean_ttft_ms="fast"), "points[0].bench.mean_ttft_ms"),
    "negative-counter": (lambda p: p["metrics"]["deltas"]["counters"].update(
        {"vllm:prefix_cache_hits_total": -1000.0}), "points[0].metrics.deltas.counters.vllm:prefix_cache_hits_total"),
    "nan-histogram": (lambda p: p["metrics"]["deltas"]["histograms"]["vllm:request_prompt_tokens"].update(
        sum=float("nan")), "points[0].metrics.deltas.histograms.vllm:request_prompt_tokens.sum"),
    "inf-peak": (lambda p: p["metrics"]["peaks"].update({"vllm:kv_cache_usage_perc": float("inf")}),
                 "points[0].metrics.peaks.vllm:kv_cache_usage_perc"),
}


@pytest.mark.parametrize("kind", sorted(SERVING_VALUES))
@pytest.mark.parametrize("command", ["matrix", "report"])
def test_serving_numbers_that_are_not_finite_and_positive_are_one_line(kind, command, tmp_path, kv):
    edit, where = SERVING_VALUES[kind]
    runs = serve_pair(tmp_path, edit=lambda arm, data: edit(_point(data, arm)) if arm == "fp8" else None)
    code, out, err = kv(command, *runs, "--format", "json", "-q")
    assert_one_line_error(code, out, err, str(runs[1] / "manifest.json"),
                          re.escape(f"arms.fp8.{where} is not a number of 0 or more"),
                          r"capture the run again")


def test_offline_worker_counts_are_checked_too(tmp_path, kv):
    from conftest import VLLM033_RUNS

    run = tmp_path / "offline"
    shutil.copytree(VLLM033_RUNS["offline-cold-prefill"], run)
    run.chmod(0o755)
    path = run / "manifest.json"
    data = json.loads(path.read_text())
    data["arms"]["fp8"]["points"][0]["tokens_in"] = -1
    path.chmod(0o644)
    path.write_text(json.dumps(data))
    code, out, err = kv("report", run, "--format", "json")
    assert_one_line_error(code, out, err, str(path), r"arms.fp8.points\[0\].tokens_in is not a number of 0 or more")


# ==== 2. plots draw any text as written, and never into an input run directory ====================================

MATH = "$\\undefinedcommand{x}^$ $x_"  # matplotlib's mathtext fails to parse this


def _svg_texts(folder: Path) -> list[str]:
    texts = []
    for svg in sorted(folder.glob("*.svg")):
        root = ElementTree.parse(svg).getroot()  # raises on text that is not well-formed XML
        texts += ["".join(node.itertext()) for node in root.iter("{http://www.w3.org/2000/svg}text")]
    return texts


def test_report_plots_draw_mathtext_and_control_characters_as_written(tmp_path, kv):
    run = run_copy(tmp_path)
    for arm in ("fp8", "nvfp4"):
        with sqlite3.connect(run / f"{arm}.sqlite") as conn:
            conn.execute("UPDATE TARGET_INFO_GPU SET name = ?", (f"NVIDIA {MATH} \x1b[2J\x07\x00",))
        conn.close()
    plots = tmp_path / "plots"
    code, out, err = kv("report", run, "--label", f"fp8 {MATH}", "--label", "nvfp4 $\\", "--plots", plots,
                        "--plot-format", "svg", "-o", tmp_path / "report.md")
    assert code == 0, err
    drawn = "\n".join(_svg_texts(plots))
    assert f"NVIDIA {MATH} \\x1b[2J\\x07\\x00" in drawn and f"fp8 {MATH}" in drawn
    code, out, err = kv("report", run, "--label", MATH, "--label", "b", "--plots", tmp_path / "png")
    assert code == 0, err
    assert (tmp_path / "png" / "summary.png").read_bytes()[:4] == b"\x89PNG"


def test_matrix_plots_draw_a_mathtext_scenario_name_as_written(tmp_path, kv):
    def edit(arm, data):
        data["settings"]["scenario"] = f"sweep {MATH}\x1b"

    runs = serve_pair(tmp_path, "sweep", edit)
    code, out, err = kv("matrix", *runs, "--plots", tmp_path / "plots", "--plot-format", "svg", "-q")
    assert code == 0, err
    assert any(f"sweep {MATH}\\x1b (serve)" in text for text in _svg_texts(tmp_path / "plots"))


@pytest.mark.parametrize("where", ["run-directory", "inside-it"])
@pytest.mark.parametrize("command", ["matrix", "report"])
def test_plots_never_go_into_an_input_run_directory(where, command, tmp_path, kv):
    runs = serve_pair(tmp_path, "sweep")
    target = runs[0] if where == "run-directory" else runs[0] / "plots"
    before = sorted(p.name for p in runs[0].iterdir())
    code, out, err = kv(command, *runs, "--plots", target, "-q")
    assert_one_line_error(code, out, err, f"--plots {target}", r"never writes among its inputs")
    assert sorted(p.name for p in runs[0].iterdir()) == before
