"""A torch-only stand-in for the FlashInfer calls a `kvtrace repro` script makes, so that its tests run the whole
script on the CPU: the wrappers gather each sequence's pages through the page table the script planned, decode the
cache as FlashInfer documents its formats (FP8 times its scale; NVFP4: E2M1 codes, low nibble first, times the
E4M3 block scale and the global scale) and attend in float32 (causal rows aligned to the end of the keys). Written
apart from the script's own float64 reference, so that a wrong page table or layout shows as a large error.
"""

from __future__ import annotations

import math
import types

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
CALLS: list[str] = []  # what ran, by name, for the tests

# The logit a causal mask gives a future key. FlashInfer 0.6.16.post3 used a finite one (-5e4 times the folded
# k_scale / sqrt(d), about -8.5 on Gaussian inputs); a test sets such a value to see the scripts' check catch it.
MASKED_LOGIT = float("-inf")


def _decode_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: float) -> torch.Tensor:
    nibbles = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).long()
    values = E2M1[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0)
    return values * block_scales.float().repeat_interleave(16, dim=-1) * float(global_scale)


def _scalar(value) -> float:
    return float(value.reshape(())) if isinstance(value, torch.Tensor) else float(value)


def _sequence(pages, indptr, indices, last_page_len, b):
    chosen = indices[int(indptr[b]):int(indptr[b + 1])].long()
    length = (len(chosen) - 1) * pages.shape[1] + int(last_page_len[b])
    return pages[chosen].reshape(-1, *pages.shape[2:])[:length]


class _Wrapper:
    def __init__(self, workspace, layout="NHD", use_cuda_graph=False, backend="auto", use_tensor_cores=False):
        assert layout == "NHD"
        self.backend = backend

    def _plan(self, qo_indptr, indptr, indices, last_page_len, hq, hkv, dim, page, causal, q_data_type,
              kv_data_type):
        self.qo_indptr, self.indptr, self.indices, self.last = qo_indptr, indptr, indices, last_page_len
        self.hq, self.hkv, self.causal, self.kv_dtype, self.q_dtype = hq, hkv, causal, kv_data_type, q_data_type

    def run(self, q, paged_kv_cache, q_scale=None, k_scale=None, v_scale=None, kv_cache_sf=None):
        CALLS.append(f"{type(self).__name__}:{self.backend}:{q.dtype}:{paged_kv_cache[0].dtype}")
        assert q.dtype == self.q_dtype and paged_kv_cache[0].dtype == self.kv_dtype
        outputs = []
        for b in range(len(self.indptr) - 1):
            k, v = (_sequence(pages, self.indptr, self.indices, self.last, b) for pages in paged_kv_cache)
            if kv_cache_sf is not None:
                ks, vs = (_sequence(pages, self.indptr, self.indices, self.last, b) for pages in kv_cache_sf)
                k, v = _decode_nvfp4(k, ks, _scalar(k_scale)), _decode_nvfp4(v, vs, _scalar(v_scale))
            else:
                k, v = k.float() * _scalar(k_scale or 1.0), v.float() * _scalar(v_scale or 1.0)
            rows = q[int(self.qo_indptr[b]):int(self.qo_indptr[b + 1])].float() * _scalar(q_scale or 1.0)
            group = self.hq // self.hkv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", rows, k) / math.sqrt(q.shape[-1])
            if self.causal:
                position = torch.arange(k.shape[0] - rows.shape[0], k.shape[0])[:, None]
                scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > position, MASKED_LOGIT)
            outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        return torch.cat(outputs).to(torch.bfloat16)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, hq, hkv, dim, page, causal=False,
             q_data_type=torch.float16, kv_data_type=None, o_data_type=None):
        if self.backend == "fa3" and kv_data_type == torch.uint8:
            raise ValueError("fa3 reads no NVFP4 cache")
        self._plan(qo_indptr, indptr, indices, last_page_len, hq, hkv, dim, page, causal, q_data_type, kv_data_type)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, hq, hkv, dim, page, **kwargs):
        batch = len(indptr) - 1
        self._plan(torch.arange(batch + 1), indptr, indices, last_page_len, hq, hkv, dim, page, False,
                   kwargs["q_data_type"], kwargs["kv_data_type"])


def _check_slots(slots, pages):
    assert slots.min() >= 0 and slots.max() < pages.shape[0] * pages.shape[1]


def append_paged_kv_cache(k, v, batch_indices, positions, paged, indices, indptr, last_page_len, layout):
    CALLS.append("append_paged_kv_cache")
    assert k.dtype == paged[0].dtype and len(k) == len(batch_indices) == len(positions)


def nvfp4_quantize_append_paged_kv_cache(k, v, batch_indices, positions, paged, scales, indices, indptr,
                                         last_page_len, k_scale, v_scale, layout):
    CALLS.append("nvfp4_quantize_append_paged_kv_cache")
    assert isinstance(k_scale, float) and len(k) == len(batch_indices) == len(positions)


def _as_float32_scalar_tensors(values, *, device):
    """FlashInfer's host check of the scales: one count per CUDA tensor checked (its device-to-host copy)."""
    CALLS.extend("scale check" for _, value in values if isinstance(value, torch.Tensor))
    return tuple(value if isinstance(value, torch.Tensor) else torch.tensor([value]) for _, value in values)


PAGE = types.ModuleType("flashinfer.page")
PAGE._as_float32_scalar_tensors = _as_float32_scalar_tensors


def nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(k, v, slots, paged, scales, k_scale, v_scale,
                                                           layout="NHD"):
    CALLS.append(f"slot_mapping:{type(k_scale).__name__}")
    PAGE._as_float32_scalar_tensors((("k_scale", k_scale), ("v_scale", v_scale)), device=k.device)
    _check_slots(slots, paged[0])
    assert len(slots) == len(k)


def nvfp4_kv_dequantize_paged(paged, scales, block_tables, seq_lens, k_scale, v_scale, out_k, out_v, layout):
    CALLS.append("nvfp4_kv_dequantize_paged")
    for b, length in enumerate(seq_lens.tolist()):
        pages = block_tables[b][:math.ceil(length / paged[0].shape[1])].long()
        for data, sf, scale, out in ((paged[0], scales[0], k_scale, out_k), (paged[1], scales[1], v_scale, out_v)):
            rows = data[pages].flatten(0, 1)[:length], sf[pages].flatten(0, 1)[:length]
            out[b, :length] = _decode_nvfp4(*rows, _scalar(scale)).to(out.dtype)


def module() -> types.ModuleType:
    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.0.0+standin"
    fake.page = PAGE
    for name, value in list(globals().items()):
        if name[0].isupper() or name.startswith(("append", "nvfp4")):
            setattr(fake, name, value)
    return fake


class _Event:
    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        import time
        self.at = time.perf_counter()

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def cuda_on_cpu(monkeypatch) -> None:
    """torch.cuda as far as the script uses it, answering on the CPU."""
    properties = types.SimpleNamespace(multi_processor_count=0, total_memory=0)
    for name, value in (("Event", _Event), ("synchronize", lambda *a: None), ("current_device", lambda: 0),
                        ("get_device_properties", lambda *a: properties), ("get_device_name", lambda *a: "CPU"),
                        ("get_device_capability", lambda *a: (0, 0)), ("empty_cache", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)
