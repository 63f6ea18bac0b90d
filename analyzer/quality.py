"""Quality beside speed: what a run directory recorded about the error each KV format adds, for a report's two arms.

Two levels, by engine:
- kernel (FlashInfer): per workload point, each format's attention output against a float64 reference over the BF16
  cache (capture/flashinfer_quality.py wrote it): the kernel's output, the format alone (exact attention over the
  dequantized cache), the BF16 output floor and the cache's round trip. Rows stay per context and phase.
- answers (vLLM serve with --quality-prompts): each arm's greedy answers to the same prompts, paired prompt by prompt:
  accuracy with McNemar's exact test (analyzer.stats), the first token where the arms' outputs diverge, and the
  share of tokens generated alike, also against a BF16 (`auto`) arm when a run directory recorded one. With repeats,
  the test pairs the first runs (ARM.r1 with ARM.r1); run k pairs with run k and is compared with run 1, since a
  repeat answers the same prompts again and adds none. With --load-format dummy the answers come from random weights:
  the result says so, carries no accuracy, and shows only how many prompts each run answered.

Reads the manifests and the RUN.quality.json files they name; returns one Quality that every renderer reads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtrace import files
from kvtrace.analyzer.runs import ArmInput, run_file
from kvtrace.analyzer.stats import mcnemar, shares
from kvtrace.errors import KvtraceError

MEASURED = "measured"
NOT_MEASURED = "not measured"
MEANINGLESS = "not a measurement"  # dummy weights: the plumbing ran, the numbers mean nothing
KERNEL, ANSWERS = "kernel", "answers"
METRICS = ("rel_l2", "cosine", "max_abs")
AUTO = "auto"
# A kernel departs from the attention its own dequantized cache defines when its output is farther from that
# attention than DEPARTURE_ROUNDINGS BF16 roundings (unit roundoff 2^-9, relative): an honest BF16 kernel rounds its
# queries, its probabilities and its output, and FlashInfer's FP8 and NVFP4 decode on the H200 sit at 0.9-1.7 of one
# (docs/statistics.md, "Departures").
BF16_ROUNDING = 2.0 ** -9
DEPARTURE_ROUNDINGS = 5


@dataclass
class ErrorRow:
    """One workload point's error against the float64 reference over the BF16 cache, per arm: for `prefill` and
    `decode` the kernel's attention output (and `*_format`: exact attention over the dequantized cache, the format's
    share); for `cache k` / `cache v` the round trip dequantize(quantize(x)) against x."""

    context: int
    what: str  # prefill, decode, cache k, cache v
    baseline: dict | None  # rel_l2, cosine, max_abs
    candidate: dict | None
    baseline_format: dict | None = None
    candidate_format: dict | None = None
    floor: dict | None = None  # the reference rounded to BF16: what any kernel with a BF16 output pays
    # the kernel's output against exact attention over its own dequantized cache (recorded since kernel_vs_format)
    baseline_vs_format: dict | None = None
    candidate_vs_format: dict | None = None


@dataclass
class Departure:
    """A workload point where one arm's kernel strays from the attention its own cache defines (DEPARTURE_ROUNDINGS)."""

    context: int
    what: str  # prefill, decode
    side: str  # baseline, candidate
    kernel: float  # rel_l2 of the kernel's output against the reference
    format: float  # rel_l2 of exact attention over the dequantized cache against the reference
    # rel_l2 of the kernel's output against exact attention over its own dequantized cache: measured (the run recorded
    # kernel_vs_format) or, for runs recorded before, a lower bound from kernel and format (the triangle inequality)
    distance: float
    measured: bool

    @property
    def roundings(self) -> float:
        """The distance in BF16 roundings (BF16_ROUNDING)."""
        return self.distance / BF16_ROUNDING


@dataclass(frozen=True)
class Strays:
    """One arm's kernel of one phase that departs at some contexts, with the span of its distances in roundings."""

    side: str  # baseline, candidate
    what: str  # prefill, decode
    departures: tuple[Departure, ...]
    low_roundings: float
    high_roundings: float


