"""A `vllm bench serve` started ahead of its turn: it imports vLLM's benchmark modules (about 20 s on the H200
box, most of a point's wall time when each point started its own client), then waits for one line on stdin.
"go" runs the client as `python -m vllm.entrypoints.cli.main ...` would; anything else, or the end of stdin,
exits without sending a request. Its timing starts after the gate, in the client's own code, as before.

    python -m kvtrace.capture.vllm_gated_client [--preload MODULE ...] -- MODULE ARG ...

Standard library only; vLLM is imported by name, never by kvtrace.
"""

from __future__ import annotations

import importlib
import runpy
import sys

# What `vllm bench serve` imports before it sends anything: vLLM 0.33's CLI main() imports every subcommand's
# module, then the benchmark's own. --preload replaces the list.
PRELOAD = tuple(f"vllm.entrypoints.cli.{name}" for name in (
    "main", "benchmark.main", "collect_env", "download_kernels", "launch", "openai", "preload", "run_batch", "serve",
    "snapshot")) + ("vllm.benchmarks.serve", "vllm.benchmarks.datasets")


def main(argv: list[str]) -> int:
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    preload = [options[i + 1] for i, option in enumerate(options) if option == "--preload"] or PRELOAD
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as error:  # a vLLM without that module: the client imports what it needs after the gate
            print(f"kvtrace: not preloaded: {name} ({type(error).__name__}: {error})", flush=True)
    print("kvtrace: client ready, waiting for its turn", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 0
    sys.argv = command
    runpy.run_module(command[0], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
