"""What a report's Environment and Reproduce sections hold from a run directory's manifest, beyond the traces: the KV
pool each arm ran with and how it was set, the engine settings a serve run's server got, the model's shape, the
`kvtrace capture` command that records the same run again, and the engine's own commands as the capture ran them
(the server under nsys, then the bench client per traffic point).

Machine paths are shortened to their last component (the model's folder, the python and nsys binaries): a report
names no host's layout."""

from __future__ import annotations

import json
import shlex
from pathlib import Path, PurePosixPath

from kvtrace import files
from kvtrace.analyzer import kv_pool
from kvtrace.analyzer.runs import bare_name, run_file
from kvtrace.manifest import Manifest, Point

# The settings that shape a serve run's server besides the KV format, as `kvtrace capture vllm` recorded them.
_SERVE_SETTINGS = ("attention_backend", "load_format", "prefix_caching", "seed", "profile_steps")


def portable(argv: list[str]) -> str:
    """A recorded command with machine paths made portable: files of the run directory by name, any other
    absolute path by its last component (`nsys`, `python3`, the model's folder)."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if value.startswith("/"):
            value = PurePosixPath(value).name
        out.append(f"{key}{eq}{value}")
    return shlex.join(out)


def pool_row(manifest: Manifest) -> tuple[str, str] | None:
    """("KV pool", "fp8 16,384 tokens, nvfp4 29,120 tokens (--kv-cache-memory-bytes 1 GiB)") for a vLLM run."""
    if manifest.engine != "vllm":
        return None
    pools = kv_pool.arm_pools(manifest, [(arm, None) for arm in manifest.runs_by_arm])
    if all(p.tokens is None for p in pools):
        return None
    sizes = ", ".join(f"{p.arm} {p.tokens:,} tokens" if p.tokens is not None else f"{p.arm} not recorded"
                      for p in pools)
    how = list(dict.fromkeys(kv_pool.size_words(p) for p in pools))
    return "KV pool", f"{sizes} ({'; '.join(how)})"


def serve_settings(manifest: Manifest) -> str | None:
    """A serve run's engine settings (its workload records none of its own): what every arm's server got."""
    if manifest.engine != "vllm" or manifest.mode != "serve":
        return None
    words = [f"{key}={manifest.settings[key]}" for key in _SERVE_SETTINGS
             if isinstance(manifest.settings.get(key), (str, int, float, bool))]
    extra = manifest.settings.get("extra_vllm_args")
    if isinstance(extra, list) and extra:
        words.append(f"extra vLLM arguments: {shlex.join(map(str, extra))}")
    return ", ".join(words) or None


def model_config(manifest: Manifest) -> str | None:
    """The model's shape as the capture read it (its config.json summary, less where it was read from)."""
    model = {k: v for k, v in manifest.model.items() if k not in ("source", "kv_config")}
    return json.dumps(model, sort_keys=True, ensure_ascii=False) if model else None


def capture_command(manifest: Manifest) -> str | None:
    """The `kvtrace capture vllm` command that records this run again, from the manifest's settings: a sweep runs
    the very points this run directory ran (--points-from it), a single point its shape. A scenario of a capture
    matrix says where the matrix's plan is instead (its settings hold one scenario of it)."""
    s = manifest.settings
    if manifest.engine != "vllm" or not s.get("scenario"):
        return None
    if "servers" in s:  # one scenario of `kvtrace capture vllm-matrix`, whose plan is the matrix root's
        return "# recorded by kvtrace capture vllm-matrix: its plan and arms are in ../matrix.json"
    model = PurePosixPath(str((s.get("model") or {}).get("source") or "MODEL")).name
    argv = ["kvtrace", "capture", "vllm", "--model", model, "--scenario", s["scenario"], "--mode",
            s.get("mode") or "serve", "--arms", ",".join(s.get("arms") or manifest.runs_by_arm),
            "--out", "RUN_DIR"]
    points = s.get("points") or []
    if s["scenario"] == "sweep":
        argv += ["--points-from", "."]  # this run directory: its very points
    elif points:
        try:
            point = Point.parse(points[0])
        except (ValueError, TypeError):
            point = None
        if point is not None:
            argv += ["--input-len", str(point.input_len), "--output-len", str(point.output_len),
                     "--num-prompts", str(point.num_prompts), "--concurrency", str(point.concurrency)]
            if point.prefix_len:
                argv += ["--prefix-len", str(point.prefix_len), "--num-prefixes", str(point.num_prefixes)]
    for key, flag in (("seed", "--seed"), ("load_format", "--load-format"), ("repeats", "--repeats"),
                      ("profile_steps", "--profile-steps")):
        if s.get(key) not in (None, ""):
            argv += [flag, str(s[key])]
    extra = s.get("extra_vllm_args")
    if isinstance(extra, list) and extra:
        argv += ["--", *map(str, extra)]
    return portable(argv)


def engine_commands(manifest: Manifest) -> list[str]:
    """Each run's server (or offline worker) command under nsys as recorded; for a serve run, the first run's bench
    commands after its own, warm-up first then one per traffic point (the other runs sent the same with their own
    result file names). A `kvtrace capture vllm-matrix` run shares its arm's server with the other scenarios and
    records only its bench commands: each server's command is the first line of its log, once per server."""
    commands = []
    servers = isinstance(manifest.settings.get("servers"), dict)
    logs: set[str] = set()
    for place, name in enumerate(manifest.runs):
        raw = manifest.raw["arms"][name].get("commands")
        recorded = [c for c in raw if isinstance(c, list) and c and all(isinstance(a, str) for a in c)] \
            if isinstance(raw, list) else []
        if servers:
            log = manifest.raw["arms"][name].get("log")
            if isinstance(log, str) and log not in logs:
                logs.add(log)
                commands += [c for c in [_logged_command(manifest.path.parent, log, f"arm {name}")] if c]
            bench = recorded if place == 0 else []
        else:
            commands += [portable(recorded[0])] if recorded else []
            bench = recorded[1:] if place == 0 else []
        if manifest.mode == "serve":
            commands += [portable(c) for c in bench if "bench" in c and "serve" in c]
    return commands


def _logged_command(run: Path, log: str, owner: str) -> str | None:
    """The command a server log opens with ("$ nsys profile … vllm serve …"), from a log in the run directory
    itself, read as runs reads a run's log (a regular file inside the run directory, bounded); None where there is
    none, its first line is not one whole line within 64 KiB, or it does not parse."""
    if not bare_name(log):
        return None
    path = run_file(run, log, owner, "log")
    if not path.exists():
        return None
    text = files.read_small(path, f"log {path}", "keep the capture's own log there, or remove it").decode(
        errors="replace")
    end = text.find("\n", 0, 1 << 16)
    if not text.startswith("$ ") or end < 0:
        return None
    try:
        return portable(shlex.split(text[2:end]))
    except ValueError:
        return None
