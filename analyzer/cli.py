"""Analyzer commands: a thin click layer; every command is one library call plus a renderer."""

from __future__ import annotations

import functools
import io
import math
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console

import kvtrace.nsys
from kvtrace import files
from kvtrace.analyzer import align, compare, render, verify
from kvtrace.analyzer import runs as runs_lib
from kvtrace.analyzer.classify import SEGMENTS, load_recipes
from kvtrace.analyzer.findings import read_first
from kvtrace.analyzer.kernels import list_kernels
from kvtrace.analyzer.load import open_trace, open_traces
from kvtrace.analyzer.render import escape, markdown
from kvtrace.analyzer.names import NameKey
from kvtrace.analyzer.results import Diff
from kvtrace.analyzer.run_context import RunContext
from kvtrace.analyzer.stats import verdicts
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.analyzer.render.escape import visible
from kvtrace.errors import KvtraceError
from kvtrace.text import plural


# Whole numbers on the command line end at int64, where the numpy and polars columns they meet end; past it a
# count or size means nothing.
INT64_MAX = (1 << 63) - 1


class Whole(click.IntRange):
    """A whole-number option from `low` up to int64 (the help shows only the lower bound, as before)."""

    def __init__(self, low: int):
        super().__init__(low)

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if number > INT64_MAX:
            shown = str(value) if len(str(value)) <= 30 else f"{str(value)[:30]}…"
            self.fail(f"{shown} is past int64 ({INT64_MAX}).", param, ctx)
        return number


class FiniteRange(click.FloatRange):
    """A number option that is finite: click's FloatRange lets nan through every bound, and inf past an open one."""

    name = "float range"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


# A suffix of -o FILE that picks the format when --format is not given.
FORMAT_OF_SUFFIX = {".md": "markdown", ".markdown": "markdown", ".json": "json", ".csv": "csv"}


def target_options(command):
    """--format and -o: where the result goes. -o FILE takes the format from its suffix unless --format is given;
    -o - is standard output."""

    @click.option("--format", "fmt", type=click.Choice(render.FORMATS), default="table", show_default=True,
                  help="Terminal table, GitHub markdown, JSON (versioned schema) or CSV. With -o FILE the default "
                       "is the one its suffix names (.md, .json, .csv).")
    @click.option("-o", "--output", metavar="FILE", type=click.Path(allow_dash=True, path_type=Path),
                  help="Write to FILE (atomically, never onto an input) instead of standard output; - is standard "
                       "output.")
    @functools.wraps(command)
    def wrapper(*args, fmt, output, **kwargs):
        context = click.get_current_context()
        if output is not None:
            if context.get_parameter_source("fmt") is ParameterSource.DEFAULT:
                fmt = FORMAT_OF_SUFFIX.get(output.suffix.lower(), fmt)
            # The paths given are inputs: an output naming one is refused before any work is done.
            inputs().extend(path for name, value in context.params.items() if name not in ("output", "plots_dir")
                            for path in _paths(value))
            files.check_target(output, inputs())
        return command(*args, fmt=fmt, output=output, **kwargs)

    return wrapper


def _paths(value) -> list[Path]:
    """The paths in an option's value: a path, or paths in (nested) tuples (--recipe, --repeat A B)."""
    if isinstance(value, tuple):
        return [path for item in value for path in _paths(item)]
    return [value] if isinstance(value, Path) else []


def interval_options(band_for: str = ""):
    """--threshold, --confidence and --seed, shared by the commands that give verdicts; `band_for` says what the
    threshold's band applies to beyond kernels (", for kernels and TTFT")."""

    def decorate(command):
        for option in reversed((
                click.option("--threshold", default=0.02, show_default=True, type=FiniteRange(0, 1, max_open=True),
                             help=f"No-change band around a ratio of 1 (0.02 = ±2%){band_for}."),
                click.option("--confidence", default=0.95, show_default=True,
                             type=FiniteRange(0, 1, min_open=True, max_open=True),
                             help="Confidence level of the bootstrap intervals."),
                click.option("--seed", default=0, show_default=True, type=Whole(0),
                             help="Bootstrap seed (same inputs and seed, same output)."))):
            command = option(command)
        return command

    return decorate


