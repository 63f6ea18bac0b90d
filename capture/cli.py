"""`kvtrace capture ...`: click layer over the capture engines. Imports nothing from the analyzer."""

from __future__ import annotations

from pathlib import Path

import click

from kvtrace.errors import KvtraceError


def _int_list(ctx, param, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise KvtraceError(f"--{param.name} takes comma-separated integers, e.g. 2048,8192; got {value!r}") from None


def _name_list(ctx, param, value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


@click.group()
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
@click.option("--arms", default="fp8,nvfp4", show_default=True, callback=_name_list, help="Formats to record, comma-separated.")
@click.option("--nsys", "nsys_path", default=None, help="nsys binary (default: $NSYS, PATH, known installs).")
@click.option("--force", is_flag=True, help="Replace an existing run directory.")
def flashinfer(out, context, batch, q_heads, kv_heads, head_dim, page_size, prefill_calls, decode_calls,
               append_calls, gemm_calls, seed, arms, nsys_path, force) -> None:
    """Kernel-level A/B: the same cached tokens stored as FP8 and as NVFP4, one trace per format.

    Needs an SM80+ GPU, torch, FlashInfer and nsys. Writes ARM.nsys-rep, ARM.sqlite, ARM.log and
    ARM.workload.json per arm and manifest.json for the run.
    """
    from kvtrace.capture import flashinfer_engine

    spec = flashinfer_engine.FlashInferSpec(
        contexts=context, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
        prefill_calls=prefill_calls, decode_calls=decode_calls, append_calls=append_calls, gemm_calls=gemm_calls,
        seed=seed)
    manifest = flashinfer_engine.capture(out, spec, arms=arms, force=force, nsys=nsys_path)
    failed = [name for name, arm in manifest["arms"].items() if arm["status"] != "ok"]
    for name, arm in manifest["arms"].items():
        click.echo(f"{name}: {arm['status']}" + (f" ({arm['error']})" if arm["error"] else f" -> {out / arm['sqlite']}"))
    if failed:
        raise SystemExit(1)
