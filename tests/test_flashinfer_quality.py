"""The FlashInfer engine's quality numbers on the CPU: the float64 reference and the error metrics against an
independent numpy computation on the same tensors, the formats' errors with the project's own quantizers
(capture/formats.py), the outlier mode, and user-dumped tensors read from a .safetensors file.

FlashInfer's own outputs need a GPU; their comparison goes through the same functions tested here.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import FI_GAUSSIAN, FI_OUTLIERS, FI_QUALITY  # noqa: E402
from kvtrace.capture import flashinfer_quality as quality  # noqa: E402
from kvtrace.capture import formats  # noqa: E402
from kvtrace.capture import flashinfer_workload as workload  # noqa: E402
from kvtrace.capture.flashinfer_engine import FlashInferSpec  # noqa: E402
from kvtrace.errors import KvtraceError  # noqa: E402

ARGS = dict(contexts=[32, 80], batch=2, q_heads=4, kv_heads=2, head_dim=32, page_size=16, prefill_calls=1,
            decode_calls=1, append_calls=3, gemm_calls=1, gemm_size=8, seed=3)


def numpy_attention(q, k, v, causal_rows=None):
    """One sequence, float64: q [n, Hq, D], k/v [C, Hkv, D]; causal_rows: the positions of q's rows. The query heads
    that share a KV head at once (one matrix product each way), softmax row by row after subtracting the row's maximum.
    Causal rows are taken a few at a time, each few against the keys up to its last position: the keys past it would
    only be masked out."""
    q, k, v = (np.asarray(t.double() if hasattr(t, "double") else t, dtype=np.float64) for t in (q, k, v))
    rows, kv_heads = q.shape[0], k.shape[1]
    group, dim = q.shape[1] // kv_heads, q.shape[2]
    positions = np.full(rows, k.shape[0] - 1) if causal_rows is None else np.asarray(causal_rows)
    out = np.empty_like(q)
    for chunk in np.array_split(np.arange(rows), min(rows, 8)):
        keys = positions[chunk].max() + 1
        later = np.arange(keys)[None, :] > np.repeat(positions[chunk], group)[:, None]  # (row, head) by key
        for h in range(kv_heads):
            heads = slice(h * group, (h + 1) * group)
            logits = q[chunk, heads].reshape(-1, dim) @ k[:keys, h].T / math.sqrt(dim)
            logits[later] = -np.inf
            weights = np.exp(logits - logits.max(axis=1, keepdims=True))
            out[chunk, heads] = (weights @ v[:keys, h] / weights.sum(axis=1, keepdims=True)).reshape(-1, group, dim)
    return out


def numpy_errors(out, ref):
    out, ref = np.asarray(out, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    diff = out - ref
    return {"rel_l2": np.sqrt(diff @ diff / (ref @ ref)), "cosine": out @ ref / np.sqrt((out @ out) * (ref @ ref)),
            "max_abs": np.abs(diff).max()}


def drawn(context, source=None, seed=3):
    args = argparse.Namespace(**ARGS)
    return workload.Inputs.draw(args, context, torch.Generator().manual_seed(seed), source)


@pytest.mark.parametrize("context", [5, 80])
def test_reference_matches_numpy_attention(context):
    inputs = drawn(context)
    batch = ARGS["batch"]
    rows = quality.prefill_rows(context, count=9)
    prefill = quality.attention64(inputs.q_prefill, inputs.keys, inputs.values, batch, context, rows)
    decode = quality.attention64(inputs.q_decode, inputs.keys, inputs.values, batch, context, None)
    for b in range(batch):
        k, v = inputs.keys[b * context:(b + 1) * context], inputs.values[b * context:(b + 1) * context]
        q = inputs.q_prefill[b * context:(b + 1) * context][rows]
        np.testing.assert_allclose(prefill[b * len(rows):(b + 1) * len(rows)].numpy(),
                                   numpy_attention(q, k, v, rows), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(decode[b:b + 1].numpy(), numpy_attention(inputs.q_decode[b:b + 1], k, v),
                                   rtol=1e-12, atol=1e-14)


def test_prefill_rows_are_spread_and_keep_both_ends():
    assert quality.prefill_rows(10) == list(range(10))
    rows = quality.prefill_rows(32768)
    assert len(rows) == quality.PREFILL_ROWS and rows[0] == 0 and rows[-1] == 32767
    assert rows == sorted(set(rows))


def test_error_metrics_match_numpy_and_their_definitions():
    generator = torch.Generator().manual_seed(1)
    ref = torch.randn(7, 4, 16, generator=generator, dtype=torch.float64)
    out = ref + 0.01 * torch.randn(7, 4, 16, generator=generator, dtype=torch.float64)
    got, want = quality.errors(out, ref), numpy_errors(out.numpy(), ref.numpy())
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-12)
    same = quality.errors(ref, ref)
    assert same["rel_l2"] == 0 and same["max_abs"] == 0 and same["cosine"] == pytest.approx(1, abs=1e-15)
    opposite = quality.errors(-ref, ref)
    assert opposite["rel_l2"] == pytest.approx(2) and opposite["cosine"] == pytest.approx(-1)
    assert quality.errors(torch.zeros_like(ref), ref) == {"rel_l2": 1.0, "cosine": None,
                                                            "max_abs": float(ref.abs().max())}


@pytest.mark.parametrize("kv_format", ["fp8", "nvfp4"])
def test_round_trip_is_the_quantizers_dequantized_cache(kv_format):
    x = drawn(32).keys
    if kv_format == "fp8":
        scale = formats.fp8_quantize(x)[1]
        expected = (formats.fp8_quantize(x)[0].float() * scale).double().numpy()
    else:
        q = formats.nvfp4_quantize(x)
        scale, expected = q.global_scale, formats.nvfp4_dequantize(q).double().numpy()
    np.testing.assert_array_equal(quality.round_trip(kv_format, x, scale).double().numpy(), expected)


def point(kv_format, inputs, context):
    if kv_format == "fp8":
        k_scale, v_scale = formats.fp8_quantize(inputs.keys)[1], formats.fp8_quantize(inputs.values)[1]
    else:
        k_scale, v_scale = (formats.nvfp4_quantize(x).global_scale for x in (inputs.keys, inputs.values))
    tensors = (inputs.keys, inputs.values, inputs.q_prefill, inputs.q_decode)
    dequantized = quality.read_back(kv_format, *tensors, k_scale, v_scale, ARGS["batch"], context)
    return quality.point_quality(dequantized, *tensors, ARGS["batch"], context)


def test_format_error_matches_numpy_on_the_dequantized_cache():
    context, batch = 48, ARGS["batch"]
    inputs = drawn(context)
    result = point("nvfp4", inputs, context)
    k_deq = quality.round_trip("nvfp4", inputs.keys, quality_scale(inputs.keys))
    v_deq = quality.round_trip("nvfp4", inputs.values, quality_scale(inputs.values))
    rows = quality.prefill_rows(context)
    ref, out = [], []
    for b in range(batch):
        window = slice(b * context, (b + 1) * context)
        q = inputs.q_prefill[window][rows]
        ref.append(numpy_attention(q, inputs.keys[window], inputs.values[window], rows))
        out.append(numpy_attention(q, k_deq[window], v_deq[window], rows))
    want = numpy_errors(np.concatenate(out), np.concatenate(ref))
    for name in want:
        assert result["format"]["prefill"][name] == pytest.approx(want[name], rel=1e-9)
    want_k = numpy_errors(k_deq.numpy(), inputs.keys.double().numpy())
    assert result["cache"]["k"]["rel_l2"] == pytest.approx(want_k["rel_l2"], rel=1e-12)
    assert result["prefill_rows_per_sequence"] == context and "kernel" not in result


def quality_scale(x):
    return formats.nvfp4_quantize(x).global_scale


@pytest.mark.parametrize("mode", ["gaussian", "outliers"])
@pytest.mark.parametrize("context", [16, 48, 80])
def test_nvfp4_adds_more_error_than_fp8_at_every_point(mode, context):
    source = quality.outlier_channels(ARGS["kv_heads"], ARGS["head_dim"], ARGS["seed"]) if mode == "outliers" else None
    inputs = drawn(context, source)
    fp8, nvfp4 = point("fp8", inputs, context), point("nvfp4", inputs, context)
    for tensor in ("k", "v"):
        assert nvfp4["cache"][tensor]["rel_l2"] > fp8["cache"][tensor]["rel_l2"]
        assert nvfp4["cache"][tensor]["max_abs"] > fp8["cache"][tensor]["max_abs"]
    for phase in ("prefill", "decode"):
        assert nvfp4["format"][phase]["rel_l2"] > fp8["format"][phase]["rel_l2"]
        assert nvfp4["format"][phase]["cosine"] < fp8["format"][phase]["cosine"]
        # Both above the BF16 output rounding floor any kernel pays.
        assert fp8["format"][phase]["rel_l2"] > fp8["output_rounding"][phase]["rel_l2"] > 0


def test_outliers_scale_fixed_channels_and_cost_nvfp4_more():
    channels = quality.outlier_channels(ARGS["kv_heads"], ARGS["head_dim"], ARGS["seed"])
    assert channels.shape == (ARGS["kv_heads"], quality.OUTLIER_CHANNELS)
    plain, spiked = drawn(48), drawn(48, channels)
    # The Gaussian draws are the same; only the chosen channels of K and V are scaled.
    assert torch.equal(plain.q_prefill, spiked.q_prefill) and torch.equal(plain.q_decode, spiked.q_decode)
    gain = torch.ones(ARGS["kv_heads"], ARGS["head_dim"])
    for head in range(ARGS["kv_heads"]):
        gain[head, channels[head]] = quality.OUTLIER_GAIN
    for name in ("keys", "values", "new_k", "new_v"):
        assert torch.equal(getattr(spiked, name), (getattr(plain, name).float() * gain).to(torch.bfloat16)), name
    # A block of 16 values shares one scale in NVFP4: an outlier channel crushes the other values of its block,
    # while FP8's float grid keeps their relative precision. On the ordinary channels NVFP4's error grows several
    # times and FP8's stays; the attention output's error grows more, in absolute terms, with NVFP4.
    ordinary = torch.ones(ARGS["kv_heads"], ARGS["head_dim"], dtype=torch.bool)
    for head in range(ARGS["kv_heads"]):
        ordinary[head, channels[head]] = False
    cache, output = {}, {}
    for label, inputs in (("gaussian", plain), ("outliers", spiked)):
        for kv_format in ("fp8", "nvfp4"):
            x = inputs.keys
            scale = quality_scale(x) if kv_format == "nvfp4" else formats.fp8_quantize(x)[1]
            cache[label, kv_format] = quality.errors(quality.round_trip(kv_format, x, scale)[:, ordinary],
                                                     x[:, ordinary])["rel_l2"]
            output[label, kv_format] = point(kv_format, inputs, 48)["format"]["prefill"]["rel_l2"]
    assert cache["outliers", "nvfp4"] > 2 * cache["gaussian", "nvfp4"]
    assert cache["outliers", "fp8"] == pytest.approx(cache["gaussian", "fp8"], rel=0.1)
    assert (output["outliers", "nvfp4"] - output["gaussian", "nvfp4"]
            > output["outliers", "fp8"] - output["gaussian", "fp8"] > 0)


# ---- user-dumped tensors ------------------------------------------------------------------------------

def write_safetensors(path, tensors: dict, dtype="BF16") -> None:
    """The file layout written out from its specification: 8-byte little-endian header size, a JSON header of
    {name: {dtype, shape, data_offsets}} (offsets relative to the data after the header), then the raw data."""
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.to(torch.bfloat16 if dtype == "BF16" else torch.float32).contiguous()
        raw = data.view(torch.int16 if dtype == "BF16" else torch.int32).numpy().astype("<i2" if dtype == "BF16"
                                                                                         else "<i4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def dumped(tokens=100, q_heads=4, kv_heads=2, head_dim=32):
    generator = torch.Generator().manual_seed(11)
    return {"q": torch.randn(tokens, q_heads, head_dim, generator=generator),
            "k": torch.randn(tokens, kv_heads, head_dim, generator=generator) * 3,
            "v": torch.randn(tokens, kv_heads, head_dim, generator=generator)}


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_tensor_file_is_read_as_written(tmp_path, dtype):
    tensors, path = dumped(), tmp_path / "layer3.safetensors"
    write_safetensors(path, tensors, dtype)
    quality.check_tensor_file(path, 4, 2, 32, 100)
    read, sha256 = quality.read_tensor_file(path)
    for name, tensor in tensors.items():
        expected = tensor.to(torch.bfloat16) if dtype == "BF16" else tensor
        assert read[name].dtype == expected.dtype and torch.equal(read[name], expected), name
    assert quality.describe_inputs(str(path), sha256) == {"kind": "file", "file": "layer3.safetensors",
                                                           "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def test_file_inputs_are_contiguous_windows_with_the_last_token_as_decode_query(tmp_path):
    tensors = {name: t.to(torch.bfloat16) for name, t in dumped(tokens=100).items()}
    args = argparse.Namespace(**ARGS)
    inputs = workload.Inputs.draw(args, 32, torch.Generator().manual_seed(0), tensors)
    starts = quality.windows(100, 32, args.batch)
    assert starts == [0, 68]
    for b, start in enumerate(starts):
        window = slice(b * 32, (b + 1) * 32)
        assert torch.equal(inputs.keys[window], tensors["k"][start:start + 32])
        assert torch.equal(inputs.values[window], tensors["v"][start:start + 32])
        assert torch.equal(inputs.q_prefill[window], tensors["q"][start:start + 32])
        assert torch.equal(inputs.q_decode[b], tensors["q"][start + 31])
        assert torch.equal(inputs.new_k[0, b], tensors["k"][(start + 32) % 100])
    assert inputs.new_k.shape == (args.append_calls, args.batch, args.kv_heads, args.head_dim)


@pytest.mark.parametrize("change,says", [
    (lambda t: t.pop("v"), "has no tensor 'v'"),
    (lambda t: t.update(k=t["k"][:, :1]), "pass --kv-heads 1"),
    (lambda t: t.update(q=t["q"][:50]), "different token counts"),
    (lambda t: t.update(q=t["q"].reshape(100, -1)), "not [tokens, heads, head_dim]"),
])
def test_tensor_file_that_does_not_fit_is_one_clear_error(tmp_path, change, says):
    tensors = dumped()
    change(tensors)
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, tensors)
    with pytest.raises(KvtraceError, match=says.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        FlashInferSpec(contexts=(32,), q_heads=4, kv_heads=2, head_dim=32, inputs=str(path)).validate()


def test_tensor_file_too_short_truncated_or_foreign_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, dumped(tokens=40))
    with pytest.raises(KvtraceError, match="holds 40 tokens, fewer than --context 64"):
        quality.check_tensor_file(path, 4, 2, 32, 64)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(KvtraceError, match="truncated"):
        quality.check_tensor_file(path, 4, 2, 32, 32)
    path.write_bytes(b"PK\x03\x04 not a tensor file at all")
    with pytest.raises(KvtraceError, match="is not a .safetensors file"):
        quality.check_tensor_file(path, 4, 2, 32, 32)
    with pytest.raises(KvtraceError, match="cannot read it"):
        quality.check_tensor_file(tmp_path / "missing.safetensors", 4, 2, 32, 32)


def test_workload_passes_the_inputs_to_the_arm_process(tmp_path):
    path = tmp_path / "t.safetensors"
    write_safetensors(path, dumped())
    spec = FlashInferSpec(contexts=(32,), q_heads=4, kv_heads=2, head_dim=32, inputs=str(path))
    args = workload.parse_args([*spec.workload_args(), "--kv-format", "fp8", "--result", "r.json"])
    assert args.inputs == str(path.resolve())
    assert workload.parse_args([*FlashInferSpec().workload_args(), "--kv-format", "fp8",
                                "--result", "r.json"]).inputs == "gaussian"


# ---- a recorded run's numbers, drawn again on the CPU ------------------------------------------------------

def mt19937(seed: int) -> np.random.MT19937:
    """numpy's MT19937 in the state torch's CPU generator has after manual_seed(seed): the reference seeding
    (init_genrand) of the same Mersenne Twister, whose raw 32-bit outputs torch's uniforms are made from."""
    key = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        key.append((1812433253 * (key[-1] ^ (key[-1] >> 30)) + i) & 0xFFFFFFFF)
    generator = np.random.MT19937()
    generator.state = {"bit_generator": "MT19937", "state": {"key": np.array(key, np.uint32), "pos": 624}}
    return generator