def output_options(command):
    """--format, -o, --recipe, --nsys, --quiet and --no-cache, shared by every analyzer command."""

    @target_options
    @click.option("--recipe", "recipe_files", multiple=True, type=click.Path(path_type=Path),
                  help="Extra recipe file; its rules take precedence over the shipped ones. Repeatable.")
    @click.option("--nsys", "nsys_path", callback=_check_nsys_option,
                  help="nsys used to export .nsys-rep inputs (default: $NSYS, PATH).")
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


def _check_nsys_option(context, parameter, value: str | None) -> str | None:
    """At once, not only when an .nsys-rep needs exporting: a wrong --nsys is wrong with .sqlite inputs too."""
    if value is not None:
        kvtrace.nsys.check_explicit(value)
    return value


def inputs() -> list[Path]:
    """Files this command reads, which its output must never replace."""
    return click.get_current_context().meta.setdefault("kvtrace.inputs", [])


def run_files(run: Path) -> list[Path]:
    """Every entry of a run directory (links included): kvtrace reads its manifests, exports, logs, bench results,
    per-request counts and answers, so an output may replace none of them."""
    try:
        return sorted(Path(run).iterdir())
    except OSError:  # not a folder: the reader of the run says what is wrong
        return [Path(run)]


@contextmanager
def progress(message: str, delay_s: float = 1.0):
    """A transient spinner on standard error for a step still running after `delay_s` (loading or exporting
    a large trace); nothing when standard error is not a terminal or with --quiet. Yields a function that
    names the step now running (which report, which step) beside the message."""
    context = click.get_current_context(silent=True)
    console = Console(stderr=True, emoji=False)
    if (context and context.meta.get("kvtrace.quiet")) or not console.is_terminal:
        yield lambda step: None
        return
    status = console.status(escape.rich(message))
    lock, done = threading.Lock(), threading.Event()

    def start():
        with lock:
            if not done.is_set():
                status.start()

    def step(now: str) -> None:
        with lock:
            status.update(escape.rich(f"{message}: {now}"))

    timer = threading.Timer(delay_s, start)
    timer.daemon = True
    timer.start()
    try:
        yield step
    finally:
        with lock:
            done.set()
            timer.cancel()
            status.stop()


def use_cache() -> bool:
    return click.get_current_context().meta.get("kvtrace.cache", True)


def load_trace(path: Path, nsys_path: str | None):
    with progress(f"loading {path}") as step:
        trace = open_trace(path, nsys=nsys_path, cache=use_cache(), step=step)
    inputs().extend(_export_files(Path(trace.info.sqlite)))
    return trace


def load_traces(paths: list[Path], nsys_path: str | None):
    with progress(f"loading {' and '.join(map(str, paths))}") as step:
        traces = open_traces(paths, nsys=nsys_path, cache=use_cache(), step=step)
    inputs().extend(file for t in traces for file in _export_files(Path(t.info.sqlite)))
    return traces


def _export_files(export: Path) -> list[Path]:
    """What an output must not replace of an export read: the file, or a Parquet folder and each file in it."""
    return [export, *sorted(export.iterdir())] if export.is_dir() else [export]


