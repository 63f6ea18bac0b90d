"""Shared test fixtures: the real Nsight Systems exports, a CLI runner, and the nsys 2023.4.4 CLI.

Behaviour tests use the real H200 and H100 exports under fixtures/ (fixtures/README.md says which GPU recorded
each) and the real bad-input
artefacts under fixtures/bad/ (see fixtures/bad/README.md). Bad inputs that have no real counterpart are
built per test in tmp_path from the real exports, and their names say "synthetic".
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

# One of several test processes (pytest-xdist, one per core) computes on one thread: numpy's OpenBLAS and torch would
# start a thread per core in every process, and their busy waiting on cores the other processes use made the
# BLAS-heavy checks (test_flashinfer_quality) three times slower. Read when numpy and torch load, which is after this;
# child processes inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _threads in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_threads, "1")

# The capture's dry runs print the environment it gives vLLM, which keeps a user's own sampler setting
# (vllm_config.child_env): the golden plans are of a user who set none.
os.environ.pop("VLLM_USE_FLASHINFER_SAMPLER", None)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
# Its two .nsys-rep reports, kept unpacked beside the pack of the rest (make bench-export's default REPORTS).
NSYS2023_REPORTS = FIXTURES / "fi-h200-sm90-nsys2023"
BAD_DIR = FIXTURES / "bad"
SERVE_PACKS = FIXTURES / "vllm-h200-serve"  # serve-mode vLLM runs packed by its pack_run.py (RUN.tar.xz)
VLLM033_PACKS = FIXTURES / "vllm033-h200"  # vLLM 0.33 FP8 vs NVFP4 runs, packed the same way
# vLLM 0.33 FP8 vs NVFP4 on the Llama-3.1-8B-shaped dummy model: the capacity-bound region (issue 33)
VLLM033_8B_PACKS = FIXTURES / "vllm033-h200-8b"


def _unpack(pack: Path, *, named: bool = False) -> Path:
    """A packed run directory, unpacked once per content into a folder outside the source tree (under
    $KVTRACE_FIXTURE_CACHE, else the system's temporary folder), its files read-only like fixtures/.
    named: a pack in fixtures/DIR/ holds DIR/, and the unpacked folder keeps that name inside the digest's folder
    (reports label a run by its directory's name)."""
    digest = sha256(pack)[:16]
    root = Path(os.environ.get("KVTRACE_FIXTURE_CACHE") or tempfile.gettempdir()) / f"kvtrace-fixtures-{os.getuid()}"
    done = root / f"{pack.parent.name}-{pack.name.removesuffix('.tar.xz')}-{digest}"
    if not done.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=root, prefix=".unpacking-"))
        with tarfile.open(pack, "r:xz") as tar:
            tar.extractall(scratch, filter="data")
        for path in scratch.rglob("*"):
            if path.is_file():
                path.chmod(0o444)
        (unpacked,) = scratch.iterdir()  # the archive holds one run directory
        try:
            (scratch if named else unpacked).rename(done)
        except OSError:  # another session, or another xdist worker, unpacked it meanwhile
            pass
        shutil.rmtree(scratch, ignore_errors=True)
    return done / pack.parent.name if named else done


def edited_exports(source: Path, folder: Path, pattern: str, *statements: str) -> Path:
    """A copy of run directory `source` in `folder` whose exports matching `pattern` had the SQL `statements` run on
    them: a constructed case, never the fixture itself."""
    import sqlite3

    run = folder / source.name
    shutil.copytree(source, run)
    for export in run.glob(pattern):
        export.chmod(0o644)
        with sqlite3.connect(export) as conn:
            for statement in statements:
                conn.execute(statement)
    return run