def to_bf16(x) -> np.ndarray:
    """float32 values rounded to the nearest BF16 (ties to even), kept as float32."""
    bits = np.array(x, np.float32).view(np.uint32)  # a copy: the rounding works in place
    bits += 0x7FFF + ((bits >> 16) & 1)  # below 2**32 for every finite value
    bits &= 0xFFFF0000
    return bits.view(np.float32)


def legacy_bytes(generator: np.random.MT19937, count: int) -> np.ndarray:
    """The low 8 bits of `count` 32-bit outputs: what torch 2.7–2.11's BF16 CPU normal makes one value from (below),
    drawn a chunk at a time."""
    chunk = 1 << 22
    return np.concatenate([(generator.random_raw(min(chunk, count - at)) & 0xFF).astype(np.uint8)
                           for at in range(0, count, chunk)] or [np.zeros(0, np.uint8)])


def legacy_bf16_normal(generator: np.random.MT19937, count: int) -> np.ndarray:
    """torch 2.7–2.11's `torch.randn(dtype=torch.bfloat16)` on the CPU, rebuilt from its algorithm
    (pytorch/pytorch#166853, the `normal_fill` path of ATen's CPU DistributionTemplates.h): one BF16 uniform per value
    from the low 8 bits of one 32-bit output, then Box-Muller on each block of 16 (u1 = 1 - u[j], u2 = u[j + 8]), every
    step rounded to BF16. A torch that fixes the issue draws otherwise, so a run recorded with it (quality_inputs
    without `drawn_as`) can only be drawn again this way."""
    return legacy_from_bytes(legacy_bytes(generator, count))