@dataclass
class PromptRow:
    index: int
    id: str
    baseline_correct: bool
    candidate_correct: bool
    first_divergence: int | None  # the first token where the arms' outputs differ; None: identical
    baseline_tokens: int
    candidate_tokens: int

    @property
    def differs(self) -> bool:
        """Whether the arms answered it differently: one got it right alone, or their tokens diverge."""
        return self.baseline_correct != self.candidate_correct or self.first_divergence is not None


@dataclass
class Agreement:
    """An arm's greedy tokens against a reference arm's, prompt by prompt, up to their first divergence."""

    arm: str
    reference: str
    prompts: int
    identical: int  # prompts answered token for token alike
    token_agreement: float | None  # tokens alike before the first divergence / the reference's tokens


@dataclass
class ArmAnswers:
    """What one run's quality step recorded, whatever the weights: the plumbing's evidence, not a quality number."""

    run: str
    prompts: int  # answers recorded (one per prompt of the file)
    empty: int  # answers with no token
    cut: int  # answers stopped at max_tokens (finish_reason "length")
    max_tokens: int | None

    @property
    def nonempty(self) -> int:
        """Answers with at least one token."""
        return self.prompts - self.empty


@dataclass
class Repeat:
    """Repeat k of the pair (baseline's run k with the candidate's run k) against repeat 1: greedy answers of the
    same prompts, so a repeat is a second look at the numerics, not new prompts."""

    baseline_run: str
    candidate_run: str
    baseline_alike: int  # prompts the baseline's run k answered token for token as its run 1
    candidate_alike: int
    prompts: int
    baseline_only: int  # this repeat's paired table: prompts only the baseline got right
    candidate_only: int


@dataclass
class Quality:
    state: str  # MEASURED, NOT_MEASURED, MEANINGLESS
    reason: str | None  # why not measured, or why the numbers mean nothing
    level: str | None  # KERNEL, ANSWERS
    inputs: dict | None = None  # kernel: what the Q/K/V were (gaussian, outliers, a file)
    errors: list[ErrorRow] = field(default_factory=list)
    # kernel: per phase (prefill, decode) and side, the lowest and highest rel_l2 over the contexts (each context's
    # own row is in `errors`: this only bounds them for the one-line summary).
    spans: dict = field(default_factory=dict)
    departures: list[Departure] = field(default_factory=list)  # kernel: points where a kernel strays from its cache
    prompts_file: str | None = None
    prompts: list[PromptRow] = field(default_factory=list)
    accuracy: mcnemar.PairedAccuracy | None = None
    agreement: Agreement | None = None  # candidate against baseline
    auto: list[Agreement] = field(default_factory=list)  # each arm against an `auto` arm, when one was recorded
    answered: list[ArmAnswers] = field(default_factory=list)  # the first repeat's two runs, baseline first
    repeats: list[Repeat] = field(default_factory=list)  # repeats 2, 3, ... paired run k with run k
    notes: list[str] = field(default_factory=list)
    read: list[Path] = field(default_factory=list, repr=False)  # the answer files read (inputs: -o never lands on one)

    @property
    def differing(self) -> list[PromptRow]:
        """The prompts the arms answered differently (PromptRow.differs), in order."""
        return [row for row in self.prompts if row.differs]

    @property
    def cut_answers(self) -> int:
        """Answers of the runs in `answered` that stopped at their token limit."""
        return sum(a.cut for a in self.answered)

    @property
    def answered_prompts(self) -> int:
        """Answers the runs in `answered` recorded together."""
        return sum(a.prompts for a in self.answered)

    @property
    def cut_limit(self) -> int | None:
        """The token limit the cut answers stopped at, where they were cut and every such run recorded the same one."""
        limits = {a.max_tokens for a in self.answered if a.cut}
        return limits.pop() if len(limits) == 1 else None

    @property
    def strays(self) -> list[Strays]:
        """The departures grouped per arm and phase, in first-seen order."""
        groups: dict[tuple[str, str], list[Departure]] = {}
        for departure in self.departures:
            groups.setdefault((departure.side, departure.what), []).append(departure)
        return [Strays(side, what, tuple(found), min(d.roundings for d in found), max(d.roundings for d in found))
                for (side, what), found in groups.items()]

    def to_dict(self) -> dict:
        data = asdict(self)
        del data["read"]  # paths stay out of reports
        floors = {(row.context, row.what): row.floor for row in self.errors}
        for shown, departure in zip(data["departures"], self.departures):
            floor = floors.get((departure.context, departure.what))
            # gap and floor: the field's first form within kvtrace.report/4, kept for readers of it
            shown.update(roundings=departure.roundings, gap=departure.kernel - departure.format,
                         floor=floor["rel_l2"] if floor else None)
        if self.accuracy is not None:
            data["accuracy"].update(baseline_accuracy=self.accuracy.baseline_accuracy,
                                    candidate_accuracy=self.accuracy.candidate_accuracy)
        return data


