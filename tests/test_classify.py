"""Recipes and kernel families, on kernel names from real traces (shared/reference/nvfp4-kv-kernels.md)."""

import sqlite3
from pathlib import Path

import polars as pl
import pytest

from conftest import REAL_SQLITE, VLLM_COLD_PREFILL
from kvtrace.analyzer.classify import SEGMENTS, load_recipes
from kvtrace.analyzer.kernel_names import parse_kernel_name
from kvtrace.errors import KvtraceError



PREFILL_TILES = (128, 2, 4, 8, 8, 4, 1)  # CTA_TILE_Q, NUM_MMA_Q, NUM_MMA_KV, NUM_MMA_D_QK, NUM_MMA_D_VO, warps Q, KV
DECODE_TILES = (16, 1, 4, 8, 8, 1, 4)


def flashinfer_fa2(mask_mode: int, kv: str, tiles=PREFILL_TILES, params: str = "PagedParams") -> str:
    """FA2 paged prefill exactly as Nsight Systems 2025.3 names it on the H200 (fixtures/fi-h200-sm90)."""
    tile_args = ", ".join(f"(unsigned int){t}" for t in tiles)
    return (
        f"void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<(flashinfer::MaskMode)"
        f"{mask_mode}, {tile_args}, (flashinfer::PosEncodingMode)0, __nv_bfloat16, {kv}, __nv_bfloat16, float, int, "
        f"flashinfer::DefaultAttention<(bool)0, (bool)0, (bool)0, (bool)0>>, {params}>(T2)"
    )


# Copied from the real H200 fixtures, fixtures/fi-h200-sm90/*.sqlite (SELECT DISTINCT demangled names).
H200_PREFILL_NVFP4 = (
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<(flashinfer::MaskMode)1, "
    "(unsigned int)128, (unsigned int)2, (unsigned int)4, (unsigned int)8, (unsigned int)8, (unsigned int)4, "
    "(unsigned int)1, (flashinfer::PosEncodingMode)0, __nv_bfloat16, __nv_fp4x2_e2m1, __nv_bfloat16, float, int, "
    "flashinfer::DefaultAttention<(bool)0, (bool)0, (bool)0, (bool)0>>, PagedParams>(T2)"
)
H200_DECODE_FP8 = (
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<(flashinfer::MaskMode)0, "
    "(unsigned int)16, (unsigned int)1, (unsigned int)4, (unsigned int)8, (unsigned int)8, (unsigned int)1, "
    "(unsigned int)4, (flashinfer::PosEncodingMode)0, __nv_bfloat16, __nv_fp8_e4m3, __nv_bfloat16, float, int, "
    "flashinfer::DefaultAttention<(bool)0, (bool)0, (bool)0, (bool)0>>, PagedParams>(T2)"
)
H200_APPEND_FP8 = (
    "void flashinfer::AppendPagedKVCacheKernel<(unsigned int)128, (unsigned int)16, __nv_fp8_e4m3, int>("
    "flashinfer::paged_kv_t<T3, T4>, T3 *, T3 *, T4 *, T4 *, unsigned int, unsigned long, unsigned long, "
    "unsigned long, unsigned long)"
)
H200_APPEND_NVFP4 = (
    "void flashinfer::NVFP4QuantizeAppendPagedKVCacheKernel<(unsigned int)128, __nv_bfloat16, int>("
    "flashinfer::paged_kv_t<unsigned char, T3>, const T2 *, const T2 *, const T3 *, const T3 *, unsigned int, "
    "unsigned long, unsigned long, unsigned long, unsigned long, unsigned char *, unsigned char *, unsigned long, "
    "unsigned long, unsigned long, unsigned long, unsigned long, unsigned long, float, float)"
)
H200_MERGE = (
    "void flashinfer::PersistentVariableLengthMergeStatesKernel<(unsigned int)8, (unsigned int)16, "
    "(unsigned int)8, (unsigned int)4, __nv_bfloat16, __nv_bfloat16, int>(T5 *, float *, T7 *, T6 *, float *, "
    "unsigned int, unsigned int *, unsigned int)"
)
H200_GEMM = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
H200_FP8_CAST = (
    "void at::native::vectorized_elementwise_kernel<(int)4, at::native::float8_copy_kernel_cuda("
    "at::TensorIteratorBase &)::[lambda(float) (instance 1)], std::array<char *, (unsigned long)2>>(int, T2, T3)"
)
H200_FILL = (
    "void at::native::vectorized_elementwise_kernel<(int)8, at::native::FillFunctor<c10::BFloat16>, "
    "std::array<char *, (unsigned long)1>>(int, T2, T3)"
)
H200_COPY = (
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase &)::"
    "[lambda() (instance 3)]::operator ()() const::[lambda() (instance 7)]::operator ()() const::[lambda(float) "
    "(instance 1)], std::array<char *, (unsigned long)2>, (int)4, TrivialOffsetCalculator<(int)1, unsigned int>, "
    "TrivialOffsetCalculator<(int)1, unsigned int>, at::native::memory::LoadWithCast<(int)1>, "
    "at::native::memory::StoreWithCast<(int)1>>(int, T1, T2, T4, T5, T6, T7)"
)
H200_MUL = (
    "void at::native::vectorized_elementwise_kernel<(int)8, at::native::AUnaryFunctor<c10::BFloat16, c10::BFloat16, "
    "c10::BFloat16, at::native::binary_internal::MulFunctor<float>>, std::array<char *, (unsigned long)2>>(int, T2, T3)"
)

