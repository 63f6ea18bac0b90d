"""The vLLM capture's quality step through the stand-in server (tests/vllm_standin.py): the shipped prompt file
(fixtures/quality/arithmetic-8.jsonl) sent greedily to each arm after its measured traffic, each answer recorded
with its tokens and logprobs and judged against the reference answer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvtrace.capture import vllm_quality
from kvtrace.errors import KvtraceError
from test_capture_vllm import alive, config, run_capture, serve_config
from test_capture_vllm import plain_serve, standin  # noqa: F401  (fixtures)

PROMPTS = Path(__file__).resolve().parents[1] / "fixtures" / "quality" / "arithmetic-8.jsonl"


def with_quality(cfg, prompts=PROMPTS, max_tokens=256):
    return dataclasses.replace(cfg, quality_prompts=str(prompts), quality_max_tokens=max_tokens)


def sums() -> list[int]:
    return [int(vllm_quality.expected(json.loads(line)["answer"])) for line in PROMPTS.read_text().splitlines()]


def test_each_arm_answers_the_prompts_after_its_traffic(standin):
    cfg = with_quality(serve_config(standin), max_tokens=5)
    manifest = run_capture(standin, cfg)
    run = standin.tmp / "run"
    assert manifest["status"] == "ok"
    # The stand-in's nvfp4 server adds one to odd sums: those answers are wrong.
    wrong = {"fp8": set(), "nvfp4": {i for i, total in enumerate(sums()) if total % 2}}
    assert wrong["nvfp4"] == {1, 2, 7}
    for arm in ("fp8", "nvfp4"):
        summary = manifest["arms"][arm]["quality"]
        assert summary["prompts"] == 8 and summary["correct"] == 8 - len(wrong[arm])
        assert (summary["prompts_file"], summary["max_tokens"], summary["temperature"]) == (PROMPTS.name, 5, 0)
        assert summary["model"] == str(standin.model) and len(summary["prompts_sha256"]) == 64
        recorded = json.loads((run / summary["file"]).read_text())
        assert [r["id"] for r in recorded["results"]] == [f"add-{i}" for i in range(1, 9)]
        for index, result in enumerate(recorded["results"]):
            assert result["correct"] == (index not in wrong[arm])
            assert result["tokens"][1:] == [" is", " the", " sum", "."] and result["token_logprobs"] == [-0.25] * 5
            assert result["completion"] == "".join(result["tokens"])
        # Its own file, named by the run, listed nowhere in the trace's commands (it runs after /stop_profile).
        assert summary["file"] == f"{arm}.quality.json"
    assert not [pid for pid in standin.pids() if alive(pid)]


def test_a_failed_quality_step_keeps_the_arms_trace(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_FAIL", "quality@nvfp4")
    manifest = run_capture(standin, with_quality(serve_config(standin)))
    arm = manifest["arms"]["nvfp4"]
    assert arm["status"] == "ok" and arm["sqlite"] == "nvfp4.sqlite"
    assert arm["quality"]["error"].startswith("quality prompts not answered: quality prompt add-1: POST "
                                              "/v1/completions answered 500")
    assert manifest["arms"]["fp8"]["quality"]["correct"] == 8


def test_without_prompts_there_is_no_quality_step(plain_serve):
    manifest = plain_serve.manifest
    assert manifest["arms"]["fp8"]["quality"] is None and not list((plain_serve.tmp / "run").glob("*.quality.json"))


@pytest.mark.parametrize("completion,answer,correct", [
    (" 42 is the sum.", "12 + 30 = 42\n#### 42", True),
    ("The answer is 1,002.", "#### 1002", True),
    ("It is 41, or maybe 42", "#### 42", True),  # the last number counts
    ("42, no: 41", "#### 42", False),
    ("no number here", "#### 42", False),
    (" Paris, the capital.", "Paris", True),
    ("The capital is Paris", "Paris", False),
    ("-3.5 degrees", "#### -3.5", True),
    ("w42 w42", "#### 42", False),  # a word's digits are no number (the H200's dummy-weight answers are such words)
    ("42 then w7", "#### 42", True),
    ("H2O is 18 g/mol", "#### 18", True),
    ("...42", "#### 42", True),
])
def test_answer_matching(completion, answer, correct):
    assert vllm_quality.matches(completion, answer) is correct


@pytest.mark.parametrize("text,says", [
    ("", "holds no prompts"),
    ('{"prompt": "x", "answer": "1"}\nnot json\n', "line 2 is not JSON"),
    ('{"prompt": "x"}\n', 'line 1 needs string fields "prompt" and "answer"'),
    ('[1, 2]\n', 'line 1 needs string fields'),
])
def test_bad_prompt_files_are_one_clear_error(tmp_path, text, says):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(KvtraceError, match=says):
        vllm_quality.load_prompts(path)


def test_quality_options_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(KvtraceError, match="needs --mode serve"):
        with_quality(config(mode="offline")).validate()
    with pytest.raises(KvtraceError, match="cannot be read"):
        with_quality(config(), tmp_path / "missing.jsonl").validate()
    with pytest.raises(KvtraceError, match="at least 1"):
        with_quality(config(), max_tokens=0).validate()