def emit(result, fmt: str, output: Path | None) -> None:
    # Which arm is which (the narrower format as the baseline, swapped arms), before any number.
    for finding in read_first(_diff_findings(result)):
        click.echo(f"kvtrace: {finding.level}: {visible(finding.message)}", err=True)
    if output is None or files.is_stdout(output):
        try:
            if fmt == "table":
                console = _Stdout()
                if not console.is_terminal and "COLUMNS" not in os.environ:
                    console = _Stdout(width=200)  # piped: no terminal width to fit, keep rows on one line
                render.render_table(result, console)
            else:  # markdown as an issue holds it: no file beside standard output for the rest
                sys.stdout.write(render.render_markdown(result, None)[0] if fmt == "markdown" else
                                 render.render_text(result, fmt))
            sys.stdout.flush()
        except BrokenPipeError:
            files.discard_stdout()  # the reader has what it wanted; a --fail-on gate still decides the exit code
        except OSError as error:  # no room (/dev/full, a full disk or quota): one line, and nothing more written
            files.discard_stdout()
            raise KvtraceError(f"cannot write standard output: {(error.strerror or str(error)).lower()}; free some "
                               "space, or write the result elsewhere with -o FILE") from None
        return
    rest = whole = None
    if fmt == "table":
        buffer = io.StringIO()
        render.render_table(result, Console(file=buffer, width=200, no_color=True, force_terminal=False,
                                            emoji=False))
        text = buffer.getvalue()
    elif fmt == "markdown":
        rest = whole_path(output)
        text, whole = render.render_markdown(result, rest and rest.name)
        whole = whole if rest is not None else None  # a device or FIFO has nothing beside it
    else:
        text = render.render_text(result, fmt)
    # Written first: the files the issue-sized markdown names exist once it does.
    written = write_parts(rest, whole) if whole is not None else []
    files.write(output, text, inputs())
    if written:
        click.echo(f"kvtrace: {visible(str(output))} fits a GitHub issue body; the whole report is in "
                   f"{named(written)}", err=True)
    # Standard output stays empty, so what a reader of the file would be warned about goes to standard error: each
    # warning where they are few, else their counts and where the file lists them.
    for line in warning_lines(_warnings(result), written or [output]):
        click.echo(line, err=True)


def write_parts(first: Path, text: str) -> list[Path]:
    """Write markdown that an issue-sized file leaves out beside it, as `first` (FILE.full.md, matrix's
    FILE.details.md) and, past an issue body, in parts that fit one each (markdown.parts): FILE.full-2.md and on.
    Each is refused like any target that is an input, before any is written. Parts that an earlier, longer text left
    past the last are not removed: the last part names no next one, and every part says how many there are."""
    parts = markdown.parts(text, first.name)
    paths = [first.with_name(markdown.part_name(first.name, number)) for number in range(1, len(parts) + 1)]
    for path in paths:
        files.check_target(path, inputs())
    for path, part in zip(paths, parts):
        files.write(path, part, inputs())
    return paths


def named(paths: list[Path]) -> str:
    """A file, or parts of one, as standard error names them."""
    shown = ", ".join(visible(str(path)) for path in paths)
    return shown if len(paths) == 1 else f"{len(paths)} parts: {shown}"


# Standard error lists at most this many findings (kernel families paired on their last calls, one finding each,
# are the many, and come last); the rest it counts, naming the file that lists them.
LISTED_WARNINGS = 5
_PER_FAMILY = "alignment"


def warning_lines(findings: list, listed_in: list[Path]) -> list[str]:
    """The lines for standard error: the findings about the runs first, then those per kernel family, each while
    they are few, and one line counting the rest by level and check."""
    ordered = [f for f in findings if f.check != _PER_FAMILY] + [f for f in findings if f.check == _PER_FAMILY]
    shown = ordered[:LISTED_WARNINGS] if len(ordered) > LISTED_WARNINGS + 1 else ordered
    lines = [f"kvtrace: {f.level}: {visible(f.message)}" for f in shown]
    rest = ordered[len(shown):]
    if rest:
        counts: dict[tuple, int] = {}
        for finding in rest:
            counts[finding.level, finding.check] = counts.get((finding.level, finding.check), 0) + 1
        listed = ", ".join(f"{count} {plural(count, level)} ({check})" for (level, check), count in counts.items())
        where = named(listed_in) if len(listed_in) == 1 else f"the whole report ({named(listed_in)})"
        lines.append(f"kvtrace: {len(rest)} more findings: {listed}; {where} lists each under "
                     "Comparability and Runs")
    return lines


def whole_path(output: Path) -> Path | None:
    """Where the whole markdown goes when the -o file holds what fits an issue: beside it, FILE.full.md; None for
    a target that is no regular file (a device, a FIFO), which has nothing beside it."""
    if output.exists() and not output.is_file():
        return None
    return output.with_name(f"{output.stem}{markdown.WHOLE_SUFFIX}{output.suffix or '.md'}")


