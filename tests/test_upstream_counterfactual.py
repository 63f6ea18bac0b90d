"""The upstream draft of the host-sync finding over a scenario of the first H100 capacity matrix
(fixtures/vllm033-h100-counterfactual): the counterfactual arm lives in the root's counterfactual/SCENARIO, beside
copies of the same rounds' stock NVFP4 runs, and the draft finds it there. Every number is checked against the bench
client's own per-request times."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import COUNTERFACTUAL, REPO, reading_stalled_timings

PATCHED = "nvfp4-validate-once"
SWEEP = COUNTERFACTUAL / "sweep"


def _ttfts(run: Path, arm: str, point: int) -> list[float]:
    """Every request's TTFT of an arm at a point, over its runs (the bench client's --save-detailed lists)."""
    manifest = json.loads((run / "manifest.json").read_text())
    values = []
    for name, record in manifest["arms"].items():
        if record["arm"] == arm:
            values += json.loads((run / f"{name}.p{point}.bench.json").read_text())["ttfts"]
    return values


def _draft(folder: Path) -> str:
    from kvtrace.cli import main

    out = folder / "flashinfer.md"
    assert main(["report", str(SWEEP), "--upstream", "flashinfer", "-o", str(out)]) in (0, None)
    return out.read_text()


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return _draft(tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def draft_of_stalled_timings(tmp_path_factory):
    """The draft as it would read if the sweep's timings held no stall (conftest.reading_stalled_timings)."""
    with reading_stalled_timings():
        return _draft(tmp_path_factory.mktemp("draft-stalled"))


def test_the_draft_finds_the_matrix_counterfactual_and_names_its_patch(draft):
    counterfactual = COUNTERFACTUAL / "counterfactual" / "sweep"
    manifest = json.loads((counterfactual / "manifest.json").read_text())
    patches = {json.dumps(r["patch"], sort_keys=True) for r in manifest["arms"].values() if r["arm"] == PATCHED}
    (patch,) = [json.loads(p) for p in patches]
    shipped = hashlib.sha256((REPO / patch["file"]).read_bytes()).hexdigest()
    assert patch["sha256"] == shipped  # the arm ran the patch this checkout ships
    assert f"arm `{PATCHED}`" in draft and f"SHA-256 `{shipped}`" in draft and "not a stock release" in draft
    assert "not measured" not in draft.split("**With the check once per scale tensor**")[1].split("**The call alone**")[0]


def test_the_counterfactual_ttft_whose_windows_closed_inside_the_traffic_is_not_comparable(draft):
    """The sweep's windows closed inside its timed traffic (tests/test_window_stall.py): the draft gives no ratio
    there, in its answer, its TTFT table or the counterfactual's."""
    counterfactual = COUNTERFACTUAL / "counterfactual" / "sweep"
    points = json.loads((counterfactual / "manifest.json").read_text())["settings"]["points"]
    section = draft.split("**With the check once per scale tensor**")[1].split("###")[0]
    rows = re.findall(r"^\| `([^`]+)` \| not comparable: [^|]* \| not comparable: ", section, flags=re.M)
    assert rows == points
    answer = next(line for line in draft.splitlines() if line.startswith("**In short:**"))
    assert "×" not in answer.split("against stock NVFP4:")[1] and "not comparable at" in answer
    table = draft.split("Time to first token, NVFP4 / FP8")[1].split("**With the check")[0]
    assert "×" not in table and table.count("not comparable") == 4


def test_the_counterfactual_ratios_are_the_bench_clients_own(draft_of_stalled_timings):
    """Patched against stock NVFP4 and against FP8, at each point the patched arm ran: the mean TTFT over every
    request of every run, patched over the other (each run holds as many requests)."""
    counterfactual = COUNTERFACTUAL / "counterfactual" / "sweep"
    points = json.loads((counterfactual / "manifest.json").read_text())["settings"]["points"]
    section = draft_of_stalled_timings.split("**With the check once per scale tensor**")[1].split("###")[0]
    rows = re.findall(r"^\| `([^`]+)` \| ([0-9.]+)× \[[^|]*\| ([0-9.]+)× \[", section, flags=re.M)
    assert [row[0] for row in rows] == points
    sweep_points = json.loads((SWEEP / "manifest.json").read_text())["settings"]["points"]
    for index, (point, against_stock, against_fp8) in enumerate(rows):
        patched = _ttfts(counterfactual, PATCHED, index)
        stock = _ttfts(counterfactual, "nvfp4", index)
        fp8 = _ttfts(SWEEP, "fp8", sweep_points.index(point))
        mean = lambda values: sum(values) / len(values)  # noqa: E731
        assert against_stock == f"{mean(patched) / mean(stock):.3f}"
        assert against_fp8 == f"{mean(patched) / mean(fp8):.3f}"


def test_a_patched_arm_picked_for_the_draft_is_refused_in_one_line(run_kvtrace, tmp_path):
    """The draft is of the stock arms; picking the counterfactual as either side says so (exit 2, one line)."""
    counterfactual = COUNTERFACTUAL / "counterfactual" / "sweep"
    code, out, err = run_kvtrace("report", counterfactual, "--arm", "nvfp4", "--arm", PATCHED, "--upstream", "flashinfer",
                                 "-o", tmp_path / "draft.md")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"arm {PATCHED} is the counterfactual" in err and not (tmp_path / "draft.md").exists()


def test_a_matrix_root_named_elsewhere_in_the_manifest_is_not_followed(tmp_path):
    """Only the layout the capture writes is searched: a scenario whose manifest names another root (here "/") does not
    send the draft looking for a counterfactual there, so the draft says none was measured."""
    from kvtrace.cli import main

    root = tmp_path / "root"
    shutil.copytree(SWEEP, root / "sweep")
    shutil.copytree(COUNTERFACTUAL / "counterfactual", root / "counterfactual")
    path = root / "sweep" / "manifest.json"
    path.chmod(0o644)
    data = json.loads(path.read_text())
    data["settings"]["matrix"]["root"] = "/"
    path.write_text(json.dumps(data))
    out = tmp_path / "draft.md"
    assert main(["report", str(root / "sweep"), "--upstream", "flashinfer", "-o", str(out)]) in (0, None)
    section = out.read_text().split("**With the check once per scale tensor**")
    assert len(section) == 1 and "not measured" in out.read_text()
