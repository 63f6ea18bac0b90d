"""Markdown, terminal and CSV for the capacity calculation (analyzer.capacity.Capacity; JSON is json_out's): the
tables only pick and format its fields."""

from __future__ import annotations

import io
from dataclasses import asdict, fields

from rich.console import Console

from kvtrace.analyzer.capacity import Capacity
from kvtrace.analyzer.render.escape import csv_writer, md_prose, md_text, rich, visible
from kvtrace.analyzer.render.report_tables import _bytes, _count, _exact_bytes, _rich_table
from kvtrace.analyzer.render.units import markdown_table, percent, shown_path

def _capacity_tables(cap: Capacity) -> list[tuple[str, list[str], list[list[str]]]]:
    per_gpu = "per GPU" if cap.tp > 1 else ""
    header = ["format", "stored as", f"bytes/token{' ' + per_gpu if per_gpu else ''}", "ratio", "capacity"]
    if cap.tokens_per_sequence is not None:
        header += [f"{_count(cap.formats[0].tokens)} tokens"]
    if cap.memory_gib is not None:
        header += [f"tokens in {cap.memory_gib:g} GiB"]
    rows = []
    for f in cap.formats:
        row = [f.label, f.format, _exact_bytes(f.bytes_per_token), f"{f.ratio:.4g}", f"{f.capacity_multiplier:.2f}×"]
        if cap.tokens_per_sequence is not None:
            row.append(f"{f.gib_for_tokens:,.4g} GiB ({f.bytes_for_tokens:,} B)")
        if cap.memory_gib is not None:
            row.append(_count(f.tokens_in_memory))
        rows.append(row)
    tables = [("Bytes per token", header, rows)]
    if cap.groups:
        group_header = ["format", "layer group", "layers", f"bytes/token{' ' + per_gpu if per_gpu else ''}"]
        if cap.tokens_per_sequence is not None:
            group_header += ["pages per sequence", f"{_count(cap.formats[0].tokens)} tokens"]
        group_rows = []
        for g in cap.groups:
            row = [g.label, f"sliding window {g.window:,}" if g.window else g.kind, str(g.layers),
                   _exact_bytes(g.bytes_per_token)]
            if cap.tokens_per_sequence is not None:
                row += [_count(g.pages_per_sequence), f"{_bytes(g.bytes_for_tokens)} ({g.bytes_for_tokens:,} B)"]
            group_rows.append(row)
        tables.append(("Per layer group", group_header, group_rows))
    if cap.measured:
        measured = [[m.arm, m.kv_cache_dtype, _count(m.tokens),
                     "–" if m.available_gib is None else f"{m.available_gib:g} GiB",
                     _count(m.ideal_tokens), percent(m.measured_over_ideal),
                     "–" if m.multiplier is None else f"{m.multiplier:.3f}×",
                     "–" if m.ideal_multiplier is None else f"{m.ideal_multiplier:.3f}×"] for m in cap.measured]
        tables.append(("Measured by vLLM (\"GPU KV cache size\") against the ideal",
                       ["arm", "KV dtype", "tokens", "available KV memory", "ideal tokens", "measured / ideal",
                        "tokens vs first arm", "ideal vs first arm"], measured))
    return tables


def _capacity_lead(cap: Capacity) -> str:
    m = cap.model
    parts = [m.describe()]
    if m.source:
        parts.append(f"from {m.source}")
    if m.groups[0].kind == "mla":
        parts.append(f"TP {cap.tp} (the whole latent on every GPU)")
    else:
        parts.append(f"TP {cap.tp} ({cap.kv_heads_per_rank} KV head{'s' if cap.kv_heads_per_rank != 1 else ''} per GPU"
                     + (f", each replicated on {cap.replicas} GPUs" if cap.replicas > 1 else "") + ")")
    parts.append(f"pages of {cap.page_size} tokens")
    if cap.tokens_per_sequence is not None:
        parts.append(f"{_count(cap.tokens_per_sequence)} tokens × {cap.sequences} sequence"
                     + ("s" if cap.sequences != 1 else ""))
    if m.groups[0].kind == "mla":
        math = "Bytes per token count one latent of D values per layer: FP8 = L·D, BF16 = 2·L·D."
    else:
        math = ("Bytes per token count K and V of every " + ("attention " if m.kv_layers != m.layers else "")
                + "layer" + (" (windowed ones until their window is full)" if len(m.groups) > 1 else "")
                + ": FP8 = 2·L·H·D, NVFP4 = 2·L·H·(D/2 + D/16), BF16 = 2·L·H·2D.")
    lead = "Model: " + ", ".join(parts) + ". " + math
    if cap.ideal_ratio is not None:
        lead += (f" {cap.formats[-1].label} / {cap.formats[0].label}: ratio {cap.ideal_ratio:.4g}, capacity "
                 f"{cap.ideal_multiplier:.2f}×.")
    return lead


def capacity_markdown(cap: Capacity, level: str = "##") -> str:
    lines = [f"{level} kvtrace capacity" + (f": {md_text(shown_path(cap.run))}" if cap.run else ""), "",
             md_prose(_capacity_lead(cap)), ""]
    for title, header, rows in _capacity_tables(cap):
        # Labels and the model's source name sit among the numbers: every cell as plain text.
        lines += [f"{level}# {title}", ""] + markdown_table([md_text(h) for h in header],
                                                            [[md_text(c) for c in row] for row in rows]) + [""]
    lines += [f"- {md_prose(note)}" for note in cap.notes]
    return "\n".join(lines).rstrip() + "\n"


def capacity_terminal(cap: Capacity, console: Console) -> None:
    console.print(rich(_capacity_lead(cap)), highlight=False)
    for title, header, rows in _capacity_tables(cap):
        console.print(_rich_table(title, header, rows))
    for note in cap.notes:
        console.print(f"  {visible(note)}", markup=False, highlight=False)


def capacity_csv(cap: Capacity) -> str:
    buffer = io.StringIO()
    writer = csv_writer(buffer)
    columns = [f.name for f in fields(cap.formats[0])] if cap.formats else ["label"]
    writer.writerow(["section", *columns])
    for row in cap.formats:
        writer.writerow(["format", *("" if v is None else v for v in asdict(row).values())])
    if cap.groups:
        writer.writerow(["section", *(f.name for f in fields(cap.groups[0]))])
        for row in cap.groups:
            writer.writerow(["group", *("" if v is None else v for v in asdict(row).values())])
    if cap.measured:
        measured = [f.name for f in fields(cap.measured[0])]
        writer.writerow(["section", *measured])
        for row in cap.measured:
            writer.writerow(["measured", *("" if v is None else v for v in asdict(row).values())])
    return buffer.getvalue()