def legacy_from_bytes(raw: np.ndarray) -> np.ndarray:
    """legacy_bf16_normal's values from its bytes: each block of 16 on its own, value j (j < 8) of a block from its
    bytes j (the radius) and j + 8 (the angle), as is value j + 8 (sine for cosine). Every step is a function of one
    byte, so each value is one of 256 × 256: computed once as a table, then looked up."""
    uniform = np.arange(256) / 256
    radius = to_bf16(np.sqrt(-2 * to_bf16(np.log(1 - uniform))))
    theta = to_bf16(2 * np.pi * uniform).astype(np.float64)
    cosine, sine = (to_bf16(radius[:, None] * to_bf16(wave(theta))[None, :]).reshape(-1) for wave in (np.cos, np.sin))
    blocks = raw.reshape(-1, 16).astype(np.intp)
    index = blocks[:, :8] * 256 + blocks[:, 8:]  # [radius byte, angle byte]
    return np.concatenate([cosine[index], sine[index]], axis=1).reshape(-1)


def test_generated_inputs_reach_the_gaussian_tails_the_legacy_draw_cut_off():
    """The workload's draw against torch 2.7–2.11's BF16 CPU normal on as many values: only the workload's passes
    |x| = 3.33, and it records that it drew so."""
    args = argparse.Namespace(**{**ARGS, "batch": 4, "kv_heads": 8, "head_dim": 128})
    keys = workload.Inputs.draw(args, 1024, torch.Generator().manual_seed(0)).keys.float()
    legacy = legacy_bf16_normal(mt19937(0), keys.numel())
    assert np.abs(legacy).max() == pytest.approx(3.328125) and keys.abs().max() > 4
    assert float(keys.std()) == pytest.approx(1, abs=0.01)


