"""Hostile input, round 2 (issue 26): values of the wrong type, patterns that never end, exports mid-write,
outputs onto what is read, active text, run directories read outside themselves. tests/test_hostile_input.py
holds round 1 and the helpers; this file is its continuation (kept apart to stay under ~600 lines).

Every CLI run goes through `kv` (no traceback, the inputs on the command line unchanged); every hostile input is
a copy of a real fixture edited in tmp_path. docs/reliability.md has a row per class.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from conftest import NSYS2025_DIR, REPEAT, fingerprint
from test_bad_input import assert_one_line_error
from test_hostile_input import FP8, KERNEL, NVFP4, SMALL, edited, kv, named  # noqa: F401 (kv is a fixture)

FIRST_KERNEL = f"(SELECT rowid FROM {KERNEL} ORDER BY start LIMIT 1)"
# Text that GitHub markdown would render: HTML, emphasis, a link, an emoji shortcode, and invisible marks.
ACTIVE = "<b>bold</b> *em* [link](https://evil.example) :cat: \u200e\u200f\u061c\u202a\u2066\u200b"
# The same in a file name, which cannot hold "/".
FILE_ACTIVE = "<b>bold<b> *em* [link](evil) :cat: \u200e\u202a"
INVISIBLE = "\u200e\u200f\u061c\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200b\ufeff"


def run_copy(tmp_path: Path, source: Path = NSYS2025_DIR) -> Path:
    run = tmp_path / "run"
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("*.nsys-rep"))
    return run


def edit_manifest(run: Path, edit) -> None:
    data = json.loads((run / "manifest.json").read_text())
    edit(data)
    (run / "manifest.json").write_text(json.dumps(data, allow_nan=True))


def outside_code_spans(markdown: str) -> str:
    """The markdown with its fenced blocks and code spans (which GitHub renders literally) cut out."""
    unfenced = re.sub(r"^(`{3,})[^\n]*\n.*?^\1$", "", markdown, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", unfenced)


# ==== 1. values of the wrong type in a trace: one line, exit 2 ====================================================

TRACE_VALUES = {
    "blob-kernel-name": ([f"UPDATE StringIds SET value = X'41ff42' WHERE id = (SELECT demangledName FROM {KERNEL} "
                          "ORDER BY start LIMIT 1)"], r"StringIds has BLOB \(not text\) values"),
    "blob-gpu-name": (["UPDATE TARGET_INFO_GPU SET name = X'41ff42'"], r"TARGET_INFO_GPU has BLOB \(not text\) "
                      "values in name"),
    "text-total-memory": (["UPDATE TARGET_INFO_GPU SET totalMemory = 'abc'"], r"TARGET_INFO_GPU has text \(not "
                          "integer\\) values in totalMemory"),
    "blob-metadata": (["UPDATE META_DATA_EXPORT SET value = X'ff00' WHERE name = 'EXPORT_PRODUCT_VERSION'"],
                      r"META_DATA_EXPORT has BLOB \(not text\) values in EXPORT_PRODUCT_VERSION"),
    # SQLite's `+` reads text as 0: these used to load as another launch shape or device.
    "text-gridX": ([f"UPDATE {KERNEL} SET gridX = 'abc' WHERE rowid = {FIRST_KERNEL}"], r"values in gridX"),
    "text-blockX": ([f"UPDATE {KERNEL} SET blockX = 'abc' WHERE rowid = {FIRST_KERNEL}"], r"values in blockX"),
    "text-deviceId": ([f"UPDATE {KERNEL} SET deviceId = 'abc' WHERE rowid = {FIRST_KERNEL}"], r"deviceId"),
    # Past its bits a value spilled into the next field of the packed signature.
    "huge-blockX": ([f"UPDATE {KERNEL} SET blockX = 4096 WHERE rowid = {FIRST_KERNEL}"], r"values in blockX"),
}


@pytest.mark.parametrize("kind", sorted(TRACE_VALUES))
def test_trace_values_of_the_wrong_type_are_one_line(kind, tmp_path, kv):
    statements, problem = TRACE_VALUES[kind]
    bad = edited(tmp_path, f"{kind}.sqlite", *statements)
    code, out, err = kv("summary", bad, "--no-cache")
    assert_one_line_error(code, out, err, str(bad), problem, r"export the report again")


def test_a_file_name_that_is_not_utf8_is_read_and_shown_as_its_bytes(tmp_path, kv):
    trace = Path(os.fsdecode(os.fsencode(tmp_path) + b"/run-\xff.sqlite"))
    shutil.copy2(SMALL, trace)
    reference = json.loads(kv("summary", SMALL, "--format", "json")[1])
    for fmt in ("table", "markdown", "csv", "json"):
        code, out, err = kv("summary", trace, "--format", fmt)
        assert code == 0, err
        if fmt in ("table", "markdown"):
            assert "run-\\xff" in out or "run-\\\\xff" in out
    data = json.loads(kv("summary", trace, "--format", "json")[1])
    assert data["segments"] == reference["segments"]  # the same numbers as the same export under a UTF-8 name


BAD_NUMBERS = [
    (["diff", SMALL, NVFP4, "--threshold", "nan"], "--threshold", r"not a finite number"),
    (["diff", SMALL, NVFP4, "--confidence", "nan"], "--confidence", r"not a finite number"),
    (["summary", SMALL, "--last", str(10 ** 19)], "--last", r"past int64"),
    (["summary", SMALL, "--time", "1" + "0" * 400 + ":"], "--time", r"past any trace's timeline"),
    (["capacity", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--memory", "inf"], "--memory",
     r"not in the range"),
    (["capacity", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--memory", "nan"], "--memory",
     r"not a finite number"),
    (["capacity", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--memory", "1e308"], "--memory",
     r"not in the range"),
    (["capacity", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--tokens", "1" + "0" * 400], "--tokens",
     r"past int64"),
    (["summary", SMALL, "--recipe", "/dev/zero"], "recipe /dev/zero", r"not a regular file"),
]


@pytest.mark.parametrize("args,names,problem", BAD_NUMBERS, ids=[" ".join(map(str, a[0][-2:])) for a in BAD_NUMBERS])
def test_numbers_past_their_range_are_one_line(args, names, problem, kv):
    code, out, err = kv(*args)
    assert_one_line_error(code, out, err, names, problem)


MANIFEST_VALUES = [
    (lambda m: m["environment"].update(packages=["torch"]), "environment.packages", "an object"),
    (lambda m: m["arms"]["fp8"].setdefault("kv_cache", {}).update(tokens=float("nan")), "arms.fp8.kv_cache.tokens",
     "a whole number of at least 1"),
    (lambda m: m["arms"]["fp8"].setdefault("kv_cache", {}).update(tokens=float("inf")), "arms.fp8.kv_cache.tokens",
     "a whole number of at least 1"),
    (lambda m: m["arms"]["fp8"]["workload"].update(engine={"block_size": "abc"}), "arms.fp8.workload.engine.block_size",
     "a whole number"),
    (lambda m: m["settings"].update(engine_flags={"fp8": "--enforce-eager"}), "settings.engine_flags.fp8", "a list"),
    (lambda m: m["arms"]["fp8"].setdefault("kv_cache", {}).update(tokens=1000, available_gib=-3.5),
     "arms.fp8.kv_cache.available_gib", "a number of 0 or more"),
    # A status is one that capture writes (manifest.RunStatus, CaptureStatus), or the rules on it would misread it.
    (lambda m: m["arms"]["fp8"].update(status="done"), "arms.fp8.status", 'one of "ok", "failed", "not run"'),
    (lambda m: m.update(status="finished"), "status", 'one of "ok", "partial", "failed", "interrupted"'),
]


@pytest.mark.parametrize("edit,where,wanted", MANIFEST_VALUES)
@pytest.mark.parametrize("command", ["report", "capacity"])
def test_manifest_values_of_the_wrong_type_are_one_line(edit, where, wanted, command, tmp_path, kv):
    run = run_copy(tmp_path)
    edit_manifest(run, edit)
    code, out, err = kv(command, run)
    assert_one_line_error(code, out, err, str(run / "manifest.json"), rf"{re.escape(where)} is not {wanted}",
                          r"capture the run")


@pytest.mark.parametrize("what", ["manifest", "config"])
def test_json_nested_100000_deep_is_one_line(what, tmp_path, kv):
    deep = "[" * 100_000 + "]" * 100_000
    if what == "manifest":
        run = run_copy(tmp_path)
        data = json.loads((run / "manifest.json").read_text())
        (run / "manifest.json").write_text(json.dumps(data)[:-1] + f', "deep": {deep}}}')
        code, out, err = kv("report", run)
        names = str(run / "manifest.json")
    else:
        (tmp_path / "config.json").write_text(f'{{"num_hidden_layers": {deep}}}')
        code, out, err = kv("capacity", "--config", tmp_path / "config.json")
        names = str(tmp_path / "config.json")
    assert_one_line_error(code, out, err, names, r"nested too deeply")


def _capacity_json(kv, config: dict, tmp_path: Path, *args) -> dict:
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = kv("capacity", "--config", tmp_path / "config.json", "--format", "json", *args, timeout=60)
    assert code == 0, err
    return json.loads(out)


def test_a_trillion_layers_are_sized_exactly(tmp_path, kv):
    layers = 10 ** 12
    data = _capacity_json(kv, {"num_hidden_layers": layers, "num_key_value_heads": 8, "head_dim": 128}, tmp_path,
                          "--memory", "80")
    fp8 = next(row for row in data["formats"] if row["format"] == "fp8")
    assert fp8["bytes_per_token"] == 2 * layers * 8 * 128  # K and V, one byte per value
    assert fp8["tokens_in_memory"] == 0  # not one token of 2 TB fits in 80 GiB


def test_a_billion_sliding_window_layers_are_counted_in_closed_form(tmp_path, kv):
    layers = 10 ** 9
    config = {"model_type": "gemma3_text", "num_hidden_layers": layers, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 1024}
    data = _capacity_json(kv, config, tmp_path)
    groups = {g["kind"]: g["layers"] for g in data["model"]["groups"]}
    # Gemma 3: every 6th layer (i + 1 divisible by 6) is full attention, the others keep a window.
    assert groups == {"full": layers // 6, "sliding": layers - layers // 6}


@pytest.mark.parametrize("layers", ["1" + "0" * 400, "NaN", "Infinity", "1e999"])
def test_a_layer_count_past_int64_in_a_config_is_one_line(layers, tmp_path, kv):
    (tmp_path / "config.json").write_text(f'{{"num_hidden_layers": {layers}, "num_key_value_heads": 1}}')
    code, out, err = kv("capacity", "--config", tmp_path / "config.json")
    assert_one_line_error(code, out, err, "num_hidden_layers", r"not a positive whole number below 2\^63")


def test_a_250_byte_output_name_is_written(tmp_path, kv):
    target = tmp_path / ("a" * 250 + ".md")  # its temporary sibling is cut to fit the 255-byte limit
    code, out, err = kv("summary", SMALL, "-o", target)
    assert code == 0, err
    assert target.read_text().startswith("## kvtrace summary")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_missing_path_with_a_newline_is_one_line(tmp_path, kv):
    code, out, err = kv("summary", tmp_path / "no\nsuch.sqlite")
    assert_one_line_error(code, out, err, "no\\nsuch.sqlite", r"no such file")


def test_an_error_line_shows_escape_and_bell_as_text(tmp_path, kv):
    code, out, err = kv("summary", tmp_path / "x\x1b]0;owned\x07.sqlite")
    assert_one_line_error(code, out, err, "x\\x1b]0;owned\\x07.sqlite", r"no such file")
    code, out, err = kv("summary", SMALL, "--window", "(\x1b[2J")
    assert_one_line_error(code, out, err, "\\x1b[2J", r"not a valid regex")


# ==== 2. nothing runs unbounded ===================================================================================

def _nvtx_named(tmp_path: Path, text: str) -> Path:
    """The 2025.3 export (which has NVTX ranges) with every range named `text`."""
    return edited(tmp_path, "nvtx.sqlite", f"UPDATE StringIds SET value = {_sql(text)} WHERE id IN (SELECT textId "
                  "FROM NVTX_EVENTS)", f"UPDATE NVTX_EVENTS SET text = {_sql(text)} WHERE text IS NOT NULL",
                  source=FP8)


def _sql(text: str) -> str:
    return "CAST(X'" + text.encode().hex() + "' AS TEXT)"


@pytest.mark.parametrize("pattern", ["(.+)+Z", "(a|a)*$", "(a+)+$"])
def test_a_catastrophic_window_pattern_is_stopped_or_answered(pattern, tmp_path, kv):
    """Python's re takes 2^40 steps on these; the `regex` package either finds the answer fast or stops at 1 s."""
    trace = _nvtx_named(tmp_path, "a" * 40 + "!")
    code, out, err = kv("summary", trace, "--window", pattern, timeout=120)
    if code == 0:
        pytest.fail(f"/{pattern}/ cannot match {'a' * 40}!: {out[:200]}")
    assert_one_line_error(code, out, err, pattern, r"took over 1 s|no kernels inside the window")


