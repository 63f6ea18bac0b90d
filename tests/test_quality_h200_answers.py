"""The vLLM quality step's real answers: the H200 run of fixtures/vllm033-h200-8b capacity-preemption (--repeats 2:
fp8.r1 nvfp4.r1 fp8.r2 nvfp4.r2), each arm answering fixtures/quality/arithmetic-8.jsonl greedily, 32 tokens with
logprobs, on llama-8b-shape with --load-format dummy. The H100 capacity matrix ran no quality step (its sweep stands
beside it as a scenario without answers).

The answers are noise (random weights), the plumbing and the statistics are not: every number the analyzer gives
on these files is checked here against a computation written straight from the files. The statistics need weights
to be shown, so they are checked on copies whose manifests claim real weights, named "synthetic" (fixtures/README.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from conftest import FIXTURES, MATRIX_RUNS, VLLM033_8B_RUNS
from kvtrace.analyzer import matrix, quality
from kvtrace.analyzer.classify import load_recipes
from kvtrace.analyzer.render import quality as quality_render
from kvtrace.analyzer.render import render_table, render_text
from kvtrace.analyzer.render.matrix import markdown as matrix_markdown
from kvtrace.analyzer.runs import ArmInput
from kvtrace.analyzer.stats import mcnemar
from kvtrace.capture import vllm_quality
from kvtrace.errors import KvtraceError
from kvtrace.manifest import read_manifest

PREEMPTION = VLLM033_8B_RUNS["capacity-preemption"]
SWEEP = MATRIX_RUNS["sweep"]
PROMPTS = FIXTURES / "quality" / "arithmetic-8.jsonl"
ANSWERED = [(PREEMPTION, run) for run in ("fp8.r1", "nvfp4.r1", "fp8.r2", "nvfp4.r2")]


def recorded(run_dir: Path, run: str) -> dict:
    return json.loads((run_dir / f"{run}.quality.json").read_text())


def reference_divergence(first: list[str], second: list[str]) -> int | None:
    """Written here from the definition: the first index where the tokens differ, or where the shorter ends."""
    for index in range(max(len(first), len(second))):
        if index >= len(first) or index >= len(second) or first[index] != second[index]:
            return index
    return None


def reference_p(b: int, c: int) -> float:
    if b + c == 0:
        return 1.0
    scipy_stats = pytest.importorskip("scipy.stats")
    return scipy_stats.binomtest(b, b + c, 0.5).pvalue


def synthetic(run_dir: Path, target: Path, load_format: str = "auto") -> Path:
    """A copy of a real run's manifests and answers (no traces: the quality analysis reads none), its settings'
    load format changed so that the answers are analysed as a measurement."""
    target.mkdir()
    for path in run_dir.iterdir():
        if path.name.endswith((".manifest.json", ".quality.json")) or path.name == "manifest.json":
            shutil.copy(path, target / path.name)
    edit_json(target / "manifest.json", lambda d: d["settings"].update(load_format=load_format))
    return target


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def analyse(run_dir: Path, baseline: str, candidate: str) -> quality.Quality:
    manifest = read_manifest(run_dir)
    return quality.build(ArmInput.of(run_dir, manifest, baseline), ArmInput.of(run_dir, manifest, candidate),
                         (baseline, candidate))


# ---- the files as the H200 wrote them -------------------------------------------------------------------

@pytest.mark.parametrize("run_dir,run", ANSWERED, ids=[f"preemption-{r}" for _, r in ANSWERED])
def test_the_recorded_answers_are_consistent(run_dir, run):
    data = recorded(run_dir, run)
    summary = json.loads((run_dir / "manifest.json").read_text())["arms"][run]["quality"]
    # The manifest's summary is the file's head, and names the shipped prompt file by its bytes.
    assert {k: v for k, v in data.items() if k != "results"} == summary
    assert summary["prompts_sha256"] == hashlib.sha256(PROMPTS.read_bytes()).hexdigest()
    assert json.loads((run_dir / "manifest.json").read_text())["settings"]["load_format"] == "dummy"
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    results = data["results"]
    assert [(r["index"], r["id"], r["answer"]) for r in results] == [
        (i, p["id"], p["answer"]) for i, p in enumerate(prompts)]
    assert summary["prompts"] == len(results) == 8 and summary["correct"] == sum(r["correct"] for r in results) == 0
    for result in results:
        # Every answer ran to the limit: as many tokens as logprobs as --quality-max-tokens, none empty.
        assert result["finish_reason"] == "length"
        assert len(result["tokens"]) == len(result["token_logprobs"]) == summary["max_tokens"] == 32
        assert all(math.isfinite(v) and v < 0 for v in result["token_logprobs"])
        # The dummy model's word-level vocabulary: tokens carry no space, so the analyzer compares tokens, not text.
        assert result["completion"] == " ".join(result["tokens"]) != "".join(result["tokens"])
        # Its words hold digits (w2096) but no number stands alone: wrong, and not by luck of a word's digits.
        assert re.search(r"\d", result["completion"]) and not re.search(r"(?:^|\s)-?\d", result["completion"])
        assert result["correct"] is False is vllm_quality.matches(result["completion"], result["answer"])


def test_a_word_s_digits_are_no_answer():
    completion = recorded(PREEMPTION, "fp8.r1")["results"][0]["completion"]
    word = completion.split()[-1]
    assert re.fullmatch(r"w\d+", word)
    # Judged against the digits of its own words, the real answer is still wrong (it was right before the matcher
    # asked for a number that stands alone).
    assert not vllm_quality.matches(completion, f"#### {word[1:]}")
    assert vllm_quality.matches(completion + f" so {word[1:]}", f"#### {word[1:]}")


# ---- report and matrix on the real runs: not a measurement, but the step ran ----------------------------

def dummy_line(run_dir: Path, runs: tuple[str, str]) -> str:
    answers = [recorded(run_dir, run)["results"] for run in runs]
    counts = [(sum(bool(r["tokens"]) for r in a), len(a)) for a in answers]
    cut = sum(r["finish_reason"] == "length" for a in answers for r in a)
    return (f"Quality not a measurement: the model ran with --load-format dummy (random weights) in {run_dir.name}: "
            f"its answers say nothing about quality (the quality step itself ran: {runs[0]} answered {counts[0][0]} of "
            f"{counts[0][1]} prompts of {PROMPTS.name}, {runs[1]} {counts[1][0]} of {counts[1][1]}; {cut} of "
            f"{sum(len(a) for a in answers)} answers stopped at the 32-token limit).")


def test_report_says_not_a_measurement_and_shows_the_step_ran(preemption_report):
    result = preemption_report
    q = result.quality
    assert q.state == quality.MEANINGLESS and q.accuracy is None and q.agreement is None and not q.prompts
    assert [(a.run, a.prompts, a.empty, a.cut) for a in q.answered] == [("fp8.r1", 8, 0, 8), ("nvfp4.r1", 8, 0, 8)]
    assert sorted(p.name for p in q.read) == ["fp8.r1.quality.json", "fp8.r2.quality.json", "nvfp4.r1.quality.json",
                                              "nvfp4.r2.quality.json"]
    markdown = render_text(result, "markdown")
    head = markdown.split("<details>", 1)[0]
    line = dummy_line(PREEMPTION, ("fp8.r1", "nvfp4.r1"))
    assert line in head.splitlines()
    assert not re.search(r"accuracy|McNemar|%|identical|alike", line)  # no number that reads as quality
    details = markdown.split("### Quality", 1)[1].split("###", 1)[0]
    assert "- fp8.r2 answered 8 of 8 prompts token for token as its arm's first run, nvfp4.r2 8 of 8\n" in details
    assert "paired table" not in details
    data = json.loads(render_text(result, "json"))["quality"]
    assert data["accuracy"] is None and [a["prompts"] for a in data["answered"]] == [8, 8]
    assert data["repeats"] == [{"baseline_run": "fp8.r2", "candidate_run": "nvfp4.r2", "baseline_alike": 8,
                                "candidate_alike": 8, "prompts": 8, "baseline_only": 0, "candidate_only": 0}]
    console = Console(file=io.StringIO(), width=100, color_system=None)
    render_table(result, console)
    assert line in " ".join(console.file.getvalue().split())


def test_matrix_says_not_a_measurement_for_each_scenario():
    """Each scenario its own line: the preemption run's answers are no measurement (dummy weights), the matrix's sweep
    recorded none."""
    result = matrix.build([PREEMPTION, SWEEP], load_recipes(()))
    text = matrix_markdown(result)
    line = dummy_line(PREEMPTION, ("fp8.r1", "nvfp4.r1"))
    assert any(row.endswith(line) for row in text.splitlines()), line
    sweep = json.loads((SWEEP / "manifest.json").read_text())
    assert not list(SWEEP.glob("*.quality.json")) and all(a["quality"] is None for a in sweep["arms"].values())
    assert any(row.startswith("- sweep (serve): Quality not measured: fp8 and nvfp4 ran without --quality-prompts")
               for row in text.splitlines())
    assert "No run here measured the model's answers, so nvfp4's accuracy is not established" in text


# ---- the statistics on the real answers, as if the weights were real ------------------------------------

@pytest.fixture
def preemption(tmp_path) -> Path:
    return synthetic(PREEMPTION, tmp_path / "synthetic-preemption")


def check_against_files(q: quality.Quality, run_dir: Path, runs: tuple[str, str]) -> None:
    """Every number of an answers-level Quality against a computation from the two runs' files."""
    base, cand = (recorded(run_dir, run)["results"] for run in runs)
    right = [[r["correct"] for r in side] for side in (base, cand)]
    table = {"both": sum(b and c for b, c in zip(*right)), "baseline": sum(b and not c for b, c in zip(*right)),
             "candidate": sum(c and not b for b, c in zip(*right)),
             "neither": sum(not b and not c for b, c in zip(*right))}
    acc = q.accuracy
    assert acc.prompts == len(base) == sum(table.values())
    assert acc.baseline_accuracy == sum(right[0]) / len(base) and acc.candidate_accuracy == sum(right[1]) / len(base)
    assert (acc.baseline_correct - acc.baseline_only, acc.baseline_only, acc.candidate_only,
            acc.prompts - acc.baseline_correct - acc.candidate_only) == (
        table["both"], table["baseline"], table["candidate"], table["neither"])
    assert acc.p_value == pytest.approx(reference_p(table["baseline"], table["candidate"]), rel=1e-12)
    assert acc.verdict == (mcnemar.AccuracyVerdict.DIFFERS if acc.p_value < 0.05 else mcnemar.AccuracyVerdict.SAME)
    splits = [reference_divergence(b["tokens"], c["tokens"]) for b, c in zip(base, cand)]
    assert [(row.id, row.first_divergence, row.baseline_tokens, row.candidate_tokens) for row in q.prompts] == [
        (b["id"], split, len(b["tokens"]), len(c["tokens"])) for b, c, split in zip(base, cand, splits)]
    alike = sum(len(b["tokens"]) if split is None else split for b, split in zip(base, splits))
    total = sum(len(b["tokens"]) for b in base)
    assert q.agreement.token_agreement == (alike / total if total else None)
    assert (q.agreement.identical, q.agreement.prompts) == (splits.count(None), len(base))


