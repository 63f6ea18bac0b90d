"""`kvtrace capture flashinfer` and the capture runner, on a CPU machine (no GPU, no real profiling).

- The CLI, as a user runs it (`python -m kvtrace ...` in a subprocess): the missing GPU, spec errors and a
  missing nsys are each one stderr line `kvtrace: error: ...` with exit code 2 and no Traceback, and no run
  directory is created.
- Run-directory rules (runner.prepare_run_dir, and through the CLI with only the GPU preflight bypassed).
- The runner's arm handling through a stand-in nsys: a small executable written per test that mimics the
  part of the nsys CLI the runner uses (`--version`; `profile ... --output=BASE app...`, which runs the app
  and writes BASE.nsys-rep, or only BASE.qdstrm, or nothing; `export --type=sqlite --output=X report`,
  which copies a REAL export from fixtures/fi-h200-sm90 to X, or fails half-way). It logs every call.
- Export through the real Nsight Systems 2023.4.4 CLI where available (the conftest `nsys` fixture).

No timing assertions.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

import kvtrace.nsys
from conftest import NSYS2023_REPORTS, NSYS2025_DIR, fingerprint, sha256
from kvtrace.capture import flashinfer_engine, runner
from kvtrace.errors import KvtraceError
from kvtrace.manifest import MANIFEST, SCHEMA, Run, run_order

STAND_IN_VERSION = "NVIDIA Nsight Systems version 0.0.0-stand-in"

# -S: the stand-in needs only the standard library (no site start-up), and it runs once per profile and per export.
STAND_IN_NSYS = r'''#!{python} -S
"""Stand-in for the nsys CLI surface used by kvtrace's capture runner. Controlled by environment:
FAKE_NSYS_CALLS (append each argv as a JSON line), FAKE_NSYS_FIXTURES (folder of real ARM.sqlite exports
and ARM.workload.json results), FAKE_NSYS_RUN (run | replay: skip the app and copy ARM.workload.json to its
--result), FAKE_NSYS_PROFILE (report | qdstrm | import-error | nothing), FAKE_NSYS_EXPORT (ok | partial | nothing),
FAKE_NSYS_FAIL (the --output base name of one profile that exits 1, e.g. fp8.r2)."""
import json, os, shutil, subprocess, sys
from pathlib import Path

args = sys.argv[1:]
if os.environ.get("FAKE_NSYS_CALLS"):
    with open(os.environ["FAKE_NSYS_CALLS"], "a") as calls:
        calls.write(json.dumps(args) + "\n")
fixtures = Path(os.environ.get("FAKE_NSYS_FIXTURES", "."))

if args == ["--version"]:
    print("{version}")
    sys.exit(0)

if args[:1] == ["profile"]:
    options, app = [], args[1:]
    while app and app[0].startswith("-"):
        options.append(app.pop(0))
    output = [o.split("=", 1)[1] for o in options if o.startswith("--output=")]
    if not output or not app:
        print("usage: nsys profile [options] --output=BASE app [args]", file=sys.stderr)
        sys.exit(1)
    base = Path(output[0])
    if os.environ.get("FAKE_NSYS_RUN", "run") == "run":
        code = subprocess.run(app).returncode
    else:
        code = 0
        if "--result" in app and "--kv-format" in app:
            result = Path(app[app.index("--result") + 1])
            arm = app[app.index("--kv-format") + 1]
            shutil.copyfile(fixtures / (arm + ".workload.json"), result)
    if base.name == os.environ.get("FAKE_NSYS_FAIL"):
        code = 1
    mode = os.environ.get("FAKE_NSYS_PROFILE", "report")
    if mode == "report":
        base.with_name(base.name + ".nsys-rep").write_bytes(b"stand-in report\n")
        print("Generated:\n\t" + str(base) + ".nsys-rep")
    elif mode == "qdstrm":
        base.with_name(base.name + ".qdstrm").write_bytes(b"stand-in raw stream\n")
        print("Importer not found; raw data left in " + str(base) + ".qdstrm")
    elif mode == "import-error":  # what nsys 2025.3.1 printed on the H200 when its import step failed
        base.with_name(base.name + ".qdstrm").write_bytes(b"stand-in raw stream\n")
        print("Importer error status: An unknown error occurred.")
    sys.exit(code)

if args[:1] == ["export"]:
    output = [a.split("=", 1)[1] for a in args if a.startswith("--output=")]
    if "--type=sqlite" not in args or not output:
        print("usage: nsys export --type=sqlite --output=FILE report", file=sys.stderr)
        sys.exit(1)
    target, report = Path(output[0]), Path(args[-1])
    if not report.is_file():
        print("cannot open " + str(report), file=sys.stderr)
        sys.exit(1)
    source = fixtures / (report.name.split(".")[0] + ".sqlite")
    mode = os.environ.get("FAKE_NSYS_EXPORT", "ok")
    if mode == "ok":
        shutil.copyfile(source, target)
    elif mode == "partial":
        target.write_bytes(source.read_bytes()[:4096])
        print("ProtobufParseException (stand-in)", file=sys.stderr)
        sys.exit(1)
    sys.exit(0)

print("stand-in nsys: unsupported arguments " + " ".join(args), file=sys.stderr)
sys.exit(1)
'''


# ---------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """Path of the stand-in nsys; its environment is set through monkeypatch (inherited by subprocesses)."""
    folder = tmp_path / "stand-in-bin"
    folder.mkdir()
    path = folder / "nsys"
    path.write_text(STAND_IN_NSYS.replace("{python}", sys.executable).replace("{version}", STAND_IN_VERSION))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    calls = tmp_path / "nsys-calls.jsonl"
    monkeypatch.setenv("FAKE_NSYS_CALLS", str(calls))
    monkeypatch.setenv("FAKE_NSYS_FIXTURES", str(NSYS2025_DIR))
    for name in ("FAKE_NSYS_RUN", "FAKE_NSYS_PROFILE", "FAKE_NSYS_EXPORT", "FAKE_NSYS_FAIL", "FAKE_QDSTRM_IMPORTER"):
        monkeypatch.delenv(name, raising=False)
    return path


def nsys_calls(tmp_path) -> list[list[str]]:
    path = tmp_path / "nsys-calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def exits_workload(fail_for: str = "") -> list[str]:
    """A workload that takes the arm name as its argument and exits 1 for `fail_for`, 0 otherwise."""
    return [sys.executable, "-c",
            "import sys; print('workload', sys.argv[1]); sys.exit(1 if sys.argv[1] == %r else 0)" % fail_for]


def one_error_line(code: int, out: str, err: str) -> str:
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvtrace: error: ")
    return lines[0]


def tree(folder: Path) -> dict[str, tuple]:
    """Every file under folder (hidden ones included) with its bytes, size and mtime."""
    return {str(p.relative_to(folder)): fingerprint(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def no_gpu_here():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this test is about a machine without a CUDA GPU")


def nsys_findable_without_path() -> bool:
    """Whether kvtrace.nsys.find_nsys would find an nsys in one of its well-known install locations."""
    return any(glob.glob(pattern) for pattern in kvtrace.nsys.INSTALL_GLOBS)


# ---------------------------------------------------------------------------------------------------------
# CLI errors, one line each


def test_no_gpu_is_one_line_and_creates_nothing(run_kvtrace, tmp_path, stand_in):
    no_gpu_here()
    code, out, err = run_kvtrace("capture", "flashinfer", "--out", tmp_path / "run", env={"NSYS": str(stand_in)})
    line = one_error_line(code, out, err)
    assert "no CUDA GPU" in line and "GPU machine" in line
    assert out == ""
    assert not (tmp_path / "run").exists()
    # Nothing was profiled.
    assert not any(call[:1] == ["profile"] for call in nsys_calls(tmp_path))


@pytest.mark.parametrize("args, says", [
    (["--head-dim", "100"], "--head-dim 100 is not a multiple of 16"),
    (["--head-dim", "72"], "--head-dim 72 is not a multiple of 16"),
    (["--q-heads", "60", "--kv-heads", "8"], "--q-heads 60 is not a multiple of --kv-heads 8"),
    (["--kv-heads", "0"], "--kv-heads must be at least 1"),
    (["--q-heads", "0"], "--q-heads must be at least 1"),
    (["--head-dim", "0"], "--head-dim must be at least 1"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--page-size", "0"], "--page-size must be at least 1"),
    (["--context", "2048,abc"], "--context takes comma-separated integers"),
    (["--context", "2048,,8192"], "--context takes comma-separated integers"),
    (["--context", "0"], "--context needs positive token counts"),
    (["--context", "2048,-1"], "--context needs positive token counts"),
    (["--arms", "fp8,int4"], "unknown arm(s) int4"),
    (["--arms", "bf16"], "unknown arm(s) bf16"),
    (["--arms", ","], "--arms needs one or more distinct arms"),
    (["--arms", "fp8,fp8"], "--arms needs one or more distinct arms"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--repeats", "-2"], "--repeats must be at least 1, got -2"),
])
def test_spec_errors_are_one_line(run_kvtrace, tmp_path, args, says):
    # No nsys anywhere, no GPU: the spec is checked first, so its error is the one reported.
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    code, out, err = run_kvtrace("capture", "flashinfer", "--out", tmp_path / "run", *args,
                                 env={"NSYS": None, "PATH": str(empty_bin)})
    line = one_error_line(code, out, err)
    assert says in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("how", ["NSYS unset, PATH without nsys", "NSYS not executable", "--nsys missing"])
def test_nsys_missing_is_one_line(run_kvtrace, tmp_path, how):
    if nsys_findable_without_path():
        pytest.skip("an nsys is installed in a well-known location on this machine")
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    env = {"NSYS": None, "PATH": str(empty_bin)}
    extra = []
    if how == "NSYS not executable":
        not_executable = tmp_path / "nsys"
        not_executable.write_text("#!/bin/sh\n")
        env["NSYS"] = str(not_executable)
    elif how == "--nsys missing":
        extra = ["--nsys", str(tmp_path / "no-such-nsys")]
    code, out, err = run_kvtrace("capture", "flashinfer", "--out", tmp_path / "run", *extra, env=env)
    line = one_error_line(code, out, err)
    if extra:  # an explicit --nsys that is not there is named as such
        assert f"--nsys {tmp_path / 'no-such-nsys'} is not an executable file" in line
    else:
        assert "nsys (Nsight Systems CLI) not found" in line
        assert "NSYS=" in line and "PATH" in line  # says how to point kvtrace at it
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------
# Run directories


def _fake_run_dir(folder: Path) -> None:
    """A run directory as kvtrace leaves it: manifest from runner.manifest plus arm files."""
    folder.mkdir(parents=True)
    (folder / "fp8.log").write_text("old log\n")
    arm = runner.ArmResult(name="fp8", status="ok", sqlite="fp8.sqlite", log="fp8.log")
    runner.write_json_atomic(folder / MANIFEST, runner.manifest("flashinfer", {}, {}, [arm]))
    shutil.copyfile(NSYS2025_DIR / "fp8.sqlite", folder / "fp8.sqlite")


def test_prepare_run_dir_rules(tmp_path):
    # New, and existing-but-empty folders are fine.
    runner.prepare_run_dir(tmp_path / "new" / "nested", force=False)
    assert (tmp_path / "new" / "nested").is_dir()
    (tmp_path / "empty").mkdir()
    runner.prepare_run_dir(tmp_path / "empty", force=False)

    # An existing kvtrace run without --force: refused, untouched, and the message names --force.
    run = tmp_path / "run"
    _fake_run_dir(run)
    before = tree(run)
    with pytest.raises(KvtraceError, match="--force"):
        runner.prepare_run_dir(run, force=False)
    assert tree(run) == before
    # With --force: replaced by an empty directory.
    runner.prepare_run_dir(run, force=True)
    assert run.is_dir() and list(run.iterdir()) == []


@pytest.mark.parametrize("manifest_text", [None, '{"name": "my-web-app", "version": "1.0"}', "not json {"])
@pytest.mark.parametrize("force", [False, True])
def test_foreign_non_empty_folder_is_refused_even_with_force(tmp_path, manifest_text, force):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me\n")
    (folder / "sub").mkdir()
    (folder / "sub" / "data.bin").write_bytes(b"\x00\x01")
    if manifest_text is not None:  # someone else's manifest.json is not a kvtrace run
        (folder / "manifest.json").write_text(manifest_text)
    before = tree(folder)
    with pytest.raises(KvtraceError, match="kvtrace replaces only its own run directories") as refused:
        runner.prepare_run_dir(folder, force=force)
    assert "--force" not in str(refused.value)  # never suggests a --force that would be refused too
    assert tree(folder) == before


def test_out_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "afile"
    target.write_text("x\n")
    for force in (False, True):
        with pytest.raises(KvtraceError, match="is a file"):
            runner.prepare_run_dir(target, force=force)
    assert target.read_text() == "x\n"


def run_cli_in_process(capsys, *args) -> tuple[int, str, str]:
    """kvtrace's real entry point, in this process (so that monkeypatches apply)."""
    from kvtrace.cli import main

    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def no_preflight(monkeypatch):
    """Everything but the GPU check: the rest of `capture flashinfer` runs for real on this CPU machine."""
    monkeypatch.setattr(flashinfer_engine, "preflight", lambda arms: None)