def _not_measured(reason: str, level: str | None = None) -> Quality:
    return Quality(NOT_MEASURED, reason, level)


# ---- kernel level (FlashInfer) --------------------------------------------------------------------------

def _metrics(value) -> dict | None:
    """A recorded {rel_l2, cosine, max_abs}, each a finite number in its range (distances 0 or more, cosine within
    ±1 or None), else None: a damaged value shows as missing, never as a measured error (-0.25 was reported as one,
    and -1 divided 1 + rel_l2 = 0)."""
    if not isinstance(value, dict):
        return None
    out = {}
    for name in METRICS:
        number = value.get(name)
        low, high = (-1.0, 1.0) if name == "cosine" else (0.0, math.inf)
        if number is None and name == "cosine":
            out[name] = None
        elif isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number) \
                and low <= number <= high:
            out[name] = float(number)
        else:
            return None
    return out


def _by_context(item: ArmInput) -> dict[int, dict]:
    contexts = item.record.workload.get("contexts")
    found = {}
    for entry in contexts if isinstance(contexts, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("context"), int) and isinstance(entry.get("quality"), dict):
            found[entry["context"]] = entry["quality"]
    return found


def _kernel(base: ArmInput, cand: ArmInput) -> Quality:
    b, c = _by_context(base), _by_context(cand)
    if not b or not c:
        return _not_measured("the FlashInfer runs recorded no attention error (captured before kvtrace measured it: "
                             "capture again)", KERNEL)
    rows = []
    for context in sorted(set(b) & set(c)):
        qb, qc = b[context], c[context]
        for what in ("prefill", "decode"):
            rows.append(ErrorRow(context, what, _entry(qb, "kernel", what), _entry(qc, "kernel", what),
                                 _entry(qb, "format", what), _entry(qc, "format", what),
                                 _entry(qb, "output_rounding", what), _entry(qb, "kernel_vs_format", what),
                                 _entry(qc, "kernel_vs_format", what)))
        for tensor in ("k", "v"):
            rows.append(ErrorRow(context, f"cache {tensor}", _entry(qb, "cache", tensor), _entry(qc, "cache", tensor)))
    if not rows:
        return _not_measured("the two FlashInfer runs share no context length with an attention error", KERNEL)
    inputs = [item.record.workload.get("quality_inputs") for item in (base, cand)]
    spans = {}
    for what in ("prefill", "decode"):
        for side in ("baseline", "candidate"):
            values = [getattr(row, side)["rel_l2"] for row in rows if row.what == what and getattr(row, side)]
            spans.setdefault(what, {})[side] = [min(values), max(values)] if values else None
    result = Quality(MEASURED, None, KERNEL, inputs=inputs[0] if isinstance(inputs[0], dict) else None, errors=rows,
                     spans=spans, departures=_departures(rows))
    if inputs[0] != inputs[1]:
        result.notes.append("the arms' Q/K/V came from different inputs: their errors do not compare")
    return result


