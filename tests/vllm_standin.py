"""Stand-ins for what the vLLM capture drives, so that its tests need no GPU, vLLM or Nsight Systems.

- `python vllm_standin.py nsys profile|export|--version ...`: runs the profiled command and writes a report
  file when it exits (ignoring SIGINT itself, as nsys does while it finalizes); export writes a small SQLite.
- A fake `vllm` package (written by the tests into a temporary folder, see `write_fake_vllm`) whose
  `python -m vllm.entrypoints.cli.main serve` is a tiny HTTP server with /health, /metrics (prometheus_client
  text, vLLM's metric names), /start_profile, /stop_profile, /reset_prefix_cache, /v1/models and
  /v1/completions (the bench client's requests, and quality prompts answered by `complete`), and
  whose `bench serve` posts completions to it and writes a result JSON. Its `LLM` class serves the offline
  worker, beside a fake `torch` (version and NVTX only, as a CPU-only torch has none).

Failures are switched on per arm through STANDIN_FAIL, e.g. "never-ready@fp8,bench@nvfp4":
server-exit, never-ready, ignore-sigint, profile-404, profile-body-422 (a /start_profile with a body refused), quality (server; quality: prompts answered 500), drop-keepalive
(server: a connection closed, unannounced, after each completion), drop-window (server under nsys
--capture-range-end=repeat: no report for its window STANDIN_DROP_WINDOW, the first by default;
STANDIN_REPORTS_AT_EXIT: every report written when the server exits); bench
(client); worker (offline LLM); no-report, export (nsys; these two also per run, e.g. "export@fp8.r2"). STANDIN_DEVICES
lists the devices whose kernels an export holds, STANDIN_RANK_GIB each tensor-parallel rank's KV memory. STANDIN_PIDDIR
collects pid files so
tests can check that nothing survives; STANDIN_BENCH_HANG names a file the measured bench creates before
hanging (for Ctrl-C tests); STANDIN_CALLS names a file the offline LLM appends its calls to; STANDIN_CONNECTIONS a
file the server appends a line (the arm) to for each connection that carried completions.
"""

from __future__ import annotations

# Each process started from here imports what its own part needs, the rest on the way in (a capture starts dozens).
import argparse
import importlib
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

MODEL_LABELS = ("model_name", "engine")
BLOCK = 16


def failing(what: str, arm: str | None) -> bool:
    return f"{what}@{arm}" in os.environ.get("STANDIN_FAIL", "").split(",")


def write_pid(kind: str) -> None:
    folder = os.environ.get("STANDIN_PIDDIR")
    if folder:
        Path(folder, f"{kind}-{os.getpid()}.pid").write_text(str(os.getpid()))


