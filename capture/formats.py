"""KV-cache quantizers: FP8 E4M3 and packed NVFP4, in FlashInfer's paged layout (their byte costs are
kvtrace.kv_formats').

NVFP4 here is what FlashInfer's FA2 kernels read (flashinfer PR #3097, `kv_cache_sf` docstring in
`flashinfer/prefill.py`): two E2M1 codes per uint8 (even element in the low nibble), one float8_e4m3fn
scale per 16 consecutive values along head_dim (linear layout), and one float32 global decode scale per
tensor passed as `k_scale` / `v_scale`, so that value = e2m1 * block_scale * global_scale.
FlashInfer's own quantizer needs SM100 (PTX cvt to e2m1); this one is plain torch and runs anywhere.

The functions import torch when called; importing the module does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.kv_formats import NVFP4_BLOCK

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Magnitudes of the eight positive E2M1 codes 0..7; bit 3 is the sign.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class NVFP4Tensor:
    data: "torch.Tensor"  # uint8, [..., D/2]
    scales: "torch.Tensor"  # float8_e4m3fn, [..., D/16]
    global_scale: float  # decode scale: value = e2m1 * scale * global_scale


def nvfp4_global_scale(x: "torch.Tensor") -> float:
    """Decode scale that maps the tensor's absolute maximum onto E2M1_MAX * E4M3_MAX."""
    amax = float(x.abs().max())
    return amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0


def _e2m1_codes(scaled: "torch.Tensor") -> "torch.Tensor":
    """Round to the nearest E2M1 value (ties to the even code, as the hardware cvt does)."""
    import torch

    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=scaled.device)
    magnitude = scaled.abs().clamp(max=E2M1_MAX)
    # Midpoints between neighbouring grid values; bucketize gives the code of the nearest value.
    midpoints = (grid[1:] + grid[:-1]) / 2
    code = torch.bucketize(magnitude, midpoints, right=False)
    # On an exact midpoint bucketize picks the lower code; move to the upper one when that is even.
    on_midpoint = (code < 7) & (magnitude == midpoints[code.clamp(max=6)])
    code = torch.where(on_midpoint & (code % 2 == 1), code + 1, code)
    sign = (scaled < 0).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def nvfp4_quantize(x: "torch.Tensor", global_scale: float | None = None,
                   low_nibble_first: bool = True) -> NVFP4Tensor:
    """Quantize along the last dimension (a multiple of 16) into packed NVFP4.

    `low_nibble_first=False` packs the even element into the high nibble: only for checking, on the
    GPU, which order FlashInfer's kernel reads.
    """
    import torch

    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {NVFP4_BLOCK}")
    gs = nvfp4_global_scale(x) if global_scale is None else float(global_scale)
    values = x.float().reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    block_amax = values.abs().amax(dim=-1, keepdim=True)
    scales = (block_amax / (E2M1_MAX * gs)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    # Divide by the scale as stored (rounded to e4m3), so dequantization inverts exactly what was used.
    denominator = scales.float() * gs
    scaled = torch.where(denominator > 0, values / denominator, torch.zeros_like(values))
    codes = _e2m1_codes(scaled).reshape(*x.shape[:-1], -1)
    even, odd = codes[..., 0::2], codes[..., 1::2]
    packed = even | (odd << 4) if low_nibble_first else odd | (even << 4)
    return NVFP4Tensor(packed.contiguous(), scales.squeeze(-1).contiguous(), gs)


def nvfp4_dequantize(q: NVFP4Tensor, dtype=None, low_nibble_first: bool = True) -> "torch.Tensor":
    import torch

    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=q.data.device)
    low, high = q.data & 0x0F, q.data >> 4
    even, odd = (low, high) if low_nibble_first else (high, low)
    codes = torch.stack((even, odd), dim=-1).reshape(*q.data.shape[:-1], -1)
    magnitude = grid[(codes & 0x07).long()]
    values = torch.where((codes & 0x08) != 0, -magnitude, magnitude)
    scales = q.scales.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return (values * scales * q.global_scale).to(dtype or torch.float32)


def fp8_quantize(x: "torch.Tensor", scale: float | None = None) -> tuple["torch.Tensor", float]:
    """Per-tensor FP8 E4M3 with a decode scale (value = fp8 * scale), as `k_scale`/`v_scale` take it."""
    import torch

    amax = float(x.abs().max())
    scale = (amax / E4M3_MAX if amax > 0 else 1.0) if scale is None else float(scale)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
