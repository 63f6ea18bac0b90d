"""The FlashInfer workload's preparation on the CPU, with a stand-in for the flashinfer package.

Real FlashInfer kernels need a GPU; what is checked here is kvtrace's own part of the workload: the same BF16
inputs in both arms, the phases and their NVTX names (the format kvtrace.manifest owns and the report parses),
the KV bytes per call, the plans handed to FlashInfer, and the append calls' token positions. Expected values
are derived from the arguments, not copied from a run.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvtrace.capture import flashinfer_workload as workload  # noqa: E402
from kvtrace.manifest import parse_phase_name  # noqa: E402

ARGS = dict(contexts=[32, 48], batch=2, q_heads=4, kv_heads=2, head_dim=16, page_size=16, prefill_calls=3,
            decode_calls=5, append_calls=4, gemm_calls=2, gemm_size=8, seed=7)


class StandInWrapper:
    """Records its plan; `run` returns zeros of the query's shape (the accuracy numbers are then 1.0)."""

    def __init__(self, workspace, layout, **options):
        self.options, self.plans, self.runs = options, [], []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, q, paged, **kwargs):
        self.runs.append(kwargs)
        return torch.zeros_like(q)


def stand_in_flashinfer() -> SimpleNamespace:
    appends = []

    def append(*args):
        appends.append(args)

    page = SimpleNamespace(append_paged_kv_cache=append, nvfp4_quantize_append_paged_kv_cache=append)
    return SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=StandInWrapper,
                           BatchDecodeWithPagedKVCacheWrapper=StandInWrapper, page=page, appends=appends)


def prepared(kv_format: str, context: int):
    args = argparse.Namespace(kv_format=kv_format, **ARGS)
    flashinfer = stand_in_flashinfer()
    generator = torch.Generator().manual_seed(args.seed)
    workspace = torch.zeros(16, dtype=torch.uint8)
    gemm_calls = []
    phases, entry = workload.prepare_context(flashinfer, args, context, generator, workspace,
                                             lambda: gemm_calls.append(1))
    return args, flashinfer, phases, entry, gemm_calls


def test_both_arms_draw_the_same_inputs():
    args = argparse.Namespace(**ARGS)
    first, second = (workload.Inputs.draw(args, 32, torch.Generator().manual_seed(7)) for _ in range(2))
    for name in ("keys", "values", "q_prefill", "q_decode", "new_k", "new_v"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    assert first.keys.shape == (2 * 32, 2, 16) and first.q_prefill.shape == (2 * 32, 4, 16)
    assert first.new_k.shape == (4, 2, 2, 16) and first.keys.dtype == torch.bfloat16


@pytest.mark.parametrize("kv_format,bytes_per_value", [("fp8", 1.0), ("nvfp4", 0.5 + 1 / 16)])
@pytest.mark.parametrize("context", [32, 48])
def test_phases_names_calls_and_bytes(kv_format, bytes_per_value, context):
    args, _, phases, entry, _ = prepared(kv_format, context)
    per_token = args.kv_heads * 2 * args.head_dim * bytes_per_value  # K and V of every KV head
    expected = [("prefill", args.prefill_calls, args.batch * context * per_token),
                ("decode", args.decode_calls, args.batch * context * per_token),
                ("append", args.append_calls, args.batch * per_token),
                ("gemm", args.gemm_calls, 3 * 2 * args.gemm_size ** 2)]
    assert [(parse_phase_name(p.name), p.calls, p.bytes_per_call) for p in phases] == [
        ((kind, context), calls, int(size)) for kind, calls, size in expected]
    assert all(p.name.endswith(f" batch={args.batch}") for p in phases)
    assert entry["context"] == context and entry["kv_bytes_read_per_attention_call"] == expected[0][2]
    # The nibble-order check runs on NVFP4's smallest context only; the errors at every one (the stand-in's all-zero
    # outputs are 100% off, with no defined cosine, against the reference and the dequantized cache alike).
    assert ("accuracy" in entry) == (kv_format == "nvfp4" and context == min(args.contexts))
    quality = entry["quality"]
    assert set(quality["format"]) == set(quality["kernel"]) == set(quality["kernel_vs_format"]) == {"prefill", "decode"}
    assert quality["kernel_vs_format"]["decode"]["rel_l2"] == 1.0
    assert quality["kernel"]["decode"]["rel_l2"] == 1.0 and quality["kernel"]["prefill"]["cosine"] is None
    assert 0 < quality["format"]["prefill"]["rel_l2"] < 0.5 and set(quality["cache"]) == {"k", "v"}


@pytest.mark.parametrize("kv_format", ["fp8", "nvfp4"])
def test_plans_and_runs_hand_flashinfer_the_cache_format(kv_format):
    args, _, phases, _, _ = prepared(kv_format, 32)
    prefill, decode = phases[0].run.func.__self__, phases[1].run.func.__self__
    kv_dtype = {"fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}[kv_format]
    assert prefill.options == {"backend": "fa2"} and decode.options == {"use_tensor_cores": True, "backend": "fa2"}
    for wrapper in (prefill, decode):
        (_, kwargs), = wrapper.plans
        assert kwargs["kv_data_type"] == kv_dtype and kwargs["q_data_type"] == torch.bfloat16
    assert prefill.plans[0][1]["causal"] is True
    # NVFP4 passes its block scales (kv_cache_sf), FP8 only the per-tensor scales.
    assert ("kv_cache_sf" in prefill.runs[0]) == (kv_format == "nvfp4")
    assert {"k_scale", "v_scale"} <= set(decode.runs[0])


@pytest.mark.parametrize("kv_format", ["fp8", "nvfp4"])
def test_append_writes_the_next_tokens_and_restarts_after_warm_up(kv_format):
    args, flashinfer, phases, _, gemm_calls = prepared(kv_format, 32)
    assert len(flashinfer.appends) == 1 and gemm_calls == [1]  # warmed up once each
    append = phases[2].run
    assert append.step == 0
    for _ in range(args.append_calls + 1):
        append()
    # Positions: argument 3 of both append APIs; the calls cycle through the prepared steps.
    positions = [call[3].tolist() for call in flashinfer.appends[1:]]
    assert positions == [[32 + step] * args.batch for step in (0, 1, 2, 3, 0)]
    if kv_format == "fp8":
        assert flashinfer.appends[1][0].dtype == torch.float8_e4m3fn  # cast before the scatter
    else:
        assert flashinfer.appends[1][0].dtype == torch.bfloat16  # the fused kernel quantizes