def kv_tokens(kv_dtype: str) -> int:
    """Capacity that moves with the KV dtype the way vLLM's does (bf16 2 B, fp8 1 B, nvfp4 0.5625 B)."""
    base = int(os.environ.get("STANDIN_KV_TOKENS", "100000"))
    return {"auto": base // 2, "nvfp4": base * 16 // 9}.get(kv_dtype, base)


def print_kv_lines(tokens: int) -> None:
    # Tensor-parallel workers each log their KV memory (STANDIN_RANK_GIB: one value per rank).
    for rank, gib in enumerate(filter(None, os.environ.get("STANDIN_RANK_GIB", "").split(","))):
        print(f"(Worker_TP{rank} pid={os.getpid() + 1 + rank}) INFO [gpu_worker.py:398] Available KV cache memory: "
              f"{gib} GiB", file=sys.stderr)
    # vLLM 0.26's two startup lines, engine-core prefix included.
    print(f"(EngineCore_DP0 pid={os.getpid()}) INFO [kv_cache_utils.py:2177] GPU KV cache size: {tokens:,} tokens",
          file=sys.stderr)
    print(f"(EngineCore_DP0 pid={os.getpid()}) INFO [kv_cache_utils.py:2178] Maximum concurrency for 8,192 tokens "
          f"per request: {tokens / 8192:.2f}x", file=sys.stderr, flush=True)


class Stats:
    """vLLM's counters and gauges for one engine, exposed the way vLLM exposes them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.counters = dict.fromkeys(("prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                                       "prefix_cache_queries", "prefix_cache_hits"), 0)
        self.gauges = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0}
        self.ttft = [0, 0.0]
        self.engine_steps = 0  # one per output token: what vllm:iteration_tokens_total counts

    def request(self, prompt_len: int, output_len: int, concurrency: int, cached: int) -> None:
        demand = concurrency * (prompt_len + output_len)
        self.counters["prompt_tokens"] += prompt_len
        self.counters["generation_tokens"] += output_len
        self.counters["request_success"] += 1
        self.counters["prefix_cache_queries"] += prompt_len
        self.counters["prefix_cache_hits"] += cached
        self.counters["num_preemptions"] += demand > self.capacity
        self.gauges["num_requests_running"] = concurrency
        self.gauges["kv_cache_usage_perc"] = min(1.0, demand / self.capacity)
        self.ttft[0] += 1
        self.ttft[1] += 0.05
        self.engine_steps += output_len

    def prometheus_text(self, model: str, kv_dtype: str) -> str:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

        registry = CollectorRegistry()
        labels = {"model_name": model, "engine": "0"}
        for name, value in self.counters.items():
            Counter(f"vllm:{name}", name, list(labels), registry=registry).labels(**labels).inc(value)
        for name, value in self.gauges.items():
            Gauge(f"vllm:{name}", name, list(labels), registry=registry).labels(**labels).set(value)
        histogram = Histogram("vllm:time_to_first_token_seconds", "ttft", list(labels), buckets=[0.1, 1.0],
                              registry=registry).labels(**labels)
        for _ in range(self.ttft[0]):
            histogram.observe(0.05)
        steps = Histogram("vllm:iteration_tokens_total", "tokens per engine step", list(labels), buckets=[1.0, 16.0],
                          registry=registry).labels(**labels)
        for _ in range(self.engine_steps):
            steps.observe(1.0)
        Gauge("vllm:cache_config_info", "cache config", ["block_size", "cache_dtype", "num_gpu_blocks", "engine"],
              registry=registry).labels(block_size="16", cache_dtype=kv_dtype,
                                        num_gpu_blocks=str(self.capacity // BLOCK), engine="0").set(1)
        return generate_latest(registry).decode()


class KvEventPublisher:
    """vLLM's ZeroMQ KV-event publisher (vllm/distributed/kv_events.py, 0.33): multipart (topic, 8-byte sequence
    number, msgpack [ts, events]), each event a map tagged by its "type"."""

    def __init__(self, config: dict):
        import zmq

        self.topic = config.get("topic", "").encode()
        # XPUB, which is PUB to the subscriber, so that it can see the subscription arrive: a publisher drops what it
        # sends before that, and a fixed sleep would only make the loss unlikely.
        self.socket = zmq.Context.instance().socket(zmq.XPUB)
        self.socket.connect(config["endpoint"])
        self.seq = 0
        if self.socket.poll(10_000):
            self.socket.recv()  # b"\x01" + the subscribed topic

    def publish(self, stored: int, evicted: int) -> None:
        import msgspec

        events = [{"type": "BlockStored", "block_hashes": list(range(stored)), "parent_block_hash": None,
                   "token_ids": [], "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None}]
        events += [{"type": "BlockRemoved", "block_hashes": [index], "medium": "GPU"} for index in range(evicted)]
        payload = msgspec.msgpack.encode([time.time(), events])
        self.socket.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
        self.seq += 1


def record_call(arm: str, name: str, detail=None) -> None:
    calls = os.environ.get("STANDIN_CALLS")
    if calls:
        with open(calls, "a") as handle:
            handle.write(json.dumps({"arm": arm, "call": name, "detail": detail, "pid": os.getpid()}) + "\n")


def complete(request: dict, arm: str) -> dict:
    """A greedy completion of a quality prompt: the sum of the prompt's numbers, which an nvfp4 arm gets wrong (one
    too many) when the sum is odd, and a sentence of up to max_tokens word tokens."""
    import re

    total = sum(int(n) for n in re.findall(r"\d+", request["prompt"]))
    if arm.startswith("nvfp4") and total % 2:
        total += 1
    tokens = [f" {total}", " is", " the", " sum", "."][:request["max_tokens"]]
    return {"choices": [{"text": "".join(tokens), "finish_reason": "stop" if len(tokens) == 5 else "length",
                         "logprobs": {"tokens": tokens, "token_logprobs": [-0.25] * len(tokens)}}]}


def serve(argv: list[str]) -> None:
    import socket
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--kv-cache-dtype")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true")
    parser.add_argument("--kv-events-config")
    args, _ = parser.parse_known_args(argv)
    arm = args.kv_cache_dtype
    events = KvEventPublisher(json.loads(args.kv_events_config)) if args.kv_events_config else None
    write_pid("server")
    if failing("server-exit", arm):
        print("stand-in: CUDA out of memory while loading the model", file=sys.stderr)
        sys.exit(3)
    if failing("ignore-sigint", arm):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    stats = Stats(kv_tokens(arm))
    print_kv_lines(stats.capacity)
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    repeat_output, windows = os.environ.get("STANDIN_NSYS_REPEAT"), [0]

    def write_window_report(number: int) -> None:
        Path(f"{repeat_output}.{number}.nsys-rep").write_text("stand-in window report\n")
    # What an engine patch (capture/patches) did to FlashInfer's page module, as the server imports it.
    page = importlib.import_module("flashinfer.page") if importlib.util.find_spec("flashinfer") else None
    record_call(arm, "serve", {"patched": hasattr(getattr(page, "_as_float32_scalar_tensors", None), "__wrapped__"),
                               "port": args.port})

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server does
        completions = 0  # served over this connection (one handler per connection)

        def setup(self):
            super().setup()
            # Headers and body leave as two writes: without this, the second waits for the client's delayed ACK of
            # the first on a kept-alive connection. vLLM's asyncio server sets it too.
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def reply(self, status: int, body: str = "") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def stream(self, request: dict, details: bool) -> None:
            """A streamed completion as vLLM sends it: one event per token, then the usage chunk."""
            usage = {"prompt_tokens": request["prompt_len"], "completion_tokens": request["output_len"],
                     "total_tokens": request["prompt_len"] + request["output_len"]}
            if details:
                usage["prompt_tokens_details"] = {"cached_tokens": request["cached"]}
            events = [{"choices": [{"index": 0, "text": f" w{3 + token}"}], "usage": None}
                      for token in range(request["output_len"])]
            events.append({"choices": [], "usage": usage})
            data = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
            self.reply(200, data)

        def do_GET(self):
            if self.path == "/health":
                self.reply(503 if failing("never-ready", arm) else 200)
            elif self.path == "/metrics":
                self.reply(200, stats.prometheus_text(args.model, arm))
            elif self.path == "/v1/models":
                self.reply(200, json.dumps({"data": [{"id": args.model}]}))
            else:
                self.reply(404)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/start_profile" and body and failing("profile-body-422", arm):
                self.reply(422, "stand-in: extra fields not permitted")
                return
            if self.path in ("/start_profile", "/stop_profile"):
                record_call(arm, self.path.strip("/"), json.loads(body) if body else None)
                if self.path == "/stop_profile":
                    windows[0] += 1
                    # nsys --capture-range-end=repeat: a report per capture range (drop-window: none for window
                    # STANDIN_DROP_WINDOW, the first by default)
                    dropped = int(os.environ.get("STANDIN_DROP_WINDOW", "1"))
                    if repeat_output and not (failing("drop-window", arm) and windows[0] == dropped) \
                            and not os.environ.get("STANDIN_REPORTS_AT_EXIT"):
                        write_window_report(windows[0])
                self.reply(404 if failing("profile-404", arm) else 200)
            elif self.path == "/reset_prefix_cache":
                record_call(arm, "reset_prefix_cache")
                self.reply(200 if dev_mode else 404, json.dumps({"success": True}))
            elif self.path == "/v1/completions" and isinstance(json.loads(body).get("prompt"), list):
                request = json.loads(body)  # token ids: the matrix's traced pass
                record_call(arm, "traced-completion", {"prompt_tokens": len(request["prompt"]),
                                                       "max_tokens": request["max_tokens"]})
                self.reply(200, json.dumps({"choices": [{"text": " w3" * request["max_tokens"]}],
                                            "usage": {"prompt_tokens": len(request["prompt"]),
                                                      "completion_tokens": request["max_tokens"]}}))
            elif self.path == "/v1/completions" and "prompt" in json.loads(body):
                if failing("quality", arm):
                    self.reply(500, "stand-in: internal error")
                else:
                    self.reply(200, json.dumps(complete(json.loads(body), arm)))
            elif self.path == "/v1/completions":
                request = json.loads(body)
                stats.request(request["prompt_len"], request["output_len"], request["concurrency"],
                              request["cached"])
                if events is not None:
                    events.publish(request["stored_blocks"], request["evicted_blocks"])
                self.stream(request, args.enable_prompt_tokens_details)
                self.completions += 1
                connections = os.environ.get("STANDIN_CONNECTIONS")
                if connections and self.completions == 1:
                    with open(connections, "a") as handle:
                        handle.write(f"{arm}\n")
                # An idle keep-alive connection that the server closes, unannounced, as servers do after a timeout.
                self.close_connection = self.close_connection or failing("drop-keepalive", arm)
            else:
                self.reply(404)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stand-in server: shutting down", file=sys.stderr)
    finally:
        server.server_close()
        if repeat_output and os.environ.get("STANDIN_REPORTS_AT_EXIT"):  # an nsys that writes them all at the end
            for number in range(1, windows[0] + 1):
                write_window_report(number)


def bench(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for name in ("--host", "--dataset-name", "--result-dir", "--result-filename"):
        parser.add_argument(name)
    for name in ("--port", "--num-prompts", "--max-concurrency", "--random-input-len", "--random-output-len",
                 "--prefix-repetition-prefix-len", "--prefix-repetition-suffix-len", "--prefix-repetition-output-len",
                 "--prefix-repetition-num-prefixes", "--seed"):
        parser.add_argument(name, type=int, default=0)
    parser.add_argument("--save-result", action="store_true")
    args, _ = parser.parse_known_args(argv)
    write_pid("bench")
    arm = args.result_filename.split(".")[0] if args.result_filename else None
    hang = os.environ.get("STANDIN_BENCH_HANG")
    if hang and arm:
        Path(hang).write_text(str(os.getpid()))
        while True:
            time.sleep(3600)
    if failing("bench", arm):
        print("stand-in bench: all requests failed", file=sys.stderr)
        sys.exit(1)
    import urllib.request

    prefix, prefixes = args.prefix_repetition_prefix_len, args.prefix_repetition_num_prefixes
    if prefix and args.num_prompts < prefixes:  # vLLM 0.26's prefix_repetition dataset refuses this
        print(f"ValueError: num_requests ({args.num_prompts}) must be greater than or equal to num_prefixes "
              f"({prefixes})", file=sys.stderr)
        sys.exit(1)
    prompt_len = prefix + (args.prefix_repetition_suffix_len if prefix else args.random_input_len)
    evict_every = int(os.environ.get("STANDIN_EVICT_EVERY", "0"))  # a prefix block evicted every N requests
    output_len = args.prefix_repetition_output_len if prefix else args.random_output_len
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for index in range(args.num_prompts):
        cached = prefix if prefix and index >= prefixes else 0  # each prefix misses once, then hits
        evicted = 1 if evict_every and index % evict_every == evict_every - 1 else 0
        body = json.dumps({"prompt_len": prompt_len, "output_len": output_len, "concurrency": args.max_concurrency,
                           "cached": cached, "stored_blocks": (prompt_len - cached) // BLOCK,
                           "evicted_blocks": evicted}).encode()
        request = urllib.request.Request(f"http://{args.host}:{args.port}/v1/completions", data=body, method="POST")
        opener.open(request, timeout=30).read()
    if args.save_result:
        duration = 0.01 * args.num_prompts
        result = {"backend": "vllm", "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
                  "duration": duration, "completed": args.num_prompts, "failed": 0,
                  "total_input_tokens": prompt_len * args.num_prompts,
                  "total_output_tokens": output_len * args.num_prompts,
                  "request_throughput": args.num_prompts / duration,
                  "output_throughput": output_len * args.num_prompts / duration,
                  "mean_ttft_ms": 50.0, "p99_ttft_ms": 80.0, "mean_itl_ms": 10.0, "p99_itl_ms": 20.0}
        Path(args.result_dir, args.result_filename).write_text(json.dumps(result))


def cli_main() -> None:
    """`python -m vllm.entrypoints.cli.main serve|bench serve ...`"""
    argv = sys.argv[1:]
    if argv[0] == "serve":
        serve(argv[1:])
    elif argv[:2] == ["bench", "serve"]:
        bench(argv[2:])
    else:
        sys.exit(f"stand-in vllm: unsupported command {argv}")


# The offline LLM ------------------------------------------------------------------------------------------

class EngineArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for name in ("--model", "--kv-cache-dtype", "--attention-backend", "--profiler-config", "--load-format"):
            parser.add_argument(name)
        for name in ("--seed", "--max-num-seqs", "--max-model-len"):
            parser.add_argument(name, type=int)
        parser.add_argument("--skip-tokenizer-init", action="store_true")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
        return parser

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "EngineArgs":
        engine_args = cls()
        engine_args.__dict__.update(vars(namespace))
        return engine_args


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class Counter:
    def __init__(self, name, labels, value):
        self.name, self.labels, self.value = name, labels, value


class Gauge(Counter):
    pass


class Histogram:
    def __init__(self, name, labels, count, sum):
        self.name, self.labels, self.count, self.sum = name, labels, count, sum


class _Namespace:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class LLM:
    profiling = False

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.arm = kwargs["kv_cache_dtype"]
        self.stats = Stats(kv_tokens(self.arm))
        self.seen_blocks: set[tuple[int, ...]] = set()
        cache = _Namespace(cache_dtype=self.arm, block_size=BLOCK, num_gpu_blocks=self.stats.capacity // BLOCK,
                           enable_prefix_caching=bool(kwargs.get("enable_prefix_caching")))
        self.llm_engine = _Namespace(
            vllm_config=_Namespace(cache_config=cache,
                                   model_config=_Namespace(max_model_len=kwargs.get("max_model_len") or 8192),
                                   scheduler_config=_Namespace(max_num_seqs=kwargs.get("max_num_seqs"),
                                                               max_num_batched_tokens=8192)),
            model_config=_Namespace(get_vocab_size=lambda: 32000))
        self.call("init", {key: kwargs[key] for key in ("kv_cache_dtype", "attention_backend", "load_format",
                                                         "skip_tokenizer_init", "enable_prefix_caching")})
        print_kv_lines(self.stats.capacity)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        return cls(**vars(engine_args))

    def call(self, name: str, detail=None) -> None:
        calls = os.environ.get("STANDIN_CALLS")
        if calls:
            with open(calls, "a") as handle:
                handle.write(json.dumps({"arm": self.arm, "call": name, "detail": detail}) + "\n")

    def cached_tokens(self, tokens: list[int]) -> int:
        """Longest block-aligned prefix seen before, as vLLM's prefix cache would find it."""
        cached = 0
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            key = tuple(tokens[:end])
            if key in self.seen_blocks:
                cached = end
            self.seen_blocks.add(key)
        return cached if self.llm_engine.vllm_config.cache_config.enable_prefix_caching else 0

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.call("generate", len(prompts))
        if failing("worker", self.arm) and self.profiling:
            raise RuntimeError("stand-in: CUDA error: an illegal memory access was encountered")
        outputs = []
        for prompt in prompts:
            tokens = prompt["prompt_token_ids"]
            cached = self.cached_tokens(tokens)
            self.stats.request(len(tokens), sampling_params.max_tokens, len(prompts), cached)
            outputs.append(_Namespace(prompt_token_ids=tokens, num_cached_tokens=cached,
                                      outputs=[_Namespace(token_ids=[7] * sampling_params.max_tokens)]))
        return outputs

    def start_profile(self):
        self.call("start_profile")
        self.profiling = True

    def stop_profile(self):
        self.call("stop_profile")
        self.profiling = False

    def reset_prefix_cache(self):
        self.call("reset_prefix_cache")
        self.seen_blocks.clear()
        return True

    def get_metrics(self):
        labels = {"model_name": self.kwargs["model"], "engine": "0"}
        metrics = [Counter(f"vllm:{name}", labels, value) for name, value in self.stats.counters.items()]
        metrics += [Gauge(f"vllm:{name}", labels, value) for name, value in self.stats.gauges.items()]
        metrics.append(Histogram("vllm:time_to_first_token_seconds", labels, *self.stats.ttft))
        return metrics


