"""Hostile input, round 3 (issue 35): serving numbers from run directories, text in plots, Parquet folders, the
export cache of .nsys-rep reports, `capture import`, the process's own environment, and text that stays active.
tests/test_hostile_input.py holds round 1 and the helpers, tests/test_hostile_input_round2.py round 2.

Every CLI run goes through `kv` (no traceback, the inputs on the command line unchanged); every hostile input is
a copy of a real fixture edited in tmp_path. docs/reliability.md has a row per kind.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import regex

from conftest import (NSYS2023_DIR, NSYS2023_REPORTS, NSYS2025_DIR, PARQUET_2025, REPO, SERVE_RUNS, TORCH_H200,
                      VLLM033_RUNS)
from test_bad_input import assert_one_line_error
from test_hostile_input import KERNEL, NVFP4, SMALL, json_of, kv, without_dac  # noqa: F401 (kv, without_dac: fixtures)
from test_hostile_input_round2 import outside_code_spans, run_copy, with_nvtx_ranges


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


@pytest.mark.parametrize("requests,where,wanted", [
    (16, None, None), ({"file": "fp8.requests.json", "requests": 16, "cached_tokens": 0}, None, None),
    ("16", "requests", "a number of 0 or more or an object"),
    ({"file": "fp8.requests.json", "cached_tokens": -1}, "requests.cached_tokens", "a number of 0 or more"),
])
def test_a_points_requests_is_a_count_or_the_relays_summary(requests, where, wanted, tmp_path):
    """A point's `requests` is the offline worker's count or the usage relay's summary: a value of neither kind names
    both, and a summary names its own field that is wrong."""
    from kvtrace.errors import KvtraceError
    from kvtrace.manifest import read_manifest

    data = json.loads((VLLM033_RUNS["offline-cold-prefill"] / "manifest.json").read_text())
    data["arms"]["fp8"]["points"][0]["requests"] = requests
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(data))
    if where is None:
        read_manifest(path)
    else:
        with pytest.raises(KvtraceError, match=re.escape(f"arms.fp8.points[0].{where} is not {wanted}:")):
            read_manifest(path)


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


# ==== 3. Parquet folders ==========================================================================================

def parquet_copy(tmp_path: Path, name: str = "pq") -> Path:
    folder = tmp_path / name
    shutil.copytree(PARQUET_2025 / "fp8", folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    return folder


def _first_kernel_name_id(folder: Path) -> int:
    return pq.read_table(folder / f"{KERNEL}.parquet", columns=["demangledName"]).column(0)[0].as_py()


def _rewrite(path: Path, table, **options) -> None:
    pq.write_table(table, path, **options)


def _invalid_utf8(folder: Path) -> None:
    strings = pq.read_table(folder / "StringIds.parquet")
    values = [v.encode() for v in strings.column("value").to_pylist()]
    values[strings.column("id").to_pylist().index(_first_kernel_name_id(folder))] = b"void k\xff<int>()"
    _rewrite(folder / "StringIds.parquet",
             strings.set_column(1, "value", pa.array(values, pa.large_binary()).view(pa.large_string())))


def _column_twice(folder: Path) -> None:
    kernels = pq.read_table(folder / f"{KERNEL}.parquet")
    _rewrite(folder / f"{KERNEL}.parquet", kernels.append_column("start", kernels.column("start")))


def _id_twice(folder: Path) -> None:
    strings = pq.read_table(folder / "StringIds.parquet")
    again = pa.table({"id": pa.array([_first_kernel_name_id(folder)], pa.int32()),
                      "value": pa.array(["void renamed()"], pa.large_string())}, schema=strings.schema)
    _rewrite(folder / "StringIds.parquet", pa.concat_tables([again, strings]))


PARQUET_DAMAGE = {
    # Arrow reads UTF-8 unchecked; polars panicked on it (PanicException, exit 1).
    "invalid-utf8": (_invalid_utf8, r"StringIds has invalid UTF-8 \(not text\) values in value"),
    "column-twice": (_column_twice, rf"{KERNEL}\.parquet has column start more than once"),
    # SQLite's primary key makes ids unique; here the first row's name silently replaced the kernel's.
    "id-twice": (_id_twice, r"StringIds\.parquet holds id \d+ more than once"),
}


@pytest.mark.parametrize("kind", sorted(PARQUET_DAMAGE))
def test_damaged_parquet_folders_are_one_line(kind, tmp_path, kv):
    damage, problem = PARQUET_DAMAGE[kind]
    folder = parquet_copy(tmp_path)
    damage(folder)
    code, out, err = kv("summary", folder, "--no-cache")
    assert_one_line_error(code, out, err, str(folder), problem, r"export the report again")


def test_a_parquet_file_of_one_row_groups_reads_as_its_rows(tmp_path, kv):
    folder = parquet_copy(tmp_path)
    for table in (KERNEL, "CUPTI_ACTIVITY_KIND_RUNTIME"):
        # 2,056 kernels and 3,612 runtime calls, a row group each: read one group at a time, this took 500 s.
        _rewrite(folder / f"{table}.parquet", pq.read_table(folder / f"{table}.parquet"), row_group_size=1)
    assert pq.read_metadata(folder / f"{KERNEL}.parquet").num_row_groups > 2000
    reference = json.loads(kv("summary", PARQUET_2025 / "fp8", "--format", "json", "--no-cache")[1])
    code, out, err = kv("summary", folder, "--format", "json", "--no-cache", child=True, timeout=300)
    assert code == 0, err
    assert json.loads(out)["segments"] == reference["segments"]


@pytest.mark.slow
def test_a_parquet_decompression_bomb_is_said_to_exceed_memory(tmp_path, kv):
    folder = parquet_copy(tmp_path)
    strings = pq.read_table(folder / "StringIds.parquet")
    zeros = pa.array([b"\0" * (256 << 20)], pa.large_binary()).view(pa.large_string())
    # 5 GiB of text in 170 kB: past the 4 GiB this kvtrace may allocate (ulimit -v below).
    with pq.ParquetWriter(folder / "StringIds.parquet", strings.schema, compression="zstd", write_statistics=False,
                          use_dictionary=False) as writer:
        writer.write_table(strings)
        for number in range(20):
            writer.write_table(pa.table({"id": pa.array([10 ** 6 + number], pa.int32()), "value": zeros},
                                        schema=strings.schema))

    def four_gib():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    code, out, err = kv("summary", folder, "--no-cache", preexec_fn=four_gib, timeout=300)
    assert_one_line_error(code, out, err, str(folder / "StringIds.parquet"), r"not enough memory to read it \(its "
                          r"pages decompress to 5\.0 GiB\)", r"decompression bomb")
    assert "damaged" not in err


# ==== 4. the export cache of .nsys-rep reports ====================================================================

def standin_nsys(tmp_path: Path, *, hang: bool = False) -> Path:
    """An nsys whose `export --type=sqlite` copies the real 2023.4 export of the report it is given (fixtures
    hold both) and counts its exports in exports.log; `hang`: it never returns."""
    script = tmp_path / "nsys"
    script.write_text(f"""#!/bin/bash