# Names as the reference quotes them (vllm#50416 / flashinfer#4269, §10), abbreviations included.
REFERENCE_FA2_NVFP4 = (
    "flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<(flashinfer::MaskMode)1, ... "
    "__nv_bfloat16, __nv_fp4x2_e2m1, __nv_bfloat16, float, int, ...>, PagedParams>"
)
REFERENCE_FA2_FP8 = REFERENCE_FA2_NVFP4.replace("__nv_fp4x2_e2m1", "__nv_fp8_e4m3")
TRTLLM_CONTEXT_NVFP4 = "fmhaSm100aKernel_QE4m3KvE2m1OE4m3H128PagedKvCausalP32VarSeqQ128Kv128PersistentContext"
TRTLLM_GEN_NVFP4 = "fmhaSm100aKernel_QE4m3KvE2m1OE4m3H128PagedKvDenseP16VarSeqQ8Kv128PersistentSwapsAbForGen"
# Reference §1.2 / §5.2 (demangled form of <__nv_bfloat16, uint8_t, kFp8E4M3>), with nsys-style parameters.
RESHAPE = (
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, {}, (vllm::Fp8KVCacheDataType){}>(const T1 *, "
    "const T1 *, T2 *, T2 *, const long *, long, long, long, long, int, int, int, const float *, const float *)"
)
RESHAPE_FP8 = RESHAPE.format("unsigned char", 1)
RESHAPE_AUTO = RESHAPE.format("__nv_bfloat16", 0)
# JIT builds pass a generated Params struct (cf. `PagedParams` above), so the name carries no KV dtype.
JIT_DECODE = (
    "void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, (unsigned int)2, "
    "(unsigned int)4, (unsigned int)8, (unsigned int)16, (unsigned int)1, (unsigned int)8, "
    "flashinfer::DefaultAttention<(bool)0, (bool)0, (bool)0, (bool)0>, Params>(T9)"
)
RESHAPE_NVFP4 = "void vllm::reshape_and_cache_nvfp4_kernel<__nv_bfloat16, (vllm::NVFP4KVScaleSearch)0>(const T1 *)"

SEGMENT_CASES = [
    # Real H200 fixture names (and the builder's FP8 twin of the prefill one).
    (H200_PREFILL_NVFP4, "prefill_attention", "flashinfer.toml:fa2-paged-prefill"),
    (flashinfer_fa2(1, "__nv_fp8_e4m3"), "prefill_attention", "flashinfer.toml:fa2-paged-prefill"),
    (H200_DECODE_FP8, "decode_attention", "flashinfer.toml:fa2-paged-decode-tensor-cores"),
    (H200_MERGE, "decode_attention", "flashinfer.toml:split-kv-merge"),
    (H200_APPEND_FP8, "kv_append", "flashinfer.toml:append"),
    (H200_APPEND_NVFP4, "kv_append", "flashinfer.toml:nvfp4-quantize-append"),
    (H200_GEMM, "gemm", "common.toml:gemm"),
    (H200_FP8_CAST, "quantize", "torch.toml:float8-cast"),
    (H200_FILL, "memory", "torch.toml:copy-fill"),
    (H200_COPY, "memory", "torch.toml:copy-fill"),
    (H200_MUL, "other", None),
    # Names quoted in the reference, then names shaped after the upstream kernels' templates (the literal
    # spelling, `8` vs `(int)8`, varies with the Nsight Systems version and does not matter to the rules).
    (REFERENCE_FA2_NVFP4, "prefill_attention", "flashinfer.toml:fa2-paged-prefill"),
    (JIT_DECODE, "decode_attention", "flashinfer.toml:cuda-core-decode"),
    (
        "void flashinfer::BatchPrefillWithRaggedKVCacheKernel<flashinfer::KernelTraits<(flashinfer::MaskMode)1, 128u, "
        "2u, 4u, 8u, 8u, 4u, 1u, (flashinfer::PosEncodingMode)0, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, float, "
        "int, flashinfer::DefaultAttention<false, false, false, false>>, RaggedParams>(RaggedParams)",
        "prefill_attention",
        "flashinfer.toml:fa2-ragged-prefill",
    ),
    ("kernel_mha", "decode_attention", "flashinfer.toml:xqa-decode"),
    (TRTLLM_CONTEXT_NVFP4, "prefill_attention", "flashinfer.toml:trtllm-gen-context"),
    (TRTLLM_GEN_NVFP4, "decode_attention", "flashinfer.toml:trtllm-gen-generation"),
    (
        "void flashinfer::PrefillWithKVCacheKernel<flashinfer::SparseCollectiveMainloop<flashinfer::DefaultAttention<"
        "false, false, false, false>, flashinfer::AttentionKernelTraits<false, 128, 128, 128, 2, __nv_bfloat16>, true>"
        ", flashinfer::CollectiveEpilogue<flashinfer::AttentionKernelTraits<false, 128, 128, 128, 2, __nv_bfloat16>>, "
        "flashinfer::AttentionKernelTraits<false, 128, 128, 128, 2, __nv_bfloat16>, false, true, "
        "flashinfer::BatchPrefillPersistentTileScheduler<int>, false>(T1::Params, T2::Params, T4::Params)",
        "prefill_attention",
        "flashinfer.toml:fa3-prefill",
    ),
    ("void flashinfer::FP8PrefillWithKVCacheKernel<Mainloop, Epilogue, Ktraits, false, true, Scheduler>(Params)",
     "prefill_attention", "flashinfer.toml:fa3-prefill"),
    (
        "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t>>, false, true, false, false, "
        "true, true, false, false>(flash::Flash_fwd_params)",
        "prefill_attention",
        "vllm.toml:flash-attn",
    ),
    (RESHAPE_FP8, "kv_append", "vllm.toml:reshape-and-cache-flash"),
    (RESHAPE_AUTO, "kv_append", "vllm.toml:reshape-and-cache-flash"),
    (RESHAPE_NVFP4, "kv_append", "vllm.toml:reshape-and-cache-nvfp4"),
    ("void vllm::reshape_and_cache_kernel<__nv_bfloat16, unsigned char, (vllm::Fp8KVCacheDataType)1>(const T1 *)",
     "kv_append", "vllm.toml:reshape-and-cache"),
    (
        "void flashinfer::NVFP4QuantizeAppendPagedKVCacheWithSlotMappingKernel<128u, __nv_bfloat16, int>("
        "flashinfer::paged_kv_t<unsigned char, int>, const __nv_bfloat16 *)",
        "kv_append",
        "flashinfer.toml:nvfp4-quantize-append",
    ),
    ("void flashinfer::AppendPagedKVCacheKernel<128u, 8u, __nv_fp8_e4m3, int>(flashinfer::paged_kv_t<__nv_fp8_e4m3, "
     "int>, __nv_fp8_e4m3 *, __nv_fp8_e4m3 *, int *, int *, unsigned int, unsigned long)",
     "kv_append", "flashinfer.toml:append"),
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "gemm", "common.toml:gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", "gemm", "common.toml:gemm"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>>>(T1::Params)",
     "gemm", "common.toml:gemm"),
    ("fused_moe_kernel", "moe", "vllm.toml:fused-moe"),
    ("void tensorrt_llm::kernels::cutlass_kernels::expandInputRowsKernel<__nv_bfloat16, __nv_fp4_e2m1>(const T1 *)",
     "moe", "flashinfer.toml:cutlass-fused-moe"),
    ("void tensorrt_llm::kernels::cutlass_kernels::doGatedActivationKernel<__nv_bfloat16, float>(T1 *)",
     "moe", "flashinfer.toml:cutlass-fused-moe"),
    ("void vllm::cvt_fp16_to_fp4<c10::BFloat16, false>(int, int, const T1 *, const float *, unsigned int *)",
     "quantize", "vllm.toml:quantize"),
    ("void vllm::scaled_fp8_quant_kernel<c10::BFloat16, c10::Float8_e4m3fn>(T2 *, const T1 *, const float *, long)",
     "quantize", "vllm.toml:quantize"),
    ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 3>(T1 *, long, long, const T1 *, const T1 *, float, int, int)",
     "norm", "vllm.toml:rms-norm"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(T1 *, long, T1 *, const T1 *, float, int, int)",
     "norm", "vllm.toml:rms-norm"),
    ("void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>(T2 *, T2 *, T2 *, unsigned int, unsigned int, "
     "unsigned int, float, float)", "norm", "common.toml:norm"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>(T1 *, const T1 *, int)",
     "activation", "vllm.toml:act-and-mul"),
    ("void vllm::cross_device_reduce_1stage<c10::BFloat16, 8>(vllm::RankData *, vllm::RankSignals, T1 *, int, int)",
     "communication", "vllm.toml:custom-all-reduce"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication",
     "common.toml:collectives"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1>>(int, "
     "T2, T3)", "memory", "torch.toml:copy-fill"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
     "cuda(at::TensorIteratorBase &)::[lambda() (instance 3)]::operator ()() const::[lambda() (instance 7)]::operator "
     "()() const::[lambda(float) (instance 1)]>(at::TensorIteratorBase &, const T1 &)::[lambda(int) (instance 1)]>"
     "(int, T3)", "memory", "torch.toml:copy-fill"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(const long *, T1 *, T1 *, const T1 *, int, long)",
     "other", "common.toml:rotary"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<T1, T2>)",
     "other", None),
]


