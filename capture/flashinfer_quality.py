"""The numerical error each KV format adds to attention, measured on the FlashInfer workload's own tensors.

Per workload point (context length) and format, for prefill and decode, four numbers apart; the first three against a
float64 reference over the BF16 cache (the source the format was quantized from):
- `format`: exact (float64) attention over the dequantized cache against the reference: the error the format's
  bits add, whatever kernel reads them (computable anywhere, with capture/formats.py's quantizers);
- `kernel`: FlashInfer's output against the reference: what a model would get (GPU only);
- `output_rounding`: the reference rounded to BF16, the floor any kernel with a BF16 output has;
- `kernel_vs_format`: the kernel's output against exact attention over its own dequantized cache: what the kernel
  adds beyond its format (its arithmetic, or a departure from the attention the cache defines).
Plus the round trip of the cache itself (dequantize(quantize(x)) against x) for K and V.
Each is relative L2 error, cosine similarity and max absolute error (docs/statistics.md says what they mean).

Causal prefill is checked on PREFILL_ROWS query positions per sequence (evenly spaced, the last included), so that
a float64 reference stays affordable at 32k tokens; decode on every sequence's query.

Inputs: the engine's Gaussian generator, `outliers` (a few fixed channels per KV head scaled up, the way real models'
keys carry them), or Q/K/V a user dumped from a model into a .safetensors file (TENSOR_NAMES).

Standard library at import (the engine checks a tensor file before profiling); torch when the functions run.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import stat
import struct
from pathlib import Path

from kvtrace.errors import KvtraceError

GENERATED = ("gaussian", "outliers")
# Generated tensors are float32 normals rounded to BF16 (normal_bf16): torch's own BF16 CPU normal draws its uniforms
# at BF16 precision on torch 2.7–2.11, so its values stop at |x| = 3.33 on 256 levels (pytorch/pytorch#166853).
# Recorded in the manifest: runs drawn before (fi-h200-sm90-quality) carry no `drawn_as`.
DRAWN_AS = "float32 normal rounded to bf16"
# Outlier mode: this many channels per KV head, fixed across tokens, scaled by OUTLIER_GAIN in K and V.
OUTLIER_CHANNELS = 4
OUTLIER_GAIN = 16.0
PREFILL_ROWS = 64
# A dumped file's tensors: name -> which heads its second dimension counts. Shapes [tokens, heads, head_dim], the
# keys after RoPE, one layer, one sequence in token order.
TENSOR_NAMES = {"q": "q_heads", "k": "kv_heads", "v": "kv_heads"}
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_MAX_HEADER = 100 * 1024 * 1024


# ---- inputs ----------------------------------------------------------------------------------------------

def _header(path: Path, data: bytes | None = None) -> tuple[dict, int]:
    """A .safetensors file's tensor table and where its data starts (8-byte little-endian header length, JSON),
    read from the file, or from its bytes `data` where they are in memory already."""
    try:
        # Without blocking: a FIFO would wait for a writer before it could be refused
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") if data is None else io.BytesIO(data) as handle:
            if data is None and not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ValueError("not a regular file: a folder, pipe, FIFO or device")
            raw = handle.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise ValueError(f"header of {length} bytes")
            table = json.loads(handle.read(length))
            if not isinstance(table, dict):
                raise ValueError("header is not a JSON object")
    except OSError as error:
        raise KvtraceError(f"--inputs {path}: cannot read it ({error.strerror or error})") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        reason = "its header is nested too deeply" if isinstance(error, RecursionError) else error
        raise KvtraceError(f"--inputs {path} is not a .safetensors file ({reason}): dump q, k and v with "
                           "safetensors.torch.save_file") from None
    return table, 8 + length


def check_tensor_file(path: Path, q_heads: int, kv_heads: int, head_dim: int, max_context: int) -> None:
    """Refuse, before anything runs, a file whose q/k/v do not fit the workload's shape."""
    table, start = _header(path)
    size = path.stat().st_size - start
    tokens = set()
    for name, heads in TENSOR_NAMES.items():
        entry = table.get(name)
        if not isinstance(entry, dict):
            raise KvtraceError(f"--inputs {path} has no tensor {name!r}: it needs q, k and v, each [tokens, heads, "
                               "head_dim]")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPES:
            raise KvtraceError(f"--inputs {path}: {name} is {dtype!r}; save it as bfloat16, float16 or float32")
        wanted = {"q_heads": q_heads, "kv_heads": kv_heads}[heads]
        if not (isinstance(shape, list) and len(shape) == 3 and all(_whole(n) for n in shape)):
            raise KvtraceError(f"--inputs {path}: {name} has shape {shape!r}, not [tokens, heads, head_dim]")
        if shape[1:] != [wanted, head_dim]:
            raise KvtraceError(f"--inputs {path}: {name} is {shape}, the workload wants [tokens, {wanted}, {head_dim}]: "
                               f"pass --{heads.replace('_', '-')} {shape[1]} --head-dim {shape[2]}")
        width = {"BF16": 2, "F16": 2, "F32": 4}[dtype]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(n) for n in offsets)
                and offsets[1] - offsets[0] == math.prod(shape) * width
                and 0 <= offsets[0] and offsets[1] <= size):
            raise KvtraceError(f"--inputs {path}: {name}'s data offsets {offsets!r} do not match its shape (truncated?)")
        tokens.add(shape[0])
    if len(tokens) != 1:
        raise KvtraceError(f"--inputs {path}: q, k and v hold different token counts {sorted(tokens)}; dump one "
                           "sequence's tokens for all three")
    (count,) = tokens
    if count < max_context:
        raise KvtraceError(f"--inputs {path} holds {count} tokens, fewer than --context {max_context}: pass contexts "
                           f"up to {count}")


