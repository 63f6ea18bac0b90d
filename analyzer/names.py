"""Range names as pairing keys: the part of an NVTX range's name that says where in the program a call ran.

Many annotations number every instance of a range, so no call of one run would ever meet its twin in the
other: PyTorch's operator ranges (`nsys profile --pytorch=autograd-nvtx`, `torch.autograd.profiler.emit_nvtx`)
carry `op_id = N`, `seq = N` and `input_op_ids = [...]` (the op ids of the inputs), and training or benchmark
loops name their iterations `step 17`, `iteration 3` or `ProfilerStep#5`. The key replaces those counters by
INSTANCE and keeps everything else, which is what tells work apart: PyTorch's tensor shapes (`sizes = [...]`),
vLLM's token counts (`execute_context_8(16384)_generation_0(0)`), kvtrace's `ctx=2048`.
"""

from __future__ import annotations

from dataclasses import dataclass

import regex

from kvtrace.analyzer.classify import MATCH_TIMEOUT_S
from kvtrace.errors import KvtraceError

INSTANCE = "*"
# Each pattern's first group is the counter. PyTorch writes `name, seq = 3, op_id = 7, sizes = [...],
# input_op_ids = [...]` (getNvtxStr in torch/csrc/profiler/util.cpp, read as recorded in fixtures/torch-h200).
COUNTERS = (
    r"\bop_id = (\d+)",
    r"\bseq = (\d+)",
    r"\binput_op_ids = (\[[^\]]*\])",
    r"ProfilerStep#(\d+)",
    r"(?i)\b(?:step|iteration|iter|epoch)[ _#]?(\d+)\b",
)
# What every COUNTERS match holds: a name without any of these has none, and one search of it replaces five (a
# million distinct names, each keyed, took 20 s).
_COUNTER_WORDS = regex.compile(r"op_id = |seq = |input_op_ids = |ProfilerStep#|(?i:step|iter|epoch)")


@dataclass(frozen=True)
class NameKey:
    """How a range name becomes its pairing key: the default counters (COUNTERS) and the user's `ignore`
    patterns are replaced by INSTANCE, except where they fall inside a match of a `keep` pattern."""

    ignore: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()

    def __post_init__(self):
        for option, patterns in (("--nvtx-ignore", self.ignore), ("--nvtx-keep", self.keep)):
            for pattern in patterns:
                try:
                    regex.compile(pattern)
                except regex.error as error:
                    raise KvtraceError(f"{option} {pattern!r} is not a valid regex ({error})") from None

    def describe(self) -> list[str]:
        parts = [f"NVTX name parts matching /{p}/ ignored in pairing" for p in self.ignore]
        return parts + [f"NVTX name parts matching /{p}/ kept in pairing" for p in self.keep]

    def of(self, names: tuple[str, ...] | list[str]) -> list[str]:
        """Each name's key, in time linear in the names (each is read once; most by one search)."""
        # The user's patterns run on the `regex` engine with the recipes' time limit per match, as --window does:
        # a nested quantifier such as (a+)+$ would otherwise backtrack without end on a long name.
        counters = [regex.compile(p) for p in (*COUNTERS, *self.ignore)]
        keeps = [regex.compile(p) for p in self.keep]
        own = bool(self.ignore or self.keep)
        try:
            return [_key(name, counters, keeps) if own or _COUNTER_WORDS.search(name) else name for name in names]
        except TimeoutError:
            raise KvtraceError(f"an --nvtx-ignore or --nvtx-keep pattern took over {MATCH_TIMEOUT_S:g} s on one NVTX "
                               "name (nested quantifiers such as (a+)+ backtrack without end): simplify the "
                               "pattern") from None


def _key(name: str, counters: list[regex.Pattern], keeps: list[regex.Pattern]) -> str:
    kept = [match.span() for pattern in keeps for match in pattern.finditer(name, timeout=MATCH_TIMEOUT_S)]
    spans = set()
    for pattern in counters:
        for match in pattern.finditer(name, timeout=MATCH_TIMEOUT_S):
            span = match.span(1) if pattern.groups else match.span()
            if span[0] < span[1] and not any(low <= span[0] and span[1] <= high for low, high in kept):
                spans.add(span)
    out, at = [], 0
    for low, high in sorted(spans):
        if low >= at:  # overlapping counters count once
            out += [name[at:low], INSTANCE]
            at = high
    return "".join(out) + name[at:]
