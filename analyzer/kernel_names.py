"""C++ demangled kernel names: template arguments, the parameter list, the base name (parse_kernel_name), the
name to show (display_span, looking through launch wrappers), and slots that name template arguments (SlotRef)
for recipes to match on and to abstract.

Tolerant of hostile names (unclosed brackets, `operator<`, thousands of nested brackets): a name costs a bounded
multiple of its length, never its square.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

_OPENER_OF = {">": "<", ")": "(", "]": "[", "}": "{"}
# Longest first, so that `operator<<=` is not read as `operator<` followed by a template list.
_OPERATOR_SYMBOLS = sorted(
    "<<= >>= <=> ->* () [] << >> <= >= == != && || ++ -- -> += -= *= /= %= &= |= ^= "
    "< > + - * / % & | ^ ~ ! = ,".split(),
    key=len,
    reverse=True,
)
_PARAMS_TAIL = re.compile(r"(?: ?(?:const|volatile|noexcept|&&|&))* ?")
_ENUM_CAST = re.compile(r"\((?P<type>[A-Za-z_][\w:]*)\)(?P<value>-?\w+)")
_OPERATOR_ALTERNATIVES = "|".join(map(re.escape, _OPERATOR_SYMBOLS))
_OPERATOR_NAME_END = re.compile(rf"\boperator ?(?:{_OPERATOR_ALTERNATIVES})$")
_IDENTIFIER = re.compile(rf"\boperator ?(?:{_OPERATOR_ALTERNATIVES})|[A-Za-z_~][\w~]*")
# What the parser looks at: brackets, commas, and operator names (consumed whole, so the '<' of
# `operator<` opens nothing).
_TOKEN = re.compile(rf"\boperator ?(?:{_OPERATOR_ALTERNATIVES})|[<>()\[\]{{}},]")
# Launch wrappers whose first non-numeric template argument names the real work (CUTLASS kernels,
# FA3 arch guards, PyTorch elementwise functors).
_LAUNCH_WRAPPERS = re.compile(
    r"device_kernel|Kernel2?|enable_sm\d+\w*|(?:vectorized_|unrolled_)?elementwise_kernel|gpu_kernel_impl\w*"
)
_NUMBER_ARG = re.compile(r"(?:\([\w: ]+\))?-?\d+\w*")  # 4, 128u, (int)8, (unsigned int)128
# Template arguments are recorded down to this many enclosing brackets (real kernels nest about ten deep).
# Each level's arguments together hold at most the whole name, so a hostile name of thousands of nested
# brackets costs this many times its length, not its length squared.
_MAX_ARG_DEPTH = 32


@dataclass(frozen=True)
class TemplateArg:
    """One argument of one template instantiation; start/end index KernelName.text."""

    template: str  # qualified template name as written before '<', e.g. "flashinfer::KernelTraits"
    list_at: int  # index of the '<' that opens this argument list
    index: int
    text: str
    start: int
    end: int


@dataclass(frozen=True)
class KernelName:
    """A demangled kernel name split into the parts classification needs."""

    text: str  # whitespace-normalised demangled name
    key_start: int  # after the `void ` return type
    key_end: int  # where the function parameter list starts (len(text) when there is none)
    base_start: int  # the kernel's own name, without namespaces and template arguments
    base_end: int
    args: tuple[TemplateArg, ...]

    @property
    def key(self) -> str:
        return self.text[self.key_start : self.key_end]

    @property
    def base(self) -> str:
        return self.text[self.base_start : self.base_end]


def parse_kernel_name(demangled: str) -> KernelName:
    """Parse template arguments, the parameter list and the base name out of a demangled name.

    Tolerant by design: a '<' that never closes (a less-than inside an expression) is dropped when
    its enclosing bracket closes, '>' outside a template list (or in '->') is plain text, and
    `operator<`-style names are skipped as names, not brackets.
    """
    text = " ".join(demangled.split())
    # Each open bracket: [opener, start, qualified name before it, start of current arg, finished arg spans]
    stack: list[list] = []
    args: list[TemplateArg] = []
    top_level_groups: list[tuple[str, int, int]] = []
    for token in _TOKEN.finditer(text):
        char, i = token.group(), token.start()
        if char in "<([{":
            stack.append([char, i, _name_before(text, i) if char == "<" else "", i + 1, []])
        elif char == ">":
            if stack and stack[-1][0] == "<" and text[i - 1] != "-":
                _close(stack, i, text, args, top_level_groups)
        elif char in ")]}":
            while stack and stack[-1][0] == "<":  # an unclosed '<' inside (...) was a less-than
                stack.pop()
            if stack and stack[-1][0] == _OPENER_OF[char]:
                _close(stack, i, text, args, top_level_groups)
        elif char == "," and stack and stack[-1][0] == "<":
            stack[-1][4].append((stack[-1][3], i))
            stack[-1][3] = i + 1
    if stack:  # a truncated name: its outermost open bracket runs to the end
        top_level_groups.append((stack[0][0], stack[0][1], len(text)))

    key_start = 5 if text.startswith("void ") else 0
    key_end = len(text)
    for opener, start, end in reversed(top_level_groups):
        if opener == "(" and start > key_start and _PARAMS_TAIL.fullmatch(text, end + 1):
            key_end = start
        break
    base_start, base_end = _base_span(text, key_start, key_end, top_level_groups)
    return KernelName(text, key_start, key_end, base_start, base_end, tuple(args))


def _name_before(text: str, end: int) -> str:
    """The qualified name right before a '<' (a backward scan: regexes from 0 are quadratic here)."""
    start = end - 1 if text[end - 1 : end] == " " else end
    operator_name = _OPERATOR_NAME_END.search(text, max(0, start - 12), start)
    if operator_name:
        start = operator_name.start()
    while start > 0 and (_is_word(text[start - 1]) or text[start - 1] in ":~"):
        start -= 1
    return text[start:end].strip(" :")


def _is_word(char: str) -> bool:
    return bool(char) and (char.isalnum() or char == "_")


def _close(stack: list[list], end: int, text: str, args: list[TemplateArg], top_level: list) -> None:
    opener, start, name, arg_start, spans = stack.pop()
    if opener == "<" and len(stack) < _MAX_ARG_DEPTH:
        spans.append((arg_start, end))
        for index, (a, b) in enumerate(spans):
            raw = text[a:b]
            stripped = raw.strip()
            if stripped:
                lead = len(raw) - len(raw.lstrip())
                args.append(TemplateArg(name, start, index, stripped, a + lead, a + lead + len(stripped)))
    if not stack:
        top_level.append((opener, start, end))


def _base_span(text: str, start: int, end: int, top_level: list[tuple[str, int, int]]) -> tuple[int, int]:
    """Span of the last identifier outside every bracket, e.g. the `X` in `ns::X<...>(...)`."""
    masked = list(text[:end])
    for _, a, b in top_level:
        masked[a : min(b + 1, end)] = " " * (min(b + 1, end) - a)
    found = [m.span() for m in _IDENTIFIER.finditer("".join(masked), start)]
    return found[-1] if found else (start, end)


def display_span(kernel: KernelName) -> tuple[int, int]:
    """The base name, looking through launch wrappers: `cutlass::device_kernel<...GemmUniversal<...>>`
    shows as GemmUniversal, `vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, ...>` as
    FillFunctor."""
    start, end = kernel.base_start, kernel.base_end
    while _LAUNCH_WRAPPERS.fullmatch(kernel.text, start, end):
        list_at = end + 1 if kernel.text[end : end + 1] == " " else end
        wrapped = next(
            (a for a in kernel.args if a.list_at == list_at and not _NUMBER_ARG.fullmatch(a.text)), None
        )
        # The wrapped name: the last identifier before its own brackets (`ns::f(...)::[lambda]` -> f).
        head = re.match(r"[^<(\[{]*", wrapped.text).group() if wrapped else ""
        names = [m for m in _IDENTIFIER.finditer(head) if m.group() not in ("const", "volatile")]
        if not names:
            break
        start, end = wrapped.start + names[-1].start(), wrapped.start + names[-1].end()
    return start, end


# ---------------------------------------------------------------------------------------------------
# Slots: named template arguments
# ---------------------------------------------------------------------------------------------------

_SLOT_REF = re.compile(r"(?P<name>[A-Za-z_]\w*(?:::[A-Za-z_]\w*)*)(?:\[(?P<index>\d+)\])?")


@dataclass(frozen=True)
class SlotRef:
    """`Enum` names every template argument cast to that enum type, e.g. `(flashinfer::MaskMode)1`;
    `Template[i]` names the i-th (0-based) argument of every instantiation of Template."""

    name: str
    index: int | None

    @classmethod
    def parse(cls, spec: str) -> SlotRef | None:
        m = _SLOT_REF.fullmatch(spec)
        return cls(m["name"], None if m["index"] is None else int(m["index"])) if m else None

    def __str__(self) -> str:
        return self.name if self.index is None else f"{self.name}[{self.index}]"

    @property
    def display(self) -> str:
        """Without namespaces, for family labels: `MaskMode`, `KernelTraits[1]`."""
        return str(self).rsplit("::", 1)[-1]

    def find(self, kernel: KernelName) -> Iterator[tuple[TemplateArg, str]]:
        """Each argument in the slot, with its value (the enum value for casts, else the text)."""
        for arg in kernel.args:
            if self.index is None:
                cast = _ENUM_CAST.fullmatch(arg.text)
                if cast and _same_name(cast["type"], self.name):
                    yield arg, cast["value"]
            elif arg.index == self.index and _same_name(arg.template, self.name):
                yield arg, arg.text


def _same_name(qualified: str, ref: str) -> bool:
    return qualified == ref or qualified.endswith("::" + ref)
