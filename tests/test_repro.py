"""`kvtrace repro`: the standalone script written from a run's manifest and trace.

The scripts run on the GPU box (fixtures/repro/); here: they are Python that imports only torch, flashinfer and the
standard library, their shapes are the run's (read again from the manifest, the model's config.json and the trace's
NVTX names with plain SQL), the committed ones are what the command writes, and bad inputs get the one-line error.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import sqlite3
import sys

import pytest

from conftest import FI_GAUSSIAN, FIXTURES, VLLM033_8B_RUNS

COLD_PREFILL = VLLM033_8B_RUNS["capacity-cold-prefill"]
# The committed scripts, by the run directory's name they were generated from (fixtures/repro/README.md).
COMMITTED = {"vllm033-h200-8b-cold-prefill": COLD_PREFILL, "fi-h200-sm90-gaussian": FI_GAUSSIAN}


def generate(run_kvtrace, tmp_path, name: str, source) -> str:
    """The script for `source` seen under the run directory name `name` (the name the script records)."""
    (tmp_path / "runs").mkdir(exist_ok=True)
    link = tmp_path / "runs" / name
    link.symlink_to(source, target_is_directory=True)
    out = tmp_path / f"{name}.py"
    code, stdout, err = run_kvtrace("repro", link, "-o", out)
    assert code == 0, err
    assert stdout == ""
    return out.read_text()


def spec_of(text: str) -> dict:
    tree = ast.parse(text)
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "SPEC"]
    return ast.literal_eval(node.value)


def imported(text: str) -> set[str]:
    tree = ast.parse(text)
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    return names | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}


def nvtx_names(sqlite_path) -> list[str]:
    with sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True) as db:
        return [row[0] for row in db.execute(
            "SELECT coalesce(n.text, s.value) FROM NVTX_EVENTS n LEFT JOIN StringIds s ON n.textId = s.id")]


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_committed_script_is_what_repro_writes(run_kvtrace, tmp_path, name):
    text = generate(run_kvtrace, tmp_path, name, COMMITTED[name])
    assert (FIXTURES / "repro" / f"{name}.py").read_text() == text, \
        f"fixtures/repro/{name}.py is stale: regenerate it (fixtures/repro/README.md)"


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_script_imports_only_torch_flashinfer_and_the_standard_library(name):
    text = (FIXTURES / "repro" / f"{name}.py").read_text()
    outside = imported(text) - set(sys.stdlib_module_names)
    assert outside == {"torch", "flashinfer"}
    assert not re.search(r"^\s*(import|from)\s+(kvtrace|vllm)\b", text, re.M)


def test_vllm_cold_prefill_script_carries_the_traced_shapes():
    spec = spec_of((FIXTURES / "repro" / "vllm033-h200-8b-cold-prefill.py").read_text())
    config = json.loads((FIXTURES / "models" / "llama-8b-shape" / "config.json").read_text())
    manifest = json.loads((COLD_PREFILL / "manifest.json").read_text())
    assert (spec["q_heads"], spec["kv_heads"], spec["head_dim"], spec["layers"]) == (
        config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"], config["num_hidden_layers"])
    assert spec["page_size"] == manifest["arms"]["fp8"]["workload"]["engine"]["block_size"]
    # Every prefill step the trace names: N requests of T tokens in all; the point says each prompt's length.
    point = manifest["arms"]["fp8"]["points"][0]
    per_request = point["tokens_in"] // point["requests"]
    steps = {tuple(map(int, m.groups())) for name in nvtx_names(COLD_PREFILL / "fp8.sqlite")
             if (m := re.fullmatch(r"execute_context_(\d+)\((\d+)\)_generation_0\(0\)", name)) and m.group(1) != "0"}
    assert steps and all(tokens == requests * per_request for requests, tokens in steps)
    prefill = [case for case in spec["cases"] if case["kernel"] == "prefill"]
    assert sorted((len(c["qo_lens"]), sum(c["qo_lens"])) for c in prefill) == sorted(steps)
    for case in prefill:
        assert case["causal"] and case["qo_lens"] == case["kv_lens"] == [per_request] * len(case["qo_lens"])
    # The routes the trace took, from each arm's log.
    routes = spec["source"]["traced_routes"]
    for arm, route in (("fp8", "FA3, FP8 q"), ("nvfp4", "FA2, BF16 q")):
        log = (COLD_PREFILL / f"{arm}.log").read_text()
        dtype = re.findall(r"resolved query dtypes: prefill=torch\.(\w+)", log)[-1]
        assert (dtype == "float8_e4m3fn") == (route == "FA3, FP8 q")
        assert routes[arm] == route
    labels = {route["label"] for route in prefill[0]["routes"]}
    assert {"fp8 own route", "nvfp4 own route", "fp8 on nvfp4's route"} <= labels


def test_vllm_traced_prefill_time_is_the_kernels_in_the_step_ranges():
    spec = spec_of((FIXTURES / "repro" / "vllm033-h200-8b-cold-prefill.py").read_text())
    (case,) = [c for c in spec["cases"] if c["kernel"] == "prefill"]
    with sqlite3.connect(f"file:{COLD_PREFILL / 'nvfp4.sqlite'}?mode=ro", uri=True) as db:
        count, total = db.execute(
            "SELECT count(*), sum(k.end - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
            "ON k.demangledName = s.id WHERE s.value LIKE '%BatchPrefillWithPagedKVCacheKernel%'").fetchone()
    assert case["traced"]["nvfp4"]["kernels"] == count
    assert case["traced"]["nvfp4"]["us_per_kernel"] == pytest.approx(total / 1e3 / count, rel=1e-4)


def test_flashinfer_script_carries_the_workload_spec_and_its_phases():
    spec = spec_of((FIXTURES / "repro" / "fi-h200-sm90-gaussian.py").read_text())
    settings = json.loads((FI_GAUSSIAN / "manifest.json").read_text())["settings"]["spec"]
    assert (spec["q_heads"], spec["kv_heads"], spec["head_dim"], spec["page_size"]) == (
        settings["q_heads"], settings["kv_heads"], settings["head_dim"], settings["page_size"])
    phases = {(m.group(1), int(m.group(2)), int(m.group(3))) for name in nvtx_names(FI_GAUSSIAN / "nvfp4.sqlite")
              if (m := re.fullmatch(r"kvtrace:(prefill|decode|append) ctx=(\d+) batch=(\d+)", name))}
    assert {(c["kernel"], c["kv_lens"][0] - len(c.get("new_lens") or []) // len(c["kv_lens"]), len(c["kv_lens"]))
            for c in spec["cases"]} == phases
    for case in spec["cases"]:
        assert case["causal"] == (case["kernel"] == "prefill")
        assert len(case["qo_lens"]) == settings["batch"]
    assert spec["source"]["versions"]["flashinfer"] == "0.6.16.post3"


def test_a_trace_inside_the_run_directory_gives_the_same_script(run_kvtrace, tmp_path):
    whole = generate(run_kvtrace, tmp_path, "fi-h200-sm90-gaussian", FI_GAUSSIAN)
    out = tmp_path / "from-trace.py"
    code, _, err = run_kvtrace("repro", tmp_path / "runs" / "fi-h200-sm90-gaussian" / "nvfp4.sqlite", "-o", out)
    assert code == 0, err
    assert out.read_text() == whole


def test_bad_inputs_get_one_line(run_kvtrace, tmp_path):
    lone = tmp_path / "alone"
    lone.mkdir()
    shutil.copy(FI_GAUSSIAN / "fp8.sqlite", lone / "fp8.sqlite")
    for bad, words in ((tmp_path / "missing", "no such run directory"),
                       (lone / "fp8.sqlite", "no manifest.json beside it"),
                       (lone, "manifest")):
        code, out, err = run_kvtrace("repro", bad)
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvtrace: error:") and words in lines[0], err


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_script_runs_every_route_against_a_standin(monkeypatch, tmp_path, capsys, name):
    """The committed script, on shrunk shapes, against tests/flashinfer_standin.py on the CPU: every route runs,
    each output lies within BF16 rounding of the float64 reference over the cache as stored (a wrong page table,
    layout or scale would be far off), the split multiplies out, and the JSON holds it all."""
    import flashinfer_standin

    flashinfer_standin.cuda_on_cpu(monkeypatch)
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin.module())
    source = (FIXTURES / "repro" / f"{name}.py").read_text().replace('"cuda"', '"cpu"')
    namespace = {"__name__": "repro_under_test"}
    exec(compile(source, name, "exec"), namespace)
    spec = namespace["SPEC"]
    spec.update(q_heads=4, kv_heads=2, head_dim=32)
    kinds = {}
    for case in spec["cases"]:  # one case per kernel, shrunk to uneven lengths of a few pages
        if case["kernel"] in kinds:
            continue
        kinds[case["kernel"]] = case
        case["kv_lens"] = [37, 16, 5]
        case["qo_lens"] = case["kv_lens"] if case["kernel"] == "prefill" else [1, 1, 1]
        if case["kernel"] == "append":
            case["new_lens"] = [3, 1, 2]
    spec["cases"] = list(kinds.values())
    out = tmp_path / "repro.json"
    monkeypatch.setattr(sys, "argv", ["script", "--json", str(out), "--warmup", "1", "--iters", "3"])
    namespace["main"]()
    results = json.loads(out.read_text())
    assert results["environment"]["flashinfer"] == "0.0.0+standin"
    for case in results["cases"]:
        for route in case["routes"]:
            assert route["status"] == "ok", route.get("traceback")
            assert route["gpu_us"]["n"] >= 3
            if case["kernel"] != "append":
                # within BF16's rounding of the output, except the workspace route's second rounding (to FP8)
                bound = 0.08 if route.get("via") == "fp8-workspace" else 0.01
                assert route["quality"]["rel_l2_vs_own_cache"] < bound, (case["name"], route["label"])
                assert route["quality"]["rel_l2_vs_bf16"] < 0.3
        split = case["split"]
        assert split["ratio"] == pytest.approx(split["route"] * split["format"])
    assert "nvfp4 own route" in capsys.readouterr().out
    calls = set(flashinfer_standin.CALLS)
    assert {"slot_mapping:Tensor", "slot_mapping:float", "nvfp4_kv_dequantize_paged"} <= calls
    assert "BatchPrefillWithPagedKVCacheWrapper:fa3:torch.float8_e4m3fn:torch.float8_e4m3fn" in calls