def test_fp8_against_nvfp4_as_recorded(preemption):
    q = analyse(preemption, "fp8", "nvfp4")
    assert q.state == quality.MEASURED and q.level == quality.ANSWERS
    check_against_files(q, preemption, ("fp8.r1", "nvfp4.r1"))
    # What the files say: both arms wrong on every prompt (p = 1), their first tokens already differ everywhere.
    assert (q.accuracy.baseline_correct, q.accuracy.candidate_correct, q.accuracy.p_value) == (0, 0, 1.0)
    assert {row.first_divergence for row in q.prompts} == {0} and q.agreement.token_agreement == 0.0
    line = quality_render.line(q, "fp8", "nvfp4")
    assert line.startswith("Quality (8 prompts of arithmetic-8.jsonl, greedy): accuracy fp8 0.0% → nvfp4 0.0%, no "
                           "significant accuracy difference (McNemar exact p = 1: 0 prompts only fp8 got right, 0 only "
                           "nvfp4); outputs identical on 0 of 8 prompts, 0.0% of fp8's tokens alike")
    assert [n for n in q.notes if "32-token limit" in n] == [
        f"{run}: 8 of 8 answers stopped at the 32-token limit (finish_reason length): a cut answer can miss its "
        "number (raise --quality-max-tokens)" for run in ("fp8.r1", "nvfp4.r1")]


