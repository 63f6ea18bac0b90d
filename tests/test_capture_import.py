"""`kvtrace capture import RUNDIR`: runs whose report import or export failed, taken up afterwards.

- On the real vLLM 0.33 runs of fixtures/vllm033-h200 (fixtures/README.md): their manifests keep, under
  "import", what the H200 recorded for the runs whose import failed there. Put back as recorded (status
  "failed", no export listed) with the hand export beside it, the command makes of each run directory the
  manifest that was committed, and it refuses a hand export that is not a complete nsys export.
- The .qdstrm path through the stand-in nsys of test_capture_flashinfer and a stand-in QdstrmImporter
  beside it (a small executable that writes BASE.nsys-rep from `-i BASE.qdstrm`, or fails as the H200's did).

No timing assertions.
"""

from __future__ import annotations

import json
import shutil
import stat
import sys
from pathlib import Path

import pytest

from conftest import NSYS2025_DIR, VLLM033_RUNS, sha256
from kvtrace.capture import import_run, runner
from kvtrace.manifest import MANIFEST
from test_capture_flashinfer import exits_workload, nsys_calls, one_error_line, stand_in  # noqa: F401

# What the H200's importer said on every failed run (libdw.so.1 had gone from its library path).
H200_IMPORTER_ERROR = ("error while loading shared libraries: libdw.so.1: cannot open shared object file: "
                       "No such file or directory")

STAND_IN_IMPORTER = r'''#!{python}
"""Stand-in QdstrmImporter: `-i BASE.qdstrm` writes BASE.nsys-rep, unless FAKE_IMPORTER=fail."""
import os, sys
from pathlib import Path
raw = Path(sys.argv[sys.argv.index("-i") + 1])
if os.environ.get("FAKE_IMPORTER") == "fail":
    print(sys.argv[0] + ": {error}")
    sys.exit(127)
raw.with_suffix(".nsys-rep").write_bytes(b"stand-in report\n")
print('Saved report file to "' + str(raw.with_suffix(".nsys-rep")) + '"')
'''


def as_recorded(run: Path, target: Path) -> Path:
    """A writable copy of a committed run directory with every imported run's entry put back as the
    capture recorded it (the copy's exports stay: they are the hand exports)."""
    shutil.copytree(run, target)
    for path in target.iterdir():
        path.chmod(0o644)
    for path in [target / MANIFEST, *target.glob("*.manifest.json")]:
        data = json.loads(path.read_text())
        for entry in data["arms"].values():
            done = entry.pop("import", None)
            if done:
                entry.update(status=done["original"]["status"], error=done["original"]["error"], sqlite=None)
        if "imports" in data:
            data["status"] = data.pop("imports")[0]["status_before"]
        elif path.name != MANIFEST and entry["status"] == "failed":
            data["status"] = "failed"
        path.write_text(json.dumps(data, indent=2) + "\n")
    return target


def without_stamps(data: dict) -> dict:
    """What is the same for the same run whenever it is imported: not the time, nor the export's hash (the
    committed export is the cut of the one imported on the H200)."""
    for entry in data["arms"].values():
        entry.get("import", {}).pop("utc", None)
        entry.get("import", {}).pop("sqlite", None)
    for record in data.get("imports", []):
        record.pop("utc")
    return data


IMPORTED = {"offline-cold-prefill": ["fp8"], "offline-decode-heavy": ["fp8", "nvfp4"],
            "serve-prefix-reuse": ["nvfp4"]}


