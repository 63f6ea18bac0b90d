"""`kvtrace capture ...`: click layer over the capture engines. Imports nothing from the analyzer."""

from __future__ import annotations

import math
from pathlib import Path

import click

from kvtrace.errors import KvtraceError
from kvtrace.manifest import (DECIDING_RUN_PAIRS, MANIFEST, CaptureStatus, Manifest, RunStatus, WindowStatus,
                              read_manifest)


def _int_list(ctx, param, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise KvtraceError(f"--{param.name} takes comma-separated integers, e.g. 2048,8192; got {value!r}") from None


def _name_list(ctx, param, value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _seconds(ctx, param, value: float) -> float:
    """A wait in seconds: NaN passes every comparison and would never time out, infinity never ends."""
    if not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"{value} is not a finite number of seconds above 0", ctx, param)
    return value


def _written(manifest: dict, out: Path) -> Manifest:
    """The typed view of the manifest a capture just wrote into `out`."""
    return Manifest.of(manifest, out / MANIFEST)


# Each repeat is a GPU run of minutes: past this a count is a slip, and listing its runs would never end.
MAX_REPEATS = 1000


def _repeats(ctx, param, value: int | None) -> int | None:
    """At most MAX_REPEATS, before any run is listed (below 1 the capture's own check says so)."""
    if value is not None and value > MAX_REPEATS:
        raise KvtraceError(f"--repeats {value} is more than the {MAX_REPEATS:,} runs per arm kvtrace records: "
                           "give fewer")
    return value


# A served capture records as many repeats as decide a serving point; an offline kernel comparison pairs calls within
# one run.
SERVE_REPEATS = DECIDING_RUN_PAIRS
REPEATS_HELP = ("Record each arm N times, arms interleaved (A B A B ...) so that drift over time is not "
                "confounded with the arm; runs are named ARM.rK when N > 1.")


# Set here too, not only on the top-level group: click caches each command's help option on first use, and
# the group may be invoked on its own (tests, embedding).
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def capture() -> None:
    """Record matched FP8 / NVFP4 runs under Nsight Systems."""


@capture.command("flashinfer")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Run directory to create.")
@click.option("--context", default="2048,8192,32768", show_default=True, callback=_int_list,
              help="Cached tokens per sequence, comma-separated.")
@click.option("--batch", default=8, show_default=True, help="Sequences per call.")
@click.option("--q-heads", default=64, show_default=True, help="Query heads.")
@click.option("--kv-heads", default=8, show_default=True, help="KV heads (GQA when fewer than query heads).")
@click.option("--head-dim", default=128, show_default=True, help="Head dimension (a multiple of 16).")
@click.option("--page-size", default=16, show_default=True, help="Tokens per KV page.")
@click.option("--prefill-calls", default=8, show_default=True, help="Measured prefill calls per context.")
@click.option("--decode-calls", default=64, show_default=True, help="Measured decode calls per context.")
@click.option("--append-calls", default=64, show_default=True, help="Measured append calls per context.")
@click.option("--gemm-calls", default=16, show_default=True, help="Control GEMM calls per context.")
@click.option("--seed", default=0, show_default=True, help="Seed of the BF16 source tensors (same in both arms).")
@click.option("--inputs", default="gaussian", show_default=True, metavar="SOURCE",
              help="Q/K/V of the workload: gaussian (the seeded generator); outliers (the same with 4 channels per KV "
                   "head scaled 16x in K and V, as real models' keys carry them); or a .safetensors file with tensors "
                   "q [tokens, q_heads, head_dim], k and v [tokens, kv_heads, head_dim] dumped from a model (keys "
                   "after RoPE). Each format's attention error against a float64 reference is recorded per context.")
@click.option("--arms", default="fp8,nvfp4", show_default=True, callback=_name_list, help="Formats to record, comma-separated.")
@click.option("--repeats", default=1, show_default=True, callback=_repeats, help=REPEATS_HELP)
@click.option("--nsys", "nsys_path", default=None, help="nsys binary (default: $NSYS, PATH, known installs).")
@click.option("--force", is_flag=True, help="Replace an existing run directory.")
def flashinfer(out, context, batch, q_heads, kv_heads, head_dim, page_size, prefill_calls, decode_calls,
               append_calls, gemm_calls, seed, inputs, arms, repeats, nsys_path, force) -> None:
    """Kernel-level A/B: the same cached tokens stored as FP8 and as NVFP4, one trace per format.

    Needs an SM80+ GPU, torch, FlashInfer and nsys. Writes ARM.nsys-rep, ARM.sqlite, ARM.log and
    ARM.workload.json per arm (ARM.rK.* per arm and repeat with --repeats) and manifest.json for the run.
    Per context, ARM.workload.json also records the format's error: its attention output (prefill and decode)
    and its cache round trip against a float64 reference over the BF16 cache (relative L2, cosine, max abs).
    """
    from kvtrace.capture import flashinfer_engine

    spec = flashinfer_engine.FlashInferSpec(
        contexts=context, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
        prefill_calls=prefill_calls, decode_calls=decode_calls, append_calls=append_calls, gemm_calls=gemm_calls,
        seed=seed, inputs=inputs)
    manifest = _written(flashinfer_engine.capture(out, spec, arms=arms, repeats=repeats, force=force, nsys=nsys_path),
                        out)
    for run in manifest.runs.values():
        click.echo(f"{run.name}: {run.status}" + (f" ({run.error})" if run.error else f" -> {out / run.sqlite}"))
    if any(run.status != RunStatus.OK for run in manifest.runs.values()):
        raise SystemExit(1)


def _optional_int_list(ctx, param, value: str | None) -> tuple[int, ...] | None:
    return None if value is None else _int_list(ctx, param, value)


@capture.command("vllm")
@click.option("--model", required=True, help="Model directory (with config.json) or Hugging Face model id.")
@click.option("--scenario", type=click.Choice(["cold-prefill", "decode-heavy", "prefix-reuse", "sweep"]),
              default="cold-prefill", show_default=True,
              help="Traffic shape: cold prefill (1 output token, no prefix cache), decode-heavy, shared-prefix "
                   "reuse, or a context x concurrency sweep up to the first arm's capacity.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Run directory to create.  [default: runs/vllm-SCENARIO]")
@click.option("--arms", default="fp8,nvfp4", show_default=True, callback=_name_list,
              help="vLLM --kv-cache-dtype values, one run each.")
@click.option("--mode", type=click.Choice(["serve", "offline"]), default="serve", show_default=True,
              help="serve: vllm serve + vllm bench serve; offline: vLLM's LLM class, token-id prompts.")
@click.option("--input-len", type=int, default=None, help="Prompt tokens (prefix-reuse: after the shared prefix).")
@click.option("--output-len", type=int, default=None, help="Generated tokens per request (EOS ignored).")
@click.option("--num-prompts", type=int, default=None, help="Requests (sweep: per point).")
@click.option("--concurrency", type=int, default=None, help="Requests in flight.")
@click.option("--prefix-len", type=int, default=None, help="prefix-reuse: shared prefix tokens.")
@click.option("--num-prefixes", type=int, default=None, help="prefix-reuse: distinct shared prefixes.")
@click.option("--trace-file", type=click.Path(), default=None,
              help="prefix-reuse, serve: replay this timed_trace JSONL instead of prefix_repetition.")
@click.option("--contexts", default=None, callback=_optional_int_list, help="sweep: prompt lengths, e.g. 1024,4096.")
@click.option("--concurrencies", default=None, callback=_optional_int_list, help="sweep: concurrencies, e.g. 8,32,128.")
@click.option("--points-from", type=click.Path(), default=None,
              help="sweep: run exactly the points an earlier sweep run directory ran (its first finished run), so "
                   "that arms recorded one at a time cover the same grid.")
@click.option("--seed", default=0, show_default=True, help="Seed of the prompts and of vLLM's sampling.")
@click.option("--load-format", type=click.Choice(["auto", "dummy"]), default="auto", show_default=True,
              help="dummy: random weights from config.json alone (no download).")
@click.option("--quality-prompts", type=click.Path(), default=None,
              help="serve: after each arm's measured traffic, send these prompts (JSONL, one {\"prompt\", "
                   "\"answer\"} per line, e.g. GSM8K's test split) greedily with logprobs and record each answer and "
                   "whether it matches; `kvtrace report` pairs the arms prompt by prompt.")
@click.option("--quality-max-tokens", default=256, show_default=True, help="serve: tokens generated per quality prompt.")
@click.option("--host", default="127.0.0.1", show_default=True, help="serve: address the server binds.")
@click.option("--port", default=8000, show_default=True, help="serve: port the server binds.")
@click.option("--startup-timeout", default=1800.0, show_default=True, callback=_seconds,
              help="serve: seconds to wait for /health.")
@click.option("--repeats", type=int, default=None, callback=_repeats,
              help=REPEATS_HELP + f" [default: {SERVE_REPEATS} in serve mode, enough run pairs to decide a serving "
                   "point; 1 offline]")
@click.option("--profile-steps", default=0, show_default=True,
              help="Trace N engine steps of a traced pass of the first point, sent before the timed traffic, "
                   "instead of the timed traffic itself (0: trace all of it). Keeps long serve runs' traces small; "
                   "closing a window holds the engine seconds, so a bounded one never closes inside timed traffic.")
@click.option("--nsys", "nsys_path", default=None, help="nsys binary (default: $NSYS, PATH, known installs).")
@click.option("--dry-run", is_flag=True, help="Print every arm's commands and exit; needs no GPU, vLLM or nsys.")
@click.option("--force", is_flag=True, help="Replace an existing run directory.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def vllm(model, scenario, out, arms, mode, input_len, output_len, num_prompts, concurrency, prefix_len, num_prefixes,
         trace_file, contexts, concurrencies, points_from, seed, load_format, quality_prompts, quality_max_tokens, host,
         port, startup_timeout, repeats, profile_steps, nsys_path, dry_run, force, vllm_args) -> None:
    """Matched vLLM runs that differ only in --kv-cache-dtype, each traced by Nsight Systems.

    Extra vLLM engine flags go after `--`, e.g. `-- --max-model-len 8192 --kv-cache-memory-bytes 20G`;
    both arms get them. nvfp4 needs vLLM 0.33 or newer on SM80, SM90 or SM120 (FlashInfer FA2 kernels), or
    older vLLM on Blackwell (SM100); the preflight asks vLLM before recording. Writes, per
    arm (per arm and repeat, named ARM.rK, with --repeats), ARM.nsys-rep, ARM.sqlite, ARM.log,
    ARM.manifest.json and (serve) bench results and /metrics scrapes or (offline) ARM.workload.json, plus
    manifest.json for the run.
    """
    from kvtrace.capture import vllm_commands, vllm_config, vllm_engine

    repeats = repeats if repeats is not None else SERVE_REPEATS if mode == "serve" else 1
    followed, followed_from = vllm_config.followed_points(points_from, mode) if points_from else (None, None)
    workload = vllm_config.Workload.for_scenario(
        scenario, input_len=input_len, output_len=output_len, num_prompts=num_prompts, concurrency=concurrency,
        prefix_len=prefix_len, num_prefixes=num_prefixes, trace_file=trace_file, contexts=contexts,
        concurrencies=concurrencies, followed=followed, followed_from=followed_from, seed=seed)
    cfg = vllm_config.VllmCapture(model=model, workload=workload, arms=arms, mode=mode, load_format=load_format,
                                  host=host, port=port, extra_args=tuple(vllm_args), repeats=repeats,
                                  profile_steps=profile_steps, quality_prompts=quality_prompts,
                                  quality_max_tokens=quality_max_tokens)
    out = out or Path("runs") / f"vllm-{scenario}"
    if dry_run:
        click.echo(vllm_commands.dry_run(cfg, out, nsys=nsys_path), nl=False)
        return
    manifest = _written(vllm_engine.capture(cfg, out, force=force, nsys=nsys_path, startup_timeout_s=startup_timeout),
                        out)
    for run in manifest.runs.values():
        if run.status != RunStatus.OK:
            click.echo(f"{run.name}: {run.status} ({run.error})")
            continue
        kv = f", GPU KV cache {run.kv_cache_tokens:,} tokens" if run.kv_cache else ""
        click.echo(f"{run.name}: ok -> {out / run.sqlite}{kv}")
    if manifest.status != CaptureStatus.OK:
        raise SystemExit(1)


@capture.command("vllm-matrix")
@click.option("--model", required=True, help="Model directory (with config.json) or Hugging Face model id.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Matrix root to create: one run directory per scenario, servers/ and matrix.json.")
@click.option("--arms", default="fp8,nvfp4", show_default=True, callback=_name_list,
              help="vLLM --kv-cache-dtype values, one server each; KVDTYPE:PATCH adds a counterfactual arm with a "
                   "patch from capture/patches (e.g. nvfp4:validate-once), recorded at cold prefill and the sweep's "
                   "concurrencies 4 and 8 only.")
@click.option("--repeats", default=SERVE_REPEATS, show_default=True, callback=_repeats,
              help="Interleaved rounds (A B A B ...) of every scenario.")
@click.option("--concurrencies", default="4,8,12,16", show_default=True, callback=_int_list,
              help="The sweep's concurrencies (context 2,048 + 128 out); reach past the narrowest format's capacity.")
@click.option("--sweep-prompts", default=32, show_default=True, help="Requests per sweep point.")
@click.option("--load-format", type=click.Choice(["auto", "dummy"]), default="auto", show_default=True,
              help="dummy: random weights from config.json alone (no download).")
@click.option("--seed", default=0, show_default=True, help="Seed of the prompts and of vLLM's sampling.")
@click.option("--port", default=8000, show_default=True, help="First server's port; each next arm's is 10 higher.")
@click.option("--one-at-a-time", is_flag=True,
              help="Run the arms' servers one after another instead of all at once on the GPU.")
@click.option("--memory-fraction", default=0.25, show_default=True,
              help="Each co-resident server's --gpu-memory-utilization: vLLM 0.33 refuses to start when free memory "
                   "is below this fraction of the GPU's, which the default 0.9 fails beside another server.")
@click.option("--no-co-residence-check", is_flag=True,
              help="Skip the closing re-run of one point on the first arm with the other servers shut down.")
@click.option("--export-workers", default=8, show_default=True, help="nsys exports run at the end, this many at once.")
@click.option("--startup-timeout", default=1800.0, show_default=True, help="Seconds to wait for the servers' /health.")
@click.option("--nsys", "nsys_path", default=None, help="nsys binary (default: $NSYS, PATH, known installs).")
@click.option("--dry-run", is_flag=True, help="Print the whole plan with its estimated time and exit.")
@click.option("--force", is_flag=True, help="Replace an existing matrix root.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def vllm_matrix(model, out, arms, repeats, concurrencies, sweep_prompts, load_format, seed, port, one_at_a_time,
                memory_fraction, no_co_residence_check, export_workers, startup_timeout, nsys_path, dry_run, force,
                vllm_args) -> None:
    """The whole capacity matrix (cold prefill, prefix reuse, preemption, the sweep) against one long-lived server
    per arm, arms interleaved by round, a bounded profile window in every point's traffic.

    Extra vLLM engine flags go after `--` (every server gets them). Writes OUT/SCENARIO/ run directories that
    `kvtrace report` and `kvtrace matrix` read (ARM.rK.pN.sqlite per point), OUT/servers/ARM/ (server log, nsys
    reports, KV events) and OUT/matrix.json (every phase's wall time).
    """
    from kvtrace.capture import vllm_matrix, vllm_matrix_run
    from kvtrace.capture.vllm_patches import ArmSpec

    cfg = vllm_matrix.MatrixConfig(
        model=model, arms=tuple(ArmSpec.parse(arm) for arm in arms),
        scenarios=tuple(vllm_matrix.capacity_scenarios(concurrencies, sweep_prompts)), repeats=repeats,
        load_format=load_format, port=port, extra_args=tuple(vllm_args), seed=seed, co_resident=not one_at_a_time,
        memory_fraction=memory_fraction, co_residence_check=not no_co_residence_check, export_workers=export_workers)
    if dry_run:
        click.echo(vllm_matrix.dry_run(cfg, out, nsys=nsys_path), nl=False)
        return
    matrix = vllm_matrix_run.capture(cfg, out, force=force, nsys=nsys_path, startup_timeout_s=startup_timeout)
    failed = []
    for run_dir in matrix.run_dirs:
        for run in read_manifest(out / run_dir).runs.values():
            traced = sum(1 for w in run.windows if w.status == WindowStatus.EXPORTED)
            click.echo(f"{run_dir}/{run.name}: {run.status}, {traced}/{len(run.windows)} windows traced"
                       + (f" ({run.error})" if run.error else ""))
            failed += [run.name] if run.status != RunStatus.OK else []
    click.echo(f"matrix: {matrix.seconds:.0f} s in all; co-resident: {matrix.co_resident}"
               + (f"; stopped early: {matrix.error}" if matrix.error else ""))
    if failed or matrix.error:
        raise SystemExit(1)


@capture.command("import")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--nsys", "nsys_path", default=None, help="nsys binary (default: $NSYS, PATH, known installs).")
def import_(run_dir, nsys_path) -> None:
    """Take up the runs of RUN_DIR whose workload finished but whose report import or export failed.

    Per such run: adopts ARM.sqlite when it was exported by hand (after checking that it is a complete nsys
    export), else exports ARM.nsys-rep, else imports ARM.qdstrm with the QdstrmImporter of the nsys install and
    exports the report. The manifests then mark the run ok and keep its original status and error, what was
    done and the export's SHA-256 under "import". Runs that failed otherwise are left as they are.
    """
    from kvtrace.capture import import_run

    outcome = import_run.import_run(run_dir, nsys=nsys_path)
    if not outcome:
        click.echo(f"{run_dir}: no run failed on its report import or export; nothing to do")
        return
    for name, problem in outcome.items():
        click.echo(f"{name}: " + (f"not imported ({problem})" if problem else f"ok -> {run_dir / (name + '.sqlite')}"))
    if any(outcome.values()):
        raise SystemExit(1)