def test_the_same_arm_twice_is_identical(preemption):
    """fp8.r1 against fp8.r2: greedy decoding on the same numerics gave the same tokens on every prompt."""
    q = analyse(preemption, "fp8.r1", "fp8.r2")
    check_against_files(q, preemption, ("fp8.r1", "fp8.r2"))
    assert q.agreement.identical == 8 and q.agreement.token_agreement == 1.0
    assert all(row.first_divergence is None for row in q.prompts)


def test_real_tokens_with_constructed_correctness_and_divergence(preemption):
    """The real token lists, the correctness judged against other references and nvfp4's tokens made to follow
    fp8's for the first 4·i tokens of prompt i: the table, McNemar and the divergence away from their trivial
    values, still against the independent computation."""
    fp8_word = recorded(preemption, "fp8.r1")["results"][0]["tokens"][0]
    nvfp4_word = recorded(preemption, "nvfp4.r1")["results"][0]["tokens"][0]
    references = [fp8_word] * 6 + [nvfp4_word, f"{fp8_word} {nvfp4_word}"]  # 6 only fp8, 1 only nvfp4, 1 neither

    def judge(run, follow=None):
        def change(data):
            for index, (result, want) in enumerate(zip(data["results"], references)):
                result["answer"] = want
                result["correct"] = vllm_quality.matches(result["completion"], want)  # the answer as recorded
                if follow is not None:
                    result["tokens"][:4 * index] = follow[index]["tokens"][:4 * index]
        edit_json(preemption / f"{run}.quality.json", change)

    judge("fp8.r1")
    judge("nvfp4.r1", follow=recorded(preemption, "fp8.r1")["results"])
    q = analyse(preemption, "fp8", "nvfp4")
    check_against_files(q, preemption, ("fp8.r1", "nvfp4.r1"))
    acc = q.accuracy
    assert (acc.baseline_only, acc.candidate_only, acc.prompts - acc.baseline_correct - acc.candidate_only) == (6, 1, 1)
    assert acc.p_value == pytest.approx(2 * (1 + 7) / 2 ** 7) and acc.verdict == mcnemar.AccuracyVerdict.SAME
    assert [row.first_divergence for row in q.prompts] == [0, 4, 8, 12, 16, 20, 24, 28]
    assert q.agreement.token_agreement == sum(range(0, 32, 4)) / (8 * 32)


