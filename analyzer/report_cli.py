"""`kvtrace report`, `kvtrace matrix` and `kvtrace capacity`: thin click commands over analyzer.report, analyzer.matrix
and analyzer.capacity."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from kvtrace import files, model_config
from kvtrace.analyzer import capacity as capacity_lib
from kvtrace.analyzer.cli import (FiniteRange, Whole, as_run, emit, inputs, interval_options, output_options, progress,
                                  run_files, target_options, use_cache, verify_option, window_options, write_parts)
from kvtrace.errors import KvtraceError
from kvtrace.manifest import read_manifest
from kvtrace.nsys import find_nsys


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--arm", "arms", multiple=True, metavar="NAME",
              help="Arm to report on, with all its runs (ARM.rK: one run of a --repeats capture). One run directory: "
                   "give it twice (baseline first). Two run directories: once for both, or twice for one each. "
                   "Default: a run's two arms, wider KV format first.")
@click.option("--label", "labels", multiple=True, help="Names for the two arms, baseline first (repeat twice).")
@interval_options(", for kernels and TTFT")
@click.option("--plots", "plots_dir", type=click.Path(path_type=Path),
              help="Write plots into this folder (created if missing); the markdown report links them.")
@click.option("--exports-from", "exports_from", multiple=True, metavar="DIR", type=click.Path(path_type=Path),
              help="A folder outside the run directories whose exports their manifests may list (by default a "
                   "manifest's exports must lie inside its run directory). Repeatable.")
@click.option("--plot-format", type=click.Choice(["png", "svg"]), default="png", show_default=True,
              help="Image format of --plots.")
@click.option("--upstream", type=click.Choice(["flashinfer", "vllm"]),
              help="Instead of the report, a draft issue for that project's tracker (its bug template's sections, "
                   "markdown): the finding the report holds (NVFP4's host sync per layer), with the repro script "
                   "inline and the counterfactual arm's numbers when the run directory has one.")
@verify_option
@window_options
@output_options
def report(runs, arms, labels, threshold, confidence, seed, plots_dir, exports_from, plot_format, upstream,
           verify_totals, window, fmt, output, recipe_files, nsys_path):
    """Kernel diff and serving metrics of two arms, side by side, from run directories.

    RUNS is one run directory written by `kvtrace capture` (its two arms are compared, e.g. FlashInfer's fp8
    and nvfp4), or two run directories, or RUNDIR/ARM paths naming arms. Beside the kernel diff it shows,
    from the manifests, TTFT with the cached prompt tokens next to it, ITL/TPOT, throughput, preemptions,
    peak running requests and KV usage, prefix-cache hit rate, capacity, and achieved KV bandwidth where
    the engine records bytes per call. It says when a TTFT gain is a prefix-hit/capacity effect rather than
    a faster prefill kernel. An arm recorded with --repeats N is compared run by run (r1 with r1, …), and
    the kernel intervals then include the between-run variance. Exit codes: 0 done, 2 bad input.
    """
    from kvtrace.analyzer import report as report_lib
    from kvtrace.analyzer.classify import load_recipes

    verify_with = find_nsys(nsys_path) if verify_totals else None
    with progress(f"loading and comparing {' '.join(map(str, runs))}"
                  + (", checking kernel totals with nsys stats" if verify_with else "")) as step:
        result = report_lib.build(list(runs), load_recipes(recipe_files), arms=tuple(arms), labels=tuple(labels),
                                  threshold=threshold, confidence=confidence, seed=seed, window=window,
                                  nsys=nsys_path, cache=use_cache(), verify_with=verify_with, step=step,
                                  exports_from=tuple(exports_from))
    result.diff.headline = result.diff.headline.with_command(as_run(result.run_dir))
    inputs().extend(Path(export) for arm in (result.baseline, result.candidate) for export in arm.runs)
    inputs().extend(file for arm in (result.baseline, result.candidate) for file in run_files(arm.run))
    inputs().extend(Path(arm.log) for arm in (result.baseline, result.candidate) if arm.log)
    inputs().extend(result.quality.read if result.quality else ())
    inputs().extend(Path(split.file) for split in result.repro)
    if upstream is not None:
        _draft(result, upstream, list(runs), load_recipes(recipe_files), output,
               dict(threshold=threshold, confidence=confidence, seed=seed, window=window, nsys=nsys_path,
                    cache=use_cache(), exports_from=tuple(exports_from)))
        return
    if plots_dir is not None:
        from kvtrace.analyzer.render import plots  # matplotlib only on this path

        to_file = output is not None and not files.is_stdout(output)
        written = plots.write_plots(result, plots_dir, plot_format, link_base=output.parent if to_file else None,
                                    inputs=inputs())
        result = dataclasses.replace(result, plots=written)
    emit(result, fmt, output)


def _draft(result, project: str, runs: list[Path], recipes, output: Path | None, options: dict) -> None:
    """`report --upstream`: the report's finding as a draft issue, to standard output or -o FILE."""
    from kvtrace.analyzer import report as report_lib, upstream as upstream_lib
    from kvtrace.analyzer.render import repro as repro_render, upstream as upstream_render

    def build_report(paths, arms):
        inputs().extend(file for path in paths for file in run_files(path))
        return report_lib.build(paths, recipes, arms=arms, **options)

    with progress("drafting the upstream issue"):
        finding = upstream_lib.host_sync(result, project, build_report, repro_render.script)
        text = upstream_render.host_sync_markdown(finding)
    if output is None or files.is_stdout(output):
        click.echo(text, nl=False)
    else:
        files.write(output, text, inputs())