[ "$1" = --version ] && {{ echo "NVIDIA Nsight Systems version 2023.4.4.54-234433681190v0"; exit 0; }}
{'sleep 100000' if hang else ''}
for a in "$@"; do case "$a" in --output=*) out="${{a#--output=}}";; esac; report="$a"; done
echo "$report" >> {tmp_path}/exports.log
cp {NSYS2023_DIR}/"$(basename "$report" .nsys-rep)".sqlite "$out"
""")
    script.chmod(0o755)
    return script


def _report(tmp_path: Path, name: str = "fp8") -> Path:
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    shutil.copy2(NSYS2023_REPORTS / f"{name}.nsys-rep", folder / f"{name}.nsys-rep")
    return folder / f"{name}.nsys-rep"


def _exports(tmp_path: Path) -> int:
    return len((tmp_path / "exports.log").read_text().splitlines())


def _cached_export(cache_dir: Path) -> Path:
    [export] = [p for p in (cache_dir / "exports").iterdir() if p.name.endswith(".sqlite")]
    return export


CACHE_DAMAGE = {
    "truncated": lambda export: os.truncate(export, 4096),
    "flipped-byte": lambda export: export.write_bytes(export.read_bytes()[:-100] + b"\x01" + export.read_bytes()[-99:]),
    # Another report's export at this one's name (its bytes, or a link to it).
    "another-reports": lambda export: shutil.copyfile(NSYS2023_DIR / "nvfp4.sqlite", export),
    "link": lambda export: (export.unlink(), export.symlink_to(NSYS2023_DIR / "nvfp4.sqlite")),
    "folder": lambda export: (export.unlink(), export.mkdir(), (export / "x").write_text("x")),
}


@pytest.mark.parametrize("damage", sorted(CACHE_DAMAGE))
def test_a_cached_export_that_is_not_its_reports_is_exported_again(damage, tmp_path, cache_dir, kv):
    report, nsys = _report(tmp_path), standin_nsys(tmp_path)
    reference = json_of(kv, "kernels", NSYS2023_DIR / "fp8.sqlite", "--no-cache")["rows"]
    assert json_of(kv, "kernels", report, "--no-cache", env={"NSYS": str(nsys)})["rows"] == reference
    export = _cached_export(cache_dir)
    CACHE_DAMAGE[damage](export)
    code, out, err = kv("kernels", report, "--no-cache", "--format", "json", env={"NSYS": str(nsys)})
    assert code == 0, err
    assert json.loads(out)["rows"] == reference and _exports(tmp_path) == 2
    assert _cached_export(cache_dir).is_file() and not _cached_export(cache_dir).is_symlink()
    assert json_of(kv, "kernels", report, "--no-cache", env={"NSYS": str(nsys)})["rows"] == reference
    assert _exports(tmp_path) == 2  # sealed again: used as is


def test_a_read_only_exports_folder_is_passed_over(tmp_path, cache_dir, kv, without_dac):
    report, nsys = _report(tmp_path), standin_nsys(tmp_path)
    (cache_dir / "exports").mkdir(mode=0o500)
    code, out, err = kv("kernels", report, "--format", "json", env={"NSYS": str(nsys), "TMPDIR": str(tmp_path)},
                        preexec_fn=without_dac or (lambda: None))
    assert code == 0, err
    assert re.fullmatch(r"kvtrace: warning: cache folder \S+/exports cannot be written; not using it: make it "
                        r"writable, or set KVTRACE_CACHE_DIR\n(kvtrace: note: .*\n)?", err), err
    assert list((cache_dir / "exports").iterdir()) == []


# ==== 5. capture import stays inside the run directory and never waits on a FIFO ==================================

def _importable_run(tmp_path: Path) -> Path:
    from test_capture_import import as_recorded

    return as_recorded(VLLM033_RUNS["offline-decode-heavy"], tmp_path / "run")  # fp8 and nvfp4 to take up


@pytest.mark.parametrize("where", ["sqlite", "log"])
def test_capture_import_refuses_a_fifo_at_once(where, tmp_path, run_kvtrace):
    run = _importable_run(tmp_path)
    fifo = run / f"nvfp4.{where}"
    fifo.unlink(missing_ok=True)
    if where == "log":
        (run / "nvfp4.sqlite").unlink()  # so that the run is exported, which logs
        (run / "nvfp4.nsys-rep").write_bytes(b"stand-in report\n")
    os.mkfifo(fifo)
    code, out, err = run_kvtrace("capture", "import", run, "--nsys", standin_nsys(tmp_path), child=True, timeout=120)
    assert code == 1 and "Traceback" not in err, err
    assert f"nvfp4: not imported (nvfp4.{where} is not a regular file (a FIFO" in out, out
    assert "fp8: ok" in out
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("where", ["log", "manifest", "arm-manifest"])
def test_capture_import_never_writes_through_a_link_out_of_the_run(where, tmp_path, run_kvtrace):
    run = _importable_run(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    name = {"log": "nvfp4.log", "manifest": "manifest.json", "arm-manifest": "nvfp4.manifest.json"}[where]
    if where == "log":
        (run / "nvfp4.sqlite").unlink()
        (run / "nvfp4.nsys-rep").write_bytes(b"stand-in report\n")
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to(outside)
    else:
        shutil.move(run / name, outside)
        (run / name).symlink_to(outside)
    before = outside.read_bytes()
    code, out, err = run_kvtrace("capture", "import", run, "--nsys", standin_nsys(tmp_path), child=True, timeout=120)
    assert "Traceback" not in err, err
    if where == "log":
        assert code == 1 and "nvfp4: not imported (nvfp4.log is a link" in out, out
    else:
        assert code == 2 and err.startswith(f"kvtrace: error: {run / name} is a link") and err.count("\n") == 1, err
    assert outside.read_bytes() == before


# ==== 6. the process's own environment ============================================================================

@pytest.mark.parametrize("step", ["version", "export"])
def test_an_nsys_that_never_returns_is_stopped_naming_the_step(step, tmp_path, cache_dir, run_kvtrace):
    report, nsys = _report(tmp_path), standin_nsys(tmp_path, hang=True)
    if step == "version":
        nsys.write_text(nsys.read_text().replace("#!/bin/bash\n", "#!/bin/bash\nsleep 100000\n", 1))
    code, out, err = run_kvtrace("kernels", report, "--nsys", nsys, env={"KVTRACE_STEP_LIMIT_S": "2"}, child=True,
                                 timeout=120)
    named = f"`{nsys} --version`" if step == "version" else f"nsys export of {report}"
    assert_one_line_error(code, out, err, named, r"did not finish within 2 s and was stopped")
    assert not list(cache_dir.rglob("*.sqlite"))  # nothing half-exported left


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_a_step_limit_that_is_no_time_is_one_line(value, tmp_path, cache_dir, run_kvtrace):
    code, out, err = run_kvtrace("kernels", _report(tmp_path), "--nsys", standin_nsys(tmp_path),
                                 env={"KVTRACE_STEP_LIMIT_S": value}, child=True)
    assert_one_line_error(code, out, err, f"KVTRACE_STEP_LIMIT_S={value}", r"not a number of seconds above 0")


HOSTILE_LABEL = "é→µ–"  # none of these is ASCII; → is not Latin-1 either


@pytest.mark.parametrize("encoding", ["C-locale", "ascii", "latin-1"])
@pytest.mark.parametrize("fmt", ["table", "markdown"])
def test_an_output_encoding_that_cannot_hold_the_text_shows_escapes(encoding, fmt, tmp_path):
    changes = {"LC_ALL": "C", "PYTHONUTF8": "0"} if encoding == "C-locale" else {"PYTHONIOENCODING": encoding}
    env = {key: value for key, value in {**os.environ, **changes}.items()
           if key not in ("LANG", "PYTHONIOENCODING") or key in changes}
    done = subprocess.run([sys.executable, "-m", "kvtrace", "summary", str(SMALL), "--label", HOSTILE_LABEL,
                           "--format", fmt], capture_output=True, env=env, cwd=tmp_path, timeout=300)
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    out = done.stdout.decode("latin-1" if encoding == "latin-1" else "ascii")
    # Under the C locale the label arrives as undecodable bytes, shown as such; else what the encoding lacks is an
    # escape (Latin-1 holds é, µ).
    arrow = "\\u2192" if encoding != "C-locale" else "\\\\xe2\\\\x86\\\\x92" if fmt == "markdown" else "\\xe2\\x86\\x92"
    assert arrow in out, out[:300]


def test_a_closed_standard_output_or_error_is_no_traceback(tmp_path):
    def closed(descriptor):
        return lambda: os.close(descriptor)

    def kvtrace(*args, descriptor):
        return subprocess.run([sys.executable, "-m", "kvtrace", *map(str, args)], capture_output=True, text=True,
                              preexec_fn=closed(descriptor), cwd=tmp_path, timeout=300)

    assert kvtrace("summary", SMALL, descriptor=1).returncode == 0
    written = kvtrace("summary", SMALL, "-o", tmp_path / "out.md", descriptor=1)
    assert written.returncode == 0 and (tmp_path / "out.md").read_text().startswith("## kvtrace summary")
    refused = kvtrace("summary", tmp_path / "missing.sqlite", descriptor=2)
    assert refused.returncode == 2 and "Traceback" not in refused.stdout


@pytest.mark.parametrize("fmt", ["table", "markdown", "json"])
def test_a_full_disk_on_standard_output_is_one_line(fmt, tmp_path):
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "kvtrace", "summary", str(SMALL), "--format", fmt], stdout=full,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=300)
    assert_one_line_error(done.returncode, "", done.stderr, "standard output", r"no space left on device", r"-o FILE")


@pytest.mark.parametrize("value", ["0", "-1", "many", ""])
def test_polars_max_threads_that_is_no_count_is_one_line(value, run_kvtrace):
    code, out, err = run_kvtrace("summary", SMALL, "--no-cache", env={"POLARS_MAX_THREADS": value}, child=True)
    if value == "":  # unset in effect
        assert code == 0, err
    else:
        assert_one_line_error(code, out, err, f"POLARS_MAX_THREADS={value}", r"not a number of threads of 1 or more")


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, kv):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir(mode=0o700)
    code, out, err = kv("summary", SMALL, "--format", "json", cwd=work,
                        env={"KVTRACE_CACHE_DIR": None, "XDG_CACHE_HOME": "relative-cache", "HOME": str(home)})
    assert code == 0, err
    assert list(work.iterdir()) == []  # not ./relative-cache/kvtrace
    assert (home / ".cache" / "kvtrace" / "traces").is_dir()  # the spec's default, ~/.cache


def test_100000_labels_are_one_line(kv):
    code, out, err = kv("diff", SMALL, NVFP4, *[word for n in range(100_000) for word in ("--label", f"x{n}")])
    assert_one_line_error(code, out, err, "200,003 command-line words", r"past the 10,000 kvtrace reads")


# ==== 7. text that stays inert ====================================================================================

FP8_2025 = NSYS2025_DIR / "fp8.sqlite"
PING = "@octocat @org/team https://evil.example/x www.evil.example"


def _prose(markdown: str) -> str:
    """What GitHub renders as text or markup: outside code spans, with kvtrace's own inert comments removed
    (`@<!-- -->octocat` renders as "@octocat" text, no ping)."""
    return outside_code_spans(markdown)


def test_recipe_rule_ids_and_file_names_are_inert_in_markdown(tmp_path, kv):
    recipe = tmp_path / "<img src=x>@octocat.toml"
    recipe.write_text('order = 1\ndescription = "<img src=x> </details> [d](javascript:alert(1)) <!--"\n'
                      '[[rule]]\nid = "<img src=y></details>[a](javascript:alert(1))<!--@octocat"\n'
                      'segment = "other"\nmatch = "Functor"\n'
                      'note = "<b>n</b> </details> [n](javascript:x) <!-- https://evil.example"\n')
    code, out, err = kv("kernels", FP8_2025, "--recipe", recipe, "--format", "markdown")
    assert code == 0, err
    prose = _prose(out)
    for active in ("<img", "</details>", "<b>", r"\]\(javascript", "@octocat", "https://evil", "<!--(?! -->)"):
        assert not re.search(rf"(?<!\\){active}", prose), active
    assert "`<img src=x>@octocat.toml:<img src=y></details>[a](javascript:alert(1))<!--@octocat`" in out


def test_mentions_and_bare_urls_in_labels_gpu_names_and_capture_metadata_are_inert(tmp_path, kv):
    run = run_copy(tmp_path)
    for arm in ("fp8", "nvfp4"):
        with sqlite3.connect(run / f"{arm}.sqlite") as conn:
            conn.execute("UPDATE TARGET_INFO_GPU SET name = ?", (f"NVIDIA {PING}",))
            conn.execute("UPDATE META_DATA_CAPTURE SET value = ? WHERE name LIKE '%CUDA_GRAPH_TRACE_OPTIONS:MODE'",
                         ("<img src=x> **Node** [x](https://evil.example) @octocat :cat:",))
        conn.close()
    for args in (["report", run, "--label", f"a {PING}", "--label", "b :cat:"], ["summary", run / "fp8.sqlite",
                 "--label", PING], ["diff", run / "fp8.sqlite", run / "nvfp4.sqlite", "--label", PING, "--label", "b"]):
        code, out, err = kv(*args, "--format", "markdown")
        assert code == 0, err
        prose = _prose(out)
        for active in ("@octocat", "@org", "https://", r"www\.evil", "<img", r"\*\*Node", ":cat:"):
            assert not re.search(rf"(?<!\\){active}", prose), (active, args[0])
        assert not re.search(r"(?<!\\)\]\(", prose), args[0]
        assert "@<!-- -->octocat" in prose and "https:<!-- -->//evil.example" in prose


def test_shortcodes_stay_text_in_the_terminal_table(tmp_path, kv):
    code, out, err = kv("summary", SMALL, "--label", ":cat: :smile:")
    assert code == 0, err
    assert ":cat: :smile:" in out and "\N{CAT FACE}" not in out and "\N{SMILING FACE WITH OPEN MOUTH}" not in out


# ==== 8. a million distinct NVTX names, engine flags after -- =====================================================

def test_names_without_a_counter_word_keep_their_name_and_the_rest_are_keyed_in_full():
    from kvtrace.analyzer import names

    with sqlite3.connect(f"file:{TORCH_H200 / 'block-a.sqlite'}?mode=ro", uri=True) as conn:
        real = [text for (text,) in conn.execute("SELECT DISTINCT text FROM NVTX_EVENTS WHERE text IS NOT NULL")]
    conn.close()
    assert any("op_id = " in name for name in real)  # PyTorch's numbered operator ranges
    counters = [regex.compile(p) for p in names.COUNTERS]
    every = [*real, "kvtrace:decode ctx=2048 batch=8", "r123", "Step 5", "epoch7", "ProfilerStep#3"]
    assert names.NameKey().of(every) == [names._key(name, counters, []) for name in every]


@pytest.mark.slow
def test_a_million_distinct_nvtx_names_load(tmp_path, kv):
    trace = with_nvtx_ranges(FP8_2025, tmp_path / "million.sqlite", 1_000_000, "'range ' || i")
    reference = json_of(kv, "summary", FP8_2025)
    assert json_of(kv, "summary", trace, "--no-cache")["segments"] == reference["segments"]


@pytest.mark.parametrize("flags", [["--tensor-parallel-size=x"], ["--tensor-parallel-size", "x"], ["-tp=0"],
                                   ["--tensor-parallel-size"]])
def test_a_tensor_parallel_flag_that_is_no_size_is_one_line(flags, tmp_path, kv):
    code, out, err = kv("capture", "vllm", "--model", REPO / "fixtures" / "models" / "llama-tiny", "--out",
                        tmp_path / "run", "--", *flags)
    assert_one_line_error(code, out, err, "extra vLLM arguments", r"is not a tensor-parallel size")
    assert not (tmp_path / "run").exists()
    # A run directory whose manifest records one: `capacity` and `report` read the size from it.
    [run] = serve_pair(tmp_path, "sweep", lambda arm, data: data["settings"].update(extra_vllm_args=flags))[1:]
    code, out, err = kv("capacity", run)
    assert_one_line_error(code, out, err, f"{run}: its engine flags", r"is not a tensor-parallel size",
                          r"capture the run again")