# ---- repeats: run k with run k, the test on the first -----------------------------------------------------

def test_repeats_pair_run_k_with_run_k(preemption):
    def flip(data):
        data["results"][0]["correct"] = True

    def reword(data):
        data["results"][3]["tokens"][5] = "w1"
    edit_json(preemption / "fp8.r2.quality.json", flip)
    edit_json(preemption / "nvfp4.r2.quality.json", reword)
    q = analyse(preemption, "fp8", "nvfp4")
    # The test is the first repeat's, untouched by what changed in the second.
    assert [a.run for a in q.answered] == ["fp8.r1", "nvfp4.r1"] and q.accuracy.baseline_correct == 0
    check_against_files(q, preemption, ("fp8.r1", "nvfp4.r1"))
    r1 = {run: recorded(preemption, run)["results"] for run in ("fp8.r1", "nvfp4.r1", "fp8.r2", "nvfp4.r2")}
    alike = [sum(a["tokens"] == b["tokens"] for a, b in zip(r1[f"{arm}.r2"], r1[f"{arm}.r1"])) for arm in ("fp8",
                                                                                                            "nvfp4")]
    assert alike == [8, 7]
    assert q.repeats == [quality.Repeat("fp8.r2", "nvfp4.r2", 8, 7, 8, 1, 0)]
    assert ("fp8.r2 answered 8 of 8 prompts token for token as its arm's first run, nvfp4.r2 7 of 8; their paired "
            "table: 1 prompts only fp8.r2 got right, 0 only nvfp4.r2 (the test above is the first repeat's)"
            in quality_render.repeats(q))
    # One run of each arm picked by name: that pair alone, no repeat.
    alone = analyse(preemption, "fp8.r2", "nvfp4.r2")
    assert [a.run for a in alone.answered] == ["fp8.r2", "nvfp4.r2"] and not alone.repeats
    assert alone.accuracy.baseline_only == 1


def test_a_repeat_without_answers_is_named_not_compared(preemption):
    edit_json(preemption / "manifest.json", lambda d: d["arms"]["nvfp4.r2"].update(quality=None))
    q = analyse(preemption, "fp8", "nvfp4")
    assert q.state == quality.MEASURED and not q.repeats
    assert "fp8.r2 and nvfp4.r2 recorded no answers to the same prompts: repeat not compared" in q.notes


# ---- answers that do not pair, or are not the run's own ---------------------------------------------------