@click.command()
@click.argument("run", required=False, type=click.Path(path_type=Path))
@click.option("--config", "config_path", type=click.Path(path_type=Path),
              help="Hugging Face config.json (or its model folder): full, sliding-window and MLA attention layers; "
                   "recurrent layers are left out, layouts it cannot size are refused.")
@click.option("--layers", type=Whole(1), help="num_hidden_layers (instead of, or over, --config).")
@click.option("--kv-heads", type=Whole(1), help="num_key_value_heads (instead of, or over, --config).")
@click.option("--head-dim", type=Whole(1), help="head_dim (instead of, or over, --config).")
@click.option("--tokens", type=Whole(1), help="Tokens per sequence to size the cache for.")
@click.option("--sequences", default=1, show_default=True, type=Whole(1),
              help="Sequences of --tokens each (each is padded to whole pages).")
@click.option("--tp", type=Whole(1), help="Tensor-parallel size: KV heads are split across GPUs.  [default: 1, "
                                                   "or the run's --tensor-parallel-size]")
@click.option("--page-size", type=Whole(1), help="Tokens per KV page.  [default: 16, or the run's block size]")
@click.option("--memory", "memory_gib", type=FiniteRange(0, capacity_lib.MAX_MEMORY_GIB, min_open=True),
              help="KV-cache memory per GPU in GiB: how many tokens fit (one sequence's, when layers are windowed).")
@click.option("--kv-format", "kv_formats", multiple=True, metavar="FORMAT",
              help="Format to size (fp8, nvfp4, bf16, fp16 or a vLLM --kv-cache-dtype), the first the reference. "
                   "Repeatable.  [default: fp8 and nvfp4 (MLA: bf16 and fp8), or the run's arms]")
@target_options
def capacity(run, config_path, layers, kv_heads, head_dim, tokens, sequences, tp, page_size, memory_gib, kv_formats,
             fmt, output):
    """KV-cache bytes per token per format, and how many tokens fit, from a model's shape.

    FP8 = 2·L·H·D bytes per token, NVFP4 = 2·L·H·(D/2 + D/16): ratio 0.5625, 1.78× the tokens. With
    --tp the KV heads are split across GPUs (replicated when there are fewer heads than GPUs). An MLA model
    (DeepSeek-V2/V3) caches one latent per layer on every GPU: FP8 = L·(kv_lora_rank + qk_rope_head_dim).
    Sliding-window layers hold at most their window, per layer group; Mamba and linear-attention layers are
    not counted; configs kvtrace cannot size are refused (exit 2). With a vLLM RUN directory, vLLM's own
    "GPU KV cache size: N tokens" per arm is set against the ideal.
    """
    # What capacity reads beside its arguments: the run's manifest and the model folder's config.json.
    if run is not None:
        inputs().extend(run_files(run) if run.is_dir() else [run])
    if config_path is not None:
        inputs().append(config_path / "config.json" if config_path.is_dir() else config_path)
    if output is not None:
        files.check_target(output, inputs())
    overrides = {k: v for k, v in {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}.items() if v is not None}
    layout = None
    if config_path is not None:
        layout = capacity_lib.load_config(config_path)
        if overrides:
            layout = capacity_lib.with_overrides(layout, f"{layout.source}, with {_flags(overrides)} from the command "
                                                 "line", **overrides)
    elif len(overrides) == 3:
        layout = model_config.plain(**overrides, source="the command line")
    elif overrides and run is None:
        missing = [f"--{name.replace('_', '-')}" for name in ("layers", "kv_heads", "head_dim") if name not in overrides]
        raise KvtraceError(f"give {', '.join(missing)} too, or --config with the model's config.json")
    if run is not None:
        if layout is None and overrides:
            manifest_layout = capacity_lib.run_shape(read_manifest(run), str(run))[0]
            layout = capacity_lib.with_overrides(manifest_layout, f"{manifest_layout.source}, with {_flags(overrides)} "
                                                 "from the command line", **overrides)
        result = capacity_lib.from_run(run, layout=layout, tp=tp, page_size=page_size, tokens=tokens,
                                       sequences=sequences, memory_gib=memory_gib, kv_formats=list(kv_formats) or None)
    else:
        if layout is None:
            raise KvtraceError("give the model's shape: --config path/to/config.json, or --layers, --kv-heads and "
                               "--head-dim, or a vLLM run directory")
        names, left_out = (list(kv_formats), []) if kv_formats else capacity_lib.default_formats(layout)
        result = capacity_lib.capacity(layout, [(name, name) for name in names], tp=tp or 1, page_size=page_size or 16,
                                       tokens=tokens, sequences=sequences, memory_gib=memory_gib)
        result.notes += left_out
    emit(result, fmt, output)


