"""kvtrace's cache: its folders, SQLite exports of .nsys-rep reports, and the trace cache (entries of loaded
traces that a later load maps instead of reading the export again).

An entry is a folder named by the export's identity (path, device, inode, size, modification and change
time) and the kvtrace version. It holds the calls' layout (analyzer.calls: one .npy file per array, mapped
when read), the cell, signature and range tables as Arrow IPC files, the trace's info as JSON, and kvtrace's
marker with that identity and each file's size and CRC-32, which a read checks before it maps anything
(docs/reliability.md). An entry is written under a temporary name (`partial`) while the export is read, and
renamed into place once whole (`seal`).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import polars as pl

import kvtrace.files
import kvtrace.nsys
from kvtrace import __version__
from kvtrace.analyzer import calls as calls_
from kvtrace.errors import KvtraceError
from kvtrace.nsys import is_sqlite

CACHE_FORMAT = 4  # bump whenever the cached frames, TraceInfo or the entry's files change shape
CACHE_DAYS = 14  # entries not read for this long are removed when another entry is written
_FRAMES = ("cells", "signatures", "ranges")
_ENTRY_FILES = (*(f"{name}.arrow" for name in _FRAMES), *(f"{name}.npy" for name in calls_.ARRAYS), "info.json")
# kvtrace's own file in each entry, written first: the clean-up removes only folders that hold it, and a read
# checks the entry against it (which export, as it is now; each file's size and CRC-32).
_MARKER = "kvtrace-cache-entry.json"
# <export stem>-<hash of its path>-<hash of its identity>, and .<that>-<random> while it is being written.
_ENTRY_NAME = re.compile(r"\.?.+-[0-9a-f]{12}-[0-9a-f]{12}(?:-\w+)?", re.DOTALL)
# An export kvtrace made of a report: <report stem, at most 64 characters>-<20 hex digits of its identity>.
_EXPORT_NAME = re.compile(r".{1,64}-[0-9a-f]{20}\.(?:sqlite|parquetdir|sqlite\.json)", re.DOTALL)
# An export's seal: the report it is of (its key) and each of its files' inode, mtime, size and CRC-32 as they were
# before it was published (a rename keeps them). Inside a Parquet export; beside an SQLite one, as NAME.json.
_SEAL = "kvtrace-export.json"
# What an export killed on its way leaves (files.beside, nsys.export_parquet): .<export name>.<random>[.sqlite].
_EXPORT_LEFTOVER = re.compile(r"\..{1,64}-[0-9a-f]{20}\.(?:sqlite|parquetdir)\.\w+(?:\.sqlite)?", re.DOTALL)
LEFTOVER_DAYS = 1  # far longer than any export runs
_IDENTITY = ("dev", "ino", "size", "mtime_ns", "ctime_ns")
_warned: set[str] = set()

Loaded = TypeVar("Loaded")


@dataclass(frozen=True)
class Entry:
    path: Path
    export: dict  # the export's identity when the load began


def entry_of(export_path: Path) -> Entry | None:
    """The cache entry of this export (an SQLite file, or a Parquet folder and its files) as it is now, or None when there is no private cache folder. Another
    path, device, inode, size, modification or change time (which `touch` and `cp -p` cannot set back), or
    kvtrace version is another entry."""
    folder = cache_dir("traces")
    if folder is None:
        return None
    resolved = export_path.resolve()
    status = resolved.stat()
    export = {"path": str(resolved), "device": status.st_dev, "inode": status.st_ino, "size": status.st_size,
              "mtime_ns": status.st_mtime_ns, "ctime_ns": status.st_ctime_ns, "cache_format": CACHE_FORMAT,
              "kvtrace": __version__}
    if stat.S_ISDIR(status.st_mode):
        # A Parquet export: a file rewritten in place leaves the folder's own times as they were, so each
        # file's identity is part of the folder's.
        export["files"] = sorted([entry.name, *(getattr(entry.stat(), f"st_{key}") for key in _IDENTITY)]
                                 for entry in os.scandir(resolved))
    place = hashlib.sha256(os.fsencode(resolved)).hexdigest()[:12]
    version = hashlib.sha256(json.dumps(export, sort_keys=True).encode()).hexdigest()[:12]
    # The stem only labels the entry (the hashes identify it): bytes that are not UTF-8 become U+FFFD, which Arrow's
    # file API can pass on.
    stem = os.fsencode(resolved.stem[:64]).decode(errors="replace")
    return Entry(folder / f"{stem}-{place}-{version}", export)


class _Unsound(Exception):
    """A cache entry that is not a whole, unchanged copy of this export's frames."""