class _Stdout(Console):
    def __init__(self, **options):
        super().__init__(emoji=False, **options)  # `:cat:` in a name or label stays text, never a picture

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError  # rich would exit 1 at once; emit() carries on


def _diff_findings(result) -> list:
    """The kernel diff's findings: a diff's own, a serving report's diff's."""
    diff = result if isinstance(result, Diff) else getattr(result, "diff", None)
    return list(diff.findings) if isinstance(diff, Diff) else []


def _warnings(result) -> list:
    """What emit says on standard error after writing a file (what read_first picks came before)."""
    found = list(getattr(result, "findings", ())) if not isinstance(result, Diff) else []
    first = read_first(_diff_findings(result))
    return [f for f in found + _diff_findings(result) if f.level != "ok" and f not in first]


def window_options(command):
    """Which calls to compare: NVTX windows, a time window, vLLM step kinds, warm-up trimming."""

    @click.option("--window", "nvtx", metavar="REGEX",
                  help="Only kernels launched inside NVTX ranges whose name matches REGEX.")
    @click.option("--time", "time_window", metavar="START:END",
                  help="Only kernels starting in this part of each trace's timeline, in seconds (or ms/us/ns).")
    @click.option("--phase", type=click.Choice([align.PREFILL, align.DECODE, align.MIXED]),
                  help="Only kernels of vLLM steps of this kind (from its execute_context_… NVTX ranges).")
    @click.option("--skip-warmup", default=0, show_default=True, type=Whole(0),
                  help="Drop the first N calls per kernel family, launch shape and NVTX range.")
    @click.option("--last", type=Whole(1),
                  help="Keep only the last N calls per kernel family, launch shape and NVTX range.")
    @click.option("--nvtx-ignore", "nvtx_ignore", multiple=True, metavar="REGEX",
                  help="Leave the parts of NVTX range names matching REGEX (its first group, if it has one) out of "
                       "pairing, besides instance counters (op_id = N, seq = N, step N, ProfilerStep#N, …). "
                       "Repeatable.")
    @click.option("--nvtx-keep", "nvtx_keep", multiple=True, metavar="REGEX",
                  help="Pair on the parts of NVTX range names matching REGEX as they are, counters included "
                       "('step \\d+' keeps step numbers; '.*' pairs on full names). Repeatable.")
    @functools.wraps(command)
    def wrapper(*args, nvtx, time_window, phase, skip_warmup, last, nvtx_ignore, nvtx_keep, **kwargs):
        window = align.Window(nvtx=nvtx, time_ns=align.parse_time_window(time_window) if time_window else (None, None),
                              phase=phase, skip_warmup=skip_warmup, last=last,
                              names=NameKey(ignore=nvtx_ignore, keep=nvtx_keep))
        return command(*args, window=window, **kwargs)

    return wrapper


verify_option = click.option(
    "--verify", "verify_totals", is_flag=True,
    help="Check kvtrace's per-kernel calls and totals of every input (each run of both arms) against `nsys stats "
         "-r cuda_gpu_kern_sum` (nsys from --nsys, $NSYS or PATH), and per short kernel name against `nsys recipe "
         "cuda_gpu_kern_sum` on each input's .nsys-rep where that nsys runs its recipes; the output says they agree "
         "to the nanosecond or lists where they do not.")


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