def _whole(value) -> bool:
    """A size or offset as safetensors writes it: an integer of 0 or more (2.0 would slice no buffer, True is 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_tensor_file(path: Path) -> tuple[dict, str]:
    """q, k, v of a .safetensors file as CPU tensors, in their stored dtype, and the SHA-256 of the bytes they were
    read from (describe_inputs records it)."""
    import torch

    data = path.read_bytes()
    table, start = _header(path, data)
    tensors = {}
    for name in TENSOR_NAMES:
        entry = table[name]
        begin, end = entry["data_offsets"]
        buffer = bytearray(data[start + begin:start + end])
        tensors[name] = torch.frombuffer(buffer, dtype=getattr(torch, _DTYPES[entry["dtype"]])).reshape(entry["shape"])
    return tensors, hashlib.sha256(data).hexdigest()


def describe_inputs(kind: str, sha256: str | None = None) -> dict:
    """What the manifest records about the inputs: the kind, and for a file its name and SHA-256 (read_tensor_file's)."""
    if kind in GENERATED:
        return {"kind": kind, "drawn_as": DRAWN_AS, **({"outlier_channels": OUTLIER_CHANNELS,
                                                       "outlier_gain": OUTLIER_GAIN} if kind == "outliers" else {})}
    return {"kind": "file", "file": Path(kind).name, "sha256": sha256}


def normal_bf16(generator: "torch.Generator", *shape: int) -> "torch.Tensor":
    """Standard normal BF16 values drawn as DRAWN_AS says, where the generator lives."""
    import torch

    return torch.randn(shape, generator=generator, device=generator.device).to(torch.bfloat16)


def outlier_channels(kv_heads: int, head_dim: int, seed: int) -> "torch.Tensor":
    """[kv_heads, OUTLIER_CHANNELS] channel indices, from their own generator: the Gaussian draws stay the same."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(head_dim, generator=generator)[:OUTLIER_CHANNELS] for _ in range(kv_heads)])


def add_outliers(x: "torch.Tensor", channels: "torch.Tensor") -> "torch.Tensor":
    """x [..., kv_heads, head_dim] with `channels` of each head scaled by OUTLIER_GAIN."""
    import torch

    gain = torch.ones(x.shape[-2:], dtype=torch.float32, device=x.device)
    gain.scatter_(1, channels.to(x.device), OUTLIER_GAIN)
    return (x.float() * gain).to(x.dtype)


def windows(tokens: int, context: int, batch: int) -> list[int]:
    """Start of each sequence's contiguous window of `context` tokens in a dumped sequence of `tokens`, spread
    over it (contiguous, so that the relative positions RoPE encodes stay those of the model)."""
    room = tokens - context
    return [room * b // max(batch - 1, 1) for b in range(batch)]


# ---- reference and errors --------------------------------------------------------------------------------

def prefill_rows(context: int, count: int = PREFILL_ROWS) -> list[int]:
    """Query positions checked in causal prefill: evenly spaced, the first and the last included."""
    if context <= count:
        return list(range(context))
    return sorted({round(i * (context - 1) / (count - 1)) for i in range(count)})


def attention64(q: "torch.Tensor", keys: "torch.Tensor", values: "torch.Tensor", batch: int, context: int,
                rows: list[int] | None) -> "torch.Tensor":
    """float64 attention, softmax scale 1/sqrt(head_dim), query head h reading KV head h // (q_heads / kv_heads).

    q: [batch * q_len, Hq, D]; keys, values: [batch * context, Hkv, D]. rows=None: decode (q_len 1, every key);
    else causal prefill (q_len = context) at those query positions only. Returns [batch * len(rows or 1), Hq, D].
    """
    import torch

    q_len = 1 if rows is None else context
    out = []
    for b in range(batch):
        k = keys[b * context:(b + 1) * context].double()
        v = values[b * context:(b + 1) * context].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qb = q[b * q_len:(b + 1) * q_len].double()
        positions = torch.arange(context, device=q.device)
        if rows is not None:
            index = torch.tensor(rows, device=q.device)
            qb = qb[index]
        scores = torch.einsum("rhd,khd->hrk", qb, k) / math.sqrt(q.shape[-1])
        if rows is not None:
            scores = scores.masked_fill(positions[None, None, :] > index[None, :, None], float("-inf"))
        out.append(torch.einsum("hrk,khd->rhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(out)


def select_rows(out: "torch.Tensor", batch: int, context: int, rows: list[int]) -> "torch.Tensor":
    """The prefill output [batch * context, Hq, D] at the checked query positions of each sequence."""
    import torch

    index = torch.tensor([b * context + r for b in range(batch) for r in rows], device=out.device)
    return out[index]


def errors(out: "torch.Tensor", ref: "torch.Tensor") -> dict:
    """Relative L2 error, cosine similarity (of the flattened tensors) and max absolute error, in float64."""
    out, ref = out.double().flatten(), ref.double().flatten()
    diff = out - ref
    norms = float(out.norm() * ref.norm())
    return {"rel_l2": float(diff.norm() / ref.norm()),
            "cosine": float(out.dot(ref)) / norms if norms else None,  # undefined for an all-zero tensor
            "max_abs": float(diff.abs().max())}


def round_trip(kv_format: str, x: "torch.Tensor", scale: float) -> "torch.Tensor":
    """dequantize(quantize(x)) with the decode scale the cache was written with, as float32."""
    from kvtrace.capture import formats

    if kv_format == "fp8":
        return formats.fp8_quantize(x, scale)[0].float() * scale
    return formats.nvfp4_dequantize(formats.nvfp4_quantize(x, scale))


def read_back(kv_format: str, keys, values, q_prefill, q_decode, k_scale: float, v_scale: float, batch: int,
              context: int) -> dict:
    """The cache as the format stores it, read back ("k", "v": round_trip with the cache's scales), and float64
    attention over it ("prefill" at prefill_rows(context), "decode"): the format's side of point_quality, and what
    the workload's layout checks hold the kernel's output against."""
    rows = prefill_rows(context)
    k_deq, v_deq = round_trip(kv_format, keys, k_scale), round_trip(kv_format, values, v_scale)
    return {"k": k_deq, "v": v_deq, "prefill": attention64(q_prefill, k_deq, v_deq, batch, context, rows),
            "decode": attention64(q_decode, k_deq, v_deq, batch, context, None)}


def point_quality(dequantized: dict, keys, values, q_prefill, q_decode, batch: int, context: int,
                  kernel: tuple | None = None) -> dict:
    """One workload point's errors (module docstring). dequantized: read_back's for these tensors; kernel:
    FlashInfer's (prefill, decode) outputs, on a GPU."""
    import torch

    rows = prefill_rows(context)
    result = {"reference": "float64 attention over the BF16 cache", "prefill_rows_per_sequence": len(rows),
              "cache": {"k": errors(dequantized["k"], keys), "v": errors(dequantized["v"], values)},
              "format": {}, "output_rounding": {}}
    if kernel is not None:
        result["kernel"], result["kernel_vs_format"] = {}, {}
    for phase, q, phase_rows in (("prefill", q_prefill, rows), ("decode", q_decode, None)):
        ref = attention64(q, keys, values, batch, context, phase_rows)
        result["format"][phase] = errors(dequantized[phase], ref)
        result["output_rounding"][phase] = errors(ref.to(torch.bfloat16), ref)
        if kernel is not None:
            out = kernel[0 if phase == "prefill" else 1]
            out = select_rows(out, batch, context, rows) if phase_rows else out
            result["kernel"][phase] = errors(out, ref)
            result["kernel_vs_format"][phase] = errors(out, dequantized[phase])
    return result
