"""A trace's kernel calls grouped into cells, in a compact layout written chunk by chunk and memory-mapped.

A cell holds the calls of one signature launched inside ranges of one innermost NVTX range name (or outside
every named range). Per call, cell after cell and in start order within a cell, the layout keeps the call's
duration (uint32 ns when every kernel is shorter than 4.3 s, else int64), its rank (its position in start
order) and its innermost range; and, once in start order, every call's start. The cell of a call is implied
by its position. A comparison without a window reads the durations alone, 4 bytes per call; ranks, ranges
and starts are paged in only where a window or the launch order across cells needs them.

The loader hands in the calls chunk by chunk, from several threads at once (one chunk per rowid range of the
kernel table, each in table order). Chunks are counted by cell as they arrive, held in memory up to HELD_BYTES
and spilled to files beside the layout beyond that, and scattered into place once every chunk is in, so that
memory stays bounded whatever the trace's size.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl


# Per call, in cell order; and the starts, in start order.
ARRAYS = ("duration", "rank", "range", "start")
# Kept per call in table order until the layout is made. A duration is kept as uint32: the few that do not fit
# (kernels of 4.3 s and more) are kept beside, exactly.
_SPILLED = {"sig": np.uint32, "range": np.int32, "start": np.int64, "duration": np.uint32}
_SPILLED_BYTES = sum(np.dtype(t).itemsize for t in _SPILLED.values())
# Chunks are held in memory up to this much per layout, and spilled to files in the layout's folder beyond it:
# writing new file pages costs about 1.5 s of system time per GB on the machines of docs/performance.md.
HELD_BYTES = 256 << 20
BLOCK_ROWS = 1 << 18  # calls placed at a time per thread, about 10 MiB of working memory
_DENSE_KEYS = 1 << 22  # below this many (signature, name) keys, keys are counted and looked up in flat arrays


class Damaged(Exception):
    """A layout file that is not what the layout wrote."""


@dataclass(frozen=True)
class Calls:
    """A trace's calls by cell (see the module docstring).

    `cells` has a row per cell, ordered by (sig, name): cell, sig, name (a code in the trace's sorted range
    names; one past the last for calls outside every named range), calls, total_ns and first (the rank of
    its earliest call). Cell i is [offsets[i], offsets[i + 1]) of `duration`, `rank` and `range`.
    """

    cells: pl.DataFrame
    offsets: np.ndarray
    duration: np.ndarray
    rank: np.ndarray
    range: np.ndarray
    start: np.ndarray
    maps: tuple = ()  # the memory maps behind the arrays, if any

    @property
    def count(self) -> int:
        return int(self.offsets[-1])

    def release(self) -> None:
        """Hand the pages read so far back to the page cache: they stop counting as this process's memory
        and are read again from there when touched."""
        for mapped in self.maps:
            mapped.madvise(mmap.MADV_DONTNEED)

    def per_kernel(self) -> pl.DataFrame:
        """One row per call in start order (start, duration, sig, range): the whole trace in memory, for
        tests and small traces."""
        sig = np.repeat(self.cells["sig"].to_numpy(), np.diff(self.offsets))
        rows = np.empty(self.count, dtype=np.int64)
        rows[self.rank] = np.arange(self.count)
        return pl.DataFrame({"start": np.asarray(self.start), "duration": self.duration[rows].astype(np.int64),
                             "sig": sig[rows].astype(np.uint32), "range": self.range[rows]})


@dataclass(frozen=True)
class Laid:
    """What Layout.finish returns: the calls, and what the loader needs besides."""

    calls: Calls
    sig_order: np.ndarray  # per signature as the chunks numbered it, its number in the calls
    launched: np.ndarray  # per range, the calls launched with it as the innermost range
    last_end: int | None  # the latest end of a call


class Layout:
    """Builds a Calls from chunks of calls; `folder` holds the spilled chunks and the layout's files (None:
    everything stays in memory)."""

    def __init__(self, folder: Path | None, name_of_range: np.ndarray, outside: int):
        self.folder = folder
        # Per range, its name code; calls outside every range get `outside`, as do unnamed ranges.
        self.name_of_range = np.append(name_of_range.astype(np.int64), outside)
        self.width = outside + 1
        self.chunks: dict[int, _Chunk] = {}
        self.lock = threading.Lock()

    def chunk(self, index: int, rows: int) -> _Chunk:
        """The writer of chunk `index` of at most `rows` calls (chunks are laid out in index order), for one
        thread."""
        with self.lock:
            held = sum(c.capacity for c in self.chunks.values() if c.folder is None) * _SPILLED_BYTES
            in_memory = self.folder is None or held + rows * _SPILLED_BYTES <= HELD_BYTES
            chunk = _Chunk(self, index, None if in_memory else self.folder, rows)
            self.chunks[index] = chunk
        return chunk

    def discard(self) -> None:
        """Remove the spilled chunks, when the calls will not be laid out."""
        for chunk in self.chunks.values():
            chunk.close()
            chunk.remove()

    def finish(self, workers: int) -> Laid:
        """Lay the chunks out by cell, on `workers` threads. Ties in start keep table order."""
        chunks = [self.chunks[i] for i in sorted(self.chunks)]
        for chunk in chunks:
            chunk.close()
        base = np.concatenate([[0], np.cumsum([c.rows for c in chunks])]).astype(np.int64)
        total = int(base[-1])
        # Signatures are numbered in order of first appearance in the table, whichever chunk met them first.
        signatures = max((c.first_row.size for c in chunks), default=0)
        first_seen = np.full(signatures, np.iinfo(np.int64).max, dtype=np.int64)
        for chunk, first in zip(chunks, base[:-1].tolist()):
            seen = np.flatnonzero(chunk.first_row >= 0)
            first_seen[seen] = np.minimum(first_seen[seen], first + chunk.first_row[seen])
        sig_order = np.empty(signatures, dtype=np.int64)
        sig_order[np.argsort(first_seen, kind="stable")] = np.arange(signatures)
        launched = sum((c.launched for c in chunks), np.zeros(self.name_of_range.size, dtype=np.int64))
        last_end = max((c.last_end for c in chunks if c.rows), default=None)
        counted = [chunk.counted() for chunk in chunks]
        seen = np.unique(np.concatenate([k for k, _, _ in counted] + [np.zeros(0, dtype=np.int64)]))
        width = self.width
        cell_keys, cell_of_seen = np.unique(sig_order[seen // width] * width + seen % width, return_inverse=True)
        if signatures * width <= _DENSE_KEYS:
            flat = np.zeros(signatures * width, dtype=np.int64)
            flat[seen] = cell_of_seen
            cell_of = flat.__getitem__
        else:
            def cell_of(keys: np.ndarray) -> np.ndarray:
                return cell_of_seen[np.searchsorted(seen, keys)]
        calls, total_ns = np.zeros(cell_keys.size, dtype=np.int64), np.zeros(cell_keys.size, dtype=np.int64)
        earlier = []  # per chunk: its calls' cells, and the calls of those cells in earlier chunks
        for keys, counts, totals in counted:
            cells = cell_of(keys)
            earlier.append((cells, calls[cells].copy()))
            calls[cells] += counts
            total_ns[cells] += totals
        offsets = np.concatenate([[0], np.cumsum(calls)]).astype(np.int64)
        in_order = all(c.in_order for c in chunks) and all(
            a.last_start <= b.first_start for a, b in zip(chunks, chunks[1:]) if a.rows and b.rows)
        extremes = [c.extremes for c in chunks if c.rows]
        fits = not extremes or (min(e[0] for e in extremes) >= 0 and max(e[1] for e in extremes) < 1 << 32)
        index_type = np.uint32 if total < 1 << 32 else np.int64
        files = _Files(self.folder)
        out = {"duration": files.create("duration", np.uint32 if fits else np.int64, total),
               "rank": files.create("rank", index_type, total),
               "range": files.create("range", np.int32, total),
               "start": files.create("start", np.int64, total)}
        if not in_order:
            chunks, base = [_in_start_order(chunks)], np.array([0, total], dtype=np.int64)
            earlier = [(np.arange(cell_keys.size), np.zeros(cell_keys.size, dtype=np.int64))]
        for chunk, first in zip(chunks, base[:-1].tolist()):
            for block, values in chunk.blocks("start"):
                out["start"][first + block:first + block + values.size] = values
            files.release()

        def scatter(position: int) -> None:
            chunk, (cells, before) = chunks[position], earlier[position]
            cursor = offsets[:-1].copy()  # where this chunk's next call of each cell goes
            cursor[cells] += before
            for block, sig in chunk.blocks("sig"):
                rows = slice(block, block + sig.size)
                in_range = chunk.read("range", rows)
                cell = cell_of(sig.astype(np.int64) * self.width + self.name_of_range[in_range])
                if cell_keys.size <= 1 << 16:
                    cell = cell.astype(np.uint16)  # numpy radix-sorts 16-bit cell numbers
                order = np.argsort(cell, kind="stable")
                counts = np.bincount(cell, minlength=cell_keys.size)
                del cell
                # The block's calls sorted by cell go to consecutive places from each cell's cursor.
                present = np.flatnonzero(counts)
                target = np.repeat(cursor[present] - (np.cumsum(counts[present]) - counts[present]), counts[present])
                target += np.arange(target.size)
                cursor += counts
                out["duration"][target] = chunk.read("duration", rows)[order]
                out["range"][target] = in_range[order]
                for long_rows, long_durations in chunk.overflow:
                    inside = (long_rows >= rows.start) & (long_rows < rows.stop)
                    if inside.any():
                        place = np.empty(order.size, dtype=np.int64)
                        place[order] = target
                        out["duration"][place[long_rows[inside] - rows.start]] = long_durations[inside]
                order += int(base[position]) + block  # the rank of a call in start order is its row
                out["rank"][target] = order
                files.release()

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            list(pool.map(scatter, range(len(chunks))))
        for chunk in chunks:
            chunk.remove()
        first_rank = out["rank"][offsets[:-1]].astype(np.int64)
        files.release()
        cells = pl.DataFrame({"cell": np.arange(cell_keys.size, dtype=np.uint32),
                              "sig": (cell_keys // self.width).astype(np.uint32),
                              "name": (cell_keys % self.width).astype(np.uint32),
                              "calls": calls, "total_ns": total_ns, "first": first_rank})
        for array in out.values():
            array.flags.writeable = False
        return Laid(Calls(cells=cells, offsets=offsets, maps=files.maps, **out), sig_order, launched[1:], last_end)


def _in_start_order(chunks: list[_Chunk]) -> _Chunk:
    """Kernel rows out of start order: every chunk's calls in memory as one chunk, sorted by start (ties in
    table order). This costs about 32 bytes per kernel while loading; exports list a GPU's kernels in start
    order, so only traces of several GPUs can need it."""
    layout = chunks[0].layout
    rows = sum(c.rows for c in chunks)
    whole = _Chunk(layout, -1, None, 0)
    starts = np.concatenate([c.read("start") for c in chunks])
    order = np.argsort(starts, kind="stable")
    whole.held["start"] = starts[order]
    del starts
    for name in ("sig", "range", "duration"):
        whole.held[name] = np.concatenate([c.read(name) for c in chunks])[order]
    whole.rows = whole.capacity = rows
    whole.counts = [part for c in chunks for part in c.counts]
    if any(c.overflow for c in chunks):
        place = np.empty(rows, dtype=np.int64)
        place[order] = np.arange(rows)
        base = np.cumsum([0] + [c.rows for c in chunks])
        whole.overflow = [(place[first + long_rows], values) for c, first in zip(chunks, base)
                          for long_rows, values in c.overflow]
    for chunk in chunks:
        chunk.remove()
    return whole


class _Chunk:
    """One chunk of calls in table order, written by one thread: counted by cell key, and kept in memory (with
    room for `capacity` calls) or spilled to files in `folder`."""

    def __init__(self, layout: Layout, index: int, folder: Path | None, capacity: int):
        self.layout, self.index, self.folder, self.capacity = layout, index, folder, capacity
        self.rows = 0
        self.in_order = True
        self.first_start = self.last_start = 0
        self.extremes = (0, 0)  # smallest and largest duration
        self.last_end = None  # largest start + duration
        self.first_row = np.zeros(0, dtype=np.int64)  # per signature, its first row in the chunk (-1: none)
        # per range (from NO_RANGE), the calls launched in it
        self.launched = np.zeros(layout.name_of_range.size, dtype=np.int64)
        self.counts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.overflow: list[tuple[np.ndarray, np.ndarray]] = []  # rows and durations of calls of 2^32 ns or more
        self.handles = {}
        self.held: dict[str, np.ndarray] = {}
        if folder is not None:
            self.handles = {name: open(self._path(name), "wb") for name in _SPILLED}
        elif capacity:
            # An anonymous mapping of its own, so that its pages go back to the system with the chunk rather than
            # stay in the allocator's heap.
            memory, at = mmap.mmap(-1, capacity * _SPILLED_BYTES), 0
            for name, dtype in _SPILLED.items():
                self.held[name] = np.frombuffer(memory, dtype=dtype, count=capacity, offset=at)
                at += capacity * np.dtype(dtype).itemsize

    def _path(self, name: str) -> Path:
        return self.folder / f".chunk-{self.index}.{name}"

    def add(self, start: np.ndarray, duration: np.ndarray, sig: np.ndarray, in_range: np.ndarray) -> None:
        """A batch of calls, continuing the chunk in table order."""
        if not start.size:
            return
        if self.rows:
            self.in_order = self.in_order and bool(start[0] >= self.last_start)
        else:
            self.first_start = int(start[0])
        self.in_order = self.in_order and bool(np.all(start[1:] >= start[:-1]))
        self.last_start = int(start[-1])
        low, high = int(duration.min()), int(duration.max())
        self.extremes = (min(self.extremes[0], low), max(self.extremes[1], high)) if self.rows else (low, high)
        if high >= 1 << 32:
            long = np.flatnonzero(duration >= 1 << 32)
            self.overflow.append((self.rows + long, duration[long]))
        end = int((start + duration).max())
        self.last_end = end if self.last_end is None else max(self.last_end, end)
        top = int(sig.max()) + 1
        if top > self.first_row.size:
            self.first_row = np.concatenate([self.first_row, np.full(top - self.first_row.size, -1, np.int64)])
        new = np.flatnonzero((np.bincount(sig, minlength=self.first_row.size) > 0) & (self.first_row < 0))
        if new.size:
            rows = np.flatnonzero(np.isin(sig, new))
            found, first = np.unique(sig[rows], return_index=True)
            self.first_row[found] = self.rows + rows[first]
        self.launched += np.bincount(in_range + 1, minlength=self.launched.size)
        keys = sig.astype(np.int64) * self.layout.width + self.layout.name_of_range[in_range]
        if int(keys.max()) < _DENSE_KEYS:
            counts = np.bincount(keys)
            present = np.flatnonzero(counts)
            # Exact: a batch's time per cell stays far below 2^53 ns.
            totals = np.bincount(keys, weights=duration)[present].astype(np.int64)
            self.counts.append((present, counts[present], totals))
        else:
            present, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
            self.counts.append((present, counts, np.bincount(inverse, weights=duration).astype(np.int64)))
        rows = slice(self.rows, self.rows + start.size)
        for name, values in (("sig", sig), ("range", in_range), ("start", start), ("duration", duration)):
            values = values.astype(_SPILLED[name], copy=False)  # durations of 2^32 ns and more wrap: see overflow
            if self.handles:
                values.tofile(self.handles[name])
            else:
                self.held[name][rows] = values
        self.rows = rows.stop

    def counted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The chunk's cell keys, with their calls and summed durations."""
        if not self.counts:
            return (np.zeros(0, dtype=np.int64),) * 3
        keys = np.concatenate([k for k, _, _ in self.counts])
        unique, inverse = np.unique(keys, return_inverse=True)
        counts = np.bincount(inverse, weights=np.concatenate([c for _, c, _ in self.counts]), minlength=unique.size)
        totals = np.zeros(unique.size, dtype=np.int64)
        np.add.at(totals, inverse, np.concatenate([t for _, _, t in self.counts]))
        return unique, counts.astype(np.int64), totals

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()

    def read(self, name: str, rows: slice = slice(0, None)) -> np.ndarray:
        """One kept column, whole or some rows."""
        dtype = np.dtype(_SPILLED[name])
        stop = self.rows if rows.stop is None else rows.stop
        if self.folder is not None:
            return np.fromfile(self._path(name), dtype=dtype, count=stop - rows.start,
                               offset=rows.start * dtype.itemsize)
        return self.held[name][rows.start:stop] if name in self.held else np.zeros(0, dtype=dtype)

    def blocks(self, name: str):
        """(first row, values) of one kept column, BLOCK_ROWS at a time: memory stays at a block."""
        for first in range(0, self.rows, BLOCK_ROWS):
            yield first, self.read(name, slice(first, min(first + BLOCK_ROWS, self.rows)))

    def remove(self) -> None:
        if self.folder is not None:
            for name in _SPILLED:
                self._path(name).unlink(missing_ok=True)
        self.held = {}