def _flags(overrides: dict) -> str:
    return ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in overrides.items())


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--objective", type=click.Choice(["ttft", "itl", "throughput"]), default="ttft", show_default=True,
              help="What decides a traffic point: TTFT, ITL (inter-token latency) or throughput (output tokens/s).")
@interval_options(", for kernels and the objective")
@click.option("--plots", "plots_dir", type=click.Path(path_type=Path),
              help="Write the TTFT budget of every point (budget.png: stacked bars per arm) and each sweep's crossover "
                   "plot into this folder (created if missing); the markdown links them.")
@click.option("--plot-format", type=click.Choice(["png", "svg"]), default="png", show_default=True,
              help="Image format of --plots.")
@output_options
def matrix(runs, objective, threshold, confidence, seed, plots_dir, plot_format, fmt, output, recipe_files, nsys_path):
    """One decision over a matrix of scenarios: phase by phase, traffic point by traffic point.

    RUNS are the run directories of several scenarios (`kvtrace capture` for each: cold prefill, decode-heavy,
    prefix reuse, a sweep), or folders holding them. A run directory with two arms is one scenario; run
    directories of one arm each pair by engine, mode and scenario. Each scenario is reported as `kvtrace
    report` would; per traffic point the matrix sets TTFT beside the cached prompt tokens, ITL and throughput,
    each with candidate / baseline and its interval over every run, says which arm wins the point on --objective
    (only on three run pairs or more, and only where its interval excludes no change and the ratio is beyond the threshold;
    fewer run pairs say what was measured and that `--repeats 3` would decide it) and what wins it (a faster kernel, more prefix hits, a capacity effect; "not explained" otherwise), where a
    sweep's crossover lies, and states what the kernel rows measured and the decision with the rows it rests on.
    A point measured in several run directories with disagreeing results is not decided; with agreeing ones, it
    is decided once on all their run pairs pooled. The markdown fits a GitHub issue: if it would not, -o FILE.md
    writes the kernel rows and the rest into FILE.details.md (in parts of an issue body each, FILE.details-2.md and on,
    where it is longer). Exit codes: 0 done, 2 bad input.
    """
    from kvtrace.analyzer import matrix as matrix_lib
    from kvtrace.analyzer.classify import load_recipes

    with progress(f"reporting on every scenario of {' '.join(map(str, runs))}"):
        result = matrix_lib.build(list(runs), load_recipes(recipe_files), objective=objective, threshold=threshold,
                                  confidence=confidence, seed=seed, nsys=nsys_path, cache=use_cache())
    for scenario in result.scenarios:
        arms = (scenario.report.baseline, scenario.report.candidate)
        inputs().extend(Path(export) for arm in arms for export in arm.runs)
        inputs().extend(file for arm in arms for file in run_files(arm.run))
        inputs().extend(Path(arm.log) for arm in arms if arm.log)
        inputs().extend(scenario.report.quality.read if scenario.report.quality else ())
    if plots_dir is not None:
        from kvtrace.analyzer.render import budget_plot, plots  # matplotlib only on this path

        to_file = output is not None and not files.is_stdout(output)
        where = {"link_base": output.parent if to_file else None, "inputs": inputs()}
        result.plots = (budget_plot.write_budget_plot(result, plots_dir, plot_format, **where)
                        + plots.write_matrix_plots(result, plots_dir, plot_format, **where))
    if fmt == "markdown" and output is not None and not files.is_stdout(output):
        from kvtrace.analyzer.render import matrix as matrix_render

        head, rest = matrix_render.markdown_parts(result)
        if len(head) + len(rest) > matrix_render.ISSUE_CHARS:  # the rest beside it, so that the file fits an issue
            result.rest_file = write_parts(output.with_name(f"{output.stem}.details.md"), rest)[0].name
    emit(result, fmt, output)