def test_a_catastrophic_window_pattern_on_the_real_fixture_ends(kv):
    code, out, err = kv("summary", FP8, "--window", "(.+)+Z", timeout=120)
    assert_one_line_error(code, out, err, "(.+)+Z", r"took over 1 s|no kernels inside the window")


def with_nvtx_ranges(source: Path, target: Path, count: int, name: str) -> Path:
    """A copy of the export `source` with `count` more NVTX ranges, each after the last range (no kernel in it), the
    i-th named by the SQL expression `name` of i (0 to count - 1); made in SQLite, not row by row in Python."""
    shutil.copy2(source, target)
    with sqlite3.connect(target) as conn:
        tid, end = conn.execute('SELECT globalTid, max("end") FROM NVTX_EVENTS').fetchone()
        conn.execute(f"""WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?)
                         INSERT INTO NVTX_EVENTS (start, "end", eventType, text, globalTid)
                         SELECT ? + 10 * i, ? + 10 * i + 5, 59, {name}, ? FROM n""", (count, end, end, tid))
    conn.close()
    return target


def test_100000_distinct_nvtx_names_load(tmp_path, kv):
    trace = with_nvtx_ranges(FP8, tmp_path / "many.sqlite", 100_000, "'kvtrace:decode ctx=' || i || ' batch=1'")
    reference = json.loads(kv("summary", FP8, "--format", "json")[1])
    code, out, err = kv("summary", trace, "--format", "json", "--no-cache", timeout=300)
    assert code == 0, err
    assert json.loads(out)["segments"] == reference["segments"]  # ranges without kernels change no number


