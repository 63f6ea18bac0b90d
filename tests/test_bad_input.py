"""Bad input through the real CLI: one line `kvtrace: error: ...` naming the file and the fix, exit 2.

Every kind is run as `kvtrace summary X`, `kvtrace diff X good.sqlite` and `kvtrace diff good.sqlite X`.
For each: exit code 2, stdout empty, stderr exactly one line that starts with `kvtrace: error:`, names
the file and says what to do, no "Traceback" anywhere, and the input's bytes and mtime unchanged.

Real artefacts (fixtures/bad/, see its README.md): an export of a process that launched no kernels, and
the partial SQLite that Nsight Systems 2023.4.4 leaves when it fails on a 2025.3 report. Everything else
is built here in tmp_path from the real exports; the ones that could come from nsys but do not are named
"synthetic".
"""

from __future__ import annotations

import ctypes
import os
import random
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from conftest import BAD_DIR, GOOD_SQLITE, NO_KERNELS_DIR, NSYS2023_DIR, NSYS2023_REPORTS, NSYS2025_DIR, fingerprint

HALF_SOURCE = NSYS2025_DIR / "fp8.sqlite"


@dataclass(frozen=True)
class Kind:
    make: Callable[[Path], Path]  # tmp_path -> the bad input
    problem: str  # regex the message must match: what is wrong
    fix: str  # regex the message must match: what to do
    needs_nsys: bool = False


def _missing(tmp: Path) -> Path:
    return tmp / "missing.sqlite"


def _directory(tmp: Path) -> Path:
    folder = tmp / "traces"
    folder.mkdir()
    shutil.copy2(GOOD_SQLITE, folder / "fp8.sqlite")
    return folder


def _empty(tmp: Path) -> Path:
    path = tmp / "empty.sqlite"
    path.touch()
    return path


def _random_bytes(tmp: Path, suffix: str = ".sqlite") -> Path:
    path = tmp / f"random-bytes{suffix}"
    path.write_bytes(random.Random(20231).randbytes(64 * 1024))
    return path


