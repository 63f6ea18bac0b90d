"""The words of an upstream draft (analyzer/upstream.py): the sections each project's issue template asks for, in its
order, the answer first and the repro script inside <details>; under a GitHub issue body's limit."""

from __future__ import annotations

from kvtrace.analyzer.render.escape import code_fence, md_code, md_prose, md_text
from kvtrace.analyzer.render.markdown import ISSUE_LIMIT
from kvtrace.analyzer.render.units import interval, markdown_table, ratio
from kvtrace.analyzer.stats.verdicts import Verdict
from kvtrace.analyzer.upstream import HISTORY, NOT_MEASURED, HostSyncFinding, Ttft
from kvtrace.errors import KvtraceError

TITLES = {
    "flashinfer": "[Performance] NVFP4 slot-mapping KV append copies its CUDA scale tensors to the host on every "
                  "call: one host sync per layer in vLLM's eager steps",
    "vllm": "[Performance]: NVFP4 KV cache on SM90: one host sync per layer in every eager step (FlashInfer's "
            "scale check in the slot-mapping append)",
}


def host_sync_markdown(finding: HostSyncFinding) -> str:
    sections = _flashinfer(finding) if finding.project == "flashinfer" else _vllm(finding)
    text = "\n".join([f"<!-- kvtrace draft for {_repository(finding.project)}: the title is the bold line "
                      "below; each ### section is one field of its issue template -->", f"**{TITLES[finding.project]}**", "",
                      f"**In short:** {_answer(finding)}", "", *sections]).rstrip() + "\n"
    if len(text) > ISSUE_LIMIT:
        raise KvtraceError(f"the draft would hold {len(text):,} characters, past a GitHub issue body's "
                           f"{ISSUE_LIMIT:,}: its repro script is too long to inline; report this to kvtrace")
    return text


def _repository(project: str) -> str:
    return {"flashinfer": "flashinfer-ai/flashinfer", "vllm": "vllm-project/vllm"}[project]


def _answer(f: HostSyncFinding) -> str:
    step = f.worst_step
    loss = [t for t in f.ttft if t.verdict == Verdict.REGRESSION and not t.window_stall]
    ttft = (f"; NVFP4's TTFT against FP8's is {_ttft_words(loss[0])} at {md_code(loss[0].point)}" if loss else "")
    counterfactual = f.counterfactual
    timed = [f"{md_code(t.point)}: {_ttft_words(t)}" for t in counterfactual.against_nvfp4 if not t.window_stall]
    stalled = [md_code(t.point) for t in counterfactual.against_nvfp4 if t.window_stall]
    if stalled:
        timed.append(f"not comparable at {', '.join(stalled)} (a profile window closed inside their timed traffic)")
    with_patch = ("not measured yet (no arm with the check run once was recorded)"
                  if counterfactual.state == NOT_MEASURED else "; ".join(timed) or "measured, without TTFT")
    return (f"with vLLM's NVFP4 KV cache ({md_text(f.candidate)} against {md_text(f.baseline)}), each eager step "
            f"makes {_range(step.copies_low, step.copies_high)} device-to-host copies of "
            f"{_range(step.bytes_low, step.bytes_high)} bytes into pageable memory, one per layer, right before the "
            f"NVFP4 append kernel; each holds the host {step.host_mean_ms:.2f} ms on average ({step.host_per_step_ms:.1f} "
            f"ms per {md_text(step.phase)} step): it queues nothing while the stream drains, and the GPU then waits "
            f"for the next layer's launches (time with no kernel running per {md_text(step.phase)} step: "
            f"{step.idle_ms[0]:.2f} ms with FP8, {step.idle_ms[1]:.2f} ms with NVFP4){ttft}. The copies are FlashInfer's check of the scale tensors (`_as_float32_scalar_tensors`). "
            f"NVFP4's TTFT with the check once per scale tensor, against stock NVFP4: {with_patch}.")


def _range(low, high) -> str:
    return "?" if low is None else str(low) if low == high else f"{low}–{high}"


