"""Engine patches for counterfactual arms: `--arms fp8,nvfp4,nvfp4:validate-once` records a third arm whose server
runs a named, declared change to the engine's Python code, shipped in capture/patches/NAME.py.

A patch is installed as `sitecustomize.py` in a folder put first on that one server's PYTHONPATH: the server and
the engine core and workers it spawns load it; no other process does. Its name and the SHA-256 of its text go into
the manifest wherever the arm appears, and the arm's files are named LABEL.rK.* with LABEL = KVDTYPE-PATCH (e.g.
nvfp4-validate-once.r1.*), so that a patched arm is never read as a stock release.

Standard library only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvtrace.errors import KvtraceError
from kvtrace.kv_formats import VLLM_KV_CACHE_DTYPES, patched_arm_label

PATCHES = Path(__file__).parent / "patches"


def known_patches() -> list[str]:
    return sorted(path.stem for path in PATCHES.glob("*.py"))


@dataclass(frozen=True)
class ArmSpec:
    """One arm of a matrix: the label its files and manifests carry, vLLM's --kv-cache-dtype, and its patch."""

    label: str
    kv_dtype: str
    patch: str | None = None

    @classmethod
    def parse(cls, text: str) -> "ArmSpec":
        kv_dtype, _, patch = text.partition(":")
        if kv_dtype not in VLLM_KV_CACHE_DTYPES:
            raise KvtraceError(f"unknown arm {text!r}: an arm is a vLLM --kv-cache-dtype ({', '.join(VLLM_KV_CACHE_DTYPES)})"
                               ", optionally with :PATCH, e.g. nvfp4:validate-once")
        if not patch:
            return cls(kv_dtype, kv_dtype)
        if patch not in known_patches():
            raise KvtraceError(f"unknown patch {patch!r} in --arms {text}: choose from {', '.join(known_patches())} "
                               "(files in capture/patches/)")
        return cls(patched_arm_label(kv_dtype, patch), kv_dtype, patch)

    def record(self) -> dict | None:
        """What the manifest says about the arm's patch (None: the stock engine)."""
        if self.patch is None:
            return None
        text = (PATCHES / f"{self.patch}.py").read_bytes()
        return {"name": self.patch, "file": f"capture/patches/{self.patch}.py",
                "sha256": hashlib.sha256(text).hexdigest(), "applied_to": "this arm's vllm serve process tree only"}


def install(spec: ArmSpec, folder: Path, env: dict) -> dict:
    """The server environment with the patch on its PYTHONPATH (env unchanged for a stock arm)."""
    if spec.patch is None:
        return env
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PATCHES / f"{spec.patch}.py", folder / "sitecustomize.py")
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": str(folder) + (os.pathsep + path if path else "")}
