"""Traces of several GPUs (issue 37): ranks, per-rank pairing and head rows, rank skew, communication outside the
drift controls, and the CUDA-graph warning only where graphs were launched.

The real multi-device pair is nsys-ai's two-H100 PyTorch run (fixtures/torch-h100x2, cut by its pack.py);
traces named "synthetic" are real single-GPU exports with their kernels copied onto a second device."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3

import pytest

from conftest import GRAPH_LOOP, NSYS2025_DIR, TORCH_H100X2
from kvtrace.analyzer import compare, headline
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.load import open_trace
from kvtrace.errors import KvtraceError

BEFORE, AFTER = TORCH_H100X2 / "before.sqlite", TORCH_H100X2 / "after.sqlite"
NCCL = "ncclDevKernel_SendRecv"


@pytest.fixture(scope="module")
def pair(shipped_recipes):
    return compare.diff(open_trace(BEFORE), open_trace(AFTER), shipped_recipes)


def durations(path, device: int) -> list[int]:
    """The NCCL calls of one device, by plain SQL."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return [r[0] for r in db.execute("""SELECT k."end" - k.start FROM CUPTI_ACTIVITY_KIND_KERNEL k
                                            JOIN StringIds s ON s.id = k.shortName
                                            WHERE s.value = ? AND k.deviceId = ?""", (NCCL, device))]


def test_kernels_keep_their_device_and_process():
    """Each device that ran kernels is a rank, in deviceId order, with the process that drove it; its kernel count
    is the original export's (the cut keeps every kernel)."""
    record = json.loads((TORCH_H100X2 / "cut.json").read_text())
    for name, pids in (("before.sqlite", (144, 145)), ("after.sqlite", (148, 149))):
        ranks = open_trace(TORCH_H100X2 / name).info.ranks
        assert [r.device_id for r in ranks] == [0, 1]
        assert [r.processes for r in ranks] == [(pids[0],), (pids[1],)]
        per_device = {}
        for device, _, calls, _ in record[name]["kernel_totals"]:
            per_device[device] = per_device.get(device, 0) + calls
        assert [r.kernels for r in ranks] == [per_device[0], per_device[1]]


def test_single_gpu_traces_have_one_rank_and_no_rank_rows(fi_h200_diff):
    assert len(fi_h200_diff.baseline.info.ranks) == 1
    assert fi_h200_diff.rank_rows == []
    assert all(r.ranks_agree is None and r.rank is None for r in fi_h200_diff.segments + fi_h200_diff.phases)
    assert not [f for f in fi_h200_diff.findings if f.check == "ranks"]


def test_calls_pair_rank_by_rank_on_the_real_pair(pair):
    """Rank k of the baseline pairs with rank k of the candidate: the NCCL rows per rank hold each device's own
    calls (plain SQL), and the ranks' pairs add up to the row of every rank."""
    ranks = [r for r in pair.rank_rows if r.segment == "communication" and r.phase is None]
    assert [r.rank for r in ranks] == [0, 1]
    for row in ranks:
        before, after = durations(BEFORE, row.rank), durations(AFTER, row.rank)
        assert (row.baseline_calls, row.baseline_total_ns) == (len(before), sum(before))
        assert (row.candidate_calls, row.candidate_total_ns) == (len(after), sum(after))
        assert 0 < row.compared_calls <= min(len(before), len(after))
    # rank 0 waits twice as long per call as rank 1 in `before`: pooled, they would be one mixed number
    per_call = [r.baseline_total_ns / r.baseline_calls for r in ranks]
    assert per_call[0] > 1.8 * per_call[1]
    for pooled in pair.segments:
        mine = [r for r in pair.rank_rows if r.segment == pooled.segment and r.phase is None]
        assert sum(r.compared_calls for r in mine) == pooled.compared_calls, pooled.segment


def test_communication_is_never_a_drift_control(pair, shipped_recipes, tmp_path):
    """NCCL waits for the slowest rank: its segment is its own and outside the controls, so the drift band is
    measured on GEMM, norm and activation alone (with NCCL in it the band was +12.0% [−9.1%, +38.4%])."""
    communication = next(r for r in pair.segments if r.segment == "communication")
    assert not communication.kv_independent
    assert "communication" not in pair.drift.segments
    assert set(pair.drift.segments) == {"gemm", "norm", "activation"}
    assert all(h.row.segment != "communication" for h in headline.head_rows(pair) if h.question == headline.CONTROL)
    for name in ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                 "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::RankSignals, "
                 "vllm::Signal*, __nv_bfloat16*, int, int)"):
        found = shipped_recipes.classify_one(name)
        assert (found.segment, found.kv_independent) == ("communication", False)
    user = tmp_path / "mine.toml"
    user.write_text("[[rule]]\nid='nccl'\nsegment='communication'\nmatch='nccl'\nkv_independent=true\n")
    with pytest.raises(KvtraceError, match="cannot be `kv_independent`") as raised:
        load_recipes([user])
    assert "\n" not in str(raised.value) and "mine.toml" in str(raised.value)


