"""Renderers only draw: every number a report shows is computed by the library call (issue 49), so no module of
analyzer/render/ does arithmetic on a result's fields. Read from the source (ast), so that the rule holds for code
written later.

What counts as arithmetic on a result: +, -, *, / (also in place) with an operand that is a numeric field of one of
the library's result dataclasses (`row.ratio - row.ci_low`), and sum/max/min over a result's fields or a len() of
results filtered by a rule (`sum(a.cut for a in result.answered)`). Not counted: scaling a value to the unit it is
printed in (ns to µs, ms or s, a fraction to percent, bytes to TB), and a count compared to choose words
(`len(point.causes) > 2`). Drawing positions that matplotlib asks for are drawing: the bars' offsets, an empirical
CDF's plotting positions over the library's per-call durations (what a histogram's bins are to its counts).
ALLOWED names the few places that compute on a result to lay out text or draw, each with its reason."""

from __future__ import annotations

import ast
import re

from conftest import REPO

RENDER = REPO / "analyzer" / "render"
# Printing a number in another unit: ns -> µs, ms, s; a fraction -> percent; bytes or FLOPs -> tera.
UNIT_SCALES = {1e3, 1e6, 1e9, 1e12, 100}
ALLOWED = {
    # matplotlib's errorbar takes an interval as distances from the point: the library's interval, drawn.
    ("plots.py", "_whiskers", "r.ratio - r.ci_low"),
    ("plots.py", "_whiskers", "r.ci_high - r.ratio"),
    # The width of the environment's name column, so that the values line up: text layout.
    ("upstream.py", "_environment", "max((len(name) for name, _ in f.environment))"),
}


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if getattr(target, "id", getattr(target, "attr", None)) == "dataclass":
            return True
    return False


def _result_fields() -> tuple[set[str], set[str]]:
    """(every field and property name, the numeric ones) of the dataclasses outside analyzer/render/."""
    fields, numeric = set(), set()
    for path in [*(REPO / "analyzer").rglob("*.py"), *(REPO / "kvtrace").glob("*.py")]:
        if RENDER in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ClassDef) and _is_dataclass(node)):
                continue
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    name, kind = item.target.id, ast.unparse(item.annotation)
                elif isinstance(item, ast.FunctionDef) and any(getattr(d, "id", None) == "property"
                                                              for d in item.decorator_list):
                    name, kind = item.name, ast.unparse(item.returns) if item.returns else ""
                else:
                    continue
                fields.add(name)
                if re.search(r"\b(int|float)\b", kind):
                    numeric.add(name)
    return fields, numeric


FIELDS, NUMERIC = _result_fields()
_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv)


def _numeric(node: ast.AST) -> bool:
    """Whether an operand is a result's numeric field (row.ratio, step.idle_ms[0]) or arithmetic on one."""
    if isinstance(node, ast.Attribute):
        return node.attr in NUMERIC
    if isinstance(node, ast.Subscript):
        return _numeric(node.value)
    if isinstance(node, ast.IfExp):
        return _numeric(node.body) or _numeric(node.orelse)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) or _numeric(node.right)
    return False


def _unit_scaling(node: ast.BinOp) -> bool:
    return isinstance(node.op, (ast.Mult, ast.Div)) and any(
        isinstance(side, ast.Constant) and side.value in UNIT_SCALES for side in (node.left, node.right))


def _reads_fields(node: ast.AST) -> bool:
    """Whether an expression reads a result's field (a method call's name is not a field read)."""
    called = {id(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
    return any(isinstance(n, ast.Attribute) and n.attr in FIELDS and id(n) not in called for n in ast.walk(node))


def _filtered(node: ast.AST) -> bool:
    return isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp)) and any(g.ifs for g in node.generators)


def computations(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, expression) of each computation on a result's fields in a renderer's source."""
    tree = ast.parse(source)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, _ARITHMETIC) and not _unit_scaling(node) \
                and (_numeric(node.left) or _numeric(node.right)):
            found.append(node)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, _ARITHMETIC) and _numeric(node.value):
            found.append(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            arguments = [*node.args, *(k.value for k in node.keywords)]
            if node.func.id in ("sum", "max", "min") and any(_reads_fields(a) for a in arguments):
                found.append(node)
            elif node.func.id == "len" and _filtered(node.args[0]) and _reads_fields(node.args[0]) \
                    and not isinstance(parents.get(id(node)), ast.Compare):
                found.append(node)
    return [(node.lineno, _function(node, parents), ast.unparse(node)) for node in found]


def _function(node: ast.AST, parents: dict) -> str:
    """The name of the function a node is in ("" at module level)."""
    while (node := parents.get(id(node))) is not None:
        if isinstance(node, ast.FunctionDef):
            return node.name
    return ""


def test_renderers_compute_nothing_on_results():
    found = [f"{path.name}:{line} in {function}(): {expression}" for path in sorted(RENDER.glob("*.py"))
             for line, function, expression in computations(path.read_text())
             if (path.name, function, expression) not in ALLOWED]
    assert not found, ("renderers compute on results: give the number to the result, computed by the library "
                       "(analyzer/), and print its field:\n" + "\n".join(found))


def test_the_allowed_places_still_exist():
    """An entry that matches nothing any more is dead: it would let a later computation of the same text through."""
    for name, function, expression in ALLOWED:
        assert (function, expression) in {found[1:] for found in computations((RENDER / name).read_text())}, \
            (name, function, expression)


def test_the_rule_finds_what_render_computed_before():
    """The renderers' own computations, before the library took them over, are found; printing is not."""
    computed = {
        "first.prompts - first.empty": 'f"{first.prompts - first.empty} of {first.prompts}"',
        "sum((a.cut for a in result.answered))": "cut = sum(a.cut for a in result.answered)",
        "s.attention_ns + s.quantize_ns": "duration(s.attention_ns + s.quantize_ns)",
        "max(f.steps, key=lambda s: s.host_per_step_ms)": "step = max(f.steps, key=lambda s: s.host_per_step_ms)",
        "max(row.band, threshold)": "return max(row.band, threshold)",
        "len([r for r in result.prompts if r.baseline_correct])": "more = len([r for r in result.prompts "
                                                                   "if r.baseline_correct])",
        "bottom += part.ms": "bottom += part.ms",
    }
    for expected, source in computed.items():
        assert [e for _, _, e in computations(source)] == [expected], source
    printed = ['f"{duration(arm.host_ns / 1e6)} and {100 * row.share:.1f}%"', "len(point.causes) > 2",
               'text = "a " + row.segment + f" {row.ratio:.3f}"', "low, high = row.run_ratio_range"]
    for source in printed:
        assert computations(source) == [], source