@pytest.fixture(scope="module")
def recipes(shipped_recipes):
    return shipped_recipes


DIMS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z")


def names_frame(names):
    """The classifier's input: one row per distinct signature, all launch dims 1."""
    return pl.DataFrame(
        {
            "name_id": list(range(len(names))),
            "demangled": names,
            "short": [parse_kernel_name(n).base for n in names],
            **{dim: [1] * len(names) for dim in DIMS},
        },
        schema_overrides={column: pl.Int64 for column in ("name_id", *DIMS)},
    )


def test_segments_are_the_documented_tuple():
    assert SEGMENTS == (
        "prefill_attention", "decode_attention", "kv_append", "gemm", "moe", "quantize", "norm", "activation",
        "communication", "memory", "other",
    )


@pytest.mark.parametrize("name,segment,recipe", SEGMENT_CASES, ids=[c[2] or "unmatched" for c in SEGMENT_CASES])
def test_segment_per_real_name(recipes, name, segment, recipe):
    result = recipes.classify_one(name)
    assert (result.segment, result.recipe) == (segment, recipe)


def test_classify_adds_columns_per_distinct_signature(recipes):
    names = [case[0] for case in SEGMENT_CASES]
    out = recipes.classify(names_frame(names))
    assert out.columns == [
        "name_id", "demangled", "short", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
        "segment", "family", "family_label", "kv_dtype", "recipe", "kv_independent",
    ]
    assert all(out.schema[c] == pl.Utf8 for c in ("segment", "family", "family_label", "kv_dtype", "recipe"))
    assert out.schema["kv_independent"] == pl.Boolean
    assert out["segment"].to_list() == [case[1] for case in SEGMENT_CASES]
    assert out["recipe"].to_list() == [case[2] for case in SEGMENT_CASES]
    unmatched = out.filter(pl.col("recipe").is_null())
    assert unmatched.height == 2 and set(unmatched["segment"]) == {"other"}
    assert recipes.classify(names_frame([])).height == 0


