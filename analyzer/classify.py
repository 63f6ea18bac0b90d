"""Kernel classification: ordered TOML recipes map demangled kernel names to segments, and a family key
abstracts the KV-cache dtype so that the FP8 and the NVFP4 build of one kernel line up across arms.

Work happens per distinct kernel signature (hundreds even in 10M-kernel traces), never per launch.
The recipe format is documented in docs/recipes.md.
"""

from __future__ import annotations

import importlib.resources
import operator
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import polars as pl
import regex

from kvtrace import files
from kvtrace.analyzer.kernel_names import KernelName, SlotRef, display_span, parse_kernel_name
from kvtrace.errors import KvtraceError
from kvtrace.kv_formats import STORAGE_LABELS, kernel_dtype_label

SEGMENTS = (
    "prefill_attention",
    "decode_attention",
    "kv_append",
    "gemm",
    "moe",
    "quantize",
    "norm",
    "activation",
    "communication",
    "memory",
    "other",
)

# Segments that are never drift controls, whatever a recipe says: a collective (NCCL, custom all-reduce) on one
# rank waits for the slowest rank, so its duration carries every other rank's work and skew.
NEVER_CONTROLS = frozenset({"communication"})

# Segments whose kernels read or write the KV cache: only these (and unmatched names) get the
# FP8/FP4 token fallback, so an FP8 GEMM is not reported as running an "fp8" KV cache.
KV_SEGMENTS = frozenset({"prefill_attention", "decode_attention", "kv_append"})

DIMS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z")
INPUT_COLUMNS = ("name_id", "demangled", "short", *DIMS)
KV_PLACEHOLDER = "{kv}"

# ---------------------------------------------------------------------------------------------------
# KV dtype labels
# ---------------------------------------------------------------------------------------------------

# Unambiguous KV-capable tokens, abstracted when a rule names no slot (see KV_SEGMENTS).
_FALLBACK_TOKENS = re.compile(
    r"(?<![\w:])(?:__nv_fp8_e4m3|__nv_fp8_e5m2|__nv_fp4x2_e2m1|__nv_fp4_e2m1"
    r"|cutlass::float_e4m3_t|cutlass::float_e5m2_t|cutlass::float_e2m1_t)(?!\w)"
)


# ---------------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------------