FAKE_FLASHINFER = {
    "flashinfer/__init__.py": "",
    "flashinfer/page.py": ("def _is_stream_capturing_on_device(device):\n    return False\n\n\n"
                           "def _as_float32_scalar_tensors(values, *, device):\n    return tuple(v for _, v in values)\n"),
}


FAKE_VLLM = {
    "vllm/__init__.py": "from vllm_standin import LLM, SamplingParams\n__version__ = '0.0.0+standin'\n",
    "vllm/inputs.py": "TokensPrompt = dict\n",
    "vllm/engine/__init__.py": "",
    "vllm/engine/arg_utils.py": "from vllm_standin import EngineArgs\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/argparse_utils.py": "from argparse import ArgumentParser as FlexibleArgumentParser\n",
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/cli/__init__.py": "",
    "vllm/entrypoints/cli/main.py": "import vllm_standin\n\nif __name__ == '__main__':\n    vllm_standin.cli_main()\n",
}


# What the offline worker asks of torch (its version, and NVTX, which a CPU-only torch lacks). Importing the real
# torch costs each worker run about 1.6 s of CPU; the tests that need the real one remove this.
FAKE_TORCH = {
    "torch/__init__.py": "from torch import cuda, version\n__version__ = '0.0.0+standin'\n",
    "torch/version.py": "cuda = None\n",
    "torch/cuda/__init__.py": "from torch.cuda import nvtx\n",
    "torch/cuda/nvtx.py": ("def range_push(name):\n    raise RuntimeError('stand-in torch: built without CUDA')\n\n\n"
                           "def range_pop():\n    raise RuntimeError('stand-in torch: built without CUDA')\n"),
}