def test_rank_skew_names_the_straggler(pair):
    """The rank whose collectives wait least is the one the others wait for: rank 1 in `before` (NCCL 520 µs
    against 249 µs per call), rank 0 in `after`."""
    found = {f.message.split(":")[0]: f for f in pair.findings if f.check == "ranks"}
    assert found["before"].level == found["after"].level == "warning"
    assert "rank 1 (device 1) is the straggler" in found["before"].message
    assert "rank 0 (device 0) is the straggler" in found["after"].message
    assert "rank 0 = device 0 (pid 144), rank 1 = device 1 (pid 145)" in found["before"].message


def test_no_graph_warning_without_graph_launches(pair, tmp_path, shipped_recipes):
    """Both exports say CUDA graphs were traced as 'Graph', but no graph was launched: nothing is missing."""
    assert pair.baseline.info.graph_trace_mode == "Graph"
    assert pair.baseline.info.graph_launches is False
    assert not [f for f in pair.findings if f.check == "graph-trace"]
    # Synthetic: the graph-loop export (graphs launched, traced per node) relabelled as traced per graph.
    synthetic = tmp_path / "a-2000-graph-mode-synthetic.sqlite"
    shutil.copyfile(GRAPH_LOOP / "a-2000.sqlite", synthetic)
    with sqlite3.connect(synthetic) as db:
        assert db.execute("UPDATE META_DATA_CAPTURE SET value = 'Graph' WHERE name LIKE "
                          "'%CUDA_GRAPH_TRACE_OPTIONS:MODE'").rowcount == 1
    graphs = open_trace(synthetic, cache=False)
    assert graphs.info.graph_launches is True
    found = compare.diff(graphs, graphs, shipped_recipes).findings
    assert [f.level for f in found if f.check == "graph-trace"] == ["warning", "warning"]
    # The Parquet reader says the same of the real per-node export.
    assert open_trace(GRAPH_LOOP / "a-2000", cache=False).info.graph_launches is True


def two_ranks(source, target, stretch: float = 1.0):
    """A synthetic two-GPU export: every kernel of a real single-GPU export again on device 1, its duration times
    `stretch` there; the GPU row copied for device 1."""
    shutil.copyfile(source, target)
    with sqlite3.connect(target) as db:
        columns = [r[1] for r in db.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)")]
        chosen = ", ".join("1" if c == "deviceId" else f'start + CAST(("end" - start) * {stretch} AS INTEGER)'
                           if c == "end" else f'"{c}"' for c in columns)
        db.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL SELECT {chosen} FROM CUPTI_ACTIVITY_KIND_KERNEL")
        gpu = [r[1] for r in db.execute("PRAGMA table_info(TARGET_INFO_GPU)")]
        db.execute(f"INSERT INTO TARGET_INFO_GPU SELECT {', '.join('1' if c == 'id' else c for c in gpu)} "
                   "FROM TARGET_INFO_GPU WHERE id = 0")
    return open_trace(target, cache=False)


def test_synthetic_ranks_that_agree_share_one_head_row(tmp_path, shipped_recipes, fi_h200_diff):
    fp8 = two_ranks(NSYS2025_DIR / "fp8.sqlite", tmp_path / "fp8-2gpu-synthetic.sqlite")
    nvfp4 = two_ranks(NSYS2025_DIR / "nvfp4.sqlite", tmp_path / "nvfp4-2gpu-synthetic.sqlite")
    assert [r.device_id for r in fp8.info.ranks] == [0, 1]
    result = compare.diff(fp8, nvfp4, shipped_recipes)
    heads = headline.head_rows(result)
    singles = headline.head_rows(fi_h200_diff)
    assert [h.point for h in heads if h.question != headline.APPEND_PHASE] == \
        [f"{h.point} · 2 ranks agree" for h in singles if h.question != headline.APPEND_PHASE]
    for head, single in zip(heads, singles):
        assert head.row.ratio == pytest.approx(single.row.ratio, rel=1e-9)
        assert head.row.baseline.mean_ns == pytest.approx(single.row.baseline.mean_ns)
    for row in result.rank_rows:
        single = next(r for r in fi_h200_diff.segments + fi_h200_diff.phases
                      if (r.segment, r.phase) == (row.segment, row.phase))
        assert row.compared_calls == single.compared_calls and row.ratio == pytest.approx(single.ratio)


