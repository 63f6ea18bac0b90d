"""Checks before a vLLM capture starts anything: the environment probe (versions, GPU, nvfp4 support), the
model directory and its config, the server port, and the inherited environment worth recording.

Standard library only: the probe runs in the Python that has vLLM (kvtrace.capture.vllm_probe), so that
kvtrace itself never imports torch or vLLM.
"""

from __future__ import annotations

import json
import os
import socket
import kvtrace.nsys
from pathlib import Path

from kvtrace import model_config
from kvtrace.capture import vllm_probe
from kvtrace.capture.vllm_config import VllmCapture
from kvtrace.errors import KvtraceError
from kvtrace.kv_formats import canonical_format

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
MAKE_TOKENIZER = "make_tokenizer.py"  # beside llama-tiny's config.json (fixtures/models/llama-tiny)
# Inherited environment worth recording; names that look like credentials are never written.
_ENV_PREFIXES = ("VLLM_", "FLASHINFER_", "CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "TRITON_", "HF_", "NVIDIA_")
_ENV_NAMES = ("PYTHONHASHSEED", "PYTHONPATH", "MAX_JOBS", "LD_LIBRARY_PATH")
_SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")


def probe_environment(python: str, nvfp4: bool) -> dict:
    """Versions, GPU and (when asked) whether the installed vLLM stores nvfp4 KV on this GPU, from a child
    Python so that kvtrace itself never imports torch or vLLM."""
    command = [python, str(Path(vllm_probe.__file__)), *(["nvfp4"] if nvfp4 else [])]
    try:
        result = kvtrace.nsys.run_step(command, "the environment probe", 600, env={**os.environ, "PYTHONSAFEPATH": "1"})
    except (OSError, kvtrace.nsys.TimedOut) as error:
        raise KvtraceError(f"{python} could not run the environment probe ({error}): check the Python "
                           "that has vLLM installed") from None
    for line in result.stdout.splitlines():
        if line.startswith(vllm_probe.MARKER):
            return json.loads(line.removeprefix(vllm_probe.MARKER))
    detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
    raise KvtraceError(f"{python} could not run the environment probe ({detail}): check that Python "
                       "imports torch and vLLM")


def check_probe(probe: dict, arms: tuple[str, ...], tensor_parallel_size: int = 1) -> None:
    if not probe.get("vllm"):
        raise KvtraceError("vLLM is not installed for this Python: pip install 'kvtrace[vllm]' (vLLM 0.26 or "
                           "newer) where kvtrace runs, or use --dry-run to print the commands")
    if not probe.get("gpu_count"):
        detail = f" ({probe['torch_error']})" if probe.get("torch_error") else ""
        raise KvtraceError(f"no CUDA GPU visible to torch{detail}: run the vLLM capture on a GPU machine, "
                           "or use --dry-run to print the commands")
    if probe["gpu_count"] < tensor_parallel_size:
        raise KvtraceError(f"--tensor-parallel-size {tensor_parallel_size} needs {tensor_parallel_size} GPUs, and "
                           f"torch sees {probe['gpu_count']}: run on a machine with as many (CUDA_VISIBLE_DEVICES "
                           "may hide some), or lower --tensor-parallel-size")
    if any(arm.startswith("nvfp4") for arm in arms):
        check_nvfp4(probe)


def check_nvfp4(probe: dict) -> None:
    """The installed vLLM's own answer decides (FlashInferBackend.supports_kv_cache_dtype): vLLM 0.33 stores
    nvfp4 on SM80/90/120 through FlashInfer's FA2 path (`_nvfp4_kv_on_fa2` in vllm/v1/attention/backends/
    flashinfer.py), older releases only on SM100 (trtllm-gen). A probe that could not ask is a failed probe,
    never a "no"."""
    verdict = probe.get("vllm_nvfp4_kv")
    major, minor = probe["capability"]
    gpu, version = f"{probe['gpu_name']} (SM{major}{minor})", probe["vllm"]
    if verdict is True or (verdict is None and major == 10 and not probe.get("vllm_nvfp4_kv_error")):
        return  # SM10x with a vLLM too old to be asked: its trtllm-gen path is where nvfp4 began
    if verdict is None:
        error = probe.get("vllm_nvfp4_kv_error") or "the probe gave no answer"
        raise KvtraceError(f"could not ask vLLM {version} whether it stores an nvfp4 KV cache on {gpu}: importing "
                           f"its FlashInfer backend failed ({error}); fix that vLLM install (the error names "
                           "what is missing), or capture --arms auto,fp8")
    here = "--arms auto,fp8 here"
    if major == 10:
        problem = (f"vLLM {version} reports no nvfp4 KV support on {gpu}: its FlashInfer trtllm-gen attention is "
                   "unavailable")
        fix = ("check the FlashInfer install and that --attention-config.use_trtllm_attention is not false, "
               f"or capture {here}")
    else:
        problem = f"vLLM {version} does not store an nvfp4 KV cache on {gpu}"
        fix = f"install vLLM 0.33 or newer (its FlashInfer backend stores nvfp4 on SM80, SM90 and SM120), or capture {here}"
    raise KvtraceError(f"{problem}: {fix}")


def check_model(cfg: VllmCapture) -> dict:
    """The model's attention shapes from its config.json, after checking that vLLM can load it."""
    path = Path(cfg.model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise KvtraceError(f"{cfg.model} has no config.json: point --model at a model directory or a "
                               "Hugging Face model id")
        if cfg.load_format == "auto" and not any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()):
            raise KvtraceError(f"{cfg.model} holds no weights (*.safetensors, *.bin): pass --load-format dummy "
                               "for random weights (kernel timings do not depend on their values), or point "
                               "--model at a full checkpoint")
        if cfg.mode == "serve" and not any((path / name).exists() for name in TOKENIZER_FILES):
            raise KvtraceError(f"{cfg.model} has no tokenizer files, which `vllm bench serve` needs to build "
                               f"prompts: {_tokenizer_fix(path, cfg.load_format)}, or use --mode offline "
                               "(token-id prompts)")
        try:
            config = json.loads((path / "config.json").read_text())
        except ValueError as error:
            raise KvtraceError(f"{path / 'config.json'} is not valid JSON ({error}): fix or replace it") from None
    elif cfg.is_local_model():
        raise KvtraceError(f"model path {cfg.model} does not exist: check --model")
    else:
        config = _hub_config(cfg.model)
    summary = model_summary(cfg.model, config, cfg.arms)
    limit = summary.get("max_position_embeddings")
    longest = max(p.prefix_len + p.input_len + p.output_len for p in cfg.workload.points(cfg.mode))
    if limit and longest > limit and not any(a.startswith("--max-model-len") for a in cfg.extra_args):
        raise KvtraceError(f"requests of {longest} tokens exceed the model's {limit} positions: shorten the "
                           "prompts or outputs of this scenario")
    return summary


def _tokenizer_fix(path: Path, load_format: str) -> str:
    # fixtures/models/llama-tiny ships a config and the script that writes its word-level tokenizer.
    script = path / MAKE_TOKENIZER
    if script.is_file():
        return f"run `python3 {script} {path}` (needs the tokenizers package) to write llama-tiny's tokenizer there"
    if load_format == "dummy":
        return (f"add tokenizer files there (for a copy of kvtrace's fixtures/models/llama-tiny config, "
                f"`python3 fixtures/models/llama-tiny/{MAKE_TOKENIZER} {path}` writes a word-level one)")
    return "add the model's tokenizer files there"


def _hub_config(model: str) -> dict | None:
    """config.json from the local Hugging Face cache, if the model was downloaded before (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(model, "config.json")
        return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None
    except (OSError, ValueError):  # not a valid repo id, or a damaged cache entry: vLLM will say more
        return None


def model_summary(model: str, config: dict | None, arms: tuple[str, ...]) -> dict:
    if config is None:
        return {"source": model, "config": "not found locally"}
    text = model_config.text_part(config)
    summary = {
        "source": model,
        "architectures": config.get("architectures"),
        "model_type": text.get("model_type", config.get("model_type")),
        "num_hidden_layers": text.get("num_hidden_layers"),
        "num_attention_heads": text.get("num_attention_heads"),
        "num_key_value_heads": text.get("num_key_value_heads"),
        "head_dim": text.get("head_dim"),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "torch_dtype": text.get("torch_dtype") or text.get("dtype"),
        "kv_config": model_config.kv_fields(config),  # the analyzer reads the KV layout from these
    }
    try:
        layout = model_config.read(config, model)
    except KvtraceError as error:  # kvtrace cannot size this layout; vLLM still runs it
        summary["kv_layout"] = f"not sized: {error}"
        return summary
    summary["kv_layout"] = layout.describe()
    per_token = {}
    for arm in arms:
        kv_format = canonical_format(arm, layout.dtype)  # "auto" stores the model dtype, taken as 16-bit
        if model_config.format_problem(layout, kv_format):
            continue
        try:  # every KV layer's bytes per token
            per_token[arm] = layout.bytes_per_token(kv_format)
        except ValueError:  # NVFP4 of a head_dim that is no multiple of 16: vLLM refuses that arm itself
            continue
    summary["kv_bytes_per_token"] = {arm: int(b) if b.is_integer() else b for arm, b in per_token.items()}
    return summary


def check_port(host: str, port: int) -> None:
    if not port_free(host, port):
        raise KvtraceError(f"port {port} on {host} is in use: stop what listens there or pass --port")


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def relevant_env(environ) -> dict[str, str]:
    return {name: value for name, value in sorted(environ.items())
            if (name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES)
            and not any(marker in name.upper() for marker in _SECRET_MARKERS)}
