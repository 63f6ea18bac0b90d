"""Install layout, entry points, layer boundaries and the generated CLI reference."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile

from conftest import NSYS2025_DIR, REPO


def test_wheel_puts_everything_under_kvtrace(tmp_path):
    # Built from a copy, so that setuptools' build/ folder never lands in the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for folder in ("kvtrace", "analyzer", "capture", "recipes"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(source)], check=True)
    wheel = next(tmp_path.glob("kvtrace-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"kvtrace"}
    for module in ("kvtrace/analyzer/load.py", "kvtrace/capture/runner.py", "kvtrace/recipes/flashinfer.toml",
                   "kvtrace/__main__.py", "kvtrace/nsys.py", "kvtrace/kv_formats.py", "kvtrace/manifest.py",
                   "kvtrace/capture/vllm_probe.py"):
        assert module in names, module
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvtrace = kvtrace.cli:main" in entry_points


def test_python_dash_m_and_console_script_agree():
    module = subprocess.run([sys.executable, "-m", "kvtrace", "--version"], capture_output=True, text=True)
    assert module.returncode == 0 and module.stdout.startswith("kvtrace, version ")


def _imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return {name.split(".")[0] for name in out.split()} | set(out.split())


def test_analyzer_never_imports_gpu_stacks():
    modules = _imported_after(
        "from kvtrace.analyzer import cli, compare, load, classify, stats\n"
        "from kvtrace.analyzer.render import terminal, markdown, json_out, csv_out\n"
        f"from kvtrace.cli import main\n"
        f"main(['diff', '{NSYS2025_DIR / 'fp8.sqlite'}', '{NSYS2025_DIR / 'nvfp4.sqlite'}', '--format', 'json', "
        f"'-o', '/dev/null'])")
    assert not modules & {"torch", "flashinfer", "vllm"}


def test_capture_never_imports_analyzer_or_plotting():
    modules = _imported_after("from kvtrace.capture import cli, runner, flashinfer_engine, formats, vllm_engine, "
                              "vllm_commands, vllm_offline_workload\n"
                              "from kvtrace.capture.formats import nvfp4_quantize")
    assert not modules & {"polars", "matplotlib", "numpy", "kvtrace.analyzer", "torch", "vllm"}


def _kvtrace_imports(path) -> set[str]:
    """Every kvtrace module a source file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("kvtrace.")}


def test_layers_import_only_the_floor():
    """analyzer/ never imports capture/ and capture/ never imports analyzer/; the floor (kvtrace/*.py but the
    CLI modules) imports neither. Read from the source, so that an import inside a function counts too."""
    floor = {"kvtrace.nsys", "kvtrace.kv_formats", "kvtrace.manifest", "kvtrace.errors", "kvtrace.files",
             "kvtrace.model_config"}
    for layer, forbidden in (("analyzer", "kvtrace.capture"), ("capture", "kvtrace.analyzer")):
        for path in sorted((REPO / layer).rglob("*.py")):
            bad = {name for name in _kvtrace_imports(path) if name.startswith(forbidden)}
            assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
    for name in floor:
        path = REPO / (name.replace(".", "/") + ".py")
        if path.exists():
            layers = {n for n in _kvtrace_imports(path) if n.startswith(("kvtrace.analyzer", "kvtrace.capture",
                                                                         "kvtrace.cli"))}
            assert not layers, f"{path.relative_to(REPO)} imports {sorted(layers)}"


def test_help_lists_commands_without_importing_them():
    modules = _imported_after("from kvtrace.cli import cli\n"
                              "import click.testing\n"
                              "assert click.testing.CliRunner().invoke(cli, ['--help']).exit_code == 0")
    assert not modules & {"polars", "torch", "kvtrace.analyzer", "kvtrace.capture"}


def test_cli_reference_is_current_and_every_command_has_help():
    from kvtrace import docs

    assert (REPO / "docs" / "cli.md").read_text() == docs.reference(), "run `make docs`"
    for path, command in docs.walk(docs.cli, ["kvtrace"]):
        assert (command.help or "").strip(), " ".join(path)
        for param in command.params:
            if param.param_type_name == "option" and param.name not in ("help", "version"):
                assert (param.help or "").strip(), (" ".join(path), param.name)


def _source_modules() -> dict[str, object]:
    """Every module of the three source folders by its installed name (pyproject's package-dir)."""
    roots = {"kvtrace": REPO / "kvtrace", "kvtrace.analyzer": REPO / "analyzer", "kvtrace.capture": REPO / "capture"}
    found = {}
    for package, folder in roots.items():
        for path in folder.rglob("*.py"):
            parts = [part for part in path.relative_to(folder).with_suffix("").parts if part != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def test_no_import_cycle():
    """The modules import one way (docs/design.md): no module reaches itself through the modules it imports, at
    module level or inside a function. `from PACKAGE import MODULE` is an arrow to MODULE, not to the package."""
    modules = _source_modules()
    arrows = {}
    for name, path in modules.items():
        targets = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                       for inner in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # annotations only: no arrow when the code runs
                continue
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                inside = {f"{node.module}.{alias.name}" for alias in node.names}
                targets |= inside if inside <= modules.keys() else inside | {node.module}
        arrows[name] = (targets & modules.keys()) - {name}
    done, path = set(), []

    def visit(name):
        path.append(name)
        for target in sorted(arrows[name]):
            assert target not in path, " → ".join(path[path.index(target):] + [target])
            if target not in done:
                visit(target)
        path.pop()
        done.add(name)

    for name in sorted(modules):
        if name not in done:
            visit(name)


def test_no_module_over_650_lines():
    """A module past 650 lines holds more than one room (docs/design.md): split it along its seams."""
    long = {str(path.relative_to(REPO)): lines for path in _source_modules().values()
            if (lines := len(path.read_text().splitlines())) > 650}
    assert not long, long


def test_readme_is_an_entrance():
    """README.md stays an entrance (issue 49): under 12,000 characters, the long material in docs/, and every file
    it links (docs, the demo's picture) is there."""
    text = (REPO / "README.md").read_text()
    assert len(text) < 12_000
    links = re.findall(r"\]\(([^)#\s]+)", text)
    assert "docs/summary.png" in links and "docs/usage.md" in links
    assert not [link for link in links if not (REPO / link).is_file()]
