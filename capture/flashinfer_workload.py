"""One arm of the FlashInfer A/B, run as its own process under nsys (`python -m ...`).

Both arms build the same BF16 K/V/Q from the same seed (or load them from a user's tensor file) and differ only in
how the cache is stored.
Everything that compiles or allocates happens before cudaProfilerStart; the measured region holds
NVTX-named phases per context length: causal paged prefill, tensor-core decode, KV append, and a bf16
GEMM control that must not move between arms.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvtrace.capture import flashinfer_quality as quality
from kvtrace.capture import formats, runner
from kvtrace.kv_formats import kv_bytes_per_token_head
from kvtrace.manifest import phase_name

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kv-format", choices=sorted(KV_DTYPES), required=True)
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--q-heads", type=int, required=True)
    parser.add_argument("--kv-heads", type=int, required=True)
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--page-size", type=int, required=True)
    parser.add_argument("--prefill-calls", type=int, required=True)
    parser.add_argument("--decode-calls", type=int, required=True)
    parser.add_argument("--append-calls", type=int, required=True)
    parser.add_argument("--gemm-calls", type=int, required=True)
    parser.add_argument("--gemm-size", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--inputs", default="gaussian", help="gaussian, outliers, or a .safetensors file of q, k, v")
    parser.add_argument("--result", type=Path, required=True)
    return parser.parse_args(argv)


class PagedCache:
    """One context length's cache in NHD pages, with room for the appended tokens."""

    def __init__(self, kv_format: str, keys: torch.Tensor, values: torch.Tensor, batch: int, context: int,
                 extra_tokens: int, page_size: int):
        self.kv_format, self.batch, self.context, self.page_size = kv_format, batch, context, page_size
        kv_heads, head_dim = keys.shape[-2], keys.shape[-1]
        pages_per_seq = math.ceil((context + extra_tokens) / page_size)
        device = keys.device
        self.indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages_per_seq
        self.indices = torch.arange(batch * pages_per_seq, dtype=torch.int32, device=device)
        slots = pages_per_seq * page_size
        # Source rows: [batch * context, kv_heads, head_dim] laid into the first `context` slots of each seq.
        def to_pages(rows: torch.Tensor) -> torch.Tensor:
            padded = torch.zeros(batch, slots, *rows.shape[1:], dtype=rows.dtype, device=device)
            padded[:, :context] = rows.reshape(batch, context, *rows.shape[1:])
            return padded.reshape(batch * pages_per_seq, page_size, *rows.shape[1:]).contiguous()

        if kv_format == "fp8":
            k8, self.k_scale = formats.fp8_quantize(keys)
            v8, self.v_scale = formats.fp8_quantize(values)
            self.k_cache, self.v_cache = to_pages(k8.view(torch.uint8)).view(torch.float8_e4m3fn), \
                to_pages(v8.view(torch.uint8)).view(torch.float8_e4m3fn)
            self.scales = None
        else:
            kq, vq = formats.nvfp4_quantize(keys), formats.nvfp4_quantize(values)
            self.k_scale, self.v_scale = kq.global_scale, vq.global_scale
            self.k_cache, self.v_cache = to_pages(kq.data), to_pages(vq.data)
            self.scales = (to_pages(kq.scales.view(torch.uint8)).view(torch.float8_e4m3fn),
                           to_pages(vq.scales.view(torch.uint8)).view(torch.float8_e4m3fn))
        self.kv_heads, self.head_dim = kv_heads, head_dim

    def last_page_len(self, tokens: int) -> torch.Tensor:
        last = (tokens - 1) % self.page_size + 1
        return torch.full((self.batch,), last, dtype=torch.int32, device=self.indptr.device)

    def pages_used(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """indptr/indices restricted to the pages that `tokens` occupy."""
        used = math.ceil(tokens / self.page_size)
        per_seq = int(self.indptr[1])
        indices = self.indices.reshape(self.batch, per_seq)[:, :used].reshape(-1).contiguous()
        indptr = torch.arange(self.batch + 1, dtype=torch.int32, device=indices.device) * used
        return indptr, indices

    def run_kwargs(self) -> dict:
        kwargs = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        if self.scales is not None:
            kwargs["kv_cache_sf"] = self.scales
        return kwargs


@dataclass(frozen=True)
class MeasuredPhase:
    """One NVTX range of the measured region: `calls` calls of `run`, each moving `bytes_per_call` KV bytes
    (the GEMM control: its operand and result bytes)."""

    name: str
    run: Callable[[], object]
    calls: int
    bytes_per_call: int


@dataclass
class Inputs:
    """One context length's BF16 tensors, drawn from the shared generator in a fixed order (same in both arms)."""

    keys: torch.Tensor
    values: torch.Tensor
    q_prefill: torch.Tensor
    q_decode: torch.Tensor
    new_k: torch.Tensor  # one token per sequence for each append call
    new_v: torch.Tensor

    @classmethod
    def draw(cls, args: argparse.Namespace, context: int, generator: torch.Generator, source=None,
             device=None) -> "Inputs":
        """source: None (Gaussian), outlier channels ([kv_heads, n], quality.outlier_channels) or a dumped file's
        q, k, v (quality.read_tensor_file). Generated tensors are drawn where the generator lives (the workload's is a
        CPU one, so that a GPU run's tensors can be drawn again anywhere: tests check its recorded errors on them),
        then moved to `device`; a file's draw nothing (the generator is not used after the contexts)."""
        if isinstance(source, dict):
            inputs = cls.of_file(args, context, source)
        else:
            keys = quality.normal_bf16(generator, args.batch * context, args.kv_heads, args.head_dim)
            values = quality.normal_bf16(generator, args.batch * context, args.kv_heads, args.head_dim)
            q_prefill = quality.normal_bf16(generator, args.batch * context, args.q_heads, args.head_dim)
            q_decode = quality.normal_bf16(generator, args.batch, args.q_heads, args.head_dim)
            new_k = quality.normal_bf16(generator, args.append_calls, args.batch, args.kv_heads, args.head_dim)
            new_v = quality.normal_bf16(generator, args.append_calls, args.batch, args.kv_heads, args.head_dim)
            if source is not None:
                keys, values, new_k, new_v = (quality.add_outliers(x, source) for x in (keys, values, new_k, new_v))
            inputs = cls(keys, values, q_prefill, q_decode, new_k, new_v)
        return inputs if device is None else cls(*(tensor.to(device) for tensor in vars(inputs).values()))

    @classmethod
    def of_file(cls, args: argparse.Namespace, context: int, tensors: dict) -> "Inputs":
        """Each sequence a contiguous window of the dumped tokens; its decode query the window's last token (which
        attends to every cached token, itself included, as in decode); appends write the tokens that follow."""
        q, k, v = (tensors[name].to(torch.bfloat16) for name in ("q", "k", "v"))
        starts = quality.windows(k.shape[0], context, args.batch)
        rows = torch.cat([torch.arange(s, s + context) for s in starts])
        last = torch.tensor([s + context - 1 for s in starts])
        follow = torch.tensor([[(s + context + step) % k.shape[0] for s in starts] for step in range(args.append_calls)])
        return cls(k[rows], v[rows], q[rows], q[last], k[follow], v[follow])


class Appender:
    """KV append calls: call `step` writes token `context + step` of every sequence (cycling through the
    prepared steps); page tables include that slot."""

    def __init__(self, flashinfer, cache: PagedCache, inputs: Inputs, calls: int):
        self.flashinfer, self.cache, self.inputs, self.step = flashinfer, cache, inputs, 0
        batch, device, context = cache.batch, cache.indptr.device, cache.context
        self.tables = []
        for step in range(calls):
            indptr, indices = cache.pages_used(context + step + 1)
            self.tables.append((indptr, indices, cache.last_page_len(context + step + 1),
                                torch.arange(batch, dtype=torch.int32, device=device),
                                torch.full((batch,), context + step, dtype=torch.int32, device=device)))

    def __call__(self) -> None:
        s = self.step % len(self.tables)
        self.step += 1
        indptr, indices, last, batch_indices, positions = self.tables[s]
        cache, paged = self.cache, (self.cache.k_cache, self.cache.v_cache)
        new_k, new_v = self.inputs.new_k[s], self.inputs.new_v[s]
        if cache.kv_format == "fp8":
            # vLLM-style cast-and-scatter: quantize with the per-tensor scale, then write the rows.
            k8 = (new_k.float() / cache.k_scale).to(torch.float8_e4m3fn)
            v8 = (new_v.float() / cache.v_scale).to(torch.float8_e4m3fn)
            self.flashinfer.page.append_paged_kv_cache(k8, v8, batch_indices, positions, paged, indices, indptr,
                                                       last, "NHD")
        else:
            self.flashinfer.page.nvfp4_quantize_append_paged_kv_cache(
                new_k, new_v, batch_indices, positions, paged, cache.scales, indices, indptr, last,
                cache.k_scale, cache.v_scale, "NHD")


def plan_attention(flashinfer, args: argparse.Namespace, cache: PagedCache, workspace: torch.Tensor):
    """FA2 paged prefill (causal, the whole context as queries) and tensor-core decode wrappers, planned."""
    context, kv_dtype, device = cache.context, KV_DTYPES[args.kv_format], workspace.device
    kv_indptr, kv_indices = cache.pages_used(context)
    qo_indptr = torch.arange(args.batch + 1, dtype=torch.int32, device=device) * context
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    prefill.plan(qo_indptr, kv_indptr, kv_indices, cache.last_page_len(context), args.q_heads, args.kv_heads,
                 args.head_dim, args.page_size, causal=True, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
                 o_data_type=torch.bfloat16)
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True, backend="fa2")
    decode.plan(kv_indptr, kv_indices, cache.last_page_len(context), args.q_heads, args.kv_heads, args.head_dim,
                args.page_size, q_data_type=torch.bfloat16, kv_data_type=kv_dtype, o_data_type=torch.bfloat16)
    return prefill, decode


