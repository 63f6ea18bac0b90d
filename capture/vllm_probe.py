"""What the Python that runs vLLM has: package versions, GPU, and (when asked) whether its vLLM stores an nvfp4
KV cache on this GPU. Run as a script by kvtrace.capture.vllm_preflight, in that Python, so that kvtrace itself
never imports torch or vLLM:

    python vllm_probe.py [nvfp4]

Prints one line, `KVTRACE_PROBE <json>`. Standard library at module level; torch and vLLM only inside.
"""

import json
import sys
from importlib import metadata, util

MARKER = "KVTRACE_PROBE "
PACKAGES = ("vllm", "torch", "flashinfer-python", "prometheus-client")


def probe(nvfp4: bool) -> dict:
    info = {}
    for dist in PACKAGES:
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    if info["vllm"] is None and util.find_spec("vllm") is not None:
        info["vllm"] = "unknown (no package metadata)"
    try:
        import torch

        info["cuda_runtime"] = torch.version.cuda
        info["gpu_count"] = torch.cuda.device_count()
        if info["gpu_count"]:
            info["gpu_name"] = torch.cuda.get_device_name(0)
            info["capability"] = list(torch.cuda.get_device_capability(0))
    except Exception as error:  # a broken torch is reported, not raised: the preflight names it
        info["torch_error"] = f"{type(error).__name__}: {error}"
    if nvfp4 and info["vllm"] and info.get("gpu_count"):
        try:
            from vllm.v1.attention.backends.flashinfer import FlashInferBackend

            info["vllm_nvfp4_kv"] = bool(FlashInferBackend.supports_kv_cache_dtype("nvfp4"))
        except Exception as error:
            info["vllm_nvfp4_kv_error"] = f"{type(error).__name__}: {error}"
    return info


if __name__ == "__main__":
    print(MARKER + json.dumps(probe("nvfp4" in sys.argv[1:])))