STALLED = "not comparable: a profile window closed inside the timed traffic, which holds the engine while nsys stops"


def _ttft_words(t: Ttft) -> str:
    if t.window_stall:
        return STALLED
    return f"{ratio(t.ratio)} {interval(t.low, t.high)} ({t.verdict}, {t.runs} run pair(s))"


def _environment(f: HostSyncFinding) -> list[str]:
    width = max(len(name) for name, _ in f.environment)
    lines = [f"{name:<{width}}  {value}" for name, value in f.environment]
    for split in f.kernel_level:
        lines.append(f"repro script ran with: flashinfer {split.flashinfer}, torch {split.torch}, {split.gpu} "
                     f"(SM{split.sm})")
    return ["```text", *(line.replace("```", "'''") for line in lines), "```", "",
            f"Source: {md_prose(f.environment_source)}."]


def _evidence(f: HostSyncFinding) -> list[str]:
    lines = [f"From the Nsight Systems traces of {md_code(f.run)} (`kvtrace report`, steps both arms ran, paired "
             "in order; intervals are 95%):", ""]
    lines += markdown_table(
        ["eager step", "paired steps", "copies per step", "bytes", "host time per copy (mean)", "per step",
         "kernel launched before", "step span NVFP4/FP8", "no kernel running per step, FP8 → NVFP4"],
        [[md_text(s.phase), str(s.steps), _range(s.copies_low, s.copies_high), _range(s.bytes_low, s.bytes_high),
          f"{s.host_mean_ms:.3f} ms", f"{s.host_per_step_ms:.2f} ms", md_text(s.before or "–"),
          f"{ratio(s.span_ratio)} {interval(s.span_low, s.span_high)}",
          f"{s.idle_ms[0]:.2f} → {s.idle_ms[1]:.2f} ms"] for s in f.steps])
    if f.ttft:
        lines += ["", "Time to first token, NVFP4 / FP8 (mean over requests, interval over requests and run pairs):", ""]
        lines += markdown_table(["traffic point", "NVFP4 / FP8", "interval", "verdict", "run pairs"],
                                [[md_code(t.point), "–", "–", STALLED, str(t.runs)] if t.window_stall else
                                 [md_code(t.point), ratio(t.ratio), interval(t.low, t.high), md_text(t.verdict),
                                  str(t.runs)] for t in f.ttft])
    lines += ["", *_counterfactual(f), "", *_kernel_level(f)]
    return lines


def _counterfactual(f: HostSyncFinding) -> list[str]:
    c = f.counterfactual
    if c.state == NOT_MEASURED:
        return [f"**With the check once per scale tensor:** {NOT_MEASURED}. The run directory holds no "
                f"{md_code(c.arm)} arm (recorded with `kvtrace capture vllm-matrix --arms "
                "fp8,nvfp4,nvfp4:validate-once`)."]
    lines = [f"**With the check once per scale tensor** (arm {md_code(c.arm)} of {md_code(c.run)}: the stock release "
             f"patched by {md_code(c.patch.get('name'))}, SHA-256 {md_code(c.patch.get('sha256'))}; not a stock "
             "release), time to first token:", ""]
    pairs = {t.point: t for t in c.against_fp8}
    lines += markdown_table(["traffic point", "patched / stock NVFP4", "patched NVFP4 / FP8"],
                            [[md_code(t.point), _ttft_words(t), _ttft_words(pairs[t.point]) if t.point in pairs else "–"]
                             for t in c.against_nvfp4])
    if c.copies_per_step:
        lines += ["", "Host waits per step (copies and synchronizations), stock NVFP4 → patched: " + "; ".join(
            f"{md_text(phase)} {_waits(stock)} → {_waits(patched)}" for phase, (stock, patched) in c.copies_per_step.items())
                  + "."]
    return lines


def _waits(value) -> str:
    """A mean over steps: whole where it is whole, else to two decimals (1 wait in 6 steps is 0.17, not 0.166667)."""
    return "not recorded" if value is None else f"{value:g}" if float(value).is_integer() else f"{value:.2f}"