@pytest.mark.parametrize(
    "nvfp4,fp8",
    [
        (H200_PREFILL_NVFP4, flashinfer_fa2(1, "__nv_fp8_e4m3")),
        (flashinfer_fa2(0, "__nv_fp4x2_e2m1", DECODE_TILES), H200_DECODE_FP8),
        (
            flashinfer_fa2(1, "__nv_fp4x2_e2m1", params="flashinfer::BatchPrefillPagedParams<__nv_bfloat16, "
                           "__nv_fp4x2_e2m1, __nv_bfloat16, int>"),
            flashinfer_fa2(1, "__nv_fp8_e4m3", params="flashinfer::BatchPrefillPagedParams<__nv_bfloat16, "
                           "__nv_fp8_e4m3, __nv_bfloat16, int>"),
        ),
        (REFERENCE_FA2_NVFP4, REFERENCE_FA2_FP8),
        (TRTLLM_CONTEXT_NVFP4, TRTLLM_CONTEXT_NVFP4.replace("KvE2m1", "KvE4m3")),
        (TRTLLM_GEN_NVFP4, TRTLLM_GEN_NVFP4.replace("KvE2m1", "KvE4m3")),
    ],
)
def test_fp8_and_nvfp4_builds_share_a_family(recipes, nvfp4, fp8):
    a, b = recipes.classify_one(nvfp4), recipes.classify_one(fp8)
    assert a.family == b.family and a.family_label == b.family_label
    assert (a.kv_dtype, b.kv_dtype) == ("nvfp4", "fp8_e4m3")
    assert "{kv}" in a.family