def exports_in(folder: Path) -> list[Path]:
    """What is in a cache's exports folder, sorted, less the seals of SQLite exports (NAME.sqlite.json beside each,
    analyzer/cache.py)."""
    return sorted(p for p in folder.iterdir() if not p.name.endswith(".sqlite.json"))


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# The serve-mode run directories (fixtures/README.md), by pack name: prefix-reuse-auto, ..., sweep-fp8.
SERVE_RUNS = {pack.name.removesuffix(".tar.xz"): _unpack(pack) for pack in sorted(SERVE_PACKS.glob("*.tar.xz"))}
# PyTorch programs recorded with PyTorch's own operator ranges (fixtures/torch-h200/record.sh), not by kvtrace.
TORCH_H200 = _unpack(FIXTURES / "torch-h200" / "torch-h200.tar.xz")
# nsys-ai's two-H100 PyTorch pair (before.sqlite, after.sqlite), cut to what kvtrace reads (fixtures/README.md).
TORCH_H100X2 = _unpack(FIXTURES / "torch-h100x2" / "torch-h100x2.tar.xz", named=True)
# The vLLM 0.33 run directories (fixtures/README.md): offline-cold-prefill, ..., serve-sweep.
VLLM033_RUNS = {pack.name.removesuffix(".tar.xz"): _unpack(pack) for pack in sorted(VLLM033_PACKS.glob("*.tar.xz"))}
# The older H200 runs of the 8B shape that the matrix does not replace: the offline cold prefill that fixtures/repro's
# script comes from, and the preemption run with the quality prompts.
VLLM033_8B_RUNS = {pack.name.removesuffix(".tar.xz"): _unpack(pack)
                   for pack in sorted(VLLM033_8B_PACKS.glob("*.tar.xz"))}
# The whole capacity matrix of the 8B shape, recorded by `kvtrace capture vllm-matrix` on an H100 (issue 46): one
# server per arm, three interleaved rounds, a traced pass in every point before its timed traffic
# (fixtures/README.md); its runs by scenario.
MATRIX = _unpack(FIXTURES / "vllm033-h100-matrix" / "vllm033-h100-matrix.tar.xz", named=True)
MATRIX_RUNS = {run.name: run for run in sorted(MATRIX.iterdir()) if (run / "manifest.json").is_file()}
# The first matrix recording (2026-12-06), whose windows stalled its timed traffic, cut to what it alone holds: the
# counterfactual arm (counterfactual/cold-prefill, counterfactual/sweep), the sweep its stock runs were copied from,
# the co-residence check (checks/co-residence) and its matrix.json.
COUNTERFACTUAL = _unpack(FIXTURES / "vllm033-h100-counterfactual" / "vllm033-h100-counterfactual.tar.xz", named=True)
# The same matrix recorded twice on 2026-12-07: with 8-step windows inside each point's timed traffic, and with each
# window around a traced pass before it (cut to the manifests and bench timelines; fixtures/README.md).
WINDOW_STALL = _unpack(FIXTURES / "vllm033-h100-window-stall" / "vllm033-h100-window-stall.tar.xz", named=True)
# The older runs, each packed whole as fixtures/RUN/RUN.tar.xz (fixtures/README.md), by run name.
PACKED_RUNS = {run: _unpack(FIXTURES / run / f"{run}.tar.xz", named=True) for run in (
    "fi-h200-sm90", "fi-h200-sm90-nsys2023", "fi-h200-sm90-repeat", "fi-h200-sm90-repeats2", "fi-h200-sm90-quality",
    "fi-h200-sm90-gaussian", "fi-h200-sm90-outliers", "vllm-h200-cold-prefill", "vllm-h200-decode-heavy",
    "fi-h100-sm90-gaussian-fi0.7.2.post1")}
