"""`kvtrace` entry point.

Subcommands are imported on first use so that `kvtrace capture ...` runs on a bare GPU box without the
analyzer's dependencies (polars, matplotlib), and `kvtrace diff ...` never imports torch.
"""

from __future__ import annotations

import difflib
import importlib
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


def main(argv: list[str] | None = None) -> None:
    # A bare `kvtrace` asks what there is: the help on standard output, not a usage error.
    args = (sys.argv[1:] if argv is None else argv) or ["--help"]
    try:
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