def _departures(rows: list[ErrorRow]) -> list[Departure]:
    found = []
    for row in rows:
        for side in ("baseline", "candidate"):
            kernel, format_alone = getattr(row, side), getattr(row, f"{side}_format")
            if kernel is None or format_alone is None:
                continue
            direct = getattr(row, f"{side}_vs_format")
            # |K - R| - |F - R| <= |K - F| and |F| <= |R| (1 + format): a bound in units of |F|, as direct's
            distance = (direct["rel_l2"] if direct else
                        (kernel["rel_l2"] - format_alone["rel_l2"]) / (1 + format_alone["rel_l2"]))
            if distance > DEPARTURE_ROUNDINGS * BF16_ROUNDING:
                found.append(Departure(row.context, row.what, side, kernel["rel_l2"], format_alone["rel_l2"],
                                       distance, direct is not None))
    return found


def _entry(quality: dict, group: str, name: str) -> dict | None:
    """quality[group][name] of one context's record (e.g. kernel/prefill, cache/k), checked."""
    found = quality.get(group)
    return _metrics(found.get(name)) if isinstance(found, dict) else None


# ---- answers level (vLLM) -------------------------------------------------------------------------------

def _summary(item: ArmInput, run: str | None = None) -> dict | None:
    """The manifest's quality summary of one run of an arm (its first by default)."""
    entry = ((item.manifest.raw.get("arms") or {}).get(run or item.runs[0]) or {})
    value = entry.get("quality") if isinstance(entry, dict) else None
    return value if isinstance(value, dict) else None


def _results(run: Path, summary: dict, label: str, read: list[Path]) -> list[dict]:
    """A run's per-prompt answers (RUN.quality.json inside its run directory), checked field by field and against
    the manifest's summary of them: a file that answers another prompt file is not this run's."""
    name = summary.get("file")
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".quality.json"):
        raise KvtraceError(f"{label}: the manifest names no quality file inside its run directory ({name!r}): "
                           "capture again with --quality-prompts")
    fix = "capture again with --quality-prompts"
    path = run_file(run, name, label, "answers")
    read.append(path)
    data = files.read_json(path, f"{label}'s answers {name}", fix)
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list):
        raise KvtraceError(f"{label}'s answers {name} hold no results list: {fix}")
    count = summary.get("prompts")
    if data.get("prompts_sha256") != summary.get("prompts_sha256") or count not in (None, len(results)):
        raise KvtraceError(f"{label}'s answers {name} are not the ones its manifest records (another prompt file's "
                           f"SHA-256 or another count than {count!r}): put the run's own file back or {fix}")
    for index, result in enumerate(results):
        if not (isinstance(result, dict) and isinstance(result.get("correct"), bool)
                and isinstance(result.get("tokens"), list) and all(isinstance(t, str) for t in result["tokens"])):
            raise KvtraceError(f"{label}'s answers {name}: result {index} needs a boolean `correct` and a list of "
                               f"token strings: {fix}")
        logprobs = result.get("token_logprobs")
        if logprobs is not None and not (isinstance(logprobs, list) and len(logprobs) == len(result["tokens"])):
            raise KvtraceError(f"{label}'s answers {name}: result {index} has {len(result['tokens'])} tokens but "
                               f"{len(logprobs) if isinstance(logprobs, list) else 'no list of'} logprobs: {fix}")
    return results


def _unpaired(results: list[list[dict]], labels: tuple[str, str]) -> str | None:
    """Why two runs' answers do not pair prompt by prompt, or None: the same prompts, in the same order."""
    if len(results[0]) != len(results[1]):
        return f"{labels[0]} and {labels[1]} answered {len(results[0])} and {len(results[1])} prompts: not comparable"
    for index, (b, c) in enumerate(zip(*results)):
        ids = [str(r.get("id", index + 1)) for r in (b, c)]
        if ids[0] != ids[1]:
            return (f"{labels[0]} and {labels[1]} answered different prompts (prompt {index + 1} is {ids[0]!r} and "
                    f"{ids[1]!r}): not comparable")
    return None