def read(entry: Entry, workers: int, build: Callable[[dict, dict[str, pl.DataFrame], calls_.Calls], Loaded]
         ) -> Loaded | None:
    """What `build` makes of the entry's info, frames (signatures, ranges) and mapped calls, or None when
    there is no entry. An entry that fails its checks (damaged, left half written, planted, a link, another
    export's), or that `build` cannot take (KeyError, TypeError, ValueError), is removed, so that it is
    written again."""
    import pyarrow as pa

    try:
        folder = os.lstat(entry.path)
    except OSError:
        return None
    try:
        if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.getuid():
            raise _Unsound
        marker = json.loads(_entry_bytes(entry.path / _MARKER))
        if marker.get("export") != entry.export:
            raise _Unsound
        with ThreadPoolExecutor(max_workers=workers) as pool:  # zlib releases the GIL
            found = list(pool.map(_size_and_crc, (entry.path / name for name in _ENTRY_FILES)))
        if [marker["files"][name] for name in _ENTRY_FILES] != found:
            raise _Unsound
        info = json.loads(_entry_bytes(entry.path / "info.json"))
        frames = {}
        for name in _FRAMES:
            with pa.memory_map(str(entry.path / f"{name}.arrow")) as mapped:
                frames[name] = pl.from_arrow(pa.ipc.open_file(mapped).read_all())
        # Memory-mapped: the calls' columns are views of the page cache, paged in as an analysis reads them.
        calls = calls_.open_layout(entry.path, frames.pop("cells"))
        loaded = build(info, frames, calls)
    except (_Unsound, calls_.Damaged, OSError, ValueError, KeyError, TypeError, pa.ArrowException,
            pl.exceptions.PolarsError):
        _discard(entry.path)
        return None
    with suppress(OSError):
        os.utime(entry.path)  # last use, for the age-based clean-up
    return loaded


def _entry_bytes(path: Path) -> bytes:
    """A file of an entry, never through a link."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as handle:
        return handle.read()


def _size_and_crc(path: Path) -> list[int]:
    """Size and CRC-32 of a file of an entry (about 0.1 s per 10M kernels). Read in chunks rather than mapped,
    so that the pass adds nothing to the process's resident memory."""
    crc, size, chunk = 0, 0, bytearray(1 << 20)
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb", buffering=0) as handle:
        while got := handle.readinto(chunk):
            crc = zlib.crc32(memoryview(chunk)[:got], crc)
            size += got
    return [size, crc]


def partial(entry: Entry) -> Path | None:
    """A new entry's folder under a temporary name, kvtrace's (marked) from the first moment so that the clean-up
    knows it; None when the cache folder cannot take it. The loader lays the calls out in it."""
    try:
        folder = Path(tempfile.mkdtemp(dir=entry.path.parent, prefix=f".{entry.path.name}-"))
    except OSError:
        return None
    try:
        (folder / _MARKER).write_text(json.dumps({"kvtrace_cache_entry": CACHE_FORMAT}))
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return folder


def seal(entry: Entry, folder: Path, frames: dict[str, pl.DataFrame], info: dict, workers: int) -> None:
    """Complete an entry whose calls are laid out in `folder` (from `partial`) with its frames (cells,
    signatures, ranges), info, and the marker with each file's size and CRC-32, and rename it into place; then
    remove older entries and leftover temporary folders of the same export, and entries unused for
    CACHE_DAYS. Caching is best effort: on failure the folder goes, and the trace keeps its mapped calls."""
    import pyarrow as pa

    try:
        try:
            for name in _FRAMES:
                table = frames[name].rechunk().to_arrow()
                with pa.OSFile(str(folder / f"{name}.arrow"), "wb") as sink, \
                        pa.ipc.new_file(sink, table.schema) as writer:
                    writer.write_table(table, max_chunksize=max(table.num_rows, 1))
            (folder / "info.json").write_text(json.dumps(info))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                files = dict(zip(_ENTRY_FILES, pool.map(_size_and_crc, (folder / name for name in _ENTRY_FILES))))
            marker = {"kvtrace_cache_entry": CACHE_FORMAT, "export": entry.export, "files": files}
            (folder / _MARKER).write_text(json.dumps(marker))
            os.replace(folder, entry.path)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    except OSError:
        return
    same_export = entry.path.name.rsplit("-", 1)[0] + "-"
    unused_since = time.time() - CACHE_DAYS * 86400
    for other in entry.path.parent.iterdir():
        with suppress(OSError):
            if other != entry.path and _is_entry(other) and (other.name.lstrip(".").startswith(same_export)
                                                             or other.lstat().st_mtime < unused_since):
                shutil.rmtree(other)