@functools.lru_cache(maxsize=2)
def _drawn_again(spec: str, inputs: str, context: int) -> dict:
    spec, inputs = json.loads(spec), json.loads(inputs)
    if inputs.get("drawn_as") == quality.DRAWN_AS:
        generator = torch.Generator().manual_seed(spec["seed"])

        def randn(*shape, rows=None):
            values = torch.randn(shape, generator=generator).to(torch.bfloat16)
            return values if rows is None else values[rows]

        skip = randn
    else:
        assert "drawn_as" not in inputs, f"a draw this test cannot repeat: {inputs['drawn_as']!r}"
        legacy = mt19937(spec["seed"])

        def randn(*shape, rows=None):
            raw = legacy_bytes(legacy, math.prod(shape))
            if rows is not None:  # whole rows are whole blocks of 16: each row's values come from its own bytes
                assert math.prod(shape[1:]) % 16 == 0
                raw, shape = raw.reshape(shape[0], -1)[rows].reshape(-1), (len(rows), *shape[1:])
            return torch.from_numpy(legacy_from_bytes(raw).reshape(shape)).to(torch.bfloat16)

        def skip(*shape, rows=None):
            legacy_bytes(legacy, math.prod(shape))

    for _ in range(2):
        skip(spec["gemm_size"], spec["gemm_size"])
    batch, kv_heads, q_heads, head_dim, appends = (spec[k] for k in ("batch", "kv_heads", "q_heads", "head_dim",
                                                                     "append_calls"))
    for each in spec["contexts"]:
        draw = randn if each == context else skip
        rows = [b * each + row for b in range(batch) for row in quality.prefill_rows(each)]
        tensors = {"keys": draw(batch * each, kv_heads, head_dim), "values": draw(batch * each, kv_heads, head_dim),
                   "q_prefill": draw(batch * each, q_heads, head_dim, rows=rows),
                   "q_decode": draw(batch, q_heads, head_dim)}
        skip(appends, batch, kv_heads, head_dim), skip(appends, batch, kv_heads, head_dim)
        if each == context:
            break
    if inputs.get("kind") == "outliers":
        channels = quality.outlier_channels(kv_heads, head_dim, spec["seed"])
        for name in ("keys", "values"):
            tensors[name] = quality.add_outliers(tensors[name], channels)
    return tensors