def _truncated(tmp: Path) -> Path:
    """The first half of a real export, as an interrupted copy leaves it."""
    data = HALF_SOURCE.read_bytes()
    path = tmp / "truncated-half.sqlite"
    path.write_bytes(data[: len(data) // 2])
    return path


def _truncated_header(tmp: Path) -> Path:
    """Cut inside the 100-byte SQLite header."""
    path = tmp / "truncated-header.sqlite"
    path.write_bytes(HALF_SOURCE.read_bytes()[:60])
    return path


def _not_nsys(tmp: Path) -> Path:
    """A healthy SQLite database that is not an Nsight Systems export."""
    path = tmp / "notes.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    conn.execute("INSERT INTO notes (body) VALUES ('not a trace')")
    conn.commit()
    conn.close()
    return path


def _edit_copy(tmp: Path, name: str, *statements: str) -> Path:
    path = tmp / name
    shutil.copyfile(GOOD_SQLITE, path)  # bytes only: the unpacked fixtures are read-only
    conn = sqlite3.connect(path)
    for statement in statements:
        conn.execute(statement)
    conn.commit()
    conn.execute("VACUUM")
    conn.close()
    return path


def _synthetic_no_kernel_table(tmp: Path) -> Path:
    """A real export with CUPTI_ACTIVITY_KIND_KERNEL dropped (the real case is no-kernels-nsys2023.sqlite)."""
    return _edit_copy(tmp, "synthetic-no-kernel-table.sqlite", "DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL")


def _synthetic_empty_kernel_table(tmp: Path) -> Path:
    """The kernel table present but empty (nsys creates tables lazily, so only a --lazy=false export has it)."""
    return _edit_copy(tmp, "synthetic-empty-kernel-table.sqlite", "DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL")


def _real(path: Path) -> Callable[[Path], Path]:
    return lambda tmp: path


def _copied_report(source: Path, name: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        path = tmp / name
        shutil.copy2(source, path)
        return path
    return make


def _truncated_report(tmp: Path) -> Path:
    data = (NSYS2023_REPORTS / "fp8.nsys-rep").read_bytes()
    path = tmp / "truncated.nsys-rep"
    path.write_bytes(data[: len(data) // 2])
    return path


def _empty_report(tmp: Path) -> Path:
    path = tmp / "empty.nsys-rep"
    path.touch()
    return path


KINDS = {
    "missing-path": Kind(_missing, r"no such file", r"check the path"),
    "directory": Kind(_directory, r"is a directory", r"pass one \.sqlite or \.nsys-rep file"),
    "empty-file": Kind(_empty, r"empty \(0 bytes\)", r"nsys export --type sqlite"),
    "random-bytes": Kind(_random_bytes, r"not an SQLite file", r"nsys export --type sqlite"),
    "truncated-half": Kind(_truncated, r"truncated", r"copy or export it again"),
    "truncated-header": Kind(_truncated_header, r"truncated", r"copy or export it again"),
    "sqlite-not-nsys": Kind(_not_nsys, r"not an Nsight Systems export", r"nsys export --type sqlite"),
    "no-kernels-real": Kind(_real(NO_KERNELS_DIR / "no-kernels-nsys2023.sqlite"), r"no CUDA kernel records",
                            r"nsys profile -t cuda"),
    "synthetic-no-kernel-table": Kind(_synthetic_no_kernel_table, r"no CUDA kernel records",
                                      r"nsys profile -t cuda"),
    "synthetic-empty-kernel-table": Kind(_synthetic_empty_kernel_table, r"no CUDA kernel records",
                                         r"nsys profile -t cuda"),
    "partial-export-real": Kind(_real(BAD_DIR / "partial-export-nsys2023-of-2025.3.sqlite"), r"partial .*export",
                                r"export the report again"),
    # .nsys-rep inputs go through nsys export first.
    "empty-report": Kind(_empty_report, r"empty \(0 bytes\)", r"nsys export"),
    "random-bytes-report": Kind(lambda tmp: _random_bytes(tmp, ".nsys-rep"), r"nsys export failed",
                                r"check the report opens|export it yourself", needs_nsys=True),
    "truncated-report": Kind(_truncated_report, r"nsys export failed", r"check the report opens|export it yourself",
                             needs_nsys=True),
    "no-kernels-report-real": Kind(_copied_report(NO_KERNELS_DIR / "no-kernels-nsys2023.nsys-rep",
                                                  "no-kernels-nsys2023.nsys-rep"),
                                   r"no CUDA kernel records", r"nsys profile -t cuda", needs_nsys=True),
}
COMMANDS = ["summary", "diff-baseline", "diff-candidate"]


def argv(command: str, bad: Path) -> list:
    return {"summary": ["summary", bad], "diff-baseline": ["diff", bad, GOOD_SQLITE],
            "diff-candidate": ["diff", GOOD_SQLITE, bad]}[command]


def assert_one_line_error(code: int, out: str, err: str, names: str, problem: str | None = None,
                          fix: str | None = None) -> str:
    assert "Traceback" not in out + err, err
    assert code == 2, err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    line = lines[0]
    assert line.startswith("kvtrace: error: "), line
    assert names in line, f"{names!r} not named in: {line}"
    if problem:
        assert re.search(problem, line, re.IGNORECASE), f"problem /{problem}/ not said in: {line}"
    if fix:
        assert re.search(fix, line, re.IGNORECASE), f"fix /{fix}/ not said in: {line}"
    return line


def state(path: Path):
    """What must not change: bytes + mtime of a file, the listing of a folder, or absence."""
    if path.is_dir():
        return ("dir", sorted((p.name, fingerprint(p)) for p in path.iterdir() if p.is_file()))
    if path.exists():
        return ("file", fingerprint(path))
    return ("absent",)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_bad_input(kind, command, tmp_path, run_kvtrace, request):
    spec = KINDS[kind]
    env = {}
    if spec.needs_nsys:
        env["NSYS"] = request.getfixturevalue("nsys")
    work = tmp_path / "work"
    work.mkdir()
    bad = spec.make(work)
    before, folder_before = state(bad), sorted(p.name for p in bad.parent.iterdir())
    good_before = fingerprint(GOOD_SQLITE)

    code, out, err = run_kvtrace(*argv(command, bad), env=env)

    assert_one_line_error(code, out, err, str(bad), spec.problem, spec.fix)
    assert state(bad) == before
    assert sorted(p.name for p in bad.parent.iterdir()) == folder_before  # nothing created beside it
    assert fingerprint(GOOD_SQLITE) == good_before


@pytest.mark.parametrize("kind", ["random-bytes-report", "truncated-report", "no-kernels-report-real"])
def test_failed_report_export_leaves_no_partial_in_cache(kind, nsys, tmp_path, cache_dir, run_kvtrace):
    bad = KINDS[kind].make(tmp_path)
    code, out, err = run_kvtrace("summary", bad, env={"NSYS": nsys})
    assert code == 2
    leftovers = [p for p in cache_dir.rglob("*") if p.is_file()]
    if kind == "no-kernels-report-real":
        # The export itself succeeded (a complete SQLite, reused next time); only the content is bad.
        names = sorted(p.name for p in leftovers)  # the export and its seal (NAME.sqlite.json), tying it to the report
        assert len(names) == 2 and names[0].endswith(".sqlite") and names[1] == names[0] + ".json"
        assert not names[0].startswith(".")
    else:
        assert leftovers == []


def test_nsys_rep_without_nsys(tmp_path, run_kvtrace):
    """An .nsys-rep (no sibling export) when neither $NSYS nor PATH has nsys."""
    report = tmp_path / "fp8.nsys-rep"
    shutil.copy2(NSYS2023_REPORTS / "fp8.nsys-rep", report)
    path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    if shutil.which("nsys", path=path):
        pytest.skip(f"nsys is on {path}")
    before = fingerprint(report)
    code, out, err = run_kvtrace("summary", report, env={"NSYS": None, "PATH": path})
    line = assert_one_line_error(code, out, err, "nsys", r"needs nsys", r"NSYS=|PATH")
    assert "nsys export --type sqlite" in line
    assert fingerprint(report) == before


# ---- unreadable file ---------------------------------------------------------------------------------

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def _drop_dac_capabilities() -> None:
    """preexec_fn: root without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH obeys file modes like anyone else.

    Dropping them from the bounding set is enough: after exec, a uid-0 process's permitted set is its
    bounding set. (Demoting to `nobody` would work too, but there the interpreter's site-packages may not
    be readable, e.g. under a pyenv in /root.)
    """
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _demote_to_nobody() -> None:
    import pwd

    nobody = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)


def _can_read(path: Path, preexec) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import sys, click; open(sys.argv[1], 'rb').read(1)", str(path)],
                           preexec_fn=preexec, capture_output=True, text=True, check=False)
    return probe.returncode == 0


def _kvtrace_runs(preexec) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import kvtrace.analyzer.cli"], preexec_fn=preexec,
                           capture_output=True, text=True, cwd="/", check=False)
    return probe.returncode == 0


@pytest.fixture
def unreadable(tmp_path):
    """(path of a real export with mode 000, preexec_fn under which the CLI cannot read it)."""
    if os.geteuid() != 0:
        candidates = [None]
        folder = tmp_path
    else:
        candidates = [_drop_dac_capabilities, _demote_to_nobody]
        # A folder that `nobody` can traverse (pytest's tmp_path parent is 0700).
        folder = Path(tempfile.mkdtemp(prefix="kvtrace-unreadable-"))
        folder.chmod(0o755)
    path = folder / "unreadable.sqlite"
    shutil.copy2(GOOD_SQLITE, path)
    path.chmod(0)
    chosen, tried = None, []
    for preexec in candidates:
        try:
            if _kvtrace_runs(preexec) and not _can_read(path, preexec):
                chosen = (path, preexec)
                break
            tried.append(f"{getattr(preexec, '__name__', 'as is')}: file still readable or kvtrace not importable")
        except (OSError, subprocess.SubprocessError) as error:
            tried.append(f"{getattr(preexec, '__name__', 'as is')}: {error}")
    try:
        if chosen is None:
            message = "cannot make a file unreadable to the CLI here: " + "; ".join(tried)
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        yield chosen
    finally:
        path.chmod(0o644)
        if folder != tmp_path:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("command", COMMANDS)
def test_unreadable_file(command, unreadable, run_kvtrace):
    path, preexec = unreadable
    path.chmod(0o644)
    before = fingerprint(path)
    path.chmod(0)
    code, out, err = run_kvtrace(*argv(command, path), preexec_fn=preexec, cwd=Path("/"))
    path.chmod(0o644)
    assert fingerprint(path) == before
    assert_one_line_error(code, out, err, str(path), r"cannot read|permission", r"check its permissions")


# ---- damaged pages -------------------------------------------------------------------------------------


def _synthetic_damaged_kernel_page(tmp: Path) -> Path:
    """A real export with its last kernel-table leaf page overwritten by random bytes (size unchanged)."""
    source = GOOD_SQLITE
    conn = sqlite3.connect(f"{source.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
    try:
        pages = [p for (p,) in conn.execute("SELECT pageno FROM dbstat WHERE name = 'CUPTI_ACTIVITY_KIND_KERNEL' "
                                            "AND pagetype = 'leaf' ORDER BY pageno")]
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    except sqlite3.OperationalError:
        pytest.skip("this sqlite3 has no dbstat table to locate kernel pages")
    finally:
        conn.close()
    assert len(pages) >= 2
    data = bytearray(source.read_bytes())
    last = pages[-1]
    data[(last - 1) * page_size: last * page_size] = random.Random(7).randbytes(page_size)
    path = tmp / "synthetic-damaged-kernel-page.sqlite"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("command", COMMANDS)
def test_damaged_page(command, tmp_path, run_kvtrace):
    bad = _synthetic_damaged_kernel_page(tmp_path)
    before = fingerprint(bad)
    code, out, err = run_kvtrace(*argv(command, bad))
    assert fingerprint(bad) == before
    assert_one_line_error(code, out, err, str(bad), r"damaged|malformed|not a readable", r"export it again")


# ---- bad options ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["summary", "diff"])
def test_output_into_missing_folder(command, tmp_path, run_kvtrace):
    target = tmp_path / "no-such-folder" / "report.md"
    args = ["summary", GOOD_SQLITE] if command == "summary" else ["diff", GOOD_SQLITE, GOOD_SQLITE]
    code, out, err = run_kvtrace(*args, "--format", "markdown", "-o", target)
    assert_one_line_error(code, out, err, str(target.parent), r"does not exist", r"create it")
    assert not target.parent.exists()
    assert list(tmp_path.iterdir()) == []  # nothing created in the folder it ran from


def test_label_given_once(run_kvtrace):
    code, out, err = run_kvtrace("diff", GOOD_SQLITE, NSYS2023_DIR / "nvfp4.sqlite", "--label", "fp8")
    assert_one_line_error(code, out, err, "--label", r"two names", r"--label \S+ --label \S+")


@pytest.mark.parametrize("command", ["summary", "diff"])
def test_unknown_format(command, run_kvtrace):
    args = ["summary", GOOD_SQLITE] if command == "summary" else ["diff", GOOD_SQLITE, GOOD_SQLITE]
    code, out, err = run_kvtrace(*args, "--format", "xml")
    assert_one_line_error(code, out, err, "xml", r"--format", r"markdown|json|csv")


def test_output_is_a_directory(tmp_path, run_kvtrace):
    code, out, err = run_kvtrace("summary", GOOD_SQLITE, "-o", tmp_path)
    assert_one_line_error(code, out, err, str(tmp_path), r"directory")


BAD_RECIPES = {
    "not-toml": ("garbage = [\n", r"not valid TOML"),
    "unknown-key": ('[[rule]]\nid = "x"\nsegment = "gemm"\nmatch = "gemm"\nfrobnicate = 1\n', r"unknown key"),
    "bad-regex": ('[[rule]]\nid = "x"\nsegment = "gemm"\nmatch = "gemm(("\n', r"regex|regular expression|pattern"),
    "unknown-segment": ('[[rule]]\nid = "x"\nsegment = "warp_drive"\nmatch = "gemm"\n', r"segment"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
@pytest.mark.parametrize("command", ["summary", "diff"])
def test_bad_recipe_file(case, command, tmp_path, run_kvtrace):
    text, problem = BAD_RECIPES[case]
    recipe = tmp_path / f"{case}.toml"
    recipe.write_text(text)
    before = fingerprint(recipe)
    args = ["summary", GOOD_SQLITE] if command == "summary" else ["diff", GOOD_SQLITE, GOOD_SQLITE]
    code, out, err = run_kvtrace(*args, "--recipe", recipe)
    assert_one_line_error(code, out, err, str(recipe), problem)
    assert fingerprint(recipe) == before


def test_missing_recipe_file(tmp_path, run_kvtrace):
    recipe = tmp_path / "missing.toml"
    code, out, err = run_kvtrace("summary", GOOD_SQLITE, "--recipe", recipe)
    assert_one_line_error(code, out, err, str(recipe), r"cannot be read", r"check the path")
    assert not recipe.exists()