NSYS2025_DIR = PACKED_RUNS["fi-h200-sm90"]  # Nsight Systems 2025.3.2, export schema 3.20.3
NSYS2023_DIR = PACKED_RUNS["fi-h200-sm90-nsys2023"]  # Nsight Systems 2023.4.4, export schema 3.7.2
REPEAT = PACKED_RUNS["fi-h200-sm90-repeat"]  # fi-h200-sm90 recorded again, on another machine
REPEATS2 = PACKED_RUNS["fi-h200-sm90-repeats2"]  # `--repeats 2`: fp8.r1 nvfp4.r1 fp8.r2 nvfp4.r2
# fi-h200-sm90's workload recorded again with each format's attention error per point (issue 36): on torch 2.11's
# coarse BF16 CPU normal (no drawn_as), then on float32 normals rounded to BF16 with each kernel's distance from its own
# dequantized cache (kernel_vs_format), Gaussian and with outlier channels in K and V (--inputs outliers).
FI_QUALITY = PACKED_RUNS["fi-h200-sm90-quality"]
FI_GAUSSIAN = PACKED_RUNS["fi-h200-sm90-gaussian"]
FI_OUTLIERS = PACKED_RUNS["fi-h200-sm90-outliers"]
# FI_GAUSSIAN's command again with FlashInfer 0.7.2.post1 (vLLM 0.33's), recorded on an H100, not an H200 (issue 47).
FI_GAUSSIAN_072 = PACKED_RUNS["fi-h100-sm90-gaussian-fi0.7.2.post1"]
VLLM_COLD_PREFILL = PACKED_RUNS["vllm-h200-cold-prefill"]  # vLLM 0.26, BF16 (auto) vs FP8
VLLM_DECODE_HEAVY = PACKED_RUNS["vllm-h200-decode-heavy"]
# The Parquet exports (nsys export --type parquetdir, the tables kvtrace reads) of fi-h200-sm90's two reports by
# Nsight Systems 2025.3: fp8/ and nvfp4/, one TABLE.parquet each (fixtures/README.md).
PARQUET_2025 = _unpack(FIXTURES / "fi-h200-sm90-parquet" / "fi-h200-sm90-parquet.tar.xz", named=True)
# bench/graph_loop.py's CUDA graph of small kernels, traced per node, recorded on the H200 with 2025.3: a-2000 and
# b-2000, each as its SQLite export and its Parquet folder (fixtures/README.md).
GRAPH_LOOP = _unpack(FIXTURES / "graph-loop-h200" / "graph-loop-h200.tar.xz", named=True)
# fixtures/bad/'s real capture without kernels, its export and report (fixtures/bad/README.md), packed.
NO_KERNELS_DIR = _unpack(BAD_DIR / "no-kernels-nsys2023.tar.xz", named=True)


def _discover_real_exports(suffix: str) -> dict[str, Path]:
    """Every real recording under fixtures/<run>/ (fixtures/bad/ holds rejects) and in the packed runs,
    keyed "<run>/<name>"."""
    found = {f"{p.parent.name}/{p.name}": p for p in sorted(FIXTURES.glob(f"*/*{suffix}")) if p.parent != BAD_DIR}
    found.update({f"{name}/{p.name}": p for name, run in PACKED_RUNS.items() for p in sorted(run.glob(f"*{suffix}"))})
    found.update({f"vllm-h200-serve/{name}/{p.name}": p for name, run in SERVE_RUNS.items()
                  for p in sorted(run.glob(f"*{suffix}"))})
    return found


# Every real export shipped for behaviour tests (the two runs above and any later recording, such as
# fi-h200-sm90-repeat and the packed serve runs), as id -> path.
REAL_SQLITE = _discover_real_exports(".sqlite")
REAL_REPORTS = _discover_real_exports(".nsys-rep")
# The smallest real export: the "good" arm of diffs whose other arm is bad.
GOOD_SQLITE = NSYS2023_DIR / "fp8.sqlite"

NSYS_WANTED = "2023.4.4"
NSYS_FALLBACK = Path("/tmp/nsys-cli/nsys")  # where shared/ci/install-nsys-cli.sh puts it by default


def fingerprint(path: Path) -> tuple[str, int, int]:
    """Bytes, size and mtime (ns): what "the loader never writes to its input" must leave unchanged."""
    stat = Path(path).stat()
    return sha256(path), stat.st_size, stat.st_mtime_ns


@pytest.fixture(params=sorted(REAL_SQLITE), ids=sorted(REAL_SQLITE))
def real_sqlite(request) -> Path:
    """Each real fixture export in turn."""
    return REAL_SQLITE[request.param]


@pytest.fixture
def good_sqlite() -> Path:
    return GOOD_SQLITE


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory):
    """In-process loads keep their trace cache here for the session, never in ~/.cache (a folder per xdist worker:
    tmp_path_factory gives each its own)."""
    os.environ["KVTRACE_CACHE_DIR"] = str(tmp_path_factory.mktemp("kvtrace-cache"))


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    """KVTRACE_CACHE_DIR for one test, so no test writes .nsys-rep exports into ~/.cache."""
    path = tmp_path / "kvtrace-cache"
    path.mkdir()
    return path


