"""Analyzer commands: a thin click layer; every command is one library call plus a renderer."""

from __future__ import annotations

import functools
import io
import os
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console

from kvtrace.analyzer import align, compare, render, stats
from kvtrace.analyzer.classify import SEGMENTS, load_recipes
from kvtrace.analyzer.load import open_trace, open_traces
from kvtrace.errors import KvtraceError


def output_options(command):
    """--format, -o, --recipe, --nsys, --quiet and --no-cache, shared by every analyzer command."""

    @click.option("--format", "fmt", type=click.Choice(render.FORMATS), default="table", show_default=True,
                  help="Terminal table, GitHub markdown, JSON (versioned schema) or CSV.")
    @click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                  help="Write to FILE (atomically) instead of standard output.")
    @click.option("--recipe", "recipe_files", multiple=True, type=click.Path(path_type=Path),
                  help="Extra recipe file; its rules take precedence over the shipped ones. Repeatable.")
    @click.option("--nsys", "nsys_path", help="nsys used to export .nsys-rep inputs (default: $NSYS, PATH).")
    @click.option("-q", "--quiet", is_flag=True, help="No progress display on standard error.")
    @click.option("--no-cache", is_flag=True,
                  help="Read the exports afresh and keep nothing in kvtrace's cache ($KVTRACE_CACHE_DIR, else "
                       "~/.cache/kvtrace), where loaded traces are otherwise kept for the next run.")
    @functools.wraps(command)
    def wrapper(*args, quiet, no_cache, **kwargs):
        click.get_current_context().meta["kvtrace.quiet"] = quiet
        click.get_current_context().meta["kvtrace.cache"] = not no_cache
        return command(*args, **kwargs)

    return wrapper


