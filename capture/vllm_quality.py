"""The model's answers per arm: after a serve-mode arm's measured traffic (outside the trace), a fixed set of prompts
from a JSONL file is sent to the arm's server one at a time, greedily (temperature 0), with each generated token's
logprob. Per prompt it records the completion, its tokens and logprobs, and whether it matches the reference answer;
the analyzer pairs the arms prompt by prompt (analyzer/quality.py).

The prompt file: one JSON object per line with "prompt" and "answer" (GSM8K's test split as it is: its answers end
in "#### NUMBER"), and optionally "id". A numeric expected answer (after "####" if present) matches the last
number of the completion that stands alone (not the digits inside a word such as "w2096" or "H2O", which dummy
weights' completions are full of); any other matches when the completion, stripped, starts with it.

Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from kvtrace import files
from kvtrace.capture.vllm_http import NET_ERRORS, http_request
from kvtrace.errors import KvtraceError

MAX_PROMPTS = 100_000
_NUMBER = re.compile(r"(?<!\w)-?\d[\d,]*(?:\.\d+)?")  # no letter, digit or _ just before: not inside a word


def load_prompts(path: str | Path) -> tuple[list[dict], str]:
    """The prompt file's entries, checked (one clear error naming the line that is wrong), and the SHA-256 of the
    bytes they were read from."""
    path = Path(path)
    # A regular file of at most files.SMALL_INPUT_BYTES: a FIFO would wait for a writer, /dev/zero never ends.
    data = files.read_small(path, f"--quality-prompts {path}", "give a JSON Lines file of prompts")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise KvtraceError(f"--quality-prompts {path}: cannot read it as UTF-8 text ({error})") from None
    prompts = []
    # Lines end at \n only, as JSON Lines says: U+2028 or U+0085 inside a string is text, not a line break.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            raise KvtraceError(f"--quality-prompts {path}: line {number} is not JSON; write one object per line with "
                               '"prompt" and "answer"') from None
        if not (isinstance(entry, dict) and isinstance(entry.get("prompt"), str)
                and isinstance(entry.get("answer"), str)):
            raise KvtraceError(f'--quality-prompts {path}: line {number} needs string fields "prompt" and "answer"')
        prompts.append({"id": str(entry.get("id", len(prompts) + 1)), "prompt": entry["prompt"],
                        "answer": entry["answer"]})
    if not prompts:
        raise KvtraceError(f"--quality-prompts {path} holds no prompts")
    if len(prompts) > MAX_PROMPTS:
        raise KvtraceError(f"--quality-prompts {path} holds {len(prompts)} prompts; at most {MAX_PROMPTS}")
    return prompts, hashlib.sha256(data).hexdigest()


def check(cfg) -> None:
    """A VllmCapture's quality options, before anything starts."""
    if cfg.mode != "serve":
        raise KvtraceError("--quality-prompts needs --mode serve: the prompts go to each arm's server")
    if cfg.quality_max_tokens < 1:
        raise KvtraceError(f"--quality-max-tokens must be at least 1, got {cfg.quality_max_tokens}")
    load_prompts(cfg.quality_prompts)


def expected(answer: str) -> str:
    """The part of a reference answer a completion must match: what follows GSM8K's "####", else the whole."""
    return answer.rsplit("####", 1)[-1].strip()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def matches(completion: str, answer: str) -> bool:
    want = expected(answer)
    value = _number(want)
    if value is not None:
        found = _NUMBER.findall(completion)
        return bool(found) and _number(found[-1]) == value
    return bool(want) and completion.strip().startswith(want)


def _served_model(base: str) -> str:
    status, body = http_request("GET", base + "/v1/models", timeout=60)
    try:
        return json.loads(body)["data"][0]["id"] if status == 200 else ""
    except (ValueError, LookupError, TypeError):
        return ""


def run(base: str, prompts_file: str | Path, max_tokens: int, out: Path, run_name: str) -> dict:
    """Every prompt once, in file order, to the server at `base`; writes RUN.quality.json and returns the arm's
    summary for its manifest entry, or {"error": why} (the arm's trace is kept either way)."""
    try:
        return _run(base, Path(prompts_file), max_tokens, out, run_name)
    except (*NET_ERRORS, RuntimeError) as failure:
        return {"error": f"quality prompts not answered: {failure}"}


def _run(base: str, prompts_file: Path, max_tokens: int, out: Path, run_name: str) -> dict:
    prompts, prompts_sha256 = load_prompts(prompts_file)
    model = _served_model(base)
    if not model:
        raise RuntimeError("GET /v1/models named no served model for the quality prompts")
    results = []
    for index, item in enumerate(prompts):
        request = {"model": model, "prompt": item["prompt"], "max_tokens": max_tokens, "temperature": 0,
                   "logprobs": 1, "seed": 0}
        status, body = http_request("POST", base + "/v1/completions", timeout=600, payload=request)
        if status != 200:
            raise RuntimeError(f"quality prompt {item['id']}: POST /v1/completions answered {status} "
                               f"{body.strip()[:200]!r}")
        try:
            choice = json.loads(body)["choices"][0]
            logprobs = choice.get("logprobs") or {}
            completion, tokens = choice["text"], logprobs.get("tokens") or []
        except (ValueError, LookupError, TypeError, AttributeError):
            raise RuntimeError(f"quality prompt {item['id']}: the completion has no choices[0].text") from None
        results.append({"index": index, "id": item["id"], "answer": item["answer"], "completion": completion,
                        "correct": matches(completion, item["answer"]), "finish_reason": choice.get("finish_reason"),
                        "tokens": tokens, "token_logprobs": logprobs.get("token_logprobs") or []})
    name = f"{run_name}.quality.json"
    summary = {"file": name, "prompts_file": prompts_file.name,
               "prompts_sha256": prompts_sha256, "prompts": len(results),
               "correct": sum(r["correct"] for r in results), "max_tokens": max_tokens, "temperature": 0,
               "model": model}
    files.write(out / name, json.dumps({**summary, "results": results}, indent=1) + "\n")
    return summary