_COMPARISON = re.compile(r"\s*(?P<op><=|>=|==|!=|<|>)?\s*(?P<value>\d+)\s*")
_OPERATORS: dict[str, Callable[[int, int], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}


@dataclass(frozen=True)
class DimCondition:
    dim: str
    op: str
    value: int

    def holds(self, row: dict) -> bool:
        actual = row.get(self.dim)
        return actual is not None and _OPERATORS[self.op](actual, self.value)


@dataclass(frozen=True)
class Rule:
    file: str  # file name, for the recipe column
    id: str
    segment: str
    pattern: regex.Pattern
    template: tuple[tuple[SlotRef, tuple[str, ...]], ...]
    dims: tuple[DimCondition, ...]
    kv_slots: tuple[SlotRef, ...]
    kv_enum: dict[str, tuple[str, ...]]
    kv_dtype: str | None
    kv_independent: bool  # the KV-cache format cannot change these kernels' work (drift controls)
    note: str
    source: str

    @property
    def recipe(self) -> str:
        return f"{self.file}:{self.id}"

    def match_name(self, kernel: KernelName) -> regex.Match | None:
        """The regex match when the name and template conditions hold (grid/block are per row)."""
        try:
            found = self.pattern.search(kernel.text, timeout=MATCH_TIMEOUT_S)
        except TimeoutError:
            raise KvtraceError(f"recipe {self.recipe}: `match` took over {MATCH_TIMEOUT_S:g} s on a kernel name of "
                               f"{len(kernel.text):,} characters (nested quantifiers such as (a+)+ backtrack "
                               "without end): simplify the pattern") from None
        if found is None:
            return None
        for ref, wanted in self.template:
            if not any(value in wanted for _, value in ref.find(kernel)):
                return None
        return found


# Recipe patterns are matched by the `regex` package: `re`'s syntax and backtracking engine, plus a time limit
# per match, because a pattern such as (a+)+$ can backtrack without end and a user's --recipe is not vetted.
MATCH_TIMEOUT_S = 1.0
_FILE_KEYS = ("order", "description", "rule")
_RULE_KEYS = ("id", "segment", "match", "template", *DIMS, "kv_slots", "kv_enum", "kv_dtype", "kv_independent",
              "note", "source")


@dataclass(frozen=True)
class _RecipeFile:
    name: str
    location: str
    order: int
    rules: tuple[Rule, ...]


def _parse_recipe_file(name: str, location: str, data: bytes, *, order_required: bool) -> _RecipeFile:
    def fail(problem: str, fix: str) -> KvtraceError:
        return KvtraceError(f"recipe {location}: {problem}; {fix}")

    try:
        document = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise fail("not UTF-8 text", "save the recipe as UTF-8") from None
    except tomllib.TOMLDecodeError as err:
        raise fail(f"not valid TOML ({err})", "fix the syntax (format: docs/recipes.md)") from None
    except RecursionError:
        raise fail("not valid TOML (nested too deeply)", "fix the syntax (format: docs/recipes.md)") from None
    unknown = sorted(set(document) - set(_FILE_KEYS))
    if unknown:
        raise fail(f"unknown top-level key {unknown[0]!r}", f"allowed keys are {', '.join(_FILE_KEYS)}")
    order = document.get("order", 0)
    if ("order" not in document and order_required) or type(order) is not int:
        raise fail("needs a top-level integer `order`", "add e.g. `order = 500` (lower orders match first)")
    tables = document.get("rule")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise fail("has no [[rule]] tables", "write each rule as a [[rule]] table (format: docs/recipes.md)")
    rules: list[Rule] = []
    for position, table in enumerate(tables, start=1):
        rule = _parse_rule(name, location, position, table)
        if any(r.id == rule.id for r in rules):
            raise fail(f"rule {rule.id!r} (#{position}): duplicate id", "give every rule of a file its own id")
        rules.append(rule)
    return _RecipeFile(name, location, order, tuple(rules))


_Fail = Callable[[str, str], KvtraceError]


def _parse_rule(file_name: str, location: str, position: int, table: dict) -> Rule:
    rule_id = table.get("id")
    label = f"rule {rule_id!r} (#{position})" if isinstance(rule_id, str) else f"rule #{position}"

    def fail(problem: str, fix: str) -> KvtraceError:
        return KvtraceError(f"recipe {location}: {label}: {problem}; {fix}")

    unknown = sorted(set(table) - set(_RULE_KEYS))
    if unknown:
        raise fail(f"unknown key {unknown[0]!r}", f"allowed keys are {', '.join(_RULE_KEYS)}")
    for key in ("id", "segment", "match"):
        if not isinstance(table.get(key), str) or not table[key]:
            raise fail(f"`{key}` is missing or not a string", f'add `{key} = "..."`')
    if table["segment"] not in SEGMENTS:
        raise fail(f"unknown segment {table['segment']!r}", f"use one of {', '.join(SEGMENTS)}")
    try:
        pattern = regex.compile(table["match"])
    except regex.error as err:
        raise fail(f"`match` is not a valid Python regex ({err})", "fix the pattern (single quotes keep backslashes)")
    template = _parse_template(table.get("template", {}), fail)
    dims = _parse_dims(table, fail)
    kv_slots, kv_enum, kv_dtype = _parse_kv(table, pattern, fail)
    if not isinstance(table.get("kv_independent", False), bool):
        raise fail("`kv_independent` is not a boolean", "write `kv_independent = true` or leave it out")
    if table.get("kv_independent") and table["segment"] in NEVER_CONTROLS:
        raise fail(f"segment {table['segment']!r} cannot be `kv_independent`: a collective lasts until the slowest "
                   "rank arrives, so its time measures the other ranks, not drift", "leave `kv_independent` out")
    for key in ("note", "source"):
        if not isinstance(table.get(key, ""), str):
            raise fail(f"`{key}` is not a string", f'write `{key} = "..."`')
    return Rule(file=file_name, id=table["id"], segment=table["segment"], pattern=pattern, template=template,
                dims=dims, kv_slots=kv_slots, kv_enum=kv_enum, kv_dtype=kv_dtype,
                kv_independent=table.get("kv_independent", False), note=table.get("note", ""),
                source=table.get("source", ""))


def _parse_template(conditions, fail: _Fail) -> tuple[tuple[SlotRef, tuple[str, ...]], ...]:
    """`template = { MaskMode = "1", "KernelTraits[3]" = ["a", "b"] }`: slot -> accepted values."""
    if not isinstance(conditions, dict):
        raise fail("`template` is not a table", 'write e.g. `template = { MaskMode = "1" }`')
    template = []
    for spec, wanted in conditions.items():
        ref = SlotRef.parse(spec)
        values = wanted if isinstance(wanted, list) else [wanted]
        if ref is None or not values or not all(type(v) in (str, int) for v in values):
            raise fail(
                f"bad template condition {spec!r} = {wanted!r}",
                'name an enum type or Template[index] and give a string, an integer or a list of them',
            )
        template.append((ref, tuple(str(v) for v in values)))
    return tuple(template)


def _parse_dims(table: dict, fail: _Fail) -> tuple[DimCondition, ...]:
    """grid_x … block_z: an integer (equality) or a comparison such as ">1"."""
    dims = []
    for dim in DIMS:
        if dim not in table:
            continue
        spec = table[dim]
        m = _COMPARISON.fullmatch(spec) if isinstance(spec, str) else None
        if type(spec) is int:
            dims.append(DimCondition(dim, "==", spec))
        elif m:
            dims.append(DimCondition(dim, m["op"] or "==", int(m["value"])))
        else:
            raise fail(f"bad `{dim}` condition {spec!r}", f'write an integer or a comparison such as `{dim} = ">1"`')
    return tuple(dims)


def _parse_kv(table: dict, pattern: re.Pattern[str],
              fail: _Fail) -> tuple[tuple[SlotRef, ...], dict[str, tuple[str, ...]], str | None]:
    """Where the KV dtype is named: kv_slots (with kv_enum labels for enum slots), a fixed kv_dtype, or a
    (?P<kv>...) group of the pattern; the last two exclude the others."""
    slot_specs = table.get("kv_slots", [])
    if not isinstance(slot_specs, list):
        slot_specs = [slot_specs]
    kv_slots = [SlotRef.parse(s) if isinstance(s, str) else None for s in slot_specs]
    if None in kv_slots:
        raise fail(
            f"bad `kv_slots` {table['kv_slots']!r}",
            'list enum types or Template[index] entries, e.g. kv_slots = ["KernelTraits[10]"]',
        )
    kv_enum = table.get("kv_enum", {})
    enum_slots = {str(ref) for ref in kv_slots if ref.index is None}
    if not isinstance(kv_enum, dict) or not all(
        key in enum_slots and isinstance(labels, list) and all(isinstance(x, str) for x in labels)
        for key, labels in kv_enum.items()
    ):
        raise fail(
            f"bad `kv_enum` {kv_enum!r}",
            "map each enum named in kv_slots to its labels by value, "
            'e.g. kv_enum = { Fp8KVCacheDataType = ["auto", "fp8_e4m3"] }',
        )
    kv_dtype = table.get("kv_dtype")
    if kv_dtype is not None and (not isinstance(kv_dtype, str) or kv_slots or "kv" in pattern.groupindex):
        raise fail("`kv_dtype` must be a string and excludes kv_slots and a (?P<kv>...) group", "keep one of them")
    return tuple(kv_slots), {key: tuple(labels) for key, labels in kv_enum.items()}, kv_dtype


# ---------------------------------------------------------------------------------------------------
# Classification
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    key: str  # normalised name, KV dtype slot(s) replaced by {kv}
    label: str  # short display form, e.g. "BatchPrefillWithPagedKVCacheKernel[MaskMode=1]"
    kv_dtype: str | None


def kernel_family(kernel: KernelName, rule: Rule | None, match: regex.Match | None) -> Family:
    """Family of a kernel name under the rule that matched it (None when no rule matched)."""
    slots: list[tuple[int, int, str]] = []  # (start, end, dtype label)
    if match is not None and "kv" in match.re.groupindex and match["kv"] is not None:
        slots.append((*match.span("kv"), kernel_dtype_label(match["kv"])))
    for ref in rule.kv_slots if rule else ():
        enum_labels = rule.kv_enum.get(str(ref))
        for arg, value in ref.find(kernel):
            if enum_labels is None:
                label = kernel_dtype_label(value)
            else:
                known = value.isdigit() and int(value) < len(enum_labels)
                label = enum_labels[int(value)] if known else f"{ref}={value}"
            slots.append((arg.start, arg.end, label))
    slots = [s for s in slots if kernel.key_start <= s[0] and s[1] <= kernel.key_end]
    fixed_label = rule.kv_dtype if rule else None
    if not slots and fixed_label is None and (rule is None or rule.segment in KV_SEGMENTS):
        slots = [
            (m.start(), m.end(), kernel_dtype_label(m.group()))
            for m in _FALLBACK_TOKENS.finditer(kernel.text, kernel.key_start, kernel.key_end)
        ]

    slots = _outermost(slots)
    key = _abstract(kernel.text, kernel.key_start, kernel.key_end, slots)
    label = _abstract(kernel.text, *display_span(kernel), slots)
    conditions = [
        f"{ref.display}={value}"
        for ref, _ in (rule.template if rule else ())
        for _, value in list(ref.find(kernel))[:1]
    ]
    if conditions:
        label += f"[{','.join(conditions)}]"
    labels = [s[2] for s in slots]
    kv_dtype = fixed_label or next((x for x in labels if x not in STORAGE_LABELS), labels[0] if labels else None)
    return Family(key, label, kv_dtype)


def _outermost(slots: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Sorted, de-duplicated slots with any slot nested in an earlier one dropped."""
    kept: list[tuple[int, int, str]] = []
    for slot in sorted(set(slots), key=lambda s: (s[0], -s[1])):
        if not kept or slot[0] >= kept[-1][1]:
            kept.append(slot)
    return kept


def _abstract(text: str, start: int, end: int, slots: list[tuple[int, int, str]]) -> str:
    parts, at = [], start
    for a, b, _ in slots:
        if start <= a and b <= end:
            parts += [text[at:a], KV_PLACEHOLDER]
            at = b
    parts.append(text[at:end])
    return "".join(parts)


@dataclass(frozen=True)
class Classification:
    segment: str
    family: str
    family_label: str
    kv_dtype: str | None
    recipe: str | None
    kv_independent: bool = False


class RecipeSet:
    """Rules in match order: user files first, then shipped files, each file's rules in file order."""

    def __init__(self, rules: Sequence[Rule], files: Sequence[str]):
        self.rules = tuple(rules)
        self.files = tuple(files)
        self._by_name: dict[str, tuple[KernelName, list[tuple[int, regex.Match]]]] = {}
        self._families: dict[tuple[str, int | None], Family] = {}

    def classify(self, names: pl.DataFrame) -> pl.DataFrame:
        """Add segment, family, family_label, kv_dtype, recipe and kv_independent to one row per distinct
        signature."""
        missing = [c for c in INPUT_COLUMNS if c not in names.columns]
        if missing:
            raise ValueError(f"classify() input lacks columns {missing}")
        results = [
            self.classify_one(row["demangled"] or row["short"] or "", row) for row in names.iter_rows(named=True)
        ]
        return names.with_columns(
            pl.Series("segment", [r.segment for r in results], dtype=pl.Utf8),
            pl.Series("family", [r.family for r in results], dtype=pl.Utf8),
            pl.Series("family_label", [r.family_label for r in results], dtype=pl.Utf8),
            pl.Series("kv_dtype", [r.kv_dtype for r in results], dtype=pl.Utf8),
            pl.Series("recipe", [r.recipe for r in results], dtype=pl.Utf8),
            pl.Series("kv_independent", [r.kv_independent for r in results], dtype=pl.Boolean),
        )

    def classify_one(self, demangled: str, dims: dict | None = None) -> Classification:
        """Classify one name; dims maps grid_x..block_z to ints (rules with dim conditions need them)."""
        kernel, candidates = self._candidates(demangled)
        for index, match in candidates:
            rule = self.rules[index]
            if all(c.holds(dims or {}) for c in rule.dims):
                family = self._family(demangled, kernel, index, match)
                return Classification(rule.segment, family.key, family.label, family.kv_dtype, rule.recipe,
                                      rule.kv_independent)
        family = self._family(demangled, kernel, None, None)
        return Classification("other", family.key, family.label, family.kv_dtype, None)

    def _candidates(self, demangled: str) -> tuple[KernelName, list[tuple[int, regex.Match]]]:
        """Rules whose name and template conditions hold, cached per name (grid/block vary by row)."""
        cached = self._by_name.get(demangled)
        if cached is None:
            kernel = parse_kernel_name(demangled)
            matches = ((index, rule.match_name(kernel)) for index, rule in enumerate(self.rules))
            cached = self._by_name[demangled] = (kernel, [(i, m) for i, m in matches if m is not None])
        return cached

    def _family(self, demangled: str, kernel: KernelName, index: int | None, match) -> Family:
        cache_key = (demangled, index)
        if cache_key not in self._families:
            rule = None if index is None else self.rules[index]
            self._families[cache_key] = kernel_family(kernel, rule, match)
        return self._families[cache_key]


def load_recipes(extra_files: Sequence[str | Path] = ()) -> RecipeSet:
    """Shipped recipes plus user files (`--recipe FILE`), which match before every shipped rule."""
    user_files = []
    for path in map(Path, extra_files):
        data = files.read_small(path, f"recipe {path}", "check the path given to --recipe")
        user_files.append(_parse_recipe_file(path.name, str(path), data, order_required=False))
    shipped_files = [
        _parse_recipe_file(entry.name, f"kvtrace.recipes/{entry.name}", entry.read_bytes(), order_required=True)
        for entry in importlib.resources.files("kvtrace.recipes").iterdir()
        if entry.name.endswith(".toml")
    ]
    # sorted() is stable: user files with equal order keep their command-line order.
    ordered = sorted(user_files, key=lambda f: f.order) + sorted(shipped_files, key=lambda f: (f.order, f.name))
    return RecipeSet([rule for f in ordered for rule in f.rules], [f.location for f in ordered])