def prepare_context(flashinfer, args: argparse.Namespace, context: int, generator: torch.Generator,
                    workspace: torch.Tensor, gemm: Callable[[], object], source=None) -> tuple[list[MeasuredPhase], dict]:
    """One context length: its cache, planned kernels and phases, warmed up (JIT compiles every FlashInfer
    variant here, outside the measured region). Returns the phases and the context's result entry, with the
    error of this format's attention against a float64 reference (flashinfer_quality). source: Inputs.draw's."""
    inputs = Inputs.draw(args, context, generator, source, device=workspace.device)
    cache = PagedCache(args.kv_format, inputs.keys, inputs.values, args.batch, context, args.append_calls,
                       args.page_size)
    prefill, decode = plan_attention(flashinfer, args, cache, workspace)
    paged = (cache.k_cache, cache.v_cache)
    run_prefill = functools.partial(prefill.run, inputs.q_prefill, paged, **cache.run_kwargs())
    run_decode = functools.partial(decode.run, inputs.q_decode, paged, **cache.run_kwargs())
    append = Appender(flashinfer, cache, inputs, args.append_calls)

    bytes_per_token_head = kv_bytes_per_token_head(args.kv_format, args.head_dim)
    kv_read = int(args.batch * context * args.kv_heads * 2 * bytes_per_token_head)
    phases = [MeasuredPhase(phase_name("prefill", context, args.batch), run_prefill, args.prefill_calls, kv_read),
              MeasuredPhase(phase_name("decode", context, args.batch), run_decode, args.decode_calls, kv_read),
              MeasuredPhase(phase_name("append", context, args.batch), append, args.append_calls,
                            int(args.batch * args.kv_heads * 2 * bytes_per_token_head)),
              MeasuredPhase(phase_name("gemm", context, args.batch), gemm, args.gemm_calls,
                            3 * 2 * args.gemm_size ** 2)]

    out_prefill, out_decode = run_prefill(), run_decode()
    dequantized = quality.read_back(args.kv_format, inputs.keys, inputs.values, inputs.q_prefill, inputs.q_decode,
                                    cache.k_scale, cache.v_scale, args.batch, context)
    entry = {"context": context, "kv_bytes_read_per_attention_call": kv_read,
             "k_scale": cache.k_scale, "v_scale": cache.v_scale,
             "quality": quality.point_quality(dequantized, inputs.keys, inputs.values, inputs.q_prefill,
                                              inputs.q_decode, args.batch, context, kernel=(out_prefill, out_decode))}
    # Which nibble FlashInfer reads first, checked once on the smallest context (quality's kernel_vs_format says how
    # near the kernel is to the cache as written, at every context).
    if args.kv_format == "nvfp4" and context == min(args.contexts):
        entry["accuracy"] = nibble_order_check(args, cache, inputs.keys, inputs.values, inputs.q_prefill,
                                               dequantized, prefill)
    append()
    append.step = 0  # the measured appends start at the first prepared token again
    gemm()
    return phases, entry


