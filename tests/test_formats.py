"""capture/formats.py (quantizers), kvtrace/kv_formats.py (bytes) and the paged cache the FlashInfer workload
builds, on the CPU.

Every expected value is derived here, independently of the code under test: the E2M1 and E4M3 roundings
are re-implemented in float64 numpy from their definitions (E2M1: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6},
sign in bit 3, round to nearest with ties to the even code, saturate at 6; E4M3 "fn": 3 mantissa bits,
exponent bias 7, subnormal step 2**-9, largest finite 448, round to nearest even), and byte counts from
bit widths (4 bits per value, one 8-bit scale per 16 values, 8 bits per FP8 value).
"""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import NSYS2025_DIR  # noqa: E402
from kvtrace import kv_formats  # noqa: E402
from kvtrace.capture import formats  # noqa: E402
from kvtrace.capture.flashinfer_workload import PagedCache  # noqa: E402


# Definitions, written out here rather than imported from the module under test.
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1 magnitudes of codes 0..7
E2M1_MAX = GRID[-1]
E4M3_MAX = (1 + 6 / 8) * 2.0 ** (15 - 7)  # largest finite E4M3fn: exponent field 15, mantissa 110b -> 448
E4M3_MIN_NORMAL_EXP = 1 - 7  # -6
BLOCK = 16


# ---------------------------------------------------------------------------------------------------------
# float64 references


def ref_e4m3(x) -> np.ndarray:
    """Round to the nearest E4M3fn value (ties to even), saturating at 448; sign kept."""
    x = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(x), E4M3_MAX)
    out = np.zeros_like(mag)
    nz = mag > 0
    _, exp = np.frexp(mag[nz])  # mag = m * 2**exp, m in [0.5, 1): floor(log2 mag) = exp - 1
    exp = np.maximum(exp - 1, E4M3_MIN_NORMAL_EXP)  # below 2**-6 the quantum stays 2**-9 (subnormals)
    quantum = 2.0 ** (exp - 3)
    out[nz] = np.minimum(np.round(mag[nz] / quantum) * quantum, E4M3_MAX)  # np.round: half to even
    return np.copysign(out, x)


def ref_e2m1_magnitude_code(mag: np.ndarray) -> np.ndarray:
    """Code 0..7 of the nearest grid value to each magnitude; on a tie the even code; saturating at 6."""
    mag = np.minimum(np.asarray(mag, dtype=np.float64), E2M1_MAX)
    distance = np.abs(mag[..., None] - GRID)
    nearest = distance == distance.min(axis=-1, keepdims=True)
    # At most two neighbours tie; of those pick the even code, otherwise the only one.
    even_pick = nearest & (np.arange(len(GRID)) % 2 == 0)
    has_tie = nearest.sum(axis=-1) > 1
    return np.where(has_tie, even_pick.argmax(axis=-1), nearest.argmax(axis=-1)).astype(np.uint8)