def _answered(run: str, summary: dict, results: list[dict]) -> ArmAnswers:
    limit = summary.get("max_tokens")
    return ArmAnswers(run, len(results), sum(not r["tokens"] for r in results),
                      sum(r.get("finish_reason") == "length" for r in results),
                      limit if isinstance(limit, int) and not isinstance(limit, bool) else None)


def first_divergence(first: list[str], second: list[str]) -> int | None:
    """The first token index where two greedy outputs differ (one ending early counts); None when identical."""
    for index, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return index
    return None if len(first) == len(second) else min(len(first), len(second))


def agreement(arm: str, reference: str, arm_results: list[dict], reference_results: list[dict]) -> Agreement:
    pairs = list(zip(arm_results, reference_results))
    return _agreement(arm, reference, [first_divergence(mine["tokens"], theirs["tokens"]) for mine, theirs in pairs],
                      [len(theirs["tokens"]) for _, theirs in pairs])


def _agreement(arm: str, reference: str, splits: list[int | None], lengths: list[int]) -> Agreement:
    """From each prompt's first divergence and the reference's token count."""
    alike = sum(length if split is None else split for split, length in zip(splits, lengths))
    return Agreement(arm, reference, len(splits), sum(split is None for split in splits),
                     shares.share(alike, sum(lengths)))


def _auto_arms(base: ArmInput, cand: ArmInput) -> list[tuple[str, ArmInput]]:
    """`auto` arms recorded beside either side (not either side itself), once per run directory."""
    found, seen = [], set()
    for item in (base, cand):
        if item.run in seen or AUTO not in item.manifest.runs_by_arm or item.arm == AUTO:
            continue
        seen.add(item.run)
        found.append((f"{item.run.name}/{AUTO}", ArmInput.of(item.run, item.manifest, AUTO)))
    if AUTO in (base.arm, cand.arm):
        return []  # the pair's own agreement is already against BF16
    return found


def _answers(base: ArmInput, cand: ArmInput, labels: tuple[str, str]) -> Quality:
    summaries = [_summary(base), _summary(cand)]
    missing = [label for label, s in zip(labels, summaries) if s is None]
    if missing:
        return _not_measured(f"{' and '.join(missing)} ran without --quality-prompts (`kvtrace capture vllm "
                             "--quality-prompts FILE.jsonl` records the model's answers)", ANSWERS)
    failed = [f"{label}: {s['error']}" for label, s in zip(labels, summaries) if isinstance(s.get("error"), str)]
    if failed:
        return _not_measured("; ".join(failed), ANSWERS)
    if summaries[0].get("prompts_sha256") != summaries[1].get("prompts_sha256"):
        return _not_measured("the arms answered different prompt files (their SHA-256 differ): not comparable", ANSWERS)
    prompts_file = summaries[0].get("prompts_file") if isinstance(summaries[0].get("prompts_file"), str) else None
    # Read whatever the weights: the files are the evidence that the step ran, and must pair before anything shows.
    read: list[Path] = []
    results = [_results(item.run, s, label, read) for item, s, label in zip((base, cand), summaries, labels)]
    unpaired = _unpaired(results, labels)
    if unpaired:
        return _not_measured(unpaired, ANSWERS)
    answered = [_answered(item.runs[0], s, r) for item, s, r in zip((base, cand), summaries, results)]
    repeats, notes = _repeats(base, cand, results, read)
    notes += [f"{a.run}: {a.empty} of {a.prompts} answers are empty" for a in answered if a.empty]
    dummy = [item.run.name for item in (base, cand) if item.manifest.settings.get("load_format") == "dummy"]
    if dummy:
        return Quality(MEANINGLESS, f"the model ran with --load-format dummy (random weights) in "
                       f"{', '.join(dict.fromkeys(dummy))}: its answers say nothing about quality", ANSWERS,
                       prompts_file=prompts_file, answered=answered, repeats=repeats, notes=notes, read=read)
    notes += [f"{a.run}: {a.cut} of {a.prompts} answers stopped at the {a.max_tokens}-token limit (finish_reason "
              "length): a cut answer can miss its number (raise --quality-max-tokens)" for a in answered if a.cut]
    rows = [PromptRow(index, str(b.get("id", index + 1)), b["correct"], c["correct"],
                      first_divergence(b["tokens"], c["tokens"]), len(b["tokens"]), len(c["tokens"]))
            for index, (b, c) in enumerate(zip(*results))]
    result = Quality(MEASURED, None, ANSWERS, prompts_file=prompts_file, prompts=rows,
                     accuracy=mcnemar.paired_accuracy([r.baseline_correct for r in rows],
                                                      [r.candidate_correct for r in rows]),
                     agreement=_agreement(labels[1], labels[0], [r.first_divergence for r in rows],
                                          [r.baseline_tokens for r in rows]), answered=answered,
                     repeats=repeats, notes=notes, read=read)
    for name, auto in _auto_arms(base, cand):
        summary = _summary(auto)
        if summary is None or summary.get("prompts_sha256") != summaries[0].get("prompts_sha256"):
            result.notes.append(f"{name} recorded no answers to the same prompts: no agreement with BF16")
            continue
        reference = _results(auto.run, summary, name, read)
        if _unpaired([results[0], reference], (labels[0], name)):
            result.notes.append(f"{name} answered other prompts: no agreement with BF16")
            continue
        result.auto += [agreement(label, name, mine, reference) for label, mine in zip(labels, results)]
    return result