def test_builder_reproduces_the_real_names():
    assert flashinfer_fa2(1, "__nv_fp4x2_e2m1") == H200_PREFILL_NVFP4
    assert flashinfer_fa2(0, "__nv_fp8_e4m3", DECODE_TILES) == H200_DECODE_FP8


def test_only_the_kv_slot_is_abstracted(recipes):
    family = recipes.classify_one(H200_PREFILL_NVFP4).family
    assert family == H200_PREFILL_NVFP4.removeprefix("void ").removesuffix("(T2)").replace("__nv_fp4x2_e2m1", "{kv}")
    other_tile = recipes.classify_one(flashinfer_fa2(1, "__nv_fp8_e4m3", (64, 1, 4, 8, 8, 4, 1))).family
    assert other_tile != family


def test_mask_mode_splits_prefill_from_decode(recipes):
    prefill = recipes.classify_one(flashinfer_fa2(1, "__nv_fp8_e4m3"))
    decode = recipes.classify_one(flashinfer_fa2(0, "__nv_fp8_e4m3"))  # same tiles: only the mask differs
    assert (prefill.segment, decode.segment) == ("prefill_attention", "decode_attention")
    assert prefill.family != decode.family
    assert prefill.family_label == "BatchPrefillWithPagedKVCacheKernel[MaskMode=1]"
    assert decode.family_label == "BatchPrefillWithPagedKVCacheKernel[MaskMode=0]"


def test_mask_modes_without_a_source_stay_unclassified(recipes):
    custom_mask = recipes.classify_one(flashinfer_fa2(2, "__nv_fp8_e4m3"))
    assert (custom_mask.segment, custom_mask.recipe, custom_mask.kv_dtype) == ("other", None, "fp8_e4m3")


def test_reshape_and_cache_flash_is_kv_append_with_both_slots_abstracted(recipes):
    fp8, auto = recipes.classify_one(RESHAPE_FP8), recipes.classify_one(RESHAPE_AUTO)
    assert fp8.segment == auto.segment == "kv_append"
    assert fp8.family == auto.family == "vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, {kv}, {kv}>"
    assert (fp8.kv_dtype, auto.kv_dtype) == ("fp8_e4m3", "bf16")
    e5m2 = recipes.classify_one(RESHAPE_FP8.replace("DataType)1", "DataType)2"))
    assert e5m2.kv_dtype == "fp8_e5m2"


def test_kv_dtype_is_only_reported_for_kv_kernels(recipes):
    fp8_gemm = recipes.classify_one(
        "void cutlass::device_kernel<vllm::cutlass_3x_gemm<cutlass::float_e4m3_t, cutlass::bfloat16_t>::GemmKernel>"
        "(T1::Params)"
    )
    assert (fp8_gemm.segment, fp8_gemm.kv_dtype, fp8_gemm.family_label) == ("gemm", None, "cutlass_3x_gemm")
    assert "cutlass::float_e4m3_t" in fp8_gemm.family
    writer = recipes.classify_one(RESHAPE_NVFP4)
    assert writer.kv_dtype == "nvfp4"
    assert writer.family == "vllm::reshape_and_cache_nvfp4_kernel<__nv_bfloat16, (vllm::NVFP4KVScaleSearch)0>"


