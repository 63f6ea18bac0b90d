"""kvtrace engine patch "validate-once": FlashInfer's NVFP4 KV append validates each CUDA scale tensor once.

FlashInfer 0.7.2.post1's `flashinfer.page._as_float32_scalar_tensors` copies every CUDA k_scale/v_scale to the host
on every call to check that it is positive and finite (flashinfer PR #3740: a zero, negative or NaN scale silently
writes an all-zero cache). vLLM 0.33 passes each layer's constant scale tensors, so an eager NVFP4 step waits on
one device-to-host copy per layer. This patch keeps the check and runs it once per scale tensor: a tensor is
checked again whenever its storage, device or in-place version changes, and always while it cannot be keyed. A
failed check raises as before; nothing is ever skipped unchecked. During CUDA graph capture the original runs.

kvtrace installs this file as `sitecustomize.py` on the PYTHONPATH of one server only (kvtrace.capture.
vllm_patches), so that the server, its engine core and its workers (spawned) all load it; the manifest records
its name and SHA-256. It imports nothing heavy until FlashInfer's page module is imported.
"""

import importlib.abc
import importlib.util
import os
import runpy
import sys
import weakref

PATCH = "validate-once"
TARGET_MODULE, TARGET = "flashinfer.page", "_as_float32_scalar_tensors"


def _say(text):
    print(f"kvtrace patch {PATCH} (pid {os.getpid()}): {text}", file=sys.stderr, flush=True)


def _wrap(original, page):
    import torch

    checked = {}  # id(tensor) -> (weak reference, storage, version) as it was checked
    said = set()  # what was said once to the log

    def state(value):
        try:
            return value.data_ptr(), value._version
        except RuntimeError:  # inference tensors carry no version counter: they are checked every call
            return None

    def already_checked(value, device):
        if not (isinstance(value, torch.Tensor) and value.is_cuda and value.device == device
                and value.dtype == torch.float32 and value.numel() == 1 and value.is_contiguous()):
            return False
        entry = checked.get(id(value))
        return entry is not None and entry[0]() is value and entry[1] == state(value) is not None

    def validate_once(values, *, device):
        if page._is_stream_capturing_on_device(device):
            return original(values, device=device)
        if all(already_checked(value, device) for _, value in values):
            if "reused" not in said:
                said.add("reused")
                _say("scale tensors already checked: no host copy for them from now on")
            return tuple(value for _, value in values)  # what the original returns for such tensors
        result = original(values, device=device)  # raises on a bad scale, as before
        for _, value in values:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                now = state(value)
                if now is None and "unkeyed" not in said:
                    said.add("unkeyed")
                    _say("a scale tensor carries no version counter: it is checked every call, as before")
                if now is not None:
                    checked[id(value)] = (weakref.ref(value), now)
        return result

    validate_once.__wrapped__ = original
    return validate_once


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        original = getattr(module, TARGET, None)
        if original is None:
            _say(f"{TARGET_MODULE}.{TARGET} not found: this FlashInfer is not the one the patch is for; NOT applied")
            return
        setattr(module, TARGET, _wrap(original, module))
        _say(f"wrapped {TARGET_MODULE}.{TARGET}")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def _chain_site_customization():
    """Run the sitecustomize this file shadows, if any, as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            runpy.run_path(candidate, run_name="sitecustomize")
            return


sys.meta_path.insert(0, _Finder())
_chain_site_customization()