@contextmanager
def progress(message: str, delay_s: float = 1.0):
    """A transient spinner on standard error for a step still running after `delay_s` (loading or exporting
    a large trace); nothing when standard error is not a terminal or with --quiet."""
    context = click.get_current_context(silent=True)
    console = Console(stderr=True)
    if (context and context.meta.get("kvtrace.quiet")) or not console.is_terminal:
        yield
        return
    status = console.status(message)
    lock, done = threading.Lock(), threading.Event()

    def start():
        with lock:
            if not done.is_set():
                status.start()

    timer = threading.Timer(delay_s, start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            done.set()
            timer.cancel()
            status.stop()


def use_cache() -> bool:
    return click.get_current_context().meta.get("kvtrace.cache", True)


def load_trace(path: Path, nsys_path: str | None):
    with progress(f"loading {path}"):
        return open_trace(path, nsys=nsys_path, cache=use_cache())


def load_traces(paths: list[Path], nsys_path: str | None):
    with progress(f"loading {' and '.join(map(str, paths))}"):
        return open_traces(paths, nsys=nsys_path, cache=use_cache())


def emit(result, fmt: str, output: Path | None) -> None:
    if fmt == "table":
        if output is None:
            console = Console()
            if not console.is_terminal:
                console = Console(width=200)  # piped: no terminal width to fit, keep rows on one line
            render.terminal.render(result, console)
            return
        buffer = io.StringIO()
        render.terminal.render(result, Console(file=buffer, width=200, no_color=True, force_terminal=False))
        text = buffer.getvalue()
    else:
        text = render.render_text(result, fmt)
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text)


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of it."""
    if not path.parent.exists():
        raise KvtraceError(f"cannot write {path}: folder {path.parent} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp creates 0600; a report is as readable as any other file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def window_options(command):
    """Which calls to compare: NVTX windows, a time window, vLLM step kinds, warm-up trimming."""

    @click.option("--window", "nvtx", metavar="REGEX",
                  help="Only kernels launched inside NVTX ranges whose name matches REGEX.")
    @click.option("--time", "time_window", metavar="START:END",
                  help="Only kernels starting in this part of each trace's timeline, in seconds (or ms/us/ns).")
    @click.option("--phase", type=click.Choice([align.PREFILL, align.DECODE, align.MIXED]),
                  help="Only kernels of vLLM steps of this kind (from its execute_context_… NVTX ranges).")
    @click.option("--skip-warmup", default=0, show_default=True, type=click.IntRange(0),
                  help="Drop the first N calls per kernel family, launch shape and NVTX range.")
    @click.option("--last", type=click.IntRange(1),
                  help="Keep only the last N calls per kernel family, launch shape and NVTX range.")
    @functools.wraps(command)
    def wrapper(*args, nvtx, time_window, phase, skip_warmup, last, **kwargs):
        window = align.Window(nvtx=nvtx, time_ns=align.parse_time_window(time_window) if time_window else (None, None),
                              phase=phase, skip_warmup=skip_warmup, last=last)
        return command(*args, window=window, **kwargs)

    return wrapper


def parse_gate(values: tuple[str, ...]) -> list[str | None]:
    """--fail-on regression[:SEGMENT] -> segments to watch (None = any segment)."""
    watched = []
    for value in values:
        kind, _, segment = value.partition(":")
        if kind != "regression" or (segment and segment not in SEGMENTS):
            raise KvtraceError(f"--fail-on {value!r}: use regression or regression:SEGMENT with SEGMENT one of "
                               f"{', '.join(SEGMENTS)}")
        watched.append(segment or None)
    return watched


def _trace_argument(name: str):
    # Existence, type and readability are checked by the loader, so that every bad input gets the same
    # one-line error (click's own checks print a usage block).
    return click.argument(name, type=click.Path(path_type=Path, exists=False, readable=False))


@click.command()
@_trace_argument("trace")
@click.option("--label", help="Name shown for the trace (default: file name).")
@window_options
@output_options
def summary(trace, label, window, fmt, output, recipe_files, nsys_path):
    """Time per segment and kernel family of one trace (.sqlite or .nsys-rep)."""
    recipes = load_recipes(recipe_files)
    loaded = load_trace(trace, nsys_path)
    with progress(f"summarizing {trace}"):
        result = compare.summarize(loaded, recipes, label=label, window=window)
    emit(result, fmt, output)


# Exit codes of `kvtrace diff` (docs/cli.md): a gate that saw a regression, and one that could not measure
# what it was told to watch. 2 is bad input (kvtrace.errors).
GATE_REGRESSION = 1
GATE_UNMEASURED = 3


def gate(result, watched: list[str | None]) -> int:
    """Apply --fail-on to a diff: one stderr line per finding; the exit code (0 when nothing tripped).

    A named segment that cannot be measured (not comparable, insufficient data, different work, or absent
    from both arms) exits GATE_UNMEASURED rather than passing; the unnamed form watches the segments that
    can be measured and lists the others. A regression wins over an unmeasured segment."""
    if not watched:
        return 0
    rows = {r.segment: r for r in result.segments}
    named = {segment for segment in watched if segment is not None}
    every = None in watched
    tripped = [r for r in result.segments if r.verdict == stats.REGRESSION and (every or r.segment in named)]
    unmeasured = [(segment, rows[segment].verdict if segment in rows else "no calls in either arm")
                  for segment in sorted(named) if segment not in rows or rows[segment].verdict in stats.UNMEASURED]
    if tripped:
        click.echo("kvtrace: gate: " + "; ".join(f"{r.segment} regressed {r.ratio:.3f}× [{r.ci_low:.3f}, {r.ci_high:.3f}]"
                                                  for r in tripped), err=True)
    if unmeasured:
        click.echo("kvtrace: gate: cannot judge " + "; ".join(f"{segment} ({why})" for segment, why in unmeasured)
                   + ": compare runs that did the same work, or drop it from --fail-on", err=True)
    skipped = [r for r in result.segments if every and r.verdict in stats.UNMEASURED and r.segment not in named]
    if skipped:
        click.echo("kvtrace: gate: not judged: " + ", ".join(f"{r.segment} ({r.verdict})" for r in skipped), err=True)
    return GATE_REGRESSION if tripped else GATE_UNMEASURED if unmeasured else 0


@click.command()
@_trace_argument("baseline")
@_trace_argument("candidate")
@click.option("--repeat", "repeats", multiple=True, nargs=2, metavar="BASELINE CANDIDATE",
              type=click.Path(path_type=Path, exists=False, readable=False),
              help="A further run of each arm, baseline first; repeat the option per run. Intervals then resample "
                   "runs, then calls within runs.")
@click.option("--label", "labels", multiple=True, help="Names for the two arms, baseline first (repeat twice).")
@click.option("--threshold", default=0.02, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="No-change band around a ratio of 1 (0.02 = ±2%).")
@click.option("--confidence", default=0.95, show_default=True, type=click.FloatRange(0, 1, min_open=True, max_open=True),
              help="Confidence level of the bootstrap intervals.")
@click.option("--seed", default=0, show_default=True, help="Bootstrap seed (same inputs and seed, same output).")
@click.option("--fail-on", "fail_on", multiple=True, metavar="regression[:SEGMENT]",
              help="Exit 1 when a compared segment (or this SEGMENT) regresses beyond the threshold; exit 3 when "
                   "SEGMENT cannot be measured. Repeatable.")
@window_options
@output_options
def diff(baseline, candidate, repeats, labels, threshold, confidence, seed, fail_on, window, fmt, output,
         recipe_files, nsys_path):
    """Compare BASELINE (e.g. fp8) with CANDIDATE (e.g. nvfp4), segment by segment and per kernel family.

    Calls are paired per kernel family, launch shape and NVTX range; intervals resample the pairs inside
    each such cell. Rows whose arms did different work say "not comparable" or "different work". With
    --repeat, run k of the baseline pairs with run k of the candidate (record them interleaved: A B A B).
    Exit codes: 0 done, 1 a --fail-on gate saw a regression, 2 bad input, 3 a --fail-on segment could not
    be measured.
    """
    if len(labels) not in (0, 2):
        raise KvtraceError("--label takes two names, baseline first: --label fp8 --label nvfp4")
    watched = parse_gate(fail_on)
    recipes = load_recipes(recipe_files)
    runs = [(baseline, candidate), *repeats]
    traces = load_traces([path for run in runs for path in run], nsys_path)
    with progress(f"comparing {baseline} and {candidate}" + (f" ({len(runs)} runs each)" if repeats else "")):
        result = compare.diff(traces[0::2], traces[1::2], recipes, labels=tuple(labels) or (None, None),
                              threshold=threshold, confidence=confidence, seed=seed, window=window)
    emit(result, fmt, output)
    code = gate(result, watched)
    if code:
        sys.exit(code)


@click.command()
@_trace_argument("trace")
@click.option("--unclassified", is_flag=True, help="Only kernels that no recipe matched.")
@click.option("--segment", type=click.Choice(SEGMENTS), help="Only kernels of this segment.")
@output_options
def kernels(trace, unclassified, segment, fmt, output, recipe_files, nsys_path):
    """Distinct kernels with their segment and recipe, by share of GPU time."""
    recipes = load_recipes(recipe_files)
    emit(compare.list_kernels(load_trace(trace, nsys_path), recipes, unclassified=unclassified,
                              segment=segment), fmt, output)