def drawn_again(spec: dict, inputs: dict, context: int) -> dict:
    """The BF16 tensors the workload drew for `context`, drawn again: its generator is a CPU one seeded with the
    spec's seed, drawing the two GEMM operands, then per context keys, values, prefill and decode queries and the
    appended rows, in that order (flashinfer_workload.main and Inputs.draw), each as `inputs` says it was drawn.
    Of the prefill queries only the rows quality.prefill_rows samples, sequence after sequence; what no check reads
    is drawn past, not made. Both arms of a run drew the same tensors: they are drawn again once (read only)."""
    return _drawn_again(json.dumps(spec, sort_keys=True), json.dumps(inputs, sort_keys=True), context)


def numpy_phase(tensors, k, v, batch, context, rows):
    """float64 numpy attention of every sequence: prefill at `rows` (tensors["q_prefill"] holds those rows, sequence
    after sequence), decode (rows None) at its one query."""
    out = []
    for b in range(batch):
        window = slice(b * context, (b + 1) * context)
        if rows is None:
            out.append(numpy_attention(tensors["q_decode"][b:b + 1], k[window], v[window]))
        else:
            out.append(numpy_attention(tensors["q_prefill"][b * len(rows):(b + 1) * len(rows)], k[window], v[window],
                                       rows))
    return np.concatenate(out)