@pytest.fixture
def run_kvtrace(request, tmp_path):
    """run_kvtrace(*args, env=None, cwd=None, preexec_fn=None, child=False) -> (exit code, stdout, stderr).

    Runs the CLI's entry point (kvtrace.cli:main, which the console script and `python -m kvtrace` call) from
    tmp_path (or `cwd`), with COLUMNS unset and `env` over the environment (None removes a variable). In this
    process by default: a child costs about 2 s of CPU in imports alone. `child=True`, or a `preexec_fn`,
    runs `python -m kvtrace` in a real process, for tests about the process itself.

    The trace cache is this worker's, warm from earlier tests (entries are keyed by each file's path and
    identity, so a test's own files never meet another's); a test that takes `cache_dir` looks at the cache
    and gets that empty folder instead.
    """
    cache = {"KVTRACE_CACHE_DIR": str(request.getfixturevalue("cache_dir"))} if "cache_dir" in request.fixturenames \
        else {}

    def run(*args, env: dict | None = None, cwd: Path | None = None, preexec_fn=None, child: bool = False,
            timeout: float = 600):
        changes = {"COLUMNS": None, **cache, **(env or {})}
        argv = [str(arg) for arg in args]
        if child or preexec_fn is not None:
            return _run_child(argv, changes, cwd or tmp_path, preexec_fn, timeout)
        return _run_in_process(argv, changes, cwd or tmp_path)

    return run


def _run_child(argv: list[str], changes: dict, cwd: Path, preexec_fn, timeout: float) -> tuple[int, str, str]:
    env = {key: value for key, value in {**os.environ, **changes}.items() if value is not None}
    result = subprocess.run([sys.executable, "-m", "kvtrace", *argv], capture_output=True, text=True, env=env,
                            cwd=cwd, preexec_fn=preexec_fn, timeout=timeout, check=False)
    return result.returncode, result.stdout, result.stderr