def test_cuda_core_decode_reads_the_kv_dtype_from_its_params_type(recipes):
    decode = (
        "void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, (unsigned int)2, "
        "(unsigned int)4, (unsigned int)8, (unsigned int)16, (unsigned int)1, (unsigned int)8, "
        "flashinfer::DefaultAttention<(bool)0, (bool)0, (bool)0, (bool)0>, flashinfer::BatchDecodeParams<"
        "__nv_bfloat16, {}, __nv_bfloat16, int>>(T9)"
    )
    fp8 = recipes.classify_one(decode.format("__nv_fp8_e4m3"))
    bf16 = recipes.classify_one(decode.format("__nv_bfloat16"))
    assert fp8.family == bf16.family and (fp8.kv_dtype, bf16.kv_dtype) == ("fp8_e4m3", "bf16")
    jit_build = recipes.classify_one(JIT_DECODE)
    assert (jit_build.recipe, jit_build.kv_dtype) == ("flashinfer.toml:cuda-core-decode", None)


def test_parser_handles_nested_templates_and_parameter_lists():
    name = parse_kernel_name(H200_PREFILL_NVFP4)
    assert name.base == "BatchPrefillWithPagedKVCacheKernel"
    assert name.key.endswith("PagedParams>") and name.text[name.key_end :] == "(T2)"
    traits = [a.text for a in name.args if a.template == "flashinfer::KernelTraits"]
    assert len(traits) == 15 and traits[0] == "(flashinfer::MaskMode)1" and traits[10] == "__nv_fp4x2_e2m1"
    assert traits[1] == "(unsigned int)128"
    assert traits[14] == "flashinfer::DefaultAttention<(bool)0, (bool)0, (bool)0, (bool)0>"
    copy = parse_kernel_name(H200_COPY)
    assert copy.base == "unrolled_elementwise_kernel" and copy.text[copy.key_end :] == "(int, T1, T2, T4, T5, T6, T7)"


@pytest.mark.parametrize(
    "demangled,base,key,args",
    [
        (
            "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 3, 128, 1>("
            "at::native::(anonymous namespace)::CatArrInputTensorMetadata<T1, T2, T4, T5>, int)",
            "CatArrayBatchedCopy",
            "at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 3, 128, 1>",
            [("float", 0), ("unsigned int", 1), ("3", 2), ("128", 3), ("1", 4)],
        ),
        ("void ns::operator<< <int>(int)", "operator<<", "ns::operator<< <int>", [("int", 0)]),
        (
            "void k<&ns::operator< <int>, (3<4), (2>1)>(bool (*)(int, int)) const",
            "k",
            "k<&ns::operator< <int>, (3<4), (2>1)>",
            [("int", 0), ("&ns::operator< <int>", 0), ("(3<4)", 1), ("(2>1)", 2)],
        ),
        ("void f<std::less<void>::operator()<int>>(int)", "f", "f<std::less<void>::operator()<int>>",
         [("void", 0), ("int", 0), ("std::less<void>::operator()<int>", 0)]),
        ("void g<ns::Functor<float>::{lambda(int)#1}, 4>(T1)", "g", "g<ns::Functor<float>::{lambda(int)#1}, 4>",
         [("float", 0), ("ns::Functor<float>::{lambda(int)#1}", 0), ("4", 1)]),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", []),
        ("kernel_mha", "kernel_mha", "kernel_mha", []),
        ("void  truncated<int, (a<b)>(int, fl", "truncated", "truncated<int, (a<b)>", [("int", 0), ("(a<b)", 1)]),
    ],
)
def test_parser_edge_cases(demangled, base, key, args):
    name = parse_kernel_name(demangled)
    assert (name.base, name.key) == (base, key)
    assert sorted((a.text, a.index) for a in name.args if a.end <= name.key_end) == sorted(args)
    assert all(name.text[a.start : a.end] == a.text for a in name.args)


def test_files_are_ordered_and_every_shipped_rule_cites_a_source(recipes):
    assert recipes.files == (
        "kvtrace.recipes/flashinfer.toml", "kvtrace.recipes/vllm.toml", "kvtrace.recipes/torch.toml",
        "kvtrace.recipes/common.toml",
    )
    assert all(rule.source for rule in recipes.rules)
    assert not any(rule.pattern.pattern in (".*", "") for rule in recipes.rules)  # no catch-all