def test_a_recipe_that_is_a_fifo_is_refused_at_once(tmp_path, kv):
    fifo = tmp_path / "recipe.toml"
    os.mkfifo(fifo)
    code, out, err = kv("summary", SMALL, "--recipe", fifo, timeout=60)
    assert_one_line_error(code, out, err, str(fifo), r"not a regular file")


# ==== 3. no silently wrong number =================================================================================

def test_kernels_that_overflow_an_int64_sum_are_refused(tmp_path, kv):
    bad = edited(tmp_path, "long.sqlite", f'UPDATE {KERNEL} SET "end" = start + 3000000000000000000 WHERE rowid IN '
                 f"(SELECT rowid FROM {KERNEL} ORDER BY rowid LIMIT 4)")
    code, out, err = kv("summary", bad, "--no-cache")
    assert_one_line_error(code, out, err, str(bad), r"past what kvtrace can sum exactly", r"export the report again")


def _copy_while_open(tmp_path: Path, name: str, journal: str, setup) -> Path:
    """A real export changed by an open connection and copied, with its -wal or -journal, before it closes."""
    work = tmp_path / f"work-{name}"
    shutil.copyfile(SMALL, work)  # bytes only: the unpacked fixtures are read-only
    conn = sqlite3.connect(work, isolation_level=None)
    try:
        setup(conn)
        conn.execute(f'UPDATE {KERNEL} SET "end" = "end" + 1000')
        shutil.copy2(work, tmp_path / name)
        shutil.copy2(f"{work}{journal}", tmp_path / f"{name}{journal}")
    finally:
        conn.close()
    return tmp_path / name