@functools.lru_cache(maxsize=2)
def _reference(spec: str, inputs: str, context: int) -> dict:
    tensors, batch = _drawn_again(spec, inputs, context), json.loads(spec)["batch"]
    return {phase: numpy_phase(tensors, tensors["keys"], tensors["values"], batch, context, rows)
            for phase, rows in (("prefill", quality.prefill_rows(context)), ("decode", None))}


def reference(spec: dict, inputs: dict, context: int) -> dict:
    """phase -> numpy_phase on drawn_again's tensors as drawn, what both arms' format errors are measured against:
    computed once (read only)."""
    return _reference(json.dumps(spec, sort_keys=True), json.dumps(inputs, sort_keys=True), context)


def check_recorded_point(spec: dict, workload: dict, entry: dict) -> None:
    """One recorded context's `cache` and `format` errors against numpy on the same tensors, with the recorded
    scales and the project's quantizers."""
    context, batch, kv_format = entry["context"], spec["batch"], workload["kv_format"]
    inputs = workload.get("quality_inputs") or {"kind": "gaussian"}
    tensors = drawn_again(spec, inputs, context)
    k_deq = quality.round_trip(kv_format, tensors["keys"], entry["k_scale"])
    v_deq = quality.round_trip(kv_format, tensors["values"], entry["v_scale"])
    recorded = entry["quality"]
    for name, deq, source in (("k", k_deq, tensors["keys"]), ("v", v_deq, tensors["values"])):
        want = numpy_errors(deq.double().numpy(), source.double().numpy())
        for metric, value in want.items():
            assert recorded["cache"][name][metric] == pytest.approx(value, rel=1e-4), (name, metric)
    rows = quality.prefill_rows(context)
    assert recorded["prefill_rows_per_sequence"] == len(rows)
    for phase, phase_rows in (("prefill", rows), ("decode", None)):
        want = numpy_errors(numpy_phase(tensors, k_deq, v_deq, batch, context, phase_rows),
                            reference(spec, inputs, context)[phase])
        for metric, value in want.items():
            assert recorded["format"][phase][metric] == pytest.approx(value, rel=1e-4), (phase, metric)