def write(tmp_path: Path, text: str, name: str = "mine.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_user_recipe_overrides_a_shipped_rule(tmp_path):
    user = write(tmp_path, """
order = 5
[[rule]]
id = "writer-as-memory"
segment = "memory"
match = 'reshape_and_cache_flash_kernel'
""")
    recipes = load_recipes([user])
    assert recipes.files[0] == str(user)
    result = recipes.classify_one(RESHAPE_FP8)
    assert (result.segment, result.recipe) == ("memory", "mine.toml:writer-as-memory")
    assert recipes.classify_one(flashinfer_fa2(1, "__nv_fp8_e4m3")).recipe == "flashinfer.toml:fa2-paged-prefill"


def test_kv_independent_marks_the_drift_controls(recipes, tmp_path):
    """Weight GEMMs, norms and activations cannot see the KV format; attention, append, quantize (the FP8
    cast) and MoE (routing follows the activations) can. A user rule is KV-dependent unless it says so."""
    by_segment = {}
    for rule in recipes.rules:
        by_segment.setdefault(rule.segment, set()).add(rule.kv_independent)
    assert by_segment["gemm"] == by_segment["norm"] == by_segment["activation"] == {True}
    for segment in ("prefill_attention", "decode_attention", "kv_append", "quantize", "moe", "memory", "other"):
        assert by_segment[segment] == {False}, segment
    user = write(tmp_path, "[[rule]]\nid='a'\nsegment='gemm'\nmatch='my_gemm'\n")
    assert load_recipes([user]).classify_one("void my_gemm()").kv_independent is False
    assert recipes.classify_one("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT").kv_independent is True


def test_user_rules_with_template_and_grid_conditions(tmp_path):
    user = write(tmp_path, """
description = "split tiny-query chunked prefill from long prefill by grid size"
[[rule]]
id = "tiny-chunk-prefill"
segment = "decode_attention"
match = 'BatchPrefillWithPagedKVCacheKernel'
template = { "flashinfer::MaskMode" = [1, "2"], "KernelTraits[1]" = "(unsigned int)128" }
grid_x = "<=4"
kv_slots = ["KernelTraits[10]"]
""")
    recipes = load_recipes([user])
    frame = names_frame([flashinfer_fa2(1, "__nv_fp8_e4m3")] * 2).with_columns(pl.Series("grid_x", [2, 300]))
    out = recipes.classify(frame)
    assert out["recipe"].to_list() == ["mine.toml:tiny-chunk-prefill", "flashinfer.toml:fa2-paged-prefill"]
    assert out["family_label"].to_list() == [
        "BatchPrefillWithPagedKVCacheKernel[MaskMode=1,KernelTraits[1]=(unsigned int)128]",
        "BatchPrefillWithPagedKVCacheKernel[MaskMode=1]",
    ]
    small_tile = flashinfer_fa2(1, "__nv_fp8_e4m3", (64, 1, 4, 8, 8, 4, 1))
    assert recipes.classify_one(small_tile, {"grid_x": 2}).recipe == "flashinfer.toml:fa2-paged-prefill"


def test_user_files_keep_command_line_order(tmp_path):
    body = '[[rule]]\nid = "r"\nsegment = "{}"\nmatch = "kernel_mha"\n'
    first = write(tmp_path, body.format("gemm"), "first.toml")
    second = write(tmp_path, body.format("moe"), "second.toml")
    assert load_recipes([first, second]).classify_one("kernel_mha").recipe == "first.toml:r"
    assert load_recipes([second, first]).classify_one("kernel_mha").recipe == "second.toml:r"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("order = \n", "not valid TOML"),
        ("orde = 1\n[[rule]]\nid='a'\nsegment='gemm'\nmatch='x'\n", "unknown top-level key 'orde'"),
        ("order = 'first'\n[[rule]]\nid='a'\nsegment='gemm'\nmatch='x'\n", "integer `order`"),
        ("order = 1\n", "has no [[rule]] tables"),
        ("[[rule]]\nid='a'\nsegment='gemm'\nmatch='x'\nsegmnt='gemm'\n", "rule 'a' (#1): unknown key 'segmnt'"),
        ("[[rule]]\nid='a'\nsegment='attention'\nmatch='x'\n", "rule 'a' (#1): unknown segment 'attention'"),
        ("[[rule]]\nid='a'\nsegment='gemm'\nmatch='gemm('\n", "rule 'a' (#1): `match` is not a valid Python regex"),
        ("[[rule]]\nid='a'\nsegment='gemm'\n", "rule 'a' (#1): `match` is missing"),
        ("[[rule]]\nsegment='gemm'\nmatch='x'\n", "rule #1: `id` is missing"),
        ("[[rule]]\nid='a'\nsegment='gemm'\nmatch='x'\ntemplate={ 'Mask Mode' = '1' }\n", "bad template condition"),
        ("[[rule]]\nid='a'\nsegment='gemm'\nmatch='x'\ngrid_y='more than 1'\n", "bad `grid_y` condition"),
        ("[[rule]]\nid='a'\nsegment='gemm'\nmatch='x'\nkv_slots='KernelTraits[x]'\n", "bad `kv_slots`"),
        ("[[rule]]\nid='a'\nsegment='gemm'\nmatch='x'\nkv_enum={ E = ['auto'] }\n", "bad `kv_enum`"),
        ("[[rule]]\nid='a'\nsegment='gemm'\nmatch='x'\nkv_dtype='nvfp4'\nkv_slots=['K[1]']\n", "`kv_dtype`"),
        ("[[rule]]\nid='a'\nsegment='gemm'\nmatch='x'\n[[rule]]\nid='a'\nsegment='moe'\nmatch='y'\n", "duplicate id"),
        ("[[rule]]\nid='a'\nsegment='gemm'\nmatch='x'\nkv_independent='yes'\n", "`kv_independent` is not a boolean"),
    ],
)
def test_bad_user_recipe_raises_one_line_naming_file_and_fix(tmp_path, text, expected):
    path = write(tmp_path, text, "bad-recipe.toml")
    with pytest.raises(KvtraceError) as raised:
        load_recipes([path])
    message = str(raised.value)
    assert expected in message and "bad-recipe.toml" in message and "\n" not in message
    assert ";" in message  # problem; fix


