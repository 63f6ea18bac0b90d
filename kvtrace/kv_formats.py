"""KV-cache formats: their canonical names, the words that name them (vLLM's --kv-cache-dtype, model dtypes,
C++ types in kernel names, the labels people give arms), and the bytes a token occupies in each.

Canonical formats: fp8 (E4M3 or E5M2, one byte per value), nvfp4 (two E2M1 values per byte plus one E4M3
scale per 16 values along head_dim, as FlashInfer's FA2 kernels read it, flashinfer PR #3097), bf16 and fp16.
Kernel names are finer: they say fp8_e4m3 or fp8_e5m2, and "auto" where vLLM's Fp8KVCacheDataType leaves the
cache in the model dtype.

Standard library only: capture imports it on the GPU box, the analyzer everywhere else.
"""

from __future__ import annotations

from kvtrace.errors import KvtraceError

FORMATS = ("fp8", "nvfp4", "bf16", "fp16")
NVFP4_BLOCK = 16  # values per E4M3 scale

# vLLM's --kv-cache-dtype values that a vLLM capture accepts as arms.
VLLM_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_4over6")

# Names as users, vLLM's --kv-cache-dtype and manifests spell them -> format. "auto" is the model dtype.
_FORMAT_OF_NAME = {"fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "fp8_e4m3fn": "fp8", "nvfp4": "nvfp4",
                   "nvfp4_4over6": "nvfp4", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                   "half": "fp16"}
_FORMAT_OF_MODEL_DTYPE = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16"}

# C++ types in demangled kernel names -> the dtype label kvtrace reports for a kernel's KV cache.
KERNEL_DTYPE_LABELS = {
    "__nv_fp4x2_e2m1": "nvfp4",
    "__nv_fp4_e2m1": "nvfp4",
    "cutlass::float_e2m1_t": "nvfp4",
    "E2m1": "nvfp4",  # trtllm-gen cubin names, e.g. `KvE2m1`
    "__nv_fp8_e4m3": "fp8_e4m3",
    "cutlass::float_e4m3_t": "fp8_e4m3",
    "c10::Float8_e4m3fn": "fp8_e4m3",
    "E4m3": "fp8_e4m3",
    "__nv_fp8_e5m2": "fp8_e5m2",
    "cutlass::float_e5m2_t": "fp8_e5m2",
    "c10::Float8_e5m2": "fp8_e5m2",
    "E5m2": "fp8_e5m2",
    "__nv_bfloat16": "bf16",
    "cutlass::bfloat16_t": "bf16",
    "c10::BFloat16": "bf16",
    "Bfloat16": "bf16",
    "half": "fp16",
    "__half": "fp16",
    "cutlass::half_t": "fp16",
    "c10::Half": "fp16",
    "Fp16": "fp16",
    "float": "fp32",
    "unsigned char": "uint8",
    "uint8_t": "uint8",
    "unsigned short": "uint16",
    "uint16_t": "uint16",
}
# Labels that say how bytes are held, not how they are encoded: another slot of the same kernel (e.g. vLLM's
# Fp8KVCacheDataType) names the encoding, so these lose to any other label.
STORAGE_LABELS = frozenset({"uint8", "uint16", "auto"})

# Kernel dtype label -> words in an arm's label that claim it ("fp8" is a substring of nothing else, "fp4"
# only of nvfp4), for spotting swapped arms.
_LABEL_WORDS = {"nvfp4": ("nvfp4", "fp4"), "fp8_e4m3": ("fp8",), "fp8_e5m2": ("fp8",), "bf16": ("bf16", "auto"),
                "fp16": ("fp16", "auto"), "auto": ("auto", "bf16")}


# A counterfactual arm (capture/vllm_patches) is a KV dtype recorded with a named engine patch: `--arms
# nvfp4:validate-once` on the command line, `nvfp4-validate-once` in its run names and files.
PATCH_SEPARATORS = (":", "-")


def patched_arm_label(kv_dtype: str, patch: str) -> str:
    return f"{kv_dtype}{PATCH_SEPARATORS[1]}{patch}"