def test_an_export_with_committed_rows_in_its_wal_is_refused(tmp_path, kv):
    export = _copy_while_open(tmp_path, "wal.sqlite", "-wal", lambda c: c.execute("PRAGMA journal_mode=WAL"))
    wal = fingerprint(Path(f"{export}-wal"))
    code, out, err = kv("summary", export, "--no-cache")
    assert_one_line_error(code, out, err, str(export), r"rows in wal\.sqlite-wal", r"\.backup")
    assert fingerprint(Path(f"{export}-wal")) == wal


def test_an_export_with_a_hot_journal_is_refused(tmp_path, kv):
    def spilling_transaction(conn):
        conn.execute("PRAGMA cache_size=2")  # the update spills pages to the file, behind a synced journal
        conn.execute("BEGIN IMMEDIATE")

    export = _copy_while_open(tmp_path, "hot.sqlite", "-journal", spilling_transaction)
    journal = fingerprint(Path(f"{export}-journal"))
    code, out, err = kv("summary", export, "--no-cache")
    assert_one_line_error(code, out, err, str(export), r"unfinished transaction in hot\.sqlite-journal")
    assert fingerprint(Path(f"{export}-journal")) == journal


def test_an_export_locked_by_a_live_writer_is_refused(tmp_path, kv):
    export = tmp_path / "live.sqlite"
    shutil.copyfile(SMALL, export)  # bytes only: the unpacked fixtures are read-only
    conn = sqlite3.connect(export, isolation_level=None)
    try:
        conn.execute("PRAGMA cache_size=2")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(f'UPDATE {KERNEL} SET "end" = "end" + 1000')
        code, out, err = kv("summary", export, "--no-cache")
    finally:
        conn.execute("ROLLBACK")
        conn.close()
    assert_one_line_error(code, out, err, str(export), r"unfinished transaction", r"no writer is left")