# Warnings the interpreter hides by default outside __main__.
_HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def _run_in_process(argv: list[str], changes: dict, cwd: Path) -> tuple[int, str, str]:
    """What the process would give: exit code, stdout, and stderr with any warning the interpreter would show
    and the traceback (exit 1) of an exception main() let through, so that "no traceback" still fails."""
    from click.testing import CliRunner

    from kvtrace.cli import main

    here = os.getcwd()
    with CliRunner().isolation(env=changes) as (stdout, stderr, _), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        os.chdir(cwd)
        try:
            main(argv)
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
            if not isinstance(done.code, int | None):
                print(done.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - the interpreter would print it and exit 1
            traceback.print_exc(file=sys.stderr)
            code = 1
        finally:
            os.chdir(here)
        for warning in caught:
            if not issubclass(warning.category, _HIDDEN_WARNINGS):
                sys.stderr.write(warnings.formatwarning(warning.message, warning.category, warning.filename,
                                                        warning.lineno, warning.line))
        sys.stdout.flush()
        sys.stderr.flush()
        return code, stdout.getvalue().decode(), stderr.getvalue().decode()


def _nsys_version(candidate: str) -> str | None:
    try:
        result = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def find_nsys() -> tuple[str | None, list[str]]:
    """The first nsys 2023.4.4 among $NSYS, PATH and /tmp/nsys-cli/nsys; and what was tried."""
    tried, seen = [], set()
    for candidate in (os.environ.get("NSYS"), shutil.which("nsys"), str(NSYS_FALLBACK)):
        if not candidate or candidate in seen:
            continue
        seen.add(candidate)
        if not os.access(candidate, os.X_OK):
            tried.append(f"{candidate} (not executable)")
            continue
        version = _nsys_version(candidate)
        if version and NSYS_WANTED in version:
            return candidate, tried
        tried.append(f"{candidate} ({version or 'no version'})")
    return None, tried


@pytest.fixture(scope="session")
def nsys() -> str:
    """Path of the Nsight Systems 2023.4.4 CLI.

    CI installs it (shared/ci/install-nsys-cli.sh), so there a missing nsys FAILS the test; locally the
    test is skipped.
    """
    path, tried = find_nsys()
    if path:
        return path
    message = (f"Nsight Systems {NSYS_WANTED} CLI not found (tried $NSYS, PATH, {NSYS_FALLBACK}: "
               f"{', '.join(tried) or 'nothing there'}); install it with shared/ci/install-nsys-cli.sh")
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def sql_calls(path, *likes: str, nvtx: str | None = None) -> list[tuple[int, int]]:
    """Kernel (start, end) by demangled-name pattern, in launch order, written in plain SQL independently of
    kvtrace. With `nvtx`, only kernels whose launch call lies inside the NVTX range of that name on the same
    thread: the projection rule of Nsight Systems' nvtx_gpu_proj_trace, written out by hand."""
    where = " OR ".join("s.value LIKE ?" for _ in likes) or "1"
    projection = """
        JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = k.correlationId
             AND (r.globalTid & 0xFFFFFFFFFF000000) = k.globalPid
        JOIN NVTX_EVENTS n ON n.globalTid = r.globalTid AND n.start <= r.start AND n.end >= r.end
             AND n.eventType IN (59, 60) AND n.text = ?""" if nvtx is not None else ""
    query = (f"SELECT k.start, k.end FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.demangledName"
             f"{projection} WHERE {where} ORDER BY k.start")
    args = ([nvtx] if nvtx is not None else []) + list(likes)
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return [tuple(row) for row in conn.execute(query, args)]


def sql_durations(path, *likes: str, nvtx: str | None = None) -> list[int]:
    """Durations of sql_calls, in launch order."""
    return [end - start for start, end in sql_calls(path, *likes, nvtx=nvtx)]


# ---- results shared by the whole session -------------------------------------------------------------------
# Built once per test process (pytest-xdist runs one per core) and only read by the tests that take them: tests
# that change a trace or a run directory build their own. A test that mutated one would show in the others,
# e.g. test_plots' check that writing plots leaves the report as it was.


def _beside_unpacked(folder: Path, unpacked: Path) -> Path:
    """A copy of fixtures/FOLDER next to an unpacked run, once per process and content: the recorded manifests name
    their exports by relative path (../../fi-h200-sm90/fp8.sqlite), which resolves there as it did in fixtures/."""
    digest = hashlib.sha256(b"".join(sha256(p).encode() + str(p.relative_to(folder)).encode()
                                     for p in sorted(folder.rglob("*")) if p.is_file())).hexdigest()[:16]
    done = unpacked.parent / f"{folder.name}-{digest}"
    if not done.is_dir():
        scratch = Path(tempfile.mkdtemp(dir=unpacked.parent, prefix=".copying-"))
        shutil.copytree(folder, scratch / folder.name)
        try:
            (scratch / folder.name).rename(done)
        except OSError:  # another xdist worker copied it meanwhile
            pass
        shutil.rmtree(scratch, ignore_errors=True)
    return done


# Run directories of recorded serve runs (their README), beside the unpacked fi-h200-sm90 whose exports they name.
RECORDED_REPORT = _beside_unpacked(FIXTURES / "vllm-recorded-report", NSYS2025_DIR)


@pytest.fixture(scope="session")
def shipped_output(tmp_path_factory):
    """shipped_output(name, fmt="markdown") -> shipped_outputs.Output: every shipped fixture's report, diff and matrix
    (tests/shipped_outputs.py), each written once per session into a folder that every xdist worker shares."""
    from shipped_outputs import ShippedOutputs

    base = tmp_path_factory.getbasetemp()
    return ShippedOutputs((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shipped-outputs")


@pytest.fixture(scope="session")
def shipped_recipes():
    """The shipped recipes, parsed once (a RecipeSet's caches per kernel name only ever grow)."""
    from kvtrace.analyzer.classify import load_recipes
    return load_recipes()


class SharedResults:
    """`report`, `matrix` and `diff` results of unmodified shipped inputs, each built once per test process on first
    request and then only read (see above)."""

    def __init__(self, recipes):
        from kvtrace.analyzer import serving
        from kvtrace.analyzer.stats import serving_intervals

        self.recipes = recipes
        self._built: dict[tuple, object] = {}
        self._deciding_run_pairs = serving_intervals.DECIDING_RUN_PAIRS
        self._window_stalls = serving.window_stalls

    def report(self, runs):
        """report.build of run directories (or RUNDIR/ARM paths)."""
        from kvtrace.analyzer import report
        return self._once(("report", *map(str, runs)), lambda: report.build(list(runs), self.recipes))

    def matrix(self, runs):
        from kvtrace.analyzer import matrix
        return self._once(("matrix", *map(str, runs)), lambda: matrix.build(list(runs), self.recipes))

    def diff(self, baseline: Path, candidate: Path):
        """compare.diff of two exports, baseline first."""
        from kvtrace.analyzer import compare
        from kvtrace.analyzer.load import open_trace
        return self._once(("diff", str(baseline), str(candidate)),
                          lambda: compare.diff(open_trace(baseline), open_trace(candidate), self.recipes))

    def _once(self, key: tuple, build):
        from kvtrace.analyzer import serving
        from kvtrace.analyzer.stats import serving_intervals

        # Results built inside reading_stalled_timings() are kept apart from the others.
        key = (*key, serving.window_stalls is self._window_stalls)
        if key not in self._built:
            # deciding_on_any_run_pairs() changes results: what is built inside it is the test's own.
            assert serving_intervals.DECIDING_RUN_PAIRS == self._deciding_run_pairs, "built under a patch: not shared"
            self._built[key] = build()
        return self._built[key]


@pytest.fixture(scope="session")
def shared(shipped_recipes) -> SharedResults:
    """shared.report(runs), shared.matrix(runs), shared.diff(baseline, candidate): built once per worker."""
    return SharedResults(shipped_recipes)


@pytest.fixture(scope="session")
def fi_h200_diff(shared):
    """`diff` of the FlashInfer H200 pair (Nsight Systems 2025.3), fp8 → nvfp4."""
    return shared.diff(NSYS2025_DIR / "fp8.sqlite", NSYS2025_DIR / "nvfp4.sqlite")


@pytest.fixture(scope="session")
def fi_h200_report(shared):
    """`report` of the FlashInfer H200 run directory."""
    return shared.report([NSYS2025_DIR])


@pytest.fixture(scope="session")
def sweep_report(shared):
    """`report` of the recorded vLLM sweep run directory."""
    return shared.report([RECORDED_REPORT / "sweep"])


@contextmanager
def deciding_on_any_run_pairs():
    """Inside the block, a serving point is decided on any number of run pairs. The shipped serve fixtures but the H100
    matrix hold one or two run pairs per point, which decide nothing (docs/statistics.md, three run pairs decide a
    point); tests of the reasons such a point would give (a faster kernel, prefix hits, capacity) build their result
    inside it."""
    from kvtrace.analyzer.stats import serving_intervals

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serving_intervals, "DECIDING_RUN_PAIRS", 1)
        yield


@contextmanager
def reading_stalled_timings():
    """Inside the block, points whose profile window closed inside their timed traffic are decided like the others.
    The shipped serve fixtures' timings include nsys' stall at such a close (tests/test_window_stall.py), so
    kvtrace calls those points not comparable; tests of the machinery that decides comparable points (pooling, the
    TTFT budget, capacity) run it on those real numbers inside this block."""
    from kvtrace.analyzer import serving

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serving, "window_stalls", lambda run, profile_steps: {})
        yield


@pytest.fixture(scope="session")
def preemption_report(shared):
    """`report` of the vLLM 0.33 preemption run (8B shape, --repeats 2): the capacity-bound case."""
    return shared.report([VLLM033_8B_RUNS["capacity-preemption"]])


@pytest.fixture(scope="session")
def capacity_matrix(shared):
    """`matrix` over every vLLM 0.33 run of the 8B shape (make demo's capacity-bound region)."""
    return shared.matrix([VLLM033_8B_RUNS[name] for name in sorted(VLLM033_8B_RUNS)])