def _repeats(base: ArmInput, cand: ArmInput, first: list[list[dict]], read: list[Path]) -> tuple[list[Repeat],
                                                                                                   list[str]]:
    """Repeats 2, 3, ... of an arm pair: run k of the baseline with run k of the candidate, each against its own
    run 1. The paired test stays repeat 1's: a repeat answers the same prompts again, it adds no prompt."""
    repeats, notes = [], []
    if len(base.runs) != len(cand.runs):
        notes.append(f"the arms have {len(base.runs)} and {len(cand.runs)} runs: repeats past "
                     f"{min(len(base.runs), len(cand.runs))} have no partner")
    for b_run, c_run in list(zip(base.runs, cand.runs))[1:]:
        summaries = [_summary(base, b_run), _summary(cand, c_run)]
        usable = all(s is not None and not isinstance(s.get("error"), str) for s in summaries)
        if not usable or summaries[0].get("prompts_sha256") != summaries[1].get("prompts_sha256"):
            notes.append(f"{b_run} and {c_run} recorded no answers to the same prompts: repeat not compared")
            continue
        results = [_results(item.run, s, run, read) for item, s, run in zip((base, cand), summaries, (b_run, c_run))]
        if (_unpaired(results, (b_run, c_run)) or _unpaired([results[0], first[0]], (b_run, base.runs[0]))
                or _unpaired([results[1], first[1]], (c_run, cand.runs[0]))):
            notes.append(f"{b_run} and {c_run} answered other prompts than repeat 1: repeat not compared")
            continue
        alike = [agreement(run, f"{run} r1", results[k], first[k]).identical for k, run in enumerate((b_run, c_run))]
        paired = mcnemar.paired_accuracy([b["correct"] for b in results[0]], [c["correct"] for c in results[1]])
        repeats.append(Repeat(b_run, c_run, alike[0], alike[1], len(results[0]), paired.baseline_only,
                              paired.candidate_only))
    return repeats, notes


def build(base: ArmInput, cand: ArmInput, labels: tuple[str, str]) -> Quality:
    engine = base.manifest.engine
    if engine == "flashinfer" and cand.manifest.engine == "flashinfer":
        return _kernel(base, cand)
    if engine == "vllm" and cand.manifest.engine == "vllm":
        if base.manifest.mode != "serve" or cand.manifest.mode != "serve":
            return _not_measured("offline vLLM runs send no quality prompts (capture with --mode serve "
                                 "--quality-prompts FILE.jsonl)", ANSWERS)
        return _answers(base, cand, labels)
    return _not_measured("the two runs come from different engines or one kvtrace does not measure quality for")
