"""One arm of the vLLM offline capture, run as its own process under nsys:

    python -m kvtrace.capture.vllm_offline_workload --scenario S --seed N --point SPEC ... --result R \
        -- <vLLM engine flags>

The engine flags are the ones `vllm serve` would get, parsed by vLLM's own parser into EngineArgs, so the
offline and serving modes and both arms share one flag list. Prompts are token ids drawn from the seed, so
no tokenizer is needed. A warm-up generate of the same shapes (other tokens) runs before
llm.start_profile(), which opens the nsys capture range (profiler "cuda"), so that JIT compilation,
autotuning and CUDA-graph capture stay out of the trace. With --traced-pass-steps the range holds a traced pass of
the first point instead and closes before the timed points (closing it holds the engine seconds). Offline vLLM has
no per-request TTFT/ITL; the result records wall time, token counts, cached prompt tokens and vLLM's own metric
counters.

Imports nothing heavy at module level, so that the engine and the tests can use its pure functions.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from importlib import metadata
from pathlib import Path

from kvtrace.capture import runner
from kvtrace.capture.vllm_common import add_sample, build_prompts, empty_snapshot, metric_deltas, request_order_sha256
from kvtrace.capture.vllm_traced_pass import traced_point
from kvtrace.manifest import Point, capacity_reason, point_range_name


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Own options before `--`, vLLM engine flags after it."""
    if "--" not in argv:
        raise SystemExit("vllm_offline_workload: put the vLLM engine flags after `--`")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="vllm_offline_workload", description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--point", type=Point.parse, action="append", required=True, dest="points",
                        help="traffic shape, e.g. input=1024,output=1,prompts=32,concurrency=16")
    parser.add_argument("--stop-at-capacity", action="store_true",
                        help="sweep: skip the rest of a context length once a point is capacity-bound")
    parser.add_argument("--traced-pass-steps", type=int, default=0,
                        help="trace a traced pass of the first point (capture/vllm_traced_pass) instead of the timed "
                             "points, in a window of this many engine steps")
    parser.add_argument("--result", type=Path, required=True)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def warmup_points(points: list[Point]) -> list[Point]:
    """One warm-up per prompt length, at its smallest concurrency: kernels compile per variant, not per batch."""
    chosen: dict[tuple[int, int], Point] = {}
    for point in points:
        key = (point.prefix_len, point.input_len)
        if key not in chosen or point.concurrency < chosen[key].concurrency:
            chosen[key] = point
    return list(chosen.values())


def snapshot(llm) -> dict | None:
    """vLLM's metrics through LLM.get_metrics(), in the same shape as a /metrics scrape."""
    try:
        metrics = llm.get_metrics()
    except AssertionError:  # engine started with --disable-log-stats
        return None
    result = empty_snapshot()
    for metric in metrics:
        kind = type(metric).__name__
        if kind == "Counter":
            add_sample(result, "counter", metric.name + "_total", metric.labels, metric.value)
        elif kind == "Gauge":
            add_sample(result, "gauge", metric.name, metric.labels, metric.value)
        elif kind == "Histogram":
            add_sample(result, "histogram_count", metric.name, metric.labels, metric.count)
            add_sample(result, "histogram_sum", metric.name, metric.labels, metric.sum)
    return result


@contextlib.contextmanager
def nvtx_range(name: str):
    """Names a measured window in the trace (the analyzer can window on it)."""
    import torch

    try:
        torch.cuda.nvtx.range_push(name)
        pushed = True
    except RuntimeError:  # a CPU-only torch has no NVTX, and there is nothing to trace
        pushed = False
    try:
        yield
    finally:
        if pushed:
            torch.cuda.nvtx.range_pop()


def _versions() -> dict:
    import torch
    import vllm

    try:
        flashinfer = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        flashinfer = None
    return {"vllm": vllm.__version__, "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
            "flashinfer": flashinfer}


def _engine_args(flags: list[str]):
    from vllm.engine.arg_utils import EngineArgs
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before the utils split
        from vllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm (kvtrace offline)"))
    return EngineArgs.from_cli_args(parser.parse_args(flags))


