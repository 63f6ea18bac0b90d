"""The answer first: the rows of a Diff that decide FP8 against NVFP4, one per workload point.

Nothing here is computed: each row is a Diff row (its per-call times, ratio, interval, verdict and pairs),
picked and named for the head of every rendering (docs/statistics.md explains the rows themselves).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvtrace import __version__
from kvtrace.analyzer import reproduce
from kvtrace.analyzer.results import Diff, DiffRow
from kvtrace.analyzer.pairing import PHASE_SEGMENTS
from kvtrace.errors import KvtraceError
from kvtrace.manifest import MANIFEST, Manifest, parse_phase_name, read_manifest

# The questions, in the order the head asks them, with the segment whose rows answer each.
PREFILL = "prefill attention"
DECODE = "decode attention"
APPEND_KERNEL = "KV append kernel"
APPEND_PHASE = "KV append phase"
CONTROL = "control (KV-independent)"
_SEGMENT_QUESTIONS = ((PREFILL, PHASE_SEGMENTS["prefill"]), (DECODE, PHASE_SEGMENTS["decode"]),
                      (APPEND_KERNEL, PHASE_SEGMENTS["append"]))
EVERY_KERNEL = "every kernel of the phase"


@dataclass(frozen=True)
class HeadRow:
    question: str
    point: str  # the workload point: a context (ctx=2048), a vLLM step kind, "all calls"; a control's segment
    family: str  # short family name(s) of the row's kernels
    row: DiffRow
    # Each arm's time per paired call; None where no call paired. Over cells of different cost per call (`mixed`)
    # it is their mean, as nsys stats' Avg is, not one call's time.
    baseline_ns: float | None = None
    candidate_ns: float | None = None
    mixed: bool = False

    @classmethod
    def of(cls, question: str, point: str, family: str, row: DiffRow) -> HeadRow:
        if row.ratio is None:
            return cls(question, point, family, row)
        means = [arm.mean_ns if arm.mean_ns is not None else arm.total_ns / arm.calls
                 for arm in (row.baseline, row.candidate)]
        return cls(question, point, family, row, means[0], means[1], not row.same_work)


@dataclass(frozen=True)
class Headline:
    baseline: str
    candidate: str
    confidence: float
    rows: list[HeadRow]
    drift: str | None  # the drift finding's words (what the controls measured, or that none was paired)
    # (name, value) of the GPU, driver, CUDA, Nsight Systems, kvtrace and, from a run directory's manifest,
    # the engine's packages and flags; no hostnames, UUIDs, user names or absolute paths.
    environment: list[tuple[str, str]] = field(default_factory=list)
    # To reproduce: `kvtrace capture` as the manifest's settings give it, the engine's commands as it ran them,
    # then this diff or report (analyzer.reproduce).
    commands: list[str] = field(default_factory=list)
    model_config: str | None = None  # the model's shape as the capture read it (JSON)
    # analyzer.statements.QueryQuantizeStatement: the query quantization that counts in one arm's prefill (a
    # quantize row the diff's tables call "only in" that arm), as the report states it.
    query_quantize: list = field(default_factory=list)

    @classmethod
    def of(cls, diff: Diff, manifest: Manifest | None = None, command: list[str] | None = None,
           query_quantize: list | None = None) -> Headline:
        """The head of `diff`; `manifest` is the run directory's beside the traces, `command` the diff's
        arguments as run (paths relative to the run directory), `query_quantize` the statements of
        statements.query_quantize_statements."""
        drift = next((f.message for f in diff.findings if f.check == "drift"), None)
        commands = []
        if manifest is not None:
            commands += [c for c in (reproduce.capture_command(manifest),) if c]
            commands += reproduce.engine_commands(manifest)
        head = cls(diff.baseline.label, diff.candidate.label, diff.confidence, head_rows(diff), drift,
                   _environment(diff, manifest), commands, reproduce.model_config(manifest) if manifest else None,
                   list(query_quantize or ()))
        return head.with_command(command) if command else head

    def with_command(self, command: list[str]) -> Headline:
        """The head with the command as run (kvtrace's arguments) after the capture commands."""
        return replace(self, commands=[*self.commands, shlex.join(["kvtrace", *command])])


def head_rows(diff: Diff) -> list[HeadRow]:
    """The questions in the head's order, each answered per workload point (a segment's phase rows, else its
    row over all calls) and per kernel where every kernel of the point paired with itself (decode attention
    apart from its split-KV merge kernel), then the KV-independent control; a report's kernel statements read
    these too."""
    rows = []
    for question, segment in _SEGMENT_QUESTIONS:
        chosen = [r for r in diff.phases if r.segment == segment] or \
                 [r for r in diff.segments if r.segment == segment]
        for r in chosen:
            kernels = [k for k in (diff.family_phases if r.phase is not None else diff.families)
                       if k.segment == segment and k.phase == r.phase]
            # Kernel by kernel where the point's kernels each paired; the kernel rows pool a trace's ranks, so
            # where its ranks disagree the segment's row stands, once per rank.
            if len(kernels) > 1 and all(k.ratio is not None for k in kernels) and r.ranks_agree is not False:
                rows += [_agreeing(diff, r, HeadRow.of(question, _point(r.phase), k.family_label, k))
                         for k in kernels]
            else:
                rows += _by_rank(diff, HeadRow.of(question, _point(r.phase), _families(diff, r), r))
    rows += [HeadRow.of(APPEND_PHASE, _point(r.phase), EVERY_KERNEL, r) for r in diff.phase_totals
             if (parse_phase_name(r.phase) or ("",))[0] == "append"]
    rows += [head for r in diff.segments if r.kv_independent and r.ratio is not None
             for head in _by_rank(diff, HeadRow.of(CONTROL, r.segment, r.segment, r))]
    return rows


def shared_points(rows: list[HeadRow]) -> set[tuple[str, str]]:
    """The (question, point) pairs that several of the head's rows answer: kernel by kernel, or once per rank."""
    seen: dict[tuple[str, str], int] = {}
    for r in rows:
        seen[(r.question, r.point)] = seen.get((r.question, r.point), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _ranks_of(diff: Diff, row: DiffRow) -> list[DiffRow]:
    return [r for r in diff.rank_rows if (r.segment, r.phase) == (row.segment, row.phase)]


def _agreeing(diff: Diff, row: DiffRow, head: HeadRow) -> HeadRow:
    """`head`, its point saying so where `row` (its segment's) is of several ranks that agree."""
    return replace(head, point=f"{head.point} · {len(_ranks_of(diff, row))} ranks agree") if row.ranks_agree else head


def _by_rank(diff: Diff, head: HeadRow) -> list[HeadRow]:
    """A row of traces of several GPUs: itself where its ranks agree (said in its point), else one row per rank."""
    if head.row.ranks_agree is None:
        return [head]
    ranks = _ranks_of(diff, head.row)
    if head.row.ranks_agree:
        return [_agreeing(diff, head.row, head)]
    return [HeadRow.of(head.question, f"{head.point} · rank {r.rank}", head.family, r) for r in ranks]


def _environment(diff: Diff, manifest: Manifest | None) -> list[tuple[str, str]]:
    info = diff.baseline.info
    gpus = []
    for g in info.gpus:
        extras = [f"SM {g.compute_capability}" if g.compute_capability else None,
                  f"{g.sm_count} SMs" if g.sm_count else None,
                  f"{g.memory_bytes / 2**30:.0f} GiB" if g.memory_bytes else None]
        gpus.append(g.name + "".join(f", {e}" for e in extras if e))
    versions = {info.product_version for info in (diff.baseline.info, diff.candidate.info)}
    found = [("GPU", "; ".join(dict.fromkeys(gpus)) or "not recorded"),
             ("driver", info.driver_version or "not recorded"),
             ("Nsight Systems", ", ".join(sorted(v or "?" for v in versions))),
             ("kvtrace", __version__)]
    if manifest is None:
        return found + [("CUDA, engine", "not recorded (no kvtrace manifest beside the traces)")]
    raw = manifest.raw.get("environment") if isinstance(manifest.raw.get("environment"), dict) else {}
    packages = manifest.packages
    cuda = packages.pop("cuda_runtime", None) or raw.get("cuda_runtime")
    found.insert(2, ("CUDA runtime", str(cuda or "not recorded")))
    found.append(("engine", (manifest.engine or "unknown") + "".join(
        f", {name} {version}" for name, version in sorted(packages.items()) if isinstance(version, str))))
    # Settings every run shares (an arm's own KV format and capacity are in its rows and traces).
    engines = [r.workload.get("engine") or r.workload.get("settings") or {} for r in manifest.runs.values()]
    flags = ", ".join(f"{k}={v}" for k, v in engines[0].items() if isinstance(v, (str, int, float, bool))
                      and not (isinstance(v, str) and v.startswith("/")) and all(e.get(k) == v for e in engines))
    flags = flags or reproduce.serve_settings(manifest)
    if flags:
        found.append(("engine settings", flags))
    pool = reproduce.pool_row(manifest)
    return found + ([pool] if pool else [])


def find_manifest(trace: Path) -> Manifest | None:
    """The kvtrace manifest of the run directory a trace sits in, if any (a broken one is not an error here:
    the diff stands without it)."""
    try:
        return read_manifest(trace.parent) if (trace.parent / MANIFEST).is_file() else None
    except KvtraceError:
        return None


def _point(phase: str | None) -> str:
    if phase is None:
        return "all calls"
    parsed = parse_phase_name(phase)
    if parsed:
        return f"ctx={parsed[1]}"
    return phase.removeprefix("vLLM ")


def _families(diff: Diff, row: DiffRow) -> str:
    """The family labels of a segment or phase row's kernels, baseline's first; '→' where the arms differ."""
    def labels(names: tuple[str, ...], side: str) -> list[str]:
        return sorted({f.family_label for f in diff.families if f.segment == row.segment
                       and set(getattr(f, f"{side}_names")) & set(names)})

    base, cand = labels(row.baseline_names, "baseline"), labels(row.candidate_names, "candidate")
    text = " + ".join(base or cand)
    return text if not base or not cand or base == cand else f"{text} → {' + '.join(cand)}"
