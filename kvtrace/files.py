"""Reading small input files (manifests, configs, recipes) and writing output files: the one atomic write (also
for files another program writes), and what an output path may name.

Standard library only: the analyzer (reports, plots) and capture (manifests, on a bare GPU box) both use it.

Rules for a target path (docs/reliability.md lists them for users):
- `-` is standard output.
- A target that is one of the command's inputs (the same file, through any link) is refused.
- A regular file, or a name not yet taken, is written atomically: a temporary file in the same folder,
  renamed over the target, so that a reader sees the old file or the new one, never half of it.
- A symbolic link is written through: its final target is replaced, the link stays.
- Anything else (a character device such as /dev/null, a FIFO, a terminal) is written in place, as a shell
  redirect would; so is a file reached through an open descriptor (/dev/stdout, /dev/fd/N), which is
  appended to, because the shell that opened it may have opened it for appending.
Every failure is a KvtraceError naming the target and what to do.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtrace.errors import KvtraceError

STDOUT = "-"
# Signals that end a process by default: held back while a temporary file exists, so that it never stays
# behind (SIGKILL cannot be held back; a killed write leaves at most a hidden `.NAME.*.tmp`, never a torn target).
_DEFERRED_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
_DESCRIPTOR_FOLDER = re.compile(r"/proc/\d+(?:/task/\d+)?/fd")


# Manifests, model configs and recipes are kilobytes; anything past this is not one (or is /dev/zero's like).
SMALL_INPUT_BYTES = 64 << 20


def read_small(path: str | os.PathLike, what: str, fix: str) -> bytes:
    """The bytes of a small input file (`what`, e.g. "recipe x.toml"), read only from a regular file and only up
    to SMALL_INPUT_BYTES: a FIFO would wait for a writer and a device such as /dev/zero never ends."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise KvtraceError(f"{what}: not a regular file (a folder, pipe, FIFO or device); {fix}")
            data = handle.read(SMALL_INPUT_BYTES + 1)
    except OSError as error:
        raise KvtraceError(f"{what}: cannot be read ({(error.strerror or str(error)).lower()}); {fix}") from None
    if len(data) > SMALL_INPUT_BYTES:
        raise KvtraceError(f"{what}: over {SMALL_INPUT_BYTES >> 20} MiB, too large for its kind; {fix}")
    return data


def read_json(path: str | os.PathLike, what: str, fix: str):
    """A small JSON file; nesting deeper than the parser's recursion limit is refused like any other text that is
    not JSON. NaN and Infinity parse as Python's json reads them (capture writes a serving client's NaN as is):
    the readers of manifests and configs check each number they use for its range, which NaN never passes."""
    try:
        return json.loads(read_small(path, what, fix))
    except RecursionError:
        raise KvtraceError(f"{what} is not readable JSON (nested too deeply): {fix}") from None
    except ValueError as error:
        raise KvtraceError(f"{what} is not readable JSON ({error}): {fix}") from None


def sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_stdout(path: str | os.PathLike | None) -> bool:
    return path is not None and os.fspath(path) == STDOUT


def discard_stdout() -> None:
    """Standard output's reader has gone (`kvtrace diff … | head`): what is still written goes nowhere, so that
    neither the rest of the command nor the interpreter's final flush fails on it."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def check_target(path: str | os.PathLike, inputs=()) -> None:
    """Refuse a target that the write would destroy or that cannot be written: one of `inputs`, a folder,
    or a name in a folder that does not exist."""
    if is_stdout(path):
        return
    path = Path(path)
    try:
        target = path.stat()
    except FileNotFoundError:
        target = None
    except OSError as error:
        raise _cannot_write(path, error) from None
    if target is not None:
        for source in inputs:
            try:
                if os.path.samestat(target, os.stat(source)):
                    raise KvtraceError(f"cannot write {path}: it is the input {source}, and kvtrace never "
                                       "overwrites its inputs; choose another output file")
            except OSError:
                continue
        if stat.S_ISDIR(target.st_mode):
            raise KvtraceError(f"cannot write {path}: it is a directory; name a file in it")
        return
    folder = Path(os.path.realpath(path)).parent if path.is_symlink() else path.parent
    if not folder.is_dir():
        raise KvtraceError(f"cannot write {path}: folder {folder} does not exist; create it first")


def check_folder(folder: str | os.PathLike, inputs=(), option: str = "--plots") -> None:
    """Refuse an output folder that is the folder of an input, or lies inside a run directory (the folder of an
    input manifest.json): outputs are never written among what kvtrace reads."""
    place = Path(os.path.realpath(folder))
    for source in inputs:
        home = Path(os.path.realpath(source)).parent
        if place == home or (Path(source).name == "manifest.json" and home in place.parents):
            raise KvtraceError(f"{option} {folder}: it is or lies inside {home}, which holds the input {source}, and "
                               "kvtrace never writes among its inputs; name a folder of its own for the output")


def write(path: str | os.PathLike, data: str | bytes, inputs=()) -> None:
    """Write `data` (text is UTF-8) to a file by the rules above (standard output is the caller's)."""
    payload = data.encode() if isinstance(data, str) else data
    check_target(path, inputs)
    path = Path(path)
    try:
        in_place = path.exists() and not stat.S_ISREG(path.stat().st_mode)
        if in_place or _through_descriptor(path):
            # No O_CREAT: the target exists. O_APPEND only matters for a regular file behind a descriptor.
            flags = os.O_WRONLY | (0 if in_place else os.O_APPEND)
            with open(os.open(path, flags), "wb") as handle:
                handle.write(payload)
            return
        _replace(Path(os.path.realpath(path)), payload)
    except OSError as error:
        raise _cannot_write(path, error) from None


@contextmanager
def beside(target: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A new empty file in `target`'s folder, for the block to fill (kvtrace, or a program such as nsys export):
    renamed over `target` when the block ends, removed when it raises. A reader of `target` sees the old file
    or the whole new one, never half of it."""
    # The target's name is cut to 128 bytes in the temporary one, so that a name near the file system's limit
    # (255 bytes) can still be written.
    stem = os.fsdecode(os.fsencode(target.name)[:128])
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{stem}.", suffix=suffix)
    os.close(fd)
    temporary = Path(name)
    try:
        yield temporary
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def _replace(target: Path, payload: bytes) -> None:
    with _signals_deferred(), beside(target) as temporary:
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, _mode_for(target))


def _mode_for(target: Path) -> int:
    """The replaced file's permissions; for a new file what open() would give (mkstemp makes 0600)."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def _through_descriptor(path: Path) -> bool:
    """Whether the path reaches its file through /proc/PID/fd (/dev/stdout, /dev/fd/1, /proc/self/fd/1)."""
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        folder = os.path.realpath(os.path.dirname(current))
        if _DESCRIPTOR_FOLDER.fullmatch(folder):
            return True
        current = os.path.join(folder, os.path.basename(current))
        if not os.path.islink(current):
            return False
        current = os.path.join(folder, os.readlink(current))
    return False


@contextmanager
def _signals_deferred():
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _cannot_write(path: Path, error: OSError) -> KvtraceError:
    reason = os.strerror(error.errno).lower() if error.errno else str(error)
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "choose a folder you can write to"
    elif error.errno == errno.ENOENT:
        fix = "check that its folder exists"
    else:
        fix = "choose another output file"
    return KvtraceError(f"cannot write {path}: {reason}; {fix}")