def as_run(run_dir: Path | None) -> list[str]:
    """The current command's arguments as given (defaults left out), for the report to show how to reproduce
    it: paths relative to `run_dir` (run from inside it), other absolute paths by name, no --nsys path."""
    context = click.get_current_context()

    def path(value) -> str:
        value = Path(value)
        if run_dir is not None:
            try:
                return str(value.resolve().relative_to(run_dir.resolve()))
            except ValueError:
                pass
        return value.name if value.is_absolute() or run_dir is not None else str(value)

    def text(value) -> str:
        return path(value) if isinstance(value, Path) else str(value)

    args = [context.info_name]
    for param in context.command.params:
        value = context.params.get(param.name)
        if isinstance(param, click.Argument):
            args += [text(v) for v in (value if isinstance(value, tuple) else [value]) if v is not None]
            continue
        if param.name == "nsys_path" or value in (None, (), False) or value == param.default:
            continue
        flag = max(param.opts, key=len)
        if getattr(param, "is_flag", False):
            args.append(flag)
        else:
            for item in (value if param.multiple else [value]):
                args += [flag, *map(text, item if isinstance(item, tuple) else [item])]
    return args


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
    """Time per segment and kernel family of one trace (.sqlite, .nsys-rep or an nsys Parquet folder)."""
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
    tripped = [r for r in result.segments if r.verdict == Verdict.REGRESSION and (every or r.segment in named)]
    unmeasured = [(segment, rows[segment].verdict if segment in rows else "no calls in either arm")
                  for segment in sorted(named) if segment not in rows or rows[segment].verdict in verdicts.UNMEASURED]
    if tripped:
        click.echo("kvtrace: gate: " + "; ".join(f"{r.segment} regressed {r.ratio:.3f}× [{r.ci_low:.3f}, {r.ci_high:.3f}]"
                                                  for r in tripped), err=True)
    if unmeasured:
        click.echo("kvtrace: gate: cannot judge " + "; ".join(f"{segment} ({why})" for segment, why in unmeasured)
                   + ": compare runs that did the same work, or drop it from --fail-on", err=True)
    skipped = [r for r in result.segments if every and r.verdict in verdicts.UNMEASURED and r.segment not in named]
    if skipped:
        click.echo("kvtrace: gate: not judged: " + ", ".join(f"{r.segment} ({r.verdict})" for r in skipped), err=True)
    return GATE_REGRESSION if tripped else GATE_UNMEASURED if unmeasured else 0


@click.command()
@_trace_argument("baseline")
@click.argument("candidate", required=False, type=click.Path(path_type=Path, exists=False, readable=False))
@click.option("--arms", nargs=2, metavar="BASELINE_REGEX CANDIDATE_REGEX",
              help="Each arm is the kernels launched inside NVTX ranges matching its REGEX (e.g. 'bench fp8' "
                   "'bench nvfp4'): two windows of one trace (give only BASELINE) or of two traces, paired, checked "
                   "and resampled as two files are.")
@click.option("--repeat", "repeats", multiple=True, nargs=2, metavar="BASELINE CANDIDATE",
              type=click.Path(path_type=Path, exists=False, readable=False),
              help="A further run of each arm, baseline first; repeat the option per run. Intervals then resample "
                   "runs, then calls within runs.")
@click.option("--label", "labels", multiple=True, help="Names for the two arms, baseline first (repeat twice).")
@interval_options()
@click.option("--fail-on", "fail_on", multiple=True, metavar="regression[:SEGMENT]",
              help="Exit 1 when a compared segment (or this SEGMENT) regresses beyond the threshold; exit 3 when "
                   "SEGMENT cannot be measured. Repeatable.")