@pytest.mark.parametrize("name", sorted(IMPORTED))
def test_real_runs_taken_up_as_committed(tmp_path, name, run_kvtrace):
    run = VLLM033_RUNS[name]
    recorded = as_recorded(run, tmp_path / name)
    before = json.loads((recorded / MANIFEST).read_text())
    assert [arm for arm, entry in before["arms"].items() if entry["status"] == "failed"] == IMPORTED[name]
    for arm in IMPORTED[name]:
        assert H200_IMPORTER_ERROR in before["arms"][arm]["error"]
    exports = {path.name: sha256(path) for path in recorded.glob("*.sqlite")}

    code, out, err = run_kvtrace("capture", "import", recorded)
    assert (code, err) == (0, ""), (out, err)
    assert out.splitlines() == [f"{arm}: ok -> {recorded / arm}.sqlite" for arm in IMPORTED[name]]
    assert {path.name: sha256(path) for path in recorded.glob("*.sqlite")} == exports  # adopted, not rewritten
    for file in [MANIFEST, *(f"{arm}.manifest.json" for arm in IMPORTED[name])]:
        made = without_stamps(json.loads((recorded / file).read_text()))
        assert made == without_stamps(json.loads((run / file).read_text())), file
    after = json.loads((recorded / MANIFEST).read_text())
    committed = json.loads((run / MANIFEST).read_text())
    cut = json.loads((run / "cut.json").read_text())["exports"]
    for arm in IMPORTED[name]:
        entry = after["arms"][arm]
        assert entry["status"] == "ok" and entry["error"] is None and entry["sqlite"] == f"{arm}.sqlite"
        assert entry["import"]["original"] == {"status": "failed", "error": before["arms"][arm]["error"]}
        assert entry["import"]["sqlite"]["sha256"] == exports[f"{arm}.sqlite"]
        # The H200's import adopted the uncut hand export that cut.json describes.
        original = cut[f"{arm}.sqlite"]["original"]
        assert committed["arms"][arm]["import"]["sqlite"] == {"bytes": original["bytes"], "sha256": original["sha256"]}
        assert entry["import"]["how"].startswith(f"adopted {arm}.sqlite")

    # Taken up once: a second call finds nothing to do and writes nothing.
    manifest_bytes = (recorded / MANIFEST).read_bytes()
    code, out, err = run_kvtrace("capture", "import", recorded)
    assert code == 0 and "nothing to do" in out
    assert (recorded / MANIFEST).read_bytes() == manifest_bytes


