"""Tensor-parallel vLLM captures: which ranks a run records, and the check after its export that each has kernels.

With `--tensor-parallel-size N` (after `--`), vLLM runs one worker process per GPU. Every rank is recorded in the
run's one report: the workers are spawned (VLLM_WORKER_MULTIPROC_METHOD=spawn, vllm_config.child_env), which
nsys follows under `--trace-fork-before-exec=true`; forked workers show no kernels (vllm#5132). Rank k is the
k-th device in deviceId order that ran kernels, as the analyzer pairs them (analyzer/load.RankInfo).

Standard library and kvtrace's floor (kvtrace/nsys.py).
"""

from __future__ import annotations

from pathlib import Path

from kvtrace.nsys import read_only

KERNEL_TABLE = "CUPTI_ACTIVITY_KIND_KERNEL"
RECORDED = ("one report for every rank: the workers are spawned (VLLM_WORKER_MULTIPROC_METHOD=spawn) under one "
            "nsys profile, which follows them (--trace-fork-before-exec=true)")


def settings(tensor_parallel_size: int) -> dict:
    """What the manifest says about the ranks before any run: how many, and how they are recorded."""
    return {"tensor_parallel_size": tensor_parallel_size, "recorded": RECORDED,
            "rank_order": "rank k = the k-th device, in deviceId order, that ran kernels (vLLM's worker k drives "
                          "the k-th visible GPU)"}


def recorded_ranks(export: Path, tensor_parallel_size: int) -> list[dict]:
    """Per device that ran kernels in the export, in deviceId order: its rank, device, kernels and processes.
    Raises RuntimeError (the run fails) naming the ranks without kernels."""
    with read_only(export) as db:
        present = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                             (KERNEL_TABLE,)).fetchone()
        rows = db.execute(f"""SELECT deviceId, count(*), group_concat(DISTINCT (globalPid >> 24) & 16777215)
                              FROM {KERNEL_TABLE} GROUP BY deviceId ORDER BY deviceId""").fetchall() if present else []
    ranks = [{"rank": rank, "device": device, "kernels": kernels,
              "processes": sorted(int(pid) for pid in str(pids or "").split(",") if pid)}
             for rank, (device, kernels, pids) in enumerate(rows)]
    if len(ranks) < tensor_parallel_size:
        missing = ", ".join(map(str, range(len(ranks), tensor_parallel_size)))
        devices = ", ".join(str(r["device"]) for r in ranks) or "none"
        raise RuntimeError(f"rank(s) {missing} of --tensor-parallel-size {tensor_parallel_size} recorded no kernels "
                           f"(devices with kernels: {devices}): were the workers forked rather than spawned "
                           "(VLLM_WORKER_MULTIPROC_METHOD=spawn, vllm#5132), or is an override of it inherited?")
    return ranks