def ref_nvfp4_details(x: np.ndarray, global_scale: float | None = None, scales: np.ndarray | None = None) -> dict:
    """Reference quantization in float64: block scales before rounding ("pre"), rounded ("scales"), the
    scaled values fed to E2M1 rounding ("scaled"), the codes (sign in bit 3) and the global scale ("gs").

    With the global scale derived from the tensor (gs = amax / (6 * 448)), the intended block scale is
    block_amax / (6 * gs) = block_amax * 448 / amax and the intended scaled value v / (scale * gs) =
    v * 6 * 448 / (scale * amax). Written that way, each is one correctly rounded float64 division of exact
    products (inputs have at most 24 significant bits), so an exact tie stays an exact tie. `scales`
    overrides the rounded block scales (to derive codes from the scales the module chose).
    """
    x = np.asarray(x, dtype=np.float64)
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    block_amax = np.abs(blocks).max(axis=-1)
    amax = np.abs(x).max()
    derived = global_scale is None and amax > 0
    if derived:
        gs = amax / (E2M1_MAX * E4M3_MAX)
        pre = block_amax * E4M3_MAX / amax
    else:
        gs = 1.0 if global_scale is None else float(global_scale)
        pre = np.minimum(block_amax / (E2M1_MAX * gs), E4M3_MAX)
    if scales is None:
        scales = ref_e4m3(pre)
    s = scales[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        if derived:
            scaled = np.where(s > 0, blocks * (E2M1_MAX * E4M3_MAX) / (s * amax), 0.0)
        else:
            scaled = np.where(s * gs > 0, blocks / (s * gs), 0.0)
    codes = ref_e2m1_magnitude_code(np.abs(scaled)) | ((scaled < 0).astype(np.uint8) << 3)
    return {"pre": pre, "scales": scales, "scaled": scaled.reshape(x.shape), "codes": codes.reshape(x.shape),
            "gs": gs}


def ref_nvfp4(x: np.ndarray, global_scale: float | None = None):
    """(codes [..., D], block scales [..., D/16], global scale) of the reference quantization."""
    d = ref_nvfp4_details(x, global_scale)
    return d["codes"], d["scales"], d["gs"]


def assert_nvfp4_matches_reference(q, x: torch.Tensor, global_scale: float | None = None) -> int:
    """Code-for-code and scale-for-scale comparison with the reference; returns how many were exact ties.

    Where the intended (exact) value sits exactly on a midpoint -- a block scale halfway between two E4M3
    values, or a scaled value halfway between two E2M1 values -- the module works with the float32 global
    scale the kernel receives (amax / 2688 is rarely representable), which moves the value by an ulp to one
    side; both neighbours are then equally near, and either is accepted. Random float32 data has none of
    these; bf16 data (few significant bits) occasionally does.
    """
    x64 = x.double().numpy()
    ref = ref_nvfp4_details(x64, global_scale)
    assert q.global_scale == pytest.approx(ref["gs"], rel=1e-12)
    got_scales = scales64(q)
    pre = ref["pre"]
    below, above = ref_e4m3(np.nextafter(pre, 0)), ref_e4m3(np.nextafter(pre, np.inf))
    scale_tie = (below != above) & (pre == (below + above) / 2)
    scale_ok = (got_scales == ref["scales"]) | (scale_tie & ((got_scales == below) | (got_scales == above)))
    assert scale_ok.all(), f"block scales differ from the reference at {np.argwhere(~scale_ok)[:5].tolist()}"

    given = ref_nvfp4_details(x64, global_scale, scales=got_scales)
    got_codes = unpack_codes(q.data, low_nibble_first=True)
    magnitude = np.minimum(np.abs(given["scaled"]), E2M1_MAX)
    midpoints = (GRID[1:] + GRID[:-1]) / 2
    lower = np.searchsorted(midpoints, magnitude)  # on a midpoint: the index of the lower neighbour's code
    code_tie = np.isin(magnitude, midpoints)
    same_sign = (got_codes & 0x8) == (given["codes"] & 0x8)
    tie_ok = code_tie & same_sign & (((got_codes & 0x7) == lower) | ((got_codes & 0x7) == lower + 1))
    code_ok = (got_codes == given["codes"]) | tie_ok
    assert code_ok.all(), f"codes differ from the reference at {np.argwhere(~code_ok)[:5].tolist()}"
    return int((got_scales != ref["scales"]).sum() + (got_codes != given["codes"]).sum())


def ref_decode(codes: np.ndarray, scales: np.ndarray, gs: float) -> np.ndarray:
    """value = e2m1 * block_scale * global_scale."""
    magnitude = GRID[codes & 0x7]
    values = np.where(codes & 0x8, -magnitude, magnitude)
    return values * np.repeat(scales, BLOCK, axis=-1) * gs


def unpack_codes(data: torch.Tensor, low_nibble_first: bool) -> np.ndarray:
    """The 4-bit codes in element order, read from the packed bytes by hand."""
    packed = data.numpy().astype(np.uint8)
    low, high = packed & 0x0F, packed >> 4
    even, odd = (low, high) if low_nibble_first else (high, low)
    return np.stack((even, odd), axis=-1).reshape(*packed.shape[:-1], -1)


def scales64(q) -> np.ndarray:
    return q.scales.float().double().numpy()


def random_normal(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def rel_error(approx, exact) -> float:
    approx, exact = np.asarray(approx, dtype=np.float64), np.asarray(exact, dtype=np.float64)
    return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


# ---------------------------------------------------------------------------------------------------------
# The references themselves (so that a wrong reference cannot make the comparisons pass vacuously)


def test_reference_e4m3_matches_its_definition_on_known_points():
    # Hand-derivable points: normals, the subnormal step, ties to even, saturation.
    points = {1.0: 1.0, 448.0: 448.0, 500.0: 448.0, 2.0 ** -9: 2.0 ** -9, 2.0 ** -11: 0.0,
              1 + 1 / 16: 1.0,  # tie between 1.0 (mantissa 000) and 1.125 (001): even mantissa
              1 + 3 / 16: 1.25,  # tie between 1.125 (001) and 1.25 (010): even mantissa
              3 * 2.0 ** -10: 2 * 2.0 ** -9}  # subnormal tie between 1 and 2 quanta: even -> 2
    got = ref_e4m3(np.array(list(points)))
    np.testing.assert_array_equal(got, np.array(list(points.values())))


def test_reference_e4m3_agrees_with_torch_float8_on_every_code():
    # Every finite positive E4M3 value and every midpoint between neighbours (ties) and slightly off them.
    every_code = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    mids = (every_code[1:] + every_code[:-1]) / 2
    probes = np.concatenate([every_code, mids, mids * (1 + 1e-6), mids * (1 - 1e-6)])
    from_torch = torch.from_numpy(probes).float().to(torch.float8_e4m3fn).double().numpy()
    np.testing.assert_array_equal(ref_e4m3(probes), from_torch)


# ---------------------------------------------------------------------------------------------------------
# NVFP4: codes, scales and layout against the reference


@pytest.mark.parametrize("shape", [(64, 128), (37, 4, 64), (3, 2, 5, 32)])
def test_nvfp4_random_data_code_for_code(shape):
    x = random_normal(*shape, seed=len(shape))
    q = formats.nvfp4_quantize(x)
    codes, scales, gs = ref_nvfp4(x.double().numpy())

    assert q.data.dtype == torch.uint8 and tuple(q.data.shape) == (*shape[:-1], shape[-1] // 2)
    assert q.scales.dtype == torch.float8_e4m3fn and tuple(q.scales.shape) == (*shape[:-1], shape[-1] // BLOCK)
    assert q.global_scale == pytest.approx(gs, rel=1e-12)
    # float32 random data has no exact ties: every scale and every code equals the reference.
    np.testing.assert_array_equal(scales64(q), scales)
    np.testing.assert_array_equal(unpack_codes(q.data, low_nibble_first=True), codes)
    assert assert_nvfp4_matches_reference(q, x) == 0


def test_nvfp4_bf16_data_matches_the_reference_up_to_exact_ties():
    # bf16 values have 8 significant bits, so intended values land exactly on midpoints now and then; there
    # the float32 global scale picks the neighbour (see assert_nvfp4_matches_reference). Everything else
    # must equal the reference, and the tolerance must not be what carries the comparison.
    x = random_normal(512, 8, 128, seed=4).to(torch.bfloat16)
    q = formats.nvfp4_quantize(x)
    decided_by_ties = assert_nvfp4_matches_reference(q, x)
    assert decided_by_ties < x.numel() * 0.01


def test_nvfp4_dequantize_is_code_times_block_scale_times_global_scale():
    x = random_normal(48, 2, 128, seed=7)
    q = formats.nvfp4_quantize(x)
    expected = ref_decode(unpack_codes(q.data, True), scales64(q), q.global_scale)
    got = formats.nvfp4_dequantize(q, dtype=torch.float64).numpy()
    # The module multiplies in float32: e2m1 * scale is exact, the global scale costs at most two roundings.
    np.testing.assert_allclose(got, expected, rtol=2 ** -23, atol=0)
    assert formats.nvfp4_dequantize(q).dtype == torch.float32
    assert formats.nvfp4_dequantize(q, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_nvfp4_global_scale_maps_tensor_amax_to_e2m1_max_times_e4m3_max():
    x = random_normal(16, 64, seed=3)
    amax = float(x.abs().max())
    assert formats.nvfp4_global_scale(x) == pytest.approx(amax / (E2M1_MAX * E4M3_MAX), rel=1e-12)
    assert formats.nvfp4_global_scale(torch.zeros(4, 16)) == 1.0
    # The block holding the tensor's absolute maximum gets the largest E4M3 scale, and that element code 7.
    q = formats.nvfp4_quantize(x)
    assert float(q.scales.float().max()) == E4M3_MAX
    flat_index = int(x.abs().argmax())
    assert unpack_codes(q.data, True).reshape(-1)[flat_index] & 0x7 == 7


def test_nvfp4_exact_grid_points_encode_exactly():
    # Global scale 1 and a 6.0 in every block: block scale 6/6 = 1, so the scaled values are the inputs.
    signed_grid = np.concatenate([GRID, -GRID[1:]])
    rows = []
    for shift in range(4):
        row = np.resize(np.roll(signed_grid, shift), BLOCK)
        row[-1] = 6.0
        rows.append(row)
    x = torch.tensor(np.array(rows), dtype=torch.float32)
    q = formats.nvfp4_quantize(x, global_scale=1.0)
    assert q.global_scale == 1.0
    np.testing.assert_array_equal(scales64(q), np.ones((4, 1)))
    codes = unpack_codes(q.data, True)
    np.testing.assert_array_equal(GRID[codes & 0x7] * np.where(codes & 0x8, -1, 1), np.array(rows))
    np.testing.assert_array_equal(formats.nvfp4_dequantize(q).numpy(), np.array(rows))


def test_nvfp4_midpoints_round_to_the_even_code():
    midpoints = (GRID[1:] + GRID[:-1]) / 2  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0
    lower = np.arange(len(midpoints))
    expected_codes = np.where(lower % 2 == 0, lower, lower + 1)  # the even one of (lower, lower + 1)
    row = np.zeros(BLOCK)
    row[:7], row[7:14] = midpoints, -midpoints
    row[14], row[15] = 6.0, 0.0  # fixes the block scale at 1
    q = formats.nvfp4_quantize(torch.tensor(row[None], dtype=torch.float32), global_scale=1.0)
    codes = unpack_codes(q.data, True)[0]
    np.testing.assert_array_equal(codes[:7], expected_codes)
    np.testing.assert_array_equal(codes[7:14], expected_codes | 0x8)
    # And the reference agrees on every one of them.
    np.testing.assert_array_equal(codes, ref_nvfp4(row[None], global_scale=1.0)[0][0])
    # Just off the midpoints, plain nearest rounding applies (both directions).
    for nudge, pick in ((1e-3, lower + 1), (-1e-3, lower)):
        off = row.copy()
        off[:7] = midpoints + nudge
        q = formats.nvfp4_quantize(torch.tensor(off[None], dtype=torch.float32), global_scale=1.0)
        np.testing.assert_array_equal(unpack_codes(q.data, True)[0][:7], pick)


def test_nvfp4_saturates_values_above_six_times_the_block_scale():
    gs = 1.0
    # (a) The block scale clamps at 448, so anything above 6 * 448 * gs saturates to code 7 (= 6 * 448).
    row = np.linspace(-1.0, 1.0, BLOCK) * 10_000.0
    q = formats.nvfp4_quantize(torch.tensor(row[None], dtype=torch.float32), global_scale=gs)
    assert float(q.scales.float()[0, 0]) == E4M3_MAX
    codes = unpack_codes(q.data, True)[0]
    beyond = np.abs(row) > E2M1_MAX * E4M3_MAX * gs
    assert beyond.any()
    np.testing.assert_array_equal(codes[beyond], np.where(row[beyond] < 0, 0xF, 0x7))
    np.testing.assert_array_equal(codes, ref_nvfp4(row[None], global_scale=gs)[0][0])
    # (b) The block scale rounds down in E4M3, so the block maximum lands above 6 and saturates.
    # amax / 6 = 1.0625 lies between E4M3 neighbours 1.0 and 1.125 and rounds (tie, even) to 1.0.
    amax = 6 * 1.0625
    assert ref_e4m3(amax / 6) == 1.0
    row = np.zeros(BLOCK)
    row[0], row[1] = amax, -amax
    q = formats.nvfp4_quantize(torch.tensor(row[None], dtype=torch.float32), global_scale=gs)
    assert float(q.scales.float()[0, 0]) == 1.0
    codes = unpack_codes(q.data, True)[0]
    assert codes[0] == 0x7 and codes[1] == 0xF
    np.testing.assert_array_equal(formats.nvfp4_dequantize(q).numpy()[0, :2], [6.0, -6.0])


def test_nvfp4_zeros_negative_zero_and_all_zero_blocks():
    x = torch.zeros(3, 4, 32)
    x[1, 2, 5] = -0.0
    q = formats.nvfp4_quantize(x)
    assert q.global_scale == 1.0
    assert torch.all(q.data == 0)
    assert torch.all(q.scales.float() == 0)
    deq = formats.nvfp4_dequantize(q)
    assert torch.all(deq == 0) and not torch.isnan(deq).any()
    # An all-zero block inside a non-zero tensor: scale 0, codes 0, decoded 0, no NaN from 0/0.
    y = random_normal(2, 64, seed=11)
    y[0, 16:32] = 0.0
    y[1, 40] = -0.0
    q = formats.nvfp4_quantize(y)
    assert float(q.scales.float()[0, 1]) == 0.0
    codes = unpack_codes(q.data, True)
    assert np.all(codes[0, 16:32] == 0)
    assert codes[1, 40] & 0x7 == 0  # -0.0 has magnitude code 0 (its sign bit is irrelevant: it decodes to 0)
    deq = formats.nvfp4_dequantize(q)
    assert torch.all(deq[0, 16:32] == 0) and float(deq[1, 40]) == 0.0
    assert not torch.isnan(deq).any()


def test_nvfp4_block_whose_scale_underflows_e4m3_decodes_to_zero():
    # With the global scale fixed by a large block, a tiny block's scale amax / (6 * gs) falls below half the
    # smallest E4M3 subnormal (2**-10) and rounds to zero: the block must decode to exact zeros, not NaN/inf.
    gs = 1.0
    tiny = 2.0 ** -10 * E2M1_MAX * gs * 0.5  # scale 2**-11 -> rounds to 0
    row = np.zeros(2 * BLOCK)
    row[:BLOCK] = np.linspace(-6.0, 6.0, BLOCK)
    row[BLOCK:] = np.linspace(-tiny, tiny, BLOCK)
    assert ref_e4m3(tiny / (E2M1_MAX * gs)) == 0.0
    q = formats.nvfp4_quantize(torch.tensor(row[None], dtype=torch.float32), global_scale=gs)
    assert float(q.scales.float()[0, 1]) == 0.0
    codes = unpack_codes(q.data, True)[0]
    assert np.all(codes[BLOCK:] & 0x7 == 0)
    deq = formats.nvfp4_dequantize(q).numpy()[0]
    np.testing.assert_array_equal(deq[BLOCK:], 0.0)
    np.testing.assert_array_equal(codes, ref_nvfp4(row[None], global_scale=gs)[0][0])
    # A block just above the underflow keeps the smallest subnormal scale and survives.
    small = 2.0 ** -9 * E2M1_MAX * gs
    row[BLOCK:] = np.linspace(-small, small, BLOCK)
    q = formats.nvfp4_quantize(torch.tensor(row[None], dtype=torch.float32), global_scale=gs)
    assert float(q.scales.float()[0, 1]) == 2.0 ** -9
    assert float(formats.nvfp4_dequantize(q)[0, -1]) == pytest.approx(small)


def test_nvfp4_random_data_with_a_global_scale_that_forces_subnormal_scales():
    # A global scale much larger than amax / 2688 pushes many block scales into the E4M3 subnormal range.
    x = random_normal(32, 64, seed=5) * torch.logspace(-4, 0, 32)[:, None]
    gs = 0.05
    q = formats.nvfp4_quantize(x, global_scale=gs)
    codes, scales, _ = ref_nvfp4(x.double().numpy(), global_scale=gs)
    assert (scales < 2.0 ** E4M3_MIN_NORMAL_EXP).any() and (scales == 0).any()
    np.testing.assert_array_equal(scales64(q), scales)
    np.testing.assert_array_equal(unpack_codes(q.data, True), codes)
    assert assert_nvfp4_matches_reference(q, x, global_scale=gs) == 0


def test_nvfp4_last_dimension_must_be_a_multiple_of_16():
    for bad in (8, 24, 100):
        with pytest.raises(ValueError, match="multiple of 16"):
            formats.nvfp4_quantize(torch.ones(2, bad))
    with pytest.raises(ValueError):
        kv_formats.kv_bytes_per_token_head("nvfp4", 100)


# ---------------------------------------------------------------------------------------------------------
# Nibble order


def test_even_element_goes_into_the_low_nibble_by_default():
    # FlashInfer's kernel reads the even element from the low nibble: on the H200 run, attention over a cache
    # packed that way was 0.40% off the float32 reference, the other order 141% (fixtures/README.md).
    assert inspect.signature(formats.nvfp4_quantize).parameters["low_nibble_first"].default is True
    assert inspect.signature(formats.nvfp4_dequantize).parameters["low_nibble_first"].default is True
    # Element 0 -> 1.0 (code 2), element 1 -> 6.0 (code 7): the byte is 0x72 low-nibble-first, 0x27 otherwise.
    row = torch.zeros(1, BLOCK)
    row[0, 0], row[0, 1] = 1.0, 6.0
    assert int(formats.nvfp4_quantize(row, global_scale=1.0).data[0, 0]) == (7 << 4) | 2
    assert int(formats.nvfp4_quantize(row, global_scale=1.0, low_nibble_first=False).data[0, 0]) == (2 << 4) | 7


def test_recorded_gpu_run_confirms_the_low_nibble_first_order():
    accuracy = json.loads((NSYS2025_DIR / "nvfp4.workload.json").read_text())["contexts"][0]["accuracy"]
    assert accuracy["prefill_vs_dequantized_cache"] < 0.01
    assert accuracy["prefill_high_nibble_first_vs_dequantized_cache"] > 0.5


@pytest.mark.parametrize("low_nibble_first", [True, False])
def test_unpack_of_pack_is_identity_for_both_nibble_orders(low_nibble_first):
    x = random_normal(20, 3, 64, seed=13)
    q = formats.nvfp4_quantize(x, low_nibble_first=low_nibble_first)
    codes, scales, gs = ref_nvfp4(x.double().numpy())
    np.testing.assert_array_equal(unpack_codes(q.data, low_nibble_first), codes)
    # Decoded in float32 by the module: at most two float32 roundings away from the float64 product.
    np.testing.assert_allclose(formats.nvfp4_dequantize(q, low_nibble_first=low_nibble_first).double().numpy(),
                               ref_decode(codes, scales, gs), rtol=2 ** -23, atol=0)
    # The two orders hold the same codes with the nibbles of each byte swapped.
    other = formats.nvfp4_quantize(x, low_nibble_first=not low_nibble_first)
    assert torch.equal(other.data, (q.data >> 4) | ((q.data & 0x0F) << 4))
    # Reading with the wrong order is not the identity.
    wrong = formats.nvfp4_dequantize(q, low_nibble_first=not low_nibble_first)
    assert rel_error(wrong.numpy(), x.numpy()) > 0.5


# ---------------------------------------------------------------------------------------------------------
# Error bounds against float64


def test_nvfp4_round_trip_error_on_random_normal_data():
    x = random_normal(1024, 8, 128, seed=1)
    deq = formats.nvfp4_dequantize(formats.nvfp4_quantize(x))
    assert rel_error(deq.numpy(), x.double().numpy()) < 0.12
    # Elementwise: away from saturation, each value is within half a grid gap of the scaled value, i.e. at
    # most 1 (the gap between 4 and 6 halved) times block scale times global scale.
    q = formats.nvfp4_quantize(x)
    bound = np.repeat(scales64(q), BLOCK, axis=-1) * q.global_scale * 1.0
    assert np.all(np.abs(deq.double().numpy() - x.double().numpy()) <= bound * (1 + 1e-6))


def test_fp8_matches_the_float64_e4m3_reference_and_error_bound():
    x = random_normal(1024, 8, 128, seed=2)
    q, scale = formats.fp8_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    amax = float(x.abs().max())
    assert scale == pytest.approx(amax / E4M3_MAX, rel=1e-12)
    expected = ref_e4m3(x.double().numpy() / scale)
    got = q.double().numpy()
    # Division happens in float32 in the module; allow a different rounding only where float32 and float64
    # quotients straddle an E4M3 tie (none expected, but that is the only legitimate difference).
    mismatch = got != expected
    assert mismatch.mean() < 1e-6
    assert rel_error(got * scale, x.double().numpy()) < 0.04
    # Saturation: a fixed scale clamps out-of-range values to +-448 rather than producing NaN.
    big = torch.tensor([1e6, -1e6, 0.0])
    q, _ = formats.fp8_quantize(big, scale=1.0)
    assert q.double().tolist() == [E4M3_MAX, -E4M3_MAX, 0.0]
    zeros, scale = formats.fp8_quantize(torch.zeros(4))
    assert scale == 1.0 and torch.all(zeros.double() == 0)


# ---------------------------------------------------------------------------------------------------------
# Bytes


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_bytes_per_token_head_from_bit_widths_and_real_tensors(head_dim):
    fp8 = head_dim * 8 / 8  # 8 bits per value
    nvfp4 = head_dim * 4 / 8 + (head_dim / BLOCK) * 8 / 8  # 4 bits per value + one byte per 16 values
    assert kv_formats.kv_bytes_per_token_head("fp8", head_dim) == fp8
    assert kv_formats.kv_bytes_per_token_head("nvfp4", head_dim) == nvfp4
    assert kv_formats.kv_bytes_per_token_head("bf16", head_dim) == 2 * head_dim
    # The tensors the quantizers actually produce take exactly that much per token-head.
    row = random_normal(1, 1, head_dim)
    q = formats.nvfp4_quantize(row)
    measured = q.data.numel() * q.data.element_size() + q.scales.numel() * q.scales.element_size()
    assert measured == nvfp4
    q8, _ = formats.fp8_quantize(row)
    assert q8.numel() * q8.element_size() == fp8


def test_bytes_per_token_head_at_head_dim_128():
    fp8, nvfp4 = (kv_formats.kv_bytes_per_token_head(f, 128) for f in ("fp8", "nvfp4"))
    assert (fp8, nvfp4) == (128, 128 // 2 + 128 // 16)
    assert nvfp4 / fp8 == (1 / 2 + 1 / 16)  # 0.5625 for any head dim


def test_kv_cache_bytes_rounds_tokens_up_to_whole_pages():
    heads, dim, page, seqs, layers = 8, 128, 16, 3, 2
    for fmt in ("fp8", "nvfp4", "bf16"):
        per = kv_formats.kv_bytes_per_token_head(fmt, dim)
        for tokens in (1, 15, 16, 17, 33, 2048):
            slots = math.ceil(tokens / page) * page
            expected = slots * seqs * heads * 2 * layers * per  # K and V
            assert kv_formats.kv_cache_bytes(fmt, tokens_per_sequence=tokens, sequences=seqs, num_kv_heads=heads,
                                             head_dim=dim, page_size=page, layers=layers) == expected
    # 17 tokens on 16-token pages cost the same as 32.
    args = dict(sequences=1, num_kv_heads=1, head_dim=dim, page_size=page)
    assert kv_formats.kv_cache_bytes("fp8", tokens_per_sequence=17, **args) == \
        kv_formats.kv_cache_bytes("fp8", tokens_per_sequence=32, **args) == 2 * 32 * dim


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_kv_cache_bytes_equals_the_bytes_of_the_workloads_paged_cache(fmt):
    batch, context, heads, dim, page = 3, 37, 2, 64, 16
    keys, values = random_normal(batch * context, heads, dim, seed=1), random_normal(batch * context, heads, dim, seed=2)
    cache = PagedCache(fmt, keys, values, batch, context, 0, page)
    held = sum(t.numel() * t.element_size() for t in (cache.k_cache, cache.v_cache, *(cache.scales or ())))
    assert kv_formats.kv_cache_bytes(fmt, tokens_per_sequence=context, sequences=batch, num_kv_heads=heads,
                                     head_dim=dim, page_size=page) == held


def test_unknown_format_is_a_value_error():
    with pytest.raises(ValueError, match="unknown KV format"):
        kv_formats.kv_bytes_per_token_head("int4", 128)
    with pytest.raises(ValueError, match="unknown KV format"):
        kv_formats.kv_cache_bytes("mxfp4", tokens_per_sequence=16, sequences=1, num_kv_heads=1, head_dim=128,
                                  page_size=16)


# ---------------------------------------------------------------------------------------------------------
# The workload's paged cache (CPU tensors)

BATCH, CONTEXT, EXTRA, PAGE, HEADS, DIM = 3, 37, 5, 8, 2, 32


@pytest.fixture(scope="module")
def source():
    keys = random_normal(BATCH * CONTEXT, HEADS, DIM, seed=21).to(torch.bfloat16)
    values = random_normal(BATCH * CONTEXT, HEADS, DIM, seed=22).to(torch.bfloat16)
    return keys, values


def _slot(cache_tensor, b, t, pages_per_seq):
    return cache_tensor[b * pages_per_seq + t // PAGE, t % PAGE]


def test_nvfp4_paged_cache_places_each_token_at_its_page_and_slot(source):
    keys, values = source
    cache = PagedCache("nvfp4", keys, values, BATCH, CONTEXT, EXTRA, PAGE)
    pages_per_seq = -(-(CONTEXT + EXTRA) // PAGE)
    assert tuple(cache.k_cache.shape) == (BATCH * pages_per_seq, PAGE, HEADS, DIM // 2)
    assert tuple(cache.scales[0].shape) == (BATCH * pages_per_seq, PAGE, HEADS, DIM // BLOCK)
    assert cache.k_cache.dtype == torch.uint8 and cache.scales[0].dtype == torch.float8_e4m3fn
    for rows, pages, scales, global_scale in ((keys, cache.k_cache, cache.scales[0], cache.k_scale),
                                              (values, cache.v_cache, cache.scales[1], cache.v_scale)):
        q = formats.nvfp4_quantize(rows)
        assert global_scale == q.global_scale
        # Read token t of sequence b from page b * pages_per_seq + t // page_size, slot t % page_size.
        data_rows, scale_rows = [], []
        for b in range(BATCH):
            for t in range(CONTEXT + EXTRA):
                data, sf = _slot(pages, b, t, pages_per_seq), _slot(scales, b, t, pages_per_seq)
                if t < CONTEXT:
                    data_rows.append(data)
                    scale_rows.append(sf)
                    row = b * CONTEXT + t
                    assert torch.equal(data, q.data[row])
                    assert torch.equal(sf.view(torch.uint8), q.scales[row].view(torch.uint8))
                else:  # room for appended tokens is empty
                    assert torch.all(data == 0) and torch.all(sf.view(torch.uint8) == 0)
        # And what the cache holds is the reference quantization of the source rows.
        gathered = formats.NVFP4Tensor(torch.stack(data_rows), torch.stack(scale_rows), global_scale)
        assert_nvfp4_matches_reference(gathered, rows)
    assert cache.run_kwargs()["kv_cache_sf"] is cache.scales
    assert cache.run_kwargs()["k_scale"] == cache.k_scale


def test_fp8_paged_cache_places_each_token_at_its_page_and_slot(source):
    keys, values = source
    cache = PagedCache("fp8", keys, values, BATCH, CONTEXT, EXTRA, PAGE)
    pages_per_seq = -(-(CONTEXT + EXTRA) // PAGE)
    assert cache.k_cache.dtype == torch.float8_e4m3fn
    assert tuple(cache.k_cache.shape) == (BATCH * pages_per_seq, PAGE, HEADS, DIM)
    assert cache.scales is None and "kv_cache_sf" not in cache.run_kwargs()
    for rows, pages, scale in ((keys, cache.k_cache, cache.k_scale), (values, cache.v_cache, cache.v_scale)):
        assert scale == pytest.approx(float(rows.float().abs().max()) / E4M3_MAX, rel=1e-12)
        expected = ref_e4m3(rows.double().numpy() / scale)
        for b in range(BATCH):
            for t in range(CONTEXT):
                got = _slot(pages, b, t, pages_per_seq).double().numpy()
                np.testing.assert_array_equal(got, expected[b * CONTEXT + t])
            for t in range(CONTEXT, CONTEXT + EXTRA):
                assert torch.all(_slot(pages, b, t, pages_per_seq).view(torch.uint8) == 0)


def test_paged_cache_page_tables_describe_exactly_the_tokens_asked_for(source):
    keys, values = source
    cache = PagedCache("nvfp4", keys, values, BATCH, CONTEXT, EXTRA, PAGE)
    pages_per_seq = -(-(CONTEXT + EXTRA) // PAGE)
    assert cache.indptr.tolist() == [b * pages_per_seq for b in range(BATCH + 1)]
    for tokens in range(1, CONTEXT + EXTRA + 1):
        indptr, indices = cache.pages_used(tokens)
        last = cache.last_page_len(tokens)
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32
        assert len(indptr) == BATCH + 1 and int(indptr[0]) == 0 and int(indptr[-1]) == len(indices)
        assert last.shape == (BATCH,)
        for b in range(BATCH):
            pages = indices[indptr[b]:indptr[b + 1]].tolist()
            # The pages holding tokens 0..tokens-1 of sequence b, in order, and no others.
            wanted = sorted({b * pages_per_seq + t // PAGE for t in range(tokens)})
            assert pages == wanted
            # Full pages before the last one plus the last page's length is exactly the token count.
            n_last = int(last[b])
            assert 1 <= n_last <= PAGE
            assert (len(pages) - 1) * PAGE + n_last == tokens