def test_unreadable_user_recipe(tmp_path):
    with pytest.raises(KvtraceError, match="missing.toml: cannot be read"):
        load_recipes([tmp_path / "missing.toml"])
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(KvtraceError, match="binary.toml: not UTF-8"):
        load_recipes([binary])


def fixture_names() -> list[str]:
    names: set[str] = set()
    # The real run directories only (REAL_SQLITE leaves out fixtures/bad, whose exports have no kernels on purpose).
    for path in REAL_SQLITE.values():
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            names.update(
                row[0]
                for row in db.execute(
                    "SELECT DISTINCT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                    "JOIN StringIds s ON s.id = k.demangledName"
                )
            )
    return sorted(names)


def test_every_attention_and_append_kernel_in_the_real_fixtures_is_classified(recipes):
    results = {name: recipes.classify_one(name) for name in fixture_names()}
    kv_kernels = {n: r for n, r in results.items() if "KVCache" in n or "reshape_and_cache" in n or "kernel_mha" in n}
    assert kv_kernels and all(r.segment != "other" for r in kv_kernels.values())
    by_family: dict[str, set] = {}
    for result in kv_kernels.values():
        by_family.setdefault(result.family, set()).add(result.kv_dtype)
    # The FP8 and NVFP4 arms' prefill kernels meet in one family.
    assert any({"fp8_e4m3", "nvfp4"} <= dtypes for dtypes in by_family.values())


def test_attention_kernels_are_never_gemm_drift_controls(recipes):
    """FlashInfer's FA3 prefill kernels in the real H200 vLLM traces carry "cutlass" in their template arguments;
    were the attention rules to miss them, the generic GEMM rule must not file them as KV-independent."""
    gemm = next(rule for rule in recipes.rules if rule.recipe == "common.toml:gemm")
    names = set()
    for arm in ("auto", "fp8"):
        with sqlite3.connect(f"file:{VLLM_COLD_PREFILL / f'{arm}.sqlite'}?mode=ro", uri=True) as db:
            names |= {name for (name,) in db.execute(
                "SELECT DISTINCT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.demangledName")}
    cutlass_attention = {name for name in names if "cutlass" in name and "PrefillWithKVCacheKernel" in name}
    assert len(cutlass_attention) == 2
    for name in cutlass_attention:
        assert gemm.match_name(parse_kernel_name(name)) is None
        assert recipes.classify_one(name).segment == "prefill_attention"
    fmha = "void cutlass::device_kernel<cutlass::fmha::kernel::Sm100FmhaFwdKernelTmaWarpspecialized<int>>(T1::Params)"
    assert not recipes.classify_one(fmha).kv_independent
    gemms = {name for name in names if recipes.classify_one(name).segment == "gemm"}
    assert gemms and all(gemm.match_name(parse_kernel_name(name)) for name in gemms)