def test_incomplete_hand_export_is_refused(tmp_path, run_kvtrace):
    recorded = as_recorded(VLLM033_RUNS["offline-decode-heavy"], tmp_path / "run")
    manifest_bytes = (recorded / MANIFEST).read_bytes()
    whole = (recorded / "nvfp4.sqlite").read_bytes()
    (recorded / "nvfp4.sqlite").write_bytes(whole[:len(whole) // 3])  # an export copied half-way
    code, out, err = run_kvtrace("capture", "import", recorded)
    assert code == 1, (out, err)
    assert "nvfp4: not imported (nvfp4.sqlite " in out and "export nvfp4.nsys-rep again" in out
    assert "fp8: ok" in out
    data = json.loads((recorded / MANIFEST).read_text())
    assert data["arms"]["nvfp4"]["status"] == "failed" and "import" not in data["arms"]["nvfp4"]
    assert data["arms"]["fp8"]["status"] == "ok" and data["status"] == "partial"
    assert data["imports"][0]["status_before"] == "failed"
    assert (recorded / MANIFEST).read_bytes() != manifest_bytes


def test_an_interrupted_capture_stays_interrupted(tmp_path, run_kvtrace):
    """Taking up the failed runs of a capture stopped by Ctrl-C (synthetic: the real run's status set so) makes
    those runs ok, not the capture whole: runs it never reached are missing, so its status stays interrupted."""
    recorded = as_recorded(VLLM033_RUNS["offline-decode-heavy"], tmp_path / "run")
    data = json.loads((recorded / MANIFEST).read_text())
    (recorded / MANIFEST).write_text(json.dumps({**data, "status": "interrupted"}, indent=2) + "\n")
    code, out, err = run_kvtrace("capture", "import", recorded)
    assert (code, err) == (0, ""), (out, err)
    after = json.loads((recorded / MANIFEST).read_text())
    assert {entry["status"] for entry in after["arms"].values()} == {"ok"}
    assert after["status"] == "interrupted" and after["imports"][0]["status_before"] == "interrupted"


def test_not_a_run_directory(tmp_path, run_kvtrace):
    message = one_error_line(*run_kvtrace("capture", "import", tmp_path))
    assert "has no manifest.json" in message


def _failed_qdstrm_run(tmp_path, stand_in, monkeypatch) -> Path:  # noqa: F811
    """A run whose fp8 arm left only fp8.qdstrm (no importer then) and whose nvfp4 arm's workload failed."""
    monkeypatch.setenv("FAKE_NSYS_PROFILE", "qdstrm")
    out = tmp_path / "run"
    out.mkdir()
    arms = [runner.run_arm(name, out, str(stand_in), exits_workload("nvfp4") + [name]) for name in ("fp8", "nvfp4")]
    assert import_run.importable(runner.manifest("flashinfer", {}, {}, arms)["arms"]["fp8"])
    assert not import_run.importable(runner.manifest("flashinfer", {}, {}, arms)["arms"]["nvfp4"])
    runner.write_json_atomic(out / MANIFEST, runner.manifest("flashinfer", {}, {}, arms))
    monkeypatch.delenv("FAKE_NSYS_PROFILE")
    importer = stand_in.parent / "QdstrmImporter"
    importer.write_text(STAND_IN_IMPORTER.replace("{python}", sys.executable).replace("{error}", H200_IMPORTER_ERROR))
    importer.chmod(importer.stat().st_mode | stat.S_IXUSR)
    return out


def test_qdstrm_imported_and_exported(tmp_path, stand_in, monkeypatch, run_kvtrace):  # noqa: F811
    out = _failed_qdstrm_run(tmp_path, stand_in, monkeypatch)
    original = json.loads((out / MANIFEST).read_text())["arms"]["fp8"]["error"]
    code, text, err = run_kvtrace("capture", "import", out, "--nsys", stand_in)
    assert (code, err) == (0, ""), (text, err)
    assert text.splitlines() == [f"fp8: ok -> {out / 'fp8.sqlite'}"]  # nvfp4's workload failed: left alone
    entry = json.loads((out / MANIFEST).read_text())["arms"]["fp8"]
    assert entry["status"] == "ok" and entry["report"] == "fp8.nsys-rep" and entry["sqlite"] == "fp8.sqlite"
    assert entry["import"]["original"] == {"status": "failed", "error": original}
    assert entry["import"]["commands"][0] == [str(stand_in.parent / "QdstrmImporter"), "-i", "fp8.qdstrm"]
    assert entry["import"]["commands"][1][:3] == [str(stand_in), "export", "--type=sqlite"]
    # The stand-in export is the real fp8 export of fixtures/fi-h200-sm90.
    assert entry["import"]["sqlite"]["sha256"] == sha256(NSYS2025_DIR / "fp8.sqlite") == sha256(out / "fp8.sqlite")
    assert [call[0] for call in nsys_calls(tmp_path)][-1] == "export"
    assert "kvtrace capture import" in (out / "fp8.log").read_text()
    nvfp4 = json.loads((out / MANIFEST).read_text())["arms"]["nvfp4"]
    assert nvfp4["status"] == "failed" and "import" not in nvfp4


def test_importer_failing_again_leaves_the_manifest(tmp_path, stand_in, monkeypatch, run_kvtrace):  # noqa: F811
    out = _failed_qdstrm_run(tmp_path, stand_in, monkeypatch)
    manifest_bytes = (out / MANIFEST).read_bytes()
    code, text, err = run_kvtrace("capture", "import", out, "--nsys", stand_in, env={"FAKE_IMPORTER": "fail"})
    assert code == 1, (text, err)
    # The capture's own words (runner.export_run), as when the capture's retry failed.
    assert text.startswith("fp8: not imported (nsys left fp8.qdstrm but no report: QdstrmImporter -i fp8.qdstrm "
                           "failed (exit code 127: ")
    assert H200_IMPORTER_ERROR in text
    assert (out / MANIFEST).read_bytes() == manifest_bytes
    assert (out / "fp8.qdstrm").exists() and not (out / "fp8.sqlite").exists()