def measure(phases: list[MeasuredPhase]) -> None:
    """The measured region: cudaProfilerStart/Stop open and close nsys' capture range around the phases."""
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for phase in phases:
        torch.cuda.nvtx.range_push(phase.name)
        for _ in range(phase.calls):
            phase.run()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main(argv=None) -> None:
    args = parse_args(argv)
    import flashinfer

    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(args.seed)  # on the CPU: Inputs.draw says why
    workspace = torch.zeros(512 * 1024 * 1024, dtype=torch.uint8, device=device)
    result = {"kv_format": args.kv_format, "versions": {
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda, "flashinfer": flashinfer.__version__},
        "gpu": {"name": torch.cuda.get_device_name(), "sm": "%d%d" % torch.cuda.get_device_capability(),
                "sm_count": torch.cuda.get_device_properties(device).multi_processor_count},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "contexts": []}
    gemm_a, gemm_b = (quality.normal_bf16(generator, args.gemm_size, args.gemm_size).to(device) for _ in range(2))
    gemm = functools.partial(torch.matmul, gemm_a, gemm_b)  # the control that must not move between arms
    source = sha256 = None
    if args.inputs == "outliers":
        source = quality.outlier_channels(args.kv_heads, args.head_dim, args.seed)
    elif args.inputs != "gaussian":
        source, sha256 = quality.read_tensor_file(Path(args.inputs))
    result["quality_inputs"] = quality.describe_inputs(args.inputs, sha256)
    phases = []
    for context in args.contexts:
        context_phases, entry = prepare_context(flashinfer, args, context, generator, workspace, gemm, source)
        phases += context_phases
        result["contexts"].append(entry)
    measure(phases)
    result["phases"] = [{"nvtx": phase.name, "calls": phase.calls, "bytes_per_call": phase.bytes_per_call}
                        for phase in phases]
    runner.write_json_atomic(args.result, result)


def nibble_order_check(args, cache, keys, values, q_prefill, dequantized, prefill) -> dict:
    """The prefill kernel over the same pages and scales with each byte's nibbles swapped, against float64 attention
    over the dequantized cache: far off when the cache was written in the order FlashInfer reads."""
    context, batch = cache.context, args.batch
    kq = formats.nvfp4_quantize(keys, cache.k_scale, low_nibble_first=False)
    vq = formats.nvfp4_quantize(values, cache.v_scale, low_nibble_first=False)
    pages_k, pages_v = cache.k_cache.clone(), cache.v_cache.clone()
    slots = pages_k.shape[0] // batch * args.page_size
    for target, packed in ((pages_k, kq.data), (pages_v, vq.data)):
        view = target.view(batch, slots, *target.shape[2:])
        view[:, :context] = packed.reshape(batch, context, *packed.shape[1:])
    out = prefill.run(q_prefill, (pages_k, pages_v), **cache.run_kwargs())
    rows = quality.select_rows(out, batch, context, quality.prefill_rows(context))
    return {"prefill_high_nibble_first_vs_dequantized_cache": quality.errors(rows, dequantized["prefill"])["rel_l2"]}


if __name__ == "__main__":
    main()