def _kernel_level(f: HostSyncFinding) -> list[str]:
    if not f.kernel_level:
        return [f"**The call alone** (the repro below, per route): {NOT_MEASURED} yet; the script prints it."]
    lines = ["**The call alone** (the repro below; per call, median [10th, 90th percentile] of the timed calls; the "
             "host's time is spent inside the call, so a call that waits on the GPU shows it there):", ""]
    rows = []
    for split in f.kernel_level:
        for route in split.appends:
            rows.append([md_text(route.case), md_text(route.label), md_text(route.description),
                         f"{route.gpu_us[0]:.1f} [{route.gpu_us[1]:.1f}, {route.gpu_us[2]:.1f}] µs",
                         f"{route.host_us[0]:.1f} [{route.host_us[1]:.1f}, {route.host_us[2]:.1f}] µs",
                         md_text(f"FlashInfer {split.flashinfer}, {split.gpu}")])
    return lines + markdown_table(["case", "route", "call", "GPU", "host", "measured with"], rows)


def _script(f: HostSyncFinding) -> list[str]:
    if f.script is None:
        return [f"kvtrace could not write the repro from this run: {md_prose(f.script_note)}"]
    fence = code_fence(f.script)
    return ["A standalone script (torch, flashinfer and the standard library), with the traced steps' shapes; it "
            "times vLLM's call (scales as CUDA tensors), the same with the check once per tensor, and with Python "
            "floats, reporting GPU and host time per call. `python repro.py --json out.json`.", "",
            f"<details><summary>repro.py ({f.script.count(chr(10))} lines)</summary>", "", f"{fence}python",
            f.script.rstrip(), fence, "", "</details>"]


def _context(f: HostSyncFinding) -> list[str]:
    return [f"- {md_prose(line)}" for line in HISTORY] + [
        "- Drafted by kvtrace (`kvtrace report --upstream`) from the run's traces and manifests; every number above "
        "is recomputable from them."]


def _flashinfer(f: HostSyncFinding) -> list[str]:
    return ["### Environment", "", *_environment(f), "",
            "### Bug description", "",
            "`nvfp4_quantize_append_paged_kv_cache_with_slot_mapping` validates CUDA-tensor `k_scale`/`v_scale` on "
            "the host on every call outside CUDA graph capture: `_as_float32_scalar_tensors` stacks them and calls "
            "`.cpu()`, a device-to-host copy into pageable memory that waits until the stream has drained. vLLM 0.33 "
            "calls it once per layer with the layer's constant scale tensors, so every eager step (prefill, mixed) "
            "stalls the host once per layer. Expected: constant scales are validated once, or on the device, and "
            "the append launches without waiting.", "", *_evidence(f), "",
            "### Minimal reproduction", "", *_script(f), "",
            "### Error messages / logs", "",
            "No error: a performance problem. The trace's copies are `cudaMemcpyAsync` device-to-host of 8 bytes "
            "(the two float32 scales) into pageable memory, each right before the append kernel.", "",
            "### Additional context", "", *_context(f)]


def _vllm(f: HostSyncFinding) -> list[str]:
    return ["### Proposal to improve performance", "",
            "`FlashInferImpl.do_kv_cache_update` (NVFP4 on SM80/90/120) calls FlashInfer's "
            "`nvfp4_quantize_append_paged_kv_cache_with_slot_mapping` with `layer._k_scale` / `layer._v_scale`, "
            "tensors on the GPU. FlashInfer checks such scales on the host on every call outside CUDA graph capture, "
            "so each eager step waits once per layer. The scales are constant after loading: checking them once "
            "(in FlashInfer, per tensor, or in vLLM at load with an entry point that skips the per-call check) "
            "removes the wait. Passing Python floats is no cure as FlashInfer stands: it turns each into a CUDA tensor "
            "with torch's blocking host-to-device copy, which also waits for the stream (the repro times both).", "",
            "### Report of performance regression", "", *_evidence(f), "", *_script(f), "",
            "### Misc discussion on performance", "", *_context(f), "",
            "### Your current environment", "", *_environment(f)]