def run(args: argparse.Namespace, engine_flags: list[str]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_args = _engine_args(engine_flags)
    started = time.monotonic()
    llm = LLM.from_engine_args(engine_args)
    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    kv_tokens = cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    result = {
        "scenario": args.scenario,
        "kv_cache_dtype": cache.cache_dtype,
        "versions": _versions(),
        "engine": {
            "kv_cache_dtype": cache.cache_dtype, "block_size": cache.block_size,
            "num_gpu_blocks": cache.num_gpu_blocks, "kv_cache_tokens": kv_tokens,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "max_model_len": config.model_config.max_model_len,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        },
        "seed": args.seed,
        "vocab_size": vocab_size,
        "startup_s": round(time.monotonic() - started, 2),
        "points": [],
    }

    def sampling(point: Point):
        return SamplingParams(max_tokens=point.output_len, ignore_eos=True, detokenize=False, temperature=0.0)

    def generate(point: Point, purpose: str):
        prompts = build_prompts(point, args.seed, vocab_size, purpose)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling(point),
                               use_tqdm=False)
        return prompts, outputs

    started = time.monotonic()
    for point in warmup_points(args.points):
        generate(point, "warmup")
    if cache.enable_prefix_caching:
        llm.reset_prefix_cache()
    result["warmup_s"] = round(time.monotonic() - started, 2)

    traced = None
    if args.traced_pass_steps:
        # A window of that many steps would close inside the first timed point and stall it: it traces a traced pass
        # of that point, named as the point so that the analyzer reads it as the point's, and closes first.
        point = traced_point(args.points[0], args.traced_pass_steps)
        llm.start_profile()
        try:
            with nvtx_range(point_range_name(args.scenario, args.points[0])):
                tick = time.perf_counter()
                _, outputs = generate(point, "traced")
                traced = {"point": point.spec(), "requests": len(outputs),
                          "completion_tokens": sum(len(output.outputs[0].token_ids) for output in outputs),
                          "seconds": round(time.perf_counter() - tick, 2)}
        finally:
            llm.stop_profile()
        if cache.enable_prefix_caching:
            llm.reset_prefix_cache()
    capped: set[tuple[int, int]] = set()
    if traced is None:
        llm.start_profile()
    try:
        for index, point in enumerate(args.points):
            if (point.prefix_len, point.input_len) in capped:
                continue
            before = snapshot(llm)
            with nvtx_range(point_range_name(args.scenario, point)):
                tick = time.perf_counter()
                prompts, outputs = generate(point, "measure")
                elapsed = time.perf_counter() - tick
            after = snapshot(llm)
            cached = [output.num_cached_tokens or 0 for output in outputs]
            record = {
                "index": index, "point": point.spec(), "elapsed_s": round(elapsed, 6),
                "requests": len(outputs),
                "tokens_in": sum(len(output.prompt_token_ids) for output in outputs),
                "tokens_out": sum(len(output.outputs[0].token_ids) for output in outputs),
                "cached_tokens": sum(cached), "cached_tokens_per_request": cached,
                "request_order_sha256": request_order_sha256([prompts, point.output_len]),
                "metrics_before": before, "metrics_after": after, "capacity": None,
            }
            if args.stop_at_capacity and before is not None and after is not None:
                record["capacity"] = capacity_reason(point, metric_deltas(before, after), None, kv_tokens)
                if record["capacity"]:
                    capped.add((point.prefix_len, point.input_len))
            result["points"].append(record)
    finally:
        if traced is None:
            llm.stop_profile()
    if traced is not None and result["points"]:
        result["points"][0]["traced_pass"] = traced
    result["request_order_sha256"] = request_order_sha256([p["request_order_sha256"] for p in result["points"]])
    return result


def main(argv: list[str] | None = None) -> None:
    args, engine_flags = parse_args(sys.argv[1:] if argv is None else argv)
    runner.write_json_atomic(args.result, run(args, engine_flags))


if __name__ == "__main__":
    main()
