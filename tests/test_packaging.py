"""Install layout, entry points, layer boundaries and the generated CLI reference."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from conftest import NSYS2025_DIR, REPO


def test_wheel_puts_everything_under_kvtrace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True)
    wheel = next(tmp_path.glob("kvtrace-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"kvtrace"}
    for module in ("kvtrace/analyzer/load.py", "kvtrace/capture/runner.py", "kvtrace/recipes/flashinfer.toml",
                   "kvtrace/__main__.py"):
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
    modules = _imported_after("from kvtrace.capture import cli, runner, flashinfer_engine, formats\n"
                              "from kvtrace.capture.formats import kv_cache_bytes")
    assert not modules & {"polars", "matplotlib", "kvtrace.analyzer"}


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
