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

# Kernels per graph replay (one NVTX range, like one decode step), in a few distinct launch shapes. At 10M kernels
# in 250-kernel replays (40,000 replays) the H200's driver failed twice (Xid 69, a segfault in libcuda) while 4,000
# replays at 1M ran through: --per-step raises the graph's size instead of the replay count.
PER_STEP = 250
STEP_NAMES = 8  # distinct range names, as a serving loop repeats a few step kinds


def workload(kernels: int, variant: str, per_step: int, eager: bool) -> None:
    import torch

    small = torch.zeros(4096, device="cuda")
    other = torch.zeros(64, 1024, device="cuda") if variant == "b" else small
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up outside the graph, as CUDA graph capture asks
        for _ in range(3):
            small.add_(1.0)
            other.mul_(1.0)
    torch.cuda.synchronize()

    def step_kernels():
        for i in range(per_step):
            (small.add_ if i % 2 else other.mul_)(1.0)

    if not eager:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step_kernels()
        torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for step in range(max(1, kernels // per_step)):
        torch.cuda.nvtx.range_push(f"step_{step % STEP_NAMES}")
        step_kernels() if eager else graph.replay()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def record(out: Path, sizes: list[int], per_step: int, at_once: bool, eager: bool) -> None:
    """Both variants of each size, one after the other or both at once: nsys' import of a 10M-kernel capture
    takes minutes on one core, and two imports side by side halve the wait."""
    from kvtrace.capture.runner import profile_command
    from kvtrace.nsys import find_nsys

    nsys = find_nsys()
    out.mkdir(parents=True, exist_ok=True)
    for size in sizes:
        running = []
        for variant in ("a", "b"):
            report = out / f"{variant}-{size}"
            command = profile_command(nsys, report, [sys.executable, os.path.abspath(__file__), "--kernels", str(size),
                                                     "--variant", variant, "--per-step", str(per_step),
                                                     *(["--eager"] if eager else [])])
            print(f"recording {report}.nsys-rep …", file=sys.stderr, flush=True)
            running.append(subprocess.Popen(command))
            if not at_once:
                running[-1].wait()
        failed = [process.args for process in running if process.wait() != 0]
        if failed:
            raise SystemExit(f"recording failed: {failed}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, nargs="+", required=True)
    parser.add_argument("--variant", choices=("a", "b"), default="a")
    parser.add_argument("--per-step", type=int, default=PER_STEP, help="kernels per graph replay (NVTX range)")
    parser.add_argument("--record", type=Path, metavar="OUT_DIR", help="record reports under nsys into OUT_DIR")
    parser.add_argument("--at-once", action="store_true", help="record a size's two reports side by side")
    parser.add_argument("--eager", action="store_true",
                        help="launch each kernel from Python instead of replaying a CUDA graph (at 10M kernels "
                             "graph replays under --cuda-graph-trace=node failed on the H200: Xid 69, Xid 13)")
    args = parser.parse_args(argv)
    if args.record:
        record(args.record, args.kernels, args.per_step, args.at_once, args.eager)
    else:
        workload(args.kernels[0], args.variant, args.per_step, args.eager)
    return 0


if __name__ == "__main__":
    sys.exit(main())
