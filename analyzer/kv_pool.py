"""The KV pool each arm served from, and how it was set: a capacity-bound point binds only for the pool it ran with,
so the pool is part of what a decision holds for. Where the runs set it below vLLM's default (a memory cap such as
--kv-cache-memory-bytes), a run of the same model shape on the same GPU with vLLM's default pool (the tokens its
startup line reported, per KV format) projects where each capacity-bound point would bind without the cap."""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.manifest import Manifest, Point

# vLLM's flags that size the KV pool, in the order they take precedence.
POOL_FLAGS = ("--kv-cache-memory-bytes", "--num-gpu-blocks-override", "--gpu-memory-utilization")
GIB = 1 << 30


@dataclass(frozen=True)
class ArmPool:
    """One arm's KV pool: its tokens (the startup line's) and the flag that set it (None: vLLM's default)."""

    arm: str
    kv_format: str | None
    tokens: int | None
    flag: str | None  # "--kv-cache-memory-bytes 1073741824"
    pool_bytes: int | None  # the bytes the flag gave, where it gives bytes

    @property
    def default(self) -> bool:
        return self.flag is None


def _flag(flags: list) -> tuple[str | None, int | None]:
    words = [str(f) for f in flags]
    for name in POOL_FLAGS:
        for index, word in enumerate(words):
            value = word.split("=", 1)[1] if word.startswith(name + "=") else \
                words[index + 1] if word == name and index + 1 < len(words) else None
            if value is not None:
                size = int(value) if name == "--kv-cache-memory-bytes" and value.isdecimal() else None
                return f"{name} {value}", size
    return None, None


def arm_pools(manifest: Manifest, arms: list[tuple[str, str | None]]) -> list[ArmPool]:
    """The pool of each (arm name, KV format) of a run directory, from its first run's startup line and its engine
    flags."""
    pools = []
    engine_flags = manifest.settings.get("engine_flags") or {}
    for name, kv_format in arms:
        runs = manifest.runs_by_arm.get(name) or [name]
        record = manifest.runs[runs[0]]
        flags = engine_flags.get(name) if isinstance(engine_flags, dict) else None
        if not isinstance(flags, list):
            flags = manifest.settings.get("extra_vllm_args") or []
        flag, size = _flag(flags)
        pools.append(ArmPool(arm=name, kv_format=kv_format, tokens=record.kv_cache_tokens, flag=flag, pool_bytes=size))
    return pools


def size_words(pool: ArmPool) -> str:
    """"--kv-cache-memory-bytes 1 GiB", or the flag as given, or "vLLM's default"."""
    if pool.flag is None:
        return "vLLM's default"
    if pool.pool_bytes is not None and pool.pool_bytes % GIB == 0:
        return f"{pool.flag.split()[0]} {pool.pool_bytes // GIB} GiB"
    return pool.flag


@dataclass(frozen=True)
class Projection:
    """Where a capacity-bound arm would bind with the default pool: the concurrency at which the point's requests
    (prompt and output tokens each) would fill the default pool's tokens."""

    arm: str
    tokens_per_request: int
    default_tokens: int
    binds_near: int  # the first concurrency whose demand exceeds the default pool


def project(point: str | None, pool: ArmPool, default_tokens: int | None) -> Projection | None:
    if point is None or default_tokens is None or pool.default:
        return None
    try:
        shape = Point.parse(point)
    except (ValueError, TypeError):
        return None
    per_request = shape.prefix_len + shape.input_len + shape.output_len
    if per_request <= 0:
        return None
    return Projection(arm=pool.arm, tokens_per_request=per_request, default_tokens=default_tokens,
                      binds_near=default_tokens // per_request + 1)