def test_a_quality_file_from_another_prompt_set_is_refused(tmp_path, run_kvtrace):
    """A copied run whose nvfp4.r1 answers are another prompt file's: the report stops on one line, dummy weights
    or not, since the answers no longer prove that this run's step ran."""
    run = tmp_path / "copied"
    shutil.copytree(PREEMPTION, run)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(line + "\n" for line in reversed(PROMPTS.read_text().splitlines())))

    def replace(data):
        data["prompts_sha256"] = hashlib.sha256(other.read_bytes()).hexdigest()
        data["prompts_file"] = other.name
        data["results"].reverse()
    target = run / "nvfp4.r1.quality.json"
    target.chmod(0o644)
    edit_json(target, replace)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and not p.name.endswith(".sqlite")}
    code, out, err = run_kvtrace("report", str(run), "--format", "json")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "nvfp4's answers nvfp4.r1.quality.json are not the ones its manifest records" in err
    assert before == {p.name: p.read_bytes() for p in run.iterdir() if p.name in before}


def test_answers_to_other_prompts_are_not_comparable(preemption):
    # The same prompt file by its hash, but the answers in another order (an edited file): not paired.
    edit_json(preemption / "nvfp4.r1.quality.json", lambda d: d["results"].reverse())
    q = analyse(preemption, "fp8", "nvfp4")
    assert q.state == quality.NOT_MEASURED and q.accuracy is None
    assert q.reason == "fp8 and nvfp4 answered different prompts (prompt 1 is 'add-1' and 'add-8'): not comparable"
    assert quality_render.line(q, "fp8", "nvfp4") == f"Quality not measured: {q.reason}."


def test_arms_of_different_prompt_files_are_not_comparable(preemption):
    for name in ("manifest.json", "nvfp4.r1.quality.json"):
        edit_json(preemption / name, lambda d: (d["arms"]["nvfp4.r1"]["quality"] if "arms" in d else d).update(
            prompts_sha256="0" * 64))
    q = analyse(preemption, "fp8", "nvfp4")
    assert q.state == quality.NOT_MEASURED
    assert q.reason == "the arms answered different prompt files (their SHA-256 differ): not comparable"


@pytest.mark.parametrize("change,says", [
    (lambda d: d["results"][2]["token_logprobs"].pop(), "result 2 has 32 tokens but 31 logprobs"),
    (lambda d: d["results"].pop(), "are not the ones its manifest records"),
])
def test_damaged_answers_are_one_clear_error(preemption, change, says):
    edit_json(preemption / "nvfp4.r1.quality.json", change)
    with pytest.raises(KvtraceError, match=says):
        analyse(preemption, "fp8", "nvfp4")


def test_empty_answers_are_counted_not_hidden(tmp_path):
    run = synthetic(PREEMPTION, tmp_path / "synthetic-empty", load_format="dummy")

    def empty(data):
        data["results"][1].update(completion="", tokens=[], token_logprobs=[], finish_reason="stop")
    edit_json(run / "nvfp4.r1.quality.json", empty)
    q = analyse(run, "fp8", "nvfp4")
    assert [(a.run, a.prompts - a.empty, a.cut) for a in q.answered] == [("fp8.r1", 8, 8), ("nvfp4.r1", 7, 7)]
    assert "nvfp4.r1: 1 of 8 answers are empty" in q.notes
    assert "fp8.r1 answered 8 of 8 prompts of arithmetic-8.jsonl, nvfp4.r1 7 of 8; 15 of 16 answers stopped" in \
        quality_render.line(q, "fp8", "nvfp4")
    edit_json(run / "manifest.json", lambda d: d["settings"].update(load_format="auto"))
    check_against_files(analyse(run, "fp8", "nvfp4"), run, ("fp8.r1", "nvfp4.r1"))


def test_hostile_prompt_ids_stay_text(preemption):
    ids = ["a|b", "`x`", "\x1b[31mred", "<details>", "é\u202eolleh", "line\nbreak", "**bold**", "[l](http://x)"]

    def rename(data):
        for result, name in zip(data["results"], ids):
            result["id"] = name
    for run in ("fp8.r1", "nvfp4.r1"):
        edit_json(preemption / f"{run}.quality.json", rename)
    q = analyse(preemption, "fp8", "nvfp4")
    lines = quality_render.markdown(q, "fp8", "nvfp4")
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + len(ids)
    # Every row keeps its 6 cells: no id's pipe or newline broke the table, and no escape reaches the page.
    assert {len(re.findall(r"(?<!\\)\|", line)) for line in table} == {7}
    text = "\n".join(lines)
    assert "\x1b" not in text and "\u202e" not in text and "<details>" not in text
    console = Console(file=io.StringIO(), width=200, color_system=None)
    quality_render.terminal(q, "fp8", "nvfp4", console)
    assert "\x1b" not in console.file.getvalue()
