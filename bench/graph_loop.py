"""A workload of many small kernels for bench/export.py on a GPU machine: a CUDA graph of small kernels
replayed inside NVTX ranges, between cudaProfilerStart and cudaProfilerStop, as `kvtrace capture` records a
decode loop (capture.runner.profile_command: CUDA and NVTX tracing, --cuda-graph-trace=node, the
cudaProfilerApi capture range).

    python bench/graph_loop.py --record OUT_DIR --kernels 1000000 10000000     # nsys from $NSYS

records, per size, two reports (`a-N.nsys-rep`, `b-N.nsys-rep`: the same loop, b's multiply kernels on a
larger tensor, so another launch shape) for `python bench/export.py OUT_DIR/a-N.nsys-rep OUT_DIR/b-N.nsys-rep`.
Without --record it is the workload itself (run under nsys). Needs torch with CUDA.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

# Kernels per graph replay (one NVTX range, like one decode step), in a few distinct launch shapes.
PER_STEP = 250
STEP_NAMES = 8  # distinct range names, as a serving loop repeats a few step kinds


def workload(kernels: int, variant: str) -> None:
    import torch

    small = torch.zeros(4096, device="cuda")
    other = torch.zeros(64, 1024, device="cuda") if variant == "b" else small
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up outside the graph, as CUDA graph capture asks
        for _ in range(3):
            small.add_(1.0)
            other.mul_(1.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(PER_STEP):
            (small.add_ if i % 2 else other.mul_)(1.0)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for step in range(max(1, kernels // PER_STEP)):
        torch.cuda.nvtx.range_push(f"step_{step % STEP_NAMES}")
        graph.replay()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def record(out: Path, sizes: list[int]) -> None:
    from kvtrace.capture.runner import profile_command
    from kvtrace.nsys import find_nsys

    nsys = find_nsys()
    out.mkdir(parents=True, exist_ok=True)
    for size in sizes:
        for variant in ("a", "b"):
            report = out / f"{variant}-{size}"
            command = profile_command(nsys, report, [sys.executable, os.path.abspath(__file__),
                                                     "--kernels", str(size), "--variant", variant])
            print(f"recording {report}.nsys-rep …", file=sys.stderr, flush=True)
            subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, nargs="+", required=True)
    parser.add_argument("--variant", choices=("a", "b"), default="a")
    parser.add_argument("--record", type=Path, metavar="OUT_DIR", help="record reports under nsys into OUT_DIR")
    args = parser.parse_args(argv)
    if args.record:
        record(args.record, args.kernels)
    else:
        workload(args.kernels[0], args.variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