@pytest.mark.parametrize("repeat", [(REPEAT / "fp8.sqlite", REPEAT / "fp8.sqlite"), (FP8, REPEAT / "nvfp4.sqlite")],
                         ids=["both-arms", "again"])
def test_repeat_with_a_file_used_twice_is_refused(repeat, kv):
    code, out, err = kv("diff", FP8, NVFP4, "--repeat", *repeat)
    assert_one_line_error(code, out, err, str(repeat[0]), r"are the same file", r"pass every run once")


# ==== 4. outputs never land on what is read =======================================================================

@pytest.mark.parametrize("command", ["diff", "capacity", "report"])
def test_output_onto_the_manifest_read_is_refused(command, tmp_path, kv):
    run = run_copy(tmp_path)
    manifest = run / "manifest.json"
    before = fingerprint(manifest)
    args = {"diff": ["diff", run / "fp8.sqlite", run / "nvfp4.sqlite"], "capacity": ["capacity", run],
            "report": ["report", run]}[command]
    code, out, err = kv(*args, "-o", manifest)
    assert_one_line_error(code, out, err, str(manifest), r"is the input", r"choose another output")
    assert fingerprint(manifest) == before


def test_plots_never_write_through_a_link_onto_an_input(tmp_path, kv):
    run = run_copy(tmp_path)
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "summary.png").symlink_to(run / "fp8.sqlite")
    before = fingerprint(run / "fp8.sqlite")
    code, out, err = kv("report", run, "--plots", plots, "-o", tmp_path / "report.md")
    assert_one_line_error(code, out, err, str(plots / "summary.png"), r"is the input")
    assert fingerprint(run / "fp8.sqlite") == before