def test_workload_records_what_numpy_computes_on_the_same_tensors():
    """The CPU workload path (a stand-in FlashInfer) at a small spec: every recorded point checks out."""
    from test_flashinfer_workload import stand_in_flashinfer

    spec = dict(contexts=[32, 48], batch=2, q_heads=4, kv_heads=2, head_dim=32, page_size=16, prefill_calls=1,
                decode_calls=1, append_calls=3, gemm_calls=1, gemm_size=8, seed=5)
    for kv_format in ("fp8", "nvfp4"):
        args = argparse.Namespace(kv_format=kv_format, inputs="gaussian", **spec)
        generator = torch.Generator().manual_seed(spec["seed"])
        for _ in range(2):
            quality.normal_bf16(generator, spec["gemm_size"], spec["gemm_size"])
        for context in spec["contexts"]:
            _, entry = workload.prepare_context(stand_in_flashinfer(), args, context, generator,
                                                torch.zeros(16, dtype=torch.uint8), lambda: None)
            check_recorded_point(spec, {"kv_format": kv_format, "quality_inputs": quality.describe_inputs("gaussian")},
                                 entry)


FLASHINFER_RUNS = [FI_QUALITY, FI_GAUSSIAN, FI_OUTLIERS]


def recorded_workloads(run) -> tuple[dict, dict]:
    manifest = json.loads((run / "manifest.json").read_text())
    return manifest["settings"]["spec"], {arm: manifest["arms"][arm]["workload"] for arm in ("fp8", "nvfp4")}


@pytest.mark.slow
@pytest.mark.parametrize("run", FLASHINFER_RUNS, ids=lambda p: p.name)
def test_recorded_gpu_errors_match_numpy_on_the_same_tensors(run):
    """The H200 run's recorded errors: the smallest context's format and cache errors drawn again here and computed
    by numpy, and NVFP4's error above FP8's at every point, kernel and format alike."""
    spec, workloads = recorded_workloads(run)
    for recorded in workloads.values():
        check_recorded_point(spec, recorded, recorded["contexts"][0])
    for fp8, nvfp4 in zip(workloads["fp8"]["contexts"], workloads["nvfp4"]["contexts"]):
        for group in ("kernel", "format"):
            for phase in ("prefill", "decode"):
                assert nvfp4["quality"][group][phase]["rel_l2"] > fp8["quality"][group][phase]["rel_l2"]
        for tensor in ("k", "v"):
            assert nvfp4["quality"]["cache"][tensor]["rel_l2"] > fp8["quality"]["cache"][tensor]["rel_l2"]
    # Each kernel's distance from its own dequantized cache, where recorded, against the triangle inequality:
    # | |K - R| - |F - R| | <= |K - F|, with |F| <= |R| (1 + format).
    for recorded in workloads.values():
        for entry in recorded["contexts"]:
            point = entry["quality"]
            for phase in ("prefill", "decode") if "kernel_vs_format" in point else ():
                kernel, alone = point["kernel"][phase]["rel_l2"], point["format"][phase]["rel_l2"]
                assert abs(kernel - alone) / (1 + alone) <= point["kernel_vs_format"][phase]["rel_l2"]


def test_recorded_outliers_cost_nvfp4_more_than_fp8():
    """The same draws with outlier channels: at every recorded point and phase the format's error grows for both,
    and by more for NVFP4, whose 16-value blocks share one scale with the outlier."""
    plain, spiked = (recorded_workloads(run)[1] for run in (FI_GAUSSIAN, FI_OUTLIERS))
    assert spiked["fp8"]["quality_inputs"]["kind"] == "outliers" and plain["fp8"]["quality_inputs"]["kind"] == "gaussian"
    assert spiked["fp8"]["quality_inputs"]["drawn_as"] == plain["fp8"]["quality_inputs"]["drawn_as"]
    growth = {}
    for arm in ("fp8", "nvfp4"):
        for before, after in zip(plain[arm]["contexts"], spiked[arm]["contexts"]):
            assert before["context"] == after["context"]
            for phase in ("prefill", "decode"):
                growth[arm, before["context"], phase] = (after["quality"]["format"][phase]["rel_l2"]
                                                         - before["quality"]["format"][phase]["rel_l2"])
    for (arm, context, phase), value in growth.items():
        if arm == "nvfp4":
            assert value > growth["fp8", context, phase] > 0, (context, phase)