def test_synthetic_skewed_rank_is_shown_rank_by_rank(tmp_path, shipped_recipes, fi_h200_diff):
    """The candidate's second GPU 1.5× slower on every kernel: its ranks disagree, so the head has a row per rank,
    rank 0 the single GPU's numbers and rank 1 half as much again."""
    fp8 = two_ranks(NSYS2025_DIR / "fp8.sqlite", tmp_path / "fp8-2gpu-synthetic.sqlite")
    nvfp4 = two_ranks(NSYS2025_DIR / "nvfp4.sqlite", tmp_path / "nvfp4-2gpu-skewed-synthetic.sqlite", 1.5)
    result = compare.diff(fp8, nvfp4, shipped_recipes)
    heads = [h for h in headline.head_rows(result) if h.question == headline.PREFILL]
    single = [h for h in headline.head_rows(fi_h200_diff) if h.question == headline.PREFILL]
    assert [h.point for h in heads] == [f"{s.point} · rank {k}" for s in single for k in (0, 1)]
    for k, (rank0, rank1) in enumerate(zip(heads[::2], heads[1::2])):
        assert rank0.row.ratio == pytest.approx(single[k].row.ratio, rel=1e-9)
        assert rank1.row.ratio == pytest.approx(1.5 * single[k].row.ratio, rel=1e-3)


def test_arms_of_different_rank_counts_are_an_error(tmp_path, shipped_recipes):
    fp8 = two_ranks(NSYS2025_DIR / "fp8.sqlite", tmp_path / "fp8-2gpu-synthetic.sqlite")
    result = compare.diff(fp8, open_trace(NSYS2025_DIR / "nvfp4.sqlite"), shipped_recipes)
    errors = [f.message for f in result.findings if f.check == "ranks" and f.level == "error"]
    assert len(errors) == 1 and "on 2 GPU(s)" in errors[0] and "on 1" in errors[0]


GRID = re.compile(r"grid (\d+)×(\d+)×(\d+) block (\d+)×(\d+)×(\d+)")


@pytest.mark.parametrize("path", [BEFORE, AFTER], ids=["before", "after"])
def test_summary_gives_time_per_call_where_diff_pairs_calls(path, shipped_recipes, run_kvtrace):
    """Issue 49: a family whose calls differ only in rank or instance-numbered ranges (PyTorch's op_id and seq) has
    its time per call, as nsys stats counts it; one of several launch shapes has a row per shape. Each row's calls
    and time are those of its kernel names and launch shape in plain SQL (rows of one shape split by range name add
    up to the shape's)."""
    code, out, err = run_kvtrace("summary", path)
    assert code == 0, err
    assert out.count("mixed (") <= 5
    summary = compare.summarize(open_trace(path), shipped_recipes)
    assert all(row.stats.mean_ns is not None for row in summary.families)
    assert sum(row.launch is not None for row in summary.families) >= 10  # the elementwise kernels' tensor sizes
    parts: dict[tuple, list[int]] = {}
    for row in summary.families:
        assert row.stats.mean_ns == pytest.approx(row.stats.total_ns / row.stats.calls)
        found = parts.setdefault((row.family, row.launch, row.names), [0, 0])
        found[0] += row.stats.calls
        found[1] += row.stats.total_ns
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        for (_, launch, names), (calls, total) in parts.items():
            shape = GRID.fullmatch(launch).groups() if launch else ()
            where = " AND k.gridX = ? AND k.gridY = ? AND k.gridZ = ? AND k.blockX = ? AND k.blockY = ? AND k.blockZ = ?"
            expected = db.execute(f"""SELECT COUNT(*), SUM(k."end" - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k
                                      JOIN StringIds s ON s.id = k.demangledName
                                      WHERE s.value IN ({", ".join("?" * len(names))}){where if shape else ""}""",
                                  (*names, *map(int, shape))).fetchone()
            assert (calls, total) == expected, (names, launch)
