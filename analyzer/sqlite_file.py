"""An SQLite file as kvtrace opens it: a regular, readable, complete file, settled (no rows beside it in a
`-wal` or hot `-journal`), opened read-only and immutable. Nothing here knows nsys tables (analyzer.load does).
"""

from __future__ import annotations

import os
import sqlite3
import stat
import struct
from contextlib import suppress
from pathlib import Path
from urllib.parse import quote

from kvtrace.errors import KvtraceError


def check_file(path: Path) -> None:
    try:
        status = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise KvtraceError(f"{path}: no such file: check the path") from None
    except OSError as error:
        # Typically a folder on the way that this user may not search (no x permission).
        raise KvtraceError(f"cannot reach {path}: {error.strerror.lower()}; check the permissions of the folders "
                           "on its path") from None
    if stat.S_ISDIR(status.st_mode):
        try:
            found = sorted(p.name for p in path.iterdir() if p.suffix in (".sqlite", ".nsys-rep"))
        except OSError:
            found = []
        hint = f" (it holds {', '.join(found[:4])})" if found else ""
        raise KvtraceError(f"{path} is a directory{hint} but not an Nsight Systems Parquet export (no "
                           "StringIds.parquet): pass one .sqlite or .nsys-rep file, or the folder that "
                           "`nsys export --type parquetdir` writes")
    if not stat.S_ISREG(status.st_mode):
        # Opening a FIFO would wait for a writer, and SQLite needs to seek: streams are not read.
        raise KvtraceError(f"{path} is not a regular file (a pipe, FIFO or device): kvtrace reads exports from "
                           "files; save the stream to a .sqlite file first")
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as error:
        raise KvtraceError(f"cannot read {path}: {error.strerror.lower()}; check its permissions") from None
    if status.st_size == 0:
        raise KvtraceError(f"{path} is empty (0 bytes): re-run `nsys export --type sqlite` on the report")


def check_size(path: Path) -> None:
    """Compare the file with the size its header promises, which catches truncated copies."""
    with open(path, "rb") as handle:
        header = handle.read(100)
    if len(header) < 100:
        raise KvtraceError(f"{path} is truncated (only {len(header)} bytes): copy or export it again")
    page_size = struct.unpack(">H", header[16:18])[0]
    page_size = 65536 if page_size == 1 else page_size
    change_counter, page_count = struct.unpack(">II", header[24:32])
    version_valid_for = struct.unpack(">I", header[92:96])[0]
    actual = path.stat().st_size
    if change_counter == version_valid_for and page_count and actual < page_size * page_count:
        raise KvtraceError(f"{path} is truncated ({actual} of {page_size * page_count} bytes): copy or export "
                           "it again")


# The first bytes of a rollback journal that still holds a transaction; SQLite zeroes them once it is done.
_JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")


def check_settled(path: Path) -> None:
    """Refuse an export that SQLite would show differently from its main file: committed rows still in its
    `-wal` (WAL mode, not checkpointed, or a writer still at work) or a hot `-journal` (a writer that died or is
    mid-transaction). kvtrace reads exports as immutable, which looks at the main file alone, and it never opens
    them for writing, which is what replaying a journal or checkpointing a WAL would take."""
    wal, journal = Path(f"{path}-wal"), Path(f"{path}-journal")
    copy = f"make a consistent copy with `sqlite3 {path} \".backup copy.sqlite\"` once no writer is left, and pass that"
    with suppress(OSError):
        if wal.stat().st_size > 0:
            raise KvtraceError(f"{path} has rows in {wal.name} beside it that its main file lacks (a WAL-mode "
                               f"database not checkpointed, or a writer still at work): {copy}")
    with suppress(OSError):
        if not stat.S_ISREG(journal.stat().st_mode):  # never open a FIFO planted there
            return
        with open(journal, "rb") as handle:
            if handle.read(8) == _JOURNAL_MAGIC:
                raise KvtraceError(f"{path} has an unfinished transaction in {journal.name} beside it (a writer "
                                   f"died or is still writing): {copy}")


def read_only_uri(path: Path) -> str:
    """The export as an SQLite URI opened read-only; the path's bytes are quoted, so that a file name that is not
    UTF-8 (kept by Python as surrogates) reaches SQLite as it is on disk."""
    return f"file:{quote(os.fsencode(path.resolve()))}?mode=ro&immutable=1"


def connect(path: Path) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(read_only_uri(path), uri=True)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.DatabaseError as error:
        raise KvtraceError(f"{path} is not a readable SQLite database ({error}): export it again") from None
