"""The one exception type the CLI turns into a one-line message and exit code 2."""


class KvtraceError(Exception):
    """Bad input or environment: the message names the problem and the fix."""

    exit_code = 2
