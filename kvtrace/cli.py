"""`kvtrace` entry point.

Subcommands are imported on first use so that `kvtrace capture ...` runs on a bare GPU box without the
analyzer's dependencies (polars, matplotlib), and `kvtrace diff ...` never imports torch.
"""

from __future__ import annotations

import difflib
import fcntl
import importlib
import io
import os
import sys

import click

from kvtrace import __version__, files
from kvtrace.errors import KvtraceError
from kvtrace.text import visible

# command name -> ("module:attribute", one-line help shown by `kvtrace --help` without importing it)
_COMMANDS = {
    "summary": ("kvtrace.analyzer.cli:summary", "Time per segment and kernel family of one trace."),
    "diff": ("kvtrace.analyzer.cli:diff", "Compare a baseline trace with a candidate, segment by segment."),
    "kernels": ("kvtrace.analyzer.cli:kernels", "List kernels with their segment; --unclassified for the rest."),
    "capture": ("kvtrace.capture.cli:capture", "Record matched FP8 / NVFP4 runs under Nsight Systems."),
    "report": ("kvtrace.analyzer.report_cli:report", "Kernel diff beside serving metrics of two arms' run directories."),
    "matrix": ("kvtrace.analyzer.report_cli:matrix", "One decision over several scenarios' run directories."),
    "repro": ("kvtrace.analyzer.cli:repro", "A standalone FlashInfer script with a run's shapes: FP8 vs NVFP4 per route."),
    "capacity": ("kvtrace.analyzer.report_cli:capacity", "KV-cache bytes per token and tokens that fit, per format."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in _COMMANDS:
            close = difflib.get_close_matches(name, list(_COMMANDS), n=1)
            hint = f"did you mean `kvtrace {close[0]}`?" if close else f"commands: {', '.join(sorted(_COMMANDS))}"
            raise click.UsageError(f"no such command {name!r}; {hint}", ctx)
        return super().resolve_command(ctx, args)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module_name, attribute = _COMMANDS[name][0].split(":")
        return getattr(importlib.import_module(module_name), attribute)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, _COMMANDS[name][1]) for name in self.list_commands(ctx)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvtrace")
def cli() -> None:
    """Compare FP8 and NVFP4 KV-cache runs from Nsight Systems traces."""


def _sane_streams() -> None:
    """What the environment hands the process, made safe to write to: a closed standard descriptor (Python then
    has no stream), or one that cannot be written, reads and writes /dev/null, as for a reader that has gone
    away; an encoding that cannot hold kvtrace's text (LC_ALL=C with PYTHONUTF8=0, PYTHONIOENCODING=ascii or
    latin-1) shows what it cannot hold as `\u2013` instead of failing."""
    for descriptor in (0, 1, 2):
        try:
            mode = fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_ACCMODE
        except OSError:  # closed
            mode = None
        # Closed, or (standard output or error) open for reading only: a shell script that execs kvtrace with 2>&-
        # leaves the script itself there.
        if mode is None or (descriptor and mode == os.O_RDONLY):
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != descriptor:
                os.dup2(opened, descriptor)
                os.close(opened)
    for name, descriptor in (("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is None:
            setattr(sys, name, open(descriptor, "w", closefd=False))
        stream = getattr(sys, name)
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


# Command-line words kvtrace reads (1,000 run directories, or labels and recipes for them, are far below): click's
# parser takes the words off the front of a list one at a time, in time quadratic in their count (100,000 --label
# values took minutes).
MAX_WORDS = 10_000


def _check_environment() -> None:
    """Variables that would make a library panic later, refused in one line first."""
    threads = os.environ.get("POLARS_MAX_THREADS")
    if threads and not (threads.isdecimal() and 0 < int(threads) < 1 << 16):
        raise KvtraceError(f"POLARS_MAX_THREADS={threads} is not a number of threads of 1 or more: set it to one, or "
                           "unset it to use every core")


def main(argv: list[str] | None = None) -> None:
    # A bare `kvtrace` asks what there is: the help on standard output, not a usage error.
    args = (sys.argv[1:] if argv is None else argv) or ["--help"]
    _sane_streams()
    try:
        _check_environment()
        if len(args) > MAX_WORDS:
            raise KvtraceError(f"{len(args):,} command-line words, past the {MAX_WORDS:,} kvtrace reads: pass fewer "
                               "(a folder holding the run directories instead of each one, for `kvtrace matrix`)")
        cli.main(args=args, prog_name="kvtrace", standalone_mode=False)
        sys.stdout.flush()  # inside the try: a reader that has gone away is not an error
    except KvtraceError as error:
        click.echo(f"kvtrace: error: {visible(error)}", err=True)
        sys.exit(error.exit_code)
    except click.exceptions.Abort:
        click.echo("kvtrace: aborted", err=True)
        sys.exit(130)
    except click.UsageError as error:
        command = error.ctx.command_path if error.ctx else "kvtrace"
        click.echo(f"kvtrace: error: {visible(error.format_message())} (see `{command} --help`)", err=True)
        sys.exit(2)
    except click.ClickException as error:
        click.echo(f"kvtrace: error: {visible(error.format_message())}", err=True)
        sys.exit(error.exit_code)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except BrokenPipeError:
        files.discard_stdout()
        sys.exit(0)