def test_cli_run_directory_rules(tmp_path, stand_in, no_preflight, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_NSYS_RUN", "replay")  # no GPU here: the stand-in replays the H200 results
    out = tmp_path / "run"
    small = ["--context", "16", "--batch", "1", "--nsys", stand_in]

    code, stdout, err = run_cli_in_process(capsys, "capture", "flashinfer", "--out", out, *small)
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["arms"]["fp8"]["status"] == "ok"

    # Again without --force: refused in one line, the first run left exactly as it was.
    (out / "user-note.txt").write_text("added after the run\n")
    before = tree(out)
    code, stdout, err = run_cli_in_process(capsys, "capture", "flashinfer", "--out", out, *small)
    assert "--force" in one_error_line(code, stdout, err)
    assert tree(out) == before

    # With --force: replaced (the note is gone, a new manifest is there).
    code, stdout, err = run_cli_in_process(capsys, "capture", "flashinfer", "--out", out, *small, "--force")
    assert code == 0, err
    assert not (out / "user-note.txt").exists()
    assert {p.name for p in out.iterdir()} == {"manifest.json"} | {
        f"{arm}.{ext}" for arm in ("fp8", "nvfp4") for ext in ("log", "nsys-rep", "sqlite", "workload.json")}

    # A non-empty folder that is not a kvtrace run: refused even with --force, untouched.
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("\\documentclass{article}\n")
    before = tree(other)
    for extra in ([], ["--force"]):
        code, stdout, err = run_cli_in_process(capsys, "capture", "flashinfer", "--out", other, *small, *extra)
        assert "replaces only its own run directories" in one_error_line(code, stdout, err)
        assert tree(other) == before


def test_cli_end_to_end_with_stand_in_nsys(tmp_path, stand_in, no_preflight, monkeypatch, capsys):
    """The whole `capture flashinfer` path except the GPU: workload command, nsys flags, export, manifest."""
    monkeypatch.setenv("FAKE_NSYS_RUN", "replay")
    out = tmp_path / "fi"
    code, stdout, err = run_cli_in_process(
        capsys, "capture", "flashinfer", "--out", out, "--context", "2048,8192", "--batch", "2", "--q-heads",
        "32", "--kv-heads", "4", "--head-dim", "64", "--page-size", "32", "--seed", "7", "--nsys", stand_in)
    assert code == 0, err
    assert stdout.splitlines() == [f"fp8: ok -> {out / 'fp8.sqlite'}", f"nvfp4: ok -> {out / 'nvfp4.sqlite'}"]

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kvtrace_manifest"] == SCHEMA and manifest["engine"] == "flashinfer"
    assert manifest["environment"]["nsys"] == STAND_IN_VERSION
    assert manifest["environment"]["nsys_path"] == str(stand_in)
    spec = manifest["settings"]["spec"]
    assert (spec["contexts"], spec["batch"], spec["q_heads"], spec["kv_heads"], spec["head_dim"],
            spec["page_size"], spec["seed"]) == ([2048, 8192], 2, 32, 4, 64, 32, 7)
    assert manifest["settings"]["arms"] == ["fp8", "nvfp4"]
    assert (manifest["settings"]["repeats"], manifest["settings"]["order"]) == (1, ["fp8", "nvfp4"])
    for arm in ("fp8", "nvfp4"):
        entry = manifest["arms"][arm]
        assert entry["status"] == "ok" and entry["error"] is None
        assert (entry["name"], entry["arm"], entry["repeat"]) == (arm, arm, 1)
        assert sha256(out / entry["sqlite"]) == sha256(NSYS2025_DIR / f"{arm}.sqlite")
        # The workload result the arm wrote is embedded in the manifest.
        assert entry["workload"] == json.loads((NSYS2025_DIR / f"{arm}.workload.json").read_text())
        profile = entry["commands"][0]
        assert profile[:2] == [str(stand_in), "profile"]
        workload = profile[profile.index(sys.executable):]
        assert workload[:3] == [sys.executable, "-m", "kvtrace.capture.flashinfer_workload"]
        flags = dict(zip(workload[3::2], workload[4::2]))
        assert flags == {"--kv-format": arm, "--contexts": "2048,8192", "--batch": "2", "--q-heads": "32",
                         "--kv-heads": "4", "--head-dim": "64", "--page-size": "32", "--prefill-calls": "8",
                         "--decode-calls": "64", "--append-calls": "64", "--gemm-calls": "16",
                         "--gemm-size": "4096", "--seed": "7", "--inputs": "gaussian",
                         "--result": str(out / f"{arm}.workload.json")}
    # No temporary files anywhere in the run directory.
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") or p.name.endswith((".tmp", ".partial"))]


def test_repeats_interleave_the_arms(tmp_path, stand_in, no_preflight, monkeypatch, capsys):
    """--repeats 2: runs fp8.r1 nvfp4.r1 fp8.r2 nvfp4.r2, in that order, each with its own files and manifest
    entry; one failed run leaves the others and their entries."""
    monkeypatch.setenv("FAKE_NSYS_RUN", "replay")
    monkeypatch.setenv("FAKE_NSYS_FAIL", "fp8.r2")
    out = tmp_path / "fi"
    code, stdout, err = run_cli_in_process(capsys, "capture", "flashinfer", "--out", out, "--context", "16",
                                           "--batch", "1", "--repeats", "2", "--nsys", stand_in)
    order = ["fp8.r1", "nvfp4.r1", "fp8.r2", "nvfp4.r2"]
    assert code == 1, err  # one run failed
    assert [line.split(":")[0] for line in stdout.splitlines()] == order
    assert "fp8.r2: failed (workload under nsys exited with code 1 (see fp8.r2.log))" in stdout
    # The order nsys was called in: profile and export of each run before the next run starts.
    calls = [(call[0], Path(call[-1]).name if call[0] == "export" else
              Path(next(a.split("=", 1)[1] for a in call if a.startswith("--output="))).name)
             for call in nsys_calls(tmp_path) if call[:1] in (["profile"], ["export"])]
    assert calls == [("profile", "fp8.r1"), ("export", "fp8.r1.nsys-rep"), ("profile", "nvfp4.r1"),
                     ("export", "nvfp4.r1.nsys-rep"), ("profile", "fp8.r2"), ("profile", "nvfp4.r2"),
                     ("export", "nvfp4.r2.nsys-rep")]

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["arms"] == ["fp8", "nvfp4"]
    assert (manifest["settings"]["repeats"], manifest["settings"]["order"]) == (2, order)
    assert list(manifest["arms"]) == order
    for name, entry in manifest["arms"].items():
        arm, repeat = name.split(".r")
        assert (entry["name"], entry["arm"], entry["repeat"]) == (name, arm, int(repeat))
        assert entry["log"] == f"{name}.log" and (out / entry["log"]).exists()
        workload = entry["commands"][0]
        assert workload[workload.index("--kv-format") + 1] == arm  # the arm's format, the run's files
        assert workload[workload.index("--result") + 1] == str(out / f"{name}.workload.json")
        if name == "fp8.r2":
            assert entry["status"] == "failed" and entry["sqlite"] is None and "see fp8.r2.log" in entry["error"]
        else:
            assert entry["status"] == "ok" and entry["sqlite"] == f"{name}.sqlite"
            assert sha256(out / entry["sqlite"]) == sha256(NSYS2025_DIR / f"{arm}.sqlite")
            assert entry["workload"] == json.loads((NSYS2025_DIR / f"{arm}.workload.json").read_text())
    assert {p.name for p in out.iterdir()} == {"manifest.json"} | {
        f"{name}.{ext}" for name in order for ext in ("log", "nsys-rep", "sqlite", "workload.json")} - {
        "fp8.r2.sqlite"}


def test_run_order():
    assert run_order(("fp8", "nvfp4"), 1) == [Run("fp8", "fp8", 1), Run("nvfp4", "nvfp4", 1)]
    assert [(run.name, run.arm, run.repeat) for run in run_order(("a", "b", "c"), 2)] == [
        ("a.r1", "a", 1), ("b.r1", "b", 1), ("c.r1", "c", 1), ("a.r2", "a", 2), ("b.r2", "b", 2), ("c.r2", "c", 2)]
    with pytest.raises(KvtraceError, match="--repeats must be at least 1, got 0"):
        run_order(("fp8",), 0)


@pytest.mark.slow
def test_cli_real_workload_fails_on_cpu_and_both_arms_are_recorded(tmp_path, stand_in, no_preflight, capsys):
    """Under the stand-in nsys the real workload process runs and fails here (no GPU / FlashInfer): each arm
    is recorded as failed with its log, the command exits 1, and nothing half-made is left."""
    no_gpu_here()
    out = tmp_path / "fi"
    code, stdout, err = run_cli_in_process(capsys, "capture", "flashinfer", "--out", out, "--context", "16",
                                           "--batch", "1", "--nsys", stand_in)
    assert code == 1
    assert stdout.splitlines() == [
        "fp8: failed (workload under nsys exited with code 1 (see fp8.log))",
        "nvfp4: failed (workload under nsys exited with code 1 (see nvfp4.log))"]
    manifest = json.loads((out / "manifest.json").read_text())
    for arm in ("fp8", "nvfp4"):
        entry = manifest["arms"][arm]
        assert entry["status"] == "failed" and entry["sqlite"] is None and entry["workload"] is None
        log = (out / entry["log"]).read_text()
        assert log.startswith("$ " + " ".join(entry["commands"][0]))
        assert "Traceback" in log  # the workload's own error is in the log, not on the terminal
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------------------
# The runner's arms, driven directly


def test_profile_command_has_the_documented_flags(tmp_path):
    command = runner.profile_command("/x/nsys", tmp_path / "fp8", ["python", "-m", "w", "--a", "1"])
    assert command[:2] == ["/x/nsys", "profile"]
    for flag in ("--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none", "--cuda-graph-trace=node",
                 "--capture-range=cudaProfilerApi", "--capture-range-end=stop", f"--output={tmp_path / 'fp8'}"):
        assert flag in command
    assert command[-5:] == ["python", "-m", "w", "--a", "1"]  # the workload last, untouched


@pytest.mark.parametrize("failing", ["nvfp4", "fp8"])
def test_one_failing_arm_leaves_the_other_and_a_manifest_entry(tmp_path, stand_in, failing):
    out = tmp_path / "run"
    runner.prepare_run_dir(out, force=False)
    arms = []
    for name in ("fp8", "nvfp4"):
        arms.append(runner.run_arm(name, out, str(stand_in), exits_workload(failing) + [name]))
        runner.write_json_atomic(out / MANIFEST, runner.manifest("flashinfer", {"nsys": "stand-in"},
                                                                        {"arms": ["fp8", "nvfp4"]}, arms))
    ok_name = "fp8" if failing == "nvfp4" else "nvfp4"
    results = {arm.name: arm for arm in arms}

    failed = results[failing]
    assert failed.status == "failed"
    assert "exited with code 1" in failed.error and f"see {failing}.log" in failed.error
    assert failed.sqlite is None and not (out / f"{failing}.sqlite").exists()
    # nsys still wrote a report of the failed workload; the manifest points at it (it may open in the GUI).
    assert failed.report == f"{failing}.nsys-rep" and (out / failed.report).exists()
    failed_log = (out / f"{failing}.log").read_text()
    assert failed_log.startswith("$ " + " ".join(failed.commands[0]))
    assert f"workload {failing}" in failed_log  # the workload's output went to its log
    assert len(failed.commands) == 1  # no export was attempted

    good = results[ok_name]
    assert good.status == "ok" and good.error is None
    assert (good.sqlite, good.report, good.log) == (f"{ok_name}.sqlite", f"{ok_name}.nsys-rep", f"{ok_name}.log")
    assert sha256(out / good.sqlite) == sha256(NSYS2025_DIR / f"{ok_name}.sqlite")
    assert (out / good.report).exists() and (out / good.log).exists()
    assert [c[1] for c in good.commands] == ["profile", "export"]

    manifest = json.loads((out / MANIFEST).read_text())
    assert list(manifest["arms"]) == ["fp8", "nvfp4"]
    for name, entry in manifest["arms"].items():
        assert entry["commands"] == [list(c) for c in results[name].commands]
        assert entry["status"] == results[name].status and entry["error"] == results[name].error
        assert entry["log"] == f"{name}.log"
    # Only the expected files: no temporaries from the manifest or the export.
    # (Like nsys, the stand-in still writes the failing arm's report.)
    assert {p.name for p in out.iterdir()} == {"manifest.json", f"{failing}.log", f"{failing}.nsys-rep",
                                               f"{ok_name}.log", f"{ok_name}.nsys-rep", f"{ok_name}.sqlite"}


def test_qdstrm_without_importer_is_explained(tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv("FAKE_NSYS_PROFILE", "qdstrm")
    out = tmp_path / "run"
    out.mkdir()
    arm = runner.run_arm("fp8", out, str(stand_in), exits_workload() + ["fp8"])
    assert arm.status == "failed"
    assert "fp8.qdstrm" in arm.error and "importer is missing" in arm.error
    assert "QdstrmImporter -i fp8.qdstrm" in arm.error and "see fp8.log" in arm.error
    assert (out / "fp8.qdstrm").exists()  # kept, so that it can be imported elsewhere
    assert not (out / "fp8.sqlite").exists() and arm.sqlite is None and arm.report is None


STAND_IN_IMPORTER = r'''#!{python}
"""Stand-in QdstrmImporter: `-i RAW.qdstrm` writes RAW.nsys-rep (FAKE_QDSTRM_IMPORTER=ok) or fails as the
real one did on the H200 without its libraries (fail)."""
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if os.environ.get("FAKE_NSYS_CALLS"):
    with open(os.environ["FAKE_NSYS_CALLS"], "a") as calls:
        calls.write(json.dumps(["QdstrmImporter", *args]) + "\n")
raw = Path(args[args.index("-i") + 1])
if os.environ.get("FAKE_QDSTRM_IMPORTER", "ok") == "ok":
    raw.with_suffix(".nsys-rep").write_bytes(b"stand-in report\n")
    print("Saved report file to " + str(raw.with_suffix(".nsys-rep")))
    sys.exit(0)
print("QdstrmImporter: error while loading shared libraries: libdw.so.1: cannot open shared object file")
sys.exit(127)
'''


def add_importer(stand_in: Path, folder: Path | None = None) -> Path:
    path = (folder or stand_in.parent) / "QdstrmImporter"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STAND_IN_IMPORTER.replace("{python}", sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_failed_import_is_retried_with_qdstrm_importer(tmp_path, stand_in, monkeypatch):
    """The H200 case (issue 20): nsys profile's import step failed and left only the raw capture; one more
    import with QdstrmImporter of the same install makes the report, and the export goes on."""
    monkeypatch.setenv("FAKE_NSYS_PROFILE", "import-error")
    add_importer(stand_in)
    out = tmp_path / "run"
    out.mkdir()
    arm = runner.run_arm("fp8", out, str(stand_in), exits_workload() + ["fp8"])
    assert arm.status == "ok", arm.error
    assert arm.report == "fp8.nsys-rep" and (out / "fp8.sqlite").exists()
    assert ["QdstrmImporter", "-i", str(out / "fp8.qdstrm")] in nsys_calls(tmp_path)
    log = (out / "fp8.log").read_text()
    assert "Importer error status" in log and "QdstrmImporter -i" in log and "Saved report file" in log


def test_failed_retry_quotes_both_errors(tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv("FAKE_NSYS_PROFILE", "import-error")
    monkeypatch.setenv("FAKE_QDSTRM_IMPORTER", "fail")
    add_importer(stand_in)
    out = tmp_path / "run"
    out.mkdir()
    arm = runner.run_arm("nvfp4", out, str(stand_in), exits_workload() + ["nvfp4"])
    assert arm.status == "failed" and arm.sqlite is None
    assert 'nsys profile\'s import said "Importer error status: An unknown error occurred."' in arm.error
    assert "QdstrmImporter -i nvfp4.qdstrm failed too (exit code 127" in arm.error and "libdw.so.1" in arm.error
    assert "importer is missing" not in arm.error and (out / "nvfp4.qdstrm").exists()


def test_importer_is_found_where_each_install_keeps_it(tmp_path):
    """Beside nsys (a standalone install's bin/), in host-linux-x64/ beside target-linux-x64/ (Debian's
    2023.4.4), in host/linux-desktop-*/ beside host/target-linux-x64/ (the copy inside Nsight Compute)."""
    for layout, importer_dir in [("a/bin", "a/bin"), ("b/target-linux-x64", "b/host-linux-x64"),
                                 ("c/host/target-linux-x64", "c/host/linux-desktop-glibc_2_11_3-x64")]:
        nsys = tmp_path / layout / "nsys"
        nsys.parent.mkdir(parents=True)
        nsys.write_text("#!/bin/sh\n")
        nsys.chmod(0o755)
        assert kvtrace.nsys.find_importer(str(nsys)) is None
        importer = add_importer(nsys, tmp_path / importer_dir)
        assert kvtrace.nsys.find_importer(str(nsys)) == str(importer)


def test_no_report_at_all_is_explained(tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv("FAKE_NSYS_PROFILE", "nothing")
    out = tmp_path / "run"
    out.mkdir()
    arm = runner.run_arm("nvfp4", out, str(stand_in), exits_workload() + ["nvfp4"])
    assert arm.status == "failed"
    assert "nsys wrote no report" in arm.error and "cudaProfilerStart" in arm.error
    assert sorted(p.name for p in out.iterdir()) == ["nvfp4.log"]


def test_export_goes_through_a_temporary_name(tmp_path, stand_in):
    out = tmp_path / "run"
    out.mkdir()
    arm = runner.run_arm("nvfp4", out, str(stand_in), exits_workload() + ["nvfp4"])
    assert arm.status == "ok"
    export_calls = [c for c in nsys_calls(tmp_path) if c[:1] == ["export"]]
    assert len(export_calls) == 1
    written_to = Path(next(a.split("=", 1)[1] for a in export_calls[0] if a.startswith("--output=")))
    assert written_to.parent == out and written_to != out / "nvfp4.sqlite"
    assert not written_to.exists()  # renamed into place
    assert sha256(out / "nvfp4.sqlite") == sha256(NSYS2025_DIR / "nvfp4.sqlite")
    assert export_calls[0][-1] == str(out / "nvfp4.nsys-rep")


@pytest.mark.parametrize("mode", ["partial", "nothing"])
def test_failed_export_leaves_no_partial_file(tmp_path, stand_in, monkeypatch, mode):
    # partial: nsys writes half a file and exits 1 (as nsys 2023.4 does on a newer report);
    # nothing: exits 0 without writing anything.
    monkeypatch.setenv("FAKE_NSYS_EXPORT", mode)
    out = tmp_path / "run"
    out.mkdir()
    arm = runner.run_arm("fp8", out, str(stand_in), exits_workload() + ["fp8"])
    assert arm.status == "failed"
    assert "nsys export failed" in arm.error and "see fp8.log" in arm.error
    assert arm.report == "fp8.nsys-rep" and arm.sqlite is None  # the report stays, for a later export
    assert sorted(p.name for p in out.iterdir()) == ["fp8.log", "fp8.nsys-rep"]
    log = (out / "fp8.log").read_text()
    assert "$ " + str(stand_in) + " export --type=sqlite" in log


def test_workload_result_is_embedded_and_env_is_passed(tmp_path, stand_in):
    out = tmp_path / "run"
    out.mkdir()
    result = out / "fp8.workload.json"
    workload = [sys.executable, "-c",
                "import json, os, sys; json.dump({'marker': os.environ['KVTRACE_TEST_MARKER']}, "
                "open(sys.argv[1], 'w'))", str(result)]
    env = dict(os.environ, KVTRACE_TEST_MARKER="from-env")
    arm = runner.run_arm("fp8", out, str(stand_in), workload, env=env, workload_result=result)
    assert arm.status == "ok"
    assert arm.workload == {"marker": "from-env"}


def test_nsys_version_and_host_environment_from_the_binary(stand_in):
    assert kvtrace.nsys.nsys_version(str(stand_in)) == STAND_IN_VERSION
    environment = runner.host_environment(str(stand_in))
    assert environment["nsys"] == STAND_IN_VERSION and environment["nsys_path"] == str(stand_in)
    assert isinstance(environment["gpus"], list)


def test_find_nsys_order(tmp_path, stand_in, monkeypatch):
    other = tmp_path / "other-bin"
    other.mkdir()
    shutil.copy2(stand_in, other / "nsys")
    monkeypatch.setenv("PATH", str(other))
    monkeypatch.setenv("NSYS", str(stand_in))
    assert kvtrace.nsys.find_nsys() == str(stand_in)  # $NSYS before PATH
    assert kvtrace.nsys.find_nsys(str(other / "nsys")) == str(other / "nsys")  # --nsys before $NSYS
    monkeypatch.delenv("NSYS")
    assert kvtrace.nsys.find_nsys() == str(other / "nsys")  # then PATH


# ---------------------------------------------------------------------------------------------------------
# Manifest


def test_manifest_is_valid_json_written_atomically(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    arms = [runner.ArmResult(name="fp8", status="ok", sqlite="fp8.sqlite", log="fp8.log",
                             commands=[["nsys", "profile", "x"], ["nsys", "export", "y"]], seconds=1.5),
            runner.ArmResult(name="nvfp4", status="failed", error="boom (see nvfp4.log)", log="nvfp4.log",
                             commands=[["nsys", "profile", "z"]])]
    data = runner.manifest("flashinfer", {"nsys": "v"}, {"spec": {"batch": 8}}, arms)
    path = out / MANIFEST
    runner.write_json_atomic(path, data)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(data))
    assert loaded["kvtrace_manifest"] == SCHEMA
    assert set(loaded) == {"kvtrace_manifest", "engine", "created_utc", "environment", "settings", "arms"}
    assert loaded["arms"]["nvfp4"]["commands"] == [["nsys", "profile", "z"]]
    assert loaded["arms"]["fp8"]["error"] is None and loaded["arms"]["nvfp4"]["sqlite"] is None
    assert path.read_text().endswith("}\n")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]

    # Rewriting replaces the whole file (atomic rename, nothing appended or left over).
    runner.write_json_atomic(path, runner.manifest("flashinfer", {}, {}, arms[:1]))
    assert list(json.loads(path.read_text())["arms"]) == ["fp8"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]

    # A manifest that cannot be serialised leaves the previous one intact and no temporary file.
    before = fingerprint(path)
    with pytest.raises(TypeError):
        runner.write_json_atomic(path, {"not serialisable": object()})
    assert fingerprint(path) == before
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


def test_committed_fixture_manifest_has_the_runner_shape():
    """The H200 run's manifest.json (fixtures/fi-h200-sm90) is what runner.manifest writes."""
    manifest = json.loads((NSYS2025_DIR / "manifest.json").read_text())
    fields = set(runner.ArmResult.__dataclass_fields__)
    assert manifest["kvtrace_manifest"] == SCHEMA and manifest["engine"] == "flashinfer"
    for name, arm in manifest["arms"].items():
        # Recorded before --repeats added each run's `arm` and `repeat`.
        assert set(arm) == fields - {"arm", "repeat"} and arm["name"] == name and arm["status"] == "ok"
        assert (NSYS2025_DIR / arm["sqlite"]).exists() and (NSYS2025_DIR / arm["log"]).exists()
        assert arm["commands"][0][1] == "profile" and "--capture-range=cudaProfilerApi" in arm["commands"][0]
    assert runner._is_kvtrace_run(NSYS2025_DIR)


# ---------------------------------------------------------------------------------------------------------
# Export through the real Nsight Systems 2023.4.4 CLI (skipped locally when it is not installed)


def test_real_nsys_export_through_temporary_name(nsys, tmp_path):
    report = tmp_path / "fp8.nsys-rep"
    shutil.copy2(NSYS2023_REPORTS / "fp8.nsys-rep", report)
    target = tmp_path / "fp8.sqlite"
    with open(tmp_path / "fp8.log", "w") as log:
        kvtrace.nsys.export_sqlite(nsys, report, target, log=log)
    import sqlite3

    conn = sqlite3.connect(f"{target.resolve().as_uri()}?mode=ro", uri=True)
    try:
        product = dict(conn.execute("SELECT name, value FROM META_DATA_EXPORT"))["EXPORT_PRODUCT_VERSION"]
    finally:
        conn.close()
    assert product.startswith("2023.4.4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8.log", "fp8.nsys-rep", "fp8.sqlite"]


def test_real_nsys_failed_export_leaves_nothing(nsys, tmp_path):
    # nsys 2023.4.4 cannot read a 2025.3 report: it exits non-zero after writing part of the SQLite file.
    report = tmp_path / "nvfp4.nsys-rep"
    shutil.copy2(NSYS2025_DIR / "nvfp4.nsys-rep", report)
    with open(tmp_path / "nvfp4.log", "w") as log, pytest.raises(RuntimeError, match="nsys export failed"):
        kvtrace.nsys.export_sqlite(nsys, report, tmp_path / "nvfp4.sqlite", log=log)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvfp4.log", "nvfp4.nsys-rep"]
    assert "ProtobufParseException" in (tmp_path / "nvfp4.log").read_text()