def _is_entry(path: Path) -> bool:
    """Whether kvtrace made this folder: an entry's name, a folder of this user's (not a link to one), and
    kvtrace's marker file in it. Nothing else in the cache folder is ever removed."""
    if not _ENTRY_NAME.fullmatch(path.name):
        return False
    try:
        folder, marker = os.lstat(path), os.lstat(path / _MARKER)
    except OSError:
        return False
    return stat.S_ISDIR(folder.st_mode) and folder.st_uid == os.getuid() and stat.S_ISREG(marker.st_mode)


def _discard(path: Path) -> None:
    """Clear an entry's name for a sound entry: a link or file there is unlinked (never followed), a folder
    removed only when kvtrace made it."""
    with suppress(OSError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
        elif _is_entry(path):
            shutil.rmtree(path)


# ---- .nsys-rep export ---------------------------------------------------------------------------------

def export_report(report: Path, *, nsys: str | None = None, tables: tuple[str, ...] = (),
                  step: Callable[[str], None] | None = None,
                  note: Callable[[Path, str], None] | None = None) -> Path:
    """Export an .nsys-rep in kvtrace's cache (never beside the user's file): with `tables` (all kvtrace reads),
    to a Parquet folder of only those, the fastest exact export below PARQUET_MAX_REPORT_BYTES
    (docs/performance.md); to SQLite for a larger report, or where this nsys cannot give an exact Parquet
    export (one line on standard error says why), of only `tables`, or of every table where it cannot export
    only those. `step` hears what runs, `note` the report and that line (standard error without
    it).

    A sibling `<report>.sqlite` newer than the report is used as is, as 2023.4.4's `nsys recipe` does
    (2025.3's exports Parquet instead).
    """
    sibling = report.with_suffix(".sqlite")
    # Only a regular file: a folder of that name, or a FIFO planted there, is no export.
    if sibling.is_file() and sibling.stat().st_mtime >= report.stat().st_mtime and is_sqlite(sibling):
        return sibling
    try:
        nsys_path = kvtrace.nsys.find_nsys(nsys)
    except KvtraceError as error:
        raise KvtraceError(f"an .nsys-rep needs nsys to export it: {error}; or pass the .sqlite from "
                           "`nsys export --type sqlite`") from None
    # The same identity as a trace-cache entry: a report rewritten with its size and mtime kept is another key.
    # An export of every table (older kvtrace, or the fallback) holds what one of `tables` does: same key.
    status = report.stat()
    identity = (report.resolve(), status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns,
                status.st_ctime_ns, nsys_path)
    key = hashlib.sha256("|".join(map(str, identity)).encode(errors="surrogateescape")).hexdigest()[:20]
    folder = cache_dir("exports")
    if folder is None:  # no cache folder can be used: a temporary one for this command, removed as kvtrace exits
        folder = Path(tempfile.mkdtemp(prefix="kvtrace-export-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    parquet, target = (folder / f"{report.stem[:64]}-{key}{suffix}" for suffix in (".parquetdir", ".sqlite"))
    # Only what kvtrace sealed there for this report, unchanged; anything else at the name (damaged, another
    # report's, a folder or link planted) is cleared and the report exported again.
    for export in (parquet, target):
        if os.path.lexists(export):
            if _sealed(export, key):
                return export
            _clear(export)
    # A large report goes to SQLite by choice, not for want of Parquet: no note.
    large = status.st_size >= kvtrace.nsys.PARQUET_MAX_REPORT_BYTES
    wants_parquet = bool(tables) and not large
    seal = functools.partial(_write_seal, key=key, export=target)
    try:
        _prune_exports(folder)
        why = _export_parquet(nsys_path, report, parquet, tables, step, key) if wants_parquet else None
        if wants_parquet and why is None:
            return parquet
        if step is not None:
            step(f"exporting {report.name} (nsys export{', the tables kvtrace reads' if tables else ''}"
                 f"{'; SQLite, faster than Parquet for a report this large' if large else ''})")
        try:
            kvtrace.nsys.export_sqlite(nsys_path, report, target, tables=tables, seal=seal)
        except kvtrace.nsys.ExportFailed as failed:
            if not tables or failed.newer_report:
                raise
            kvtrace.nsys.export_sqlite(nsys_path, report, target, seal=seal)  # this nsys may not know --tables
            why = (f"{why}; " if why else "") + (f"it could not export only the tables kvtrace reads "
                                                   f"({failed.last_line}); exported every table instead")
        if why:
            (note or _note)(report, f"{_version(nsys_path)}: {why}")
    except kvtrace.nsys.ExportFailed as failed:
        if failed.newer_report:
            raise KvtraceError(f"{_version(nsys_path)} cannot read {report}: it was recorded by a newer "
                               "Nsight Systems; export it there (nsys export --type sqlite) or point "
                               "NSYS at that version") from None
        raise KvtraceError(f"nsys export failed on {report} (exit {failed.returncode}: {failed.last_line}); "
                           "check the report opens in Nsight Systems, or export it yourself") from None
    except OSError as error:
        raise KvtraceError(f"cannot write the export of {report} into {folder}: "
                           f"{(error.strerror or str(error)).lower()}; make that folder writable, or set "
                           "KVTRACE_CACHE_DIR to one that is") from None
    return target


def _files_of(export: Path) -> list[tuple[str, Path]]:
    """An export's files by name: a Parquet folder's (its seal aside), or the SQLite file itself ("")."""
    if not stat.S_ISDIR(os.lstat(export).st_mode):
        return [("", export)]
    return sorted((entry.name, Path(entry.path)) for entry in os.scandir(export) if entry.name != _SEAL)


def _seal_of(export: Path, key: str) -> dict:
    found = []
    for name, path in _files_of(export):
        status = os.lstat(path)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(f"{path} is not a regular file")
        found.append([name, status.st_ino, status.st_mtime_ns, *_size_and_crc(path)])
    return {"kvtrace_export": key, "files": found}


def _seal_path(written: Path, export: Path) -> Path:
    """Where the seal of the export published as `export` goes while the export is at `written` (the name it is
    renamed from, or `export` itself): inside a Parquet folder, which it moves with; beside an SQLite file, as
    `export`'s name with .json."""
    return written / _SEAL if stat.S_ISDIR(os.lstat(written).st_mode) else export.with_name(f"{export.name}.json")


def _write_seal(written: Path, *, key: str, export: Path) -> None:
    """Seal a new export before it is published as `export`."""
    kvtrace.files.write(_seal_path(written, export), json.dumps(_seal_of(written, key)))


def _sealed(export: Path, key: str) -> bool:
    """Whether the export at this name is a real file or folder of this user's whose seal names this report and
    whose files are the ones sealed, byte for byte (CRC-32, as trace-cache entries are checked)."""
    try:
        status = os.lstat(export)
        if status.st_uid != os.getuid() or not (stat.S_ISDIR(status.st_mode) or stat.S_ISREG(status.st_mode)):
            return False
        return json.loads(_entry_bytes(_seal_path(export, export))) == _seal_of(export, key)
    except (OSError, ValueError):
        return False


def _clear(export: Path) -> None:
    """Remove what stands at an export's name in kvtrace's private exports folder: a link is unlinked (never
    followed), a folder removed, a file unlinked."""
    try:
        if stat.S_ISDIR(os.lstat(export).st_mode):
            shutil.rmtree(export)
        else:
            os.unlink(export)
    except FileNotFoundError:
        pass  # another kvtrace cleared it meanwhile
    except OSError as error:
        raise KvtraceError(f"cannot replace {export}, which is no sound export of its report: "
                           f"{(error.strerror or str(error)).lower()}; remove it, or set KVTRACE_CACHE_DIR") from None


def _prune_exports(folder: Path) -> None:
    """Before a new export: remove kvtrace's exports made more than CACHE_DAYS ago (a report used since is exported
    and read again once: its trace-cache entry is keyed on the export), and what exports killed on their way left
    more than LEFTOVER_DAYS ago. Only this user's files and folders of those names, never a link or anything else
    in the folder."""
    now = time.time()
    for other in folder.iterdir():
        with suppress(OSError):
            status = os.lstat(other)
            days = CACHE_DAYS if _EXPORT_NAME.fullmatch(other.name) else \
                LEFTOVER_DAYS if _EXPORT_LEFTOVER.fullmatch(other.name) else None
            if days is None or status.st_uid != os.getuid() or status.st_mtime >= now - days * 86400:
                continue
            if stat.S_ISREG(status.st_mode):
                os.unlink(other)
            elif stat.S_ISDIR(status.st_mode):
                shutil.rmtree(other)


def _export_parquet(nsys_path: str, report: Path, parquet: Path, tables: tuple[str, ...],
                    step: Callable[[str], None] | None, key: str) -> str | None:
    """Export `tables` to the Parquet folder `parquet`: None once it is there, else why not (for the note that
    the SQLite export replaces it). A report this nsys cannot read at all raises (ExportFailed), as SQLite would
    fail on it too."""
    if kvtrace.nsys.parquet_known_inexact(kvtrace.nsys.nsys_version(nsys_path)):
        return "its Parquet output lacks META_DATA_CAPTURE (the CUDA graph trace mode): exported to SQLite instead"
    if step is not None:
        step(f"exporting {report.name} (nsys export --type parquetdir, the tables kvtrace reads)")
    try:
        kvtrace.nsys.export_parquet(nsys_path, report, parquet, tables,
                                    seal=functools.partial(_write_seal, key=key, export=parquet))
    except kvtrace.nsys.ExportFailed as failed:
        if failed.newer_report:
            raise
        return f"it could not export Parquet ({failed.last_line}): exported to SQLite instead"
    return None


def _note(report: Path, line: str) -> None:
    sys.stderr.write(f"kvtrace: note: {report}: {line}\n")


def notes_text(notes: dict[Path, str]) -> str:
    """The notes of several reports' exports, one line per note, naming every report it is about."""
    reports: dict[str, list[str]] = {}
    for report, line in notes.items():
        reports.setdefault(line, []).append(str(report))
    return "".join(f"kvtrace: note: {' and '.join(names)}: {line}\n" for line, names in reports.items())


def _version(nsys_path: str) -> str:
    return kvtrace.nsys.nsys_version(nsys_path).replace("NVIDIA ", "")


def export_reports(reports: list[Path], workers: int, *, nsys: str | None = None, tables: tuple[str, ...] = (),
                   step: Callable[[str], None] | None = None,
                   notes: dict[Path, str] | None = None) -> dict[Path, Path]:
    """Each distinct report's export (export_report), several at once when there are cores for them: nsys
    export runs on about one core. A report named twice is exported once; the first failure, in the
    reports' order, is raised. `notes` receives each export's note (export_report), by report."""
    distinct = list(dict.fromkeys(report.resolve() for report in reports))
    at_once = max(1, min(len(distinct), workers))
    if step is not None and at_once > 1:
        names = " and ".join(report.name for report in distinct)
        inner, step = step, lambda message: inner(f"exporting {names} ({at_once} at once)")
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        told: dict[Path, str] = {}
        futures = [pool.submit(export_report, report, nsys=nsys, tables=tables, step=step, note=told.__setitem__)
                   for report in distinct]
        exported = {report: future.result() for report, future in zip(distinct, futures)}
    if notes is not None:
        notes.update((report, told[report]) for report in distinct if report in told)  # in the reports' order
    else:
        sys.stderr.write(notes_text({report: told[report] for report in distinct if report in told}))
    return exported


# ---- cache folders ------------------------------------------------------------------------------------

def cache_dir(kind: str) -> Path | None:
    """kvtrace's cache folder for `kind` (exports, traces): $KVTRACE_CACHE_DIR, else $XDG_CACHE_HOME/kvtrace
    or ~/.cache/kvtrace. When that cannot be created, or is not this user's alone (another user could plant
    entries in it), a folder of this user's own under the temporary directory; None if even that is not."""
    xdg = os.environ.get("XDG_CACHE_HOME") or ""
    # The XDG spec: a relative XDG_CACHE_HOME is invalid and ignored (it would put the cache in the working folder).
    base = Path(os.environ.get("KVTRACE_CACHE_DIR") or
                Path(xdg if os.path.isabs(xdg) else Path.home() / ".cache") / "kvtrace")
    fallback = Path(tempfile.gettempdir()) / f"kvtrace-{os.getuid()}"
    for folder in (base / kind, fallback / kind):
        try:
            folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder.mkdir(mode=0o700, exist_ok=True)
        except OSError:
            continue
        if not _private(folder.parent if folder.parent == fallback else folder):
            problem = "is not this user's alone (owner or mode)", "make it yours with mode 0700"
        elif not os.access(folder, os.W_OK | os.X_OK):
            problem = "cannot be written", "make it writable"
        else:
            return folder
        if str(folder) not in _warned:
            _warned.add(str(folder))
            sys.stderr.write(f"kvtrace: warning: cache folder {folder} {problem[0]}; not using it: {problem[1]}, "
                             "or set KVTRACE_CACHE_DIR\n")
    return None


def _private(folder: Path) -> bool:
    """A folder (links followed) that this user owns and no one else may write to."""
    try:
        status = folder.stat()
    except OSError:
        return False
    return stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid() and not status.st_mode & 0o022