class _Files:
    """The layout's arrays: .npy files mapped into memory in `folder`, or plain arrays without one."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.maps: tuple = ()

    def create(self, name: str, dtype, count: int) -> np.ndarray:
        if self.folder is None:
            return np.empty(count, dtype=dtype)
        path = self.folder / f"{name}.npy"
        with open(path, "wb+") as handle:
            np.lib.format.write_array_header_1_0(handle, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                          "fortran_order": False, "shape": (count,)})
            offset = handle.tell()
            handle.truncate(offset + count * np.dtype(dtype).itemsize)
            mapped = mmap.mmap(handle.fileno(), 0)
        self.maps += (mapped,)
        return np.frombuffer(mapped, dtype=dtype, count=count, offset=offset)

    def release(self) -> None:
        for mapped in self.maps:
            mapped.madvise(mmap.MADV_DONTNEED)  # shared file pages: written through, only unmapped here


def sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per span [offsets[i], offsets[i + 1]) of `values` (none empty), its int64 sum. Spans are summed a few
    million values at a time: np.add.reduceat would first copy all of the values as int64."""
    out = np.zeros(offsets.size - 1, dtype=np.int64)
    first = 0
    while first < out.size:
        last = max(first + 1, int(np.searchsorted(offsets, offsets[first] + BLOCK_ROWS * 16, side="right")) - 1)
        last = min(last, out.size)
        low, high = int(offsets[first]), int(offsets[last])
        if last == first + 1:  # one span, however long: a buffered sum
            out[first] = values[low:high].sum(dtype=np.int64)
        else:
            out[first:last] = np.add.reduceat(values[low:high], offsets[first:last] - low, dtype=np.int64)
        first = last
    return out


def open_layout(folder: Path, cells: pl.DataFrame) -> Calls:
    """The Calls of a layout written to `folder` earlier, memory-mapped; Damaged when a file does not match
    the cell table."""
    offsets = np.concatenate([[0], np.cumsum(cells["calls"].to_numpy())]).astype(np.int64)
    arrays, maps = {}, []
    for name in ARRAYS:
        with open(os.open(folder / f"{name}.npy", os.O_RDONLY | os.O_NOFOLLOW), "rb") as handle:
            try:
                version = np.lib.format.read_magic(handle)
                if version != (1, 0):
                    raise Damaged
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
            except ValueError:
                raise Damaged from None
            offset = handle.tell()
            size = os.fstat(handle.fileno()).st_size
            if fortran or shape != (int(offsets[-1]),) or dtype.kind not in "iu" or dtype.byteorder == ">" \
                    or size != offset + shape[0] * dtype.itemsize:
                raise Damaged
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        maps.append(mapped)
        arrays[name] = np.frombuffer(mapped, dtype=dtype, count=shape[0], offset=offset)
    return Calls(cells=cells, offsets=offsets, maps=tuple(maps), **arrays)
