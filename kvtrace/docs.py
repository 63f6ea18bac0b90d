"""Print the CLI reference (docs/cli.md) from the commands' own --help; tests/test_packaging.py keeps it
current."""

from __future__ import annotations

import click

from kvtrace.cli import cli


def walk(command: click.Command, path: list[str]):
    yield path, command
    if isinstance(command, click.Group):
        context = click.Context(command, info_name=" ".join(path))
        for name in command.list_commands(context):
            yield from walk(command.get_command(context, name), path + [name])


def reference() -> str:
    parts = ["# kvtrace command-line reference", "",
             "Generated from `--help` by `make docs`; `tests/test_packaging.py` fails when it is out of date.", ""]
    for path, command in walk(cli, ["kvtrace"]):
        context = click.Context(command, info_name=" ".join(path), terminal_width=100,
                                help_option_names=["-h", "--help"])
        parts += [f"## `{' '.join(path)}`", "", "```", command.get_help(context), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference(), end="")