def split_arm_label(label: str) -> tuple[str, str | None] | None:
    """(vLLM --kv-cache-dtype, patch name or None) of an arm label such as fp8, nvfp4:validate-once or
    nvfp4-validate-once; None when the label starts with no known KV dtype."""
    lowered = label.lower()
    for dtype in sorted(VLLM_KV_CACHE_DTYPES, key=len, reverse=True):
        if lowered == dtype:
            return dtype, None
        if lowered.startswith(dtype) and lowered[len(dtype):len(dtype) + 1] in PATCH_SEPARATORS \
                and len(lowered) > len(dtype) + 1:
            return dtype, label[len(dtype) + 1:]
    return None


def canonical_format(name: str, model_dtype: str | None = None) -> str:
    """fp8, nvfp4, bf16 or fp16 for a format or vLLM --kv-cache-dtype name (a patched arm's label names its KV
    dtype); 'auto' follows the model dtype."""
    key = name.lower()
    if key not in _FORMAT_OF_NAME and key != "auto" and split_arm_label(key):
        key = split_arm_label(key)[0]
    if key == "auto":
        return _FORMAT_OF_MODEL_DTYPE.get((model_dtype or "bfloat16").lower(), "bf16")
    if key not in _FORMAT_OF_NAME:
        raise KvtraceError(f"unknown KV format {name!r}: use fp8, nvfp4, bf16, fp16 or a vLLM --kv-cache-dtype "
                           "such as auto, fp8_e4m3 or nvfp4")
    return _FORMAT_OF_NAME[key]


def kernel_dtype_label(token: str) -> str:
    """The dtype label ("nvfp4", "fp8_e4m3", "bf16", ...) of a C++ type token; unknown tokens verbatim."""
    return KERNEL_DTYPE_LABELS.get(token, token)


def claimed_dtypes(label: str) -> set[str]:
    """Kernel dtype labels that an arm's label names, e.g. {"fp8_e4m3", "fp8_e5m2"} for "fp8-run"."""
    lowered = label.lower()
    return {dtype for dtype, words in _LABEL_WORDS.items() if any(word in lowered for word in words)}


# ---- bytes ---------------------------------------------------------------------------------------------

def kv_bytes_per_token_head(kv_format: str, head_dim: int) -> float:
    """Bytes of one cached row of head_dim values for one token: one KV head's K or V alone, or an MLA latent
    (which vLLM caches as a single KV head of kv_lora_rank + qk_rope_head_dim values)."""
    if kv_format in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return float(head_dim)
    if kv_format == "nvfp4":
        if head_dim % NVFP4_BLOCK:
            raise ValueError(f"NVFP4 needs head_dim divisible by {NVFP4_BLOCK}, got {head_dim}")
        return head_dim / 2 + head_dim / NVFP4_BLOCK
    if kv_format in ("bf16", "fp16", "auto"):
        return 2.0 * head_dim
    raise ValueError(f"unknown KV format {kv_format!r}: use fp8, nvfp4 or bf16")


def kv_bytes_per_token(kv_format: str, *, head_dim: int, kv_heads: int, layers: int = 1) -> float:
    """K and V of every layer for `kv_heads` heads: 2·L·H·(bytes per head-dim row)."""
    return kv_bytes_per_token_head(kv_format, head_dim) * kv_heads * 2 * layers


def kv_cache_bytes(kv_format: str, *, tokens_per_sequence: int, sequences: int, num_kv_heads: int,
                   head_dim: int, page_size: int, layers: int = 1) -> int:
    """Bytes of K and V held for `sequences` of `tokens_per_sequence`, whole pages included."""
    pages = -(-tokens_per_sequence // page_size) * sequences
    per_slot = kv_bytes_per_token(kv_format, head_dim=head_dim, kv_heads=num_kv_heads, layers=layers)
    return int(pages * page_size * per_slot)


def bytes_per_value(name: str, model_dtype: str | None = None) -> float:
    """Bytes per stored value of a format or vLLM --kv-cache-dtype name (0 when unknown), NVFP4's scales
    included: what orders arms widest (the baseline) first."""
    try:
        return kv_bytes_per_token_head(canonical_format(name, model_dtype), NVFP4_BLOCK) / NVFP4_BLOCK
    except KvtraceError:
        return 0.0