@verify_option
@window_options
@output_options
def diff(baseline, candidate, arms, repeats, labels, threshold, confidence, seed, fail_on, verify_totals, window, fmt,
         output, recipe_files, nsys_path):
    """Compare BASELINE (e.g. fp8) with CANDIDATE (e.g. nvfp4), segment by segment and per kernel family.

    Calls are paired per kernel family, launch shape and NVTX range; intervals resample the pairs inside
    each such cell. Rows whose arms did different work say "not comparable" or "different work". With
    --repeat, run k of the baseline pairs with run k of the candidate (record them interleaved: A B A B).
    With --arms, one trace can hold both arms (kvtrace diff run.sqlite --arms 'bench fp8' 'bench nvfp4').
    Exit codes: 0 done, 1 a --fail-on gate saw a regression, 2 bad input, 3 a --fail-on segment could not
    be measured.
    """
    if candidate is None and not arms:
        raise KvtraceError("diff needs a CANDIDATE trace, or --arms BASELINE_REGEX CANDIDATE_REGEX to take both arms "
                           "from one trace")
    if candidate is None and repeats:
        raise KvtraceError("--repeat needs two traces per run; with one trace, --arms takes both arms from it")
    candidate = baseline if candidate is None else candidate
    windows = (window, None) if not arms else (replace(window, arm=arms[0]), replace(window, arm=arms[1]))
    if len(labels) not in (0, 2):
        raise KvtraceError("--label takes two names, baseline first: --label fp8 --label nvfp4")
    watched = parse_gate(fail_on)
    recipes = load_recipes(recipe_files)
    runs = [(baseline, candidate), *repeats]
    if repeats:
        _check_distinct_runs(runs)
    context = RunContext.of(baseline, None if candidate is baseline else candidate)
    if context.read and output is not None:
        # Read for the headline: -o must not replace them.
        inputs().extend(context.read)
        files.check_target(output, inputs())
    # A trace holding both arms is loaded once.
    traces = load_traces([baseline], nsys_path) * 2 if candidate is baseline else \
        load_traces([path for run in runs for path in run], nsys_path)
    with progress(f"comparing {baseline} and {candidate}" + (f" ({len(runs)} runs each)" if repeats else "")):
        result = compare.diff(traces[0::2], traces[1::2], recipes, labels=tuple(labels) or (None, None),
                              threshold=threshold, confidence=confidence, seed=seed, window=windows[0],
                              candidate_window=windows[1])
    if verify_totals:
        with progress("checking kernel totals with nsys stats"):
            verify.attach(result, traces, recipes, kvtrace.nsys.find_nsys(nsys_path))
    emit(context.attach(result, as_run(context.run_dir)), fmt, output)
    code = gate(result, watched)
    if code:
        sys.exit(code)


def _check_distinct_runs(runs: list[tuple[Path, Path]]) -> None:
    """With --repeat every file is a run of its own: the same file in both arms, or twice in one, would pair a
    run with itself and pass its zero difference, or its own spread, off as the between-run variance."""
    seen: list[tuple[os.stat_result, Path]] = []
    for path in (p for run in runs for p in run):
        try:
            status = path.stat()
        except OSError:
            continue  # the loader says what is wrong with it
        for earlier_status, earlier in seen:
            if os.path.samestat(status, earlier_status):
                raise KvtraceError(f"{path} and {earlier} are the same file: with --repeat each run of each arm is a "
                                   "recording of its own; pass every run once")
        seen.append((status, path))
    for side in (0, 1):  # a repeat copied from another run of its arm is the same recording too
        runs_lib.check_distinct_recordings([run[side] for run in runs], "pass every run once, each a recording of its "
                                           "own")


@click.command()
@_trace_argument("trace")
@click.option("--unclassified", is_flag=True, help="Only kernels that no recipe matched.")
@click.option("--segment", type=click.Choice(SEGMENTS), help="Only kernels of this segment.")
@output_options
def kernels(trace, unclassified, segment, fmt, output, recipe_files, nsys_path):
    """Distinct kernels with their segment and recipe, by share of GPU time."""
    recipes = load_recipes(recipe_files)
    emit(list_kernels(load_trace(trace, nsys_path), recipes, unclassified=unclassified, segment=segment),
         fmt, output)


@click.command()
@_trace_argument("run")
@click.option("-o", "--output", metavar="FILE", type=click.Path(allow_dash=True, path_type=Path),
              help="Write the script to FILE (atomically, never onto an input) instead of standard output.")
def repro(run, output):
    """Write a standalone FlashInfer script with RUN's shapes (a run directory, or a trace inside one): it times FP8
    against NVFP4 on each format's route and on NVFP4's, checks both against float64, and writes JSON with --json.
    It imports only torch, flashinfer and the standard library."""
    from kvtrace.analyzer import repro as repro_spec
    from kvtrace.analyzer.render import repro as repro_script

    # What it reads: the run directory's manifests, exports and logs; the script never replaces one of them.
    read = [run, *(path for path in repro_spec.run_directory(run).iterdir() if path.is_file())]
    if output is not None and not files.is_stdout(output):
        files.check_target(output, read)
    with progress("reading the run's trace"):
        text = repro_script.script(repro_spec.build(run))
    if output is None or files.is_stdout(output):
        sys.stdout.write(text)
    else:
        files.write(output, text, read)