def write_fake_vllm(site: Path) -> None:
    for relative, text in {**FAKE_VLLM, **FAKE_TORCH, **FAKE_FLASHINFER}.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# Nsight Systems ----------------------------------------------------------------------------------------

def nsys(argv: list[str]) -> int:
    import sqlite3
    import subprocess

    if argv == ["--version"]:
        print("NVIDIA Nsight Systems version 2099.1.0 (kvtrace stand-in)")
        return 0
    rest = argv[1:]
    count = next((i for i, arg in enumerate(rest) if not arg.startswith("-")), len(rest))
    options, workload = rest[:count], rest[count:]
    output = next(arg.split("=", 1)[1] for arg in options if arg.startswith("--output="))
    # The run (ARM, or ARM.rK with repeats; a failure may name either): an export names it by its report.
    run = Path(workload[0]).name.removesuffix(".nsys-rep") if argv[0] == "export" else Path(output).name
    arm = run.split(".")[0]
    if argv[0] == "export":
        if failing("export", arm) or failing("export", run):
            print("stand-in nsys: export failed", file=sys.stderr)
            return 1
        with sqlite3.connect(output) as db:
            db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
            db.execute("INSERT INTO StringIds VALUES (1, 'stand-in')")
            # STANDIN_DEVICES: the devices (one process each) whose kernels the export holds, e.g. "0,1".
            devices = [int(d) for d in os.environ.get("STANDIN_DEVICES", "").split(",") if d]
            if devices:
                db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, \"end\" INTEGER, "
                           "deviceId INTEGER, globalPid INTEGER, shortName INTEGER)")
                db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?, 1)",
                               [(10 * i, 10 * i + 5, device, (100 + device) << 24)
                                for device in devices for i in range(3)])
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # nsys outlives its target to write the report
    env = dict(os.environ)
    if "--capture-range-end=repeat" in options:
        env["STANDIN_NSYS_REPEAT"] = output
    child = subprocess.Popen(workload, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    returncode = child.wait()
    if "--capture-range-end=repeat" not in options and not (failing("no-report", arm) or failing("no-report", run)):
        Path(output + ".nsys-rep").write_text("stand-in report\n")
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    if sys.argv[1] != "nsys":
        sys.exit("usage: vllm_standin.py nsys ...")
    sys.exit(nsys(sys.argv[2:]))