# ==== 5. text from files and flags is inert =======================================================================

def test_active_text_from_traces_manifests_and_flags_is_inert_in_markdown(tmp_path, kv):
    run = run_copy(tmp_path)
    for arm in ("fp8", "nvfp4"):
        with sqlite3.connect(run / f"{arm}.sqlite") as conn:
            conn.execute("UPDATE TARGET_INFO_GPU SET name = ?", (f"NVIDIA {ACTIVE}",))
            conn.execute("UPDATE META_DATA_EXPORT SET value = ? WHERE name = 'EXPORT_PRODUCT_VERSION'", (ACTIVE,))
            conn.execute("UPDATE StringIds SET value = value || ? WHERE id IN (SELECT textId FROM NVTX_EVENTS)",
                         (ACTIVE,))
        conn.close()
    edit_manifest(run, lambda m: [phase.update(nvtx=phase["nvtx"] + ACTIVE) for arm in m["arms"].values()
                                  for phase in arm["workload"]["phases"]])
    named_file = tmp_path / f"<i>{FILE_ACTIVE}.sqlite"
    shutil.copy2(run / "fp8.sqlite", named_file)
    for args in (["report", run, "--label", f"<u>{ACTIVE}", "--label", "b"], ["diff", run / "fp8.sqlite",
                 run / "nvfp4.sqlite"], ["summary", named_file], ["summary", SMALL, "--label", ACTIVE]):
        code, out, err = kv(*args, "--format", "markdown")
        assert code == 0, err
        prose = outside_code_spans(out)
        for active in ("<b>", "<i>", "<u>", "*em*", ":cat:", *INVISIBLE):
            assert active not in prose, (active, args[0])
        assert not re.search(r"(?<!\\)\]\(", prose), args[0]  # `\](` is a bracket and text, `](` a link


@pytest.mark.parametrize("fmt", ["table", "markdown", "csv"])
def test_bidirectional_and_zero_width_marks_in_kernel_names_are_visible(fmt, tmp_path, kv):
    trace = named(tmp_path, f"void k{INVISIBLE}<int>(int)")
    code, out, err = kv("kernels", trace, "--format", fmt)
    assert code == 0, err
    assert not any(mark in out for mark in INVISIBLE)
    assert "\\u200e\\u200f\\u061c" in out


# ==== 6. a run directory is read inside itself ====================================================================

@pytest.mark.parametrize("where", ["dot-dot", "absolute", "link-out"])
def test_manifest_exports_outside_the_run_directory_are_refused(where, tmp_path, kv):
    run = run_copy(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy2(FP8, outside / "fp8.sqlite")
    if where == "link-out":
        (run / "fp8.sqlite").unlink()
        (run / "fp8.sqlite").symlink_to(outside / "fp8.sqlite")
    else:
        listed = "../elsewhere/fp8.sqlite" if where == "dot-dot" else str(outside / "fp8.sqlite")
        edit_manifest(run, lambda m: m["arms"]["fp8"].update(sqlite=listed))
    code, out, err = kv("report", run)
    assert_one_line_error(code, out, err, "arm fp8", r"outside the run directory", r"--exports-from")
    # Named on the command line, the folder is read.
    code, out, err = kv("report", run, "--exports-from", outside, "--format", "json")
    assert code == 0, err


def test_a_manifest_pointing_at_a_system_file_opens_nothing(tmp_path, kv):
    run = run_copy(tmp_path)
    edit_manifest(run, lambda m: m["arms"]["fp8"].update(sqlite="../../../../../../etc/passwd"))
    code, out, err = kv("report", run)
    assert_one_line_error(code, out, err, "etc/passwd", r"outside the run directory")
    assert "not an SQLite file" not in err
